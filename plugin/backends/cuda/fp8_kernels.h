// Internal to the CUDA backend: the launcher of the FP8 quantization kernels (fp8_kernels.cu).
// Enqueues on `stream` and returns the launch's error (cudaSuccess when enqueued). Not installed.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace shadowsync::cuda_detail {

// Per part of `elements / parts` consecutive elements at `src` (`element_bytes` 4: fp32, or 2
// with `bf16` telling bf16 from fp16): scales[part] = max|x| / 448 and dst[i] =
// float8_e4m3fn(x * (1 / scale)) (plugin/core/fp8_quantize.h). Three launches: the parts'
// maxima into `scales` (zeroed first), the quantization, the maxima turned into scales.
cudaError_t launch_quantize_fp8(const void* src, std::size_t element_bytes, bool bf16,
                                std::size_t elements, std::size_t parts, void* dst, float* scales,
                                cudaStream_t stream);

}  // namespace shadowsync::cuda_detail
