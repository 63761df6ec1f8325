#include "update_stress.h"

#include <thread>

#include "deadline.h"

namespace shadowsync::testing {

bool run_update_stress(LoopbackRig& rig, HostFakeEngine& engine, std::uint64_t updates,
                       const GroupsOf& groups_of, std::chrono::minutes limit) {
  StepHook& hook = rig.receiver().step_hook();
  std::thread trainer([&] {
    std::mt19937_64 rng(7);
    for (std::uint64_t v = 1; v <= updates; ++v) {
      PublishHandle handle = rig.publish(v, groups_of(v, rng));
      const auto dice = rng() % 4;
      if (dice != 0) handle.wait();
      if (dice == 1) {
        wait_until([&] { return hook.applied_version() >= v; }, "the engine applies a version");
      }
    }
  });
  std::mt19937_64 rng(9);
  const bool in_time = engine.step_until_applied(
      updates, deadline_from_now(limit), [&](std::optional<std::uint64_t>) {
        if (rng() % 8 == 0) engine.synchronize();
      });
  trainer.join();
  return in_time;
}

}  // namespace shadowsync::testing
