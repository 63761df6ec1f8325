// A hash of every live byte of every group: what the engine computes from. Equal hashes before
// and after a fault mean the live weights are bit-for-bit what they were. Engine thread only (it
// reads the live pointer table); call with the engine stream idle.
#pragma once

#include <cstdint>

#include "shadowsync/receiver.h"

namespace shadowsync::testing {

inline std::uint64_t live_hash(Receiver& receiver) {
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (std::size_t g = 0; g < receiver.layout().groups().size(); ++g) {
    const std::byte* arena = receiver.step_hook().live_arena(g);
    for (std::size_t i = 0; i < receiver.layout().groups()[g].arena_bytes(); ++i) {
      h = (h ^ static_cast<std::uint8_t>(arena[i])) * 1099511628211ull;
    }
  }
  return h;
}

}  // namespace shadowsync::testing
