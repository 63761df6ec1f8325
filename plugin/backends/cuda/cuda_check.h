// Internal to the CUDA backend, the NCCL transport and kernels: checking CUDA runtime calls. Not
// installed.
//
//   SHADOWSYNC_CUDA_CHECK(cudaMalloc(&ptr, bytes), "bytes={} device={}", bytes, device);
//
// throws Error(kBackend) with a message such as
//   cudaMalloc(&ptr, bytes) failed (bytes=1073741824 device=0): cudaErrorMemoryAllocation: out
//   of memory [cuda_backend.cpp:57]
//
// The format string and its arguments describe the call's key arguments; pass "" when there are
// none worth naming.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include <fmt/format.h>

#include "shadowsync/error.h"

namespace shadowsync::cuda_detail {

// Strips the directory from __FILE__: a breadcrumb needs the file, not the build machine's path.
constexpr const char* base_name(const char* path) noexcept {
  const char* base = path;
  for (const char* p = path; *p != '\0'; ++p) {
    if (*p == '/' || *p == '\\') base = p + 1;
  }
  return base;
}

// Clears the runtime's per-thread last error. A failing call also records its error there, and
// code that checks cudaGetLastError() after its own kernel launches (PyTorch does) would otherwise
// blame itself for our failure. A sticky error (cudaErrorIllegalAddress and the like) corrupts
// the context for good; clearing the last error does not undo that, and later calls keep failing.
inline void clear_last_error() noexcept { (void)cudaGetLastError(); }

[[noreturn]] inline void throw_cuda_error(cudaError_t status, const char* call,
                                          const std::string& context, const char* file, int line) {
  clear_last_error();
  throw Error(ErrorCode::kBackend,
              fmt::format("{} failed{}{}{}: {}: {} [{}:{}]", call, context.empty() ? "" : " (",
                          context, context.empty() ? "" : ")", cudaGetErrorName(status),
                          cudaGetErrorString(status), base_name(file), line));
}

}  // namespace shadowsync::cuda_detail

// Evaluates `call` once; on anything but cudaSuccess throws Error(kBackend) naming the call, the
// formatted context and CUDA's error name and string, after clearing the last error.
#define SHADOWSYNC_CUDA_CHECK(call, ...)                                                           \
  do {                                                                                             \
    const cudaError_t shadowsync_cuda_status_ = (call);                                            \
    if (shadowsync_cuda_status_ != cudaSuccess) {                                                  \
      ::shadowsync::cuda_detail::throw_cuda_error(shadowsync_cuda_status_, #call,                  \
                                                  ::fmt::format(__VA_ARGS__), __FILE__, __LINE__); \
    }                                                                                              \
  } while (0)
