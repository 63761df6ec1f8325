// A toy inference engine on the host backend, for the examples. Each step() runs the receiver's
// step hook on the calling thread (the engine thread), then enqueues one "decode step" on its
// stream that reads the live weights of every group: the first, middle and last word of every
// tensor, every word every `full_read_every`-th step, with `compute_time` of "compute" between the
// reads of the first and the second half of the tensors. A step is torn when a word it reads is
// not what the version the step hook made live wrote (weights.h; StepHook::live_content_version):
// the library guarantees that no step is, while updates stream in next to the steps.
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

#include "shadowsync/host_backend.h"
#include "shadowsync/receiver.h"

namespace shadowsync::examples {

struct HostEngineOptions {
  std::chrono::microseconds compute_time{0};
  std::size_t full_read_every = 16;  // 0: never
};

class HostEngine {
 public:
  // `backend` and `receiver` (a receiver on `backend`) must outlive the engine.
  HostEngine(HostBackend& backend, Receiver& receiver, HostEngineOptions options = {});
  ~HostEngine();  // waits for the steps enqueued
  HostEngine(const HostEngine&) = delete;
  HostEngine& operator=(const HostEngine&) = delete;

  // Engine thread: the step hook, then one decode step enqueued. Returns the version the hook
  // made live, if it made one.
  std::optional<std::uint64_t> step();
  Stream& stream() { return *stream_; }
  void synchronize();  // waits for every step enqueued

  // Thread-safe; complete for the steps done.
  std::uint64_t steps_done() const { return steps_done_.load(); }
  std::uint64_t torn_steps() const { return torn_steps_.load(); }
  std::string first_torn() const;  // "" while no step tore

 private:
  // Reads every other tensor from `first` on; the number of wrong words.
  std::size_t read_half(const std::vector<const std::byte*>& arenas,
                        const std::vector<std::uint64_t>& versions, std::size_t first,
                        bool full) const;
  void run_step(std::uint64_t index, const std::vector<const std::byte*>& arenas,
                const std::vector<std::uint64_t>& versions, bool full);

  HostBackend& backend_;
  Receiver& receiver_;
  HostEngineOptions options_;
  std::unique_ptr<Stream> stream_;
  std::uint64_t steps_enqueued_ = 0;
  std::atomic<std::uint64_t> steps_done_{0};
  std::atomic<std::uint64_t> torn_steps_{0};
  mutable std::mutex mutex_;
  std::string first_torn_;
};

}  // namespace shadowsync::examples
