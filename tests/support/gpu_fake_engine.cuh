// The test oracle (fake_engine.h, pattern.h) on a real GPU: a fake inference engine on one
// CudaBackend whose decode steps are CUDA kernels on the engine's stream, and the fill kernel a
// trainer uses to write the pattern of a version into device tensors.
//
// Each GpuFakeEngine::step() runs the receiver's step hook on the host (the swap, if an update is
// pending), reads the live pointer table and the content versions the hook says are live, and
// launches ONE decode kernel on the engine stream. The kernel reads, in every group, sampled words
// every step (first, middle and last word of every tensor, and the words on both sides of every
// bucket boundary) and every word of every tensor every Nth step, decodes the version each word
// was written at (pattern_word.h), and writes one record: the applied version and, per group, the
// single version it read or kTornVersion when it read two. A step whose group read anything but
// the content version the hook made live counts as torn (a device counter). Nothing in a step
// waits on the host: records stay on the device until synchronize() (or a full record ring) pulls
// them back, and UpdateHistory::check judges them like the HostFakeEngine's.
//
// This header needs no CUDA headers (it is included from .cu and .cpp files alike); the kernels
// live in gpu_fake_engine.cu, which is compiled only when the CUDA backend is built.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fake_engine.h"  // StepRecord, kTornVersion, UpdateHistory
#include "pattern_word.h"
#include "shadowsync/backend.h"
#include "shadowsync/cuda_backend.h"
#include "shadowsync/layout.h"
#include "shadowsync/receiver.h"

namespace shadowsync::testing {

// The most groups (base + adapters) a GpuFakeEngine decodes: they travel in the kernel's
// parameters.
inline constexpr std::size_t kGpuEngineMaxGroups = 8;

// ---------------------------------------------------------------------------------------------
// (a) Fill: what the trainer's optimizer step would produce.
// ---------------------------------------------------------------------------------------------

// Enqueues on `stream` (a stream of `backend`) a kernel that writes the pattern of
// (group, tensor, version) into `bytes` bytes of device memory at `dst`: word w is
// pattern_word(group, tensor, w, version); a partial tail word gets its low-order bytes, as
// fill_pattern() writes on the host. Makes backend's device current. Throws std::runtime_error on
// a launch failure.
void fill_pattern_async(CudaBackend& backend, Stream& stream, void* dst, std::size_t bytes,
                        std::size_t group, std::size_t tensor, std::uint64_t version);

// Fills every tensor of `group` at its layout offset inside `arena` (a device buffer of at least
// the group's arena_bytes()) at `version`: one kernel per tensor. Padding is left as it is.
void fill_group_async(CudaBackend& backend, Stream& stream, const Layout& layout,
                      std::size_t group, std::uint64_t version, std::byte* arena);

// ---------------------------------------------------------------------------------------------
// (b) The fake engine.
// ---------------------------------------------------------------------------------------------

struct GpuFakeEngineOptions {
  // Every Nth step (steps 0, N, 2N, ...) reads every word of every tensor; 0: never.
  std::size_t full_check_every = 16;
  // true: the engine waits for its stream after every step, as an engine that samples on the host
  // does. false: the engine only ever waits through events (the swap's release events, and the
  // run-ahead bound below).
  bool host_sync_each_step = false;
  // Without host_sync_each_step: at most this many steps enqueued and not finished, as a real
  // engine's scheduler runs one or two steps ahead (waits on the event of step k-N before
  // enqueueing step k). 0: unbounded (CUDA's launch queue is the only bound).
  std::size_t max_steps_in_flight = 8;
  // Records the device holds before step() pulls them back (a host wait between two steps).
  std::size_t record_capacity = std::size_t{1} << 15;
  // Consecutive records with the same applied version and the same versions read are kept once.
  // UpdateHistory::check judges each record alone (and needs applied versions not to go back),
  // so its verdict does not change, while its cost (records x history) drops from steps to swaps.
  bool merge_repeated_records = true;
  // Bound on every host wait (a step's sync, the run-ahead bound, synchronize()).
  std::chrono::milliseconds wait_timeout{60'000};
  // Run the steps on a stream the caller owns (CudaBackend::wrap_stream) instead of a fresh
  // normal-priority stream of the backend. The caller keeps it alive while the engine exists.
  bool wrap_external_stream = false;
  CudaStreamHandle external_stream = nullptr;
};

class GpuFakeEngine {
 public:
  // Builds the sample and chunk tables of the receiver's layout and uploads them (host waits,
  // here only). Throws std::runtime_error for a layout of more than kGpuEngineMaxGroups groups.
  GpuFakeEngine(CudaBackend& backend, Receiver& receiver, GpuFakeEngineOptions options = {});
  ~GpuFakeEngine();  // waits for every enqueued step (bounded), then frees
  GpuFakeEngine(const GpuFakeEngine&) = delete;
  GpuFakeEngine& operator=(const GpuFakeEngine&) = delete;

  // Engine thread: runs the step hook, then enqueues one decode step. Returns what the hook did.
  std::optional<std::uint64_t> step();
  Stream& stream() { return *stream_; }

  // Waits for every enqueued step (throws std::runtime_error past options.wait_timeout) and pulls
  // the records and the torn counter back to the host.
  void synchronize();

  std::uint64_t steps_enqueued() const { return steps_enqueued_; }
  std::uint64_t full_steps_enqueued() const { return full_steps_enqueued_; }
  // As of the last synchronize():
  std::uint64_t steps_done() const { return steps_done_; }      // device-side step counter
  std::uint64_t torn_steps() const { return torn_steps_; }      // device-side torn counter
  std::uint64_t torn_records() const { return torn_records_; }  // torn steps seen in records
  std::string first_torn() const { return first_torn_; }        // "" if none
  std::vector<StepRecord> records() const { return records_; }
  std::size_t record_count() const { return records_.size(); }

  std::size_t samples_per_step() const { return sample_count_; }
  std::size_t bytes_per_full_check() const { return full_bytes_; }

 private:
  struct Tables;
  void wait_event(Event& event, const char* what);
  void pull_records(std::uint64_t count);  // the first `count` slots of the ring
  void flush_ring();                       // all steps done, ring emptied into records_

  CudaBackend& backend_;
  Receiver& receiver_;
  GpuFakeEngineOptions options_;
  std::size_t groups_ = 0;
  std::size_t record_words_ = 0;  // uint64 words per device record
  std::unique_ptr<Stream> stream_;
  std::unique_ptr<Event> sync_event_;
  std::vector<std::unique_ptr<Event>> step_events_;  // run-ahead bound, one per slot
  std::unique_ptr<Tables> tables_;
  std::size_t sample_count_ = 0;
  std::size_t chunk_count_ = 0;
  std::size_t full_bytes_ = 0;
  int sample_grid_ = 1;
  int full_grid_ = 1;

  std::uint64_t steps_enqueued_ = 0;
  std::uint64_t full_steps_enqueued_ = 0;
  std::uint64_t ring_used_ = 0;  // slots written since the ring was last emptied
  std::uint64_t steps_done_ = 0;
  std::uint64_t torn_steps_ = 0;
  std::uint64_t torn_records_ = 0;
  std::string first_torn_;
  std::vector<StepRecord> records_;
};

}  // namespace shadowsync::testing
