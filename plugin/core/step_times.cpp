#include "shadowsync/step_times.h"

#include <algorithm>

namespace shadowsync {

std::vector<StepTimes::Step> StepTimes::steps_since(std::int64_t since_ns,
                                                    std::size_t max) const {
  max = std::min(max, kMaxIntervals);
  const std::uint64_t newest = count();  // stamps [0, newest) are written
  const std::uint64_t first = newest > max + 1 ? newest - (max + 1) : 0;
  std::vector<std::int64_t> stamps;
  stamps.reserve(newest - first);
  for (std::uint64_t i = first; i < newest; ++i) {
    stamps.push_back(stamps_[i % kCapacity].load(std::memory_order_relaxed));
  }
  // Entries the writer may have overwritten while they were read: those it reached by now (the
  // one at `after % kCapacity` may be half-way through being rewritten).
  std::atomic_thread_fence(std::memory_order_acquire);
  const std::uint64_t after = count_.load(std::memory_order_relaxed);
  const std::uint64_t valid_from = after >= kCapacity ? after - kCapacity + 1 : 0;

  std::vector<Step> steps;
  for (std::uint64_t i = std::max(first, valid_from); i + 1 < newest; ++i) {
    const std::int64_t start = stamps[i - first];
    if (start < since_ns) continue;
    steps.push_back({start, stamps[i + 1 - first] - start});
  }
  return steps;
}

std::vector<std::int64_t> StepTimes::intervals_since(std::int64_t since_ns,
                                                     std::size_t max) const {
  std::vector<std::int64_t> intervals;
  for (const Step& step : steps_since(since_ns, max)) intervals.push_back(step.duration_ns);
  return intervals;
}

}  // namespace shadowsync
