// A 64-bit FNV-1a hash fed with length-prefixed fields, so that ("ab","c") and ("a","bc") differ.
// Used for the layout fingerprint: it detects disagreement between honest peers, it is not a
// defence against a malicious one (the control channel's authentication is).
#pragma once

#include <cstdint>
#include <cstring>
#include <string_view>

namespace shadowsync {

class Hash64 {
 public:
  Hash64& add_bytes(const void* data, std::size_t size) {
    const auto* bytes = static_cast<const unsigned char*>(data);
    for (std::size_t i = 0; i < size; ++i) {
      state_ ^= bytes[i];
      state_ *= kPrime;
    }
    return *this;
  }
  Hash64& add(std::uint64_t value) {
    unsigned char bytes[8];
    for (int i = 0; i < 8; ++i) bytes[i] = static_cast<unsigned char>(value >> (8 * i));
    return add_bytes(bytes, sizeof bytes);
  }
  Hash64& add(std::string_view text) {
    add(static_cast<std::uint64_t>(text.size()));
    return add_bytes(text.data(), text.size());
  }
  std::uint64_t value() const { return state_; }

 private:
  static constexpr std::uint64_t kOffset = 0xcbf29ce484222325ull;
  static constexpr std::uint64_t kPrime = 0x100000001b3ull;
  std::uint64_t state_ = kOffset;
};

}  // namespace shadowsync
