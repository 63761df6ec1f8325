// The control channel between two processes: an engine that keeps decoding while it takes
// updates, and a trainer that connects to it, hands over the rendezvous id, publishes updates and
// waits for the engine's acks. On the host backend, with a TCP socket transport standing in for
// NCCL (tests/support/socket_transport.h): no GPU needed. tests/integration/test_control_e2e.cpp
// runs it as two real processes, killing the first trainer and connecting a second.
//
//   export SHADOWSYNC_CONTROL_TOKEN=$(openssl rand -hex 32)
//   control_channel engine [--port P]              # prints "listening <port>", runs until SIGTERM
//   control_channel trainer --port P [--rounds N] [--die-after-header]
//
// The engine prints one summary line when it stops and exits 0 only if no step was torn.
#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "fake_engine.h"
#include "pattern.h"
#include "shadowsync/engine_channel.h"
#include "shadowsync/host_backend.h"
#include "shadowsync/receiver.h"
#include "shadowsync/sender.h"
#include "shadowsync/trainer_channel.h"
#include "socket_transport.h"

#if defined(__SANITIZE_THREAD__)
#define SHADOWSYNC_EXAMPLE_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define SHADOWSYNC_EXAMPLE_TSAN 1
#endif
#endif
#if defined(SHADOWSYNC_EXAMPLE_TSAN)
// As in tests/support/catch_main.cpp: TSan does not model the fences moodycamel's queue (inside
// the receiver) synchronizes with; this program has no Catch main to bring the suppression.
extern "C" const char* __tsan_default_suppressions() { return "race:moodycamel::\n"; }
#endif

using namespace shadowsync;
using Clock = std::chrono::steady_clock;

namespace {

constexpr auto kDeadline = std::chrono::seconds(30);

// Small on purpose (the test runs under sanitizers), but with several buckets per group and two
// groups, so an update is more than one broadcast and a LoRA-only update is possible.
Layout example_layout() {
  return Layout::build({{"embed.weight", DType::kFloat32, {4096}, "base"},
                        {"layer0.weight", DType::kBFloat16, {64, 64}, "base"},
                        {"lm_head.weight", DType::kFloat32, {2048}, "base"},
                        {"lora.A", DType::kBFloat16, {8, 64}, "lora"},
                        {"lora.B", DType::kBFloat16, {64, 8}, "lora"}},
                       {.bucket_bytes = 8192});
}

std::atomic<bool> g_stop{false};
void on_signal(int) { g_stop.store(true); }

int run_engine(std::uint16_t port) {
  const Layout layout = example_layout();
  HostBackend backend;
  Receiver receiver(layout, backend, nullptr);  // the transport comes with the first rendezvous
  testing::HostFakeEngine engine(
      backend, receiver, {.compute_time = std::chrono::microseconds(50), .record_steps = false});
  EngineChannelConfig config;
  config.port = port;
  EngineChannel channel(
      receiver,
      [&](const RendezvousRequest& request) -> std::unique_ptr<Transport> {
        return testing::SocketTransport::connect(backend, request.unique_id, request.rank,
                                                 request.world_size, Clock::now() + kDeadline);
      },
      config);
  std::atomic<std::uint64_t> failed{0};
  receiver.set_observer([&](const UpdateReport& report) {
    if (report.outcome != UpdateOutcome::kFailed) return;
    ++failed;
    channel.report_failed(report.version, ErrorCode::kTransport, report.error);
  });
  std::signal(SIGTERM, on_signal);
  std::signal(SIGINT, on_signal);
  std::printf("listening %u\n", static_cast<unsigned>(channel.port()));
  std::fflush(stdout);

  std::uint64_t applied = 0;
  while (!g_stop.load()) {
    // The engine thread: the step hook, one decode step, and an ack when a swap happened.
    const auto version = engine.step();
    engine.synchronize();
    if (version) {
      ++applied;
      channel.report_applied(*version, engine.steps_done());
    }
    // Between batches: an engine with no requests does not spin.
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  const EngineChannelStats stats = channel.stats();
  channel.shutdown();
  receiver.shutdown();
  engine.synchronize();
  std::printf(
      "engine summary: applied=%llu last=%llu failed=%llu torn=%llu trainers=%llu "
      "rendezvous=%llu headers=%llu refused=%llu auth_failures=%llu protocol_errors=%llu\n",
      static_cast<unsigned long long>(applied),
      static_cast<unsigned long long>(receiver.step_hook().applied_version()),
      static_cast<unsigned long long>(failed.load()),
      static_cast<unsigned long long>(engine.torn_steps()),
      static_cast<unsigned long long>(stats.trainers_authenticated),
      static_cast<unsigned long long>(stats.rendezvous_done),
      static_cast<unsigned long long>(stats.headers_accepted),
      static_cast<unsigned long long>(stats.headers_refused),
      static_cast<unsigned long long>(stats.authentication_failures),
      static_cast<unsigned long long>(stats.protocol_errors));
  if (engine.torn_steps() != 0) std::printf("first torn step: %s\n", engine.first_torn().c_str());
  std::fflush(stdout);
  return engine.torn_steps() == 0 ? 0 : 1;
}

int run_trainer(std::uint16_t port, int rounds, bool die_after_header) {
  const Layout layout = example_layout();
  HostBackend backend;
  TrainerChannelConfig config;
  config.engines.push_back({"127.0.0.1", port});
  TrainerChannel channel(layout, config);
  // A restarted trainer continues above whatever the engine accepted before.
  const std::uint64_t first = channel.highest_accepted_version() + 1;

  // Rendezvous: this side listens (rank 0), the engine joins with the id the channel carries.
  auto transport = testing::SocketTransport::listen(backend, 2);
  channel.send_rendezvous(transport->id());
  transport->accept_peers(Clock::now() + kDeadline);
  if (!channel.wait_rendezvous(Clock::now() + kDeadline)) {
    throw std::runtime_error("the engine did not finish the rendezvous in time");
  }
  Sender sender(layout, backend, std::move(transport));
  std::printf("trainer: connected, engine live at %llu, first version %llu\n",
              static_cast<unsigned long long>(channel.engines()[0].applied_version),
              static_cast<unsigned long long>(first));
  std::fflush(stdout);

  const std::vector<std::vector<std::string>> kinds = {{"base", "lora"}, {"lora"}, {"base"}};
  int acked = 0;
  for (int i = 0; i < rounds; ++i) {
    const std::uint64_t version = first + static_cast<std::uint64_t>(i);
    const auto& groups = kinds[static_cast<std::size_t>(i) % kinds.size()];
    testing::HostTensors tensors(layout, groups, version);
    PublishHandle handle = sender.publish(version, groups, tensors.sources());
    channel.send_update_header(handle.header());
    handle.wait();
    if (!channel.wait_until_all_applied(version, Clock::now() + kDeadline)) {
      throw std::runtime_error(fmt::format("update {} was not acked in time", version));
    }
    ++acked;
  }
  std::printf("trainer: %d rounds acked, last version %llu at engine step %llu\n", acked,
              static_cast<unsigned long long>(channel.engines()[0].applied_version),
              static_cast<unsigned long long>(channel.engines()[0].applied_step));
  std::fflush(stdout);
  if (die_after_header) {
    // A trainer that crashes after announcing an update, before sending a byte of it: no
    // goodbye, the engine's receive finds its peer gone.
    const UpdateHeader header = make_update_header(layout, first + rounds, {"base"});
    channel.send_update_header(header);
    std::raise(SIGKILL);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  if (argc < 2) throw std::runtime_error("usage: control_channel engine|trainer [options]");
  const std::string role = argv[1];
  std::uint16_t port = 0;
  int rounds = 50;
  bool die_after_header = false;
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--port" && i + 1 < argc) {
      port = static_cast<std::uint16_t>(std::atoi(argv[++i]));
    } else if (arg == "--rounds" && i + 1 < argc) {
      rounds = std::atoi(argv[++i]);
    } else if (arg == "--die-after-header") {
      die_after_header = true;
    } else {
      throw std::runtime_error(fmt::format("unknown argument '{}'", arg));
    }
  }
  if (role == "engine") return run_engine(port);
  if (role == "trainer") return run_trainer(port, rounds, die_after_header);
  throw std::runtime_error(fmt::format("unknown role '{}' (engine or trainer)", role));
} catch (const std::exception& error) {
  std::fprintf(stderr, "control_channel: %s\n", error.what());
  return 2;
}
