// SameHostTransport's device flavour (SameHostMemory::kDevice) on one GPU:
//  * the transport conformance suite (tests/support/transport_conformance.h), every rank with its
//    own CudaBackend(0) in a thread of this process, 2 and 3 ranks, 4 KiB slots (the suite's
//    broadcasts cross hundreds of chunks) and 1 MiB slots (one chunk each);
//  * a trainer process and an engine process on the same GPU: the trainer is a child process
//    (this binary running the hidden case "[.same_host_gpu_trainer]", spawned with posix_spawn,
//    its parameters in the environment), the engine is this process, a GpuFakeEngine stepping
//    while 1,000 updates (base, LoRA or both by v % 3) stream in; 0 torn steps, every update
//    ready, the oracle's verdict on every step (UpdateHistory::check). Both sides follow one
//    deterministic schedule, so each builds the update headers itself;
//  * a receiver that cannot open the sender's export: a fake sender (the real handshake, then a
//    setup that carries a memory file where the cuMem export belongs, or no descriptor at all) ->
//    connect() refuses with an error naming what was tried and both GPUs;
//  * a trainer process SIGKILLed mid-update: the engine's update fails cleanly (the socket's EOF,
//    well within the receiver's deadlines) while the engine keeps stepping, the live bytes do not
//    change, and a new trainer process connects and its updates apply.
//  * a receive the trainer answers only after the engine synchronized the device (cudaFree and
//    cudaDeviceSynchronize on the engine's thread): the synchronize returns at once, because a
//    receiver enqueues nothing before its doorbell came; and a doorbell that never comes ends the
//    receive at SameHostConfig::doorbell_timeout, enqueueing nothing.
//
// Skips (77, "SKIPPED: ...") without a usable CUDA device: the GPU variant of Catch's main
// (tests/support/catch_main.cpp). A watchdog per case ends the process if anything hangs; the
// trainer children die with it (PR_SET_PDEATHSIG) and a hung child ends itself (alarm).
//
// A device-flavour receiver's broadcast_async blocks its thread until the sender's doorbells came
// (host-gated), and the sender's may block while the CUDA stream's queue is full: every rank
// therefore enqueues from its own thread (the conformance suite does), never a receiver's and the
// sender's broadcasts from one.
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "child_process.h"
#include "deadline.h"
#include "fake_engine.h"
#include "gpu_fake_engine.cuh"
#include "same_host_fixture.h"
#include "shadowsync/cuda_backend.h"
#include "shadowsync/error.h"
#include "shadowsync/receiver.h"
#include "shadowsync/same_host_transport.h"
#include "shadowsync/sender.h"
#include "shadowsync/update_header.h"
#include "transport_conformance.h"
#include "transports/same_host/same_host_auth.h"
#include "transports/same_host/same_host_frame.h"
#include "transports/same_host/same_host_socket.h"
#include "watchdog.h"


using namespace shadowsync;
using namespace shadowsync::testing;
using namespace std::chrono_literals;

namespace {

// Ranks of one process wait on each other through host memory (the transport's stream waits): two
// streams sharing one of the device's hardware queues could then block each other. More queues
// (the maximum, 32; the default is 8) before CUDA starts make that unlikely; the trainer child
// inherits it. Separate processes, as in production, never share a queue.
[[maybe_unused]] const int kMoreHardwareQueues = ::setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);


using Clock = std::chrono::steady_clock;

const std::string kToken = "ssk1-70622ead7c7e924047c94fc1b529d4ad9fb7faa90936f8d242164d298ed19e73";

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// ---------------------------------------------------------------------------------------------
// 1. Conformance on the device flavour.
// ---------------------------------------------------------------------------------------------

std::unique_ptr<SameHostFixture> device_fixture(int world_size, std::size_t slot_bytes) {
  return std::make_unique<SameHostFixture>(
      world_size, SameHostMemory::kDevice, slot_bytes,
      [](int) -> std::unique_ptr<Backend> { return std::make_unique<CudaBackend>(0); });
}


}  // namespace

TEST_CASE("same-host gpu conformance: device memory, 4 KiB slots, each case alone",
          "[conformance][same_host][gpu]") {
  Watchdog watchdog(300s);
  const int world_size = GENERATE(2, 3);
  const std::string name = GENERATE(Catch::Generators::from_range(conformance_case_names()));
  CAPTURE(world_size, name);
  const auto fixture = device_fixture(world_size, 4096);
  CHECK(fixture->same_host(0).memory() == SameHostMemory::kDevice);
  const ConformanceResult result = run_conformance_case(*fixture, name);
  report_same_host_case(result);
  CHECK(result.passed());
}

TEST_CASE("same-host gpu conformance: device memory, the whole suite on one fixture",
          "[conformance][same_host][gpu]") {
  Watchdog watchdog(300s);
  const int world_size = GENERATE(2, 3);
  const std::size_t slot_bytes = GENERATE(std::size_t{4096}, std::size_t{1} << 20);
  CAPTURE(world_size, slot_bytes);
  const auto fixture = device_fixture(world_size, slot_bytes);
  CHECK(conformance_cases_skipped_on(*fixture) == kSkippedOnSameHost);
  const auto start = Clock::now();
  const auto results = run_transport_conformance(*fixture);
  REQUIRE(results.size() == conformance_case_names().size());
  for (const ConformanceResult& result : results) report_same_host_case(result);
  CHECK(conformance_failures(results).empty());
  // Still usable after the suite's aborts and reconnects.
  const ConformanceResult again =
      run_conformance_case(*fixture, "broadcast from root 0 of 1 B, 4097 B and 1 MiB");
  report_same_host_case(again);
  CHECK(again.passed());
  std::printf("same_host_gpu: conformance %s: %zu cases, %.2f s\n", fixture->name().c_str(),
              results.size(), seconds_since(start));
}

// ---------------------------------------------------------------------------------------------
// 2 and 4. A trainer process and an engine process on one GPU.
// ---------------------------------------------------------------------------------------------

namespace {

// ~3.9 MiB of base in 256 KiB buckets (16 of them, tensors crossing bucket boundaries, partial
// tail words), a LoRA group of ~0.2 MiB.
Layout process_layout() {
  std::vector<TensorSpec> specs;
  specs.push_back({"embed", DType::kBFloat16, {1024, 256}, "base"});
  for (int l = 0; l < 6; ++l) {
    const std::string prefix = "layers." + std::to_string(l);
    specs.push_back({prefix + ".w", DType::kBFloat16, {1000, 256}, "base"});
    specs.push_back({prefix + ".norm", DType::kBFloat16, {257}, "base"});
  }
  specs.push_back({"head", DType::kFloat32, {300, 256}, "base"});
  specs.push_back({"bias", DType::kInt8, {777}, "base"});
  specs.push_back({"lora.A", DType::kBFloat16, {128, 256}, "lora"});
  specs.push_back({"lora.B", DType::kFloat32, {256, 128}, "lora"});
  specs.push_back({"lora.C", DType::kFloat16, {96, 64}, "lora"});
  specs.push_back({"lora.scale", DType::kFloat32, {70}, "lora"});
  return Layout::build(std::move(specs), {.bucket_bytes = std::size_t{256} << 10});
}

std::vector<std::string> groups_of(std::uint64_t v) {
  switch (v % 3) {
    case 0: return {"lora"};
    case 1: return {"base"};
    default: return {"base", "lora"};
  }
}

std::uint64_t env_u64(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr ? 0 : std::strtoull(value, nullptr, 10);
}

SameHostConfig process_config() {
  SameHostConfig c;
  c.connect_timeout = 60s;  // a child's CUDA context takes a moment
  c.handshake_timeout = 10s;
  return c;
}

// Generous: only a bug makes a bucket or an update of a few MB on one GPU take long. The
// SIGKILL case shows that a dead trainer is noticed through its socket, far sooner.
ReceiverConfig receiver_config() {
  ReceiverConfig rc;
  rc.bucket_deadline = 10s;
  rc.update_deadline = 30s;
  rc.require_checksums = true;
  return rc;
}

void wait_event(CudaBackend& backend, Event& event, const char* what) {
  if (!backend.event_wait_for(event, 30s)) {
    throw std::runtime_error(std::string("trainer: ") + what + " did not complete within 30 s");
  }
}

}  // namespace

// The trainer process. Environment: SS_SHG_PATH, SS_SHG_FIRST (first version), SS_SHG_COUNT
// (updates to send), SS_SHG_HANG (1: then start one more update, supply two of its tensors, print
// "mid" on stdout and wait to be killed). Tensors in device memory of GPU 0, filled by the
// pattern kernel; three updates of four are packed (publish), the fourth sent from arenas.
TEST_CASE("same-host gpu trainer child", "[.same_host_gpu_trainer]") {
  // Dies with the test process, whatever ends it (a watchdog, a crash).
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() == 1) std::_Exit(3);
  const char* path = std::getenv("SS_SHG_PATH");
  REQUIRE(path != nullptr);
  const Layout layout = process_layout();
  CudaBackend backend(0);
  SenderConfig sender_config;
  sender_config.update_deadline = 30s;
  auto transport = SameHostTransport::serve(path, kToken, 1, backend, SameHostMemory::kDevice,
                                            layout.bucket_bytes(), process_config());
  Sender sender(layout, backend, std::move(transport), sender_config);

  const std::size_t groups = layout.groups().size();
  std::vector<DeviceBuffer> arenas;
  std::vector<std::vector<SourceTensor>> by_group(groups);
  std::vector<SourceTensor> sources;
  for (std::size_t g = 0; g < groups; ++g) {
    const GroupLayout& group = layout.groups()[g];
    arenas.emplace_back(backend, group.arena_bytes());
    for (const auto& placement : group.tensors()) {
      by_group[g].push_back(SourceTensor{placement.spec.name, arenas[g].data() + placement.offset,
                                         placement.spec.dtype, placement.spec.shape});
      sources.push_back(by_group[g].back());
    }
  }
  auto stream = backend.create_stream(StreamPriority::kNormal);
  auto filled = backend.create_event();
  const auto fill = [&](std::uint64_t v) {
    for (const std::string& name : groups_of(v)) {
      const std::size_t g = layout.group_index(name);
      fill_group_async(backend, *stream, layout, g, v, arenas[g].data());
    }
    backend.event_record(*filled, *stream);
    wait_event(backend, *filled, "the fill kernels");
  };

  const std::uint64_t first = env_u64("SS_SHG_FIRST");
  const std::uint64_t count = env_u64("SS_SHG_COUNT");
  for (std::uint64_t v = first; v < first + count; ++v) {
    fill(v);
    std::vector<const void*> group_arenas;
    for (const std::string& name : groups_of(v)) {
      group_arenas.push_back(arenas[layout.group_index(name)].data());
    }
    const PublishHandle handle = v % 4 == 3 ? sender.publish_arenas(v, groups_of(v), group_arenas)
                                            : sender.publish(v, groups_of(v), sources);
    INFO("version " << v);
    REQUIRE(handle.wait_for(60s));
    handle.wait();  // throws the update's error if it failed
  }
  if (env_u64("SS_SHG_HANG") == 1) {
    const std::uint64_t v = first + count;
    fill(v);
    StreamedPublish streamed = sender.publish_streamed(v, groups_of(v));
    REQUIRE(streamed.order().size() > 2);
    std::vector<SourceTensor> part;
    for (std::size_t i = 0; i < 2; ++i) {
      const auto [g, t] = streamed.order()[i];
      part.push_back(by_group[g][t]);
    }
    streamed.supply(part);
    std::fputs("mid\n", stdout);
    std::fflush(stdout);
    ::alarm(120);  // ends this process if the test never kills it
    for (;;) ::pause();
  }
}

namespace {

std::unique_ptr<ChildProcess> spawn_trainer(const std::string& path, std::uint64_t first,
                                            std::uint64_t count, bool hang) {
  return spawn_self("[.same_host_gpu_trainer]",
                    {"SS_SHG_PATH=" + path, "SS_SHG_FIRST=" + std::to_string(first),
                     "SS_SHG_COUNT=" + std::to_string(count),
                     std::string("SS_SHG_HANG=") + (hang ? "1" : "0")});
}

struct SocketDir {
  std::filesystem::path dir;
  SocketDir() {
    char name[] = "/tmp/shadowsync_same_host_gpu_XXXXXX";
    REQUIRE(::mkdtemp(name) != nullptr);
    dir = name;
  }
  ~SocketDir() {
    std::error_code ignored;
    std::filesystem::remove_all(dir, ignored);
  }
  std::string path() const { return (dir / "trainer.sock").string(); }
};

// The engine process's side: one receiver and its GPU fake engine on GPU 0.
struct Engine {
  const Layout& layout;
  CudaBackend backend{0};
  Receiver receiver;
  GpuFakeEngine engine;
  UpdateHistory history;
  std::uint64_t steps = 0;

  static GpuFakeEngineOptions engine_options() {
    GpuFakeEngineOptions options;
    options.full_check_every = 16;
    options.max_steps_in_flight = 8;
    return options;
  }
  explicit Engine(const Layout& l)
      : layout(l), receiver(layout, backend, nullptr, receiver_config()),
        engine(backend, receiver, engine_options()) {}

  // Connects to the trainer at `path` (blocks until it serves).
  void connect(const std::string& path) {
    receiver.replace_transport(SameHostTransport::connect(path, kToken, 1, backend,
                                                          process_config()));
  }
  std::uint64_t failures_expected = 0;  // updates a test failed on purpose

  void begin(std::uint64_t v) {
    const UpdateHeader header = make_update_header(layout, v, groups_of(v), true);
    history.add(v, {header.groups.begin(), header.groups.end()});
    receiver.begin_update(header);
  }
  // The engine steps while the update streams in, until it made `v` live.
  void step_until_applied(std::uint64_t v) {
    const auto deadline = Clock::now() + 60s;
    std::uint64_t n = 0;
    while (receiver.step_hook().applied_version() < v) {
      engine.step();
      ++steps;
      if (++n % 256 == 0) {
        const ReceiverStats stats = receiver.stats();
        INFO("version " << v << ": " << stats.updates_failed << " failed; last error: "
                        << stats.last_error);
        REQUIRE(stats.updates_failed == failures_expected);
        REQUIRE(Clock::now() < deadline);
      }
    }
    engine.step();  // at least one step on the new version
    ++steps;
  }
  void check_oracle() {
    engine.synchronize();
    INFO("first torn step: " << engine.first_torn());
    CHECK(engine.torn_steps() == 0);
    CHECK(engine.torn_records() == 0);
    const std::string verdict = history.check(engine.records());
    INFO("update history: " << verdict);
    CHECK(verdict.empty());
  }
  // A hash of every live byte (copied back to the host), the engine stream idle.
  std::uint64_t live_hash() {
    engine.synchronize();
    std::uint64_t h = 1469598103934665603ull;  // FNV-1a
    std::vector<unsigned char> host;
    for (std::size_t g = 0; g < layout.groups().size(); ++g) {
      host.resize(layout.groups()[g].arena_bytes());
      REQUIRE(cudaMemcpy(host.data(), receiver.step_hook().live_arena(g), host.size(),
                         cudaMemcpyDeviceToHost) == cudaSuccess);
      for (const unsigned char byte : host) h = (h ^ byte) * 1099511628211ull;
    }
    return h;
  }
};

}  // namespace

TEST_CASE("same-host gpu processes: a trainer process and an engine on one GPU, 1,000 updates, "
          "0 torn steps",
          "[same_host][gpu][processes]") {
  Watchdog watchdog(240s);
  const Layout layout = process_layout();
  SocketDir dir;
  Engine engine(layout);
  constexpr std::uint64_t kUpdates = 1000;
  const auto start = Clock::now();
  auto trainer = spawn_trainer(dir.path(), 1, kUpdates, false);
  engine.connect(dir.path());
  for (std::uint64_t v = 1; v <= kUpdates; ++v) {
    engine.begin(v);
    engine.step_until_applied(v);
  }
  const double seconds = seconds_since(start);
  require_exited_zero(*trainer);
  engine.receiver.drain();
  engine.check_oracle();
  const ReceiverStats stats = engine.receiver.stats();
  INFO("last error: " << stats.last_error);
  CHECK(stats.updates_ready == kUpdates);
  CHECK(stats.updates_failed == 0);
  CHECK(engine.receiver.step_hook().applied_version() == kUpdates);
  std::printf("same_host_gpu: processes updates=%llu ready=%llu failed=%llu steps=%llu "
              "full_checks=%llu records=%zu torn_steps=%llu seconds=%.2f buckets_per_base=%zu\n",
              static_cast<unsigned long long>(kUpdates),
              static_cast<unsigned long long>(stats.updates_ready),
              static_cast<unsigned long long>(stats.updates_failed),
              static_cast<unsigned long long>(engine.engine.steps_done()),
              static_cast<unsigned long long>(engine.engine.full_steps_enqueued()),
              engine.engine.record_count(),
              static_cast<unsigned long long>(engine.engine.torn_steps()), seconds,
              layout.groups()[layout.group_index("base")].bucket_count());
}

TEST_CASE("same-host gpu processes: a trainer SIGKILLed mid-update fails it cleanly, and a new "
          "trainer's updates apply",
          "[same_host][gpu][processes]") {
  Watchdog watchdog(180s);
  const Layout layout = process_layout();
  SocketDir dir;
  Engine engine(layout);

  auto trainer = spawn_trainer(dir.path(), 1, 3, true);
  engine.connect(dir.path());
  for (std::uint64_t v = 1; v <= 3; ++v) {
    engine.begin(v);
    engine.step_until_applied(v);
  }
  const std::uint64_t before = engine.live_hash();
  engine.begin(4);  // base: the trainer supplies two of its tensors, then is killed
  wait_for_output(*trainer, "mid\n");
  const auto killed = Clock::now();
  REQUIRE(::kill(trainer->pid, SIGKILL) == 0);
  // The engine keeps stepping while the failure is detected: the socket's EOF, at once.
  const std::chrono::milliseconds deadline = receiver_config().bucket_deadline;
  wait_until(
      [&] {
        engine.engine.step();
        return engine.receiver.stats().updates_failed == 1;
      },
      "the receiver reports update 4 failed", deadline);
  const double detect_seconds = seconds_since(killed);
  const ReceiverStats stats = engine.receiver.stats();
  CAPTURE(stats.last_error, detect_seconds);
  CHECK_THAT(stats.last_error, Catch::Contains("closed its socket"));
  CHECK(stats.needs_transport);
  CHECK(engine.receiver.step_hook().applied_version() == 3);
  engine.history.add(4, {});  // never applied: keep the history's versions increasing
  engine.history.mark_failed(4);
  engine.failures_expected = 1;
  CHECK(engine.live_hash() == before);  // the live bytes untouched
  const int status = trainer->reap();
  CHECK(WIFSIGNALED(status));

  // A new trainer process, a new connection; its updates apply.
  auto next = spawn_trainer(dir.path(), 5, 3, false);
  engine.connect(dir.path());
  for (std::uint64_t v = 5; v <= 7; ++v) {
    engine.begin(v);
    engine.step_until_applied(v);
  }
  require_exited_zero(*next);
  engine.check_oracle();
  CHECK(engine.receiver.stats().updates_ready == 6);
  CHECK(engine.receiver.stats().updates_failed == 1);
  CHECK(engine.live_hash() != before);
  std::printf("same_host_gpu: sigkill detected_after_seconds=%.3f error=\"%s\" next_trainer "
              "applied=%llu\n",
              detect_seconds, stats.last_error.c_str(),
              static_cast<unsigned long long>(engine.receiver.step_hook().applied_version()));
}

// ---------------------------------------------------------------------------------------------
// 3. A receiver that cannot open the sender's export.
// ---------------------------------------------------------------------------------------------

namespace {

constexpr std::size_t kUuidBytes = 16;

std::string uuid_text(const unsigned char* uuid) {
  std::string text = "GPU-";
  for (std::size_t i = 0; i < kUuidBytes; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) text += '-';
    char hex[3];
    std::snprintf(hex, sizeof(hex), "%02x", static_cast<unsigned>(uuid[i]));
    text += hex;
  }
  return text;
}

// Plays the sender's side of the handshake with the real token, then sends a device setup whose
// handle bytes name `uuid` and whose descriptor is `passed` (-1: none).
void fake_device_sender(const std::string& path, const std::array<unsigned char, kUuidBytes>& uuid,
                        std::uint64_t allocation_bytes, int passed) {
  same_host::Fd listener = same_host::listen_on(path, 1);
  const auto deadline = same_host::Clock::now() + 30s;
  pollfd pfd{listener.get(), POLLIN, 0};
  REQUIRE(::poll(&pfd, 1, 30'000) == 1);
  same_host::Fd peer(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
  REQUIRE(peer);
  ::unlink(path.c_str());
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
  setup.memory = static_cast<std::uint32_t>(SameHostMemory::kDevice);
  setup.world_size = 2;
  setup.slot_bytes = 4096;
  // The handle bytes as the device flavour writes them: allocation size (u64 LE), GPU UUID.
  for (int i = 0; i < 8; ++i) {
    setup.handle[static_cast<std::size_t>(i)] =
        static_cast<std::byte>((allocation_bytes >> (8 * i)) & 0xff);
  }
  std::memcpy(setup.handle.data() + 8, uuid.data(), kUuidBytes);
  if (passed >= 0) {
    REQUIRE(same_host::write_with_fd(peer.get(), same_host::encode(setup), passed, deadline) ==
            same_host::Io::kOk);
  } else {
    REQUIRE(same_host::write_all(peer.get(), same_host::encode(setup), -1, deadline) ==
            same_host::Io::kOk);
  }
  // Keep the socket open until the receiver has judged the setup: it must fail on the memory,
  // not on a closed socket.
  std::array<std::byte, 1> nothing{};
  (void)same_host::read_exact(peer.get(), nothing, -1, deadline);
}

std::string connect_error(const std::string& path, CudaBackend& backend,
                          const std::array<unsigned char, kUuidBytes>& uuid,
                          std::uint64_t allocation_bytes, int passed) {
  SameHostConfig config;
  config.connect_timeout = 30s;
  config.handshake_timeout = 30s;
  auto connecting = std::async(std::launch::async, [&] {
    try {
      auto transport = SameHostTransport::connect(path, kToken, 1, backend, config);
      return std::string("connect() succeeded");
    } catch (const Error& e) {
      return std::string(e.code() == ErrorCode::kTransport ? "kTransport: " : "other Error: ") +
             e.what();
    } catch (const std::exception& e) {
      return std::string("not an Error: ") + e.what();
    }
  });
  fake_device_sender(path, uuid, allocation_bytes, passed);
  REQUIRE(connecting.wait_for(30s) == std::future_status::ready);
  return connecting.get();
}

}  // namespace

TEST_CASE("same-host gpu: a receiver that cannot open the sender's export says what it tried "
          "and names both GPUs",
          "[same_host][gpu]") {
  Watchdog watchdog(120s);
  SocketDir dir;
  CudaBackend backend(0);
  cudaDeviceProp prop{};
  REQUIRE(cudaGetDeviceProperties(&prop, 0) == cudaSuccess);
  const std::string own = uuid_text(reinterpret_cast<const unsigned char*>(prop.uuid.bytes));
  // A GPU that is not this one: the message must name the sender's GPU as the setup said.
  const std::array<unsigned char, kUuidBytes> sender_uuid = {
      0x5e, 0xed, 0xf0, 0x0d, 0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 0x01, 0x02, 0x03, 0x04};
  const std::string sender = uuid_text(sender_uuid.data());
  REQUIRE(sender != own);
  constexpr std::uint64_t kAllocationBytes = std::uint64_t{2} << 20;

  SECTION("a memory file where the cuMem export belongs") {
    same_host::Fd memory_file(::memfd_create("not-a-cumem-export", MFD_CLOEXEC));
    REQUIRE(memory_file);
    REQUIRE(::ftruncate(memory_file.get(), static_cast<off_t>(kAllocationBytes)) == 0);
    const std::string error =
        connect_error(dir.path(), backend, sender_uuid, kAllocationBytes, memory_file.get());
    CAPTURE(error, own, sender);
    CHECK_THAT(error, Catch::StartsWith("kTransport: "));
    CHECK_THAT(error, Catch::Contains("cuMemImportFromShareableHandle"));
    CHECK_THAT(error, Catch::Contains(sender + " (the sender's GPU)"));
    CHECK_THAT(error, Catch::Contains("this receiver is device 0 (" + own + ")"));
    CHECK_THAT(error, Catch::Contains(dir.path()));
    std::printf("same_host_gpu: import refused: %s\n", error.c_str());
  }
  SECTION("no descriptor at all") {
    const std::string error = connect_error(dir.path(), backend, sender_uuid, kAllocationBytes, -1);
    CAPTURE(error);
    CHECK_THAT(error, Catch::StartsWith("kTransport: "));
    CHECK_THAT(error, Catch::Contains("carried no file descriptor"));
  }
  SECTION("an announced allocation smaller than the two slots") {
    same_host::Fd memory_file(::memfd_create("small", MFD_CLOEXEC));
    REQUIRE(memory_file);
    const std::string error =
        connect_error(dir.path(), backend, sender_uuid, 4096, memory_file.get());
    CAPTURE(error);
    CHECK_THAT(error, Catch::StartsWith("kTransport: "));
    CHECK_THAT(error, Catch::Contains("4096 bytes") && Catch::Contains("2 slots of 4096 bytes"));
  }
}

// ---------------------------------------------------------------------------------------------
// 5. A receiver leaves no GPU work waiting for the trainer: the engine may synchronize the whole
//    device while a receive waits for its doorbells.
// ---------------------------------------------------------------------------------------------

namespace {

constexpr std::size_t kSyncSlotBytes = std::size_t{64} << 10;
constexpr std::size_t kSyncBytes = 3 * kSyncSlotBytes + 123;  // four chunks, the last partial

std::uint8_t sync_byte(std::size_t i) { return static_cast<std::uint8_t>((i * 7 + 3) & 0xff); }

// Ends the transport when the scope ends, whatever ends it: a receive still waiting on its thread
// returns (host-gated), and a stream still parked on a doorbell goes on - so that the futures
// declared before it can be destroyed.
struct AbortAtExit {
  SameHostTransport& transport;
  ~AbortAtExit() { transport.abort(); }
};

}  // namespace

// The trainer of the case below. Environment: SS_SHG_PATH, SS_SHG_SYNCED (a file the engine
// creates once its device synchronize returned). Serves, waits for that file, broadcasts
// kSyncBytes of sync_byte(i) once and waits until the engine acked every chunk.
TEST_CASE("same-host gpu sync trainer child", "[.same_host_gpu_sync_trainer]") {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() == 1) std::_Exit(3);
  const char* path = std::getenv("SS_SHG_PATH");
  const char* synced = std::getenv("SS_SHG_SYNCED");
  REQUIRE(path != nullptr);
  REQUIRE(synced != nullptr);
  CudaBackend backend(0);
  auto transport = SameHostTransport::serve(path, kToken, 1, backend, SameHostMemory::kDevice,
                                            kSyncSlotBytes, process_config());
  std::vector<std::uint8_t> host(kSyncBytes);
  for (std::size_t i = 0; i < host.size(); ++i) host[i] = sync_byte(i);
  void* data = nullptr;
  REQUIRE(cudaMalloc(&data, kSyncBytes) == cudaSuccess);
  REQUIRE(cudaMemcpy(data, host.data(), kSyncBytes, cudaMemcpyHostToDevice) == cudaSuccess);
  wait_until([&] { return std::filesystem::exists(synced); },
             "the engine's device synchronize (its file " + std::string(synced) + ")", 60s);
  auto stream = backend.create_stream(StreamPriority::kNormal);
  transport->broadcast_async(data, kSyncBytes, 0, *stream);
  auto done = backend.create_event();
  backend.event_record(*done, *stream);
  wait_event(backend, *done, "the broadcast (every chunk acked by the engine)");
  INFO("async_error: " << transport->async_error().value_or("none"));
  REQUIRE(!transport->async_error().has_value());
  std::printf("sent\n");
  std::fflush(stdout);
  (void)cudaFree(data);
}

TEST_CASE("same-host gpu processes: the engine synchronizes the device while a receive waits for "
          "a trainer that rings only afterwards",
          "[same_host][gpu][processes]") {
  // Before, a receiver enqueued "wait for the doorbell" on its stream at once; a device-wide
  // synchronize in the engine's process then waited for the trainer, which waits for the engine.
  Watchdog watchdog(120s);
  SocketDir dir;
  const std::filesystem::path synced = dir.dir / "synced";
  auto trainer = spawn_self("[.same_host_gpu_sync_trainer]",
                            {"SS_SHG_PATH=" + dir.path(), "SS_SHG_SYNCED=" + synced.string()});
  CudaBackend backend(0);
  SameHostConfig config = process_config();
  config.doorbell_timeout = 60s;  // only the trainer's own pace, never this deadline, may end it
  auto transport = SameHostTransport::connect(dir.path(), kToken, 1, backend, config);
  void* received = nullptr;
  REQUIRE(cudaMalloc(&received, kSyncBytes) == cudaSuccess);
  REQUIRE(cudaMemset(received, 0, kSyncBytes) == cudaSuccess);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  auto stream = backend.create_stream(StreamPriority::kLow);

  // The receiver's own thread posts the receive.
  auto receiving = std::async(std::launch::async, [&] {
    transport->broadcast_async(received, kSyncBytes, 0, *stream);
  });
  std::future<std::pair<cudaError_t, double>> syncing;
  AbortAtExit abort_at_exit{*transport};

  // The trainer rings only once this process synchronized, so the receive cannot have returned
  // yet: a receiver whose call returns here enqueued work that waits for the trainer.
  CHECK(receiving.wait_for(200ms) == std::future_status::timeout);

  // The engine's thread: a fresh allocation freed, then the whole device synchronized.
  syncing = std::async(std::launch::async, [] {
    const auto start = Clock::now();
    void* fresh = nullptr;
    cudaError_t status = cudaMalloc(&fresh, std::size_t{1} << 20);
    if (status == cudaSuccess) status = cudaFree(fresh);
    if (status == cudaSuccess) status = cudaDeviceSynchronize();
    return std::make_pair(status, seconds_since(start));
  });
  if (syncing.wait_for(2s) != std::future_status::ready) {
    transport->abort();  // lets a stream parked on the doorbell go, so that the case can end
    FAIL("the engine's cudaFree + cudaDeviceSynchronize did not return within 2 s while a "
         "receive waited for a doorbell the trainer rings only afterwards: the receiver left GPU "
         "work waiting for the other process");
  }
  const auto [status, seconds] = syncing.get();
  REQUIRE(status == cudaSuccess);
  std::printf("same_host_gpu: device synchronize during a pending receive: %.3f s\n", seconds);

  { std::ofstream(synced.string()) << "synced\n"; }
  REQUIRE(receiving.wait_for(30s) == std::future_status::ready);
  receiving.get();
  auto done = backend.create_event();
  backend.event_record(*done, *stream);
  REQUIRE(backend.event_wait_for(*done, 30s));
  INFO("async_error: " << transport->async_error().value_or("none"));
  REQUIRE(!transport->async_error().has_value());
  std::vector<std::uint8_t> host(kSyncBytes);
  REQUIRE(cudaMemcpy(host.data(), received, kSyncBytes, cudaMemcpyDeviceToHost) == cudaSuccess);
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < host.size(); ++i) wrong += host[i] != sync_byte(i) ? 1 : 0;
  CHECK(wrong == 0);
  wait_for_output(*trainer, "sent\n");
  require_exited_zero(*trainer);
  (void)cudaFree(received);
}

TEST_CASE("same-host gpu: a doorbell that never comes ends the receive at "
          "SameHostConfig::doorbell_timeout, enqueueing nothing",
          "[same_host][gpu]") {
  Watchdog watchdog(120s);
  SocketDir dir;
  CudaBackend sender_backend(0);
  CudaBackend receiver_backend(0);
  auto serving = std::async(std::launch::async, [&] {
    return SameHostTransport::serve(dir.path(), kToken, 1, sender_backend,
                                    SameHostMemory::kDevice, kSyncSlotBytes, process_config());
  });
  SameHostConfig config = process_config();
  config.doorbell_timeout = 500ms;
  auto receiver = SameHostTransport::connect(dir.path(), kToken, 1, receiver_backend, config);
  REQUIRE(serving.wait_for(30s) == std::future_status::ready);
  auto sender = serving.get();  // never broadcasts

  void* received = nullptr;
  REQUIRE(cudaMalloc(&received, kSyncBytes) == cudaSuccess);
  REQUIRE(cudaMemset(received, 0xab, kSyncBytes) == cudaSuccess);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  auto stream = receiver_backend.create_stream(StreamPriority::kLow);
  const auto start = Clock::now();
  receiver->broadcast_async(received, kSyncBytes, 0, *stream);
  const auto took = Clock::now() - start;
  CHECK(took >= 500ms);
  CHECK(took < 5s);
  const std::string error = receiver->async_error().value_or("");
  CAPTURE(error);
  CHECK_THAT(error, Catch::Contains("chunk 0") && Catch::Contains("500 ms") &&
                        Catch::Contains("SameHostConfig::doorbell_timeout"));
  // Nothing was enqueued: an event behind it completes at once, the buffer is untouched, and a
  // later broadcast returns at once.
  auto done = receiver_backend.create_event();
  receiver_backend.event_record(*done, *stream);
  CHECK(receiver_backend.event_wait_for(*done, 5s));
  const auto again = Clock::now();
  receiver->broadcast_async(received, kSyncBytes, 0, *stream);
  CHECK(Clock::now() - again < 100ms);
  std::vector<std::uint8_t> host(kSyncBytes);
  REQUIRE(cudaMemcpy(host.data(), received, kSyncBytes, cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(std::count(host.begin(), host.end(), std::uint8_t{0xab}) ==
        static_cast<std::ptrdiff_t>(kSyncBytes));
  (void)cudaFree(received);
}
