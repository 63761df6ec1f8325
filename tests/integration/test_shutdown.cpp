// Shutdown from any state, and abort/re-create cycles: shutdown returns within a bound whatever
// the receiver is doing, the engine keeps its weights until the receiver is destroyed, and
// destroying it frees every allocation and joins every thread.
//
// How each test was checked to fail without its behaviour: mutation 11 leaves the receiver's
// stream thread running, mutation 12 leaves one allocation behind (tests/mutations/11-* and 12-*,
// applied by scripts/mutation_check.sh): the cycle test fails on the thread count and on the
// allocated bytes respectively. Making wait_for_buckets ignore `stopping` made the mid-receive
// shutdown take the 10 s injected delay: over the bound.
#include <catch2/catch.hpp>

#include <atomic>
#include <thread>

#include "deadline.h"
#include "live_hash.h"
#include "loopback_rig.h"
#include "process_resources.h"
#include "shadowsync/error.h"

using namespace shadowsync;
using namespace shadowsync::testing;

namespace {

using namespace std::chrono_literals;

// Generous for sanitizer builds on a loaded machine; a shutdown that waits for a deadline (10 s
// of injected delay, a 60 s update deadline) is far above it.
constexpr auto kShutdownBound = 2s;

Layout shutdown_layout() {
  return Layout::build({{"w0", DType::kFloat32, {700}, "base"},
                        {"w1", DType::kBFloat16, {33, 17}, "base"},
                        {"a.A", DType::kBFloat16, {64}, "lora_a"}},
                       {.bucket_bytes = 1024});
}

const std::vector<std::string> kAllGroups = {"base", "lora_a"};

// The baseline, taken after one receiver lived and died: a sanitizer runtime (TSan) starts a
// helper thread of its own with the first thread the process creates, and keeps it.
ProcessResources warmed_up_baseline(const Layout& layout) {
  { LoopbackRig warm_up(layout); }
  return ProcessResources::now();
}

enum class State { kIdle, kMidReceive, kUpdatePending, kEngineMidStep };

const char* name(State state) {
  switch (state) {
    case State::kIdle: return "idle";
    case State::kMidReceive: return "mid-receive";
    case State::kUpdatePending: return "update pending";
    case State::kEngineMidStep: return "engine mid-step";
  }
  return "?";
}

}  // namespace

TEST_CASE("shutdown: from any state it returns within a bound, then everything is freed") {
  const State state =
      GENERATE(State::kIdle, State::kMidReceive, State::kUpdatePending, State::kEngineMidStep);
  CAPTURE(name(state));
  const Layout layout = shutdown_layout();
  // Broadcasts per update: the buckets and the checksum block (SenderConfig's default).
  const std::uint64_t n =
      make_update_header(layout, 1, kAllGroups, SenderConfig{}.checksums).bucket_count;
  const ProcessResources baseline = warmed_up_baseline(layout);
  {
    RigOptions options;
    options.sender.update_deadline = 5000ms;
    LoopbackRig rig(layout, options);
    auto engine = std::make_unique<HostFakeEngine>(
        rig.backend(), rig.receiver(),
        FakeEngineOptions{.full_check_every = 1, .compute_time = 100us});
    Receiver& receiver = rig.receiver();
    rig.publish(1, kAllGroups).wait();
    REQUIRE(receiver.step_hook().wait_applied(1, deadline_from_now(), engine->stream()));
    engine->step();
    engine->synchronize();
    const std::uint64_t hash_v1 = live_hash(receiver);

    std::atomic<bool> stop_engine{false};
    std::thread engine_thread;
    if (state == State::kMidReceive || state == State::kEngineMidStep) {
      // Bucket 1 of update 2 is 10 s late: the receive is in flight until shutdown aborts it.
      rig.communicator().inject_delay(0, n + 1, 10s);
      rig.publish(2, kAllGroups);
      wait_until([&] { return rig.communicator().broadcasts_completed() >= n + 1; },
                 "bucket 0 of update 2 received");
    }
    if (state == State::kUpdatePending) {
      rig.publish(2, kAllGroups).wait();
      rig.wait_offered(2);
    }
    if (state == State::kEngineMidStep) {
      // The engine thread steps throughout (each step spends 100 us on its stream).
      engine_thread = std::thread([&] {
        while (!stop_engine) engine->step();
      });
      wait_until([&] { return engine->steps_done() > 5; }, "the engine stepping");
    }

    const auto start = std::chrono::steady_clock::now();
    receiver.shutdown();
    const auto took = std::chrono::steady_clock::now() - start;
    CHECK(took < kShutdownBound);
    CHECK_THROWS_AS(receiver.begin_update(make_update_header(layout, 9, kAllGroups)), Error);

    // The engine still steps on live weights until the receiver is destroyed.
    if (engine_thread.joinable()) {
      const std::uint64_t steps = engine->steps_done();
      wait_until([&] { return engine->steps_done() > steps + 5; }, "the engine stepping on");
      stop_engine = true;
      engine_thread.join();
    }
    const std::optional<std::uint64_t> applied = engine->step();  // an offer still applies
    engine->synchronize();
    INFO(engine->first_torn());
    CHECK(engine->torn_steps() == 0);
    if (state == State::kUpdatePending) {
      CHECK(applied == std::optional<std::uint64_t>{2});
    } else {
      CHECK_FALSE(applied.has_value());
      CHECK(live_hash(receiver) == hash_v1);
    }

    engine.reset();
    rig.destroy_endpoints();
    CHECK(rig.backend().bytes_allocated() == 0);
  }
  wait_back_to(baseline, std::string("shutdown while ") + name(state));
}

// Mutations 11 (11-shutdown-leaks-stream.patch) and 12 (12-shutdown-leaks-buffer.patch) make
// this fail.
TEST_CASE("shutdown: 100 abort/re-create cycles leave threads, fds and allocations at baseline") {
  const Layout layout = shutdown_layout();
  // Broadcasts per update: the buckets and the checksum block (SenderConfig's default).
  const std::uint64_t n =
      make_update_header(layout, 1, kAllGroups, SenderConfig{}.checksums).bucket_count;
  const ProcessResources baseline = warmed_up_baseline(layout);
  for (int cycle = 0; cycle < 100; ++cycle) {
    CAPTURE(cycle);
    RigOptions options;
    options.sender.update_deadline = 5000ms;
    LoopbackRig rig(layout, options);
    {
      HostFakeEngine engine(rig.backend(), rig.receiver());
      Receiver& receiver = rig.receiver();
      rig.publish(1, kAllGroups).wait();
      REQUIRE(receiver.step_hook().wait_applied(1, deadline_from_now(), engine.stream()));

      // Abort update 2 in flight: bucket 0 landed, bucket 1 is held back.
      rig.communicator().inject_delay(0, n + 1, 10s);
      PublishHandle second = rig.publish(2, kAllGroups);
      wait_until([&] { return rig.communicator().broadcasts_completed() >= n + 1; },
                 "bucket 0 of update 2 received");
      receiver.abort_update();
      wait_until([&] { return receiver.stats().updates_failed == 1; }, "update 2 aborted");
      REQUIRE_THROWS_AS(second.wait(), Error);
      REQUIRE_THAT(receiver.stats().last_error, Catch::Contains("aborted by request"));

      // Re-create the transport; the next update applies.
      rig.reconnect();
      rig.publish(3, {"lora_a"}).wait();
      REQUIRE(receiver.step_hook().wait_applied(3, deadline_from_now(), engine.stream()));
      engine.step();
      engine.synchronize();
      REQUIRE(engine.torn_steps() == 0);
    }
    rig.destroy_endpoints();
    REQUIRE(rig.backend().bytes_allocated() == 0);
  }
  wait_back_to(baseline, "100 abort/re-create cycles");
}
