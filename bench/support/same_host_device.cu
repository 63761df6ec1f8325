// bench_same_host_one_gpu's kernels and device memory (see same_host_device.h).
#include "same_host_device.h"

#include <cstdint>

#include "bench_cuda.h"

namespace shadowsync::bench::same_host {

namespace {

constexpr int kDecodeWordsPerThread = 16;  // 16-byte words: 128 KiB per block
static_assert(kDecodeBlockBytes == std::size_t{kDecodeThreads} * kDecodeWordsPerThread * 16);

__device__ __forceinline__ float bf16_pair_sum(unsigned word) {
  return __uint_as_float(word << 16) + __uint_as_float(word & 0xffff0000u);
}

// A memory-bound decode step (a batch-1 GEMV reads each weight once): block b sums the bf16
// values of its own 128 KiB slice with coalesced 16-byte loads, eight in flight per thread, and
// writes one partial, so nothing is optimized away. Many short blocks, as a decode step's kernels.
__global__ void __launch_bounds__(kDecodeThreads)
    decode_kernel(const uint4* __restrict__ data, std::size_t n, float* __restrict__ partials) {
  const std::size_t base =
      static_cast<std::size_t>(blockIdx.x) * (kDecodeBlockBytes / 16) + threadIdx.x;
  float acc = 0.f;
#pragma unroll
  for (int batch = 0; batch < kDecodeWordsPerThread; batch += 8) {
    uint4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const std::size_t i = base + static_cast<std::size_t>(batch + u) * kDecodeThreads;
      v[u] = i < n ? data[i] : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      acc += (bf16_pair_sum(v[u].x) + bf16_pair_sum(v[u].y)) +
             (bf16_pair_sum(v[u].z) + bf16_pair_sum(v[u].w));
    }
  }
  __shared__ float warp_sums[kDecodeThreads / 32];
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, offset);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x < 32) {
    acc = threadIdx.x < kDecodeThreads / 32 ? warp_sums[threadIdx.x] : 0.f;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
      acc += __shfl_down_sync(0xffffffffu, acc, offset);
    if (threadIdx.x == 0) partials[blockIdx.x] = acc;
  }
}

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

void launch_decode(const std::byte* data, std::size_t bytes, float* partials, cudaStream_t stream) {
  const std::size_t blocks = (bytes + kDecodeBlockBytes - 1) / kDecodeBlockBytes;
  // Drop a stale "last error" left on this thread, so that the check sees the launch's own.
  (void)cudaGetLastError();
  decode_kernel<<<static_cast<unsigned>(blocks), kDecodeThreads, 0, stream>>>(
      reinterpret_cast<const uint4*>(data), bytes / 16, partials);
  check_launch("decode_kernel");
}

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
