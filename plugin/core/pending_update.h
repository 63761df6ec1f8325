// An update that has been received completely and waits in the step hook's mailbox.
#pragma once

#include <cstdint>
#include <vector>

#include "shadowsync/step_hook.h"

namespace shadowsync {

struct PendingUpdate {
  std::uint64_t version = 0;
  // Every group the swap makes live: those the update carried and those carried over from an
  // update it superseded (latest wins, but a LoRA-only update never lands on a stale base).
  std::vector<GroupSwap> swaps;
};

}  // namespace shadowsync
