// bench_same_host_one_gpu's output: progress lines while it runs; at the end (and after every
// model) the JSON (schema shadowsync-bench-same-host/1) and the Markdown tables with the goals.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench_common.h"
#include "same_host_options.h"
#include "same_host_results.h"

namespace shadowsync::bench::same_host {

// Seconds since the program started.
double elapsed_s();

// Prints "[<elapsed> s] <line>" to stdout and flushes it.
void progress(const std::string& line);

// GB/s of `bytes` moved in `ms` milliseconds (0 for no time), and GB (1e9 bytes).
inline double gbps(double bytes, double ms) { return ms > 0 ? bytes / ms / 1e6 : 0.0; }
inline double gb(double bytes) { return bytes / 1e9; }

// Allocation slack in the memory goals: cudaMemGetInfo moves in 2 MiB pages, and both sides keep
// a few small buffers (events, checksum words).
inline constexpr std::int64_t kMemorySlack = 64ll << 20;

// One goal of one model, met or not.
struct Goal {
  std::string model;
  std::string name;
  double value = 0;
  double target = 0;
  std::string unit;
  bool met = false;
};

// The goals `r`'s figures can be held to (none for what was not measured).
std::vector<Goal> goals_of(const ModelRun& r);

// The Markdown tables of `runs`, with their notes and goals.
std::string tables(const std::vector<ModelRun>& runs);

// Writes <out>/bench-same-host-<stamp>.json and .md (`complete`: every model ran or was skipped).
void write_outputs(const Options& o, const RunInfo& info, const std::vector<ModelRun>& runs,
                   bool complete, const std::vector<std::string>& errors);

}  // namespace shadowsync::bench::same_host
