#include "backends/cuda/cuda_driver.h"

#include <cuda_runtime_api.h>

#include <fmt/format.h>

#include "backends/cuda/cuda_check.h"
#include "shadowsync/error.h"

namespace shadowsync::cuda_detail {
namespace {

template <typename Fn>
void look_up(const char* symbol, Fn& fn, std::string& missing) {
  void* address = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t status =
      cudaGetDriverEntryPointByVersion(symbol, &address, 12000, cudaEnableDefault, &found);
  if (status != cudaSuccess || found != cudaDriverEntryPointSuccess || address == nullptr) {
    clear_last_error();
    if (missing.empty()) {
      missing = fmt::format("driver entry point {} not found ({})", symbol,
                            status != cudaSuccess ? cudaGetErrorName(status) : "symbol not found");
    }
    return;
  }
  fn = reinterpret_cast<Fn>(address);
}

}  // namespace

const DriverApi& driver_api() {
  static const DriverApi api = [] {
    DriverApi d;
    look_up("cuMemGetAllocationGranularity", d.granularity, d.missing);
    look_up("cuMemAddressReserve", d.reserve, d.missing);
    look_up("cuMemAddressFree", d.free_range, d.missing);
    look_up("cuMemCreate", d.create, d.missing);
    look_up("cuMemRelease", d.release, d.missing);
    look_up("cuMemMap", d.map, d.missing);
    look_up("cuMemUnmap", d.unmap, d.missing);
    look_up("cuMemSetAccess", d.set_access, d.missing);
    look_up("cuMemExportToShareableHandle", d.export_handle, d.missing);
    look_up("cuMemImportFromShareableHandle", d.import_handle, d.missing);
    look_up("cuGetErrorName", d.error_name, d.missing);
    look_up("cuDeviceGet", d.device_get, d.missing);
    look_up("cuDeviceGetAttribute", d.device_attribute, d.missing);
    look_up("cuStreamWaitValue32", d.stream_wait_value32, d.missing);
    look_up("cuMemGetAddressRange", d.address_range, d.missing);
    look_up("cuPointerGetAttribute", d.pointer_attribute, d.missing);
    return d;
  }();
  return api;
}

void check_driver(CUresult result, const char* call, const std::string& arguments) {
  if (result == CUDA_SUCCESS) return;
  const char* name = nullptr;
  if (driver_api().error_name == nullptr || driver_api().error_name(result, &name) != CUDA_SUCCESS) {
    name = nullptr;
  }
  throw Error(ErrorCode::kBackend,
              fmt::format("{} failed ({}): {} ({})", call, arguments,
                          name != nullptr ? name : "unknown CUresult", static_cast<int>(result)));
}

}  // namespace shadowsync::cuda_detail
