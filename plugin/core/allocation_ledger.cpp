// AllocationLedger: see allocation_ledger.h.
#include "core/allocation_ledger.h"

#include <cstdio>

namespace shadowsync {

void AllocationLedger::record(void* ptr, std::size_t bytes) {
  {
    std::lock_guard lock(mutex_);
    allocations_.emplace(ptr, bytes);
  }
  bytes_allocated_.fetch_add(bytes, std::memory_order_relaxed);
}

std::size_t AllocationLedger::release(void* ptr, const char* owner) noexcept {
  std::size_t bytes = 0;
  {
    std::lock_guard lock(mutex_);
    auto it = allocations_.find(ptr);
    if (it != allocations_.end()) {
      bytes = it->second;
      allocations_.erase(it);
    }
  }
  if (bytes == 0) {
    if (!warned_unknown_pointer_.exchange(true)) {
      std::fprintf(stderr,
                   "shadowsync: %s: %p was not allocated by this backend (or was freed twice); "
                   "ignored. Further such calls are ignored silently.\n",
                   owner, ptr);
    }
    return 0;
  }
  bytes_allocated_.fetch_sub(bytes, std::memory_order_relaxed);
  return bytes;
}

}  // namespace shadowsync
