// The integrity kernels of the CUDA backend: the per-bucket checksum and the non-finite count.
// Both are grid-stride reductions: each thread sums its words, a warp reduces with shuffles, one
// atomicAdd per warp lands in the 8-byte result, which a cudaMemsetAsync on the same stream zeroes
// first. Modest grids: they run on the receiver's low-priority stream next to the engine's decode
// kernels, and they are bound by memory bandwidth, not by the SM count.
#include "cuda/integrity_kernels.h"

#include <algorithm>

#include "core/integrity.h"

namespace shadowsync::cuda_detail {
namespace {

constexpr int kThreads = 256;
constexpr std::size_t kMaxBlocks = 264;  // two waves on an H100/H200's 132 SMs

using u64 = unsigned long long;  // atomicAdd's 64-bit type
static_assert(sizeof(u64) == sizeof(std::uint64_t));

__device__ void add_warp_sum(std::uint64_t value, std::uint64_t* result) {
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_down_sync(0xffffffffu, value, offset);
  if ((threadIdx.x & 31) == 0 && value != 0) atomicAdd(reinterpret_cast<u64*>(result), value);
}

__global__ void checksum_kernel(const std::uint64_t* words, std::size_t full_words,
                                const unsigned char* tail, std::size_t tail_bytes,
                                std::uint64_t* result) {
  std::uint64_t sum = 0;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
       i < full_words; i += stride) {
    sum += integrity::checksum_term(words[i], i);
  }
  if (tail_bytes > 0 && blockIdx.x == 0 && threadIdx.x == 0) {
    std::uint64_t word = 0;  // little-endian, zero-padded: as the host computes it
    for (std::size_t b = 0; b < tail_bytes; ++b) word |= std::uint64_t{tail[b]} << (8 * b);
    sum += integrity::checksum_term(word, full_words);
  }
  add_warp_sum(sum, result);
}

__global__ void nonfinite_kernel(const void* data, std::size_t elements, int element_bytes,
                                 bool bf16, std::uint64_t* result) {
  std::uint64_t count = 0;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
       i < elements; i += stride) {
    if (element_bytes == 4) {
      count += integrity::fp32_nonfinite(static_cast<const std::uint32_t*>(data)[i]) ? 1 : 0;
    } else {
      const std::uint16_t bits = static_cast<const std::uint16_t*>(data)[i];
      count += (bf16 ? integrity::bf16_nonfinite(bits) : integrity::fp16_nonfinite(bits)) ? 1 : 0;
    }
  }
  add_warp_sum(count, result);
}

unsigned blocks_for(std::size_t items) {
  const std::size_t wanted = (items + kThreads - 1) / kThreads;
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
  checksum_kernel<<<blocks_for(full_words), kThreads, 0, stream>>>(
      static_cast<const std::uint64_t*>(data), full_words, base + full_words * 8, bytes % 8,
      result);
  return cudaGetLastError();
}

cudaError_t launch_count_nonfinite(const void* data, std::size_t elements,
                                   std::size_t element_bytes, bool bf16, std::uint64_t* result,
                                   cudaStream_t stream) {
  if (cudaError_t error = cudaMemsetAsync(result, 0, sizeof(std::uint64_t), stream);
      error != cudaSuccess) {
    return error;
  }
  nonfinite_kernel<<<blocks_for(elements), kThreads, 0, stream>>>(
      data, elements, static_cast<int>(element_bytes), bf16, result);
  return cudaGetLastError();
}

}  // namespace shadowsync::cuda_detail
