// What bench_same_host_one_gpu does on the device around the library: the memory-bound decode
// step and the SM copy kernel it measures against, and plain device memory. CUDA builds only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace shadowsync::bench::same_host {

// The decode step's threads per block, and the bytes each block reads (16 16-byte words per
// thread: 128 KiB): a step over N bytes writes ceil(N / kDecodeBlockBytes) partial sums.
inline constexpr int kDecodeThreads = 512;
inline constexpr std::size_t kDecodeBlockBytes = std::size_t{kDecodeThreads} * 16 * 16;

// Threads per block of the SM copy kernel.
inline constexpr int kSmCopyThreads = 512;

// Enqueues one decode step over `bytes` (a multiple of 16) of `data` on `stream`: a memory-bound
// read like a batch-1 GEMV's, one partial sum per block into `partials`. Throws BenchError if the
// launch fails.
void launch_decode(const std::byte* data, std::size_t bytes, float* partials, cudaStream_t stream);

// Enqueues a copy of `bytes` (a multiple of 16) from `from` to `to` on `stream`, done by SMs
// (`ctas` blocks of kSmCopyThreads) instead of the copy engines. Throws BenchError if the launch
// fails.
void launch_sm_copy(std::byte* to, const std::byte* from, std::size_t bytes, int ctas,
                    cudaStream_t stream);

// The current device's free memory (cudaMemGetInfo), device-wide: every process's allocations
// count.
std::size_t free_device_bytes();

// cudaMalloc'ed memory the benchmark uses around the library (not through the backend, so that
// Backend::bytes_allocated counts only what the library itself allocates).
class DeviceMemory {
 public:
  DeviceMemory() = default;
  explicit DeviceMemory(std::size_t bytes);
  ~DeviceMemory() { reset(); }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  void reset();
  std::byte* data() const { return ptr_; }

 private:
  std::byte* ptr_ = nullptr;
};

}  // namespace shadowsync::bench::same_host
