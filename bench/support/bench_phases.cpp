// One run of the update benchmark: its order of phases, budget and artefacts (see bench_phases.h).
#include "bench_phases.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "bench_goals.h"
#include "bench_report.h"
#include "bench_runner.h"
#include "bench_stamp.h"

namespace shadowsync::bench {

Bench::Bench(Platform& p, const Options& o) : p_(p), o_(o) {
  r_.mode = p.is_gpu() ? "gpu" : "cpu";
  r_.machine = o.machine.empty() ? p.machine() : o.machine;
  r_.machine_detail = p.machine_detail();
  const RunDate date = run_date_now();
  r_.date = date.date;
  r_.stem = "bench-" + r_.mode + "-" + date.file_stamp;
  r_.priorities = p.priority_range();
  r_.interference_model = o.interference_model;
  r_.sweep_model = o.sweep_model;
}

bool Bench::run() {
  progress(cat(r_.mode == "cpu" ? "CPU smoke mode (not GPU figures)" : "GPU mode", ": ", r_.machine,
               ", commit ", o_.commit, ", budget ", o_.budget_s, " s"));
  {
    progress("raw communicator: create and connect");
    raw_pair_ = std::make_unique<TransportPair>(p_.make_transports(0));
    DeviceBuffer a(p_.backend(0), kMiB), b(p_.backend(1), kMiB);
    raw_link(p_, *raw_pair_, a.data(), b.data(), kMiB, kMiB, 0);
  }
  for (const std::string& name : o_.models) {
    const ModelConfig& m = *find_model(name);
    run_model(m);
  }
  if (o_.sweep) run_sweep(*find_model(o_.sweep_model));
  // The swap strategies, integrity checks and sender faults come last: code that had not run on a
  // GPU before (remap, the integrity kernels, aborting a communicator mid-update) cannot spoil the
  // figures above.
  for (const std::string& name : o_.models) run_variants(*find_model(name));
  std::vector<std::string> verdicts;
  commit([&](Results& r) { verdicts = integrity_verdicts(r, o_); });
  for (const std::string& line : verdicts) progress("integrity verdict: " + line);
  run_faults();
  raw_pair_.reset();
  std::lock_guard lock(mutex_);
  return r_.errors.empty();
}

std::string Bench::write(const std::string& end_reason, bool complete) {
  std::lock_guard lock(mutex_);
  r_.elapsed_s = elapsed_since_start();
  r_.end_reason = end_reason;
  r_.complete = complete;
  std::filesystem::create_directories(o_.out_dir);
  const std::string base = (std::filesystem::path(o_.out_dir) / r_.stem).string();
  {
    std::ofstream json(base + ".json");
    json << results_json(r_, o_).dump();
    if (!json) throw BenchError(cat("cannot write ", base, ".json"));
  }
  {
    std::ofstream md(base + ".md");
    md << results_markdown(r_, o_);
    if (!md) throw BenchError(cat("cannot write ", base, ".md"));
  }
  return base;
}

std::string Bench::markdown() {
  std::lock_guard lock(mutex_);
  return results_markdown(r_, o_);
}

void Bench::error(const std::string& what, const std::string& why) {
  progress("ERROR " + what + ": " + why);
  commit([&](Results& r) { r.errors.push_back(what + ": " + why); });
}

bool Bench::have_budget(double seconds, const std::string& what) {
  const double left = o_.budget_s - elapsed_since_start();
  if (left >= seconds) return true;
  progress(strf("SKIP %s: needs ~%.0f s, %.0f s of the budget left", what.c_str(), seconds, left));
  commit([&](Results& r) { r.skipped.push_back(strf("%s (needs ~%.0f s, %.0f s left)", what.c_str(), seconds, left)); });
  return false;
}

double Bench::estimate(double fixed_s, double gb, double s_per_gb) const {
  return p_.is_gpu() ? fixed_s + gb * s_per_gb : 0.5 + fixed_s / 10;
}

std::size_t Bench::decode_bytes_for(std::size_t arena) const {
  return std::max<std::size_t>(256, std::min(o_.decode_bytes, arena) / 256 * 256);
}

}  // namespace shadowsync::bench
