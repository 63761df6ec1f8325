// Internal to the CUDA backend and the NCCL transport: a guard that makes a device current. Not
// installed.
#pragma once

#include <cuda_runtime_api.h>

#include "backends/cuda/cuda_check.h"

namespace shadowsync::cuda_detail {

// Makes `device` current for the lifetime of the guard and restores the caller's device after.
// For calls that may run on any thread (destructors, abort), which must not leave that thread on
// another device. Errors are swallowed: there is nobody to report them to.
class ScopedDeviceNoThrow {
 public:
  explicit ScopedDeviceNoThrow(int device) noexcept {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device) (void)cudaSetDevice(device);
    clear_last_error();
  }
  ~ScopedDeviceNoThrow() {
    if (previous_ >= 0) (void)cudaSetDevice(previous_);
    clear_last_error();
  }
  ScopedDeviceNoThrow(const ScopedDeviceNoThrow&) = delete;
  ScopedDeviceNoThrow& operator=(const ScopedDeviceNoThrow&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace shadowsync::cuda_detail
