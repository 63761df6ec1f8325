#include "transports/same_host/same_host_wait_kernel.h"

namespace shadowsync::same_host {
namespace {

__global__ void wait_until_kernel(const volatile std::uint32_t* counter, std::uint32_t value) {
  // Every read crosses to host memory (volatile: never cached); a short sleep between reads
  // keeps the bus quiet while the peer takes its time.
  while (static_cast<std::int32_t>(*counter - value) < 0) __nanosleep(500);
}

}  // namespace

cudaError_t launch_wait_until(const std::uint32_t* counter, std::uint32_t value,
                              cudaStream_t stream) {
  wait_until_kernel<<<1, 1, 0, stream>>>(counter, value);
  return cudaGetLastError();
}

}  // namespace shadowsync::same_host
