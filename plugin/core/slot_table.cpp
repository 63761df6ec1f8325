#include "core/slot_table.h"

namespace shadowsync {

SlotTable::SlotTable(const Layout& layout, Backend& backend, SwapStrategy strategy,
                     const std::vector<std::shared_ptr<RemappableArena>>& engine_arenas)
    : backend_(backend), strategy_(strategy) {
  groups_.resize(layout.groups().size());
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    Group& group = groups_[g];
    group.bytes = layout.groups()[g].arena_bytes();
    const bool engine_arena = g < engine_arenas.size() && engine_arenas[g] != nullptr;
    if (strategy == SwapStrategy::kRemap && engine_arena) {
      group.remap = engine_arenas[g];
      group.engine_arena = true;
      group.live = group.remap->live_slot();  // an earlier receiver may have swapped it
    } else if (strategy == SwapStrategy::kRebind && engine_arena) {
      group.engine_slots = engine_arenas[g];
      group.engine_arena = true;
      group.live = group.engine_slots->live_slot();  // the slot the engine reads now
    } else if (strategy == SwapStrategy::kRemap) {
      group.remap = backend.create_remappable_arena(group.bytes);
    } else {
      for (int s = 0; s < 2; ++s) group.arena[s] = DeviceBuffer(backend, group.bytes);
    }
    for (int s = 0; s < 2; ++s) group.release[s] = backend.create_event();
  }
}

std::byte* SlotTable::slot_data(std::size_t g, int slot) const {
  const Group& group = groups_[g];
  if (group.remap) return group.remap->slot_address(slot);
  if (group.engine_slots) return group.engine_slots->slot_address(slot);
  return group.arena[slot].data();
}

std::byte* SlotTable::live_data(std::size_t g) const {
  const Group& group = groups_[g];
  if (group.remap) return group.remap->live_address();
  return slot_data(g, group.live);
}

void* SlotTable::live_tensor(std::size_t g, std::size_t t, std::size_t offset) const {
  const Group& group = groups_[g];
  if (!group.engine_storage.empty()) return group.engine_storage[t].dst;
  return live_data(g) + offset;
}

void SlotTable::use_engine_storage(std::size_t g, const Layout& layout,
                                   const std::vector<void*>& tensors) {
  Group& group = groups_[g];
  if (group.remap) {
    // Under remap, a group the engine keeps in its own tensors (vLLM's LoRA buffers beside a live
    // arena) has no use for a remap arena: one plain shadow is all it needs.
    group.remap.reset();
    group.arena[1] = DeviceBuffer(backend_, group.bytes);
    group.live = 0;
  }
  const auto& placements = layout.groups()[g].tensors();
  std::vector<Backend::CopyRegion> copies;
  for (std::size_t t = 0; t < placements.size(); ++t) {
    copies.push_back({tensors[t], group.arena[1].data() + placements[t].offset,
                      placements[t].bytes});
  }
  group.engine_storage = std::move(copies);
  group.arena[0].reset();  // nothing reads or writes the live arena any more
}

bool SlotTable::copies_in(std::size_t g) const {
  return strategy_ == SwapStrategy::kCopyIn || !groups_[g].engine_storage.empty();
}

void SlotTable::make_live(std::size_t g, int slot, Stream& engine_stream, bool work_before_done) {
  Group& group = groups_[g];
  switch (copies_in(g) ? SwapStrategy::kCopyIn : strategy_) {
    case SwapStrategy::kRebind:
      // Everything the engine enqueued so far read the old live slot; once this event passes the
      // receiver may overwrite it.
      backend_.event_record(*group.release[group.live], engine_stream);
      group.live = slot;
      return;
    case SwapStrategy::kCopyIn:
      // On the engine stream the copies run after every step that read the old bytes and before
      // every step that reads the new. Into the engine's own tensors: one batch of copies; into
      // the live arena, which is contiguous: one copy for every tensor of the group.
      if (!group.engine_storage.empty()) {
        backend_.memcpy_batch_async(group.engine_storage, engine_stream);
      } else {
        backend_.memcpy_async(group.arena[0].data(), group.arena[slot].data(), group.bytes,
                              engine_stream);
      }
      // The shadow is free to be written once the copy out of it has run.
      backend_.event_record(*group.release[slot], engine_stream);
      return;
    case SwapStrategy::kRemap:
      // Synchronizes the engine stream first (unless a gate already made sure): no kernel is
      // reading the old pages when they go.
      group.remap->remap_live(slot, engine_stream, work_before_done);
      backend_.event_record(*group.release[group.live], engine_stream);
      group.live = slot;
      return;
  }
}

}  // namespace shadowsync
