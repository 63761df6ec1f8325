// The argument checks of Backend::checksum_async, count_nonfinite_async and quantize_fp8_async
// (the data-path kernels besides copies), shared by every
// backend that has them: each throws Error(kInvalidArgument) naming the call, the pointers and
// the sizes, before anything is enqueued. `alignment` is what the backend's implementation needs
// of `data` (1: none).
#pragma once

#include <fmt/format.h>

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "shadowsync/backend.h"
#include "shadowsync/error.h"

namespace shadowsync {

inline void check_checksum_args(std::string_view call, const void* data, std::size_t bytes,
                                const std::uint64_t* result, std::size_t alignment) {
  if (result == nullptr || (data == nullptr && bytes > 0) ||
      reinterpret_cast<std::uintptr_t>(data) % alignment != 0) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{}: data {} and result {} must be non-null and data {}-byte aligned "
                            "({} bytes)",
                            call, data, static_cast<const void*>(result), alignment, bytes));
  }
}

// Also refuses a dtype without a non-finite check. `element_aligned`: data must be aligned to
// the dtype's element size.
inline void check_nonfinite_args(std::string_view call, const void* data, std::size_t elements,
                                 DType dtype, const std::uint64_t* result, bool element_aligned) {
  if (!dtype_has_nonfinite_check(dtype)) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{}: dtype {} has no non-finite check (fp32, fp16 and bf16 have)",
                            call, dtype_name(dtype)));
  }
  const std::size_t alignment = element_aligned ? dtype_size(dtype) : 1;
  if (result == nullptr || (data == nullptr && elements > 0) ||
      reinterpret_cast<std::uintptr_t>(data) % alignment != 0) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{}: data {} and result {} must be non-null and data {}-byte aligned "
                            "({} {} elements)",
                            call, data, static_cast<const void*>(result), alignment, elements,
                            dtype_name(dtype)));
  }
}

// Also refuses a source dtype other than fp32, fp16 and bf16, parts that do not divide the
// elements, and overlapping source and destination.
inline void check_quantize_fp8_args(std::string_view call, const void* src, DType dtype,
                                    std::size_t elements, std::size_t parts, const void* dst,
                                    const float* scales) {
  if (!dtype_has_nonfinite_check(dtype)) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{}: source dtype {} cannot be quantized to fp8 (fp32, fp16 and bf16 "
                            "can)",
                            call, dtype_name(dtype)));
  }
  if (parts == 0 || elements % parts != 0) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{}: {} elements do not split into {} equal parts", call, elements,
                            parts));
  }
  const auto* s = static_cast<const std::byte*>(src);
  const auto* d = static_cast<const std::byte*>(dst);
  const std::size_t src_bytes = elements * dtype_size(dtype);
  const bool overlap = s < d + elements && d < s + src_bytes;
  if (src == nullptr || dst == nullptr || scales == nullptr || overlap ||
      reinterpret_cast<std::uintptr_t>(src) % dtype_size(dtype) != 0 ||
      reinterpret_cast<std::uintptr_t>(scales) % alignof(float) != 0) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{}: src {}, dst {} and scales {} must be non-null, src and scales "
                            "element-aligned, src ({} bytes) and dst ({} bytes) apart",
                            call, src, dst, static_cast<const void*>(scales), src_bytes,
                            elements));
  }
}

}  // namespace shadowsync
