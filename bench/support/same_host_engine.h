// bench_same_host_one_gpu's engine process: its streams and the decode steps it times, the copy
// loop it measures them against, and what run_model (same_host_model_run.h) needs of the trainer.
// CUDA builds only.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "bench_common.h"
#include "same_host_options.h"
#include "same_host_trainer_process.h"
#include "shadowsync/cuda_backend.h"
#include "shadowsync/receiver.h"

namespace shadowsync::bench::same_host {

struct Engine {
  const Options& options;
  CudaBackend& backend;
  TrainerProcess* trainer = nullptr;
  std::string token;
  std::string socket_dir;
  int sms = 0;
  std::unique_ptr<Stream> stream;  // the engine's steps
  cudaStream_t native = nullptr;
  std::unique_ptr<Stream> copy_stream;  // low priority, as the receiver's: raw and emulated copies
  cudaStream_t copy_native = nullptr;
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  float* partials = nullptr;
  std::size_t partials_capacity = 0;

  Engine(const Options& o, CudaBackend& b);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // One decode step over `bytes` of `data` on the engine stream, timed with events (ms).
  double decode(const std::byte* data, std::size_t bytes);

  // Decode steps as an engine runs them: before_step (swapping when an update is pending), then
  // a step over the live weights; `steps` of them, or until `until`.
  std::vector<double> decode_loop(StepHook& hook, std::size_t group, std::size_t bytes, int steps,
                                  std::optional<Clock::time_point> until);
};

// Copies `update_bytes` bucket by bucket (bucket-sized pieces from a two-bucket source ring into a
// two-bucket destination ring) on `stream`, one emulated update after the other, until `stop`.
// With `sm_ctas` > 0 an SM kernel copies, else cudaMemcpyAsync (the copy engines).
struct CopyLoop {
  int updates = 0;
  double copy_gbps = 0;
  std::string error;

  void run(int device, cudaStream_t stream, std::byte* src, std::byte* dst, std::size_t bucket,
           std::size_t update_bytes, int sm_ctas, const std::atomic<bool>& stop);
};

// Joins a background thread however the scope is left; `stop` tells it to finish.
struct Background {
  std::atomic<bool> stop{false};
  std::thread thread;
  ~Background() {
    stop.store(true);
    if (thread.joinable()) thread.join();
  }
};

}  // namespace shadowsync::bench::same_host
