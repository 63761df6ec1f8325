// ChunkTimeline: the per-chunk medians a device-flavour same-host link reports
// (same_host_timeline.h), from stamps placed by hand.
#include <catch2/catch.hpp>

#include <string>

#include "transports/same_host/same_host_timeline.h"

using shadowsync::same_host::ChunkTimeline;
using Sender = ChunkTimeline::SenderStep;
using Receiver = ChunkTimeline::ReceiverStep;

TEST_CASE("same-host timeline: sender medians per interval, then forgotten", "[same_host]") {
  ChunkTimeline timeline(true);
  // Chunk c: enqueued at 1000c us, filled 10 us later, rung 2 us after that, acked 300 us later.
  for (std::uint64_t c = 0; c < 5; ++c) {
    const std::int64_t t = static_cast<std::int64_t>(c) * 1'000'000;
    timeline.stamp(c, Sender::kEnqueued, t);
    timeline.stamp(c, Sender::kFilled, t + 10'000);
    timeline.stamp(c, Sender::kRung, t + 12'000);
    timeline.stamp(c, Sender::kAcked, t + 312'000);
  }
  const std::string line = timeline.summarize_and_reset();
  INFO(line);
  CHECK_THAT(line, Catch::Contains("chunks 0..5"));
  CHECK_THAT(line, Catch::Contains("enqueued->filled 10.0 us (n=5)"));
  CHECK_THAT(line, Catch::Contains("filled->rung 2.0 us (n=5)"));
  CHECK_THAT(line, Catch::Contains("rung->acked (receiver's share) 300.0 us (n=5)"));
  // acked(c-1) at 1000(c-1)+312, filled(c) at 1000c+10: 698 us, for chunks 1..4.
  CHECK_THAT(line, Catch::Contains("this stream's turnaround) 698.0 us (n=4)"));
  CHECK_THAT(line, Catch::Contains("(period) 1000.0 us (n=4)"));
  const std::string again = timeline.summarize_and_reset();
  INFO(again);
  CHECK_THAT(again, Catch::Contains("chunks 5..5"));
  CHECK_THAT(again, Catch::Contains("filled->rung -;"));
}

TEST_CASE("same-host timeline: a receiver's overlapping copies count as no idle time",
          "[same_host]") {
  ChunkTimeline timeline(false);
  // Chunk c's doorbell comes at 100c us, its copy is enqueued 5 us later and done at 100c+150:
  // each copy is enqueued before the previous one is done.
  for (std::uint64_t c = 0; c < 3; ++c) {
    const std::int64_t t = static_cast<std::int64_t>(c) * 100'000;
    timeline.stamp(c, Receiver::kDoorbell, t);
    timeline.stamp(c, Receiver::kOpened, t + 1'000);
    timeline.stamp(c, Receiver::kEnqueued, t + 5'000);
    timeline.stamp(c, Receiver::kCopied, t + 150'000);
    timeline.stamp(c, Receiver::kAckSent, t + 151'000);
  }
  // A stamp of a chunk whose row another chunk took is dropped, not mixed in.
  timeline.stamp(3 + ChunkTimeline::kChunks, Receiver::kCopied, 1);
  const std::string line = timeline.summarize_and_reset();
  INFO(line);
  CHECK_THAT(line, Catch::Contains("copy enqueued->copied 145.0 us (n=3)"));
  CHECK_THAT(line, Catch::Contains("(copy engine idle) 0.0 us (n=2)"));
  CHECK_THAT(line, Catch::Contains("(the sender's turnaround) 0.0 us (n=2)"));
  CHECK_THAT(line, Catch::Contains("copied(c-1)->copied(c) (period) 100.0 us (n=2)"));
}
