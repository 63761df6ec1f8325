#include "weights.h"

#include <cstring>

namespace shadowsync::examples {

void fill_weights(void* dst, std::size_t bytes, std::size_t group, std::size_t tensor,
                  std::uint64_t version) {
  auto* out = static_cast<std::byte*>(dst);
  for (std::size_t word = 0; word * 8 < bytes; ++word) {
    const std::uint64_t value = weight_word(group, tensor, word, version);
    const std::size_t n = bytes - word * 8 < 8 ? bytes - word * 8 : 8;
    std::memcpy(out + word * 8, &value, n);  // little-endian: a partial word keeps its low bytes
  }
}

std::size_t count_wrong_words(const std::byte* data, std::size_t bytes, std::size_t group,
                              std::size_t tensor, std::uint64_t version, bool sampled) {
  const std::size_t words = bytes / 8;
  if (words == 0) return 0;
  auto wrong = [&](std::size_t word) {
    std::uint64_t value = 0;
    std::memcpy(&value, data + word * 8, 8);
    return value != weight_word(group, tensor, word, version) ? 1 : 0;
  };
  if (sampled) return wrong(0) + wrong(words / 2) + wrong(words - 1);
  std::size_t count = 0;
  for (std::size_t word = 0; word < words; ++word) count += wrong(word);
  return count;
}

TrainerWeights::TrainerWeights(const Layout& layout, const std::vector<std::string>& groups,
                               std::uint64_t version) {
  for (const std::string& name : groups) {
    const std::size_t g = layout.group_index(name);
    const auto& tensors = layout.groups()[g].tensors();
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      storage_.emplace_back((tensors[t].bytes + 7) / 8);
      fill_weights(storage_.back().data(), tensors[t].bytes, g, t, version);
      sources_.push_back(SourceTensor{tensors[t].spec.name, storage_.back().data(),
                                      tensors[t].spec.dtype, tensors[t].spec.shape});
    }
  }
}

}  // namespace shadowsync::examples
