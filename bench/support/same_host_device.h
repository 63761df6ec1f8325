// What bench_same_host_one_gpu does on the device around the library besides the decode step
// (bench_decode_step.h): the SM copy kernel it measures against, and plain device memory. CUDA
// builds only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace shadowsync::bench::same_host {

// Threads per block of the SM copy kernel.
inline constexpr int kSmCopyThreads = 512;

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
