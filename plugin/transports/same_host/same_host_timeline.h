// Internal to the same-host transport: a per-chunk timeline of the device flavour's data path,
// kept always (a clock read and a relaxed store per step) and summarized on request as medians,
// so that a benchmark run says where each chunk's time went. Not installed; no CUDA.
//
// Steps, per side (each stamped by the one thread that observes it):
//   sender:   enqueued (the caller's thread) -> filled (the thread that rings - the progress
//             thread or the caller's - saw the slot's event complete) -> rung (doorbell written to
//             every receiver) -> acked (every receiver's ack counted, the counter moved);
//   receiver: doorbell (read off the socket) -> opened (checked, gate opened) -> enqueued (the
//             caller's thread enqueued the copy) -> copied (the progress thread saw the copy's
//             event complete) -> ack sent.
// The first step of each side resets the chunk's row (a ring of kChunks rows), so a step of the
// same side is always stamped after it. Summaries read rows that other threads may still write;
// they are diagnostics, taken once the traffic stopped.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace shadowsync::same_host {

class ChunkTimeline {
 public:
  static constexpr std::size_t kChunks = 4096;
  static constexpr std::size_t kSteps = 5;
  enum class SenderStep : std::size_t { kEnqueued = 0, kFilled, kRung, kAcked };
  enum class ReceiverStep : std::size_t { kDoorbell = 0, kOpened, kEnqueued, kCopied, kAckSent };

  // Nanoseconds of std::chrono::steady_clock, the clock every stamp uses.
  static std::int64_t now_ns() noexcept;

  explicit ChunkTimeline(bool sender);

  // Any thread; the side's first step (kEnqueued, kDoorbell) resets the row of `chunk`.
  void stamp(std::uint64_t chunk, SenderStep step, std::int64_t ns = now_ns()) noexcept;
  void stamp(std::uint64_t chunk, ReceiverStep step, std::int64_t ns = now_ns()) noexcept;

  // One line: the medians (microseconds) of each step-to-step interval over the chunks stamped
  // since the last call (at most kChunks), and how many chunks had both ends. Then forgets them.
  std::string summarize_and_reset();

 private:
  struct Row {
    std::atomic<std::uint64_t> chunk{~std::uint64_t{0}};
    std::array<std::atomic<std::int64_t>, kSteps> ns{};
  };
  void set(std::uint64_t chunk, std::size_t step, bool first, std::int64_t ns) noexcept;

  bool sender_;
  std::vector<Row> rows_;
  std::atomic<std::uint64_t> begin_{0};  // chunks below this were summarized already
  std::atomic<std::uint64_t> end_{0};    // one past the highest chunk stamped
};

}  // namespace shadowsync::same_host
