// A deadline for a whole benchmark run (see bench_watchdog.h).
#include "bench_watchdog.h"

#include <chrono>
#include <utility>

namespace shadowsync::bench {

Watchdog::Watchdog(double limit_s, std::function<void()> fire) {
  thread_ = std::thread([this, limit_s, fire = std::move(fire)] {
    std::unique_lock lock(mutex_);
    if (cv_.wait_for(lock, std::chrono::duration<double>(limit_s), [this] { return done_; })) {
      return;
    }
    fire();
  });
}

Watchdog::~Watchdog() {
  {
    std::lock_guard lock(mutex_);
    done_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

}  // namespace shadowsync::bench
