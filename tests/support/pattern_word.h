// The pure functions of the test oracle's weight pattern (pattern.h), usable from host code and,
// when compiled by nvcc, from device code (the GPU fake engine decodes versions inside its decode
// kernel, and the GPU fill kernel writes the pattern the trainer publishes).
//
// Every 8-byte word `word` of tensor `tensor` of group `group` at version v > 0 is
//   pattern_key(group, tensor, word) ^ v,
// and 0 at version 0 (the zero-filled initial arena). The key is never 0, so any single full word
// decodes back to the version it was written at. pattern.h includes this header; host-only helpers
// (filling host memory, HostTensors, partial tail words) stay there.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/host_device.h"

namespace shadowsync::testing {

// What a word that matches no version's pattern decodes to (a partial tail word that does not
// match the expected version's bytes).
inline constexpr std::uint64_t kGarbageVersion = ~std::uint64_t{0};

SHADOWSYNC_HOST_DEVICE inline std::uint64_t mix64(std::uint64_t x) {
  // splitmix64 finalizer: every input bit affects every output bit.
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The per-tensor part of the key: pattern_key(g, t, w) == pattern_key_from_tensor(
// pattern_tensor_key(g, t), w). Lets a kernel hoist two of the three mixes out of its word loop.
SHADOWSYNC_HOST_DEVICE inline std::uint64_t pattern_tensor_key(std::size_t group,
                                                               std::size_t tensor) {
  return mix64(mix64(group) ^ tensor);
}

// Bits 14, 30, 46 and 62: the top exponent bit of every fp16 and bf16 element (bit 14 of each
// 16-bit lane) and of every fp32 element (bit 30 of each 32-bit lane) in an 8-byte word.
inline constexpr std::uint64_t kExponentTopBits = 0x4000400040004000ull;

SHADOWSYNC_HOST_DEVICE inline std::uint64_t pattern_key_from_tensor(std::uint64_t tensor_key,
                                                                    std::size_t word) {
  // Never 0, so version 0 differs from zeros. The exponent's top bit stays clear, so every
  // fp32/fp16/bf16 element of a pattern below version 2^14 is finite: tests can run with the
  // receiver's non-finite guard on (ReceiverConfig::reject_nonfinite).
  return (mix64(tensor_key ^ word) | 1) & ~kExponentTopBits;
}

SHADOWSYNC_HOST_DEVICE inline std::uint64_t pattern_key(std::size_t group, std::size_t tensor,
                                                        std::size_t word) {
  return pattern_key_from_tensor(pattern_tensor_key(group, tensor), word);
}

SHADOWSYNC_HOST_DEVICE inline std::uint64_t pattern_word(std::size_t group, std::size_t tensor,
                                                         std::size_t word, std::uint64_t version) {
  return version == 0 ? 0 : pattern_key(group, tensor, word) ^ version;
}

// The version a word was written at (0 for a zero word); garbage decodes to a huge number.
SHADOWSYNC_HOST_DEVICE inline std::uint64_t decode_version(std::size_t group, std::size_t tensor,
                                                           std::size_t word, std::uint64_t value) {
  return value == 0 ? 0 : pattern_key(group, tensor, word) ^ value;
}

}  // namespace shadowsync::testing
