// Deliberate breakage for mutation checks (scripts/mutation_check.sh). Each invariant test names
// the mutation that breaks it; the script builds with -DSHADOWSYNC_MUTATION=<n> and shows that the
// test fails. A normal build has kMutation == 0 and every `if constexpr` below compiles away.
#pragma once

#ifndef SHADOWSYNC_MUTATION
#define SHADOWSYNC_MUTATION 0
#endif

namespace shadowsync::mutation {

inline constexpr int kActive = SHADOWSYNC_MUTATION;

inline constexpr int kSwapOneGroupPerStep = 1;     // invariant 1: swap is not atomic across groups
inline constexpr int kSkipReleaseWait = 2;         // invariant 2: write a slot the engine still reads
inline constexpr int kPublishBeforeComplete = 3;   // invariant 3: offer before the receive finished
inline constexpr int kWorkOnFastPath = 4;          // invariant 4: a backend call on the fast path
inline constexpr int kDropCarriedGroups = 5;       // invariant 5: superseded groups are forgotten
inline constexpr int kOfferFailedUpdate = 6;       // invariant 6: a failed update is offered
inline constexpr int kWaitAppliedNeverApplies = 7; // invariant 7: idle engines never swap

}  // namespace shadowsync::mutation
