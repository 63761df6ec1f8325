// The update benchmark's options: their defaults (GPU), the CPU smoke mode's miniature, and the
// command line of bench_updates and bench_gpu.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "bench_common.h"
#include "shadowsync/layout.h"

namespace shadowsync::bench {

struct Options {
  bool cpu = false;
  std::string out_dir = "docs/bench";
  std::string commit;
  std::string machine;
  std::vector<std::string> models = {"qwen2.5-0.5b", "llama3-8b", "qwen2.5-14b"};
  std::string interference_model = "llama3-8b";
  std::string sweep_model = "llama3-8b";
  bool sweep = true;
  int swaps = 40;          // measured swaps per model (after `warmup` unmeasured ones)
  int warmup = 2;
  std::int64_t scale = 1;  // every model dimension divided by this (CPU mode: 32)
  std::size_t bucket_bytes = kDefaultBucketBytes;
  std::vector<std::size_t> sweep_buckets = {64 * kMiB, 128 * kMiB, 256 * kMiB, 512 * kMiB, kGiB};
  std::vector<int> sweep_ctas = {2, 4, 8, 16, 32};  // 0 (NCCL's default) is the default row
  std::size_t decode_bytes = 4 * kGiB;
  std::size_t alone_steps = 300;
  double during_seconds = 1.5;
  int sweep_updates = 6;
  std::size_t sweep_alone_steps = 150;
  double sweep_during_seconds = 1.0;
  std::size_t raw_chunk = kGiB;
  std::size_t sweep_raw_bytes = 4 * kGiB;
  int raw_reps = 3;
  int baseline_reps = 3;
  int copy_reps = 10;
  // The swap-strategy, integrity and sender-fault phases (after the sweep): few repetitions, each
  // costs a session.
  int strategy_swaps = 10;      // measured copy_in / remap swaps per model (after `warmup`)
  int integrity_updates = 10;   // measured updates per model with checksums, with the guard
  int raw_copy_reps = 10;       // raw device copies per model
  int fault_reps = 3;           // per fault variant (stalled, aborted)
  // The fault session's bucket deadline: the default (10 s) would make each repetition wait 10 s;
  // 1 s still leaves a new communicator's first bucket (it connects the peers) time to land.
  int fault_deadline_ms = 1000;
  int fast_path_calls = 2'000'000;
  double budget_s = 210;  // no phase starts that would end past this
  double watchdog_s = 0;  // hard stop (0: budget + 25 s)
  std::string command;
};

// The CPU smoke mode's miniature: dimensions / 32, so bytes / 1024 (buckets and decode too).
void apply_cpu_defaults(Options& o);

// Prints the usage to `out`; `has_gpu`: whether this program has a GPU mode.
void usage(std::FILE* out, const char* argv0, bool has_gpu);

// Parses argv. Returns nullopt (after printing why) on a bad argument; exits 0 on --help.
std::optional<Options> parse_options(int argc, char** argv, bool has_gpu);

}  // namespace shadowsync::bench
