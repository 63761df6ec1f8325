// Element types of weight tensors. Only the byte size matters to the data path; the name is part
// of the layout fingerprint so that a bf16 receiver never accepts fp16 bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace shadowsync {

enum class DType : std::uint8_t {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kFloat8E4M3 = 3,
  kFloat8E5M2 = 4,
  kInt8 = 5,
  kUInt8 = 6,
  kInt32 = 7,
  kInt64 = 8,
};
inline constexpr int kDTypeCount = 9;

// Bytes per element. Throws Error(kInvalidArgument) for a value outside the enum.
std::size_t dtype_size(DType dtype);

// Canonical name ("bf16", "fp32", ...). Throws for a value outside the enum.
std::string_view dtype_name(DType dtype);

// Parses a canonical name or a common alias ("bfloat16", "torch.bfloat16", "float", "half").
// Throws Error(kInvalidArgument) naming the string and the supported names.
DType dtype_from_string(std::string_view name);

// True for float types (used by the non-finite guard and the oracle).
bool dtype_is_floating(DType dtype);

}  // namespace shadowsync
