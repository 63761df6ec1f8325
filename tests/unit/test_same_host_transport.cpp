// SameHostTransport in one process (sender and receivers as threads, each with its own
// HostBackend, as separate processes would have): broadcasts, the sender packing straight into
// the shared staging, a real Sender and Receiver with the oracle, and every bad input: token,
// directory, path, stale socket, a peer that breaks the protocol. tests/integration/
// test_same_host_processes.cpp runs it across processes.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <mutex>
#include <sys/mman.h>
#include <thread>

#include "backends/host/host_stream.h"
#include "deadline.h"
#include "fake_engine.h"
#include "pattern.h"
#include "shadowsync/error.h"
#include "shadowsync/host_backend.h"
#include "shadowsync/receiver.h"
#include "shadowsync/same_host_transport.h"
#include "shadowsync/token.h"
#include "shadowsync/sender.h"
#include "transports/same_host/same_host_auth.h"
#include "transports/same_host/same_host_frame.h"
#include "transports/same_host/same_host_memory_file.h"
#include "transports/same_host/same_host_socket.h"

using namespace shadowsync;
using namespace shadowsync::testing;

namespace {

const std::string kToken = "ssk1-efe31cd121235d6c8600c5dae229b11715c0e0aacc6adae5989808afa958a7d8";

// A fresh private directory per test, removed at the end.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    char name[] = "/tmp/shadowsync_same_host_XXXXXX";
    REQUIRE(::mkdtemp(name) != nullptr);
    path = name;
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::permissions(path, std::filesystem::perms::owner_all, ignored);
    std::filesystem::remove_all(path, ignored);
  }
  std::string socket() const { return (path / "sock").string(); }
};

SameHostConfig quick() {
  SameHostConfig config;
  config.connect_timeout = std::chrono::seconds(10);
  config.handshake_timeout = std::chrono::seconds(5);
  return config;
}

// A sender and `n` receivers, connected.
struct Pair {
  std::unique_ptr<HostBackend> sender_backend = std::make_unique<HostBackend>();
  std::vector<std::unique_ptr<HostBackend>> receiver_backends;
  std::unique_ptr<SameHostTransport> sender;
  std::vector<std::unique_ptr<SameHostTransport>> receivers;

  Pair(const std::string& path, int n, std::size_t slot_bytes) {
    std::vector<std::future<std::unique_ptr<SameHostTransport>>> futures;
    for (int r = 1; r <= n; ++r) {
      receiver_backends.push_back(std::make_unique<HostBackend>());
      HostBackend& backend = *receiver_backends.back();
      futures.push_back(std::async(std::launch::async, [&path, r, &backend] {
        return SameHostTransport::connect(path, kToken, r, backend, quick());
      }));
    }
    sender = SameHostTransport::serve(path, kToken, n, *sender_backend, SameHostMemory::kHost,
                                      slot_bytes, quick());
    for (auto& f : futures) receivers.push_back(f.get());
  }
};

std::vector<std::byte> pattern_bytes(std::size_t n, int seed) {
  std::vector<std::byte> out(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<std::byte>((i * 131 + seed) & 0xff);
  return out;
}

bool wait_event(Backend& backend, Event& event) {
  return backend.event_wait_for(event, std::chrono::seconds(10));
}

}  // namespace

TEST_CASE("same-host: broadcasts of many sizes reach every receiver, chunked through the slots") {
  TempDir dir;
  Pair pair(dir.socket(), 3, 1000);
  CHECK(pair.sender->world_size() == 4);
  CHECK(pair.receivers[2]->rank() == 3);
  CHECK_FALSE(std::filesystem::exists(dir.socket()));  // unlinked once everyone came

  auto sender_stream = pair.sender_backend->create_stream(StreamPriority::kNormal);
  std::vector<std::unique_ptr<Stream>> streams;
  for (auto& b : pair.receiver_backends) streams.push_back(b->create_stream(StreamPriority::kNormal));
  for (const std::size_t size : {std::size_t{1}, std::size_t{999}, std::size_t{1000},
                                 std::size_t{1001}, std::size_t{4500}, std::size_t{0}}) {
    CAPTURE(size);
    const auto source = pattern_bytes(size, static_cast<int>(size));
    std::vector<std::vector<std::byte>> targets(3, std::vector<std::byte>(size));
    for (int r = 0; r < 3; ++r) {
      pair.receivers[r]->broadcast_async(targets[r].data(), size, 0, *streams[r]);
    }
    pair.sender->broadcast_async(const_cast<std::byte*>(source.data()), size, 0, *sender_stream);
    for (int r = 0; r < 3; ++r) {
      auto done = pair.receiver_backends[r]->create_event();
      pair.receiver_backends[r]->event_record(*done, *streams[r]);
      REQUIRE(wait_event(*pair.receiver_backends[r], *done));
      CHECK(targets[r] == source);
    }
  }
  // Zero-copy: the sender packs into the shared slot and broadcasts from it.
  auto* slot = static_cast<std::byte*>(pair.sender->staging_buffer(1, 1000));
  REQUIRE(slot != nullptr);
  CHECK(pair.sender->staging_buffer(2, 10) == nullptr);
  CHECK(pair.sender->staging_buffer(0, 1001) == nullptr);
  CHECK(pair.receivers[0]->staging_buffer(0, 10) == nullptr);
  const auto source = pattern_bytes(700, 5);
  std::memcpy(slot, source.data(), source.size());
  std::vector<std::byte> target(700);
  pair.receivers[0]->broadcast_async(target.data(), 700, 0, *streams[0]);
  pair.receivers[1]->broadcast_async(target.data(), 0, 0, *streams[1]);  // placeholder
  CHECK_THROWS_WITH(pair.receivers[2]->broadcast_async(target.data(), 700, 1, *streams[2]),
                    Catch::Contains("root 1, but the sender is always rank 0"));
  CHECK(!pair.sender->async_error());
  pair.sender->abort();  // the size mismatch above would hang the others: end it here
  auto done = pair.receiver_backends[0]->create_event();
  pair.receiver_backends[0]->event_record(*done, *streams[0]);
  REQUIRE(wait_event(*pair.receiver_backends[0], *done));
}

TEST_CASE("same-host: a Sender and a Receiver move updates checked by the oracle") {
  TempDir dir;
  const Layout layout = Layout::build({{"embed", DType::kBFloat16, {300, 16}, "base"},
                                       {"w", DType::kFloat32, {513}, "base"},
                                       {"lora.A", DType::kBFloat16, {8, 16}, "lora"}},
                                      {.bucket_bytes = 2048});
  HostBackend engine_backend;
  HostBackend trainer_backend;
  auto connecting = std::async(std::launch::async, [&] {
    return SameHostTransport::connect(dir.socket(), kToken, 1, engine_backend, quick());
  });
  auto serving = SameHostTransport::serve(dir.socket(), kToken, 1, trainer_backend,
                                          SameHostMemory::kHost, layout.bucket_bytes(), quick());
  void* const shared_slot = serving->staging_buffer(0, layout.bucket_bytes());
  Receiver receiver(layout, engine_backend, connecting.get());
  Sender sender(layout, trainer_backend, std::move(serving));
  HostFakeEngine engine(engine_backend, receiver);
  UpdateHistory history;
  for (std::uint64_t v = 1; v <= 60; ++v) {
    const std::vector<std::string> groups = v % 3 == 0   ? std::vector<std::string>{"lora"}
                                            : v % 3 == 1 ? std::vector<std::string>{"base"}
                                                         : std::vector<std::string>{"base", "lora"};
    HostTensors tensors(layout, groups, v);
    PublishHandle handle = sender.publish(v, groups, tensors.sources());
    history.add(v, {handle.header().groups.begin(), handle.header().groups.end()});
    receiver.begin_update(handle.header());
    engine.step();
    try {
      handle.wait();
    } catch (...) {
      wait_until([&] { return receiver.stats().updates_failed > 0; }, "the receiver's report");
      FAIL("receiver: " << receiver.stats().last_error);
    }
    REQUIRE(receiver.step_hook().wait_applied(v, deadline_from_now(), engine.stream()));
    engine.step();
  }
  engine.synchronize();
  CHECK(engine.torn_steps() == 0);
  CHECK(history.check(engine.records()).empty());
  CHECK(receiver.stats().updates_ready == 60);
  CHECK(shared_slot != nullptr);
}

TEST_CASE("same-host: a wrong token is refused on both sides before any memory is shared") {
  TempDir dir;
  HostBackend a;
  HostBackend b;
  SameHostConfig config = quick();
  config.connect_timeout = std::chrono::milliseconds(1500);
  auto connecting = std::async(std::launch::async, [&] {
    return SameHostTransport::connect(dir.socket(), "ssk1-4e217b3e708068e355dd91215ccb2ea999ee8d7530f4fd84340f63a34056aa56", 1, b,
                                      config);
  });
  CHECK_THROWS_WITH(SameHostTransport::serve(dir.socket(), kToken, 1, a, SameHostMemory::kHost,
                                             64, config),
                    Catch::Contains("0 of 1 receivers connected") &&
                        Catch::Contains("wrong token"));
  CHECK_THROWS_WITH(connecting.get(), Catch::Contains("the sender refused") &&
                                          Catch::Contains("wrong token"));
  CHECK_THROWS_WITH(SameHostTransport::serve(dir.socket(), "short", 1, a, SameHostMemory::kHost,
                                             64, config),
                    Catch::Contains("it has 5 bytes, fewer than the 16 required"));
}

TEST_CASE("same-host: a sender that cannot prove the token gets nothing from the receiver") {
  TempDir dir;
  HostBackend b;
  same_host::Fd listener = same_host::listen_on(dir.socket(), 4);
  auto connecting = std::async(std::launch::async, [&] {
    return SameHostTransport::connect(dir.socket(), kToken, 1, b, quick());
  });
  same_host::Fd peer(::accept(listener.get(), nullptr, nullptr));
  REQUIRE(peer);
  const auto deadline = same_host::Clock::now() + std::chrono::seconds(5);
  REQUIRE(same_host::write_all(peer.get(), same_host::encode(same_host::Challenge{}), -1,
                               deadline) == same_host::Io::kOk);
  std::array<std::byte, 80> proof{};
  REQUIRE(same_host::read_exact(peer.get(), proof, -1, deadline) == same_host::Io::kOk);
  // An impostor: accepts without knowing the token.
  REQUIRE(same_host::write_all(peer.get(), same_host::encode(same_host::Accept{}), -1, deadline) ==
          same_host::Io::kOk);
  CHECK_THROWS_WITH(connecting.get(), Catch::Contains("could not prove the token"));
  ::unlink(dir.socket().c_str());
}

TEST_CASE("same-host: directories and paths that are not ours are refused") {
  TempDir dir;
  HostBackend backend;
  SECTION("a directory others can open") {
    const auto open_dir = dir.path / "open";
    std::filesystem::create_directory(open_dir);
    ::chmod(open_dir.c_str(), 0755);
    CHECK_THROWS_WITH(SameHostTransport::serve((open_dir / "sock").string(), kToken, 1, backend,
                                               SameHostMemory::kHost, 64, quick()),
                      Catch::Contains("has mode 0755") && Catch::Contains("must be private"));
    CHECK_THROWS_WITH(SameHostTransport::connect((open_dir / "sock").string(), kToken, 1, backend,
                                                 quick()),
                      Catch::Contains("has mode 0755"));
  }
  SECTION("a private directory in a parent others can rename it in") {
    const auto shared = dir.path / "shared";
    std::filesystem::create_directory(shared);
    ::chmod(shared.c_str(), 0777);  // no sticky bit: anyone may rename 'private' away
    const auto private_dir = shared / "private";
    std::filesystem::create_directory(private_dir);
    ::chmod(private_dir.c_str(), 0700);
    CHECK_THROWS_WITH(SameHostTransport::serve((private_dir / "sock").string(), kToken, 1,
                                               backend, SameHostMemory::kHost, 64, quick()),
                      Catch::Contains("(mode 0777, owner uid") &&
                          Catch::Contains("where other users could rename it"));
    CHECK_THROWS_WITH(SameHostTransport::connect((private_dir / "sock").string(), kToken, 1,
                                                 backend, quick()),
                      Catch::Contains("where other users could rename it"));
    ::chmod(shared.c_str(), 01777);  // sticky, as /tmp: only the owner may rename
    SameHostConfig config = quick();
    config.connect_timeout = std::chrono::milliseconds(20);
    CHECK_THROWS_WITH(SameHostTransport::connect((private_dir / "sock").string(), kToken, 1,
                                                 backend, config),
                      Catch::Contains("no sender listened"));
  }
  SECTION("a symbolic link as the directory") {
    std::filesystem::create_directory_symlink(dir.path, dir.path / "link");
    CHECK_THROWS_WITH(SameHostTransport::serve((dir.path / "link" / "sock").string(), kToken, 1,
                                               backend, SameHostMemory::kHost, 64, quick()),
                      Catch::Contains("symbolic link"));
  }
  SECTION("an absent directory is created private") {
    const auto fresh = dir.path / "fresh";
    SameHostConfig config = quick();
    config.connect_timeout = std::chrono::milliseconds(50);
    CHECK_THROWS_AS(SameHostTransport::serve((fresh / "sock").string(), kToken, 1, backend,
                                             SameHostMemory::kHost, 64, config),
                    Error);
    struct stat st {};
    REQUIRE(::stat(fresh.c_str(), &st) == 0);
    CHECK((st.st_mode & 0777) == 0700);
    CHECK_FALSE(std::filesystem::exists(fresh / "sock"));  // the timed-out sender cleaned up
  }
  SECTION("a path that is a regular file") {
    { std::ofstream(dir.socket()) << "x"; }
    CHECK_THROWS_WITH(SameHostTransport::serve(dir.socket(), kToken, 1, backend,
                                               SameHostMemory::kHost, 64, quick()),
                      Catch::Contains("exists and is not a socket"));
    CHECK(std::filesystem::is_regular_file(dir.socket()));  // untouched
  }
  SECTION("a socket another sender listens on") {
    same_host::Fd live = same_host::listen_on(dir.socket(), 1);
    CHECK_THROWS_WITH(SameHostTransport::serve(dir.socket(), kToken, 1, backend,
                                               SameHostMemory::kHost, 64, quick()),
                      Catch::Contains("in use"));
  }
  SECTION("the device flavour without a CudaBackend (or without CUDA in the build)") {
    CHECK_THROWS_WITH(SameHostTransport::serve(dir.socket(), kToken, 1, backend,
                                               SameHostMemory::kDevice, 64, quick()),
                      Catch::Contains("CudaBackend"));
    CHECK_FALSE(std::filesystem::exists(dir.socket()));  // refused before anything was made
  }
}

TEST_CASE("same-host: a receiver sends nothing to a listener of another user") {
  if (::geteuid() != 0) {
    WARN("skipped: only root can listen as another user here (the check runs as any user)");
    return;
  }
  TempDir dir;
  // A child binds the socket in the private directory, becomes another user and listens: what
  // a user who swapped the directory would present. SO_PEERCRED gives the uid of listen().
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::close(ready[0]);
    same_host::Fd fd(::socket(AF_UNIX, SOCK_STREAM, 0));
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::strncpy(address.sun_path, dir.socket().c_str(), sizeof(address.sun_path) - 1);
    const bool ok = fd && ::bind(fd.get(), reinterpret_cast<const sockaddr*>(&address),
                                 sizeof(address)) == 0 &&
                    ::setgid(65534) == 0 && ::setuid(65534) == 0 && ::listen(fd.get(), 4) == 0;
    const char byte = ok ? '1' : '0';
    if (::write(ready[1], &byte, 1) != 1) ::_exit(2);
    ::pause();  // until the test kills it
    ::_exit(0);
  }
  ::close(ready[1]);
  char byte = 0;
  REQUIRE(::read(ready[0], &byte, 1) == 1);
  ::close(ready[0]);
  REQUIRE(byte == '1');
  HostBackend backend;
  CHECK_THROWS_WITH(SameHostTransport::connect(dir.socket(), kToken, 1, backend, quick()),
                    Catch::Contains("runs as uid 65534, not this user (uid 0)") &&
                        Catch::Contains("nothing was sent to it"));
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
}

TEST_CASE("same-host: a stale socket file of a dead sender is replaced") {
  TempDir dir;
  { same_host::Fd dead = same_host::listen_on(dir.socket(), 1); }  // closed, file left behind
  REQUIRE(std::filesystem::is_socket(dir.socket()));
  Pair pair(dir.socket(), 1, 64);
  CHECK(pair.sender->world_size() == 2);
}

namespace {

// Plays the sender's side of the handshake with a real token, then hands the socket to the test.
struct FakeSender {
  same_host::Fd listener;
  same_host::Fd peer;
  same_host::Fd memory_file;

  FakeSender(const std::string& path, std::size_t announced_slot_bytes, std::size_t file_bytes,
             bool pass_fd) {
    listener = same_host::listen_on(path, 1);
    peer = same_host::Fd(::accept(listener.get(), nullptr, nullptr));
    REQUIRE(peer);
    const auto deadline = same_host::Clock::now() + std::chrono::seconds(5);
    const same_host::Nonce nonce = same_host::make_nonce();
    REQUIRE(same_host::write_all(peer.get(), same_host::encode(same_host::Challenge{nonce}), -1,
                                 deadline) == same_host::Io::kOk);
    std::array<std::byte, 80> record{};
    REQUIRE(same_host::read_exact(peer.get(), record, -1, deadline) == same_host::Io::kOk);
    same_host::Proof proof;
    std::string error;
    REQUIRE(same_host::decode(record, proof, error));
    const same_host::Accept accept{
        same_host::sender_proof(kToken, nonce, proof.receiver_nonce, proof.rank)};
    REQUIRE(same_host::write_all(peer.get(), same_host::encode(accept), -1, deadline) ==
            same_host::Io::kOk);
    std::array<std::byte, 8> ready{};
    REQUIRE(same_host::read_exact(peer.get(), ready, -1, deadline) == same_host::Io::kOk);
    same_host::Setup setup;
    setup.world_size = 2;
    setup.slot_bytes = announced_slot_bytes;
    // Sealed as a real sender seals it: what is tested here is what comes after.
    memory_file = same_host::Fd(::memfd_create("fake", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    REQUIRE(::ftruncate(memory_file.get(), static_cast<off_t>(file_bytes)) == 0);
    REQUIRE(::fcntl(memory_file.get(), F_ADD_SEALS,
                    F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE) == 0);
    if (pass_fd) {
      REQUIRE(same_host::write_with_fd(peer.get(), same_host::encode(setup), memory_file.get(),
                                       deadline) == same_host::Io::kOk);
    } else {
      REQUIRE(same_host::write_all(peer.get(), same_host::encode(setup), -1, deadline) ==
              same_host::Io::kOk);
    }
    ::unlink(path.c_str());
  }
  void send_raw(std::span<const std::byte> bytes) {
    REQUIRE(same_host::write_all(peer.get(), bytes, -1, std::nullopt) == same_host::Io::kOk);
  }
};

}  // namespace

TEST_CASE("same-host: a sender that breaks the protocol writes nothing into the receiver") {
  TempDir dir;
  HostBackend backend;
  auto connecting = std::async(std::launch::async, [&] {
    return SameHostTransport::connect(dir.socket(), kToken, 1, backend, quick());
  });
  FakeSender fake(dir.socket(), 256, 512, true);
  auto transport = connecting.get();
  auto stream = backend.create_stream(StreamPriority::kNormal);
  std::vector<std::byte> target(100, std::byte{0x5a});
  const std::vector<std::byte> before = target;
  transport->broadcast_async(target.data(), target.size(), 0, *stream);

  std::string expected;
  SECTION("a slot outside the staging memory") {
    fake.send_raw(same_host::encode(same_host::DataRecord{same_host::RecordType::kDoorbell, 0, 5,
                                                          0, 100}));
    expected = "slot 5 is outside";
  }
  SECTION("a byte range past the slot") {
    fake.send_raw(same_host::encode(same_host::DataRecord{same_host::RecordType::kDoorbell, 0, 1,
                                                          200, 100}));
    expected = "outside its 256 bytes";
  }
  SECTION("a sequence that was not announced") {
    fake.send_raw(same_host::encode(same_host::DataRecord{same_host::RecordType::kDoorbell, 7, 0,
                                                          0, 100}));
    expected = "chunk 7 where chunk 0 was expected";
  }
  SECTION("a byte count of another collective") {
    fake.send_raw(same_host::encode(same_host::DataRecord{same_host::RecordType::kDoorbell, 0, 0,
                                                          0, 50}));
    expected = "mismatched collective";
  }
  SECTION("garbage") {
    std::array<std::byte, 40> garbage{};
    garbage.fill(std::byte{0xee});
    fake.send_raw(garbage);
    expected = "not a shadowsync same-host peer";
  }
  SECTION("the sender's socket closes mid-update") {
    fake.peer.reset();
    expected = "closed its socket";
  }
  auto done = backend.create_event();
  backend.event_record(*done, *stream);
  REQUIRE(wait_event(backend, *done));
  REQUIRE(transport->async_error());
  CHECK_THAT(*transport->async_error(), Catch::Contains(expected));
  CHECK(target == before);
  // Later calls complete at once: the ranks are out of step.
  transport->broadcast_async(target.data(), target.size(), 0, *stream);
  backend.event_record(*done, *stream);
  REQUIRE(wait_event(backend, *done));
  CHECK(target == before);
}

TEST_CASE("same-host: a receiver that cannot map the staging memory says what it tried") {
  TempDir dir;
  HostBackend backend;
  SECTION("a memory file smaller than announced") {
    auto connecting = std::async(std::launch::async, [&] {
      return SameHostTransport::connect(dir.socket(), kToken, 1, backend, quick());
    });
    FakeSender fake(dir.socket(), 4096, 100, true);
    CHECK_THROWS_WITH(connecting.get(), Catch::Contains("holds 100 bytes") &&
                                            Catch::Contains("2 slots of 4096 bytes"));
  }
  SECTION("no descriptor at all") {
    auto connecting = std::async(std::launch::async, [&] {
      return SameHostTransport::connect(dir.socket(), kToken, 1, backend, quick());
    });
    FakeSender fake(dir.socket(), 64, 128, false);
    CHECK_THROWS_WITH(connecting.get(), Catch::Contains("no memory file descriptor"));
  }
}

TEST_CASE("same-host: abort releases a receive waiting for a sender that never rings") {
  TempDir dir;
  Pair pair(dir.socket(), 2, 128);
  std::vector<std::unique_ptr<Stream>> streams;
  for (auto& b : pair.receiver_backends) streams.push_back(b->create_stream(StreamPriority::kNormal));
  std::vector<std::byte> target(64);
  pair.receivers[0]->broadcast_async(target.data(), 64, 0, *streams[0]);
  pair.receivers[1]->broadcast_async(target.data(), 64, 0, *streams[1]);
  auto done = pair.receiver_backends[0]->create_event();
  pair.receiver_backends[0]->event_record(*done, *streams[0]);
  CHECK_FALSE(pair.receiver_backends[0]->event_wait_for(*done, std::chrono::milliseconds(20)));
  pair.receivers[0]->abort();
  REQUIRE(wait_event(*pair.receiver_backends[0], *done));
  CHECK_THAT(*pair.receivers[0]->async_error(), Catch::Contains("aborted by rank 1"));
  // The sender sees rank 1 go (its socket was shut down) at its next broadcast.
  auto sender_stream = pair.sender_backend->create_stream(StreamPriority::kNormal);
  pair.sender->broadcast_async(target.data(), 64, 0, *sender_stream);
  auto sent = pair.sender_backend->create_event();
  pair.sender_backend->event_record(*sent, *sender_stream);
  REQUIRE(wait_event(*pair.sender_backend, *sent));
  REQUIRE(pair.sender->async_error());
  CHECK_THAT(*pair.sender->async_error(), Catch::Contains("rank 1"));
  pair.receivers[1]->abort();
}

namespace {

// Holds a HostStream: a task enqueued before the work to hold back waits until open() (or, should
// the test fail before it opens, a deadline, so that the stream can always be drained).
class Gate {
 public:
  void hold(Stream& stream) {
    host::HostStream* host_stream = host::as_host_stream(stream);
    REQUIRE(host_stream != nullptr);
    host_stream->enqueue([this] {
      std::unique_lock lock(mutex_);
      entered_ = true;
      changed_.notify_all();
      changed_.wait_for(lock, std::chrono::seconds(30), [this] { return open_; });
    });
  }
  // True once the stream reached the gate: everything enqueued behind it is now held.
  bool wait_entered(std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    return changed_.wait_for(lock, timeout, [this] { return entered_; });
  }
  void open() {
    {
      std::lock_guard lock(mutex_);
      open_ = true;
    }
    changed_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  bool entered_ = false;
  bool open_ = false;
};

// Distinct bytes per chunk: the chunks that share a slot (k and k + 2) differ everywhere a
// reused slot could show.
std::vector<std::byte> chunk_distinct_bytes(std::size_t n) {
  std::vector<std::byte> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    std::uint64_t x = (i + 1) * 0x9e3779b97f4a7c15ull;
    x ^= x >> 29;
    out[i] = static_cast<std::byte>((x * 0xbf58476d1ce4e5b9ull) >> 56);
  }
  return out;
}

}  // namespace

// The ack-wait rule: the sender writes a staging slot again only after every receiver acked the
// chunk it held. A receiver whose stream is held cannot ack chunk 0, so the sender's broadcast of
// six chunks cannot complete (it may ring chunk 0 and nothing more); a sender that did not wait
// for acks would write chunks 2 and 4 over chunk 0 in slot 0 and finish at once, and the held
// receiver would copy the wrong bytes once released.
TEST_CASE("same-host: the sender reuses a staging slot only after every receiver acked it") {
  TempDir dir;
  constexpr std::size_t kSlot = 256;
  constexpr std::size_t kBytes = 5 * kSlot + 17;  // 6 chunks: slot 0 holds chunks 0, 2, 4
  Pair pair(dir.socket(), 2, kSlot);
  auto sender_stream = pair.sender_backend->create_stream(StreamPriority::kNormal);
  std::vector<std::unique_ptr<Stream>> streams;
  for (auto& b : pair.receiver_backends)
    streams.push_back(b->create_stream(StreamPriority::kNormal));
  Gate gate;
  // On any way out: release the held stream and end every wait, so that no stream blocks its
  // destructor.
  struct Release {
    Gate& gate;
    Pair& pair;
    ~Release() {
      gate.open();
      pair.sender->abort();
      for (auto& r : pair.receivers) r->abort();
    }
  } release{gate, pair};

  const auto source = chunk_distinct_bytes(kBytes);
  for (std::size_t k = 2; k * kSlot < kBytes; ++k) {  // precondition: reuse would show
    const std::size_t n = std::min(kSlot, kBytes - k * kSlot);
    REQUIRE(std::memcmp(source.data() + k * kSlot, source.data() + (k - 2) * kSlot, n) != 0);
  }
  std::vector<std::vector<std::byte>> targets(2, std::vector<std::byte>(kBytes, std::byte{0}));

  // Rank 1 is slow: its stream is held before its receive.
  gate.hold(*streams[0]);
  REQUIRE(gate.wait_entered(std::chrono::seconds(10)));
  std::vector<std::unique_ptr<Event>> received;
  for (int r = 0; r < 2; ++r) {
    pair.receivers[r]->broadcast_async(targets[r].data(), kBytes, 0, *streams[r]);
    received.push_back(pair.receiver_backends[r]->create_event());
    pair.receiver_backends[r]->event_record(*received.back(), *streams[r]);
  }
  pair.sender->broadcast_async(const_cast<std::byte*>(source.data()), kBytes, 0, *sender_stream);
  auto sent = pair.sender_backend->create_event();
  pair.sender_backend->event_record(*sent, *sender_stream);

  // Cannot happen while rank 1 is held (it has acked nothing); the wait only gives a sender that
  // skips the acks time to be caught.
  CHECK_FALSE(pair.sender_backend->event_wait_for(*sent, std::chrono::milliseconds(200)));
  CHECK_FALSE(pair.receiver_backends[1]->event_query(*received[1]));  // held behind rank 1's ack
  gate.open();
  REQUIRE(wait_event(*pair.sender_backend, *sent));
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r + 1);
    REQUIRE(wait_event(*pair.receiver_backends[r], *received[r]));
    CHECK(targets[r] == source);
    CHECK_FALSE(pair.receivers[r]->async_error());
  }
  CHECK_FALSE(pair.sender->async_error());

  // The ranks are still in step: acks and doorbells were consumed one for one.
  const auto next = pattern_bytes(kSlot + 1, 9);
  std::vector<std::vector<std::byte>> next_targets(2, std::vector<std::byte>(next.size()));
  for (int r = 0; r < 2; ++r) {
    pair.receivers[r]->broadcast_async(next_targets[r].data(), next.size(), 0, *streams[r]);
    pair.receiver_backends[r]->event_record(*received[r], *streams[r]);
  }
  pair.sender->broadcast_async(const_cast<std::byte*>(next.data()), next.size(), 0, *sender_stream);
  pair.sender_backend->event_record(*sent, *sender_stream);
  REQUIRE(wait_event(*pair.sender_backend, *sent));
  for (int r = 0; r < 2; ++r) {
    REQUIRE(wait_event(*pair.receiver_backends[r], *received[r]));
    CHECK(next_targets[r] == next);
  }
  CHECK_FALSE(pair.sender->async_error());
}

TEST_CASE("tokens: made ones are accepted, plainly non-random ones refused with how to make one") {
  const std::string made = make_token();
  CHECK(made.size() == kTokenPrefix.size() + 64);
  CHECK(made.starts_with(kTokenPrefix));
  CHECK_FALSE(token_weakness(made).has_value());
  CHECK(make_token() != made);
  CHECK_FALSE(token_weakness(kToken).has_value());
  // The weak ones found by probing: one character, a word and a count, sixteen zeros.
  CHECK(token_weakness("aaaaaaaaaaaaaaaa").value() ==
        "it holds a run of 8 equal characters (such as 'aaaaaaaa')");
  CHECK_THAT(token_weakness("pass-word12345678").value(),
             Catch::Contains("a run of 8 consecutive characters"));
  CHECK_THAT(token_weakness("password12345678").value(),
             Catch::Contains("a run of 8 consecutive characters"));
  CHECK_THAT(token_weakness("Password-9f3c2a7e").value(),
             Catch::Contains("a common password word"));
  // The reason describes the token, never quotes it.
  CHECK(token_weakness("zzzzzzzzq1w2e3r4").value().find("zzzz") == std::string::npos);
  CHECK_THAT(token_weakness("Secret-is-long-enough").value(),
             Catch::Contains("a common password word"));
  CHECK_THAT(token_weakness(std::string(16, '0')).value(), Catch::Contains("run of 8 equal"));
  CHECK_THAT(token_weakness("abababababababab").value(), Catch::Contains("about 16 bits"));
  CHECK_THAT(token_weakness("short").value(), Catch::Contains("it has 5 bytes"));
  CHECK_THAT(token_weakness("ssk1-0000").value(), Catch::Contains("64 lowercase hex digits"));
  CHECK_THAT(token_weakness(std::string(kTokenPrefix) + std::string(32, 'a') + std::string(32, 'b'))
                 .value(),
             Catch::Contains("not random"));
  // Where a token is taken, the refusal says how to make one; nothing is created.
  TempDir dir;
  HostBackend backend;
  CHECK_THROWS_WITH(SameHostTransport::serve(dir.socket(), "password12345678", 1, backend,
                                             SameHostMemory::kHost, 64, quick()),
                    Catch::Contains("the same-host token is too weak to be a shared secret") &&
                        Catch::Contains("shadowsync.make_token()"));
  CHECK_FALSE(std::filesystem::exists(dir.socket()));
}

TEST_CASE("same-host: the staging memory is sealed: no receiver maps it writable, no one resizes "
          "it") {
  const std::size_t bytes = 2 * 4096;
  void* mapped = nullptr;
  same_host::Fd fd = same_host::make_sealed_staging(bytes, &mapped);
  static_cast<unsigned char*>(mapped)[0] = 7;  // the sender's own mapping stays writable
  CHECK_NOTHROW(same_host::check_staging_seals(fd.get(), "sock"));
  // What a receiver (or anyone holding the descriptor) can no longer do:
  errno = 0;
  CHECK(::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0) == MAP_FAILED);
  CHECK(errno == EPERM);
  void* reading = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd.get(), 0);
  REQUIRE(reading != MAP_FAILED);
  CHECK(static_cast<unsigned char*>(reading)[0] == 7);
  CHECK(::ftruncate(fd.get(), 4096) != 0);  // shrinking it under a mapping: SIGBUS on a read
  CHECK(::ftruncate(fd.get(), 4 * 4096) != 0);
  ::munmap(reading, bytes);
  ::munmap(mapped, bytes);

  // A sender that shares an unsealed file is refused by the receiver, the seals named.
  same_host::Fd plain(::memfd_create("unsealed", MFD_CLOEXEC));
  REQUIRE(plain);
  REQUIRE(::ftruncate(plain.get(), static_cast<off_t>(bytes)) == 0);
  CHECK_THROWS_WITH(same_host::check_staging_seals(plain.get(), "sock"),
                    Catch::Contains("not sealed (F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_FUTURE_WRITE "
                                    "missing)"));
}
