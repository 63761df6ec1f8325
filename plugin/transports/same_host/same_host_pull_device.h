// Internal to the same-host pull transport: its device flavour's staging, behind a seam that
// builds without CUDA refuse (same_host_device_absent.cpp). A trainer rank's two slots are one
// exportable cuMem allocation on its GPU (DeviceStaging, same_host_device_staging.h); each
// engine rank maps it for its own device, the same GPU or a peer GPU of the host. Not installed.
#pragma once

#include <array>
#include <cstddef>
#include <memory>
#include <string>

#include "shadowsync/backend.h"
#include "transports/same_host/same_host_frame.h"
#include "transports/same_host/same_host_socket.h"

namespace shadowsync::same_host {

// Staging slots in device memory, as one process maps them. `owner` keeps the mapping: it is
// released when the last copy of it goes, and only once no stream touches the slots (the pull
// transport's device calls return only after their copies completed).
struct DeviceSlots {
  std::shared_ptr<void> owner;
  std::byte* base = nullptr;  // kSlotCount slots of slot_bytes, back to back
  std::size_t slot_bytes = 0;
  int exported_fd = -1;                          // trainer: passed to each engine rank
  std::array<std::byte, kHandleBytes> handle{};  // trainer: the setup's handle bytes
};

// Trainer rank: kSlotCount slots of `slot_bytes` on `backend`'s GPU. `backend` must be a
// CudaBackend (Error(kInvalidArgument) naming what it is); Error(kBackend) naming the driver
// call when the GPU cannot export memory; in a build without CUDA, Error(kInvalidArgument).
DeviceSlots create_device_slots(Backend& backend, std::size_t slot_bytes);

// Engine rank: maps a trainer rank's slots (the fd of its setup, `setup.handle`) for `backend`'s
// GPU. Error(kInvalidArgument) when `backend` is not a CudaBackend; Error(kTransport) saying what
// was tried when it cannot map them (a GPU without peer access to the trainer's, naming both).
DeviceSlots open_device_slots(Backend& backend, Fd exported, const PullSetup& setup,
                              const std::string& path);

}  // namespace shadowsync::same_host
