// One run of the update benchmark: the phases in their order, the time budget, the results as they
// are measured. Private to bench_runner.cpp and the bench_phase*.cpp files that implement it.
//
// Thread: run() on one thread; write() may also be called from the watchdog's thread while run()
// is still going (mutex_ guards the results).
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <string>

#include "bench_models.h"
#include "bench_options.h"
#include "bench_platform.h"
#include "bench_results.h"
#include "bench_scenarios.h"
#include "bench_session.h"
#include "shadowsync/layout.h"

namespace shadowsync::bench {

class Bench {
 public:
  Bench(Platform& p, const Options& o);
  ~Bench() = default;  // raw_pair_'s two ends are torn down together (TransportPair)
  Bench(const Bench&) = delete;
  Bench& operator=(const Bench&) = delete;

  // Runs every phase the budget allows. Returns false if any phase failed.
  bool run();

  // Writes <stem>.json and <stem>.md to the output directory; returns the stem's path.
  std::string write(const std::string& end_reason, bool complete);
  std::string markdown();

 private:
  template <typename F>
  void commit(F&& f) {
    std::lock_guard lock(mutex_);
    f(r_);
  }
  void error(const std::string& what, const std::string& why);
  // Whether `seconds` of the budget are left; if not, records `what` as skipped.
  bool have_budget(double seconds, const std::string& what);
  // Rough cost of a phase on this platform: fixed + per GB moved.
  double estimate(double fixed_s, double gb, double s_per_gb) const;
  std::size_t decode_bytes_for(std::size_t arena) const;

  // bench_phase_model.cpp: shadowsync's stall, transfer and memory, the raw link, copy-at-boundary
  // and the per-parameter baseline on one model; then the other swap strategies and the integrity
  // checks.
  void run_model(const ModelConfig& config);
  // The other swap strategies and the integrity checks: a session each (the config is fixed at
  // construction), `count` updates applied as they land after o_.warmup unmeasured ones.
  UpdatesRun variant_updates(const Layout& layout, const TrainerWeights& weights, const SessionConfig& config,
                             int count);
  void run_variants(const ModelConfig& config);

  // bench_phase_sweep.cpp: the knob sweep and the sender fault.
  // Sender fault to engine report, on one model: llama3-8b (many buckets, so "mid-update" is
  // well inside the update) if it is run, else the last model named.
  void run_faults();
  void run_sweep(const ModelConfig& config);
  void sweep_row_body(SweepRow& row, Session& session, const TrainerWeights& weights, Stream& engine_stream,
                      std::size_t decode_bytes);

  Platform& p_;
  const Options& o_;
  std::mutex mutex_;  // guards r_ (the watchdog writes it out from its own thread)
  Results r_;
  std::unique_ptr<TransportPair> raw_pair_;  // NCCL's default CTAs; raw link, baseline, copy
};

}  // namespace shadowsync::bench
