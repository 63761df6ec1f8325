#include "core/slot_table.h"

namespace shadowsync {

SlotTable::SlotTable(const Layout& layout, Backend& backend, SwapStrategy strategy)
    : backend_(backend), strategy_(strategy) {
  groups_.resize(layout.groups().size());
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    Group& group = groups_[g];
    group.bytes = layout.groups()[g].arena_bytes();
    if (strategy == SwapStrategy::kRemap) {
      group.remap = backend.create_remappable_arena(group.bytes);
    } else {
      for (int s = 0; s < 2; ++s) group.arena[s] = DeviceBuffer(backend, group.bytes);
    }
    for (int s = 0; s < 2; ++s) group.release[s] = backend.create_event();
  }
}

std::byte* SlotTable::slot_data(std::size_t g, int slot) const {
  const Group& group = groups_[g];
  return group.remap ? group.remap->slot_address(slot) : group.arena[slot].data();
}

std::byte* SlotTable::live_data(std::size_t g) const {
  const Group& group = groups_[g];
  return group.remap ? group.remap->live_address() : group.arena[group.live].data();
}

void SlotTable::make_live(std::size_t g, int slot, Stream& engine_stream) {
  Group& group = groups_[g];
  switch (strategy_) {
    case SwapStrategy::kRebind:
      // Everything the engine enqueued so far read the old live slot; once this event passes the
      // receiver may overwrite it.
      backend_.event_record(*group.release[group.live], engine_stream);
      group.live = slot;
      return;
    case SwapStrategy::kCopyIn:
      // The arena is contiguous: one copy moves every tensor of the group. On the engine stream it
      // runs after every step that read the old bytes and before every step that reads the new.
      backend_.memcpy_async(group.arena[0].data(), group.arena[slot].data(), group.bytes,
                            engine_stream);
      // The shadow is free to be written once the copy out of it has run.
      backend_.event_record(*group.release[slot], engine_stream);
      return;
    case SwapStrategy::kRemap:
      // Synchronizes the engine stream first: no kernel is reading the old pages when they go.
      group.remap->remap_live(slot, engine_stream);
      backend_.event_record(*group.release[group.live], engine_stream);
      group.live = slot;
      return;
  }
}

}  // namespace shadowsync
