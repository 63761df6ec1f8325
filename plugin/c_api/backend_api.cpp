// Backends and streams through the C ABI.
#include <fmt/format.h>

#include "c_api/c_api_internal.h"
#include "shadowsync/host_backend.h"
#if defined(SHADOWSYNC_WITH_CUDA)
#include "shadowsync/cuda_backend.h"
#endif

using namespace shadowsync;
using namespace shadowsync::c_api;

extern "C" {

shadowsync_status_t shadowsync_host_backend_create(shadowsync_backend_t* backend) {
  return guard(__func__, [&] {
    auto& out = out_arg(backend, "backend");
    auto object = std::make_shared<BackendObject>();
    object->backend = std::make_unique<HostBackend>();
    out = to_handle<shadowsync_backend_t>(std::move(object));
  });
}

shadowsync_status_t shadowsync_cuda_backend_create(int device, shadowsync_backend_t* backend) {
  return guard(__func__, [&] {
    auto& out = out_arg(backend, "backend");
#if defined(SHADOWSYNC_WITH_CUDA)
    auto object = std::make_shared<BackendObject>();
    object->backend = std::make_unique<CudaBackend>(device);
    object->cuda = true;
    object->device = device;
    out = to_handle<shadowsync_backend_t>(std::move(object));
#else
    (void)out;
    throw_not_supported(fmt::format("CUDA backend of device {}: this library was built without "
                                    "CUDA (SHADOWSYNC_WITH_CUDA)",
                                    device));
#endif
  });
}

shadowsync_status_t shadowsync_backend_destroy(shadowsync_backend_t backend) {
  return guard(__func__, [&] { Registry::instance().remove<BackendObject>(backend, "backend"); });
}

shadowsync_status_t shadowsync_backend_name(shadowsync_backend_t backend, const char** name) {
  return guard(__func__, [&] {
    auto object = lookup<BackendObject>(backend, "backend");
    // Both backends return a literal.
    out_arg(name, "name") = object->backend->name().data();
  });
}

shadowsync_status_t shadowsync_stream_create(shadowsync_backend_t backend, int low_priority,
                                             shadowsync_stream_t* stream) {
  return guard(__func__, [&] {
    auto& out = out_arg(stream, "stream");
    auto object = std::make_shared<StreamObject>();
    object->backend = lookup<BackendObject>(backend, "backend");
    object->stream = object->backend->backend->create_stream(
        low_priority != 0 ? StreamPriority::kLow : StreamPriority::kNormal);
    out = to_handle<shadowsync_stream_t>(std::move(object));
  });
}

shadowsync_status_t shadowsync_stream_wrap_cuda(shadowsync_backend_t backend, void* cuda_stream,
                                                shadowsync_stream_t* stream) {
  return guard(__func__, [&] {
    auto& out = out_arg(stream, "stream");
    auto backend_object = lookup<BackendObject>(backend, "backend");
#if defined(SHADOWSYNC_WITH_CUDA)
    if (!backend_object->cuda) {
      throw_not_supported(fmt::format("wrapping a CUDA stream needs a CUDA backend, not '{}'",
                                      backend_object->backend->name()));
    }
    auto object = std::make_shared<StreamObject>();
    object->backend = backend_object;
    object->stream = static_cast<CudaBackend&>(*backend_object->backend)
                         .wrap_stream(static_cast<CudaStreamHandle>(cuda_stream));
    out = to_handle<shadowsync_stream_t>(std::move(object));
#else
    (void)out;
    (void)cuda_stream;
    throw_not_supported(fmt::format("wrapping a CUDA stream on backend '{}': this library was "
                                    "built without CUDA",
                                    backend_object->backend->name()));
#endif
  });
}

shadowsync_status_t shadowsync_stream_synchronize(shadowsync_stream_t stream) {
  return guard(__func__, [&] {
    auto object = lookup<StreamObject>(stream, "stream");
    object->backend->backend->stream_synchronize(*object->stream);
  });
}

shadowsync_status_t shadowsync_stream_destroy(shadowsync_stream_t stream) {
  return guard(__func__, [&] { Registry::instance().remove<StreamObject>(stream, "stream"); });
}

}  // extern "C"
