// The argument check of Backend::memcpy_async, shared by every backend: a copy of one byte or more
// needs both pointers. Not installed.
#pragma once

#include <fmt/format.h>

#include <cstddef>
#include <string_view>

#include "shadowsync/error.h"

namespace shadowsync {

// Throws Error(kInvalidArgument) naming `call` and the null pointer when `bytes` > 0 and either
// pointer is null. A copy of 0 bytes passes with any pointers.
inline void check_memcpy_args(std::string_view call, const void* dst, const void* src,
                              std::size_t bytes) {
  if (bytes > 0 && (dst == nullptr || src == nullptr)) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{}: null {} pointer for a {}-byte copy", call,
                            dst == nullptr ? "destination" : "source", bytes));
  }
}

// The same for Backend::memcpy_2d_async, and pitches that let rows overlap.
inline void check_memcpy_2d_args(std::string_view call, const void* dst, std::size_t dst_pitch,
                                 const void* src, std::size_t src_pitch, std::size_t row_bytes,
                                 std::size_t rows) {
  check_memcpy_args(call, dst, src, row_bytes * rows);
  if (rows > 1 && (dst_pitch < row_bytes || src_pitch < row_bytes)) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{}: rows of {} bytes with destination pitch {} and source pitch {}: "
                            "a pitch below the row size overlaps rows",
                            call, row_bytes, dst_pitch, src_pitch));
  }
}

}  // namespace shadowsync
