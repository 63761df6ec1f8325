// ChunkGate. See same_host_gate.h.
#include "transports/same_host/same_host_gate.h"

#include <algorithm>

namespace shadowsync::same_host {

void ChunkGate::open(std::uint64_t chunks) {
  {
    std::lock_guard lock(mutex_);
    open_ = std::max(open_, chunks);
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

bool ChunkGate::released() const {
  std::lock_guard lock(mutex_);
  return released_;
}

ChunkGate::Outcome ChunkGate::wait(std::uint64_t chunk, Clock::time_point deadline) {
  std::unique_lock lock(mutex_);
  changed_.wait_until(lock, deadline, [&] { return released_ || open_ > chunk; });
  if (released_) return Outcome::kReleased;
  return open_ > chunk ? Outcome::kOpen : Outcome::kDeadline;
}

}  // namespace shadowsync::same_host
