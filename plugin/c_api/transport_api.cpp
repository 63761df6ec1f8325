// Transports through the C ABI: loopback (tests, demos), same-host and NCCL.
#include <fmt/format.h>

#include <array>
#include <chrono>
#include <cstring>
#include <string_view>

#include "c_api/c_api_internal.h"
#include "shadowsync/token.h"
#include "shadowsync/same_host_transport.h"
#include "transports/same_host/same_host_pull_transport.h"
#if defined(SHADOWSYNC_WITH_CUDA)
#include "shadowsync/nccl_transport.h"
#endif

using namespace shadowsync;
using namespace shadowsync::c_api;

namespace {

// A transport that forwards every call to a shared one, keeping `owner` alive as long as itself:
// what a receiver or sender gets from a handle (the transport shared with the registry until the
// call that takes it succeeded, so that a failed call leaves the caller's handle intact), and
// what a same-host transport is wrapped in (owner: the backend of the handle it was made with,
// so that the caller may destroy that handle whenever).
class ForwardingTransport final : public Transport {
 public:
  explicit ForwardingTransport(std::shared_ptr<Transport> inner,
                               std::shared_ptr<void> owner = nullptr)
      : owner_(std::move(owner)), inner_(std::move(inner)) {}
  std::string_view name() const override { return inner_->name(); }
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  void broadcast_async(void* buffer, std::size_t bytes, int root, Stream& stream) override {
    inner_->broadcast_async(buffer, bytes, root, stream);
  }
  void* staging_buffer(int index, std::size_t bytes) override {
    return inner_->staging_buffer(index, bytes);
  }
  void flush() override { inner_->flush(); }
  RouteMover* route_mover() override { return inner_->route_mover(); }
  void group_begin() override { inner_->group_begin(); }
  void group_end() override { inner_->group_end(); }
  std::optional<std::string> async_error() override { return inner_->async_error(); }
  std::optional<std::string> waiting_for() override { return inner_->waiting_for(); }
  void abort() noexcept override { inner_->abort(); }

 private:
  std::shared_ptr<void> owner_;  // first: outlives the transport
  std::shared_ptr<Transport> inner_;
};

shadowsync_transport_t add_transport(std::unique_ptr<Transport> transport) {
  auto object = std::make_shared<TransportObject>();
  object->transport = std::move(transport);
  return to_handle<shadowsync_transport_t>(std::move(object));
}

// The token argument of the same-host calls: NULL only with a length of 0 (which the transport
// then refuses as too short, naming the minimum).
std::string_view token_arg(const void* token, std::size_t token_bytes) {
  if (token == nullptr && token_bytes != 0) {
    throw_invalid(fmt::format("'token' is NULL but token_bytes is {}", token_bytes));
  }
  return token_bytes == 0 ? std::string_view()
                          : std::string_view(static_cast<const char*>(token), token_bytes);
}

shadowsync_nccl_config_t nccl_config_arg(const shadowsync_nccl_config_t* config) {
  shadowsync_nccl_config_t defaults = SHADOWSYNC_NCCL_CONFIG_INITIALIZER;
  return read_config(config, defaults, "shadowsync_nccl_config_t");
}

#if defined(SHADOWSYNC_WITH_CUDA)
NcclTransportConfig nccl_config(const shadowsync_nccl_config_t& c) {
  NcclTransportConfig cpp;
  cpp.max_ctas = read_int(c.max_ctas, cpp.max_ctas);
  cpp.min_ctas = read_int(c.min_ctas, cpp.min_ctas);
  cpp.cga_cluster_size = read_int(c.cga_cluster_size, cpp.cga_cluster_size);
  cpp.init_timeout = read_int64(c.init_timeout_ms, cpp.init_timeout);
  cpp.enqueue_timeout = read_int64(c.enqueue_timeout_ms, cpp.enqueue_timeout);
  cpp.finalize_timeout = read_int64(c.finalize_timeout_ms, cpp.finalize_timeout);
  return cpp;
}

NcclUniqueId unique_id_arg(const uint8_t* id) {
  NcclUniqueId unique;
  std::memcpy(unique.bytes.data(), id, unique.bytes.size());
  return unique;
}
#endif

// `count` strings at `values` (NULL only with a count of 0), each named "NAME[i]" when NULL.
std::vector<std::string> string_list_arg(const char* const* values, std::size_t count,
                                         std::string_view name) {
  if (values == nullptr && count != 0) {
    throw_invalid(fmt::format("'{}' is NULL but the count is {}", name, count));
  }
  constexpr std::size_t kMaxEntries = 65536;  // a corrupt count must not allocate gigabytes
  if (count > kMaxEntries) {
    throw_invalid(fmt::format("'{}' count is {}, more than {}", name, count, kMaxEntries));
  }
  std::vector<std::string> out;
  for (std::size_t i = 0; i < count; ++i) {
    out.push_back(string_arg(values[i], fmt::format("{}[{}]", name, i)));
  }
  return out;
}

SameHostConfig same_host_config(std::int64_t connect_timeout_ms) {
  SameHostConfig config;
  if (connect_timeout_ms < 0) {
    throw_invalid(fmt::format("connect_timeout_ms is {}; expected a positive number of "
                              "milliseconds, or 0 for the default ({})",
                              connect_timeout_ms, config.connect_timeout.count()));
  }
  if (connect_timeout_ms > 0) config.connect_timeout = std::chrono::milliseconds(connect_timeout_ms);
  return config;
}

const char* memory_name(SameHostMemory memory) {
  return memory == SameHostMemory::kHost ? "SHADOWSYNC_SAME_HOST_MEMORY_HOST"
                                         : "SHADOWSYNC_SAME_HOST_MEMORY_DEVICE";
}

// The same-host transports' `memory` argument: a flavour this library was built for, with the
// backend whose streams it runs on (refused here, before anything listens). `what` and
// `socket_path` name the call in errors.
SameHostMemory same_host_memory_arg(const shadowsync_same_host_memory_t& memory,
                                    const BackendObject& backend, std::string_view what,
                                    const std::string& socket_path) {
  // A C caller may pass any int: read it as one, through the reference (loading an enum value
  // outside the enumerators' range, copying the argument included, is undefined behaviour).
  static_assert(sizeof(memory) == sizeof(int));
  int flavour = 0;
  std::memcpy(&flavour, &memory, sizeof(flavour));
  if (flavour != SHADOWSYNC_SAME_HOST_MEMORY_HOST &&
      flavour != SHADOWSYNC_SAME_HOST_MEMORY_DEVICE) {
    throw_invalid(fmt::format("'memory' is {}; expected SHADOWSYNC_SAME_HOST_MEMORY_HOST ({}) "
                              "or SHADOWSYNC_SAME_HOST_MEMORY_DEVICE ({})",
                              flavour, static_cast<int>(SHADOWSYNC_SAME_HOST_MEMORY_HOST),
                              static_cast<int>(SHADOWSYNC_SAME_HOST_MEMORY_DEVICE)));
  }
  const auto cpp_memory = static_cast<SameHostMemory>(flavour);
#if !defined(SHADOWSYNC_WITH_CUDA)
  if (cpp_memory == SameHostMemory::kDevice) {
    throw_not_supported(fmt::format("{} on '{}' with {}: this library was built without CUDA",
                                    what, socket_path, memory_name(cpp_memory)));
  }
#endif
  const bool wants_cuda = cpp_memory == SameHostMemory::kDevice;
  if (backend.cuda != wants_cuda) {
    throw_invalid(fmt::format("{} on '{}': 'memory' {} needs a {} backend, but 'backend' is '{}'",
                              what, socket_path, memory_name(cpp_memory),
                              wants_cuda ? "cuda" : "host", backend.backend->name()));
  }
  return cpp_memory;
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
  return std::make_unique<ForwardingTransport>(object_->transport);
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

shadowsync_status_t shadowsync_make_token(char* token, size_t size) {
  return guard(__func__, [&] {
    if (token == nullptr) throw_invalid("output argument 'token' is NULL");
    const std::string made = make_token();
    static_assert(SHADOWSYNC_TOKEN_BYTES == kTokenPrefix.size() + 64 + 1);
    if (size < made.size() + 1) {
      throw_invalid(fmt::format("'size' is {} bytes; a token needs {} (SHADOWSYNC_TOKEN_BYTES)",
                                size, made.size() + 1));
    }
    std::memcpy(token, made.c_str(), made.size() + 1);
  });
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
    const shadowsync_nccl_config_t c = nccl_config_arg(config);
#if defined(SHADOWSYNC_WITH_CUDA)
    out = add_transport(
        NcclTransport::create(unique_id_arg(id), rank, world_size, device, nccl_config(c)));
#else
    (void)c;
    (void)out;
    throw_not_supported(fmt::format("NCCL transport (rank {} of {}, device {}): this library was "
                                    "built without CUDA/NCCL",
                                    rank, world_size, device));
#endif
  });
}

shadowsync_status_t shadowsync_nccl_routed_transport_create(
    const uint8_t id[SHADOWSYNC_NCCL_UNIQUE_ID_BYTES], int rank, int device,
    shadowsync_routing_plan_t plan, shadowsync_backend_t backend, const char* const* gpus,
    size_t gpu_count, const shadowsync_nccl_config_t* config, shadowsync_transport_t* transport) {
  return shadowsync_nccl_routed_transport_create_replicated(id, rank, device, plan, backend, gpus,
                                                            gpu_count, 1, config, transport);
}

shadowsync_status_t shadowsync_nccl_routed_transport_create_replicated(
    const uint8_t id[SHADOWSYNC_NCCL_UNIQUE_ID_BYTES], int rank, int device,
    shadowsync_routing_plan_t plan, shadowsync_backend_t backend, const char* const* gpus,
    size_t gpu_count, int replicas, const shadowsync_nccl_config_t* config,
    shadowsync_transport_t* transport) {
  return guard(__func__, [&] {
    auto& out = out_arg(transport, "transport");
    if (id == nullptr) throw_invalid("'id' is NULL");
    const shadowsync_nccl_config_t c = nccl_config_arg(config);
    std::vector<std::string> gpu_names = string_list_arg(gpus, gpu_count, "gpus");
    auto plan_object = lookup<RoutingPlanObject>(plan, "plan");
    auto backend_object = lookup<BackendObject>(backend, "backend");
#if defined(SHADOWSYNC_WITH_CUDA)
    NcclRouteConfig route_config;
    route_config.gpus = std::move(gpu_names);
    route_config.replicas = replicas;
    // The transport shares the plan handle's object and keeps the backend (its landing buffer's)
    // alive: the caller may destroy both handles.
    std::shared_ptr<const RoutingPlan> routing(plan_object, &plan_object->plan);
    std::unique_ptr<Transport> made = NcclTransport::create_routed(
        unique_id_arg(id), rank, device, std::move(routing), plan_object->wire,
        *backend_object->backend, std::move(route_config), nccl_config(c));
    out = add_transport(
        std::make_unique<ForwardingTransport>(std::move(made), std::move(backend_object)));
#else
    (void)c;
    (void)out;
    (void)replicas;
    throw_not_supported(fmt::format("NCCL routed transport (communicator rank {} of {}, device {}): "
                                    "this library was built without CUDA/NCCL",
                                    rank, gpu_names.size(), device));
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

shadowsync_status_t shadowsync_same_host_transport_serve(
    const char* path, const void* token, size_t token_bytes, int receivers,
    shadowsync_backend_t backend, shadowsync_same_host_memory_t memory, size_t slot_bytes,
    int64_t connect_timeout_ms, shadowsync_transport_t* transport) {
  return guard(__func__, [&] {
    auto& out = out_arg(transport, "transport");
    const std::string socket_path = string_arg(path, "path");
    const std::string_view secret = token_arg(token, token_bytes);
    auto backend_object = lookup<BackendObject>(backend, "backend");
    // A C caller may pass any int: read it as one (loading an enum value outside the
    // enumerators' range is undefined behaviour in C++).
    const SameHostMemory cpp_memory =
        same_host_memory_arg(memory, *backend_object, "same-host transport", socket_path);
    const SameHostConfig config = same_host_config(connect_timeout_ms);
    std::unique_ptr<Transport> made =
        SameHostTransport::serve(socket_path, secret, receivers, *backend_object->backend,
                                 cpp_memory, slot_bytes, config);
    out = add_transport(
        std::make_unique<ForwardingTransport>(std::move(made), std::move(backend_object)));
  });
}

shadowsync_status_t shadowsync_same_host_transport_connect(const char* path, const void* token,
                                                           size_t token_bytes, int rank,
                                                           shadowsync_backend_t backend,
                                                           int64_t connect_timeout_ms,
                                                           shadowsync_transport_t* transport) {
  return guard(__func__, [&] {
    auto& out = out_arg(transport, "transport");
    const std::string socket_path = string_arg(path, "path");
    const std::string_view secret = token_arg(token, token_bytes);
    auto backend_object = lookup<BackendObject>(backend, "backend");
    const SameHostConfig config = same_host_config(connect_timeout_ms);
    std::unique_ptr<Transport> made = SameHostTransport::connect(
        socket_path, secret, rank, *backend_object->backend, config);
    out = add_transport(
        std::make_unique<ForwardingTransport>(std::move(made), std::move(backend_object)));
  });
}

shadowsync_status_t shadowsync_same_host_pull_serve(
    const char* path, const void* token, size_t token_bytes, shadowsync_routing_plan_t plan,
    int32_t trainer_rank, int32_t engine_processes, shadowsync_backend_t backend,
    shadowsync_same_host_memory_t memory, int64_t connect_timeout_ms,
    shadowsync_transport_t* transport) {
  return guard(__func__, [&] {
    auto& out = out_arg(transport, "transport");
    const std::string socket_path = string_arg(path, "path");
    const std::string_view secret = token_arg(token, token_bytes);
    auto plan_object = lookup<RoutingPlanObject>(plan, "plan");
    auto backend_object = lookup<BackendObject>(backend, "backend");
    const SameHostMemory cpp_memory =
        same_host_memory_arg(memory, *backend_object, "same-host pull transport", socket_path);
    const SameHostConfig config = same_host_config(connect_timeout_ms);
    // The transport shares the plan handle's object: the caller may destroy the handle.
    std::shared_ptr<const RoutingPlan> routing(plan_object, &plan_object->plan);
    std::unique_ptr<Transport> made = SameHostPullTransport::serve(
        socket_path, secret, std::move(routing), trainer_rank, engine_processes,
        *backend_object->backend, cpp_memory, config);
    out = add_transport(
        std::make_unique<ForwardingTransport>(std::move(made), std::move(backend_object)));
  });
}

shadowsync_status_t shadowsync_same_host_pull_connect(
    const char* const* paths, size_t count, const void* token, size_t token_bytes,
    shadowsync_routing_plan_t plan, int32_t engine_rank, shadowsync_backend_t backend,
    int64_t connect_timeout_ms, shadowsync_transport_t* transport) {
  return shadowsync_same_host_pull_connect_replica(paths, count, token, token_bytes, plan,
                                                   engine_rank, 0, backend, connect_timeout_ms,
                                                   transport);
}

shadowsync_status_t shadowsync_same_host_pull_connect_replica(
    const char* const* paths, size_t count, const void* token, size_t token_bytes,
    shadowsync_routing_plan_t plan, int32_t engine_rank, int32_t replica,
    shadowsync_backend_t backend, int64_t connect_timeout_ms, shadowsync_transport_t* transport) {
  return guard(__func__, [&] {
    auto& out = out_arg(transport, "transport");
    const std::vector<std::string> trainer_paths = string_list_arg(paths, count, "paths");
    const std::string_view secret = token_arg(token, token_bytes);
    auto plan_object = lookup<RoutingPlanObject>(plan, "plan");
    // The trainer ranks' flavour decides which backend pulls: the transport refuses a mismatch
    // at connect, naming both.
    auto backend_object = lookup<BackendObject>(backend, "backend");
    const SameHostConfig config = same_host_config(connect_timeout_ms);
    std::shared_ptr<const RoutingPlan> routing(plan_object, &plan_object->plan);
    std::unique_ptr<Transport> made = SameHostPullTransport::connect_engine_rank(
        trainer_paths, secret, std::move(routing), engine_rank, *backend_object->backend, config,
        replica);
    out = add_transport(
        std::make_unique<ForwardingTransport>(std::move(made), std::move(backend_object)));
  });
}

shadowsync_status_t shadowsync_transport_destroy(shadowsync_transport_t transport) {
  return guard(__func__,
               [&] { Registry::instance().remove<TransportObject>(transport, "transport"); });
}

}  // extern "C"
