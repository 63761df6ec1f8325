// A fake inference engine on the HostBackend: each decode step runs on the engine stream, reads
// every group's live weights (sampled words each step, every word every Nth step) and records
// the versions it saw: the test oracle (docs/architecture.md, 'Testing approach').
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "shadowsync/host_backend.h"
#include "shadowsync/receiver.h"

namespace shadowsync::testing {

inline constexpr std::uint64_t kTornVersion = ~std::uint64_t{0} - 1;

struct StepRecord {
  std::uint64_t applied_version = 0;  // the hook's applied version when the step was enqueued
  std::vector<std::uint64_t> seen;    // per group: the one version read, or kTornVersion
};

struct FakeEngineOptions {
  std::size_t full_check_every = 16;  // every Nth step reads every word of every tensor
  // Simulated compute in the middle of a step (between the two halves of its reads): widens the
  // window in which a receiver that ignores the release event would overwrite what a step reads.
  std::chrono::microseconds compute_time{0};
  bool record_steps = true;
};

class HostFakeEngine {
 public:
  HostFakeEngine(HostBackend& backend, Receiver& receiver, FakeEngineOptions options = {});
  ~HostFakeEngine();

  // Engine thread: runs the step hook, then enqueues one decode step. Returns what the hook did.
  std::optional<std::uint64_t> step();
  Stream& stream() { return *stream_; }
  void synchronize();  // waits for every enqueued step

  std::uint64_t steps_done() const { return steps_done_.load(); }
  std::uint64_t torn_steps() const { return torn_steps_.load(); }
  std::string first_torn() const;
  std::vector<StepRecord> records() const;  // call after synchronize()

  // Engine thread: steps until the receiver applied `version` (each step's result goes to
  // `after_step`, which may synchronize); false once `deadline` passed without it.
  bool step_until_applied(std::uint64_t version, std::chrono::steady_clock::time_point deadline,
                          const std::function<void(std::optional<std::uint64_t>)>& after_step);

 private:
  struct Sample {
    std::size_t tensor;
    std::size_t word;
  };
  void run_step(std::vector<const std::byte*> arenas, std::vector<std::uint64_t> expected,
                std::uint64_t applied, bool full);
  std::uint64_t read_group(std::size_t group, const std::byte* arena, std::uint64_t expected,
                           bool full, std::size_t half) const;

  HostBackend& backend_;
  Receiver& receiver_;
  FakeEngineOptions options_;
  std::unique_ptr<Stream> stream_;
  std::vector<std::vector<Sample>> samples_;  // per group
  std::uint64_t steps_enqueued_ = 0;
  std::atomic<std::uint64_t> steps_done_{0};
  std::atomic<std::uint64_t> torn_steps_{0};
  mutable std::mutex mutex_;
  std::string first_torn_;
  std::vector<StepRecord> records_;
};

// What the trainer sent, to check what the engine saw against.
class UpdateHistory {
 public:
  void add(std::uint64_t version, std::vector<std::size_t> groups);
  void mark_failed(std::uint64_t version);
  // The version a group's live bytes must have once `applied` is the applied version: the last
  // good update at or below `applied` that carried the group (0: none yet).
  std::uint64_t expected(std::size_t group, std::uint64_t applied) const;
  // Empty if every record is consistent with the history, else the first violation.
  std::string check(const std::vector<StepRecord>& records) const;

 private:
  struct Entry {
    std::uint64_t version;
    std::vector<std::size_t> groups;
    bool failed = false;
  };
  std::vector<Entry> entries_;  // increasing versions
};

}  // namespace shadowsync::testing
