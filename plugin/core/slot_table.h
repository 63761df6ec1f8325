// The memory of a receiver: two slots per group, and per slot the release event the engine
// records on its stream when it (or a copy out of the slot) stops reading it. How a slot becomes
// live depends on the swap strategy (SwapStrategy, step_hook.h), so the table does the swap
// itself:
//
//   rebind   two arenas; the live index flips, the live address moves with it
//   copy_in  two arenas; slot 0 is the live storage and never moves, slot 1 the shadow; a swap
//            copies slot 1 into slot 0 on the engine stream (one copy per group arena)
//   remap    a RemappableArena: a live range that never moves over two physical slots; a swap
//            remaps the live range onto the other slot. The arena is the table's own, or one the
//            engine made before it met the receiver (EngineArenas, receiver.h): then it is shared,
//            outlives the table, and its live slot is whichever it shows
//   rebind over an engine arena: the arena's two slot mappings are the two slots, and a swap
//            flips the live index as with the table's own arenas; the arena's live range is
//            neither read nor remapped. For an engine that captured one set of CUDA graphs per
//            slot (vLLM's graph pairs) and switches sets when the live slot changes
//
// A group whose live storage is the engine's own tensors (use_engine_storage) is swapped as under
// copy_in whatever the strategy: under remap that is a group the engine could not place in a remap
// arena (vLLM's LoRA buffers beside its live arena), copied at the swap that remaps the others.
//
// The table is the one record of which slot of each group is live; the receiver's SlotPlanner
// asks it (live_slot) rather than keeping a copy. Only the engine thread changes it (make_live,
// from the step hook's swaps and rollbacks). The receiver thread reads it only while no swap can
// run: after it resolved the step hook's offer (the engine finished the swap it took, or never
// took it) and closed the rollback window, and before it offers the next update. The step hook's
// atomics order those reads after the engine's writes.
//
// Ownership: the table owns both slots and their events for the receiver's life (an engine arena
// it shares with the engine); the backend must outlive it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "shadowsync/backend.h"
#include "shadowsync/layout.h"
#include "shadowsync/step_hook.h"

namespace shadowsync {

class SlotTable {
 public:
  struct Group {
    DeviceBuffer arena[2];                   // rebind, copy_in
    std::shared_ptr<RemappableArena> remap;  // remap
    // rebind over an engine arena: its slot mappings are the slots (arena[] stays empty).
    std::shared_ptr<RemappableArena> engine_slots;
    bool engine_arena = false;  // remap or engine_slots is one the engine made (EngineArenas)
    std::unique_ptr<Event> release[2];
    std::size_t bytes = 0;  // the layout's arena size
    // copy_in with the engine's own storage (use_engine_storage): where each tensor of the group
    // lives, and the copies a swap enqueues (src: the shadow slot's bytes); empty otherwise.
    std::vector<Backend::CopyRegion> engine_storage;
    // Version of the update whose bytes the live slot holds (0: never updated). Engine thread.
    std::uint64_t live_content_version = 0;

   private:
    friend class SlotTable;
    int live = 0;  // under copy_in always 0
  };

  // Allocates both slots of every group (zero-filled) and their events; slot 0 is live. Under
  // remap or rebind a group g with a non-null `engine_arenas[g]` takes that arena instead (its
  // live slot stays live; the receiver checked its size). The strategy must fit the backend (the receiver
  // checks that first, with a clearer message).
  SlotTable(const Layout& layout, Backend& backend, SwapStrategy strategy,
            const std::vector<std::shared_ptr<RemappableArena>>& engine_arenas = {});

  Backend& backend() const { return backend_; }
  SwapStrategy strategy() const { return strategy_; }
  Group& group(std::size_t g) { return groups_[g]; }
  const Group& group(std::size_t g) const { return groups_[g]; }
  std::size_t size() const { return groups_.size(); }

  // The slot of group `g` the engine reads (0 or 1; under copy_in always 0). The engine thread,
  // or the receiver thread while no swap can run (see above).
  int live_slot(std::size_t g) const { return groups_[g].live; }

  // Where slot `slot` of group `g` is written (the receiver) and its bytes can be read, whatever
  // is live. Thread-safe (the addresses are fixed for the table's life).
  std::byte* slot_data(std::size_t g, int slot) const;
  // What the engine reads for group `g` now. Engine thread only: under rebind it moves with
  // each swap; under copy_in and remap it never changes.
  std::byte* live_data(std::size_t g) const;

  // Makes `slot` of group `g` what the engine reads from its next enqueued work on, and records
  // on `engine_stream` the release event of the slot that is no longer read once that work runs
  // (invariant 2). Under remap this waits for `engine_stream` to have no work in flight first,
  // unless `work_before_done` (a gated swap: the work before the stream's gate has completed, the
  // work after it waits; RemappableArena::remap_live). Engine thread only.
  void make_live(std::size_t g, int slot, Stream& engine_stream, bool work_before_done = false);

  // copy_in, or remap for a group without an engine arena: the live storage of group `g` becomes
  // the engine's own tensors, `tensors[t]` holding tensor t of the group (layout order) from now
  // on; slot 0's arena (under remap: the group's remap arena) is freed and slot 1 is the shadow. A
  // swap then copies each tensor of the shadow to its address, one batched copy. Before the first
  // receive (the receiver checks that). Engine thread.
  void use_engine_storage(std::size_t g, const Layout& layout, const std::vector<void*>& tensors);
  // Whether a swap of group `g` copies the shadow into the live storage (copy_in, or a group in
  // the engine's own storage): its previous live bytes are then not kept.
  bool copies_in(std::size_t g) const;
  // Where tensor `t` of group `g` is live: in the live arena, or the engine's own storage.
  void* live_tensor(std::size_t g, std::size_t t, std::size_t offset) const;

 private:
  Backend& backend_;
  SwapStrategy strategy_;
  std::vector<Group> groups_;
};

}  // namespace shadowsync
