// What the CUDA benchmark programs share (bench_gpu.cu, bench_swap_one_gpu.cu,
// bench_integrity_one_gpu.cu): checking a runtime call, timing work on a stream with events, and
// the GPU's clock.
// CUDA only; the platform-neutral pieces are in bench_common.h.
#pragma once

#include <cuda_runtime_api.h>

#include <vector>

#include "bench_common.h"

// Throws BenchError naming the call, the CUDA error and where.
#define BENCH_CUDA(call)                                                                       \
  do {                                                                                         \
    const cudaError_t bench_status = (call);                                                   \
    if (bench_status != cudaSuccess) {                                                         \
      throw ::shadowsync::bench::BenchError(::shadowsync::bench::cat(                          \
          #call, " failed: ", cudaGetErrorString(bench_status), " (", __FILE__, ":", __LINE__, \
          ")"));                                                                               \
    }                                                                                          \
  } while (0)

namespace shadowsync::bench {

#if defined(__CUDACC__)
// The GPU's global nanosecond clock, readable from any thread of any kernel.
__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#endif

// Milliseconds between two events recorded around `enqueue()` on `stream`, once per repetition
// (the stream drained after each, so repetitions do not overlap).
template <typename Enqueue>
std::vector<double> time_on_stream(cudaStream_t stream, int reps, Enqueue&& enqueue) {
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  BENCH_CUDA(cudaEventCreate(&start));
  BENCH_CUDA(cudaEventCreate(&stop));
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    BENCH_CUDA(cudaEventRecord(start, stream));
    enqueue();
    BENCH_CUDA(cudaEventRecord(stop, stream));
    BENCH_CUDA(cudaEventSynchronize(stop));
    float elapsed = 0;
    BENCH_CUDA(cudaEventElapsedTime(&elapsed, start, stop));
    ms.push_back(elapsed);
  }
  (void)cudaEventDestroy(start);
  (void)cudaEventDestroy(stop);
  return ms;
}

}  // namespace shadowsync::bench
