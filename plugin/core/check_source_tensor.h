// A tensor the trainer hands the sender must be what the layout says: one check for
// Sender::publish() and StreamedPublish::supply(), run before a byte moves.
#pragma once

#include <fmt/format.h>

#include "shadowsync/error.h"
#include "shadowsync/layout.h"
#include "shadowsync/sender.h"

namespace shadowsync {

// Throws Error(kInvalidArgument) naming the tensor and both values when the dtype or the shape
// differs from `spec`, or the data pointer is null.
inline void check_source_tensor(const SourceTensor& given, const TensorSpec& spec) {
  if (given.dtype != spec.dtype) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("tensor '{}': dtype {} does not match layout {}", spec.name,
                            dtype_name(given.dtype), dtype_name(spec.dtype)));
  }
  if (given.shape != spec.shape) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("tensor '{}': shape {} does not match layout {}", spec.name,
                            format_shape(given.shape), format_shape(spec.shape)));
  }
  if (given.data == nullptr) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("tensor '{}': data pointer is null", spec.name));
  }
}

}  // namespace shadowsync
