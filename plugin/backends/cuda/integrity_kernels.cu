// The integrity kernels of the CUDA backend: the per-bucket checksum and the non-finite count.
// Both are grid-stride reductions: each thread sums its share, a warp reduces with shuffles, one
// atomicAdd per warp lands in the 8-byte result, which a cudaMemsetAsync on the same stream zeroes
// first. Modest grids: they run on the receiver's low-priority stream next to the engine's decode
// kernels. They are bound by memory bandwidth, so each thread keeps several 16-byte loads in flight
// (kUnroll per iteration): with one 8-byte load per thread the same grid read about 1.3 TB/s on an
// H200 (bench_integrity_one_gpu), too few bytes in flight to cover the memory latency. The loads
// are streaming (__ldcs): the received weights are not read again soon, the engine's are.
#include "backends/cuda/integrity_kernels.h"

#include <algorithm>

#include "core/integrity.h"

namespace shadowsync::cuda_detail {
namespace {

constexpr int kThreads = 256;
constexpr std::size_t kMaxBlocks = 264;  // two per SM on an H100/H200's 132 SMs
constexpr int kUnroll = 4;               // 16-byte loads in flight per thread and iteration

using u64 = unsigned long long;  // atomicAdd's 64-bit type
static_assert(sizeof(u64) == sizeof(std::uint64_t));

__device__ void add_warp_sum(std::uint64_t value, std::uint64_t* result) {
  for (int offset = 16; offset > 0; offset /= 2) {
    value += __shfl_down_sync(0xffffffffu, value, offset);
  }
  if ((threadIdx.x & 31) == 0 && value != 0) atomicAdd(reinterpret_cast<u64*>(result), value);
}

__device__ std::uint64_t low_word(uint4 v) { return v.x | (std::uint64_t{v.y} << 32); }
__device__ std::uint64_t high_word(uint4 v) { return v.z | (std::uint64_t{v.w} << 32); }

// Calls visit(vector, index) for every 16-byte vector of `vectors` at `data`, this thread's share,
// kUnroll independent loads at a time.
template <typename Visit>
__device__ void for_each_vector(const uint4* data, std::size_t vectors, Visit&& visit) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t base = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
       base < vectors; base += kUnroll * stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const std::size_t i = base + u * stride;
      if (i < vectors) v[u] = __ldcs(data + i);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const std::size_t i = base + u * stride;
      if (i < vectors) visit(v[u], i);
    }
  }
}

// words: 8-byte aligned. `head` (0 or 1) words before the first 16-byte boundary, then `vectors`
// 16-byte vectors, then `odd` (0 or 1) word, then `tail_bytes` (< 8) bytes.
__global__ void checksum_kernel(const std::uint64_t* words, std::size_t head, std::size_t vectors,
                                std::size_t odd, const unsigned char* tail, std::size_t tail_bytes,
                                std::uint64_t* result) {
  std::uint64_t sum = 0;
  for_each_vector(reinterpret_cast<const uint4*>(words + head), vectors,
                  [&](uint4 v, std::size_t i) {
                    const std::uint64_t index = head + 2 * i;
                    sum += integrity::checksum_term(low_word(v), index) +
                           integrity::checksum_term(high_word(v), index + 1);
                  });
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    const std::size_t full_words = head + 2 * vectors + odd;
    if (head == 1) sum += integrity::checksum_term(words[0], 0);
    if (odd == 1) sum += integrity::checksum_term(words[full_words - 1], full_words - 1);
    if (tail_bytes > 0) {
      std::uint64_t word = 0;  // little-endian, zero-padded: as the host computes it
      for (std::size_t b = 0; b < tail_bytes; ++b) word |= std::uint64_t{tail[b]} << (8 * b);
      sum += integrity::checksum_term(word, full_words);
    }
  }
  add_warp_sum(sum, result);
}

__device__ std::uint64_t nonfinite_in(std::uint32_t bits, int element_bytes, bool bf16) {
  if (element_bytes == 4) return integrity::fp32_nonfinite(bits) ? 1 : 0;
  const auto lo = static_cast<std::uint16_t>(bits);
  const auto hi = static_cast<std::uint16_t>(bits >> 16);
  return bf16 ? integrity::bf16_nonfinite(lo) + integrity::bf16_nonfinite(hi)
              : integrity::fp16_nonfinite(lo) + integrity::fp16_nonfinite(hi);
}

__device__ std::uint64_t nonfinite_element(const unsigned char* at, int element_bytes, bool bf16) {
  if (element_bytes == 4) {
    return integrity::fp32_nonfinite(*reinterpret_cast<const std::uint32_t*>(at)) ? 1 : 0;
  }
  const std::uint16_t bits = *reinterpret_cast<const std::uint16_t*>(at);
  return (bf16 ? integrity::bf16_nonfinite(bits) : integrity::fp16_nonfinite(bits)) ? 1 : 0;
}

// data: element-aligned. `head` elements before the first 16-byte boundary, `vectors` 16-byte
// vectors, then `tail` elements.
__global__ void nonfinite_kernel(const unsigned char* data, std::size_t head, std::size_t vectors,
                                 std::size_t tail, int element_bytes, bool bf16,
                                 std::uint64_t* result) {
  std::uint64_t count = 0;
  const unsigned char* body = data + head * element_bytes;
  for_each_vector(reinterpret_cast<const uint4*>(body), vectors, [&](uint4 v, std::size_t) {
    count += nonfinite_in(v.x, element_bytes, bf16) + nonfinite_in(v.y, element_bytes, bf16) +
             nonfinite_in(v.z, element_bytes, bf16) + nonfinite_in(v.w, element_bytes, bf16);
  });
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    const unsigned char* rest = body + vectors * 16;
    for (std::size_t e = 0; e < head; ++e) {
      count += nonfinite_element(data + e * element_bytes, element_bytes, bf16);
    }
    for (std::size_t e = 0; e < tail; ++e) {
      count += nonfinite_element(rest + e * element_bytes, element_bytes, bf16);
    }
  }
  add_warp_sum(count, result);
}

// Blocks for `vectors` 16-byte vectors: enough for each thread's kUnroll loads, at most kMaxBlocks.
unsigned blocks_for(std::size_t vectors) {
  const std::size_t per_block = std::size_t{kThreads} * kUnroll;
  const std::size_t wanted = (vectors + per_block - 1) / per_block;
  return static_cast<unsigned>(std::clamp<std::size_t>(wanted, 1, kMaxBlocks));
}

}  // namespace

cudaError_t launch_checksum(const void* data, std::size_t bytes, std::uint64_t* result,
                            cudaStream_t stream) {
  if (cudaError_t error = cudaMemsetAsync(result, 0, sizeof(std::uint64_t), stream);
      error != cudaSuccess) {
    return error;
  }
  const std::size_t full_words = bytes / 8;
  const auto* base = static_cast<const unsigned char*>(data);
  const std::size_t head =
      std::min<std::size_t>(full_words, reinterpret_cast<std::uintptr_t>(data) % 16 == 0 ? 0 : 1);
  const std::size_t vectors = (full_words - head) / 2;
  const std::size_t odd = full_words - head - 2 * vectors;
  checksum_kernel<<<blocks_for(vectors), kThreads, 0, stream>>>(
      static_cast<const std::uint64_t*>(data), head, vectors, odd, base + full_words * 8,
      bytes % 8, result);
  return cudaGetLastError();
}

cudaError_t launch_count_nonfinite(const void* data, std::size_t elements,
                                   std::size_t element_bytes, bool bf16, std::uint64_t* result,
                                   cudaStream_t stream) {
  if (cudaError_t error = cudaMemsetAsync(result, 0, sizeof(std::uint64_t), stream);
      error != cudaSuccess) {
    return error;
  }
  const auto* base = static_cast<const unsigned char*>(data);
  // Elements before the first 16-byte boundary (data is element-aligned), whole vectors, the rest.
  const std::size_t misaligned = reinterpret_cast<std::uintptr_t>(base) % 16;
  const std::size_t head =
      std::min(elements, misaligned == 0 ? 0 : (16 - misaligned) / element_bytes);
  const std::size_t vectors = (elements - head) * element_bytes / 16;
  const std::size_t tail = elements - head - vectors * 16 / element_bytes;
  nonfinite_kernel<<<blocks_for(vectors), kThreads, 0, stream>>>(
      base, head, vectors, tail, static_cast<int>(element_bytes), bf16, result);
  return cudaGetLastError();
}

}  // namespace shadowsync::cuda_detail
