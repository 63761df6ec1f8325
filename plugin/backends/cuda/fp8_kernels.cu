// The FP8 quantization kernels of the CUDA backend: what vLLM computes after loading for
// quantization="fp8", run in the shadow on the receiver's stream. A part's maximum magnitude is
// reduced per warp with shuffles and lands in scales[part] by atomicMax on its bits (magnitudes
// are non-negative, so their bits order as their values); the quantization kernel reads the
// maximum, derives the scale as the host does (fp8_quantize.h) and converts each element; a
// last tiny kernel replaces each maximum by its scale (every quantizing thread has read it by
// then: stream order).
//
// Both passes read the source 16 bytes a thread at a time (8 bf16/fp16 or 4 fp32 elements) and
// the quantization writes 8 or 4 bytes, when the part's length and the pointers allow it; else
// one element a thread. The conversion is CUDA's (__nv_cvt_float*_to_fp8*: on sm_89 and later
// one cvt.rn.satfinite instruction, before that CUDA's own software): round to nearest even,
// saturated, the host reference's bytes for every value the clamp lets through
// (tests/gpu/test_integrity_kernels.cu checks every bf16 value). Narrow loads and a software
// conversion made the quantization a visible part of an FP8 update's time.
#include "backends/cuda/fp8_kernels.h"

#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>

#include "core/fp8_quantize.h"

namespace shadowsync::cuda_detail {
namespace {

constexpr int kThreads = 256;
constexpr std::size_t kMaxBlocks = 1024;
constexpr std::size_t kVectorBytes = 16;  // one uint4 load a thread

__device__ float load(const void* src, std::size_t i, std::size_t element_bytes, bool bf16) {
  if (element_bytes == 4) return static_cast<const float*>(src)[i];
  const std::uint16_t bits = static_cast<const std::uint16_t*>(src)[i];
  return bf16 ? fp8::bf16_to_float(bits) : fp8::fp16_to_float(bits);
}

// The kN elements of one 16-byte vector (kN 8: bf16/fp16 halves, 4: fp32), as floats.
template <int kN>
__device__ void unpack(const uint4& v, bool bf16, float (&out)[kN]) {
  const std::uint32_t words[4] = {v.x, v.y, v.z, v.w};
  if constexpr (kN == 4) {
    for (int k = 0; k < 4; ++k) out[k] = fp8::bits_to_float(words[k]);
  } else {
    for (int k = 0; k < 4; ++k) {
      const auto lo = static_cast<std::uint16_t>(words[k] & 0xffffu);
      const auto hi = static_cast<std::uint16_t>(words[k] >> 16);
      out[2 * k] = bf16 ? fp8::bf16_to_float(lo) : fp8::fp16_to_float(lo);
      out[2 * k + 1] = bf16 ? fp8::bf16_to_float(hi) : fp8::fp16_to_float(hi);
    }
  }
}

// x * (1 / scale), clamped as fp8::quantize clamps it (the host reference).
__device__ float scaled(float x, float inverse) {
  return fmaxf(-fp8::kE4M3Max, fminf(x * inverse, fp8::kE4M3Max));
}

__device__ std::uint8_t to_e4m3(float y) {
  return static_cast<std::uint8_t>(__nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3));
}

// Two clamped values as two e4m3 bytes, the first in the low byte (memory order).
__device__ std::uint16_t to_e4m3x2(float first, float second) {
  return static_cast<std::uint16_t>(
      __nv_cvt_float2_to_fp8x2(make_float2(first, second), __NV_SATFINITE, __NV_E4M3));
}

__device__ void reduce_amax(float m, float* amax) {
  for (int offset = 16; offset > 0; offset /= 2) {
    m = fmaxf(m, __shfl_down_sync(0xffffffffu, m, offset));
  }
  if ((threadIdx.x & 31) == 0 && m > 0.0f) {
    atomicMax(reinterpret_cast<unsigned int*>(amax), __float_as_uint(m));
  }
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
  reduce_amax(m, amax + blockIdx.y);
}

// The same over 16-byte vectors of kN elements (per_part a multiple of kN, src 16-byte aligned).
template <int kN>
__global__ void part_amax_vector_kernel(const uint4* src, bool bf16, std::size_t vectors_per_part,
                                        float* amax) {
  const uint4* part = src + blockIdx.y * vectors_per_part;
  float m = 0.0f;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
       i < vectors_per_part; i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    float x[kN];
    unpack<kN>(part[i], bf16, x);
    for (int k = 0; k < kN; ++k) m = fmaxf(m, fabsf(x[k]));
  }
  reduce_amax(m, amax + blockIdx.y);
}

__global__ void quantize_kernel(const void* src, std::size_t element_bytes, bool bf16,
                                std::size_t per_part, const float* amax, std::uint8_t* dst) {
  const std::size_t base = blockIdx.y * per_part;
  const float inverse = 1.0f / fp8::scale_of(amax[blockIdx.y]);
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
       i < per_part; i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    dst[base + i] = to_e4m3(scaled(load(src, base + i, element_bytes, bf16), inverse));
  }
}

// The same over 16-byte vectors of kN elements, each written as kN bytes (dst kN-byte aligned).
template <int kN>
__global__ void quantize_vector_kernel(const uint4* src, bool bf16, std::size_t vectors_per_part,
                                       const float* amax, std::uint8_t* dst) {
  const std::size_t first = blockIdx.y * vectors_per_part;
  const float inverse = 1.0f / fp8::scale_of(amax[blockIdx.y]);
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
       i < vectors_per_part; i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    float x[kN];
    unpack<kN>(src[first + i], bf16, x);
    std::uint32_t words[kN / 4];
    for (int w = 0; w < kN / 4; ++w) {
      words[w] = to_e4m3x2(scaled(x[4 * w], inverse), scaled(x[4 * w + 1], inverse)) |
                 static_cast<std::uint32_t>(to_e4m3x2(scaled(x[4 * w + 2], inverse),
                                                      scaled(x[4 * w + 3], inverse)))
                     << 16;
    }
    if constexpr (kN == 8) {
      reinterpret_cast<uint2*>(dst)[first + i] = make_uint2(words[0], words[1]);
    } else {
      reinterpret_cast<std::uint32_t*>(dst)[first + i] = words[0];
    }
  }
}

__global__ void amax_to_scale_kernel(float* scales, std::size_t parts) {
  for (std::size_t p = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; p < parts;
       p += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    scales[p] = fp8::scale_of(scales[p]);
  }
}

// The grid of a pass over `parts` parts of `units` units each (elements or vectors).
dim3 part_grid(std::size_t parts, std::size_t units) {
  const std::size_t blocks_x =
      std::max<std::size_t>(1, std::min(kMaxBlocks / std::min<std::size_t>(parts, kMaxBlocks),
                                        (units + kThreads - 1) / kThreads));
  return dim3(static_cast<unsigned>(blocks_x), static_cast<unsigned>(parts));
}

template <int kN>
void launch_vector_passes(const void* src, bool bf16, std::size_t per_part, std::size_t parts,
                          std::uint8_t* dst, float* scales, cudaStream_t stream) {
  const auto* vectors = static_cast<const uint4*>(src);
  const std::size_t vectors_per_part = per_part / kN;
  const dim3 grid = part_grid(parts, vectors_per_part);
  part_amax_vector_kernel<kN><<<grid, kThreads, 0, stream>>>(vectors, bf16, vectors_per_part,
                                                               scales);
  quantize_vector_kernel<kN><<<grid, kThreads, 0, stream>>>(vectors, bf16, vectors_per_part,
                                                              scales, dst);
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
  auto* out = static_cast<std::uint8_t*>(dst);
  const std::size_t per_vector = kVectorBytes / element_bytes;  // 8 halves or 4 floats
  const bool vectors = per_part % per_vector == 0 &&
                       reinterpret_cast<std::uintptr_t>(src) % kVectorBytes == 0 &&
                       reinterpret_cast<std::uintptr_t>(dst) % per_vector == 0;
  if (vectors && per_vector == 8) {
    launch_vector_passes<8>(src, bf16, per_part, parts, out, scales, stream);
  } else if (vectors && per_vector == 4) {
    launch_vector_passes<4>(src, bf16, per_part, parts, out, scales, stream);
  } else {
    const dim3 grid = part_grid(parts, per_part);
    part_amax_kernel<<<grid, kThreads, 0, stream>>>(src, element_bytes, bf16, per_part, scales);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
    quantize_kernel<<<grid, kThreads, 0, stream>>>(src, element_bytes, bf16, per_part, scales,
                                                   out);
  }
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  const unsigned scale_blocks = static_cast<unsigned>(std::min<std::size_t>(
      kMaxBlocks, (parts + kThreads - 1) / kThreads));
  amax_to_scale_kernel<<<scale_blocks, kThreads, 0, stream>>>(scales, parts);
  return cudaGetLastError();
}

}  // namespace shadowsync::cuda_detail
