// Internal to the CUDA backend and the transports built on it: the CUDA driver API entry points
// the library calls (virtual memory management, exporting memory to a file descriptor and
// importing it, error names, device attributes, waiting on a memory word from a stream, the
// allocation an address lies in). They are looked up once through
// cudaGetDriverEntryPointByVersion, so nothing links libcuda directly: CPU-only machines load the
// library and skip GPU work. Not installed.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <string>

namespace shadowsync::cuda_detail {

// The CUDA 12.0 ABI of each entry point.
struct DriverApi {
  PFN_cuMemGetAllocationGranularity_v10020 granularity = nullptr;
  PFN_cuMemAddressReserve_v10020 reserve = nullptr;
  PFN_cuMemAddressFree_v10020 free_range = nullptr;
  PFN_cuMemCreate_v10020 create = nullptr;
  PFN_cuMemRelease_v10020 release = nullptr;
  PFN_cuMemMap_v10020 map = nullptr;
  PFN_cuMemUnmap_v10020 unmap = nullptr;
  PFN_cuMemSetAccess_v10020 set_access = nullptr;
  PFN_cuMemExportToShareableHandle_v10020 export_handle = nullptr;
  PFN_cuMemImportFromShareableHandle_v10020 import_handle = nullptr;
  PFN_cuGetErrorName_v6000 error_name = nullptr;
  PFN_cuDeviceGet_v2000 device_get = nullptr;
  PFN_cuDeviceGetAttribute_v2000 device_attribute = nullptr;
  PFN_cuStreamWaitValue32_v11070 stream_wait_value32 = nullptr;
  PFN_cuMemGetAddressRange_v3020 address_range = nullptr;
  PFN_cuPointerGetAttribute_v4000 pointer_attribute = nullptr;
  std::string missing;  // the first entry point not found, if any
};

// Looked up on first use; never throws (a missing entry point is named in `missing`).
const DriverApi& driver_api();

// Throws Error(kBackend) naming the driver call, its arguments and the driver's error name.
void check_driver(CUresult result, const char* call, const std::string& arguments);

}  // namespace shadowsync::cuda_detail
