// The stress loop of the integration tests that swap while the engine decodes: a trainer thread
// publishes versions 1..`updates` (each carrying the groups `groups_of` picks) while the engine
// thread steps until the last one is live. Catch2-free (the testkit must not depend on it): the
// caller checks what it returns and the oracle afterwards.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "fake_engine.h"
#include "loopback_rig.h"

namespace shadowsync::testing {

// The groups update `version` carries (the last update should carry all, so that every group ends
// on it); `rng` is the trainer's.
using GroupsOf = std::function<std::vector<std::string>(std::uint64_t version, std::mt19937_64& rng)>;

// The trainer waits for three in four publishes to finish (the others pile up: latest wins) and,
// for one in four, until the engine applied it; the engine synchronizes its stream after one in
// eight steps. Returns whether version `updates` went live before `limit`; the trainer thread has
// ended either way.
bool run_update_stress(LoopbackRig& rig, HostFakeEngine& engine, std::uint64_t updates,
                       const GroupsOf& groups_of, std::chrono::minutes limit);

}  // namespace shadowsync::testing
