// Swap strategies on the host backend: copy_in end to end, and the config checks that refuse
// rebind under CUDA graphs and remap on a backend that cannot remap.
//
// Checked to fail without its behaviour: tests/mutations/13-copy-in-release-before-copy.patch
// records the shadow's release event before the copy out of it; the receiver then overwrites the
// shadow while it is being copied and the stress test sees torn steps (578 of 16,048 when it was
// run). The steps' simulated compute time is what makes it visible: without it the copy ran
// before the next receive started and the mutation went unnoticed.
// Not run as mutations (each test fails by its own asserts): a copy_in that moved the live
// pointer, copied per tensor, or accepted rebind under graphs / remap on the host backend.
#include <catch2/catch.hpp>

#include <random>
#include <thread>

#include "counting_backend.h"
#include "deadline.h"
#include "live_hash.h"
#include "loopback_rig.h"
#include "shadowsync/error.h"

using namespace shadowsync;
using namespace shadowsync::testing;

namespace {

Layout copy_in_layout() {
  // Many tensors per group, so that a copy per tensor cannot pass for a copy per arena.
  return Layout::build({{"embed", DType::kBFloat16, {97, 16}, "base"},
                        {"l0.w", DType::kFloat32, {300}, "base"},
                        {"l1.w", DType::kFloat16, {513}, "base"},
                        {"l2.w", DType::kFloat32, {129}, "base"},
                        {"head", DType::kInt8, {777}, "base"},
                        {"a.A", DType::kBFloat16, {96}, "lora_a"},
                        {"a.B", DType::kBFloat16, {96}, "lora_a"},
                        {"b.A", DType::kFloat32, {70}, "lora_b"},
                        {"b.B", DType::kFloat32, {70}, "lora_b"}},
                       {.bucket_bytes = 1024});
}

RigOptions copy_in_options() {
  RigOptions options;
  options.receiver.swap_strategy = SwapStrategy::kCopyIn;
  options.receiver.engine_uses_cuda_graphs = true;  // what copy_in is for; accepted
  return options;
}

// The same, with the sender and receiver on a CountingBackend (LoopbackRig::counting()).
RigOptions counted_copy_in_options() {
  RigOptions options = copy_in_options();
  options.count_backend_calls = true;
  return options;
}

// The non-empty copies enqueued through a CountingBackend so far, and their bytes.
struct CopyStats {
  std::uint64_t calls = 0;
  std::uint64_t bytes = 0;
};

CopyStats copy_stats(const CountingBackend& backend) {
  return {backend.copy_calls.load(), backend.copy_bytes.load()};
}

std::vector<std::byte*> live_arenas(Receiver& receiver) {
  std::vector<std::byte*> arenas;
  for (std::size_t g = 0; g < receiver.layout().groups().size(); ++g) {
    arenas.push_back(receiver.step_hook().live_arena(g));
  }
  return arenas;
}

std::vector<void*> live_tensors(Receiver& receiver) {
  std::vector<void*> tensors;
  const Layout& layout = receiver.layout();
  for (std::size_t g = 0; g < layout.groups().size(); ++g) {
    for (std::size_t t = 0; t < layout.groups()[g].tensors().size(); ++t) {
      tensors.push_back(receiver.step_hook().live_tensor(g, t));
    }
  }
  return tensors;
}

// The copies one swap enqueues: publishes `groups` at `version`, waits until the update is offered
// (every copy of the sender's packing was enqueued before its last bucket arrived), then counts
// the copies the sender and receiver ask of the backend around the one step that applies it. The
// rig must count (counted_copy_in_options).
CopyStats copies_of_swap(LoopbackRig& rig, HostFakeEngine& engine, std::uint64_t version,
                         const std::vector<std::string>& groups) {
  rig.publish(version, groups).wait();
  rig.wait_offered(version);
  const CopyStats before = copy_stats(rig.counting());
  REQUIRE(engine.step() == version);
  const CopyStats after = copy_stats(rig.counting());
  engine.synchronize();
  return {after.calls - before.calls, after.bytes - before.bytes};
}

}  // namespace

TEST_CASE("copy_in stress: 2000 mixed updates while the engine decodes; no torn step, live "
          "pointers never change") {
  const Layout layout = copy_in_layout();
  RigOptions options = copy_in_options();
  options.backend.max_task_jitter = std::chrono::microseconds(20);
  options.backend.jitter_seed = 8;
  LoopbackRig rig(layout, options);
  // Steps that take a while keep the copy of a swap queued behind them on the engine stream while
  // the next update is already receiving: a shadow released before its copy ran gets overwritten.
  HostFakeEngine engine(rig.backend(), rig.receiver(),
                        {.full_check_every = 4, .compute_time = std::chrono::microseconds(100)});
  StepHook& hook = rig.receiver().step_hook();

  const std::vector<std::byte*> arenas = live_arenas(rig.receiver());
  const std::vector<void*> tensors = live_tensors(rig.receiver());
  std::uint64_t pointer_changes = 0;  // seen in the swap callback, where an adapter would rebind
  hook.set_swap_callback([&](const AppliedUpdate&) {
    if (live_arenas(rig.receiver()) != arenas || live_tensors(rig.receiver()) != tensors) {
      ++pointer_changes;
    }
  });

  constexpr std::uint64_t kUpdates = 2'000;
  const std::vector<std::vector<std::string>> kinds = {
      {"base"}, {"lora_a"}, {"lora_b"}, {"lora_a", "lora_b"}, {"base", "lora_a"},
      {"base", "lora_a", "lora_b"}};
  std::thread trainer([&] {
    std::mt19937_64 rng(3);
    for (std::uint64_t v = 1; v <= kUpdates; ++v) {
      const auto& groups = v == kUpdates ? kinds.back() : kinds[rng() % kinds.size()];
      PublishHandle handle = rig.publish(v, groups);
      // Sometimes updates pile up (latest wins), sometimes each one is swapped in.
      const auto dice = rng() % 4;
      if (dice != 0) handle.wait();
      if (dice == 1) {
        wait_until([&] { return hook.applied_version() >= v; }, "the engine applies a version");
      }
    }
  });

  std::vector<std::uint64_t> applied;
  std::mt19937_64 rng(5);
  const bool in_time = engine.step_until_applied(
      kUpdates, deadline_from_now(std::chrono::minutes(4)), [&](std::optional<std::uint64_t> v) {
        if (v) applied.push_back(*v);
        if (rng() % 8 == 0) engine.synchronize();
      });
  trainer.join();
  INFO("applied " << hook.applied_version());
  REQUIRE(in_time);  // the final version, before the deadline
  engine.step();
  engine.synchronize();

  INFO(engine.first_torn());
  CHECK(engine.torn_steps() == 0);
  CHECK(rig.history().check(engine.records()) == "");
  CHECK(rig.receiver().stats().updates_failed == 0);
  CHECK(pointer_changes == 0);
  CHECK(live_arenas(rig.receiver()) == arenas);
  CHECK(live_tensors(rig.receiver()) == tensors);
  REQUIRE(!applied.empty());
  CHECK(applied.back() == kUpdates);
  for (std::size_t i = 1; i < applied.size(); ++i) REQUIRE(applied[i] > applied[i - 1]);
  // The last update carried every group: the live bytes are exactly its pattern.
  for (std::size_t g = 0; g < layout.groups().size(); ++g) {
    INFO("group " << layout.groups()[g].name());
    CHECK(hook.live_content_version(g) == kUpdates);
  }
  WARN("copy_in stress: " << applied.size() << " swaps, "
                          << rig.receiver().stats().updates_superseded << " superseded, "
                          << engine.steps_done() << " steps");
}

TEST_CASE("copy_in: one copy per group arena; a LoRA-only update moves only the adapter's bytes") {
  const Layout layout = copy_in_layout();
  LoopbackRig rig(layout, counted_copy_in_options());
  HostFakeEngine engine(rig.backend(), rig.receiver(), {.full_check_every = 1});
  const std::size_t base = 0;
  const std::size_t lora_a = 1;
  const std::size_t lora_b = 2;
  const std::size_t base_bytes = layout.groups()[base].arena_bytes();
  const std::size_t lora_a_bytes = layout.groups()[lora_a].arena_bytes();
  const std::size_t lora_b_bytes = layout.groups()[lora_b].arena_bytes();

  CopyStats all = copies_of_swap(rig, engine, 1, {"base", "lora_a", "lora_b"});
  CHECK(all.calls == 3);  // not one per tensor (9)
  CHECK(all.bytes == base_bytes + lora_a_bytes + lora_b_bytes);

  CopyStats lora_only = copies_of_swap(rig, engine, 2, {"lora_a"});
  CHECK(lora_only.calls == 1);
  CHECK(lora_only.bytes == lora_a_bytes);

  // The base was not touched: still version 1, and every step read it whole.
  StepHook& hook = rig.receiver().step_hook();
  CHECK(hook.live_content_version(base) == 1);
  CHECK(hook.live_content_version(lora_a) == 2);
  CHECK(hook.live_content_version(lora_b) == 1);
  engine.step();
  engine.synchronize();
  INFO(engine.first_torn());
  CHECK(engine.torn_steps() == 0);
  CHECK(rig.history().check(engine.records()) == "");
}

TEST_CASE("copy_in: a LoRA-only update that supersedes a base update copies both, once each") {
  // Latest wins: update 2 (base) is taken back by update 3 (lora_a) before the engine applied it;
  // the base stays pending and lands with the adapter in one swap (invariant 5).
  const Layout layout = copy_in_layout();
  LoopbackRig rig(layout, counted_copy_in_options());
  HostFakeEngine engine(rig.backend(), rig.receiver(), {.full_check_every = 1});
  rig.publish(1, {"base", "lora_a", "lora_b"}).wait();
  StepHook& hook = rig.receiver().step_hook();
  REQUIRE(hook.wait_applied(1, deadline_from_now(), engine.stream()));

  rig.publish(2, {"base"}).wait();
  rig.wait_offered(2);
  rig.publish(3, {"lora_a"}).wait();
  wait_until([&] { return rig.receiver().stats().updates_ready >= 3 && hook.has_pending(); },
             "update 3 offered");
  const CopyStats before = copy_stats(rig.counting());
  REQUIRE(engine.step() == 3);
  const CopyStats after = copy_stats(rig.counting());
  engine.synchronize();
  CHECK(after.calls - before.calls == 2);
  CHECK(after.bytes - before.bytes ==
        layout.groups()[0].arena_bytes() + layout.groups()[1].arena_bytes());
  CHECK(hook.live_content_version(0) == 2);
  CHECK(hook.live_content_version(1) == 3);
  CHECK(hook.live_content_version(2) == 1);
  INFO(engine.first_torn());
  CHECK(engine.torn_steps() == 0);
  CHECK(rig.history().check(engine.records()) == "");
}

TEST_CASE("copy_in: rollback is refused, naming the strategy; nothing changes") {
  const Layout layout = copy_in_layout();
  LoopbackRig rig(layout, copy_in_options());
  HostFakeEngine engine(rig.backend(), rig.receiver(), {.full_check_every = 1});
  StepHook& hook = rig.receiver().step_hook();
  rig.publish(1, {"base", "lora_a", "lora_b"}).wait();
  REQUIRE(hook.wait_applied(1, deadline_from_now(), engine.stream()));
  rig.publish(2, {"base"}).wait();
  REQUIRE(hook.wait_applied(2, deadline_from_now(), engine.stream()));
  engine.synchronize();
  const std::uint64_t hash = live_hash(rig.receiver());

  try {
    hook.rollback(engine.stream());
    FAIL("rollback under copy_in did not throw");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kInvalidArgument);
    CHECK_THAT(e.what(), Catch::Contains("copy_in") && Catch::Contains("swap_strategy") &&
                             Catch::Contains("rebind or remap"));
  }
  engine.synchronize();
  CHECK(live_hash(rig.receiver()) == hash);
  CHECK(hook.applied_version() == 2);
  CHECK(hook.live_content_version(0) == 2);
  engine.step();
  engine.synchronize();
  CHECK(engine.torn_steps() == 0);
}

TEST_CASE("swap strategy: rebind is refused when the engine declares CUDA graphs") {
  const Layout layout = copy_in_layout();
  CountingBackend backend;
  ReceiverConfig config;
  config.engine_uses_cuda_graphs = true;  // swap_strategy stays rebind, the default
  try {
    Receiver receiver(layout, backend, nullptr, config);
    FAIL("a rebind receiver was built for an engine that replays CUDA graphs");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kInvalidArgument);
    CHECK_THAT(e.what(), Catch::Contains("swap_strategy is rebind") &&
                             Catch::Contains("engine_uses_cuda_graphs is true") &&
                             Catch::Contains("copy_in or remap"));
  }
  CHECK(backend.calls == 0);  // refused before anything was allocated or created

  // Without graphs rebind is fine, and with graphs copy_in is.
  CHECK_NOTHROW(Receiver(layout, backend, nullptr, ReceiverConfig{}));
  config.swap_strategy = SwapStrategy::kCopyIn;
  CHECK_NOTHROW(Receiver(layout, backend, nullptr, config));
}

TEST_CASE("swap strategy: remap is refused on the host backend, naming why and suggesting "
          "copy_in") {
  const Layout layout = copy_in_layout();
  CountingBackend backend;
  ReceiverConfig config;
  config.swap_strategy = SwapStrategy::kRemap;
  config.engine_uses_cuda_graphs = true;
  try {
    Receiver receiver(layout, backend, nullptr, config);
    FAIL("a remap receiver was built on the host backend");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kInvalidArgument);
    CHECK_THAT(e.what(), Catch::Contains("swap_strategy is remap") &&
                             Catch::Contains("backend 'host'") &&
                             Catch::Contains("no virtual memory remapping") &&
                             Catch::Contains("use swap_strategy copy_in"));
  }
  CHECK(backend.calls == 0);  // refused before anything was allocated or created
  CHECK_THROWS_AS(backend.create_remappable_arena(4096), Error);
}
