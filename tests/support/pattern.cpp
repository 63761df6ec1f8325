#include "pattern.h"

#include <algorithm>
#include <cstring>

namespace shadowsync::testing {

void fill_pattern(void* dst, std::size_t bytes, std::size_t group, std::size_t tensor,
                  std::uint64_t version) {
  auto* out = static_cast<std::byte*>(dst);
  const std::size_t words = (bytes + 7) / 8;
  for (std::size_t w = 0; w < words; ++w) {
    const std::uint64_t value = pattern_word(group, tensor, w, version);
    std::memcpy(out + w * 8, &value, std::min<std::size_t>(8, bytes - w * 8));
  }
}

std::uint64_t read_version(const std::byte* tensor_data, std::size_t tensor_bytes,
                           std::size_t group, std::size_t tensor, std::size_t word,
                           std::uint64_t expected) {
  const std::size_t n = std::min<std::size_t>(8, tensor_bytes - word * 8);
  std::uint64_t value = 0;
  std::memcpy(&value, tensor_data + word * 8, n);
  if (n == 8) return decode_version(group, tensor, word, value);
  // A partial tail word holds too few bits to decode: it either matches `expected` or is garbage.
  std::uint64_t want = pattern_word(group, tensor, word, expected);
  std::uint64_t got = 0;
  std::memcpy(&got, tensor_data + word * 8, n);
  std::uint64_t want_bytes = 0;
  std::memcpy(&want_bytes, &want, n);
  return got == want_bytes ? expected : kGarbageVersion;
}

HostTensors::HostTensors(const Layout& layout, const std::vector<std::string>& groups,
                         std::uint64_t version) {
  for (const auto& name : groups) {
    const std::size_t g = layout.group_index(name);
    const auto& tensors = layout.groups()[g].tensors();
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      storage_.emplace_back((tensors[t].bytes + 7) / 8);
      fill_pattern(storage_.back().data(), tensors[t].bytes, g, t, version);
      sources_.push_back(SourceTensor{tensors[t].spec.name, storage_.back().data(),
                                      tensors[t].spec.dtype, tensors[t].spec.shape});
    }
  }
}

void fill_arena(const Layout& layout, std::size_t group, std::uint64_t version, std::byte* arena) {
  const auto& tensors = layout.groups()[group].tensors();
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    fill_pattern(arena + tensors[t].offset, tensors[t].bytes, group, t, version);
  }
}

}  // namespace shadowsync::testing
