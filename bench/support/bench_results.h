// The update benchmark's results, filled phase by phase by the run (bench_phases.h) and read by
// the goals (bench_goals.h) and the JSON and Markdown forms (bench_report.h). Plain data; an
// optional that is empty was not measured.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "bench_common.h"
#include "bench_platform.h"
#include "bench_scenarios.h"
#include "bench_session.h"

namespace shadowsync::bench {

struct ModelResult {
  std::string name;
  std::int64_t params = 0;
  std::size_t bytes = 0;
  std::size_t tensors = 0;
  std::size_t largest_tensor = 0;
  std::size_t bucket_bytes = 0;
  std::size_t buckets = 0;

  std::optional<Summary> stall_host_us, stall_stream_us;
  std::optional<double> fast_path_ns;
  std::optional<Summary> transfer_gbps, transfer_ms;
  std::optional<double> transfer_aggregate_gbps;
  std::optional<Summary> transfer_arena_gbps;  // Sender::publish_arenas: no packing
  std::optional<RawResult> raw;
  std::optional<BaselineResult> baseline;
  std::optional<CopyResult> copy;
  std::optional<MemoryFigure> mem_shadowsync, mem_baseline, mem_copy;
  // Swap strategies other than rebind (host and engine-stream stall of each swap), and the raw
  // device copy of the same bytes that copy_in is judged against.
  std::optional<Summary> copy_in_host_us, copy_in_stream_us, remap_host_us, remap_stream_us;
  std::string remap_unavailable;  // why remap was not measured (no CUDA VMM: the host backend)
  std::optional<Summary> raw_copy_ms;
  // Transfer time with the integrity checks on, against transfer_ms (plain).
  std::optional<Summary> checksums_transfer_ms, nonfinite_transfer_ms;
  std::optional<double> nccl_init_bytes, nccl_connect_bytes, sender_staging_bytes;
  std::vector<std::string> errors;
};

struct SweepRow {
  std::string knob;  // "default", "engine_priority", "max_ctas", "bucket"
  std::size_t bucket_bytes = 0;
  int max_ctas = 0;
  bool raised_priority = false;
  std::optional<Summary> gbps;          // engine idle
  std::optional<RawResult> raw;         // same CTA bound, own communicator
  std::optional<DecodeResult> decode;   // includes transfer GB/s while decoding
  std::string error;
};

// The sender-fault phase: one session with a short bucket deadline, both variants.
struct FaultPhase {
  std::string model;
  std::size_t bytes = 0;
  std::size_t buckets = 0;
  double bucket_deadline_ms = 0;
  double poll_interval_us = 0;
  std::vector<FaultResult> variants;
};

struct Results {
  std::string mode;  // "gpu" or "cpu"
  std::string machine;
  Json machine_detail;
  std::string date;
  std::string stem;
  PriorityRange priorities;
  std::vector<ModelResult> models;
  std::optional<DecodeResult> interference;
  std::string interference_model;
  std::vector<SweepRow> sweep;
  std::string sweep_model;
  std::optional<FaultPhase> fault;
  std::vector<std::string> skipped;
  std::vector<std::string> errors;
  double elapsed_s = 0;
  bool complete = false;
  std::string end_reason;
};

}  // namespace shadowsync::bench
