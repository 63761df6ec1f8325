// A deadline for a whole benchmark run: past it, something (NCCL, the driver, another process)
// hangs, and the program writes what it has and ends instead of hanging with it.
#pragma once

#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

namespace shadowsync::bench {

class Watchdog {
 public:
  // Calls `fire` on the watchdog's own thread if this object still exists `limit_s` seconds
  // from now. `fire` is expected to end the process (std::_Exit): the run it interrupts is stuck.
  Watchdog(double limit_s, std::function<void()> fire);
  // Disarms the watchdog (unless it has fired) and joins its thread.
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

}  // namespace shadowsync::bench
