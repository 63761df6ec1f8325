// The FP8 quantization kernels of the CUDA backend: what vLLM computes after loading for
// quantization="fp8", run in the shadow on the receiver's stream. A part's maximum magnitude is
// reduced per warp with shuffles and lands in scales[part] by atomicMax on its bits (magnitudes
// are non-negative, so their bits order as their values); the quantization kernel reads the
// maximum, derives the scale as the host does (fp8_quantize.h) and converts each element; a
// last tiny kernel replaces each maximum by its scale (every quantizing thread has read it by
// then: stream order).
#include "backends/cuda/fp8_kernels.h"

#include <algorithm>
#include <cstdint>

#include "core/fp8_quantize.h"

namespace shadowsync::cuda_detail {
namespace {

constexpr int kThreads = 256;
constexpr std::size_t kMaxBlocks = 1024;

__device__ float load(const void* src, std::size_t i, std::size_t element_bytes, bool bf16) {
  if (element_bytes == 4) return static_cast<const float*>(src)[i];
  const std::uint16_t bits = static_cast<const std::uint16_t*>(src)[i];
  return bf16 ? fp8::bf16_to_float(bits) : fp8::fp16_to_float(bits);
}

// Grid: x over the part's elements, y over the parts.
__global__ void part_amax_kernel(const void* src, std::size_t element_bytes, bool bf16,
                                 std::size_t per_part, float* amax) {
  const std::size_t base = blockIdx.y * per_part;
  float m = 0.0f;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
       i < per_part; i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    m = fmaxf(m, fabsf(load(src, base + i, element_bytes, bf16)));
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    m = fmaxf(m, __shfl_down_sync(0xffffffffu, m, offset));
  }
  if ((threadIdx.x & 31) == 0 && m > 0.0f) {
    atomicMax(reinterpret_cast<unsigned int*>(amax + blockIdx.y), __float_as_uint(m));
  }
}

__global__ void quantize_kernel(const void* src, std::size_t element_bytes, bool bf16,
                                std::size_t per_part, const float* amax, std::uint8_t* dst) {
  const std::size_t base = blockIdx.y * per_part;
  const float inverse = 1.0f / fp8::scale_of(amax[blockIdx.y]);
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
       i < per_part; i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    dst[base + i] = fp8::quantize(load(src, base + i, element_bytes, bf16), inverse);
  }
}

__global__ void amax_to_scale_kernel(float* scales, std::size_t parts) {
  for (std::size_t p = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; p < parts;
       p += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    scales[p] = fp8::scale_of(scales[p]);
  }
}

}  // namespace

cudaError_t launch_quantize_fp8(const void* src, std::size_t element_bytes, bool bf16,
                                std::size_t elements, std::size_t parts, void* dst, float* scales,
                                cudaStream_t stream) {
  if (elements == 0 || parts == 0) return cudaSuccess;
  const std::size_t per_part = elements / parts;
  cudaError_t e = cudaMemsetAsync(scales, 0, parts * sizeof(float), stream);
  if (e != cudaSuccess) return e;
  // Parts beyond 65535 (grid y's limit) do not occur: one per expert.
  const std::size_t blocks_x =
      std::max<std::size_t>(1, std::min(kMaxBlocks / std::min<std::size_t>(parts, kMaxBlocks),
                                        (per_part + kThreads - 1) / kThreads));
  const dim3 grid(static_cast<unsigned>(blocks_x), static_cast<unsigned>(parts));
  part_amax_kernel<<<grid, kThreads, 0, stream>>>(src, element_bytes, bf16, per_part, scales);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  quantize_kernel<<<grid, kThreads, 0, stream>>>(src, element_bytes, bf16, per_part, scales,
                                                 static_cast<std::uint8_t*>(dst));
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  const unsigned scale_blocks = static_cast<unsigned>(std::min<std::size_t>(
      kMaxBlocks, (parts + kThreads - 1) / kThreads));
  amax_to_scale_kernel<<<scale_blocks, kThreads, 0, stream>>>(scales, parts);
  return cudaGetLastError();
}

}  // namespace shadowsync::cuda_detail
