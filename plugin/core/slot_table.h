// The memory of a receiver: two slots per group, and per slot the release event the engine
// records on its stream when it (or a copy out of the slot) stops reading it. How a slot becomes
// live depends on the swap strategy (swap_strategy.h), so the table does the swap itself:
//
//   rebind   two arenas; the live index flips, the live address moves with it
//   copy_in  two arenas; slot 0 is the live storage and never moves, slot 1 the shadow; a swap
//            copies slot 1 into slot 0 on the engine stream (one copy per group arena)
//   remap    a RemappableArena: a live range that never moves over two physical slots; a swap
//            remaps the live range onto the other slot
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "shadowsync/backend.h"
#include "shadowsync/layout.h"
#include "shadowsync/swap_strategy.h"

namespace shadowsync {

class SlotTable {
 public:
  struct Group {
    DeviceBuffer arena[2];                   // rebind, copy_in
    std::unique_ptr<RemappableArena> remap;  // remap
    std::unique_ptr<Event> release[2];
    std::size_t bytes = 0;  // the layout's arena size
    // Engine thread only (the receiver keeps its own view in SlotPlanner). Under copy_in always 0.
    int live = 0;
    std::uint64_t live_content_version = 0;
  };

  // Allocates both slots of every group (zero-filled) and their events. The strategy must fit the
  // backend (the receiver checks that first, with a clearer message).
  SlotTable(const Layout& layout, Backend& backend, SwapStrategy strategy);

  Backend& backend() const { return backend_; }
  SwapStrategy strategy() const { return strategy_; }
  Group& group(std::size_t g) { return groups_[g]; }
  const Group& group(std::size_t g) const { return groups_[g]; }
  std::size_t size() const { return groups_.size(); }

  // Where slot `slot` of group `g` is written (the receiver) and its bytes can be read, whatever
  // is live. Thread-safe (the addresses are fixed for the table's life).
  std::byte* slot_data(std::size_t g, int slot) const;
  // What the engine reads for group `g` now. Engine thread only: under rebind it moves with
  // each swap; under copy_in and remap it never changes.
  std::byte* live_data(std::size_t g) const;

  // Makes `slot` of group `g` what the engine reads from its next enqueued work on, and records
  // on `engine_stream` the release event of the slot that is no longer read once that work runs
  // (invariant 2). Under remap this waits for `engine_stream` to have no work in flight first.
  // Engine thread only.
  void make_live(std::size_t g, int slot, Stream& engine_stream);

 private:
  Backend& backend_;
  SwapStrategy strategy_;
  std::vector<Group> groups_;
};

}  // namespace shadowsync
