// The test oracle's weight pattern: every 8-byte word of tensor t of group g at
// version v is a pure function of (g, t, word index, v), and the version can be read back from
// any single word. A step that reads two versions in one group, or a version other than the one
// the update history says is live, has torn. Version 0 is the zero-filled initial arena.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "pattern_word.h"  // mix64, pattern_key, pattern_word, decode_version, kGarbageVersion
#include "shadowsync/layout.h"
#include "shadowsync/sender.h"

namespace shadowsync::testing {

// Writes the pattern of (group, tensor, version) into `bytes` bytes at `dst` (host memory).
void fill_pattern(void* dst, std::size_t bytes, std::size_t group, std::size_t tensor,
                  std::uint64_t version);

// The version word `word` of a tensor was written at. A partial tail word is too short to decode:
// it yields `expected` if it matches that version's pattern, else kGarbageVersion.
std::uint64_t read_version(const std::byte* tensor_data, std::size_t tensor_bytes,
                           std::size_t group, std::size_t tensor, std::size_t word,
                           std::uint64_t expected);

// Trainer-side tensors of some groups at some version, in host memory (the HostBackend's
// memory is host memory), ready for Sender::publish.
class HostTensors {
 public:
  HostTensors(const Layout& layout, const std::vector<std::string>& groups, std::uint64_t version);
  const std::vector<SourceTensor>& sources() const { return sources_; }

 private:
  std::vector<std::vector<std::uint64_t>> storage_;  // 8-byte aligned
  std::vector<SourceTensor> sources_;
};

// Fills a group's whole arena image (host memory) at a version: for Sender::publish_arenas.
void fill_arena(const Layout& layout, std::size_t group, std::uint64_t version, std::byte* arena);

}  // namespace shadowsync::testing
