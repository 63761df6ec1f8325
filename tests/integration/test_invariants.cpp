// One test per invariant, numbered 1 to 7 as in docs/architecture.md; each test's name states its
// invariant. Each names the mutation (a patch under tests/mutations/) that breaks its invariant on
// purpose; scripts/mutation_check.sh applies each patch to a copy of the tree, builds this test
// and shows that the test named here fails with it.
#include <catch2/catch.hpp>

#include <atomic>
#include <future>

#include "counting_backend.h"
#include "deadline.h"
#include "live_hash.h"
#include "loopback_rig.h"
#include "shadowsync/error.h"

using namespace shadowsync;
using namespace shadowsync::testing;

namespace {

Layout invariant_layout() {
  return Layout::build({{"w0", DType::kFloat32, {700}, "base"},
                        {"w1", DType::kBFloat16, {33, 17}, "base"},
                        {"w2", DType::kInt8, {999}, "base"},
                        {"a.A", DType::kBFloat16, {64}, "lora_a"},
                        {"a.B", DType::kBFloat16, {64}, "lora_a"}},
                       {.bucket_bytes = 1024});
}

// Every step the engine ran read each group whole and at a version the trainer published, in
// order (the oracle's verdict over the publish history).
void check_every_step_whole(LoopbackRig& rig, HostFakeEngine& engine) {
  engine.synchronize();
  INFO(engine.first_torn());
  CHECK(engine.torn_steps() == 0);
  CHECK(rig.history().check(engine.records()) == "");
}

}  // namespace

// Mutation 1 (01-swap-one-group-per-step.patch) makes this fail: steps see base and adapter at
// different versions, which the history check reports.
TEST_CASE("invariant 1: no torn step, every step sees each group at its last applied version") {
  const Layout layout = invariant_layout();
  LoopbackRig rig(layout);
  HostFakeEngine engine(rig.backend(), rig.receiver(), {.full_check_every = 1});
  for (std::uint64_t v = 1; v <= 40; ++v) {
    rig.publish(v, {"base", "lora_a"}).wait();
    rig.wait_offered(v);
    for (int i = 0; i < 3; ++i) engine.step();
  }
  check_every_step_whole(rig, engine);
  CHECK(rig.receiver().step_hook().applied_version() == 40);
}

// Mutation 2 (02-skip-release-wait.patch) makes this fail: version 3 lands in the slot that the
// blocked steps still read.
TEST_CASE("invariant 2: the receiver never writes a slot the engine stream still reads") {
  const Layout layout = invariant_layout();
  LoopbackRig rig(layout);
  HostFakeEngine engine(rig.backend(), rig.receiver(), {.full_check_every = 1});
  rig.publish(1, {"base", "lora_a"}).wait();
  REQUIRE(rig.receiver().step_hook().wait_applied(1, deadline_from_now(), engine.stream()));
  engine.step();
  engine.synchronize();

  // Hold the engine stream: steps enqueued now read version 1's slot only once the gate opens.
  std::promise<void> gate;
  rig.backend().launch_async(engine.stream(), [opened = gate.get_future().share()] { opened.wait(); });
  for (int i = 0; i < 4; ++i) CHECK_FALSE(engine.step().has_value());

  rig.publish(2, {"base", "lora_a"}).wait();  // lands in the other slot
  rig.wait_offered(2);
  // The swap records the release of version 1's slot after the four held steps.
  REQUIRE(engine.step() == std::optional<std::uint64_t>{2});

  // Version 3 must go into version 1's slot, which the held steps have not read yet.
  PublishHandle third = rig.publish(3, {"base", "lora_a"});
  const bool landed_early = third.wait_for(std::chrono::milliseconds(300));
  CHECK_FALSE(landed_early);  // the receive waits for the engine stream
  gate.set_value();
  third.wait();
  REQUIRE(rig.receiver().step_hook().wait_applied(3, deadline_from_now(), engine.stream()));
  engine.step();
  check_every_step_whole(rig, engine);
}

// Mutation 3 (03-publish-before-complete.patch) makes this fail: the engine swaps to a slot whose
// last bucket has not arrived.
TEST_CASE("invariant 3: the engine never reads a slot before its receive completed") {
  const Layout layout = invariant_layout();
  LoopbackRig rig(layout);
  HostFakeEngine engine(rig.backend(), rig.receiver(), {.full_check_every = 1});
  // Data buckets only (the checksum block, if any, comes after them).
  const std::uint64_t buckets = make_update_header(layout, 1, {"base", "lora_a"}).bucket_count;
  // The receiver's last data bucket of update 1 arrives late.
  rig.communicator().inject_delay(1, buckets - 1, std::chrono::milliseconds(300));
  PublishHandle first = rig.publish(1, {"base", "lora_a"});
  while (!first.done()) engine.step();  // the engine keeps generating throughout
  REQUIRE(rig.receiver().step_hook().wait_applied(1, deadline_from_now(), engine.stream()));
  for (int i = 0; i < 3; ++i) engine.step();
  check_every_step_whole(rig, engine);
}

// Mutation 4 (04-work-on-fast-path.patch) makes this fail: the fast path calls the backend.
TEST_CASE("invariant 4: with nothing pending the step hook makes no backend call and no swap") {
  const Layout layout = invariant_layout();
  CountingBackend backend;
  Receiver receiver(layout, backend, nullptr);
  auto engine_stream = backend.create_stream(StreamPriority::kNormal);
  StepHook& hook = receiver.step_hook();
  std::byte* live = hook.live_arena(0);
  const int before = backend.calls.load();
  for (int i = 0; i < 10'000; ++i) REQUIRE_FALSE(hook.before_step(*engine_stream).has_value());
  CHECK(backend.calls.load() == before);
  CHECK(hook.live_arena(0) == live);
  CHECK(hook.applied_version() == 0);
}

// Mutation 5 (05-drop-carried-groups.patch) makes this fail: the LoRA-only update lands on the old
// base.
TEST_CASE("invariant 5: latest wins, and a superseded update's groups stay in the pending one") {
  const Layout layout = invariant_layout();
  LoopbackRig rig(layout);
  HostFakeEngine engine(rig.backend(), rig.receiver(), {.full_check_every = 1});
  // The engine is busy elsewhere: three updates arrive before its next step.
  rig.publish(1, {"base", "lora_a"}).wait();
  rig.publish(2, {"base"}).wait();
  rig.publish(3, {"lora_a"}).wait();
  rig.wait_offered(3);
  REQUIRE(engine.step() == std::optional<std::uint64_t>{3});  // only the latest is applied
  CHECK(rig.receiver().step_hook().live_content_version(0) == 2);  // base of 2, not of 1 or 0
  CHECK(rig.receiver().step_hook().live_content_version(1) == 3);
  CHECK(rig.receiver().stats().updates_superseded == 2);
  engine.step();
  check_every_step_whole(rig, engine);
}

// Mutation 6 (06-offer-failed-update.patch) makes this fail: the half-received update becomes live.
TEST_CASE("invariant 6: a failed update is discarded and the live weights are untouched") {
  const Layout layout = invariant_layout();
  // Broadcasts per update: the buckets and the checksum block (SenderConfig's default).
  const std::uint64_t buckets =
      make_update_header(layout, 1, {"base", "lora_a"}, SenderConfig{}.checksums).bucket_count;
  const std::uint64_t drop_at = GENERATE_COPY(std::uint64_t{0}, std::uint64_t{1}, buckets - 1);
  CAPTURE(drop_at, buckets);
  RigOptions options;
  options.receiver.bucket_deadline = std::chrono::milliseconds(200);
  options.sender.update_deadline = std::chrono::milliseconds(2000);
  LoopbackRig rig(layout, options);
  HostFakeEngine engine(rig.backend(), rig.receiver(), {.full_check_every = 1});
  rig.publish(1, {"base", "lora_a"}).wait();
  REQUIRE(rig.receiver().step_hook().wait_applied(1, deadline_from_now(), engine.stream()));
  engine.step();
  engine.synchronize();
  const std::uint64_t hash = live_hash(rig.receiver());

  // The sender's process dies after `drop_at` buckets of update 2 (its broadcast calls are
  // counted from the start: update 1 made `buckets` of them).
  rig.communicator().inject_drop(0, buckets + drop_at);
  PublishHandle second = rig.publish(2, {"base", "lora_a"});
  const auto deadline = deadline_from_now();
  while (rig.receiver().stats().updates_failed == 0) {
    REQUIRE(std::chrono::steady_clock::now() < deadline);
    const auto swapped = engine.step();
    INFO("swapped to " << swapped.value_or(0) << "; " << rig.receiver().stats().last_error);
    REQUIRE_FALSE(swapped.has_value());  // generation goes on on version 1
    engine.synchronize();
  }
  CHECK_THROWS_AS(second.wait(), Error);
  const ReceiverStats stats = rig.receiver().stats();
  CHECK_THAT(stats.last_error, Catch::Contains("update 2 (base+lora_a) discarded"));
  CHECK(stats.needs_transport);
  for (int i = 0; i < 3; ++i) CHECK_FALSE(engine.step().has_value());
  engine.synchronize();
  CHECK(live_hash(rig.receiver()) == hash);
  CHECK(rig.receiver().step_hook().applied_version() == 1);

  // After a new rendezvous the next good update applies.
  rig.reconnect();
  rig.publish(3, {"lora_a"}).wait();
  REQUIRE(rig.receiver().step_hook().wait_applied(3, deadline_from_now(), engine.stream()));
  engine.step();
  check_every_step_whole(rig, engine);
}

// Mutation 7 (07-wait-applied-never-applies.patch) makes this fail: the idle engine never swaps.
TEST_CASE("invariant 7: an idle engine applies an update through wait_applied") {
  const Layout layout = invariant_layout();
  LoopbackRig rig(layout);
  HostFakeEngine engine(rig.backend(), rig.receiver());
  rig.publish(1, {"base"});  // no step will ever run
  StepHook& hook = rig.receiver().step_hook();
  REQUIRE(hook.wait_applied(1, deadline_from_now(), engine.stream()));
  CHECK(hook.applied_version() == 1);
  CHECK(hook.live_content_version(0) == 1);
  // A version that never comes: wait_applied gives up at its deadline.
  CHECK_FALSE(hook.wait_applied(2, std::chrono::steady_clock::now() + std::chrono::milliseconds(50),
                                engine.stream()));
}
