// What bench_same_host_one_gpu found: per model (ModelRun, filled by same_host_model_run.h) and
// about the run (RunInfo); written out by same_host_report.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace shadowsync::bench::same_host {

// Unmeasured updates before the measured ones, per model.
inline constexpr int kWarmup = 2;

// Decode steps in one condition: alone, or while something else moves the model's bytes.
struct DecodeRow {
  std::string variant;
  std::vector<double> ms;
  double copy_gbps = 0;  // the copy's own rate while decoding (0: no copy)
  int copies = 0;        // updates (or emulated updates) done in the window
  double busy = 0;       // fraction of the window with a copy in flight
};

struct MemoryFigures {
  std::int64_t slot_bytes = 0;
  std::int64_t connection_delta = 0;  // device-wide, serve + connect
  std::int64_t trainer_serve_backend_delta = 0;
  std::int64_t engine_connect_backend_delta = 0;
  std::int64_t receiver_delta = 0;  // device-wide, Receiver constructed
  std::int64_t receiver_backend_delta = 0;
  std::int64_t sender_delta = 0;  // device-wide (trainer-measured), Sender constructed
  std::int64_t sender_backend_delta = 0;
  std::int64_t updates_delta = 0;  // device-wide, across the measured updates
  std::int64_t trainer_backend_after_updates = 0;
};

struct ModelRun {
  std::string name;
  std::size_t bytes = 0;
  std::size_t tensors = 0;
  std::size_t buckets = 0;
  std::size_t largest_tensor = 0;
  std::string sources;  // full, shared, or empty when skipped
  std::size_t source_bytes = 0;
  std::string sources_note;
  // The transport's per-chunk medians over the "transport alone" reps (after the warm-up one):
  // where each chunk's time went, on each side.
  std::string sender_timeline;
  std::string receiver_timeline;
  std::vector<double> raw_ms;
  std::vector<double> transport_ms;          // trainer side
  std::vector<double> transport_engine_ms;   // engine side (adds a pipe round trip)
  std::vector<double> publish_ms;            // trainer side, end to end
  std::vector<double> receiver_transfer_ms;  // UpdateReport::transfer
  std::vector<double> stall_host_us;
  std::vector<double> stall_stream_us;
  std::size_t decode_bytes = 0;
  std::vector<DecodeRow> decode;
  MemoryFigures memory;
  std::vector<std::string> skipped;
  std::string error;
  double seconds = 0;
};

// The run's stamp and what it ran on.
struct RunInfo {
  std::string machine;
  std::string date;
  std::string stamp;  // the date in file names
  std::string command;
  std::string device;
  std::size_t device_memory = 0;
  std::string token_source;
  int sm_copy_ctas = 0;
  int sm_copy_threads = 0;
};

}  // namespace shadowsync::bench::same_host
