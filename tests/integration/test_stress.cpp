// 10,000 updates of every kind (base only, LoRA only, both) from a trainer thread while an engine
// thread decodes, with random delays on every stream and thread. The oracle checks every step.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <random>
#include <thread>

#include "deadline.h"
#include "loopback_rig.h"

using namespace shadowsync;
using namespace shadowsync::testing;

namespace {

std::uint64_t update_count() {
  // SHADOWSYNC_STRESS_UPDATES overrides the count for longer soak runs.
  if (const char* env = std::getenv("SHADOWSYNC_STRESS_UPDATES")) return std::strtoull(env, nullptr, 10);
  return 10'000;
}

void random_pause(std::mt19937_64& rng) {
  // Mostly nothing; sometimes a yield or a short sleep, to shuffle the interleavings.
  const auto dice = rng() % 100;
  if (dice < 70) return;
  if (dice < 95) {
    std::this_thread::yield();
    return;
  }
  std::this_thread::sleep_for(std::chrono::microseconds(rng() % 200));
}

}  // namespace

TEST_CASE("stress: 10,000 mixed updates while the engine decodes, zero torn steps") {
  const Layout layout = Layout::build({{"embed", DType::kBFloat16, {97, 16}, "base"},
                                       {"l0.w", DType::kFloat32, {300}, "base"},
                                       {"l1.w", DType::kFloat16, {513}, "base"},
                                       {"head", DType::kInt8, {777}, "base"},
                                       {"a.A", DType::kBFloat16, {96}, "lora_a"},
                                       {"a.B", DType::kBFloat16, {96}, "lora_a"},
                                       {"b.A", DType::kFloat32, {70}, "lora_b"}},
                                      {.bucket_bytes = 1024});
  const std::uint64_t updates = update_count();
  RigOptions options;
  options.backend.max_task_jitter = std::chrono::microseconds(20);
  options.backend.jitter_seed = 42;
  LoopbackRig rig(layout, options);
  HostFakeEngine engine(rig.backend(), rig.receiver(), {.full_check_every = 8});

  const std::vector<std::vector<std::string>> kinds = {
      {"base"}, {"lora_a"}, {"lora_b"}, {"lora_a", "lora_b"}, {"base", "lora_a"},
      {"base", "lora_a", "lora_b"}};
  std::thread trainer([&] {
    std::mt19937_64 rng(7);
    for (std::uint64_t v = 1; v <= updates; ++v) {
      // The last update carries every group, so the final state is fully determined.
      const auto& groups = v == updates ? kinds.back() : kinds[rng() % kinds.size()];
      PublishHandle handle = rig.publish(v, groups);
      const auto dice = rng() % 8;
      if (dice < 3) handle.wait();  // sometimes the trainer waits for its send,
      if (dice == 0) {              // and sometimes until the engine runs the new version
        wait_until([&] { return rig.receiver().step_hook().applied_version() >= v; },
                   "the engine applies a version the trainer waits for", std::chrono::minutes(2));
      }
      random_pause(rng);
    }
  });

  std::vector<std::uint64_t> applied;
  std::mt19937_64 rng(11);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(8);
  while (rig.receiver().step_hook().applied_version() < updates) {
    if (std::chrono::steady_clock::now() > deadline) {
      trainer.join();
      FAIL("final version " << updates << " not applied before the deadline; applied "
                            << rig.receiver().step_hook().applied_version());
    }
    if (auto v = engine.step()) applied.push_back(*v);
    if (rng() % 16 == 0) engine.synchronize();  // sometimes the engine runs ahead, sometimes not
    random_pause(rng);
  }
  trainer.join();
  engine.step();
  engine.synchronize();

  const ReceiverStats stats = rig.receiver().stats();
  INFO(engine.first_torn());
  CHECK(engine.torn_steps() == 0);
  CHECK(rig.history().check(engine.records()) == "");
  CHECK(stats.updates_failed == 0);
  CHECK(stats.updates_ready == updates);
  CHECK(applied.back() == updates);
  for (std::size_t i = 1; i < applied.size(); ++i) {
    INFO("swap " << i);
    REQUIRE(applied[i] > applied[i - 1]);  // applied versions strictly increase
  }
  // Every update was either applied or superseded by a later one, none lost.
  CHECK(applied.size() + stats.updates_superseded == updates);
  WARN("stress: " << updates << " updates, " << applied.size() << " swaps, "
                  << stats.updates_superseded << " superseded, " << engine.steps_done()
                  << " steps");
}
