// Internal to the CUDA backend: launchers of the integrity kernels (integrity_kernels.cu). Each
// enqueues on `stream` and returns the launch's error (cudaSuccess when enqueued). Not installed.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace shadowsync::cuda_detail {

// *result = checksum of `bytes` bytes at `data` (plugin/core/integrity.h). `data` is 8-byte
// aligned (arenas and staging buffers are 256-byte aligned; buckets and tensors start at
// multiples of 256).
cudaError_t launch_checksum(const void* data, std::size_t bytes, std::uint64_t* result,
                            cudaStream_t stream);

// *result = number of NaN/Inf among `elements` elements; `element_bytes` is 4 (fp32) or 2 with
// `bf16` telling bf16 from fp16.
cudaError_t launch_count_nonfinite(const void* data, std::size_t elements,
                                   std::size_t element_bytes, bool bf16, std::uint64_t* result,
                                   cudaStream_t stream);

}  // namespace shadowsync::cuda_detail
