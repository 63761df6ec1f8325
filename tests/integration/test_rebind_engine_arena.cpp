// Rebind over an engine arena (vLLM's graph pairs): the engine made the two slots itself, before
// it met the receiver, and captured one set of CUDA graphs over each. The receiver takes the
// arena's two slot mappings as its slots; a swap flips which one is live and the engine switches
// to the graph set of that slot. Nothing is copied or remapped at a swap, and the arena's live
// range is never touched. Runs on RemapHostBackend (remap_host_backend.h): HostArena's slots are
// host memory and it counts remaps.
//
// Checked to fail without its behaviour (each broken by hand once, then restored): with
// SlotTable's constructor ignoring the arena under rebind (the receiver's own slots), the first
// test fails on the live address; starting from slot 0 instead of the arena's live slot, the
// second fails; with make_live not recording the old slot's release event, the stress test sees
// torn steps.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstddef>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "deadline.h"
#include "loopback_rig.h"
#include "remap_host_backend.h"
#include "update_stress.h"

using namespace shadowsync;
using namespace shadowsync::testing;

namespace {

Layout base_layout() {
  return Layout::build({{"embed", DType::kBFloat16, {97, 16}, "base"},
                        {"l0.w", DType::kFloat32, {300}, "base"},
                        {"l1.w", DType::kFloat16, {513}, "base"}},
                       {.bucket_bytes = 1024});
}

// A rig whose receiver rebinds between the two slots of `arena`, the engine's.
struct EngineSlotsRig {
  explicit EngineSlotsRig(int live_slot = 0, std::chrono::microseconds compute_time = {},
                          bool jitter = false)
      : layout(base_layout()),
        arena(std::make_shared<HostArena>(layout.groups()[0].arena_bytes(), live_slot)),
        rig(layout, options(jitter)),
        engine(rig.backend(), rig.receiver(),
               {.full_check_every = 1, .compute_time = compute_time}) {
    arena->wait_for(rig.backend());
  }

  RigOptions options(bool jitter) {
    RigOptions o;
    o.receiver.swap_strategy = SwapStrategy::kRebind;
    o.remap_on_host = true;  // RemapHostBackend: the HostArena's backend
    o.engine_arenas = {arena};
    if (jitter) {
      o.backend.max_task_jitter = std::chrono::microseconds(20);
      o.backend.jitter_seed = 5;
    }
    return o;
  }

  StepHook& hook() { return rig.receiver().step_hook(); }

  const Layout layout;
  std::shared_ptr<HostArena> arena;
  LoopbackRig rig;
  HostFakeEngine engine;
};

}  // namespace

TEST_CASE("rebind over an engine arena: each swap flips between the arena's two slot mappings; "
          "nothing is remapped or copied") {
  EngineSlotsRig h;
  LoopbackRig& rig = h.rig;
  StepHook& hook = h.hook();
  REQUIRE(hook.live_arena(0) == h.arena->slot_address(0));
  for (std::uint64_t v = 1; v <= 4; ++v) {
    INFO("update " << v);
    rig.publish(v, {"base"}).wait();
    rig.wait_offered(v);
    const std::uint64_t copies_before = rig.counting().copy_bytes.load();
    REQUIRE(h.engine.step() == v);
    h.engine.synchronize();
    // Update v landed in the slot that was not live, which is live now.
    CHECK(hook.live_arena(0) == h.arena->slot_address(static_cast<int>(v % 2)));
    CHECK(rig.counting().copy_bytes.load() == copies_before);  // the swap copied nothing
    CHECK(hook.live_content_version(0) == v);
  }
  CHECK(h.arena->remaps == 0);
  CHECK(h.arena->live_slot() == 0);  // the live range is not the receiver's business here
  INFO(h.engine.first_torn());
  CHECK(h.engine.torn_steps() == 0);
  CHECK(rig.history().check(h.engine.records()) == "");
}

TEST_CASE("rebind over an engine arena: the receiver starts from the slot the engine reads") {
  EngineSlotsRig h(/*live_slot=*/1);
  StepHook& hook = h.hook();
  REQUIRE(hook.live_arena(0) == h.arena->slot_address(1));
  h.rig.publish(1, {"base"}).wait();
  REQUIRE(hook.wait_applied(1, deadline_from_now(), h.engine.stream()));
  CHECK(hook.live_arena(0) == h.arena->slot_address(0));  // the shadow was slot 0
  h.engine.step();
  h.engine.synchronize();
  CHECK(h.engine.torn_steps() == 0);
  CHECK(h.rig.history().check(h.engine.records()) == "");
}

TEST_CASE("rebind over an engine arena: 1000 updates while the engine decodes; no torn step") {
  // Slow steps keep reads of the old slot queued on the engine stream while the next update
  // receives: a slot released before those reads ran would be overwritten under them.
  EngineSlotsRig h(0, std::chrono::microseconds(100), /*jitter=*/true);
  LoopbackRig& rig = h.rig;
  StepHook& hook = h.hook();
  constexpr std::uint64_t kUpdates = 1'000;
  const bool in_time = run_update_stress(
      rig, h.engine, kUpdates,
      [](std::uint64_t, std::mt19937_64&) { return std::vector<std::string>{"base"}; },
      std::chrono::minutes(4));
  INFO("applied " << hook.applied_version());
  REQUIRE(in_time);
  h.engine.step();
  h.engine.synchronize();
  INFO(h.engine.first_torn());
  CHECK(h.engine.torn_steps() == 0);
  CHECK(rig.history().check(h.engine.records()) == "");
  CHECK(rig.receiver().stats().updates_failed == 0);
  CHECK(h.arena->remaps == 0);
}
