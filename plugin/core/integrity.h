// The integrity functions shared by every backend: the per-bucket checksum and the non-finite
// test of one element. Plain inline functions that compile as host code and, under nvcc, as device
// code too, so HostBackend and CudaBackend compute bit-identical results. Not installed.
//
// Checksum of a byte range: split it into 8-byte little-endian words (the last one zero-padded),
// and add mix64(word ^ index * kChecksumStride) over all words, modulo 2^64.
// * A sum is associative and commutative, so a GPU reduces it in any order, in parallel.
// * mix64 is a bijection, so changing any single word always changes the sum (a flipped byte is
//   always caught); several changed words go unnoticed with probability about 2^-64.
// * The word index enters each term, so swapped or shifted words change the sum too.
// It guards against corruption in transit, not against an attacker (who could recompute it).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/host_device.h"

namespace shadowsync::integrity {

inline constexpr std::uint64_t kChecksumStride = 0x9e3779b97f4a7c15ull;

SHADOWSYNC_HOST_DEVICE inline std::uint64_t checksum_mix(std::uint64_t x) {
  // splitmix64's finalizer: a bijection in which every input bit affects every output bit.
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The contribution of word `index` (value `word`) to a range's checksum.
SHADOWSYNC_HOST_DEVICE inline std::uint64_t checksum_term(std::uint64_t word, std::uint64_t index) {
  return checksum_mix(word ^ (index * kChecksumStride));
}

// Non-finite (NaN or infinity) test on the raw bits: all exponent bits set. fp32 takes the 32
// bits of one element; fp16 and bf16 the 16 bits of one element.
SHADOWSYNC_HOST_DEVICE inline bool fp32_nonfinite(std::uint32_t bits) {
  return (bits & 0x7f800000u) == 0x7f800000u;
}
SHADOWSYNC_HOST_DEVICE inline bool fp16_nonfinite(std::uint16_t bits) {
  return (bits & 0x7c00u) == 0x7c00u;
}
SHADOWSYNC_HOST_DEVICE inline bool bf16_nonfinite(std::uint16_t bits) {
  return (bits & 0x7f80u) == 0x7f80u;
}

}  // namespace shadowsync::integrity
