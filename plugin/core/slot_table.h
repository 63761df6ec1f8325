// The memory of a receiver: two arenas (slots) per group, and per slot the release event the
// engine records on its stream when the slot stops being live.
#pragma once

#include <memory>
#include <vector>

#include "shadowsync/backend.h"
#include "shadowsync/layout.h"

namespace shadowsync {

class SlotTable {
 public:
  struct Group {
    DeviceBuffer arena[2];
    std::unique_ptr<Event> release[2];
    // Engine thread only (the receiver keeps its own view in SlotPlanner).
    int live = 0;
    std::uint64_t live_content_version = 0;
  };

  // Allocates both slots of every group (zero-filled) and their events.
  SlotTable(const Layout& layout, Backend& backend);

  Backend& backend() const { return backend_; }
  Group& group(std::size_t g) { return groups_[g]; }
  const Group& group(std::size_t g) const { return groups_[g]; }
  std::size_t size() const { return groups_.size(); }

 private:
  Backend& backend_;
  std::vector<Group> groups_;
};

}  // namespace shadowsync
