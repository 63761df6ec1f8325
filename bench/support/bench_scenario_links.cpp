// The link limit, the per-parameter baseline, copy-at-boundary and the raw device copy (see
// bench_scenarios.h).
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <vector>

#include "bench_scenarios.h"

namespace shadowsync::bench {

RawResult raw_link(Platform& p, TransportPair& pair, const std::byte* src, std::byte* dst,
                   std::size_t bytes, std::size_t chunk, int reps) {
  Rendezvous rendezvous;
  std::vector<double> stream_gbps, host_gbps;
  const auto each_chunk = [&](auto&& f) {
    for (std::size_t offset = 0; offset < bytes; offset += chunk) f(offset, std::min(chunk, bytes - offset));
  };
  run_two(
      [&](std::atomic<bool>& abort) {
        Backend& b = p.backend(0);
        auto stream = b.create_stream(StreamPriority::kNormal);
        auto done = b.create_event();
        for (int r = 0; r <= reps; ++r) {
          rendezvous.arrive_and_wait(abort, "raw broadcast start");
          each_chunk([&](std::size_t offset, std::size_t n) {
            pair.rank0->broadcast_async(const_cast<std::byte*>(src) + offset, n, 0, *stream);
          });
          sync_stream(b, *stream, *done, "the raw broadcast (sender)");
        }
      },
      [&](std::atomic<bool>& abort) {
        Backend& b = p.backend(1);
        auto stream = b.create_stream(StreamPriority::kLow);
        auto first = p.make_stamp(1);
        auto last = p.make_stamp(1);
        for (int r = 0; r <= reps; ++r) {
          rendezvous.arrive_and_wait(abort, "raw broadcast start");
          const auto t0 = Clock::now();
          first->record(*stream);
          each_chunk([&](std::size_t offset, std::size_t n) {
            pair.rank1->broadcast_async(dst + offset, n, 0, *stream);
          });
          last->record(*stream);
          last->wait("the raw broadcast (receiver)");
          const auto t1 = Clock::now();
          if (r == 0) continue;
          stream_gbps.push_back(gb_per_s(static_cast<double>(bytes), last->ms_since(*first) / 1e3));
          host_gbps.push_back(gb_per_s(static_cast<double>(bytes), to_s(t1 - t0)));
        }
      });
  return {summarize(stream_gbps), summarize(host_gbps), bytes, chunk};
}

BaselineResult per_parameter_baseline(Platform& p, TransportPair& pair, const Layout& layout,
                                      const std::byte* src, std::byte* live, std::byte* temp,
                                      int reps) {
  const std::vector<TensorPlacement>& tensors = layout.groups().at(0).tensors();
  RpcChannel rpc;
  std::vector<double> stall_ms;
  run_two(
      [&](std::atomic<bool>& abort) {  // the trainer
        Backend& b = p.backend(0);
        auto stream = b.create_stream(StreamPriority::kNormal);
        auto done = b.create_event();
        try {
          for (int r = 0; r <= reps; ++r) {
            const auto t0 = Clock::now();  // generation pauses here
            for (std::size_t i = 0; i < tensors.size(); ++i) {
              rpc.call(static_cast<int>(i));  // engine.update_weight(name, dtype, shape)
              pair.rank0->broadcast_async(const_cast<std::byte*>(src) + tensors[i].offset,
                                          tensors[i].bytes, 0, *stream);
              rpc.wait_reply(abort);
            }
            const auto t1 = Clock::now();  // ... and resumes here
            sync_stream(b, *stream, *done, "the trainer's broadcasts");
            if (r > 0) stall_ms.push_back(to_ms(t1 - t0));
          }
        } catch (...) {
          rpc.call(RpcChannel::kStop);
          throw;
        }
        rpc.call(RpcChannel::kStop);
      },
      [&](std::atomic<bool>& abort) {  // the engine
        Backend& b = p.backend(1);
        auto stream = b.create_stream(StreamPriority::kNormal);
        auto done = b.create_event();
        for (;;) {
          const int request = rpc.wait_request(abort);
          if (request == RpcChannel::kStop) break;
          const TensorPlacement& t = tensors.at(static_cast<std::size_t>(request));
          pair.rank1->broadcast_async(temp, t.bytes, 0, *stream);
          sync_stream(b, *stream, *done, "a per-tensor receive");
          b.memcpy_async(live + t.offset, temp, t.bytes, *stream);
          sync_stream(b, *stream, *done, "a per-tensor copy");
          rpc.reply();
        }
      });
  BaselineResult result;
  result.stall_ms = summarize(stall_ms);
  result.gbps = gb_per_s(static_cast<double>(layout.total_bytes()), result.stall_ms.median / 1e3);
  result.tensors = tensors.size();
  return result;
}

CopyResult copy_at_boundary(Platform& p, TransportPair& pair, const Layout& layout,
                            const std::byte* src, std::byte* shadow, std::byte* live, int reps) {
  const GroupLayout& group = layout.groups().at(0);
  CopyResult result;
  double receive_s = 0;
  run_two(
      [&](std::atomic<bool>&) {
        Backend& b = p.backend(0);
        auto stream = b.create_stream(StreamPriority::kNormal);
        auto done = b.create_event();
        for (std::size_t k = 0; k < group.bucket_count(); ++k) {
          const Bucket bucket = group.bucket(k);
          pair.rank0->broadcast_async(const_cast<std::byte*>(src) + bucket.offset, bucket.bytes, 0, *stream);
        }
        sync_stream(b, *stream, *done, "the bucketed send");
      },
      [&](std::atomic<bool>&) {
        Backend& b = p.backend(1);
        auto stream = b.create_stream(StreamPriority::kLow);
        auto done = b.create_event();
        const auto t0 = Clock::now();
        for (std::size_t k = 0; k < group.bucket_count(); ++k) {
          const Bucket bucket = group.bucket(k);
          pair.rank1->broadcast_async(shadow + bucket.offset, bucket.bytes, 0, *stream);
        }
        sync_stream(b, *stream, *done, "the bucketed receive");
        receive_s = to_s(Clock::now() - t0);
      });
  result.receive_gbps = gb_per_s(static_cast<double>(group.arena_bytes()), receive_s);

  auto engine_stream = p.make_engine_stream(false);
  auto before = p.make_stamp(1);
  auto after = p.make_stamp(1);
  std::vector<double> stall_ms, enqueue_us;
  for (int r = 0; r < reps; ++r) {
    p.hold(*engine_stream, kHold);
    before->record(*engine_stream);
    const auto t0 = Clock::now();
    p.backend(1).memcpy_async(live, shadow, group.arena_bytes(), *engine_stream);
    const auto t1 = Clock::now();
    after->record(*engine_stream);
    after->wait("the copy at the step boundary");
    stall_ms.push_back(after->ms_since(*before));
    enqueue_us.push_back(to_us(t1 - t0));
  }
  result.stall_ms = summarize(stall_ms);
  result.enqueue_us = summarize(enqueue_us);
  return result;
}

Summary raw_device_copy(Platform& p, std::byte* dst, const std::byte* src, std::size_t bytes, int reps) {
  auto engine_stream = p.make_engine_stream(false);
  auto before = p.make_stamp(1);
  auto after = p.make_stamp(1);
  std::vector<double> ms;
  for (int r = 0; r <= reps; ++r) {
    p.hold(*engine_stream, kHold);
    before->record(*engine_stream);
    p.device_copy(*engine_stream, dst, src, bytes);
    after->record(*engine_stream);
    after->wait("a raw device copy");
    if (r > 0) ms.push_back(after->ms_since(*before));
  }
  return summarize(ms);
}

}  // namespace shadowsync::bench
