// ChunkTimeline. See same_host_timeline.h.
#include "transports/same_host/same_host_timeline.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <optional>

#include <fmt/format.h>

namespace shadowsync::same_host {

namespace {
// A step not stamped (any time, 0 included, is a valid stamp).
constexpr std::int64_t kNone = std::numeric_limits<std::int64_t>::min();
}  // namespace

std::int64_t ChunkTimeline::now_ns() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

ChunkTimeline::ChunkTimeline(bool sender) : sender_(sender), rows_(kChunks) {}

void ChunkTimeline::set(std::uint64_t chunk, std::size_t step, bool first,
                        std::int64_t ns) noexcept {
  Row& row = rows_[chunk % kChunks];
  if (first) {
    for (auto& value : row.ns) value.store(kNone, std::memory_order_relaxed);
    row.chunk.store(chunk, std::memory_order_release);
    std::uint64_t end = end_.load(std::memory_order_relaxed);
    while (end < chunk + 1 && !end_.compare_exchange_weak(end, chunk + 1)) {
    }
  } else if (row.chunk.load(std::memory_order_acquire) != chunk) {
    return;  // the row was reused by a later chunk: this stamp is too old to matter
  }
  row.ns[step].store(ns, std::memory_order_relaxed);
}

void ChunkTimeline::stamp(std::uint64_t chunk, SenderStep step, std::int64_t ns) noexcept {
  set(chunk, static_cast<std::size_t>(step), step == SenderStep::kEnqueued, ns);
}

void ChunkTimeline::stamp(std::uint64_t chunk, ReceiverStep step, std::int64_t ns) noexcept {
  set(chunk, static_cast<std::size_t>(step), step == ReceiverStep::kDoorbell, ns);
}

namespace {

std::string median_us(std::vector<double>& values) {
  if (values.empty()) return "-";
  const auto middle = values.begin() + static_cast<std::ptrdiff_t>(values.size() / 2);
  std::nth_element(values.begin(), middle, values.end());
  return fmt::format("{:.1f} us (n={})", *middle, values.size());
}

}  // namespace

std::string ChunkTimeline::summarize_and_reset() {
  const std::uint64_t end = end_.load();
  std::uint64_t begin = begin_.exchange(end);
  if (end > kChunks) begin = std::max(begin, end - kChunks);
  // The stamps of chunk c, if its row still holds it.
  const auto row_of = [&](std::uint64_t chunk) -> std::optional<std::array<std::int64_t, kSteps>> {
    if (chunk < begin || chunk >= end) return std::nullopt;
    const Row& row = rows_[chunk % kChunks];
    if (row.chunk.load(std::memory_order_acquire) != chunk) return std::nullopt;
    std::array<std::int64_t, kSteps> ns{};
    for (std::size_t s = 0; s < kSteps; ++s) ns[s] = row.ns[s].load(std::memory_order_relaxed);
    return ns;
  };
  // An interval from step `a` of chunk (c - back) to step `b` of chunk c; `clamp`: a negative
  // interval counts as 0 (it overlapped).
  struct Interval {
    const char* name;
    std::size_t a;
    std::size_t b;
    std::uint64_t back;
    bool clamp;
    std::vector<double> us;
  };
  std::vector<Interval> intervals;
  if (sender_) {
    intervals = {
        {"enqueued->filled", 0, 1, 0, false, {}},
        {"filled->rung", 1, 2, 0, false, {}},
        {"rung->acked (receiver's share)", 2, 3, 0, false, {}},
        {"acked(c-1)->filled(c) (this stream's turnaround)", 3, 1, 1, true, {}},
        {"rung(c-1)->rung(c) (period)", 2, 2, 1, false, {}},
    };
  } else {
    intervals = {
        {"doorbell->opened", 0, 1, 0, false, {}},
        {"opened->copy enqueued", 1, 2, 0, false, {}},
        {"copy enqueued->copied", 2, 3, 0, false, {}},
        {"copied->ack sent", 3, 4, 0, false, {}},
        {"ack sent(c-1)->doorbell(c) (the sender's turnaround)", 4, 0, 1, true, {}},
        {"copied(c-1)->copy enqueued(c) (copy engine idle)", 3, 2, 1, true, {}},
        {"copied(c-1)->copied(c) (period)", 3, 3, 1, false, {}},
    };
  }
  for (std::uint64_t c = begin; c < end; ++c) {
    const auto now = row_of(c);
    if (!now) continue;
    for (Interval& interval : intervals) {
      if (interval.back > c) continue;
      const auto then = interval.back == 0 ? now : row_of(c - interval.back);
      if (!then) continue;
      const std::int64_t from = (*then)[interval.a];
      const std::int64_t to = (*now)[interval.b];
      if (from == kNone || to == kNone) continue;
      double us = static_cast<double>(to - from) / 1e3;
      if (interval.clamp) us = std::max(us, 0.0);
      interval.us.push_back(us);
    }
  }
  std::string line = fmt::format("same-host {} timeline, chunks {}..{}, medians:",
                                 sender_ ? "sender" : "receiver", begin, end);
  for (Interval& interval : intervals) {
    line += fmt::format(" {} {};", interval.name, median_us(interval.us));
  }
  line.pop_back();
  return line;
}

}  // namespace shadowsync::same_host
