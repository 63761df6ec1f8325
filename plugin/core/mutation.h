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
// Faults (issue 7): each guarded by a test in tests/integration/test_faults.cpp, test_rollback.cpp
// or test_shutdown.cpp, named in scripts/mutation_check.sh.
inline constexpr int kSkipChecksumVerify = 8;      // a bucket whose checksum differs is offered
inline constexpr int kSkipNonFiniteGuard = 9;      // an update holding a NaN is offered
inline constexpr int kRollbackAfterOverwrite = 10; // rollback flips to a slot being overwritten
inline constexpr int kShutdownLeaksStream = 11;    // a receiver leaves its stream thread behind
inline constexpr int kShutdownLeaksBuffer = 12;    // a receiver leaves an allocation behind
// Swap strategies (issue 8): guarded by tests/integration/test_copy_in.cpp ("copy_in stress").
inline constexpr int kCopyInReleaseBeforeCopy = 13; // copy_in frees the shadow before copying it

}  // namespace shadowsync::mutation
