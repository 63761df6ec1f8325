// Remap and copy in one swap: a receiver whose base group is the engine's remap arena (vLLM's
// live arena) and whose adapter group lives in the engine's own tensors (vLLM's stacked LoRA
// buffers, Receiver::use_engine_storage under remap). Each swap remaps the one and copies into the
// other; neither moves what the engine reads. Runs on RemapHostBackend (remap_host_backend.h):
// remap on the CPU, the engine arena's remap waiting for the engine stream as CUDA's does.
//
// Checked to fail without its behaviour (each broken by hand once, then restored): with
// SlotTable::make_live dispatching on the receiver's strategy alone (the adapter group "remapped"
// through an arena it no longer has) the first test crashes; with the adapter's copy recorded as
// released before it ran, the stress test sees torn steps; with rollback not refusing a copied
// group, the rollback test fails.
#include <catch2/catch.hpp>

#include <cstddef>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "deadline.h"
#include "live_hash.h"
#include "loopback_rig.h"
#include "remap_host_backend.h"
#include "update_stress.h"
#include "shadowsync/error.h"

using namespace shadowsync;
using namespace shadowsync::testing;

namespace {

constexpr std::size_t kBase = 0;
constexpr std::size_t kLora = 1;

Layout base_and_lora_layout() {
  return Layout::build({{"embed", DType::kBFloat16, {97, 16}, "base"},
                        {"l0.w", DType::kFloat32, {300}, "base"},
                        {"l1.w", DType::kFloat16, {513}, "base"},
                        // Large enough that a copy into the adapter takes a while: a shadow
                        // released before its copy ran is then overwritten under it.
                        {"a.A", DType::kBFloat16, {64, 64}, "lora"},
                        {"a.B", DType::kBFloat16, {64, 64}, "lora"},
                        {"b.A", DType::kFloat32, {2048}, "lora"}},
                       {.bucket_bytes = 4096});
}

// A rig whose receiver remaps the engine's arena for the base and copies the adapter into
// `adapter` (the engine's own buffer, laid out as the group's arena).
struct HybridRig {
  explicit HybridRig(std::chrono::microseconds compute_time = {}, bool jitter = false)
      : layout(base_and_lora_layout()),
        adapter(layout.groups()[kLora].arena_bytes()),
        base_arena(std::make_shared<HostArena>(layout.groups()[kBase].arena_bytes())),
        rig(layout, options(jitter)),
        engine(rig.backend(), rig.receiver(),
               {.full_check_every = 2, .compute_time = compute_time}) {
    base_arena->wait_for(rig.backend());  // the engine's stream is the rig backend's
    std::vector<void*> tensors;
    for (const TensorPlacement& t : layout.groups()[kLora].tensors()) {
      tensors.push_back(adapter.data() + t.offset);
    }
    rig.receiver().use_engine_storage(kLora, tensors);
  }

  RigOptions options(bool jitter) {
    RigOptions o;
    o.receiver.swap_strategy = SwapStrategy::kRemap;
    o.receiver.engine_uses_cuda_graphs = true;
    o.remap_on_host = true;
    o.engine_arenas = {base_arena};
    if (jitter) {
      o.backend.max_task_jitter = std::chrono::microseconds(20);
      o.backend.jitter_seed = 11;
    }
    return o;
  }

  StepHook& hook() { return rig.receiver().step_hook(); }

  const Layout layout;
  std::vector<std::byte> adapter;
  std::shared_ptr<HostArena> base_arena;
  LoopbackRig rig;
  HostFakeEngine engine;
};

// The bytes the receiver copied through the backend so far: a swap's copies into the adapter (the
// host remap arena copies on its own).
std::uint64_t copied_bytes(LoopbackRig& rig) { return rig.counting().copy_bytes.load(); }

// The bytes of a group's tensors (its arena also holds alignment padding, which is not copied).
std::uint64_t tensor_bytes(const GroupLayout& group) {
  std::uint64_t bytes = 0;
  for (const TensorPlacement& t : group.tensors()) bytes += t.bytes;
  return bytes;
}

}  // namespace

TEST_CASE("remap with an adapter in the engine's storage: each swap remaps the base and copies "
          "the adapter; nothing the engine reads moves") {
  HybridRig h;
  LoopbackRig& rig = h.rig;
  StepHook& hook = h.hook();
  const std::byte* base_live = h.base_arena->live_address();
  REQUIRE(hook.live_arena(kBase) == base_live);
  REQUIRE(hook.live_arena(kLora) == nullptr);  // the engine's own storage
  REQUIRE(hook.live_tensor(kLora, 0) == h.adapter.data());
  const std::uint64_t adapter_bytes = tensor_bytes(h.layout.groups()[kLora]);

  struct Case {
    std::uint64_t version;
    std::vector<std::string> groups;
    int remaps;                 // of the engine's base arena, in all
    bool copies_adapter;        // this swap copies the adapter (and nothing else)
    std::uint64_t base_version; // what the live bytes hold afterwards
    std::uint64_t lora_version;
  };
  const std::vector<Case> cases = {{1, {"base", "lora"}, 1, true, 1, 1},
                                   {2, {"lora"}, 1, true, 1, 2},
                                   {3, {"base"}, 2, false, 3, 2},
                                   {4, {"base", "lora"}, 3, true, 4, 4}};
  for (const Case& c : cases) {
    INFO("update " << c.version);
    rig.publish(c.version, c.groups).wait();
    rig.wait_offered(c.version);
    const std::uint64_t before = copied_bytes(rig);
    REQUIRE(h.engine.step() == c.version);
    CHECK(copied_bytes(rig) - before == (c.copies_adapter ? adapter_bytes : 0));
    h.engine.synchronize();
    CHECK(h.base_arena->remaps == c.remaps);
    CHECK(hook.live_content_version(kBase) == c.base_version);
    CHECK(hook.live_content_version(kLora) == c.lora_version);
    CHECK(hook.live_arena(kBase) == base_live);
    CHECK(hook.live_tensor(kLora, 0) == h.adapter.data());
    h.engine.step();  // reads both groups whole (full_check_every 2) and checks their versions
    h.engine.synchronize();
  }
  INFO(h.engine.first_torn());
  CHECK(h.engine.torn_steps() == 0);
  CHECK(rig.history().check(h.engine.records()) == "");
}

TEST_CASE("remap with an adapter in the engine's storage: 1000 mixed updates while the engine "
          "decodes; no torn step") {
  // Slow steps keep a swap's copy queued on the engine stream while the next update receives: a
  // shadow released before its copy ran would be overwritten under it.
  HybridRig h(std::chrono::microseconds(100), /*jitter=*/true);
  LoopbackRig& rig = h.rig;
  StepHook& hook = h.hook();

  constexpr std::uint64_t kUpdates = 1'000;
  const std::vector<std::vector<std::string>> kinds = {{"base"}, {"lora"}, {"base", "lora"}};
  const bool in_time = run_update_stress(
      rig, h.engine, kUpdates,
      [&](std::uint64_t v, std::mt19937_64& rng) {
        return v == kUpdates ? kinds.back() : kinds[rng() % kinds.size()];
      },
      std::chrono::minutes(4));
  INFO("applied " << hook.applied_version());
  REQUIRE(in_time);  // the final version, before the deadline
  h.engine.step();
  h.engine.synchronize();

  INFO(h.engine.first_torn());
  CHECK(h.engine.torn_steps() == 0);
  CHECK(rig.history().check(h.engine.records()) == "");
  CHECK(rig.receiver().stats().updates_failed == 0);
  CHECK(hook.live_content_version(kBase) == kUpdates);
  CHECK(hook.live_content_version(kLora) == kUpdates);
  CHECK(h.base_arena->remaps > 0);
}

TEST_CASE("remap with an adapter in the engine's storage: rollback is refused, naming the group; "
          "nothing changes") {
  HybridRig h;
  LoopbackRig& rig = h.rig;
  StepHook& hook = h.hook();
  rig.publish(1, {"base", "lora"}).wait();
  REQUIRE(hook.wait_applied(1, deadline_from_now(), h.engine.stream()));
  rig.publish(2, {"base"}).wait();
  REQUIRE(hook.wait_applied(2, deadline_from_now(), h.engine.stream()));
  h.engine.synchronize();
  const int remaps = h.base_arena->remaps;
  const std::vector<std::byte> adapter = h.adapter;

  try {
    hook.rollback(h.engine.stream());
    FAIL("rollback with a copied group did not throw");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kInvalidArgument);
    CHECK_THAT(e.what(), Catch::Contains("group 'lora'") && Catch::Contains("remap") &&
                             Catch::Contains("engine's own storage"));
  }
  h.engine.synchronize();
  CHECK(h.base_arena->remaps == remaps);
  CHECK(h.adapter == adapter);
  CHECK(hook.applied_version() == 2);
  CHECK(hook.live_content_version(kBase) == 2);
  CHECK(hook.live_content_version(kLora) == 1);
}

TEST_CASE("use_engine_storage under remap: refused for a group swapped by the engine's arena, and "
          "under rebind; nothing changes") {
  HybridRig h;
  const Layout& layout = h.layout;
  std::vector<void*> base_tensors(layout.groups()[kBase].tensors().size(), h.adapter.data());
  try {
    h.rig.receiver().use_engine_storage(kBase, base_tensors);
    FAIL("use_engine_storage of the engine arena's group did not throw");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kInvalidArgument);
    CHECK_THAT(e.what(), Catch::Contains("group 'base'") && Catch::Contains("engine arena"));
  }
  CHECK(h.rig.receiver().step_hook().live_arena(kBase) == h.base_arena->live_address());

  LoopbackRig rebind(layout);
  std::vector<void*> lora_tensors(layout.groups()[kLora].tensors().size(), h.adapter.data());
  const std::byte* live = rebind.receiver().step_hook().live_arena(kLora);
  try {
    rebind.receiver().use_engine_storage(kLora, lora_tensors);
    FAIL("use_engine_storage under rebind did not throw");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kInvalidArgument);
    CHECK_THAT(e.what(), Catch::Contains("swap_strategy is rebind"));
  }
  CHECK(rebind.receiver().step_hook().live_arena(kLora) == live);
}
