// Ends the process if a test outlives its deadline: a hung NCCL call cannot be interrupted from
// inside, so GPU tests and benchmarks fail loudly this way instead of stalling ctest.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>

namespace shadowsync::testing {

class Watchdog {
 public:
  // After `timeout`, prints why, runs `last_words` (a final result line, say), and exits with
  // `exit_code`, unless stop() ran first.
  Watchdog(std::chrono::seconds timeout, std::function<void()> last_words = {}, int exit_code = 1)
      : timeout_(timeout), last_words_(std::move(last_words)), exit_code_(exit_code),
        thread_([this] { run(); }) {}
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;
  ~Watchdog() { stop(); }

  void stop() {
    {
      std::lock_guard lock(mutex_);
      finished_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

 private:
  void run() {
    std::unique_lock lock(mutex_);
    if (cv_.wait_for(lock, timeout_, [this] { return finished_; })) return;
    std::fprintf(stderr, "FAIL: did not finish within %lld s (watchdog)\n",
                 static_cast<long long>(timeout_.count()));
    if (last_words_) last_words_();
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(exit_code_);
  }

  const std::chrono::seconds timeout_;
  const std::function<void()> last_words_;
  const int exit_code_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool finished_ = false;
  std::thread thread_;  // last: starts once the members above exist
};

}  // namespace shadowsync::testing
