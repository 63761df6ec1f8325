// The stand-in decode step's kernel (see bench_decode_step.h).
#include "bench_decode_step.h"

#include <cstdint>

#include "bench_cuda.h"

namespace shadowsync::bench {

namespace {

constexpr int kDecodeWordsPerThread = 16;  // 16-byte words: 128 KiB per block
constexpr int kDecodeUnroll = 8;           // 16-byte loads in flight per thread
static_assert(kDecodeBlockBytes == std::size_t{kDecodeThreads} * kDecodeWordsPerThread * 16);
static_assert(kDecodeWordsPerThread % kDecodeUnroll == 0);

__device__ __forceinline__ float bf16_pair_sum(unsigned word) {
  return __uint_as_float(word << 16) + __uint_as_float(word & 0xffff0000u);
}
__device__ __forceinline__ float sum_bf16x8(uint4 v) {
  return (bf16_pair_sum(v.x) + bf16_pair_sum(v.y)) + (bf16_pair_sum(v.z) + bf16_pair_sum(v.w));
}

// Memory-bound like a batch-1 decode's weight reads (a GEMV kernel: many short blocks, each
// streaming its own slice of the weights once). Block b sums the bf16 values of 16-byte words
// [b * W, (b + 1) * W) of `data` (W = kDecodeBlockBytes / 16): coalesced 16-byte loads,
// kDecodeUnroll in flight per thread; one partial per block, so nothing is optimized away. Many
// blocks (32768 for 4 GiB) let the block scheduler fit them around a transfer's CTAs as a real
// decode step's kernels would.
__global__ void __launch_bounds__(kDecodeThreads)
    decode_kernel(const uint4* __restrict__ data, std::size_t n, float* __restrict__ partials) {
  const std::size_t base =
      static_cast<std::size_t>(blockIdx.x) * (kDecodeBlockBytes / 16) + threadIdx.x;
  float acc = 0.f;
#pragma unroll
  for (int batch = 0; batch < kDecodeWordsPerThread; batch += kDecodeUnroll) {
    uint4 v[kDecodeUnroll];
#pragma unroll
    for (int u = 0; u < kDecodeUnroll; ++u) {
      const std::size_t i = base + static_cast<std::size_t>(batch + u) * kDecodeThreads;
      v[u] = i < n ? data[i] : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kDecodeUnroll; ++u) acc += sum_bf16x8(v[u]);
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

}  // namespace

void launch_decode(const std::byte* data, std::size_t bytes, float* partials,
                   std::size_t partials_capacity, cudaStream_t stream) {
  const std::size_t blocks = (bytes + kDecodeBlockBytes - 1) / kDecodeBlockBytes;
  if (blocks == 0 || blocks > partials_capacity) {
    throw BenchError(cat("decode of ", bytes, " bytes: ", blocks, " blocks, room for ",
                         partials_capacity, " partial sums"));
  }
  // Drop a stale "last error" some other runtime user (NCCL probes, a NotReady query) left on
  // this thread, so that the check after the launch sees the launch's own.
  (void)cudaGetLastError();
  decode_kernel<<<static_cast<unsigned>(blocks), kDecodeThreads, 0, stream>>>(
      reinterpret_cast<const uint4*>(data), bytes / 16, partials);
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) {
    throw BenchError(cat("decode_kernel launch failed: ", cudaGetErrorString(status)));
  }
}

}  // namespace shadowsync::bench
