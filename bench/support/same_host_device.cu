// bench_same_host_one_gpu's SM copy kernel and device memory (see same_host_device.h).
#include "same_host_device.h"

#include <cstdint>

#include "bench_cuda.h"

namespace shadowsync::bench::same_host {

namespace {

// The receiver's copy done by SMs instead of copy engines: a grid-stride copy of 16-byte words,
// four loads in flight per thread, on gridDim.x blocks.
__global__ void __launch_bounds__(kSmCopyThreads)
    sm_copy_kernel(uint4* __restrict__ dst, const uint4* __restrict__ src, std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * kSmCopyThreads;
  std::size_t i = static_cast<std::size_t>(blockIdx.x) * kSmCopyThreads + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = src[i];
    const uint4 b = src[i + stride];
    const uint4 c = src[i + 2 * stride];
    const uint4 d = src[i + 3 * stride];
    dst[i] = a;
    dst[i + stride] = b;
    dst[i + 2 * stride] = c;
    dst[i + 3 * stride] = d;
  }
  for (; i < n; i += stride) dst[i] = src[i];
}

void check_launch(const char* what) {
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) {
    throw BenchError(cat(what, " launch failed: ", cudaGetErrorString(status)));
  }
}

}  // namespace

void launch_sm_copy(std::byte* to, const std::byte* from, std::size_t bytes, int ctas,
                    cudaStream_t stream) {
  (void)cudaGetLastError();
  sm_copy_kernel<<<static_cast<unsigned>(ctas), kSmCopyThreads, 0, stream>>>(
      reinterpret_cast<uint4*>(to), reinterpret_cast<const uint4*>(from), bytes / 16);
  check_launch("sm_copy_kernel");
}

std::size_t free_device_bytes() {
  std::size_t free = 0;
  std::size_t total = 0;
  BENCH_CUDA(cudaMemGetInfo(&free, &total));
  return free;
}

DeviceMemory::DeviceMemory(std::size_t bytes) {
  void* p = nullptr;
  BENCH_CUDA(cudaMalloc(&p, bytes));
  ptr_ = static_cast<std::byte*>(p);
}

void DeviceMemory::reset() {
  if (ptr_ != nullptr) (void)cudaFree(ptr_);
  ptr_ = nullptr;
}

}  // namespace shadowsync::bench::same_host
