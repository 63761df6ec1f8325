// The stand-in decode step every CUDA benchmark runs beside the library (bench_gpu.cu and
// bench_same_host_one_gpu.cu): a memory-bound read of the weights, as a batch-1 decode's GEMV
// kernels do. CUDA builds only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace shadowsync::bench {

// The decode step's threads per block, and the bytes each block reads (16 16-byte words per
// thread: 128 KiB): a step over N bytes writes ceil(N / kDecodeBlockBytes) partial sums.
inline constexpr int kDecodeThreads = 512;
inline constexpr std::size_t kDecodeBlockBytes = std::size_t{kDecodeThreads} * 16 * 16;

// Enqueues one decode step over `bytes` (a multiple of 16, at least 16) of `data` on `stream`
// (on the current device): one partial sum per block into `partials`, which has room for
// `partials_capacity` floats. Throws BenchError if the step needs more partials than that, or if
// the launch fails. Returns once the step is enqueued.
void launch_decode(const std::byte* data, std::size_t bytes, float* partials,
                   std::size_t partials_capacity, cudaStream_t stream);

}  // namespace shadowsync::bench
