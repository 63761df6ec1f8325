#include "core/slot_planner.h"

#include <fmt/format.h>

#include "shadowsync/error.h"

namespace shadowsync {

SlotPlanner::SlotPlanner(const SlotTable& slots) : slots_(slots), groups_(slots.size()) {}

const PendingUpdate* SlotPlanner::offer() const {
  return offered_ < 0 ? nullptr : &records_[offered_];
}

std::uint64_t SlotPlanner::retracted_version() const {
  return retracted_ < 0 ? 0 : records_[retracted_].version;
}

void SlotPlanner::on_applied() {
  // The old live slot (copy_in: the copied shadow); free once its release event passed.
  free_offered("on_applied");
}

void SlotPlanner::on_discarded() {
  // Bytes of a version that never goes live.
  free_offered("on_discarded");
}

void SlotPlanner::free_offered(const char* event) {
  if (offered_ < 0) {
    throw Error(ErrorCode::kInternal, fmt::format("slot planner: {} without an offer", event));
  }
  for (const auto& swap : records_[offered_].swaps) groups_[swap.group].shadow = Shadow::kFree;
  offered_ = -1;
}

void SlotPlanner::on_retracted() {
  if (offered_ < 0) throw Error(ErrorCode::kInternal, "slot planner: on_retracted without an offer");
  retracted_ = offered_;
  offered_ = -1;
}

void SlotPlanner::on_rolled_back(const std::vector<GroupSwap>& live_now) {
  if (offered_ >= 0 || receiving_) {
    throw Error(ErrorCode::kInternal,
                "slot planner: on_rolled_back while an offer or a receive is unresolved");
  }
  for (const GroupSwap& swap : live_now) groups_.at(swap.group).shadow = Shadow::kFree;
}

std::vector<ReceiveTarget> SlotPlanner::begin(std::uint64_t version,
                                              const std::vector<std::uint32_t>& groups) {
  if (offered_ >= 0 || receiving_) {
    throw Error(ErrorCode::kInternal,
                fmt::format("slot planner: begin({}) while an offer or a receive is unresolved",
                            version));
  }
  std::vector<ReceiveTarget> targets;
  targets.reserve(groups.size());
  for (const auto index : groups) {
    GroupState& g = groups_.at(index);
    g.shadow = Shadow::kReceiving;  // a pending shadow of a superseded update is overwritten
    g.content_version = version;
    targets.push_back(ReceiveTarget{index, 1 - slots_.live_slot(index)});
  }
  receiving_ = true;
  receiving_version_ = version;
  return targets;
}

const PendingUpdate& SlotPlanner::complete() {
  if (!receiving_) throw Error(ErrorCode::kInternal, "slot planner: complete without a receive");
  last_written_ = 1 - last_written_;
  PendingUpdate& record = records_[last_written_];
  record.version = receiving_version_;
  record.swaps.clear();
  for (std::size_t index = 0; index < groups_.size(); ++index) {
    GroupState& g = groups_[index];
    if (g.shadow == Shadow::kFree) continue;
    g.shadow = Shadow::kPending;
    record.swaps.push_back(GroupSwap{index, 1 - slots_.live_slot(index), g.content_version});
  }
  receiving_ = false;
  retracted_ = -1;
  offered_ = last_written_;
  return record;
}

const PendingUpdate* SlotPlanner::fail() {
  if (!receiving_) throw Error(ErrorCode::kInternal, "slot planner: fail without a receive");
  receiving_ = false;
  for (auto& g : groups_) {
    if (g.shadow == Shadow::kReceiving) g.shadow = Shadow::kFree;
  }
  const int retracted = retracted_;
  retracted_ = -1;
  if (retracted >= 0) {
    bool intact = true;
    for (const auto& swap : records_[retracted].swaps) {
      intact = intact && groups_[swap.group].shadow == Shadow::kPending;
    }
    if (intact) {
      offered_ = retracted;
      return &records_[retracted];
    }
  }
  // Whatever is still pending belonged to a superseded update that is no longer whole.
  for (auto& g : groups_) {
    if (g.shadow == Shadow::kPending) g.shadow = Shadow::kFree;
  }
  return nullptr;
}

}  // namespace shadowsync
