// The same-host pull transport's device staging (CUDA builds): DeviceStaging behind the seam of
// same_host_pull_device.h.
#include "transports/same_host/same_host_pull_device.h"

#include "transports/same_host/same_host_device_staging.h"

namespace shadowsync::same_host {

namespace {

DeviceSlots slots_of(std::shared_ptr<DeviceStaging> staging) {
  DeviceSlots slots;
  slots.base = staging->slot(0);
  slots.slot_bytes = staging->slot_bytes();
  slots.owner = std::move(staging);
  return slots;
}

}  // namespace

DeviceSlots create_device_slots(Backend& backend, std::size_t slot_bytes) {
  std::shared_ptr<DeviceStaging> staging = DeviceStaging::create(backend, slot_bytes);
  const int fd = staging->exported_fd();
  const auto handle = staging->handle();
  DeviceSlots slots = slots_of(std::move(staging));
  slots.exported_fd = fd;
  slots.handle = handle;
  return slots;
}

DeviceSlots open_device_slots(Backend& backend, Fd exported, const PullSetup& setup,
                              const std::string& path) {
  Setup as_setup;
  as_setup.memory = setup.memory;
  as_setup.slot_bytes = setup.slot_bytes;
  as_setup.handle = setup.handle;
  return slots_of(DeviceStaging::open(backend, std::move(exported), as_setup, path));
}

}  // namespace shadowsync::same_host
