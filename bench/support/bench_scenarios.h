// The scenarios the update benchmark measures, written once against Platform (bench_platform.h),
// shadowsync's Backend and Transport, on a Session (bench_session.h):
//
//   run_updates             updates one after another, each applied as soon as it is ready: the
//                           engine stall of each swap (host, engine stream) and its transfer
//   fast_path_ns            before_step() with nothing pending
//   measure_interference    memory-bound decode steps alone, then while updates stream in
//   raw_link                ncclBroadcast of the same bytes on a communicator of its own
//   per_parameter_baseline  pause; per tensor: RPC, broadcast into a temp, sync, copy, sync
//   copy_at_boundary        background bucketed receive into a shadow, one device copy at swap
//   raw_device_copy         a plain device copy of the same bytes (what copy_in is judged against)
//   sender_fault            the sender stops (or its transport is aborted) mid-update: time until
//                           the receiver reports the update failed, then recovery
//
// Implemented in bench_scenario_updates.cpp (updates, fast path, interference),
// bench_scenario_links.cpp (raw link, baseline, copy-at-boundary, raw copy) and
// bench_scenario_fault.cpp. Each is called on the engine's thread (rank 1); a scenario that needs
// a trainer runs it on a thread of its own. Every wait is bounded (kWaitLimit, bench_common.h).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "bench_common.h"
#include "bench_platform.h"
#include "bench_session.h"
#include "shadowsync/backend.h"
#include "shadowsync/layout.h"

namespace shadowsync::bench {

// ---------------------------------------------------------------------------------------------
// Updates one after another; each is applied by the engine thread (this one) as soon as it is
// ready. Per swap: the host time of before_step() (the swap path, rebind callback included) and
// the engine-stream time between stamps around it; per update: bytes / UpdateReport.transfer.
//
// rebind and copy_in: the stamps are queued behind a kernel that holds the engine stream (kHold),
// so they time what the swap enqueues (copy_in: its copy) and not the host. remap: the swap
// synchronizes the engine stream, so a held stream would be charged to the host's swap; instead
// the stream is idle, as the contract's free case (an engine that synchronized at the step
// boundary), and the stamps bracket the host's remap: the time the stream gets no new work.
// ---------------------------------------------------------------------------------------------
struct UpdatesRun {
  std::vector<double> host_us;
  std::vector<double> stream_us;
  std::vector<double> transfer_ms;
  std::vector<double> gbps;
  std::size_t bytes = 0;
};

UpdatesRun run_updates(Platform& p, Session& s, const TrainerWeights& weights,
                       Stream& engine_stream, int count, bool from_arena = false);

// before_step() with nothing pending, per call.
double fast_path_ns(Session& s, Stream& engine_stream, int calls);

// ---------------------------------------------------------------------------------------------
// Decode interference: decode steps alone (after five unmeasured ones), then for `during_seconds`
// while a trainer thread publishes the next update as soon as the engine applied the last one.
// A step counts as "during a transfer" when a transfer overlapped at least half of it. The
// session is settled before and after.
// ---------------------------------------------------------------------------------------------
struct DecodeResult {
  Summary alone_ms;
  Summary during_ms;       // steps that overlapped a transfer for at least half their time
  Summary window_ms;       // every step of the window with updates streaming
  std::size_t steps_total = 0;
  std::size_t steps_in_transfer = 0;
  std::size_t updates_ready = 0;
  std::size_t updates_superseded = 0;
  double busy_fraction = 0;  // share of the window with a transfer in flight
  Summary transfer_gbps;     // transfers while decoding
  Summary transfer_ms;
  double ratio_median = 0;   // during / alone
  double ratio_p99 = 0;
  double lost_ms_per_update = 0;  // decode time the engine loses per update
  std::size_t decode_bytes = 0;
};

DecodeResult measure_interference(Platform& p, Session& s, const TrainerWeights& weights,
                                  Stream& engine_stream, std::size_t decode_bytes,
                                  std::size_t alone_steps, double during_seconds);

// ---------------------------------------------------------------------------------------------
// The link limit: a plain broadcast of `bytes` from rank 0's `src` into rank 1's `dst`, in
// chunks of at most `chunk` bytes enqueued back to back (NCCL's count stays far from 2^31), on a
// communicator of its own. Rank 1 times it with stamps on its stream (the link) and with the host
// clock from a common rendezvous to completion observed (comparable with UpdateReport.transfer).
// The first repetition warms up (and on a fresh communicator connects the peers) and is dropped.
// ---------------------------------------------------------------------------------------------
struct RawResult {
  Summary stream_gbps;
  Summary host_gbps;
  std::size_t bytes = 0;
  std::size_t chunk = 0;
};

RawResult raw_link(Platform& p, TransportPair& pair, const std::byte* src, std::byte* dst,
                   std::size_t bytes, std::size_t chunk, int reps);

// ---------------------------------------------------------------------------------------------
// The scheme shadowsync replaces (as OpenRLHF and oat do it): generation paused, then per
// tensor: an RPC to the engine (here a condition-variable handoff between the trainer thread and
// the engine thread), a broadcast into a preallocated temporary of the largest tensor's size, a
// stream sync, a copy into the live weights, a sync, the RPC's answer. The engine is stalled for
// the whole update. One unmeasured repetition first.
// ---------------------------------------------------------------------------------------------
struct BaselineResult {
  Summary stall_ms;
  double gbps = 0;
  std::size_t tensors = 0;
};

BaselineResult per_parameter_baseline(Platform& p, TransportPair& pair, const Layout& layout,
                                      const std::byte* src, std::byte* live, std::byte* temp,
                                      int reps);

// ---------------------------------------------------------------------------------------------
// Copy-at-boundary (cosmos-rl): the update is received in the background into a shadow, in
// buckets, on a low-priority stream; at the step boundary one device copy per group arena, shadow
// to live, on the engine stream. Its stall is that copy, timed with stamps on the engine stream.
// ---------------------------------------------------------------------------------------------
struct CopyResult {
  Summary stall_ms;
  Summary enqueue_us;
  double receive_gbps = 0;
};

CopyResult copy_at_boundary(Platform& p, TransportPair& pair, const Layout& layout,
                            const std::byte* src, std::byte* shadow, std::byte* live, int reps);

// ---------------------------------------------------------------------------------------------
// The raw device copy: one plain device-to-device copy of `bytes` on an engine stream (the
// platform's device_copy: cudaMemcpyAsync on a GPU), timed with stamps behind the same hold as a
// swap. What the copy_in swap, which copies the same bytes, is judged against. One unmeasured
// repetition first.
// ---------------------------------------------------------------------------------------------
Summary raw_device_copy(Platform& p, std::byte* dst, const std::byte* src, std::size_t bytes, int reps);

// ---------------------------------------------------------------------------------------------
// A trainer that fails mid-update. The session publishes with Sender::publish_streamed and
// supplies the tensors of the first half of the arena; t0 is the moment the trainer stops.
// kStalled (a hung trainer, as under SIGSTOP): it supplies nothing more; t0 is when its last
// supply() returned. kAborted (its communicator torn down, as a dying process's is): kFaultSettle
// after the last supply() returned, so that the buckets it handed over have landed and none of
// its kernels is mid-bucket, its transport is aborted; t0 is the abort. Timed: t0 to the
// receiver's failure report (taken in the observer). Then the update is cancelled on the sender,
// both ends get new transports (a restarted trainer's rendezvous), and the next update must
// arrive and apply. Each repetition fills `result` as it goes, so that a failure part-way keeps
// what was measured.
// ---------------------------------------------------------------------------------------------
enum class SenderFault { kStalled, kAborted };

const char* fault_name(SenderFault fault);

struct FaultResult {
  std::string variant;
  std::vector<double> report_ms;   // t0 to the failure report, per repetition
  std::vector<std::string> codes;  // the report's ErrorCode, per repetition
  std::string first_error;         // the first repetition's report
  int reps = 0;                    // repetitions started
  int recovered = 0;               // repetitions after which the next update applied
};

// Long enough for a few buckets in flight to land (512 MiB: ~1.5 ms on NVLink), short next to a
// bucket deadline.
inline constexpr std::chrono::milliseconds kFaultSettle{20};

void sender_fault(Session& s, const TrainerWeights& weights, const Layout& layout,
                  Stream& engine_stream, SenderFault fault, int reps, FaultResult& result);

}  // namespace shadowsync::bench