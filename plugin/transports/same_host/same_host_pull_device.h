// Internal to the same-host pull transport: its device flavour's staging, behind a seam that
// builds without CUDA refuse (same_host_device_absent.cpp). A trainer rank's two slots are one
// exportable cuMem allocation on its GPU (DeviceStaging, same_host_device_staging.h); each
// engine rank maps it for its own device, the same GPU or a peer GPU of the host. Not installed.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
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

// A device allocation that other processes of the host can map (CUDA IPC): where a trainer rank's
// shards lie when engines read its routes in place.
struct SharedAllocation {
  const std::byte* base = nullptr;
  std::size_t bytes = 0;
  std::array<std::byte, kHandleBytes> handle{};  // a cudaIpcMemHandle_t
  std::uint64_t buffer_id = 0;  // the driver's id of the allocation, never reused in a process
};

// Trainer rank: the allocation on `backend`'s GPU that holds `address`, shared. Nullopt, with
// the reason in `why`, when CUDA IPC cannot share it (host memory, another GPU's, memory of the
// virtual memory API or of a stream-ordered pool): the caller packs instead.
// Error(kInvalidArgument) when `backend` is not a CudaBackend.
std::optional<SharedAllocation> share_allocation(Backend& backend, const void* address,
                                                 std::string& why);

// Trainer rank: whether `allocation` is still the allocation at its base (not freed, and no
// other made at the same address since).
bool still_allocated(Backend& backend, const SharedAllocation& allocation);

// Engine rank: a trainer rank's shared allocation mapped for `backend`'s GPU; the mapping goes
// with the last copy of `owner`, which must outlive every copy that reads it. Error(kTransport)
// naming `peer`, the bytes and the CUDA error when it cannot be mapped.
struct MappedAllocation {
  std::shared_ptr<void> owner;
  const std::byte* base = nullptr;
};
MappedAllocation open_shared_allocation(Backend& backend,
                                        const std::array<std::byte, kHandleBytes>& handle,
                                        std::size_t bytes, const std::string& peer);

}  // namespace shadowsync::same_host
