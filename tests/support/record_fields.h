// Fields written into an encoded record by hand (little-endian, as the codecs write them), for the
// tests that corrupt one field of a record and check the decoder refuses it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace shadowsync::testing {

template <std::size_t N>
void put_u32(std::array<std::byte, N>& record, std::size_t at, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) record[at + i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
}
template <std::size_t N>
void put_u64(std::array<std::byte, N>& record, std::size_t at, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) record[at + i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
}

}  // namespace shadowsync::testing
