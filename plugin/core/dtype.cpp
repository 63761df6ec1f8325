#include "shadowsync/dtype.h"

#include <fmt/format.h>

#include <array>
#include <string>

#include "shadowsync/error.h"

namespace shadowsync {
namespace {

struct DTypeInfo {
  std::string_view name;
  std::size_t size;
  bool floating;
};

// Indexed by the enum value.
constexpr std::array<DTypeInfo, kDTypeCount> kInfo = {{
    {"fp32", 4, true},
    {"fp16", 2, true},
    {"bf16", 2, true},
    {"fp8_e4m3", 1, true},
    {"fp8_e5m2", 1, true},
    {"int8", 1, false},
    {"uint8", 1, false},
    {"int32", 4, false},
    {"int64", 8, false},
}};

struct Alias {
  std::string_view alias;
  DType dtype;
};

constexpr std::array<Alias, 14> kAliases = {{
    {"float32", DType::kFloat32},       {"float", DType::kFloat32},
    {"float16", DType::kFloat16},       {"half", DType::kFloat16},
    {"bfloat16", DType::kBFloat16},     {"float8_e4m3fn", DType::kFloat8E4M3},
    {"float8_e5m2", DType::kFloat8E5M2}, {"e4m3", DType::kFloat8E4M3},
    {"e5m2", DType::kFloat8E5M2},       {"int", DType::kInt32},
    {"long", DType::kInt64},            {"f32", DType::kFloat32},
    {"f16", DType::kFloat16},           {"u8", DType::kUInt8},
}};

const DTypeInfo& info(DType dtype) {
  const auto index = static_cast<std::size_t>(dtype);
  if (index >= kInfo.size()) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("unsupported dtype value {} (valid: 0..{})", index, kInfo.size() - 1));
  }
  return kInfo[index];
}

}  // namespace

std::size_t dtype_size(DType dtype) { return info(dtype).size; }

std::string_view dtype_name(DType dtype) { return info(dtype).name; }

bool dtype_is_floating(DType dtype) { return info(dtype).floating; }

DType dtype_from_string(std::string_view name) {
  // torch prints dtypes as "torch.bfloat16".
  if (name.starts_with("torch.")) name.remove_prefix(6);
  for (std::size_t i = 0; i < kInfo.size(); ++i) {
    if (kInfo[i].name == name) return static_cast<DType>(i);
  }
  for (const auto& alias : kAliases) {
    if (alias.alias == name) return alias.dtype;
  }
  std::string known;
  for (const auto& entry : kInfo) {
    if (!known.empty()) known += ", ";
    known += entry.name;
  }
  throw Error(ErrorCode::kInvalidArgument,
              fmt::format("unsupported dtype '{}' (supported: {})", name, known));
}

}  // namespace shadowsync
