#include "backends/cuda/vmm_slots.h"


#include <fmt/format.h>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_driver.h"
#include "shadowsync/error.h"

namespace shadowsync::cuda_detail {
namespace {

CUmemAllocationProp device_allocation(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

CUmemAccessDesc read_write(int device) {
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return access;
}

}  // namespace

std::string VmmSlots::unsupported_reason(int device) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || device < 0 || device >= count) {
    clear_last_error();
    return fmt::format("no CUDA device {} (this process sees {})", device, count);
  }
  const DriverApi& d = driver_api();
  if (!d.missing.empty()) return d.missing;
  // The runtime initializes the driver; the driver's ordinals are the runtime's.
  if (cudaFree(nullptr) != cudaSuccess) {
    clear_last_error();
    return fmt::format("device {}: the CUDA runtime failed to initialize", device);
  }
  CUdevice handle = 0;
  int supported = 0;
  if (d.device_get(&handle, device) != CUDA_SUCCESS ||
      d.device_attribute(&supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                         handle) != CUDA_SUCCESS) {
    return fmt::format("device {}: cannot query virtual memory management support", device);
  }
  if (supported == 0) {
    return fmt::format("device {} (or its driver) does not support CUDA virtual memory management",
                       device);
  }
  return {};
}

VmmSlots::VmmSlots(int device, std::size_t bytes, int slot_count)
    : device_(device), requested_bytes_(bytes) {
  if (bytes == 0) {
    throw Error(ErrorCode::kInvalidArgument, "VMM slots: 0 bytes (at least 1 is needed)");
  }
  if (slot_count < 2) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("VMM slots: {} slots (a swap needs at least 2)", slot_count));
  }
  if (const std::string why = unsupported_reason(device); !why.empty()) {
    throw Error(ErrorCode::kBackend, "remap swap strategy unavailable: " + why);
  }
  // The driver calls act on the device's primary context: make it current on this thread.
  SHADOWSYNC_CUDA_CHECK(cudaSetDevice(device), "device={}", device);
  SHADOWSYNC_CUDA_CHECK(cudaFree(nullptr), "device={} (context initialization)", device);

  const DriverApi& d = driver_api();
  const CUmemAllocationProp prop = device_allocation(device);
  std::size_t granularity = 0;
  check_driver(d.granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
        "cuMemGetAllocationGranularity", fmt::format("device={} recommended", device));
  granularity_ = granularity;
  mapped_bytes_ = (bytes + granularity - 1) / granularity * granularity;

  const CUmemAccessDesc access = read_write(device);
  try {
    CUdeviceptr live = 0;
    check_driver(d.reserve(&live, mapped_bytes_, granularity_, 0, 0), "cuMemAddressReserve",
          fmt::format("size={} alignment={}", mapped_bytes_, granularity_));
    live_ = live;
    for (int i = 0; i < slot_count; ++i) {
      CUmemGenericAllocationHandle handle = 0;
      check_driver(d.create(&handle, mapped_bytes_, &prop, 0), "cuMemCreate",
            fmt::format("slot={} size={} device={}", i, mapped_bytes_, device));
      slots_.push_back(handle);
      CUdeviceptr own = 0;
      check_driver(d.reserve(&own, mapped_bytes_, granularity_, 0, 0), "cuMemAddressReserve",
            fmt::format("slot={} size={} alignment={}", i, mapped_bytes_, granularity_));
      slot_ranges_.push_back(own);
      check_driver(d.map(own, mapped_bytes_, 0, handle, 0), "cuMemMap",
            fmt::format("slot={} own range size={}", i, mapped_bytes_));
      check_driver(d.set_access(own, mapped_bytes_, &access, 1), "cuMemSetAccess",
            fmt::format("slot={} own range size={} device={}", i, mapped_bytes_, device));
    }
    check_driver(d.map(live_, mapped_bytes_, 0, slots_[0], 0), "cuMemMap",
          fmt::format("live range onto slot=0 size={}", mapped_bytes_));
    live_mapped_ = true;
    check_driver(d.set_access(live_, mapped_bytes_, &access, 1), "cuMemSetAccess",
          fmt::format("live range size={} device={}", mapped_bytes_, device));
    live_slot_ = 0;
  } catch (...) {
    release();
    throw;
  }
}

VmmSlots::~VmmSlots() { release(); }

void* VmmSlots::slot_address(int slot) const {
  if (slot < 0 || slot >= slot_count()) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("VMM slots: slot {} does not exist (there are {})", slot, slot_count()));
  }
  return reinterpret_cast<void*>(slot_ranges_[static_cast<std::size_t>(slot)]);
}

void VmmSlots::remap_live(int slot, cudaStream_t engine_stream, bool synchronize_first) {
  if (slot < 0 || slot >= slot_count()) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("VMM slots: cannot make slot {} live (there are {})", slot,
                            slot_count()));
  }
  if (live_slot_ < 0) {
    throw Error(ErrorCode::kBackend, "VMM slots: an earlier remap failed; the live range is gone");
  }
  if (slot == live_slot_) return;
  // Kernels still reading the live range must finish before its pages go away.
  if (synchronize_first) {
    SHADOWSYNC_CUDA_CHECK(cudaStreamSynchronize(engine_stream), "engine stream before a remap");
  }
  const DriverApi& d = driver_api();
  const CUmemAccessDesc access = read_write(device_);
  live_slot_ = -1;  // until the new mapping is complete
  check_driver(d.unmap(live_, mapped_bytes_), "cuMemUnmap",
        fmt::format("live range size={}", mapped_bytes_));
  live_mapped_ = false;
  check_driver(d.map(live_, mapped_bytes_, 0, slots_[static_cast<std::size_t>(slot)], 0), "cuMemMap",
        fmt::format("live range onto slot={} size={}", slot, mapped_bytes_));
  live_mapped_ = true;
  check_driver(d.set_access(live_, mapped_bytes_, &access, 1), "cuMemSetAccess",
        fmt::format("live range size={} device={}", mapped_bytes_, device_));
  live_slot_ = slot;
}

// Undoes whatever the constructor got to, in reverse; errors are ignored (nothing to report them
// to from a destructor, and the process keeps running).
void VmmSlots::release() noexcept {
  const DriverApi& d = driver_api();
  if (live_mapped_) (void)d.unmap(live_, mapped_bytes_);
  live_mapped_ = false;
  for (std::size_t i = 0; i < slot_ranges_.size(); ++i) {
    (void)d.unmap(slot_ranges_[i], mapped_bytes_);  // fails harmlessly if it was never mapped
    (void)d.free_range(slot_ranges_[i], mapped_bytes_);
  }
  slot_ranges_.clear();
  for (const auto handle : slots_) (void)d.release(handle);
  slots_.clear();
  if (live_ != 0) (void)d.free_range(live_, mapped_bytes_);
  live_ = 0;
  live_slot_ = -1;
}

}  // namespace shadowsync::cuda_detail
