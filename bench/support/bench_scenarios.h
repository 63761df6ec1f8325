// The scenarios the update benchmark measures, written once against Platform (bench_platform.h),
// shadowsync's Backend and Transport:
//
//   Session                 a Sender (rank 0) and a Receiver (rank 1) for one layout, with a swap
//                           strategy (rebind: an engine adapter's rebind swap callback), optional
//                           integrity checks and an observer of every report
//   run_updates             updates one after another, each applied as soon as it is ready: the
//                           engine stall of each swap (host, engine stream) and its transfer
//   raw_device_copy         a plain device copy of the same bytes (what copy_in is judged against)
//   sender_fault            the sender stops (or its transport is aborted) mid-update: time until
//                           the receiver reports the update failed, then recovery
//   measure_interference    memory-bound decode steps alone, then while updates stream in
//   raw_link                ncclBroadcast of the same bytes on a communicator of its own
//   per_parameter_baseline  pause; per tensor: RPC, broadcast into a temp, sync, copy, sync
//   copy_at_boundary        background bucketed receive into a shadow, one device copy at swap
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "bench_common.h"
#include "bench_platform.h"
#include "shadowsync/backend.h"
#include "shadowsync/layout.h"
#include "shadowsync/receiver.h"
#include "shadowsync/sender.h"
#include "shadowsync/step_hook.h"
#include "shadowsync/transport.h"

namespace shadowsync::bench {

// Stamps around a swap are recorded behind a kernel that holds the engine stream this long, so
// the host has enqueued everything the swap enqueues before the device reaches the first stamp:
// the stamps then measure the engine-stream time the swap holds, not the host's time.
inline constexpr std::chrono::microseconds kHold{1000};

// ---------------------------------------------------------------------------------------------
// Memory probes: free device memory (cudaMemGetInfo) and the backend's own allocation count.
// ---------------------------------------------------------------------------------------------
struct Probe {
  std::optional<std::size_t> free_device;
  std::size_t backend_allocated = 0;
};

inline Probe probe(Platform& p, int rank) {
  return {p.free_bytes(rank), p.backend(rank).bytes_allocated()};
}

struct MemoryFigure {
  std::optional<double> device_bytes;  // free-memory delta (what the device lost)
  double backend_bytes = 0;            // Backend::bytes_allocated delta
  double theoretical = 0;
};

// Memory taken between probes `before` and `after`.
inline MemoryFigure memory_between(const Probe& before, const Probe& after, double theoretical) {
  MemoryFigure m;
  if (before.free_device && after.free_device) {
    m.device_bytes = static_cast<double>(*before.free_device) - static_cast<double>(*after.free_device);
  }
  m.backend_bytes =
      static_cast<double>(after.backend_allocated) - static_cast<double>(before.backend_allocated);
  m.theoretical = theoretical;
  return m;
}

// ---------------------------------------------------------------------------------------------
// The trainer's weights on rank 0: one allocation with the layout's byte image, handed to
// Sender::publish as one SourceTensor per tensor (so the sender packs them through its staging
// buffers, as it would a trainer's scattered tensors).
// ---------------------------------------------------------------------------------------------
struct TrainerWeights {
  TrainerWeights(Platform& p, const Layout& layout)
      : arena(p.backend(0), layout.groups().at(0).arena_bytes()) {
    p.fill(0, arena.data(), arena.size(), 0x5eedu);
    for (const TensorPlacement& t : layout.groups()[0].tensors()) {
      sources.push_back(SourceTensor{t.spec.name, arena.data() + t.offset, t.spec.dtype, t.spec.shape});
    }
  }
  DeviceBuffer arena;
  std::vector<SourceTensor> sources;
};

// ---------------------------------------------------------------------------------------------
// Session: a Sender and a Receiver for one layout over one pair of transports.
// ---------------------------------------------------------------------------------------------
struct SessionConfig {
  SwapStrategy strategy = SwapStrategy::kRebind;
  // SenderConfig::checksums + ReceiverConfig::require_checksums. Off here, unlike the library's
  // default: the headline sessions are the plain baseline the integrity rows are compared with.
  bool checksums = false;
  bool reject_nonfinite = false;   // ReceiverConfig::reject_nonfinite
  std::chrono::milliseconds bucket_deadline{10'000};
  // A failed update is what the scenario provokes (sender_fault), not an error of the run.
  bool failures_expected = false;
};

class Session {
 public:
  struct Report {
    std::uint64_t version = 0;
    UpdateOutcome outcome = UpdateOutcome::kReady;
    std::size_t bytes = 0;
    double transfer_s = 0;
    Clock::time_point at;  // when the receiver reported it
    std::string error;
    ErrorCode code = ErrorCode::kInternal;  // kFailed: the kind of failure
  };
  // Probes around the construction (rank 1 unless named).
  struct Construction {
    Probe before_transports, after_transports, after_receiver;
  };

  Session(Platform& p, const Layout& layout, int max_ctas, Construction* trace = nullptr,
          const SessionConfig& config = {})
      : p_(p), bytes_(layout.total_bytes()), config_(config) {
    if (trace) trace->before_transports = probe(p, 1);
    TransportPair transports = p.make_transports(max_ctas);
    if (trace) trace->after_transports = probe(p, 1);
    SenderConfig sender_config;
    sender_config.update_deadline = std::chrono::milliseconds(kWaitLimit);
    sender_config.checksums = config.checksums;
    receiver_config_.update_deadline = std::chrono::milliseconds(kWaitLimit);
    receiver_config_.bucket_deadline = config.bucket_deadline;
    receiver_config_.require_checksums = config.checksums;
    receiver_config_.reject_nonfinite = config.reject_nonfinite;
    receiver_config_.swap_strategy = config.strategy;
    // copy_in and remap exist for engines that replay CUDA graphs; say so, as such an engine would.
    receiver_config_.engine_uses_cuda_graphs = config.strategy != SwapStrategy::kRebind;
    sender_transport_ = transports.rank0.get();
    sender_ = std::make_unique<Sender>(layout, p.backend(0), std::move(transports.rank0), sender_config);
    try {
      receiver_ = std::make_unique<Receiver>(layout, p.backend(1), std::move(transports.rank1),
                                             receiver_config_);
    } catch (...) {
      sender_.reset();
      throw;
    }
    if (trace) trace->after_receiver = probe(p, 1);

    for (const GroupLayout& group : layout.groups()) bound_.emplace_back(group.tensors().size());
    // What an engine adapter does under rebind: rebind each of its tensors to the new live
    // pointers. Under copy_in and remap the live addresses never move, so there is nothing to
    // rebind and the swap costs only what the strategy itself does.
    if (config.strategy == SwapStrategy::kRebind) {
      receiver_->step_hook().set_swap_callback([this](const AppliedUpdate& update) {
        StepHook& hook = receiver_->step_hook();
        for (const GroupSwap& swap : *update.swaps) {
          std::vector<void*>& tensors = bound_[swap.group];
          for (std::size_t t = 0; t < tensors.size(); ++t) tensors[t] = hook.live_tensor(swap.group, t);
        }
      });
    }
    receiver_->set_observer([this](const UpdateReport& r) {
      Report report{r.version, r.outcome, r.bytes, to_s(r.transfer), Clock::now(), r.error, r.code};
      std::lock_guard lock(mutex_);
      const bool error = r.outcome == UpdateOutcome::kFailed && !config_.failures_expected;
      if (error && first_error_.empty()) first_error_ = cat("update ", r.version, " failed: ", r.error);
      if (r.outcome != UpdateOutcome::kSuperseded) {
        last_resolved_.store(std::max(last_resolved_.load(), r.version));
      }
      if (error) failed_.fetch_add(1);
      reports_.push_back(std::move(report));
    });
  }

  ~Session() { destroy_pair(sender_, receiver_); }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  StepHook& hook() { return receiver_->step_hook(); }
  std::size_t bytes() const { return bytes_; }
  SwapStrategy strategy() const { return config_.strategy; }
  const ReceiverConfig& receiver_config() const { return receiver_config_; }

  // Publishes the next version from the trainer's weights and announces it to the receiver:
  // as scattered tensors (Sender::publish packs them through its staging buffers), or with
  // `from_arena`, straight from the trainer's arena (Sender::publish_arenas, no packing).
  PublishHandle publish(const TrainerWeights& weights, bool from_arena = false) {
    const std::uint64_t v = version_.fetch_add(1) + 1;
    const std::vector<std::string> groups = {std::string(kBaseGroup)};
    PublishHandle handle = from_arena ? sender_->publish_arenas(v, groups, {weights.arena.data()})
                                      : sender_->publish(v, groups, weights.sources);
    receiver_->begin_update(handle.header());
    return handle;
  }
  std::uint64_t last_version() const { return version_.load(); }

  // Starts publishing the next version with no tensor supplied yet (Sender::publish_streamed)
  // and announces it: the caller supplies the tensors, or stops, as a trainer would.
  StreamedPublish publish_streamed() {
    const std::uint64_t v = version_.fetch_add(1) + 1;
    StreamedPublish publish = sender_->publish_streamed(v, {std::string(kBaseGroup)});
    receiver_->begin_update(publish.header());
    return publish;
  }

  // Aborts the sender's end of the transport, as the death of the trainer's communicator would.
  // Transport::abort is thread-safe, but the Sender owns the transport and drops it once an update
  // fails: call this only while an update is in flight and nothing has failed yet (the pointer is
  // renewed by replace_transports).
  void abort_sender_transport() { sender_transport_->abort(); }

  // Waits for the receiver's report (ready or failed) of version `v` and returns it.
  Report wait_report(std::uint64_t v, const std::string& what) {
    std::optional<Report> found;
    wait_until(
        [&] {
          std::lock_guard lock(mutex_);
          for (const Report& r : reports_) {
            if (r.version == v && r.outcome != UpdateOutcome::kSuperseded) found = r;
          }
          return found.has_value();
        },
        what);
    return *found;
  }

  // Waits until version `v` was received (or failed: then throws).
  void wait_resolved(std::uint64_t v, const std::string& what) {
    wait_until([&] { return last_resolved_.load() >= v || failed_.load() > 0; }, what);
    throw_if_failed();
  }
  void throw_if_failed() {
    if (failed_.load() == 0) return;
    std::lock_guard lock(mutex_);
    throw BenchError(first_error_);
  }
  // Engine thread, with no publisher running: lets every update land and applies the last one.
  void settle(Stream& engine_stream) {
    wait_resolved(version_.load(), "the last update to land");
    hook().apply_pending_now(engine_stream);
  }

  std::size_t report_count() const {
    std::lock_guard lock(mutex_);
    return reports_.size();
  }
  std::vector<Report> reports_since(std::size_t index) const {
    std::lock_guard lock(mutex_);
    return {reports_.begin() + static_cast<std::ptrdiff_t>(std::min(index, reports_.size())),
            reports_.end()};
  }
  std::optional<Report> ready_report(std::uint64_t version) const {
    std::lock_guard lock(mutex_);
    for (auto it = reports_.rbegin(); it != reports_.rend(); ++it) {
      if (it->version == version && it->outcome == UpdateOutcome::kReady) return *it;
    }
    return std::nullopt;
  }

  // A new pair of communicators (e.g. another CTA bound). Both old ones are torn down by their
  // owners' threads (the sender's worker, the receiver's thread) at about the same time.
  void replace_transports(int max_ctas) {
    TransportPair transports = p_.make_transports(max_ctas);
    sender_transport_ = transports.rank0.get();
    sender_->replace_transport(std::move(transports.rank0));
    receiver_->replace_transport(std::move(transports.rank1));
    receiver_->drain();
  }

 private:
  Platform& p_;
  std::size_t bytes_;
  SessionConfig config_;
  ReceiverConfig receiver_config_;
  Transport* sender_transport_ = nullptr;  // owned by sender_
  std::unique_ptr<Sender> sender_;
  std::unique_ptr<Receiver> receiver_;
  std::vector<std::vector<void*>> bound_;  // the "engine's" tensor pointers, rebound per swap
  std::atomic<std::uint64_t> version_{0};

  mutable std::mutex mutex_;
  std::vector<Report> reports_;
  std::atomic<std::uint64_t> last_resolved_{0};
  std::atomic<std::uint64_t> failed_{0};
  std::string first_error_;
};

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

inline UpdatesRun run_updates(Platform& p, Session& s, const TrainerWeights& weights,
                              Stream& engine_stream, int count, bool from_arena = false) {
  UpdatesRun run;
  auto before = p.make_stamp(1);
  auto after = p.make_stamp(1);
  for (int i = 0; i < count; ++i) {
    PublishHandle handle = s.publish(weights, from_arena);
    const std::uint64_t v = handle.header().version;
    s.wait_resolved(v, cat("update ", v, " to be received"));
    wait_until([&] { return s.hook().has_pending(); }, cat("update ", v, " to be offered"));

    if (s.strategy() == SwapStrategy::kRemap) {
      before->record(engine_stream);
      before->wait("the engine stream before a remap swap");
    } else {
      p.hold(engine_stream, kHold);
      before->record(engine_stream);
    }
    const auto t0 = Clock::now();
    const std::optional<std::uint64_t> applied = s.hook().before_step(engine_stream);
    const auto t1 = Clock::now();
    after->record(engine_stream);

    if (applied != std::optional<std::uint64_t>(v)) {
      throw BenchError(cat("before_step made ", applied ? std::to_string(*applied) : "nothing",
                           " live, want version ", v));
    }
    if (!handle.wait_for(kWaitLimit)) throw BenchError(cat("publish of version ", v, " not done"));
    after->wait("the stamps around a swap");
    run.host_us.push_back(to_us(t1 - t0));
    run.stream_us.push_back(after->ms_since(*before) * 1000.0);
    const std::optional<Session::Report> report = s.ready_report(v);
    if (!report) throw BenchError(cat("no ready report for version ", v));
    run.transfer_ms.push_back(report->transfer_s * 1000.0);
    run.gbps.push_back(gb_per_s(static_cast<double>(report->bytes), report->transfer_s));
    run.bytes = report->bytes;
  }
  return run;
}

// before_step() with nothing pending, per call.
inline double fast_path_ns(Session& s, Stream& engine_stream, int calls) {
  std::uint64_t sink = 0;
  const auto t0 = Clock::now();
  for (int i = 0; i < calls; ++i) sink += s.hook().before_step(engine_stream).has_value();
  const auto t1 = Clock::now();
  if (sink != 0) throw BenchError("an update was applied during the fast-path measurement");
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / calls;
}

// ---------------------------------------------------------------------------------------------
// Decode interference.
// ---------------------------------------------------------------------------------------------
struct StepSample {
  Clock::time_point t0, t1;  // host: before the step hook, after the step completed
  double ms = 0;             // engine stream: the decode kernel
};

// Engine loop: step hook, then one decode step reading `decode_bytes` of the live weights (a
// different window each step), timed with stamps; the host waits for each step (as an engine
// that samples on the host does).
inline std::vector<StepSample> run_steps(Platform& p, Session& s, Stream& engine_stream,
                                         std::size_t decode_bytes, std::size_t max_steps,
                                         double max_seconds, const std::atomic<bool>* stop = nullptr) {
  std::vector<StepSample> steps;
  auto before = p.make_stamp(1);
  auto after = p.make_stamp(1);
  const std::size_t windows = std::max<std::size_t>(1, s.bytes() / decode_bytes);
  const auto start = Clock::now();
  for (std::size_t k = 0; k < max_steps; ++k) {
    if (to_s(Clock::now() - start) >= max_seconds) break;
    if (stop && stop->load()) break;
    StepSample step;
    step.t0 = Clock::now();
    s.hook().before_step(engine_stream);
    const std::byte* live = s.hook().live_arena(0);
    before->record(engine_stream);
    p.decode(engine_stream, live + (k % windows) * decode_bytes, decode_bytes);
    after->record(engine_stream);
    after->wait("a decode step");
    step.t1 = Clock::now();
    step.ms = after->ms_since(*before);
    steps.push_back(step);
  }
  return steps;
}

// The trainer of the interference phase: publishes the next update as soon as the engine applied
// the last one (a trainer waiting for its weights to land), so that a transfer is in flight
// nearly all the time. (Publishing as soon as the last one is *sent* would have the receiver take
// back nearly every update before the engine's next step boundary: latest wins.)
class Feeder {
 public:
  Feeder(Session& s, const TrainerWeights& weights) : s_(s), weights_(weights) {}
  ~Feeder() { stop(); }
  Feeder(const Feeder&) = delete;
  Feeder& operator=(const Feeder&) = delete;

  void start() {
    thread_ = std::thread([this] {
      try {
        while (!stop_.load()) {
          PublishHandle handle = s_.publish(weights_);
          ++published_;
          const std::uint64_t v = handle.header().version;
          if (!handle.wait_for(kWaitLimit)) throw BenchError(cat("publish of version ", v, " not done"));
          const auto deadline = Clock::now() + kWaitLimit;
          while (s_.hook().applied_version() < v && !stop_.load()) {
            s_.throw_if_failed();
            if (Clock::now() > deadline) throw BenchError(cat("version ", v, " not applied by the engine"));
            std::this_thread::yield();
          }
        }
      } catch (const std::exception& e) {
        error_ = e.what();
        failed_.store(true);
      }
    });
  }
  void stop() {
    stop_.store(true);
    if (thread_.joinable()) thread_.join();
  }
  const std::atomic<bool>& failed() const { return failed_; }
  const std::string& error() const { return error_; }  // after stop()
  std::uint64_t published() const { return published_.load(); }

 private:
  Session& s_;
  const TrainerWeights& weights_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> failed_{false};
  std::atomic<std::uint64_t> published_{0};
  std::string error_;
  std::thread thread_;
};

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

inline DecodeResult measure_interference(Platform& p, Session& s, const TrainerWeights& weights,
                                         Stream& engine_stream, std::size_t decode_bytes,
                                         std::size_t alone_steps, double during_seconds) {
  DecodeResult result;
  result.decode_bytes = decode_bytes;
  s.settle(engine_stream);
  run_steps(p, s, engine_stream, decode_bytes, 5, 1e9);  // warm-up
  const std::vector<StepSample> alone =
      run_steps(p, s, engine_stream, decode_bytes, alone_steps, 1e9);

  const std::size_t first_report = s.report_count();
  std::vector<StepSample> during;
  {
    Feeder feeder(s, weights);
    feeder.start();
    during = run_steps(p, s, engine_stream, decode_bytes, std::numeric_limits<std::size_t>::max(),
                       during_seconds, &feeder.failed());
    feeder.stop();
    if (feeder.failed().load()) throw BenchError(cat("the publisher failed: ", feeder.error()));
  }
  s.settle(engine_stream);

  std::vector<std::pair<Clock::time_point, Clock::time_point>> windows;
  std::vector<double> gbps;
  std::vector<double> transfer_ms;
  for (const Session::Report& r : s.reports_since(first_report)) {
    if (r.outcome == UpdateOutcome::kSuperseded) ++result.updates_superseded;
    if (r.outcome != UpdateOutcome::kReady) continue;
    ++result.updates_ready;
    const auto begin = r.at - std::chrono::duration_cast<Clock::duration>(
                                  std::chrono::duration<double>(r.transfer_s));
    windows.emplace_back(begin, r.at);
    gbps.push_back(gb_per_s(static_cast<double>(r.bytes), r.transfer_s));
    transfer_ms.push_back(r.transfer_s * 1000.0);
  }

  std::vector<double> alone_ms, during_ms, window_ms;
  for (const StepSample& step : alone) alone_ms.push_back(step.ms);
  for (const StepSample& step : during) {
    window_ms.push_back(step.ms);
    Clock::duration overlap{0};
    for (const auto& [begin, end] : windows) {
      const auto lo = std::max(begin, step.t0);
      const auto hi = std::min(end, step.t1);
      if (hi > lo) overlap += hi - lo;
    }
    if (overlap * 2 >= step.t1 - step.t0) during_ms.push_back(step.ms);
  }
  if (!during.empty()) {
    const auto lo = during.front().t0;
    const auto hi = during.back().t1;
    Clock::duration busy{0};
    for (const auto& [begin, end] : windows) {
      const auto a = std::max(begin, lo);
      const auto b = std::min(end, hi);
      if (b > a) busy += b - a;
    }
    result.busy_fraction = to_s(busy) / std::max(1e-9, to_s(hi - lo));
  }
  result.alone_ms = summarize(alone_ms);
  result.during_ms = summarize(during_ms);
  result.window_ms = summarize(window_ms);
  result.steps_total = during.size();
  result.steps_in_transfer = during_ms.size();
  result.transfer_gbps = summarize(gbps);
  result.transfer_ms = summarize(transfer_ms);
  if (result.alone_ms.median > 0 && result.during_ms.n > 0) {
    result.ratio_median = result.during_ms.median / result.alone_ms.median;
    result.ratio_p99 = result.during_ms.p99 / result.alone_ms.p99;
    // During a transfer of T ms the engine completes T/during steps instead of T/alone.
    result.lost_ms_per_update =
        result.transfer_ms.median * (1.0 - result.alone_ms.median / result.during_ms.median);
  }
  return result;
}

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

inline RawResult raw_link(Platform& p, TransportPair& pair, const std::byte* src, std::byte* dst,
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

// ---------------------------------------------------------------------------------------------
// The scheme shadowsync replaces (OpenRLHF, oat, the vLLM RFC): generation paused, then per
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

inline BaselineResult per_parameter_baseline(Platform& p, TransportPair& pair, const Layout& layout,
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

inline CopyResult copy_at_boundary(Platform& p, TransportPair& pair, const Layout& layout,
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

// ---------------------------------------------------------------------------------------------
// The raw device copy: one plain device-to-device copy of `bytes` on an engine stream (the
// platform's device_copy: cudaMemcpyAsync on a GPU), timed with stamps behind the same hold as a
// swap. What the copy_in swap, which copies the same bytes, is judged against. One unmeasured
// repetition first.
// ---------------------------------------------------------------------------------------------
inline Summary raw_device_copy(Platform& p, std::byte* dst, const std::byte* src, std::size_t bytes, int reps) {
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

inline const char* fault_name(SenderFault fault) {
  return fault == SenderFault::kStalled ? "stalled" : "aborted";
}

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

inline void sender_fault(Session& s, const TrainerWeights& weights, const Layout& layout,
                         Stream& engine_stream, SenderFault fault, int reps, FaultResult& result) {
  result.variant = fault_name(fault);
  // The tensors whose bytes end in the first half of the arena: at least one, never all.
  const std::vector<TensorPlacement>& placements = layout.groups().at(0).tensors();
  std::vector<SourceTensor> first_half;
  for (std::size_t t = 0; t + 1 < placements.size(); ++t) {
    if (t > 0 && placements[t].offset + placements[t].bytes > layout.total_bytes() / 2) break;
    first_half.push_back(weights.sources[t]);
  }
  for (int r = 0; r < reps; ++r) {
    ++result.reps;
    const std::uint64_t live = s.hook().applied_version();
    StreamedPublish publish = s.publish_streamed();
    const std::uint64_t v = publish.header().version;
    publish.supply(first_half);
    if (fault == SenderFault::kAborted) std::this_thread::sleep_for(kFaultSettle);
    const auto t0 = Clock::now();
    if (fault == SenderFault::kAborted) s.abort_sender_transport();
    const Session::Report report = s.wait_report(v, cat("the receiver's report of ", result.variant, " update ", v));
    if (report.outcome != UpdateOutcome::kFailed) {
      throw BenchError(cat(result.variant, " update ", v, " was not reported failed"));
    }
    result.report_ms.push_back(to_ms(report.at - t0));
    result.codes.push_back(shadowsync::to_string(report.code));
    if (r == 0) result.first_error = report.error;
    if (s.hook().has_pending() || s.hook().applied_version() != live) {
      throw BenchError(cat("after the failed update ", v, " the engine no longer serves version ", live));
    }

    // The trainer gives up on the update and both ends rendezvous again.
    publish.cancel();
    bool ended = false;
    try {
      ended = publish.handle().wait_for(kWaitLimit);
    } catch (const std::exception&) {
      ended = true;  // failed, as it must
    }
    if (!ended) throw BenchError(cat("the cancelled publish of update ", v, " did not end"));
    s.replace_transports(0);
    PublishHandle good = s.publish(weights);
    const std::uint64_t g = good.header().version;
    s.wait_resolved(g, cat("update ", g, " after the ", result.variant, " one"));
    if (!s.ready_report(g)) {
      throw BenchError(cat("update ", g, " after the ", result.variant, " one failed: ",
                           s.wait_report(g, "its report").error));
    }
    if (!good.wait_for(kWaitLimit)) throw BenchError(cat("publish of version ", g, " not done"));
    if (s.hook().apply_pending_now(engine_stream) != std::optional<std::uint64_t>(g)) {
      throw BenchError(cat("update ", g, " after the ", result.variant, " one did not apply"));
    }
    ++result.recovered;
  }
}

}  // namespace shadowsync::bench
