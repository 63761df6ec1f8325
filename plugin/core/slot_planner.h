// The slot state machine, as the receiver thread sees it: what each group's shadow slot holds
// and which record is offered to the engine. Which slot is live it asks the SlotTable, the one
// record of it (slot_table.h says when the receiver thread may read it). Pure bookkeeping, no
// threads and no memory of its own: it decides, the receiver acts. Receiver thread only.
//
// Per group the shadow slot is
//   free       nothing worth keeping (initially, after a swap made it the old live, after a failure)
//   receiving  the update in flight is being written into it
//   pending    holds complete bytes of some version, offered to the engine or about to be
//
// The offer (the update in the step hook's mailbox) is resolved before each new receive: the
// engine either applied it (its groups flip) or it was taken back (its groups stay pending and
// join the next offer, so a LoRA-only update never lands on a stale base).
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "core/pending_update.h"
#include "core/slot_table.h"

namespace shadowsync {

struct ReceiveTarget {
  std::size_t group = 0;
  int slot = 0;
};

class SlotPlanner {
 public:
  // Plans the receives into `slots`, which must outlive the planner. The shadow of a group is
  // the slot that is not live: under rebind and remap a swap makes it live, under copy_in slot 0
  // stays live and slot 1 is always the shadow (a swap copies it into slot 0 and frees it).
  explicit SlotPlanner(const SlotTable& slots);

  // The record currently offered to the engine, or nullptr.
  const PendingUpdate* offer() const;
  // The engine applied the offer (the table already shows its groups' new live slots): their
  // shadows are free.
  void on_applied();
  // The offer was taken back before the engine saw it: its groups stay pending.
  void on_retracted();
  // The offer was dropped, never to go live (Receiver::discard): its groups' shadows are free.
  void on_discarded();
  // The engine rolled its last swap back: each of `live_now` names a group and the slot that is
  // live again (the table already shows it). The slot it left holds a newer version nobody will
  // read: free. No offer or receive may be unresolved.
  void on_rolled_back(const std::vector<GroupSwap>& live_now);
  // Version of the offer taken back during the current receive (0: none).
  std::uint64_t retracted_version() const;

  // Starts receiving `version` into the shadow slot of each of `groups`. The offer must have been
  // resolved first. Returns where to write.
  std::vector<ReceiveTarget> begin(std::uint64_t version, const std::vector<std::uint32_t>& groups);
  // The receive completed: returns the record to offer (received and carried-over groups).
  const PendingUpdate& complete();
  // The receive failed: its groups' shadows are garbage. Returns the update taken back during
  // this receive if it is still intact (offer it again), else nullptr (it is lost).
  const PendingUpdate* fail();

 private:
  // The offer is resolved and its groups' shadows hold nothing worth keeping.
  void free_offered(const char* event);

  enum class Shadow { kFree, kReceiving, kPending };
  struct GroupState {
    Shadow shadow = Shadow::kFree;
    std::uint64_t content_version = 0;  // of the shadow's bytes, when pending or receiving
  };

  const SlotTable& slots_;
  std::vector<GroupState> groups_;
  // Two records alternate: the engine may still read the previous offer while the next is built.
  std::array<PendingUpdate, 2> records_;
  int last_written_ = 1;
  int offered_ = -1;    // index of the record in the mailbox (or taken, not yet resolved)
  int retracted_ = -1;  // index of the record taken back during the current receive
  bool receiving_ = false;
  std::uint64_t receiving_version_ = 0;
};

}  // namespace shadowsync
