// Status strings, the thread's last error, and what the library was built with.
#include <fmt/format.h>

#include <string>

#include "c_api/c_api_internal.h"
#include "shadowsync/dtype.h"

namespace shadowsync::c_api {
namespace {

// Detail of the last failure on this thread; never cleared by a success (as ncclGetLastError).
thread_local std::string t_last_error;

// The C enum mirrors ErrorCode value for value: the boundary converts by a cast.
static_assert(SHADOWSYNC_INVALID_ARGUMENT == static_cast<int>(ErrorCode::kInvalidArgument));
static_assert(SHADOWSYNC_LAYOUT_MISMATCH == static_cast<int>(ErrorCode::kLayoutMismatch));
static_assert(SHADOWSYNC_BAD_HEADER == static_cast<int>(ErrorCode::kBadHeader));
static_assert(SHADOWSYNC_STALE_VERSION == static_cast<int>(ErrorCode::kStaleVersion));
static_assert(SHADOWSYNC_TIMEOUT == static_cast<int>(ErrorCode::kTimeout));
static_assert(SHADOWSYNC_TRANSPORT_ERROR == static_cast<int>(ErrorCode::kTransport));
static_assert(SHADOWSYNC_BACKEND_ERROR == static_cast<int>(ErrorCode::kBackend));
static_assert(SHADOWSYNC_SHUTDOWN == static_cast<int>(ErrorCode::kShutdown));
static_assert(SHADOWSYNC_SUPERSEDED == static_cast<int>(ErrorCode::kSuperseded));
static_assert(SHADOWSYNC_INTERNAL_ERROR == static_cast<int>(ErrorCode::kInternal));

}  // namespace

shadowsync_status_t fail(shadowsync_status_t status, const char* function,
                         const std::string& message) noexcept {
  try {
    t_last_error = fmt::format("{}: {}", function, message);
  } catch (...) {  // out of memory formatting the message: keep the status
    t_last_error.clear();
  }
  return status;
}

}  // namespace shadowsync::c_api

using namespace shadowsync;
using namespace shadowsync::c_api;

extern "C" {

const char* shadowsync_get_error_string(shadowsync_status_t status) {
  switch (status) {
    case SHADOWSYNC_SUCCESS: return "no error";
    case SHADOWSYNC_INVALID_ARGUMENT:
      return "invalid argument (shadowsync_get_last_error() names the argument and its value)";
    case SHADOWSYNC_LAYOUT_MISMATCH:
      return "layout mismatch: sender and receiver built different layouts (compare tensor "
             "names, dtypes, shapes, order and bucket size on both sides)";
    case SHADOWSYNC_BAD_HEADER:
      return "bad update header (corrupt bytes, or a peer of another protocol version)";
    case SHADOWSYNC_STALE_VERSION:
      return "stale version: versions must strictly increase (after a restart continue above "
             "the last accepted one)";
    case SHADOWSYNC_TIMEOUT:
      return "timeout: a deadline passed (is every rank taking part? see the deadlines in the "
             "config)";
    case SHADOWSYNC_TRANSPORT_ERROR:
      return "transport error: a peer was lost or the communicator aborted (install a new "
             "transport; with NCCL set NCCL_DEBUG=INFO)";
    case SHADOWSYNC_BACKEND_ERROR:
      return "backend error: the device failed (out of memory? see shadowsync_get_last_error())";
    case SHADOWSYNC_SHUTDOWN: return "the object is shutting down";
    case SHADOWSYNC_SUPERSEDED: return "superseded by a newer update before it was applied";
    case SHADOWSYNC_INTERNAL_ERROR:
      return "internal error: a bug in shadowsync, please report it with "
             "shadowsync_get_last_error()";
    case SHADOWSYNC_INVALID_HANDLE:
      return "invalid handle: NULL, already destroyed, or a handle of another kind";
    case SHADOWSYNC_NOT_SUPPORTED:
      return "not supported by this build or backend (CUDA/NCCL need a library built with "
             "SHADOWSYNC_WITH_CUDA)";
    case SHADOWSYNC_IN_PROGRESS: return "in progress: not done yet, poll again";
    case SHADOWSYNC_NUM_RESULTS: break;
  }
  return "unknown status (not a shadowsync_status_t)";
}

const char* shadowsync_get_last_error(void) { return t_last_error.c_str(); }

int shadowsync_get_c_api_version(void) { return SHADOWSYNC_C_API_VERSION; }

int shadowsync_has_cuda(void) {
#if defined(SHADOWSYNC_WITH_CUDA)
  return 1;
#else
  return 0;
#endif
}

shadowsync_status_t shadowsync_dtype_info(const char* dtype, const char** canonical,
                                          size_t* element_bytes) {
  return guard(__func__, [&] {
    const DType parsed = dtype_from_string(string_arg(dtype, "dtype"));
    if (canonical != nullptr) *canonical = dtype_name(parsed).data();
    if (element_bytes != nullptr) *element_bytes = dtype_size(parsed);
  });
}

}  // extern "C"
