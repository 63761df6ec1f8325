// Transports through the C ABI: loopback (tests, demos) and NCCL.
#include <fmt/format.h>

#include <array>

#include "c_api/c_api_internal.h"
#if defined(SHADOWSYNC_WITH_CUDA)
#include "shadowsync/nccl_transport.h"
#endif

using namespace shadowsync;
using namespace shadowsync::c_api;

namespace {

// What a receiver or sender owns: the transport of a handle, shared with the registry until the
// call that takes it succeeded (so that a failed call leaves the caller's handle intact).
class SharedTransport final : public Transport {
 public:
  explicit SharedTransport(std::shared_ptr<Transport> inner) : inner_(std::move(inner)) {}
  std::string_view name() const override { return inner_->name(); }
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  void broadcast_async(void* buffer, std::size_t bytes, int root, Stream& stream) override {
    inner_->broadcast_async(buffer, bytes, root, stream);
  }
  void group_begin() override { inner_->group_begin(); }
  void group_end() override { inner_->group_end(); }
  std::optional<std::string> async_error() override { return inner_->async_error(); }
  void abort() noexcept override { inner_->abort(); }

 private:
  std::shared_ptr<Transport> inner_;
};

shadowsync_transport_t add_transport(std::unique_ptr<Transport> transport) {
  auto object = std::make_shared<TransportObject>();
  object->transport = std::move(transport);
  return to_handle<shadowsync_transport_t>(std::move(object));
}

}  // namespace

namespace shadowsync::c_api {

TransportClaim::TransportClaim(shadowsync_transport_t handle, bool allow_null) : handle_(handle) {
  if (handle == nullptr && allow_null) return;
  auto object = lookup<TransportObject>(handle, "transport");
  if (object->claimed.exchange(true)) {
    throw StatusError(SHADOWSYNC_INVALID_HANDLE,
                      fmt::format("'transport' ({}) is being given to another receiver or sender "
                                  "at this moment",
                                  static_cast<const void*>(handle)));
  }
  object_ = std::move(object);
}

TransportClaim::~TransportClaim() {
  if (object_ && !committed_) object_->claimed.store(false);
}

std::unique_ptr<Transport> TransportClaim::take() {
  if (!object_) return nullptr;
  return std::make_unique<SharedTransport>(object_->transport);
}

void TransportClaim::commit() noexcept {
  if (!object_) return;
  committed_ = true;
  try {
    Registry::instance().remove<TransportObject>(handle_, "transport");
  } catch (...) {  // destroyed by another thread meanwhile: the receiver owns it all the same
  }
}

}  // namespace shadowsync::c_api

extern "C" {

shadowsync_status_t shadowsync_loopback_create(int world_size, shadowsync_loopback_t* loopback) {
  return guard(__func__, [&] {
    auto& out = out_arg(loopback, "loopback");
    out = to_handle<shadowsync_loopback_t>(std::make_shared<LoopbackObject>(world_size));
  });
}

shadowsync_status_t shadowsync_loopback_transport(shadowsync_loopback_t loopback, int rank,
                                                  shadowsync_transport_t* transport) {
  return guard(__func__, [&] {
    auto& out = out_arg(transport, "transport");
    auto object = lookup<LoopbackObject>(loopback, "loopback");
    out = add_transport(object->communicator.transport(rank));
  });
}

shadowsync_status_t shadowsync_loopback_destroy(shadowsync_loopback_t loopback) {
  return guard(__func__,
               [&] { Registry::instance().remove<LoopbackObject>(loopback, "loopback"); });
}

shadowsync_status_t shadowsync_nccl_unique_id(uint8_t id[SHADOWSYNC_NCCL_UNIQUE_ID_BYTES]) {
  return guard(__func__, [&] {
    if (id == nullptr) throw_invalid("output argument 'id' is NULL");
#if defined(SHADOWSYNC_WITH_CUDA)
    static_assert(NcclUniqueId::kSize == SHADOWSYNC_NCCL_UNIQUE_ID_BYTES);
    const NcclUniqueId unique = NcclTransport::generate_unique_id();
    std::memcpy(id, unique.bytes.data(), unique.bytes.size());
#else
    throw_not_supported("NCCL unique id: this library was built without CUDA/NCCL");
#endif
  });
}

shadowsync_status_t shadowsync_nccl_transport_create(
    const uint8_t id[SHADOWSYNC_NCCL_UNIQUE_ID_BYTES], int rank, int world_size, int device,
    const shadowsync_nccl_config_t* config, shadowsync_transport_t* transport) {
  return guard(__func__, [&] {
    auto& out = out_arg(transport, "transport");
    if (id == nullptr) throw_invalid("'id' is NULL");
    shadowsync_nccl_config_t defaults = SHADOWSYNC_NCCL_CONFIG_INITIALIZER;
    const shadowsync_nccl_config_t c = read_config(config, defaults, "shadowsync_nccl_config_t");
#if defined(SHADOWSYNC_WITH_CUDA)
    NcclTransportConfig cpp;
    cpp.max_ctas = read_int(c.max_ctas, cpp.max_ctas);
    cpp.min_ctas = read_int(c.min_ctas, cpp.min_ctas);
    cpp.cga_cluster_size = read_int(c.cga_cluster_size, cpp.cga_cluster_size);
    cpp.init_timeout = read_int64(c.init_timeout_ms, cpp.init_timeout);
    cpp.enqueue_timeout = read_int64(c.enqueue_timeout_ms, cpp.enqueue_timeout);
    cpp.finalize_timeout = read_int64(c.finalize_timeout_ms, cpp.finalize_timeout);
    NcclUniqueId unique;
    std::memcpy(unique.bytes.data(), id, unique.bytes.size());
    out = add_transport(NcclTransport::create(unique, rank, world_size, device, cpp));
#else
    (void)c;
    (void)out;
    throw_not_supported(fmt::format("NCCL transport (rank {} of {}, device {}): this library was "
                                    "built without CUDA/NCCL",
                                    rank, world_size, device));
#endif
  });
}

shadowsync_status_t shadowsync_nccl_library(char* path, size_t path_size, int32_t* version) {
  return guard(__func__, [&] {
#if defined(SHADOWSYNC_WITH_CUDA)
    const NcclLibraryInfo library = NcclTransport::library();
    if (path != nullptr) {
      if (path_size < library.path.size() + 1) {
        throw_invalid(
            fmt::format("path_size {} is too small for the NCCL library's path {} ({} "
                        "bytes with its NUL)",
                        path_size, library.path, library.path.size() + 1));
      }
      std::memcpy(path, library.path.c_str(), library.path.size() + 1);
    }
    if (version != nullptr) *version = library.version;
#else
    (void)path;
    (void)path_size;
    (void)version;
    throw_not_supported("NCCL library: this library was built without CUDA/NCCL");
#endif
  });
}

shadowsync_status_t shadowsync_nccl_add_python_path(const char* paths) {
  return guard(__func__, [&] {
    if (paths == nullptr) throw_invalid("paths is NULL");
#if defined(SHADOWSYNC_WITH_CUDA)
    NcclTransport::add_python_path(paths);
#else
    throw_not_supported("NCCL search path: this library was built without CUDA/NCCL");
#endif
  });
}

shadowsync_status_t shadowsync_transport_destroy(shadowsync_transport_t transport) {
  return guard(__func__,
               [&] { Registry::instance().remove<TransportObject>(transport, "transport"); });
}

}  // extern "C"
