// ChunkGate. See same_host_gate.h.
#include "transports/same_host/same_host_gate.h"

#include <algorithm>
#include <thread>

namespace shadowsync::same_host {

void ChunkGate::open(std::uint64_t chunks) {
  {
    std::lock_guard lock(mutex_);
    open_.store(std::max(open_.load(), chunks));
  }
  changed_.notify_all();
}

void ChunkGate::release() noexcept {
  {
    std::lock_guard lock(mutex_);
    released_ = true;
  }
  changed_.notify_all();
}

bool ChunkGate::released() const { return released_.load(); }

ChunkGate::Outcome ChunkGate::wait(std::uint64_t chunk, Clock::time_point deadline,
                                   std::chrono::microseconds spin) {
  if (spin.count() > 0) {
    const Clock::time_point until = std::min(deadline, Clock::now() + spin);
    for (unsigned round = 0;; ++round) {
      if (released_.load()) return Outcome::kReleased;
      if (open_.load() > chunk) return Outcome::kOpen;
      if ((round & 63) == 63 && Clock::now() >= until) break;
      std::this_thread::yield();
    }
  }
  std::unique_lock lock(mutex_);
  changed_.wait_until(lock, deadline, [&] { return released_.load() || open_.load() > chunk; });
  if (released_.load()) return Outcome::kReleased;
  return open_.load() > chunk ? Outcome::kOpen : Outcome::kDeadline;
}

}  // namespace shadowsync::same_host
