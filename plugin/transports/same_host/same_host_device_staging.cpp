// The same-host transport's device staging: an exportable cuMem allocation and its mappings.
// See same_host_device_staging.h.
#include "transports/same_host/same_host_device_staging.h"

#include <cuda_runtime_api.h>

#include <cstring>

#include <fmt/format.h>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_driver.h"
#include "backends/cuda/scoped_device.h"
#include "shadowsync/error.h"

namespace shadowsync::same_host {

using cuda_detail::check_driver;
using cuda_detail::driver_api;
using cuda_detail::DriverApi;

namespace {

constexpr std::size_t kUuidBytes = 16;

std::string uuid_text(const std::array<std::byte, kUuidBytes>& uuid) {
  std::string text = "GPU-";
  for (std::size_t i = 0; i < uuid.size(); ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) text += '-';
    text += fmt::format("{:02x}", static_cast<unsigned>(uuid[i]));
  }
  return text;
}

std::array<std::byte, kUuidBytes> device_uuid(int device) {
  cudaDeviceProp prop{};
  SHADOWSYNC_CUDA_CHECK(cudaGetDeviceProperties(&prop, device), "device={}", device);
  std::array<std::byte, kUuidBytes> uuid{};
  std::memcpy(uuid.data(), prop.uuid.bytes, kUuidBytes);
  return uuid;
}


void require_driver(const char* side) {
  if (const std::string& missing = driver_api().missing; !missing.empty()) {
    throw Error(ErrorCode::kBackend,
                fmt::format("same-host {}: device memory needs the CUDA driver API: {}", side,
                            missing));
  }
}

CUmemAllocationProp exportable_allocation(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

CUmemAccessDesc read_write(int device) {
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return access;
}

// The handle bytes of the setup record: allocation size (u64 little-endian), then the UUID of
// the GPU that holds the staging.
std::array<std::byte, kHandleBytes> encode_handle(std::uint64_t allocation_bytes,
                                                  const std::array<std::byte, kUuidBytes>& uuid) {
  std::array<std::byte, kHandleBytes> out{};
  for (int i = 0; i < 8; ++i) out[i] = static_cast<std::byte>((allocation_bytes >> (8 * i)) & 0xff);
  std::memcpy(out.data() + 8, uuid.data(), kUuidBytes);
  return out;
}

}  // namespace

CudaBackend& cuda_backend_of(Backend& backend, const char* side) {
  auto* cuda = dynamic_cast<CudaBackend*>(&backend);
  if (cuda == nullptr) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("same-host {}: device memory needs a CudaBackend, got the '{}' "
                            "backend",
                            side, backend.name()));
  }
  return *cuda;
}

std::unique_ptr<DeviceStaging> DeviceStaging::create(Backend& backend, std::size_t slot_bytes) {
  CudaBackend& cuda = cuda_backend_of(backend, "serve");
  require_driver("serve");
  std::unique_ptr<DeviceStaging> staging(new DeviceStaging);
  staging->device_ = cuda.device();
  staging->slot_bytes_ = slot_bytes;
  const int device = staging->device_;
  SHADOWSYNC_CUDA_CHECK(cudaSetDevice(device), "device={}", device);
  const DriverApi& d = driver_api();
  CUdevice handle = 0;
  int posix_fd = 0;
  check_driver(d.device_get(&handle, device), "cuDeviceGet", fmt::format("ordinal={}", device));
  check_driver(d.device_attribute(&posix_fd,
                                  CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                                  handle),
               "cuDeviceGetAttribute", "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED");
  if (posix_fd == 0) {
    throw Error(ErrorCode::kBackend,
                fmt::format("same-host serve: device {} cannot export memory as a POSIX file "
                            "descriptor (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_"
                            "SUPPORTED is 0); use SameHostMemory::kHost",
                            device));
  }
  staging->uuid_ = device_uuid(device);
  const CUmemAllocationProp prop = exportable_allocation(device);
  std::size_t granularity = 0;
  check_driver(d.granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
               "cuMemGetAllocationGranularity", fmt::format("device={}", device));
  const std::size_t wanted = kSlotCount * slot_bytes;
  staging->allocation_bytes_ = (wanted + granularity - 1) / granularity * granularity;
  check_driver(d.create(&staging->allocation_, staging->allocation_bytes_, &prop, 0), "cuMemCreate",
               fmt::format("size={} device={} exportable as a POSIX fd", staging->allocation_bytes_,
                           device));
  check_driver(d.reserve(&staging->base_, staging->allocation_bytes_, granularity, 0, 0),
               "cuMemAddressReserve", fmt::format("size={}", staging->allocation_bytes_));
  check_driver(d.map(staging->base_, staging->allocation_bytes_, 0, staging->allocation_, 0), "cuMemMap",
               fmt::format("size={}", staging->allocation_bytes_));
  staging->mapped_ = true;
  const CUmemAccessDesc access = read_write(device);
  check_driver(d.set_access(staging->base_, staging->allocation_bytes_, &access, 1), "cuMemSetAccess",
               fmt::format("size={} device={}", staging->allocation_bytes_, device));
  int fd = -1;
  check_driver(d.export_handle(&fd, staging->allocation_, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
               "cuMemExportToShareableHandle", "POSIX file descriptor");
  staging->exported_ = Fd(fd);
  return staging;
}

std::unique_ptr<DeviceStaging> DeviceStaging::open(Backend& backend, Fd exported,
                                                   const Setup& setup, const std::string& path) {
  CudaBackend& cuda = cuda_backend_of(backend, "connect");
  require_driver("connect");
  std::unique_ptr<DeviceStaging> staging(new DeviceStaging);
  staging->device_ = cuda.device();
  staging->slot_bytes_ = static_cast<std::size_t>(setup.slot_bytes);
  std::uint64_t allocation_bytes = 0;
  for (int i = 0; i < 8; ++i) {
    allocation_bytes |= std::uint64_t{static_cast<std::uint8_t>(setup.handle[i])} << (8 * i);
  }
  std::memcpy(staging->uuid_.data(), setup.handle.data() + 8, kUuidBytes);
  if (allocation_bytes < kSlotCount * setup.slot_bytes || allocation_bytes > (std::uint64_t{1} << 40)) {
    throw Error(ErrorCode::kTransport,
                fmt::format("same-host connect to '{}': the sender's device staging is {} bytes, "
                            "but 2 slots of {} bytes were announced",
                            path, allocation_bytes, setup.slot_bytes));
  }
  staging->allocation_bytes_ = static_cast<std::size_t>(allocation_bytes);
  const int device = staging->device_;
  SHADOWSYNC_CUDA_CHECK(cudaSetDevice(device), "device={}", device);
  const std::array<std::byte, kUuidBytes> own = device_uuid(device);
  const std::string where =
      fmt::format("the staging lives on {} (the sender's GPU); this receiver is device {} ({})",
                  uuid_text(staging->uuid_), device, uuid_text(own));
  const DriverApi& d = driver_api();
  const auto failed = [&](const char* what, CUresult result) {
    const char* name = nullptr;
    if (d.error_name == nullptr || d.error_name(result, &name) != CUDA_SUCCESS) name = nullptr;
    return Error(ErrorCode::kTransport,
                 fmt::format("same-host connect to '{}': could not open the sender's device "
                             "staging: {} failed ({}); {}{}",
                             path, what, name != nullptr ? name : "unknown CUresult", where,
                             own == staging->uuid_ ? ""
                                               : "; a copy across GPUs needs peer access "
                                                 "between them"));
  };
  if (!exported) {
    throw Error(ErrorCode::kTransport,
                fmt::format("same-host connect to '{}': the sender's setup carried no file "
                            "descriptor (SCM_RIGHTS) for its device staging",
                            path));
  }
  CUresult result = d.import_handle(
      &staging->allocation_, reinterpret_cast<void*>(static_cast<std::uintptr_t>(exported.get())),
      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  if (result != CUDA_SUCCESS) {
    staging->allocation_ = 0;
    throw failed("cuMemImportFromShareableHandle(POSIX file descriptor)", result);
  }
  exported = Fd();  // the imported handle keeps the memory; the descriptor is done with
  const CUmemAllocationProp prop = exportable_allocation(device);
  std::size_t granularity = 0;
  check_driver(d.granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
               "cuMemGetAllocationGranularity", fmt::format("device={}", device));
  if ((result = d.reserve(&staging->base_, staging->allocation_bytes_, granularity, 0, 0)) !=
      CUDA_SUCCESS) {
    staging->base_ = 0;
    throw failed("cuMemAddressReserve", result);
  }
  if ((result = d.map(staging->base_, staging->allocation_bytes_, 0, staging->allocation_, 0)) !=
      CUDA_SUCCESS) {
    throw failed("cuMemMap", result);
  }
  staging->mapped_ = true;
  const CUmemAccessDesc access = read_write(device);
  if ((result = d.set_access(staging->base_, staging->allocation_bytes_, &access, 1)) != CUDA_SUCCESS) {
    throw failed("cuMemSetAccess(read-write for this device)", result);
  }
  return staging;
}

DeviceStaging::~DeviceStaging() {
  cuda_detail::ScopedDeviceNoThrow on_device(device_);
  const DriverApi& d = driver_api();
  if (mapped_) (void)d.unmap(base_, allocation_bytes_);
  if (base_ != 0) (void)d.free_range(base_, allocation_bytes_);
  if (allocation_ != 0) (void)d.release(allocation_);
}

std::array<std::byte, kHandleBytes> DeviceStaging::handle() const {
  return encode_handle(allocation_bytes_, uuid_);
}

}  // namespace shadowsync::same_host
