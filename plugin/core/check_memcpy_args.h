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

}  // namespace shadowsync
