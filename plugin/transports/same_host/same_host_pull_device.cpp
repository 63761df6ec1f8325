// The same-host pull transport's device staging (CUDA builds): DeviceStaging behind the seam of
// same_host_pull_device.h.
#include "transports/same_host/same_host_pull_device.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include <fmt/format.h>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_driver.h"
#include "backends/cuda/scoped_device.h"
#include "shadowsync/cuda_backend.h"
#include "shadowsync/error.h"
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

namespace {

int device_of(Backend& backend, const char* side) {
  return cuda_backend_of(backend, side).device();
}

}  // namespace

std::optional<SharedAllocation> share_allocation(Backend& backend, const void* address,
                                                 std::string& why) {
  const int device = device_of(backend, "trainer rank");
  cuda_detail::ScopedDeviceNoThrow on(device);
  // The driver calls below need the device's context current on this thread (the sender's
  // thread may have made no runtime call yet): cudaSetDevice makes its primary context current.
  if (cudaSetDevice(device) != cudaSuccess) {
    cuda_detail::clear_last_error();
    why = fmt::format("GPU {} could not be made current", device);
    return std::nullopt;
  }
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, address) != cudaSuccess ||
      attributes.type != cudaMemoryTypeDevice || attributes.device != device) {
    cuda_detail::clear_last_error();
    why = fmt::format("{} is not device memory of GPU {}", address, device);
    return std::nullopt;
  }
  const cuda_detail::DriverApi& api = cuda_detail::driver_api();
  CUdeviceptr base = 0;
  std::size_t bytes = 0;
  if (api.address_range == nullptr ||
      api.address_range(&base, &bytes, reinterpret_cast<CUdeviceptr>(address)) != CUDA_SUCCESS) {
    why = fmt::format("the allocation holding {} was not found (cuMemGetAddressRange)", address);
    return std::nullopt;
  }
  cudaIpcMemHandle_t handle{};
  const cudaError_t status = cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(base));
  if (status != cudaSuccess) {
    cuda_detail::clear_last_error();
    // Memory of cuMemCreate (PyTorch's expandable segments) or of a cudaMallocAsync pool.
    why = fmt::format("CUDA IPC cannot share the allocation holding {} ({})", address,
                      cudaGetErrorName(status));
    return std::nullopt;
  }
  SharedAllocation shared;
  if (api.pointer_attribute == nullptr ||
      api.pointer_attribute(&shared.buffer_id, CU_POINTER_ATTRIBUTE_BUFFER_ID, base) !=
          CUDA_SUCCESS) {
    why = fmt::format("the allocation holding {} has no buffer id", address);
    return std::nullopt;
  }
  shared.base = reinterpret_cast<const std::byte*>(base);
  shared.bytes = bytes;
  static_assert(sizeof(handle) == kHandleBytes);
  std::memcpy(shared.handle.data(), &handle, sizeof(handle));
  return shared;
}

bool still_allocated(Backend& backend, const SharedAllocation& allocation) {
  const int device = device_of(backend, "trainer rank");
  cuda_detail::ScopedDeviceNoThrow on(device);
  if (cudaSetDevice(device) != cudaSuccess) {  // the primary context current, as above
    cuda_detail::clear_last_error();
    return false;
  }
  const cuda_detail::DriverApi& api = cuda_detail::driver_api();
  const auto base = reinterpret_cast<CUdeviceptr>(allocation.base);
  CUdeviceptr found = 0;
  std::size_t bytes = 0;
  std::uint64_t id = 0;
  return api.address_range != nullptr && api.pointer_attribute != nullptr &&
         api.address_range(&found, &bytes, base) == CUDA_SUCCESS && found == base &&
         bytes == allocation.bytes &&
         api.pointer_attribute(&id, CU_POINTER_ATTRIBUTE_BUFFER_ID, base) == CUDA_SUCCESS &&
         id == allocation.buffer_id;
}

MappedAllocation open_shared_allocation(Backend& backend,
                                        const std::array<std::byte, kHandleBytes>& handle,
                                        std::size_t bytes, const std::string& peer) {
  const int device = device_of(backend, "engine rank");
  // One mapping per handle and GPU in the process, shared by its transports (several engine
  // ranks in one process map the same trainer allocation; CUDA IPC maps a handle once per
  // context), opened and closed under one lock.
  static std::mutex mutex;
  static std::map<std::pair<std::array<std::byte, kHandleBytes>, int>, std::weak_ptr<void>> open;
  std::lock_guard lock(mutex);
  const auto key = std::make_pair(handle, device);
  if (auto it = open.find(key); it != open.end()) {
    if (std::shared_ptr<void> owner = it->second.lock()) {
      return MappedAllocation{owner, static_cast<const std::byte*>(owner.get())};
    }
    open.erase(it);
  }
  cuda_detail::ScopedDeviceNoThrow on(device);
  cudaIpcMemHandle_t ipc{};
  std::memcpy(&ipc, handle.data(), sizeof(ipc));
  void* base = nullptr;
  const cudaError_t status = cudaIpcOpenMemHandle(&base, ipc, cudaIpcMemLazyEnablePeerAccess);
  if (status != cudaSuccess) {
    cuda_detail::clear_last_error();
    throw Error(ErrorCode::kTransport,
                fmt::format("same-host pull: {}'s shards ({} bytes) could not be mapped on GPU {} "
                            "to read them in place: cudaIpcOpenMemHandle: {}",
                            peer, bytes, device, cudaGetErrorName(status)));
  }
  std::shared_ptr<void> owner(base, [device](void* p) {
    std::lock_guard close_lock(mutex);
    cuda_detail::ScopedDeviceNoThrow on(device);
    (void)cudaIpcCloseMemHandle(p);
  });
  open[key] = owner;
  return MappedAllocation{owner, static_cast<const std::byte*>(base)};
}

}  // namespace shadowsync::same_host
