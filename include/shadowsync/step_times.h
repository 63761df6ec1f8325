// When the engine's steps started, as the step hook sees them: one timestamp per before_step in
// a small ring that the receiver reads to pace its receives (ReceiverConfig::
// decode_slowdown_budget). Recorded only when a receiver paces by a budget.
//
// Threads: one writer (the engine thread, in before_step), any number of readers (the receiver
// thread); no locks. A reader that races with the writer wrapping the ring drops the entries
// that may have been overwritten instead of reading a torn one. Ownership: owned by the StepHook.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace shadowsync {

class StepTimes {
 public:
  static constexpr std::size_t kCapacity = 64;
  // intervals_since() returns at most this many: half the ring, so that a reader never needs
  // entries the writer is about to reuse.
  static constexpr std::size_t kMaxIntervals = kCapacity / 2;

  // Steady-clock nanoseconds: the time base of every stamp.
  static std::int64_t now_ns() noexcept {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  // Engine thread: a step starts now. A relaxed load and two release stores (plain stores on
  // x86); no allocation. The stamp's release store orders it after the previous count: a reader
  // that sees this stamp also sees that count, which its check for overwritten entries needs.
  void record() noexcept {
    const std::uint64_t n = count_.load(std::memory_order_relaxed);
    stamps_[n % kCapacity].store(now_ns(), std::memory_order_release);
    count_.store(n + 1, std::memory_order_release);
  }

  // Steps recorded so far. Thread-safe.
  std::uint64_t count() const { return count_.load(std::memory_order_acquire); }

  // A step that was followed by another: when it started and how long it took (the time to
  // the next step's start), steady-clock nanoseconds.
  struct Step {
    std::int64_t start_ns;
    std::int64_t duration_ns;
  };

  // The newest steps that started at or after `since_ns` and were followed by another step,
  // oldest first, at most min(max, kMaxIntervals). Thread-safe.
  std::vector<Step> steps_since(std::int64_t since_ns, std::size_t max) const;
  // The same steps' durations only.
  std::vector<std::int64_t> intervals_since(std::int64_t since_ns, std::size_t max) const;

 private:
  std::array<std::atomic<std::int64_t>, kCapacity> stamps_{};
  std::atomic<std::uint64_t> count_{0};
};

}  // namespace shadowsync
