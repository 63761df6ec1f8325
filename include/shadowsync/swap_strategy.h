// How a swap makes an update's bytes visible to the engine (DESIGN.md §5). Chosen per receiver
// (ReceiverConfig::swap_strategy); docs/ARCHITECTURE.md says when to pick which.
#pragma once

#include <string_view>

namespace shadowsync {

enum class SwapStrategy {
  // The live pointer table flips to the other slot; the engine reads its weights through it (or
  // its adapter rebinds its tensors in the swap callback). Microseconds, no copy. Not for engines
  // that replay CUDA graphs captured over the weights: a graph keeps the old addresses.
  kRebind,
  // The live storage never moves: the swap enqueues one device copy per group of the update,
  // shadow -> live, on the engine stream. Any engine, CUDA graphs included, any backend. Costs
  // bytes / device-copy bandwidth on the engine stream; no rollback.
  kCopyIn,
  // The live weights sit at a reserved virtual range (CUDA VMM) that the swap remaps onto the
  // other slot's physical memory: the address stays, no byte is copied. CUDA graphs included;
  // CUDA backend on a device with VMM only. The swap synchronizes the engine stream.
  kRemap,
};

// "rebind", "copy_in", "remap": the names the C ABI's and Python's docs and errors use.
constexpr std::string_view swap_strategy_name(SwapStrategy strategy) {
  switch (strategy) {
    case SwapStrategy::kRebind:
      return "rebind";
    case SwapStrategy::kCopyIn:
      return "copy_in";
    case SwapStrategy::kRemap:
      return "remap";
  }
  return "unknown";
}

}  // namespace shadowsync
