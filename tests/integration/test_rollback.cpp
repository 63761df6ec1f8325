// Rollback: the slot a swap left stays intact until the next update starts receiving, so
// StepHook::rollback can flip back to it in one swap on the engine thread; once a new update
// wrote that slot it says so and changes nothing.
//
// How each test was checked to fail without its behaviour: mutation 10
// (tests/mutations/10-rollback-after-overwrite.patch) lets rollback flip to a slot being
// overwritten: the "refused" test fails.
// Skipping the release record of the left slot in StepHook::rollback (invariant 2 on the rollback
// path: flipping `live` by hand instead of SlotTable::make_live, which records it) makes "the next
// update waits for the steps still reading the slot a rollback left" fail: update 3 lands in that
// slot before the held steps read it, and they read version 3 where they expected 2 (built that
// way, seen failing, restored).
#include <catch2/catch.hpp>

#include <atomic>
#include <future>
#include <thread>

#include "deadline.h"
#include "live_hash.h"
#include "loopback_rig.h"
#include "shadowsync/error.h"

using namespace shadowsync;
using namespace shadowsync::testing;

namespace {

Layout rollback_layout() {
  return Layout::build({{"w0", DType::kFloat32, {700}, "base"},
                        {"w1", DType::kBFloat16, {33, 17}, "base"},
                        {"a.A", DType::kBFloat16, {64}, "lora_a"}},
                       {.bucket_bytes = 1024});
}

}  // namespace

TEST_CASE("rollback: flips back to the previous slot in one swap; the engine reads its bytes") {
  const Layout layout = rollback_layout();
  LoopbackRig rig(layout);
  HostFakeEngine engine(rig.backend(), rig.receiver(), {.full_check_every = 1});
  StepHook& hook = rig.receiver().step_hook();
  std::vector<AppliedUpdate> callbacks;
  std::vector<std::vector<GroupSwap>> callback_swaps;
  hook.set_swap_callback([&](const AppliedUpdate& applied) {
    callbacks.push_back(applied);
    callback_swaps.push_back(*applied.swaps);
  });

  CHECK_THROWS_WITH(hook.rollback(engine.stream()), "rollback: no update has been applied yet");

  rig.publish(1, {"base", "lora_a"}).wait();
  REQUIRE(hook.wait_applied(1, deadline_from_now(), engine.stream()));
  engine.step();
  engine.synchronize();
  const std::uint64_t hash_v1 = live_hash(rig.receiver());
  const std::byte* base_v1 = hook.live_arena(0);

  rig.publish(2, {"base"}).wait();
  REQUIRE(hook.wait_applied(2, deadline_from_now(), engine.stream()));
  engine.step();
  engine.synchronize();
  REQUIRE(live_hash(rig.receiver()) != hash_v1);

  CHECK(hook.rollback(engine.stream()) == 2);
  CHECK(hook.live_arena(0) == base_v1);  // one pointer flip, no copy
  CHECK(hook.live_content_version(0) == 1);
  CHECK(hook.live_content_version(1) == 1);
  CHECK(hook.applied_version() == 2);  // versions made live only increase
  engine.step();
  engine.synchronize();
  CHECK(live_hash(rig.receiver()) == hash_v1);
  REQUIRE(callbacks.size() == 3);
  CHECK(callbacks.back().rollback);
  CHECK(callbacks.back().version == 2);
  REQUIRE(callback_swaps.back().size() == 1);  // only the group update 2 carried
  CHECK(callback_swaps.back()[0].group == 0);
  CHECK(callback_swaps.back()[0].content_version == 1);

  // One level only.
  CHECK_THROWS_WITH(hook.rollback(engine.stream()),
                    "rollback: update 2 was already rolled back (one level is kept)");
  CHECK(live_hash(rig.receiver()) == hash_v1);

  // The receiver adopts the rollback: the next update lands in the slot version 2 left.
  rig.publish(3, {"base", "lora_a"}).wait();
  REQUIRE(hook.wait_applied(3, deadline_from_now(), engine.stream()));
  engine.step();
  engine.synchronize();
  CHECK(hook.live_content_version(0) == 3);
  CHECK(hook.live_content_version(1) == 3);
  CHECK(hook.live_arena(0) != base_v1);
  INFO(engine.first_torn());
  CHECK(engine.torn_steps() == 0);
}

// Mutation 10 (10-rollback-after-overwrite.patch) makes this fail: rollback flips to a slot being
// written.
TEST_CASE("rollback: refused once a new update started writing the previous slot") {
  const Layout layout = rollback_layout();
  LoopbackRig rig(layout);
  HostFakeEngine engine(rig.backend(), rig.receiver(), {.full_check_every = 1});
  StepHook& hook = rig.receiver().step_hook();
  for (std::uint64_t v = 1; v <= 2; ++v) {
    rig.publish(v, {"base", "lora_a"}).wait();
    REQUIRE(hook.wait_applied(v, deadline_from_now(), engine.stream()));
    engine.step();
  }
  engine.synchronize();
  const std::uint64_t hash_v2 = live_hash(rig.receiver());

  rig.publish(3, {"base"}).wait();  // received into version 1's slot of base, now pending
  rig.wait_offered(3);
  try {
    hook.rollback(engine.stream());
    FAIL("rollback succeeded although update 3 overwrote the previous slot");
  } catch (const Error& error) {
    CHECK(error.code() == ErrorCode::kSuperseded);
    CHECK(std::string(error.what()) ==
          "rollback: no longer possible, update 3 started receiving into the previous slots");
  }
  CHECK(live_hash(rig.receiver()) == hash_v2);  // nothing changed
  CHECK(hook.live_content_version(0) == 2);
  REQUIRE(engine.step() == std::optional<std::uint64_t>{3});
  engine.synchronize();
  INFO(engine.first_torn());
  CHECK(engine.torn_steps() == 0);
  CHECK(rig.history().check(engine.records()) == "");
}

TEST_CASE("rollback: racing with the receiver, every step still reads one whole version") {
  const Layout layout = rollback_layout();
  RigOptions options;
  options.backend.max_task_jitter = std::chrono::microseconds(50);  // shuffles the streams
  LoopbackRig rig(layout, options);
  HostFakeEngine engine(rig.backend(), rig.receiver(), {.full_check_every = 1});
  StepHook& hook = rig.receiver().step_hook();
  constexpr std::uint64_t kUpdates = 30;
  std::atomic<bool> trainer_done{false};
  std::string trainer_error;  // written before trainer_done
  std::thread trainer([&] {
    try {
      for (std::uint64_t v = 1; v <= kUpdates; ++v) rig.publish(v, {"base", "lora_a"}).wait();
    } catch (const std::exception& e) {
      trainer_error = e.what();
    }
    trainer_done = true;
  });
  // The engine thread: steps, and tries a rollback after every swap; each either flips back or is
  // refused because the next update already started.
  int rolled_back = 0;
  int refused = 0;
  const auto deadline = deadline_from_now();
  while (!trainer_done || (trainer_error.empty() && hook.applied_version() < kUpdates)) {
    if (std::chrono::steady_clock::now() > deadline) {
      FAIL("update " << kUpdates << " was never applied (applied " << hook.applied_version()
                     << ", rolled back " << rolled_back << ", refused " << refused << ")");
    }
    const bool swapped = engine.step().has_value();
    engine.synchronize();  // a real engine's steps take time: no unbounded backlog of them
    if (swapped) {
      const std::uint64_t live = hook.live_content_version(0);
      try {
        const std::uint64_t undone = hook.rollback(engine.stream());
        CHECK(undone == live);                       // it returns the version undone
        CHECK(hook.live_content_version(0) < live);  // and the previous one is live again
        ++rolled_back;
      } catch (const Error& error) {
        REQUIRE(error.code() == ErrorCode::kSuperseded);
        ++refused;
      }
    }
  }
  trainer.join();
  CHECK(trainer_error == "");
  CHECK(rig.receiver().stats().last_error == "");
  engine.step();
  engine.synchronize();
  INFO(engine.first_torn() << "; rolled back " << rolled_back << ", refused " << refused);
  CHECK(engine.torn_steps() == 0);
  CHECK(rolled_back + refused > 0);
  CHECK(hook.applied_version() == kUpdates);
}

// Invariant 2 on the rollback path. The engine stream is held while steps that read version 2's
// slot wait on it; the rollback leaves that slot, and update 3 is received into it. The receive
// must wait until those steps ran: the rollback's release record is what it waits on.
TEST_CASE("rollback: the next update waits for the steps still reading the slot a rollback left") {
  const Layout layout = rollback_layout();
  LoopbackRig rig(layout);
  HostFakeEngine engine(rig.backend(), rig.receiver(), {.full_check_every = 1});
  StepHook& hook = rig.receiver().step_hook();
  for (std::uint64_t v = 1; v <= 2; ++v) {
    rig.publish(v, {"base"}).wait();
    REQUIRE(hook.wait_applied(v, deadline_from_now(), engine.stream()));
    engine.step();
  }
  engine.synchronize();
  const std::byte* slot_v2 = hook.live_arena(0);

  // Hold the engine stream: the steps enqueued now read version 2's slot once the gate opens.
  std::promise<void> gate;
  rig.backend().launch_async(engine.stream(), [opened = gate.get_future().share()] { opened.wait(); });
  for (int i = 0; i < 4; ++i) CHECK_FALSE(engine.step().has_value());
  REQUIRE(hook.rollback(engine.stream()) == 2);  // records the release of version 2's slot
  REQUIRE(hook.live_arena(0) != slot_v2);

  // Version 3 goes into version 2's slot (the one the rollback left), which the held steps have
  // not read yet. 300 ms is a window to observe a wrong early landing in, not a wait to win a
  // race: with the release record, the receive cannot complete before the gate opens at all.
  PublishHandle third = rig.publish(3, {"base"});
  const bool landed_early = third.wait_for(std::chrono::milliseconds(300));
  CHECK_FALSE(landed_early);  // the receive waits for the engine stream
  gate.set_value();
  engine.synchronize();
  INFO(engine.first_torn());
  CHECK(engine.torn_steps() == 0);  // the held steps read version 2, whole

  third.wait();
  REQUIRE(hook.wait_applied(3, deadline_from_now(), engine.stream()));
  CHECK(hook.live_arena(0) == slot_v2);
  engine.step();
  engine.synchronize();
  CHECK(engine.torn_steps() == 0);
  CHECK(hook.live_content_version(0) == 3);
}
