// The toy engine of host_engine.h on a GPU (CUDA builds only), and the trainer's fill kernel.
//
// GpuEngine::step() runs the receiver's step hook on the engine thread, then enqueues one decode
// step on its stream: a kernel that reads the live weights of every group (the first, middle and
// last word of every tensor; every word every `full_read_every`-th step) and counts, on the
// device, the steps that read a word other than the version the hook made live (weights.h). The
// engine never waits on the host between steps except to stay at most `max_steps_in_flight` steps
// ahead of the GPU, as a real engine's scheduler does; torn_steps() is brought back by
// synchronize().
//
// This header needs no CUDA header; the kernels are in gpu_engine.cu.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shadowsync/backend.h"
#include "shadowsync/cuda_backend.h"
#include "shadowsync/layout.h"
#include "shadowsync/receiver.h"

namespace shadowsync::examples {

// Enqueues on `stream` (of `backend`) the kernels that write every tensor of `group` at
// `version` at its layout offset in `arena` (device memory of at least the group's arena_bytes()).
void fill_weights_async(CudaBackend& backend, Stream& stream, const Layout& layout,
                        std::size_t group, std::uint64_t version, std::byte* arena);

struct GpuEngineOptions {
  std::size_t full_read_every = 16;  // 0: never
  std::size_t max_steps_in_flight = 8;
  std::chrono::milliseconds wait_timeout{60'000};  // bound on every host wait
};

class GpuEngine {
 public:
  // `backend` and `receiver` (a receiver on `backend`) must outlive the engine.
  GpuEngine(CudaBackend& backend, Receiver& receiver, GpuEngineOptions options = {});
  ~GpuEngine();  // waits for the steps enqueued
  GpuEngine(const GpuEngine&) = delete;
  GpuEngine& operator=(const GpuEngine&) = delete;

  // Engine thread: the step hook, then one decode step enqueued. Returns the version the hook
  // made live, if it made one.
  std::optional<std::uint64_t> step();
  Stream& stream() { return *stream_; }
  // Engine thread: waits for every step enqueued (throws std::runtime_error past wait_timeout)
  // and brings the device's counters back.
  void synchronize();

  // As of the last synchronize(); engine thread:
  std::uint64_t steps_done() const { return steps_done_; }
  std::uint64_t torn_steps() const { return torn_steps_; }
  std::string first_torn() const { return first_torn_; }  // "" while no step tore

 private:
  struct Device;
  void wait(Event& event, const char* what);

  CudaBackend& backend_;
  Receiver& receiver_;
  GpuEngineOptions options_;
  std::unique_ptr<Stream> stream_;
  std::vector<std::unique_ptr<Event>> step_done_;  // one per step in flight
  std::unique_ptr<Device> device_;
  std::uint64_t steps_enqueued_ = 0;
  std::uint64_t steps_done_ = 0;
  std::uint64_t torn_steps_ = 0;
  std::string first_torn_;
};

}  // namespace shadowsync::examples
