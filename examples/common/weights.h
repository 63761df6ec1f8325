// The examples' model weights: what a trainer's optimizer step writes and what the toy engines
// check they read. Every full 8-byte word `w` of tensor `t` of group `g` at version v > 0 is
//
//   (v << 32) | (weight_key(g, t, w) & kFiniteMask)
//
// and 0 at version 0 (the zero-filled slots a receiver starts with), so any word tells the version
// that wrote it, and words of another tensor or place do not match. kFiniteMask clears the top
// exponent bit of every fp16/bf16/fp32 element, so for versions below 2^14 no element is NaN or
// infinite (a receiver may run with reject_nonfinite). A partial last word holds the low-order
// bytes of its value (little-endian). Usable from host code and, compiled by nvcc, device code.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "shadowsync/layout.h"
#include "shadowsync/sender.h"

#if defined(__CUDACC__)
#define SHADOWSYNC_EXAMPLE_HOST_DEVICE __host__ __device__
#else
#define SHADOWSYNC_EXAMPLE_HOST_DEVICE
#endif

namespace shadowsync::examples {

inline constexpr std::uint64_t kFiniteMask = ~0x40004000ull;

SHADOWSYNC_EXAMPLE_HOST_DEVICE inline std::uint64_t weight_key(std::size_t group,
                                                               std::size_t tensor,
                                                               std::size_t word) {
  std::uint64_t x = (std::uint64_t{group} << 56) ^ (std::uint64_t{tensor} << 40) ^ word;
  x *= 0x9e3779b97f4a7c15ull;  // Fibonacci hashing: nearby words get unrelated keys
  return x >> 32;
}

SHADOWSYNC_EXAMPLE_HOST_DEVICE inline std::uint64_t weight_word(std::size_t group,
                                                                std::size_t tensor,
                                                                std::size_t word,
                                                                std::uint64_t version) {
  return version == 0 ? 0 : (version << 32) | (weight_key(group, tensor, word) & kFiniteMask);
}

// Writes tensor (group, tensor)'s `bytes` bytes at `version` into host memory at `dst`.
void fill_weights(void* dst, std::size_t bytes, std::size_t group, std::size_t tensor,
                  std::uint64_t version);

// The number of full words of tensor (group, tensor) at `data` (host memory) that are not
// weight_word(..., version). Reads every word, or with `sampled` only the first, the middle and
// the last full word.
std::size_t count_wrong_words(const std::byte* data, std::size_t bytes, std::size_t group,
                              std::size_t tensor, std::uint64_t version, bool sampled);

// The tensors of `groups` at `version` in host memory (the host backend's memory), ready for
// Sender::publish; they live as long as this object.
class TrainerWeights {
 public:
  TrainerWeights(const Layout& layout, const std::vector<std::string>& groups,
                 std::uint64_t version);
  const std::vector<SourceTensor>& sources() const { return sources_; }

 private:
  std::vector<std::vector<std::uint64_t>> storage_;  // 8-byte aligned
  std::vector<SourceTensor> sources_;
};

}  // namespace shadowsync::examples
