// Updates one after another, the fast path and decode interference (see bench_scenarios.h).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "bench_scenarios.h"

namespace shadowsync::bench {

UpdatesRun run_updates(Platform& p, Session& s, const TrainerWeights& weights,
                       Stream& engine_stream, int count, bool from_arena) {
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
double fast_path_ns(Session& s, Stream& engine_stream, int calls) {
  std::uint64_t sink = 0;
  const auto t0 = Clock::now();
  for (int i = 0; i < calls; ++i) sink += s.hook().before_step(engine_stream).has_value();
  const auto t1 = Clock::now();
  if (sink != 0) throw BenchError("an update was applied during the fast-path measurement");
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / calls;
}

namespace {

struct StepSample {
  Clock::time_point t0, t1;  // host: before the step hook, after the step completed
  double ms = 0;             // engine stream: the decode kernel
};

// Engine loop: step hook, then one decode step reading `decode_bytes` of the live weights (a
// different window each step), timed with stamps; the host waits for each step (as an engine
// that samples on the host does).
std::vector<StepSample> run_steps(Platform& p, Session& s, Stream& engine_stream,
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

}  // namespace

DecodeResult measure_interference(Platform& p, Session& s, const TrainerWeights& weights,
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

}  // namespace shadowsync::bench
