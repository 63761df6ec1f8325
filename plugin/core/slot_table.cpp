#include "core/slot_table.h"

namespace shadowsync {

SlotTable::SlotTable(const Layout& layout, Backend& backend) : backend_(backend) {
  groups_.resize(layout.groups().size());
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    for (int s = 0; s < 2; ++s) {
      groups_[g].arena[s] = DeviceBuffer(backend, layout.groups()[g].arena_bytes());
      groups_[g].release[s] = backend.create_event();
    }
  }
}

}  // namespace shadowsync
