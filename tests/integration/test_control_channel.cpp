// The control channel in one process: an EngineChannel on a real Receiver, and either a
// TrainerChannel or a raw socket that speaks (or breaks) the protocol by hand. Covers the happy
// path with a loopback transport, authentication failures (wrong token, no token, replayed
// handshake, replayed frame), malformed and truncated frames, silent peers, the pending-connection
// cap, trainer replacement, and 1,000 connect/disconnect cycles without fd or thread growth.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>
#include <catch2/catch.hpp>

#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <future>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "control/control_auth.h"
#include "control/control_frame.h"
#include "control/control_socket.h"
#include "deadline.h"
#include "pattern.h"
#include "shadowsync/control_channel.h"
#include "shadowsync/host_backend.h"
#include "shadowsync/loopback_transport.h"
#include "shadowsync/receiver.h"
#include "shadowsync/same_host_transport.h"
#include "shadowsync/sender.h"

using namespace shadowsync;
using shadowsync::testing::deadline_from_now;
using shadowsync::testing::wait_until;
using Clock = std::chrono::steady_clock;

namespace {

const std::string kToken = "ssk1-25dd3db5c9cefddb744a2175b1dc872d32dc42344bd60b57a8036aaa30ee2c93";

Layout test_layout() {
  return Layout::build({{"w1", DType::kFloat32, {1000}, "base"},
                        {"w2", DType::kFloat32, {300}, "base"},
                        {"a", DType::kBFloat16, {64}, "lora"}},
                       {.bucket_bytes = 1024});
}

std::size_t count_entries(const char* dir) {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator(dir)) ++n;
  return n;
}
std::size_t thread_count() { return count_entries("/proc/self/task"); }
std::size_t fd_count() { return count_entries("/proc/self/fd"); }

// Collects the channel's log lines (and keeps the test output quiet).
class LogCapture {
 public:
  std::function<void(std::string_view)> sink() {
    return [this](std::string_view line) {
      std::lock_guard lock(mutex_);
      lines_.emplace_back(line);
    };
  }
  std::size_t count(std::string_view needle) const {
    std::lock_guard lock(mutex_);
    std::size_t n = 0;
    for (const auto& line : lines_) n += line.find(needle) != std::string::npos ? 1 : 0;
    return n;
  }
  std::string all() const {
    std::lock_guard lock(mutex_);
    std::string text;
    for (const auto& line : lines_) text += line + "\n";
    return text;
  }

 private:
  mutable std::mutex mutex_;
  std::vector<std::string> lines_;
};

ControlConfig control_config(LogCapture& log, std::string token = kToken) {
  ControlConfig config;
  config.token = std::move(token);
  config.log = log.sink();
  config.handshake_timeout = std::chrono::seconds(10);
  return config;
}

// An engine: a receiver with no transport yet, and its control channel. The transport factory
// hands out rank `request.rank` of whatever loopback communicator the test set last.
struct Engine {
  explicit Engine(const Layout& layout, LogCapture& log,
                  std::function<void(EngineChannelConfig&)> tweak = {})
      : receiver(layout, backend, nullptr), channel(receiver, factory(), config(log, tweak)) {}

  static EngineChannelConfig config(LogCapture& log,
                                    const std::function<void(EngineChannelConfig&)>& tweak) {
    EngineChannelConfig config;
    config.control = control_config(log);
    config.rank = 1;
    if (tweak) tweak(config);
    return config;
  }
  TransportFactory factory() {
    return [this](const RendezvousRequest& request) {
      std::lock_guard lock(mutex);
      if (!communicator) throw Error(ErrorCode::kTransport, "no communicator set by the test");
      return communicator->transport(request.rank);
    };
  }
  void set_communicator(std::shared_ptr<LoopbackCommunicator> c) {
    std::lock_guard lock(mutex);
    communicator = std::move(c);
  }
  void wait_closed(const char* what) {
    wait_until([&] { return channel.stats().connections_open == 0; }, what);
  }

  HostBackend backend;
  std::mutex mutex;
  std::shared_ptr<LoopbackCommunicator> communicator;
  Receiver receiver;
  EngineChannel channel;
};

TrainerChannelConfig trainer_config(LogCapture& log, std::uint16_t port,
                                    std::string token = kToken) {
  TrainerChannelConfig config;
  config.control = control_config(log, std::move(token));
  config.engines.push_back({"127.0.0.1", port});
  return config;
}

// A TCP peer that writes whatever bytes the test gives it.
class RawPeer {
 public:
  explicit RawPeer(std::uint16_t port) : fd_(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    address.sin_port = htons(port);
    REQUIRE(::connect(fd_.get(), reinterpret_cast<sockaddr*>(&address), sizeof address) == 0);
  }
  void send(std::span<const std::byte> bytes) {
    // The engine may have closed already: a failed write is not the test's concern.
    [[maybe_unused]] const ssize_t n = ::send(fd_.get(), bytes.data(), bytes.size(), MSG_NOSIGNAL);
  }
  // One whole frame (header and body); throws at EOF or the deadline.
  std::vector<std::byte> read_frame() {
    std::vector<std::byte> frame(kFrameHeaderBytes);
    read_exact(frame.data(), kFrameHeaderBytes);
    FrameHeader header;
    if (auto error = parse_frame_header(frame, header)) FAIL(*error);
    frame.resize(kFrameHeaderBytes + header.body_bytes);
    read_exact(frame.data() + kFrameHeaderBytes, header.body_bytes);
    return frame;
  }
  // True once the engine closed the connection (whatever it sent before is discarded).
  bool closed_by_engine(std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    const auto deadline = Clock::now() + timeout;
    std::byte sink[4096];
    while (control::wait_fd(fd_.get(), POLLIN, deadline)) {
      const ssize_t n = ::recv(fd_.get(), sink, sizeof sink, 0);
      if (n <= 0) return true;
    }
    return false;
  }

 private:
  void read_exact(std::byte* out, std::size_t bytes) {
    const auto deadline = deadline_from_now();
    while (bytes > 0) {
      if (!control::wait_fd(fd_.get(), POLLIN, deadline)) throw std::runtime_error("read timeout");
      const ssize_t n = ::recv(fd_.get(), out, bytes, 0);
      if (n <= 0) throw std::runtime_error("the engine closed the connection");
      out += n;
      bytes -= static_cast<std::size_t>(n);
    }
  }
  control::Fd fd_;
};

// A trainer's side of the handshake done by hand; records every byte it sends.
struct RawSession {
  control::SessionKeys keys;
  std::uint64_t sequence = 0;
  std::vector<std::byte> sent;

  void send_raw(RawPeer& peer, std::vector<std::byte> frame) {
    sent.insert(sent.end(), frame.begin(), frame.end());
    peer.send(frame);
  }
  void send_tagged(RawPeer& peer, const ControlMessage& message) {
    send_raw(peer, tagged(message));
  }
  std::vector<std::byte> tagged(const ControlMessage& message) {
    std::vector<std::byte> frame = encode_frame(message);
    const ControlMac tag = control::frame_tag(keys.trainer_to_engine, sequence++, frame);
    frame.insert(frame.end(), tag.begin(), tag.end());
    return frame;
  }
};

TrainerHelloMessage hello_for(const Layout& layout) {
  TrainerHelloMessage hello;
  hello.layout_fingerprint = layout.fingerprint();
  for (const auto& group : layout.groups())
    hello.groups.push_back({group.name(), group.bucket_count()});
  return hello;
}

// With `hello`, the peer becomes the engine's trainer (and replaces the one connected); without,
// it is authenticated but not yet the trainer.
RawSession raw_handshake(RawPeer& peer, const Layout& layout, bool hello = true) {
  const std::string& token = kToken;
  RawSession session;
  const std::vector<std::byte> challenge = peer.read_frame();
  REQUIRE(challenge.size() == kFrameHeaderBytes + kControlNonceBytes);
  ControlNonce engine_nonce;
  std::memcpy(engine_nonce.data(), challenge.data() + kFrameHeaderBytes, engine_nonce.size());
  const ControlNonce trainer_nonce = control::make_nonce();
  session.send_raw(peer,
                   encode_frame(ClientProofMessage{
                       trainer_nonce, control::trainer_proof(token, engine_nonce, trainer_nonce)}));
  peer.read_frame();  // the engine's proof (TrainerChannel checks it; not this test's subject)
  session.keys = control::derive_session_keys(token, engine_nonce, trainer_nonce);
  peer.read_frame();  // the engine's hello
  if (hello) session.send_tagged(peer, hello_for(layout));
  return session;
}

}  // namespace

TEST_CASE("a trainer connects, hands over the rendezvous, and every update is acked") {
  const Layout layout = test_layout();
  LogCapture log;
  Engine engine(layout, log);
  TrainerChannel trainer(layout, trainer_config(log, engine.channel.port()));
  REQUIRE(trainer.engines().size() == 1);
  CHECK(trainer.engines()[0].rank == 1);
  CHECK(trainer.engines()[0].connected);
  wait_until([&] { return engine.channel.stats().trainer_connected; }, "trainer authenticated");

  auto communicator = std::make_shared<LoopbackCommunicator>(2);
  engine.set_communicator(communicator);
  trainer.send_rendezvous(RendezvousId{});
  REQUIRE(trainer.wait_rendezvous(deadline_from_now()));
  Sender sender(layout, engine.backend, communicator->transport(0));

  auto stream = engine.backend.create_stream(StreamPriority::kNormal);
  const std::vector<std::vector<std::string>> kinds = {{"base", "lora"}, {"lora"}, {"base"}};
  for (std::uint64_t v = 1; v <= 10; ++v) {
    const auto& groups = kinds[v % kinds.size()];
    shadowsync::testing::HostTensors tensors(layout, groups, v);
    PublishHandle handle = sender.publish(v, groups, tensors.sources());
    trainer.send_update_header(handle.header());
    handle.wait();
    // This thread plays the engine thread: apply, then report.
    REQUIRE(engine.receiver.step_hook().wait_applied(v, deadline_from_now(), *stream));
    engine.channel.report_applied(v, 100 + v);
    REQUIRE(trainer.wait_until_all_applied(v, deadline_from_now()));
    CHECK(trainer.engines()[0].applied_step >= 100 + v);
  }
  CHECK(trainer.engines()[0].applied_version == 10);

  SECTION("a header the receiver refuses comes back as that error; nothing changes") {
    UpdateHeader stale = make_update_header(layout, 5, {"base"});
    trainer.send_update_header(stale);
    wait_until([&] { return engine.channel.stats().headers_refused == 1; }, "header refused");
    wait_until([&] { return trainer.engines()[0].error_version == 5; }, "error reached trainer");
    CHECK(trainer.engines()[0].error_code == ErrorCode::kStaleVersion);
    CHECK_THAT(trainer.engines()[0].error, Catch::Contains("greater than the last one"));
    CHECK(engine.receiver.stats().last_accepted_version == 10);

    UpdateHeader wrong = make_update_header(layout, 11, {"base"});
    wrong.bucket_count += 2;  // (+1 would announce a checksum block)
    trainer.send_update_header(wrong);
    try {
      trainer.wait_until_all_applied(11, deadline_from_now());
      FAIL("a refused update was reported as applied");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kBadHeader);
      CHECK_THAT(e.what(), Catch::Contains("bucket count"));
    }
  }

  SECTION("a trainer that leaves takes the engine's end of the transport with it") {
    // NCCL's teardown within a node waits for both ends: an engine that kept its end would hold
    // the departed trainer's Sender destructor (the two-process example hung so on GPUs).
    trainer.close();
    trainer.close();  // idempotent
    CHECK_FALSE(trainer.engines()[0].connected);
    CHECK(trainer.engines()[0].disconnect_reason == "said goodbye");
    wait_until([&] { return log.count("said goodbye (trainer shutting down)") == 1; },
               "goodbye processed");
    // The next trainer skips the rendezvous: its update finds no transport, and says why.
    TrainerChannel next(layout, trainer_config(log, engine.channel.port()));
    next.send_update_header(make_update_header(layout, 11, {"base"}));
    wait_until([&] { return engine.receiver.stats().last_failure.version == 11; },
               "update 11 failed");
    const ReceiverStats stats = engine.receiver.stats();
    CHECK(stats.last_failure.code == ErrorCode::kTransport);
    CHECK_THAT(stats.last_error, Catch::Contains("no transport (released: trainer") &&
                                     Catch::Contains("left: said goodbye (trainer shutting down)"));
    CHECK(stats.needs_transport);
    CHECK(stats.updates_ready == 10);
  }

  SECTION("the engine's channel shutting down releases the receiver's transport too") {
    engine.channel.shutdown();
    engine.channel.shutdown();  // idempotent
    wait_until([&] { return !trainer.engines()[0].connected; }, "trainer told");
    engine.receiver.begin_update(make_update_header(layout, 11, {"base"}));
    wait_until([&] { return engine.receiver.stats().last_failure.version == 11; },
               "update 11 failed");
    CHECK_THAT(engine.receiver.stats().last_error,
               Catch::Contains("no transport (released: the engine's control channel shut down"));
  }

  SECTION("a newer trainer replaces the old one; a new rendezvous and the updates resume") {
    // (A trainer that dies without a goodbye: tests/integration/test_control_e2e.cpp.)
    auto restarted =
        std::make_unique<TrainerChannel>(layout, trainer_config(log, engine.channel.port()));
    // Both ends log it (one log for both here).
    wait_until([&] { return log.count("replaced by a newer trainer") >= 1; },
               "old trainer replaced");
    wait_until([&] { return !trainer.engines()[0].connected; }, "old trainer told");
    CHECK_THAT(trainer.engines()[0].disconnect_reason, Catch::Contains("replaced"));
    CHECK_THROWS_AS(trainer.send_update_header(make_update_header(layout, 11, {"base"})), Error);

    CHECK(restarted->highest_accepted_version() == 10);
    auto fresh = std::make_shared<LoopbackCommunicator>(2);
    engine.set_communicator(fresh);
    restarted->send_rendezvous(RendezvousId{});
    REQUIRE(restarted->wait_rendezvous(deadline_from_now()));
    Sender sender2(layout, engine.backend, fresh->transport(0));
    shadowsync::testing::HostTensors tensors(layout, {"base"}, 11);
    PublishHandle handle = sender2.publish(11, {"base"}, tensors.sources());
    restarted->send_update_header(handle.header());
    handle.wait();
    REQUIRE(engine.receiver.step_hook().wait_applied(11, deadline_from_now(), *stream));
    engine.channel.report_applied(11, 500);
    REQUIRE(restarted->wait_until_all_applied(11, deadline_from_now()));
    CHECK(engine.channel.stats().rendezvous_done == 2);
    restarted.reset();
    wait_until([&] { return log.count("said goodbye (trainer shutting down)") == 1; },
               "goodbye processed");
    CHECK_FALSE(engine.channel.stats().trainer_connected);
  }
}

namespace {

// Every word of every tensor of `group` live on `receiver` reads `version` (host memory).
bool live_group_is(const Layout& layout, Receiver& receiver, std::size_t group,
                   std::uint64_t version) {
  const auto& tensors = layout.groups()[group].tensors();
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    const auto* data = static_cast<const std::byte*>(receiver.step_hook().live_tensor(group, t));
    for (std::size_t word = 0; word < (tensors[t].bytes + 7) / 8; ++word) {
      if (shadowsync::testing::read_version(data, tensors[t].bytes, group, t, word, version) !=
          version) {
        return false;
      }
    }
  }
  return true;
}

}  // namespace

TEST_CASE("a same-host rendezvous: the engine connects to the trainer's socket, updates flow") {
  const Layout layout = test_layout();
  LogCapture log;
  char dir[] = "/tmp/shadowsync_control_XXXXXX";  // mode 0700, as the transport requires
  REQUIRE(::mkdtemp(dir) != nullptr);
  struct Cleanup {
    const char* dir;
    ~Cleanup() {
      std::error_code ignored;
      std::filesystem::remove_all(dir, ignored);
    }
  } cleanup{dir};
  const std::string path = std::string(dir) + "/transport.sock";

  // The engine builds whatever transport the rendezvous names, proving the control token.
  HostBackend engine_backend;
  Receiver receiver(layout, engine_backend, nullptr);
  std::mutex seen_mutex;
  std::vector<RendezvousRequest> seen;
  EngineChannelConfig engine_config;
  engine_config.control = control_config(log);
  engine_config.rank = 1;
  EngineChannel channel(
      receiver,
      [&](const RendezvousRequest& request) -> std::unique_ptr<Transport> {
        {
          std::lock_guard lock(seen_mutex);
          seen.push_back(request);
        }
        if (request.transport.kind != TransportKind::kSameHost) {
          throw Error(ErrorCode::kInvalidArgument,
                      fmt::format("this engine takes same_host, not {}",
                                  to_string(request.transport.kind)));
        }
        SameHostConfig config;
        config.connect_timeout = std::chrono::seconds(20);
        return SameHostTransport::connect(request.transport.path,
                                          resolve_control_token(engine_config.control.token),
                                          request.rank, engine_backend, config);
      },
      engine_config);
  TrainerChannel trainer(layout, trainer_config(log, channel.port()));

  SECTION("an address the engine could not use is refused before anything is sent") {
    for (const std::string& bad :
         {std::string(), std::string(kMaxSameHostPathBytes + 1, 'p'), std::string("a\0b", 3)}) {
      try {
        trainer.send_rendezvous(TransportAddress::same_host(bad));
        FAIL("an unusable same-host path was sent");
      } catch (const Error& e) {
        CHECK(e.code() == ErrorCode::kInvalidArgument);
        CHECK_THAT(e.what(), Catch::Contains(fmt::format("({} bytes) must be 1..107 bytes without "
                                                         "a NUL byte",
                                                         bad.size())));
      }
    }
    TransportAddress unknown;
    unknown.kind = static_cast<TransportKind>(9);
    CHECK_THROWS_WITH(trainer.send_rendezvous(unknown),
                      Catch::Contains("transport kind 9 is not one of 1 (nccl), 2 (same_host)"));
    CHECK(channel.stats().rendezvous_done + channel.stats().rendezvous_failed == 0);
  }

  SECTION("the kind and path arrive; the engine's refusal names the kind") {
    trainer.send_rendezvous(RendezvousId{});
    try {
      trainer.wait_rendezvous(deadline_from_now());
      FAIL("the engine accepted a transport kind it refuses");
    } catch (const Error& e) {
      CHECK_THAT(e.what(), Catch::Contains("nccl rendezvous as rank 1 of 2 failed: this engine "
                                           "takes same_host, not nccl"));
    }
  }

  SECTION("three updates through the same-host transport") {
    trainer.send_rendezvous(TransportAddress::same_host(path));
    HostBackend trainer_backend;
    SameHostConfig config;
    config.connect_timeout = std::chrono::seconds(20);
    auto transport = SameHostTransport::serve(path, kToken, 1, trainer_backend,
                                              SameHostMemory::kHost, layout.bucket_bytes(), config);
    REQUIRE(trainer.wait_rendezvous(deadline_from_now()));
    {
      std::lock_guard lock(seen_mutex);
      REQUIRE(seen.size() == 1);
      CHECK(seen[0].transport.kind == TransportKind::kSameHost);
      CHECK(seen[0].transport.path == path);
      CHECK(seen[0].rank == 1);
      CHECK(seen[0].world_size == 2);
    }
    Sender sender(layout, trainer_backend, std::move(transport));
    auto stream = engine_backend.create_stream(StreamPriority::kNormal);
    for (std::uint64_t v = 1; v <= 3; ++v) {
      shadowsync::testing::HostTensors tensors(layout, {"base", "lora"}, v);
      PublishHandle handle = sender.publish(v, {"base", "lora"}, tensors.sources());
      trainer.send_update_header(handle.header());
      REQUIRE(handle.wait_for(std::chrono::seconds(20)));
      REQUIRE(receiver.step_hook().wait_applied(v, deadline_from_now(), *stream));
      CHECK(live_group_is(layout, receiver, 0, v));
      CHECK(live_group_is(layout, receiver, 1, v));
    }
  }
}

TEST_CASE("a wrong token or no token never gets past the handshake") {
  const Layout layout = test_layout();
  LogCapture log;
  Engine engine(layout, log);

  SECTION("wrong token") {
    try {
      TrainerChannel trainer(
          layout,
          trainer_config(log, engine.channel.port(),
                         "ssk1-70622ead7c7e924047c94fc1b529d4ad9fb7faa90936f8d242164d298ed19e73"));
      FAIL("a trainer with the wrong token connected");
    } catch (const Error& e) {
      CHECK_THAT(e.what(), Catch::Contains("wrong token"));
    }
    wait_until([&] { return log.count("authentication failed") == 1; }, "failure logged");
    CHECK(engine.channel.stats().authentication_failures == 1);
    CHECK_FALSE(engine.channel.stats().trainer_connected);
  }
  SECTION("a peer without the token sends a made-up proof") {
    RawPeer peer(engine.channel.port());
    peer.read_frame();
    peer.send(encode_frame(ClientProofMessage{control::make_nonce(), {}}));
    CHECK(peer.closed_by_engine());
    wait_until([&] { return engine.channel.stats().authentication_failures == 1; }, "counted");
  }
  SECTION("an engine that does not hold the trainer's token is not trusted either") {
    // The trainer checks the engine's proof: an impostor engine cannot take updates.
    LogCapture other_log;
    Engine impostor(layout, other_log, [](EngineChannelConfig& c) {
      c.control.token = "ssk1-f60a0d73c64b42c0e81d8f56d4163ab7f678b06ec84a526e7eba48ea216213df";
    });
    CHECK_THROWS_AS(TrainerChannel(layout, trainer_config(log, impostor.channel.port())), Error);
  }
  SECTION("no token anywhere, or a short one, is refused up front") {
    const char* saved = std::getenv(kControlTokenEnv);
    const std::string saved_value = saved ? saved : "";
    ::unsetenv(kControlTokenEnv);
    EngineChannelConfig config;
    config.control.log = log.sink();
    HostBackend backend;
    Receiver receiver(layout, backend, nullptr);
    auto factory = [](const RendezvousRequest&) { return std::unique_ptr<Transport>(); };
    try {
      EngineChannel channel(receiver, factory, config);
      FAIL("an engine channel started without a token");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kInvalidArgument);
      CHECK_THAT(e.what(), Catch::Contains(kControlTokenEnv));
    }
    TrainerChannelConfig trainer = trainer_config(log, engine.channel.port(), "");
    CHECK_THROWS_AS(TrainerChannel(layout, trainer), Error);
    config.control.token = "short";
    CHECK_THROWS_AS(EngineChannel(receiver, factory, config), Error);
    // From the environment it works (and the token never shows up in messages).
    ::setenv(kControlTokenEnv, kToken.c_str(), 1);
    config.control.token.clear();
    EngineChannel from_env(receiver, factory, config);
    TrainerChannel connected(layout, trainer_config(log, from_env.port(), ""));
    CHECK(connected.engines()[0].connected);
    if (saved) {
      ::setenv(kControlTokenEnv, saved_value.c_str(), 1);
    } else {
      ::unsetenv(kControlTokenEnv);
    }
    CHECK(log.all().find(kToken) == std::string::npos);
  }
}

TEST_CASE("a replayed handshake or frame is refused and reaches nothing") {
  const Layout layout = test_layout();
  LogCapture log;
  Engine engine(layout, log);

  // A genuine session, recorded byte for byte: proof, hello, one update header.
  RawPeer genuine(engine.channel.port());
  RawSession session = raw_handshake(genuine, layout);
  session.send_tagged(genuine, UpdateHeaderMessage{make_update_header(layout, 1, {"base"})});
  wait_until([&] { return engine.channel.stats().headers_accepted == 1; }, "genuine header");
  const std::vector<std::byte> recording = session.sent;
  const std::uint64_t accepted_before = engine.receiver.stats().last_accepted_version;

  SECTION("replaying the whole recorded session on a new connection") {
    RawPeer replay(engine.channel.port());
    replay.read_frame();  // a fresh challenge, which the recording cannot answer
    replay.send(recording);
    CHECK(replay.closed_by_engine());
    wait_until([&] { return engine.channel.stats().authentication_failures == 1; }, "counted");
    wait_until([&] { return log.count("authentication failed") == 1; }, "failure logged");
  }
  SECTION("replaying a tagged frame inside the session") {
    const std::vector<std::byte> header_frame =
        session.tagged(UpdateHeaderMessage{make_update_header(layout, 2, {"base"})});
    genuine.send(header_frame);
    wait_until([&] { return engine.channel.stats().headers_accepted == 2; }, "second header");
    genuine.send(header_frame);  // same bytes, stale sequence number
    CHECK(genuine.closed_by_engine());
    wait_until([&] { return log.count("fails its authentication tag") == 1; }, "failure logged");
  }
  SECTION("a frame with one flipped bit") {
    std::vector<std::byte> frame =
        session.tagged(UpdateHeaderMessage{make_update_header(layout, 2, {"base"})});
    frame[kFrameHeaderBytes + 8] ^= std::byte{1};  // the version
    genuine.send(frame);
    CHECK(genuine.closed_by_engine());
    wait_until([&] { return log.count("fails its authentication tag") == 1; }, "failure logged");
  }
  // Nothing of the refused bytes reached the receiver.
  const auto stats = engine.channel.stats();
  CHECK(stats.headers_refused == 0);
  CHECK(engine.receiver.stats().last_accepted_version <= accepted_before + 1);
}

TEST_CASE("malformed and truncated frames close that connection only, with a log line") {
  const Layout layout = test_layout();
  LogCapture log;
  Engine engine(layout, log, [](EngineChannelConfig& c) {
    c.control.frame_timeout = std::chrono::milliseconds(200);
  });
  // A trainer that stays connected throughout: the engine keeps serving it. (The raw peers below
  // authenticate but send no hello, or a refused one, so they never replace it.)
  TrainerChannel trainer(layout, trainer_config(log, engine.channel.port()));

  auto expect_closed = [&](RawPeer& peer, std::string_view line) {
    CHECK(peer.closed_by_engine());
    wait_until([&] { return log.count(line) >= 1; }, std::string(line));
  };

  SECTION("not the protocol at all") {
    RawPeer peer(engine.channel.port());
    const std::string http = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
    peer.send(std::as_bytes(std::span(http)));
    expect_closed(peer, "bad magic");
  }
  SECTION("a frame header announcing a huge body, before authentication") {
    RawPeer peer(engine.channel.port());
    std::vector<std::byte> frame = encode_frame(ClientProofMessage{});
    frame[8] = frame[9] = frame[10] = frame[11] = std::byte{0xff};
    peer.send(frame);
    expect_closed(peer, "body length 4294967295");
  }
  SECTION("a tagged frame before the handshake") {
    RawPeer peer(engine.channel.port());
    RendezvousMessage rendezvous;
    rendezvous.rendezvous_id = 1;
    rendezvous.rank = 1;
    rendezvous.world_size = 2;
    std::vector<std::byte> frame = encode_frame(rendezvous);
    frame.resize(frame.size() + kControlMacBytes);
    peer.send(frame);
    expect_closed(peer, "rendezvous frame before the end of the handshake");
  }
  SECTION("a peer of the previous wire version (its rendezvous carried an NCCL id only)") {
    RawPeer peer(engine.channel.port());
    peer.read_frame();  // the challenge
    std::vector<std::byte> frame = encode_frame(ClientProofMessage{});
    frame[4] = std::byte{1};  // wire version 1
    frame[5] = std::byte{0};
    peer.send(frame);
    expect_closed(peer, "wire version 1 differs from this side's 2");
  }
  SECTION("a frame only an engine sends") {
    RawPeer peer(engine.channel.port());
    RawSession session = raw_handshake(peer, layout, false);
    session.send_tagged(peer, AckMessage{1, 1});
    expect_closed(peer, "ack frame is never sent to an engine");
  }
  SECTION("a correctly tagged header whose group count exceeds the payload") {
    RawPeer peer(engine.channel.port());
    RawSession session = raw_handshake(peer, layout, false);
    std::vector<std::byte> frame =
        encode_frame(UpdateHeaderMessage{make_update_header(layout, 1, {"base"})});
    frame[kFrameHeaderBytes + 24] = std::byte{200};  // group count
    const ControlMac tag =
        control::frame_tag(session.keys.trainer_to_engine, session.sequence++, frame);
    frame.insert(frame.end(), tag.begin(), tag.end());
    peer.send(frame);
    expect_closed(peer, "malformed update_header frame: update header: group count 200");
  }
  SECTION("a trainer hello with a different layout") {
    const Layout other = Layout::build({{"x", DType::kFloat32, {10}, "base"}});
    RawPeer peer(engine.channel.port());
    raw_handshake(peer, other);
    expect_closed(peer, "trainer's layout differs");
  }
  SECTION("a truncated frame, then silence") {
    RawPeer peer(engine.channel.port());
    RawSession session = raw_handshake(peer, layout, false);
    const std::vector<std::byte> frame = session.tagged(GoodbyeMessage{"bye"});
    peer.send(std::span(frame).first(frame.size() - 1));
    expect_closed(peer, "a frame was not completed within 200 ms");
  }
  SECTION("a truncated frame, then the connection closes") {
    {
      RawPeer peer(engine.channel.port());
      RawSession session = raw_handshake(peer, layout, false);
      const std::vector<std::byte> frame = session.tagged(GoodbyeMessage{"bye"});
      peer.send(std::span(frame).first(kFrameHeaderBytes + 2));
      wait_until([&] { return engine.channel.stats().connections_open == 2; }, "bytes arrived");
    }
    wait_until([&] { return log.count("closed the connection in the middle of a frame") >= 1; },
               "truncated close logged");
  }
  // The well-behaved trainer was never disturbed: its connection still carries a header.
  CHECK(trainer.engines()[0].connected);
  CHECK(engine.channel.stats().trainer_connected);
  const std::uint64_t accepted = engine.channel.stats().headers_accepted;
  trainer.send_update_header(make_update_header(layout, 1, {"base"}));
  wait_until([&] { return engine.channel.stats().headers_accepted == accepted + 1; },
             "the good trainer's header accepted after the bad peers");
}

TEST_CASE("a peer that connects and sends nothing times out, and no thread is left behind") {
  const Layout layout = test_layout();
  LogCapture log;
  Engine engine(layout, log, [](EngineChannelConfig& c) {
    c.control.handshake_timeout = std::chrono::milliseconds(200);
  });
  const std::size_t threads = thread_count();
  const std::size_t fds = fd_count();
  {
    RawPeer silent(engine.channel.port());
    CHECK(silent.closed_by_engine());
    wait_until([&] { return log.count("handshake not completed within 200 ms") == 1; }, "logged");
  }
  engine.wait_closed("every connection closed");
  CHECK(thread_count() == threads);
  CHECK(fd_count() == fds);
}

TEST_CASE("peers that never prove the token cannot lock a trainer out: the oldest gives way") {
  const Layout layout = test_layout();
  LogCapture log;
  Engine engine(layout, log, [](EngineChannelConfig& c) {
    c.control.handshake_timeout = std::chrono::seconds(60);  // only the cap can close them
    c.max_pending_connections = 4;
  });
  std::vector<std::unique_ptr<RawPeer>> silent;
  for (int i = 0; i < 4; ++i) silent.push_back(std::make_unique<RawPeer>(engine.channel.port()));
  wait_until([&] { return engine.channel.stats().connections_open == 4; }, "4 pending");
  // One more silent peer: the oldest is closed, the newcomer keeps its slot.
  silent.push_back(std::make_unique<RawPeer>(engine.channel.port()));
  CHECK(silent.front()->closed_by_engine());
  CHECK_FALSE(silent.back()->closed_by_engine(std::chrono::milliseconds(50)));
  CHECK(engine.channel.stats().connections_refused == 1);
  CHECK(log.count("had not proved the token") == 1);
  // While every slot is held by a silent peer, trainers still get in, one after the other.
  for (std::uint64_t round = 0; round < 3; ++round) {
    {
      TrainerChannel trainer(layout, trainer_config(log, engine.channel.port()));
      CHECK(trainer.engines()[0].connected);
      CHECK(engine.channel.stats().connections_refused == 2 + round);  // it took the oldest's
    }
    // A trainer that proved the token holds no slot: a new silent peer fills the one it took.
    silent.push_back(std::make_unique<RawPeer>(engine.channel.port()));
    wait_until([&] { return engine.channel.stats().connections_accepted == 7 + 2 * round; },
               "the slot refilled by a silent peer");
  }
  CHECK(engine.channel.stats().trainers_authenticated == 3);
}

TEST_CASE("an engine that closes before the challenge is not blamed on the token") {
  const Layout layout = test_layout();
  LogCapture log;
  // A listener that accepts one connection and closes it at once, as a busy engine would.
  control::Fd listener(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(listener.get(), reinterpret_cast<sockaddr*>(&address), sizeof address) == 0);
  REQUIRE(::listen(listener.get(), 1) == 0);
  socklen_t length = sizeof address;
  REQUIRE(::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&address), &length) == 0);
  std::thread closer([&] {
    if (control::wait_fd(listener.get(), POLLIN, deadline_from_now())) {
      control::Fd accepted(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
    }
  });
  try {
    TrainerChannel trainer(layout, trainer_config(log, ntohs(address.sin_port)));
    FAIL("a trainer connected to a listener that closes at once");
  } catch (const Error& e) {
    CHECK_THAT(e.what(), Catch::Contains("no token was checked yet"));
    CHECK_THAT(e.what(), !Catch::Contains("wrong token"));
  }
  closer.join();
}

TEST_CASE("a rendezvous whose trainer left does not hold up the next trainer's") {
  const Layout layout = test_layout();
  LogCapture log;
  HostBackend backend;
  Receiver receiver(layout, backend, nullptr);
  auto communicator = std::make_shared<LoopbackCommunicator>(2);
  std::mutex mutex;
  std::condition_variable changed;
  bool released = false;
  int calls = 0;
  // The first rendezvous blocks until the test releases it, as a same-host connect to a socket
  // nobody serves does; every later one returns at once.
  TransportFactory factory = [&](const RendezvousRequest& request) -> std::unique_ptr<Transport> {
    std::unique_lock lock(mutex);
    if (++calls == 1) {
      changed.notify_all();
      changed.wait_for(lock, shadowsync::testing::kTestDeadline, [&] { return released; });
      throw Error(ErrorCode::kTimeout, "no trainer listened");
    }
    return communicator->transport(request.rank);
  };
  EngineChannel channel(receiver, factory, Engine::config(log, {}));
  {
    TrainerChannel departing(layout, trainer_config(log, channel.port()));
    departing.send_rendezvous(RendezvousId{});
    std::unique_lock lock(mutex);
    REQUIRE(changed.wait_for(lock, shadowsync::testing::kTestDeadline, [&] { return calls == 1; }));
  }  // it leaves while its factory blocks
  TrainerChannel next(layout, trainer_config(log, channel.port()));
  next.send_rendezvous(RendezvousId{});
  CHECK(next.wait_rendezvous(deadline_from_now(std::chrono::seconds(10))));
  {
    std::lock_guard lock(mutex);
    CHECK(calls == 2);
    CHECK_FALSE(released);  // served while the departed trainer's factory still blocked
    released = true;
  }
  changed.notify_all();
  CHECK(log.count("rendezvous as rank 1 of 2 given up") == 1);
  CHECK(channel.stats().rendezvous_done == 1);
}

TEST_CASE("1,000 connect/disconnect cycles leave no fd or thread behind") {
  const Layout layout = test_layout();
  LogCapture log;
  Engine engine(layout, log);
  {  // warm-up: anything allocated once (the resolver, the first trainer) is not a leak
    TrainerChannel trainer(layout, trainer_config(log, engine.channel.port()));
  }
  engine.wait_closed("warm-up closed");
  const std::size_t threads = thread_count();
  const std::size_t fds = fd_count();
  for (int cycle = 0; cycle < 1000; ++cycle) {
    if (cycle % 2 == 0) {
      RawPeer peer(engine.channel.port());  // connects and leaves mid-handshake
    } else {
      TrainerChannel trainer(layout, trainer_config(log, engine.channel.port()));
      REQUIRE(trainer.engines()[0].connected);
    }
  }
  engine.wait_closed("every connection closed");
  const auto stats = engine.channel.stats();
  CHECK(stats.connections_accepted == 1001);
  CHECK(stats.trainers_authenticated == 501);
  CHECK(stats.authentication_failures == 0);
  CHECK(thread_count() == threads);
  CHECK(fd_count() == fds);
}
