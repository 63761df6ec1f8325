// The same-host receiver's chunk copy on SMs (see same_host_copy_kernel.h): a grid-stride copy,
// 16 bytes per load and store where both ends allow it, byte by byte otherwise. A modest grid:
// it runs next to the engine's decode kernels.
#include "transports/same_host/same_host_copy_kernel.h"

#include <algorithm>
#include <cstdint>

namespace shadowsync::same_host {
namespace {

constexpr int kThreads = 256;
constexpr std::size_t kMaxBlocks = 132;  // one per SM on an H100/H200

__global__ void copy_vectors(uint4* dst, const uint4* src, std::size_t vectors) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
       i < vectors; i += stride) {
    dst[i] = src[i];
  }
}

__global__ void copy_bytes(unsigned char* dst, const unsigned char* src, std::size_t bytes) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
       i < bytes; i += stride) {
    dst[i] = src[i];
  }
}

unsigned blocks_for(std::size_t items) {
  const std::size_t wanted = (items + kThreads - 1) / kThreads;
  return static_cast<unsigned>(std::clamp<std::size_t>(wanted, 1, kMaxBlocks));
}

}  // namespace

cudaError_t launch_chunk_copy(void* dst, const void* src, std::size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  const auto d = reinterpret_cast<std::uintptr_t>(dst);
  const auto s = reinterpret_cast<std::uintptr_t>(src);
  const std::size_t vectors = bytes / sizeof(uint4);
  const std::size_t head = vectors * sizeof(uint4);
  if ((d | s) % alignof(uint4) == 0) {
    if (vectors > 0) {
      copy_vectors<<<blocks_for(vectors), kThreads, 0, stream>>>(
          static_cast<uint4*>(dst), static_cast<const uint4*>(src), vectors);
      if (const cudaError_t status = cudaGetLastError(); status != cudaSuccess) return status;
    }
    if (head == bytes) return cudaSuccess;
    copy_bytes<<<1, kThreads, 0, stream>>>(static_cast<unsigned char*>(dst) + head,
                                           static_cast<const unsigned char*>(src) + head,
                                           bytes - head);
    return cudaGetLastError();
  }
  copy_bytes<<<blocks_for(bytes), kThreads, 0, stream>>>(
      static_cast<unsigned char*>(dst), static_cast<const unsigned char*>(src), bytes);
  return cudaGetLastError();
}

}  // namespace shadowsync::same_host
