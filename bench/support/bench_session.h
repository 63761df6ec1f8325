// What every scenario of the update benchmark stands on (bench_scenarios.h):
//
//   Probe, MemoryFigure     free device memory and the backend's allocation count, and the
//                           difference between two such probes
//   TrainerWeights          the trainer's weights on rank 0, handed to the sender tensor by tensor
//   Session                 a Sender (rank 0) and a Receiver (rank 1) for one layout, with a swap
//                           strategy (rebind: an engine adapter's rebind swap callback), optional
//                           integrity checks and an observer of every report
//
// Written against Platform (bench_platform.h), shadowsync's Backend and Transport; nothing CUDA.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "bench_common.h"
#include "bench_platform.h"
#include "shadowsync/backend.h"
#include "shadowsync/layout.h"
#include "shadowsync/receiver.h"
#include "shadowsync/sender.h"
#include "shadowsync/step_hook.h"

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

Probe probe(Platform& p, int rank);

struct MemoryFigure {
  std::optional<double> device_bytes;  // free-memory delta (what the device lost)
  double backend_bytes = 0;            // Backend::bytes_allocated delta
  double theoretical = 0;
};

// Memory taken between probes `before` and `after`.
MemoryFigure memory_between(const Probe& before, const Probe& after, double theoretical);

// ---------------------------------------------------------------------------------------------
// The trainer's weights on rank 0: one allocation with the layout's byte image, handed to
// Sender::publish as one SourceTensor per tensor (so the sender packs them through its staging
// buffers, as it would a trainer's scattered tensors).
// ---------------------------------------------------------------------------------------------
struct TrainerWeights {
  TrainerWeights(Platform& p, const Layout& layout);
  DeviceBuffer arena;
  std::vector<SourceTensor> sources;
};

// ---------------------------------------------------------------------------------------------
// Session: a Sender and a Receiver for one layout over one pair of transports.
// Thread: one engine thread calls hook(), settle() and the apply paths; publish() may run on
// another thread (the interference phase's feeder); the observer runs on the receiver's thread.
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
          const SessionConfig& config = {});
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  StepHook& hook() { return receiver_->step_hook(); }
  std::size_t bytes() const { return bytes_; }
  SwapStrategy strategy() const { return config_.strategy; }
  const ReceiverConfig& receiver_config() const { return receiver_config_; }

  // Publishes the next version from the trainer's weights and announces it to the receiver:
  // as scattered tensors (Sender::publish packs them through its staging buffers), or with
  // `from_arena`, straight from the trainer's arena (Sender::publish_arenas, no packing).
  PublishHandle publish(const TrainerWeights& weights, bool from_arena = false);
  std::uint64_t last_version() const { return version_.load(); }

  // Starts publishing the next version with no tensor supplied yet (Sender::publish_streamed)
  // and announces it: the caller supplies the tensors, or stops, as a trainer would.
  StreamedPublish publish_streamed();

  // Aborts the sender's end of the transport, as the death of the trainer's communicator would.
  // Transport::abort is thread-safe, but the Sender owns the transport and drops it once an update
  // fails: call this only while an update is in flight and nothing has failed yet (the pointer is
  // renewed by replace_transports).
  void abort_sender_transport() { sender_transport_->abort(); }

  // Waits for the receiver's report (ready or failed) of version `v` and returns it.
  Report wait_report(std::uint64_t v, const std::string& what);

  // Waits until version `v` was received (or failed: then throws).
  void wait_resolved(std::uint64_t v, const std::string& what);
  void throw_if_failed();
  // Engine thread, with no publisher running: lets every update land and applies the last one.
  void settle(Stream& engine_stream);

  std::size_t report_count() const;
  std::vector<Report> reports_since(std::size_t index) const;
  std::optional<Report> ready_report(std::uint64_t version) const;

  // A new pair of communicators (e.g. another CTA bound). Both old ones are torn down by their
  // owners' threads (the sender's worker, the receiver's thread) at about the same time.
  void replace_transports(int max_ctas);

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

}  // namespace shadowsync::bench
