// Internal to the same-host transport's device flavour: the sender's two staging slots in device
// memory, shared with receivers in other processes. Not installed.
//
// The sender makes one cuMem allocation on its GPU, exportable as a POSIX file descriptor; the fd
// rides to each receiver with the setup record (SCM_RIGHTS) and the setup's handle bytes carry
// the allocation's size and the UUID of the GPU that holds it. A receiver imports the fd and maps
// the allocation for its own device: the same GPU, or a peer GPU of the host. Only the CUDA
// driver API reaches these calls (cuda_driver.h), so nothing links libcuda.
#pragma once

#include <cuda.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "shadowsync/cuda_backend.h"
#include "transports/same_host/same_host_frame.h"
#include "transports/same_host/same_host_socket.h"

namespace shadowsync::same_host {

// `backend` as the CudaBackend that device memory needs; Error(kInvalidArgument) naming `side`
// ("serve", "connect", ...) and what it is otherwise.
CudaBackend& cuda_backend_of(Backend& backend, const char* side);

class DeviceStaging {
 public:
  // Sender: kSlotCount slots of `slot_bytes` on `backend`'s device. `backend` must be a
  // CudaBackend (Error(kInvalidArgument) naming what it is); Error(kBackend) naming the driver
  // call when the device cannot make exportable memory.
  static std::unique_ptr<DeviceStaging> create(Backend& backend, std::size_t slot_bytes);
  // Receiver: maps the sender's export for `backend`'s device. Error(kTransport) saying what was
  // tried when it cannot (no fd, an fd of another host's driver, a GPU without peer access to
  // the sender's), naming both GPUs.
  // `backend` must be a CudaBackend, as for create().
  static std::unique_ptr<DeviceStaging> open(Backend& backend, Fd exported,
                                             const Setup& setup, const std::string& path);
  // Unmaps and releases. The caller makes sure no stream still touches the slots.
  ~DeviceStaging();
  DeviceStaging(const DeviceStaging&) = delete;
  DeviceStaging& operator=(const DeviceStaging&) = delete;

  int device() const { return device_; }
  std::size_t slot_bytes() const { return slot_bytes_; }
  std::byte* slot(std::uint32_t s) const {
    return reinterpret_cast<std::byte*>(base_) + std::size_t{s} * slot_bytes_;
  }
  int exported_fd() const { return exported_.get(); }      // sender: passed to each receiver
  std::array<std::byte, kHandleBytes> handle() const;      // sender: the setup's handle bytes

 private:
  DeviceStaging() = default;

  int device_ = 0;
  std::size_t slot_bytes_ = 0;
  std::size_t allocation_bytes_ = 0;
  std::array<std::byte, 16> uuid_{};  // of the GPU that holds the staging
  CUmemGenericAllocationHandle allocation_ = 0;
  CUdeviceptr base_ = 0;  // the reserved range; mapped when `mapped_`
  bool mapped_ = false;
  Fd exported_;  // sender
};

}  // namespace shadowsync::same_host
