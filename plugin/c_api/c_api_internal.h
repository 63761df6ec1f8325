// What the C ABI's entry points share: the handle registry, the objects behind handles, the
// exception-to-status boundary and argument checks. Private to plugin/c_api/.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/routing_plan.h"
#include "shadowsync/backend.h"
#include "shadowsync/error.h"
#include "shadowsync/layout.h"
#include "shadowsync/loopback_transport.h"
#include "shadowsync/receiver.h"
#include "shadowsync/sender.h"
#include "shadowsync/shadowsync.h"
#include "shadowsync/transport.h"
#include "shadowsync/update_header.h"

namespace shadowsync::c_api {

// A failure with a status of the C ABI's own (no ErrorCode counterpart).
class StatusError : public std::runtime_error {
 public:
  StatusError(shadowsync_status_t status, const std::string& message)
      : std::runtime_error(message), status_(status) {}
  shadowsync_status_t status() const noexcept { return status_; }

 private:
  shadowsync_status_t status_;
};

[[noreturn]] inline void throw_invalid(const std::string& message) {
  throw Error(ErrorCode::kInvalidArgument, message);
}
[[noreturn]] inline void throw_not_supported(const std::string& message) {
  throw StatusError(SHADOWSYNC_NOT_SUPPORTED, message);
}

// Records `message` as the calling thread's last error and returns `status`.
shadowsync_status_t fail(shadowsync_status_t status, const char* function,
                         const std::string& message) noexcept;

// The boundary: runs `body`, turns every exception into a status and the thread's last error.
template <typename Body>
shadowsync_status_t guard(const char* function, Body&& body) noexcept {
  try {
    body();
    return SHADOWSYNC_SUCCESS;
  } catch (const StatusError& e) {
    return fail(e.status(), function, e.what());
  } catch (const Error& e) {
    return fail(static_cast<shadowsync_status_t>(e.code()), function, e.what());
  } catch (const std::bad_alloc&) {
    return fail(SHADOWSYNC_INTERNAL_ERROR, function, "out of host memory");
  } catch (const std::exception& e) {
    return fail(SHADOWSYNC_INTERNAL_ERROR, function, e.what());
  } catch (...) {
    return fail(SHADOWSYNC_INTERNAL_ERROR, function, "unknown exception");
  }
}

// ---------------------------------------------------------------------------------------------
// Objects behind handles
// ---------------------------------------------------------------------------------------------

enum class Kind : std::uint8_t {
  kLayout,
  kBackend,
  kStream,
  kTransport,
  kLoopback,
  kReceiver,
  kSender,
  kPublish,
  kRemapArena,
  kRoutingPlan,
};
const char* kind_name(Kind kind) noexcept;  // "shadowsync_layout_t", ...

struct LayoutObject {
  explicit LayoutObject(Layout l) : layout(std::move(l)) {}
  const Layout layout;
};

struct BackendObject {
  std::unique_ptr<Backend> backend;
  bool cuda = false;
  int device = -1;  // the CUDA device; -1 for the host backend

  // "CUDA device 0", "the host backend": where its memory is, for messages.
  std::string where() const {
    return cuda ? fmt::format("CUDA device {}", device) : std::string("the host backend");
  }
};

struct StreamObject {
  std::shared_ptr<BackendObject> backend;  // first: outlives the stream
  std::unique_ptr<Stream> stream;
};

struct TransportObject {
  std::shared_ptr<Transport> transport;
  std::atomic<bool> claimed{false};  // a receiver or sender is being made with it
};

struct LoopbackObject {
  explicit LoopbackObject(int world_size) : communicator(world_size) {}
  LoopbackCommunicator communicator;
};

struct RemapArenaObject {
  std::shared_ptr<BackendObject> backend;  // first: outlives the arena
  std::shared_ptr<RemappableArena> arena;
  std::atomic<bool> in_use{false};  // the live memory of a receiver now
};

struct ReceiverObject {
  std::shared_ptr<BackendObject> backend;  // first: outlives the receiver
  std::vector<std::shared_ptr<RemapArenaObject>> arenas;  // engine arenas it took (in_use)
  std::unique_ptr<Receiver> receiver;
  std::unordered_map<std::string, std::pair<std::size_t, std::size_t>> by_name;

  ReceiverObject() = default;
  ReceiverObject(const ReceiverObject&) = delete;
  ReceiverObject& operator=(const ReceiverObject&) = delete;
  ~ReceiverObject() {
    receiver.reset();  // first: a later receiver may take the arenas once this one is gone
    for (auto& arena : arenas) arena->in_use.store(false);
  }
};

struct SenderObject {
  std::shared_ptr<BackendObject> backend;  // first: outlives the sender
  std::unique_ptr<Sender> sender;
};

struct PublishObject {
  explicit PublishObject(PublishHandle h) : handle(std::move(h)) {}
  PublishHandle handle;
  std::optional<StreamedPublish> streamed;
};

struct RoutingPlanObject {
  RoutingPlanObject(Layout w, RoutingPlan p) : wire(std::move(w)), plan(std::move(p)) {}
  const Layout wire;  // what the plan's groups and buckets are of, for messages
  const RoutingPlan plan;
};

template <typename T>
struct KindOf;
template <> struct KindOf<LayoutObject> { static constexpr Kind value = Kind::kLayout; };
template <> struct KindOf<BackendObject> { static constexpr Kind value = Kind::kBackend; };
template <> struct KindOf<StreamObject> { static constexpr Kind value = Kind::kStream; };
template <> struct KindOf<TransportObject> { static constexpr Kind value = Kind::kTransport; };
template <> struct KindOf<LoopbackObject> { static constexpr Kind value = Kind::kLoopback; };
template <> struct KindOf<ReceiverObject> { static constexpr Kind value = Kind::kReceiver; };
template <> struct KindOf<SenderObject> { static constexpr Kind value = Kind::kSender; };
template <> struct KindOf<PublishObject> { static constexpr Kind value = Kind::kPublish; };
template <> struct KindOf<RemapArenaObject> { static constexpr Kind value = Kind::kRemapArena; };
template <> struct KindOf<RoutingPlanObject> { static constexpr Kind value = Kind::kRoutingPlan; };

// ---------------------------------------------------------------------------------------------
// The handle registry
// ---------------------------------------------------------------------------------------------

// Handles are numbers handed out once (never reused), looked up in a table: a stale, foreign or
// NULL handle is found missing instead of being dereferenced. Entries hold shared_ptrs, so an
// object destroyed while another thread is inside a call on it lives until that call returns.
class Registry {
 public:
  static Registry& instance();

  template <typename T>
  std::uintptr_t add(std::shared_ptr<T> object) {
    std::unique_lock lock(mutex_);
    const std::uintptr_t id = next_id_;
    next_id_ += kIdStep;
    entries_.emplace(id, Entry{KindOf<T>::value, std::move(object)});
    return id;
  }

  // The object behind `handle`, or StatusError(SHADOWSYNC_INVALID_HANDLE) naming the argument.
  template <typename T>
  std::shared_ptr<T> get(const void* handle, const char* argument) const {
    std::shared_lock lock(mutex_);
    return std::static_pointer_cast<T>(find(handle, KindOf<T>::value, argument)->second.object);
  }

  // Removes `handle` and returns its object (whose destruction the caller controls).
  template <typename T>
  std::shared_ptr<T> remove(const void* handle, const char* argument) {
    std::unique_lock lock(mutex_);
    auto it = find(handle, KindOf<T>::value, argument);
    auto object = std::static_pointer_cast<T>(std::move(it->second.object));
    entries_.erase(it);
    return object;
  }

 private:
  struct Entry {
    Kind kind;
    std::shared_ptr<void> object;
  };
  // Odd and far from small integers and heap addresses, so that a handle mistaken for a pointer
  // or a count is unlikely to be one that exists.
  static constexpr std::uintptr_t kFirstId = 0x55AA000000000001ull;
  static constexpr std::uintptr_t kIdStep = 2;

  std::unordered_map<std::uintptr_t, Entry>::const_iterator find(const void* handle, Kind kind,
                                                                 const char* argument) const;
  std::unordered_map<std::uintptr_t, Entry>::iterator find(const void* handle, Kind kind,
                                                           const char* argument);

  mutable std::shared_mutex mutex_;
  std::unordered_map<std::uintptr_t, Entry> entries_;
  std::uintptr_t next_id_ = kFirstId;
};

template <typename Handle, typename T>
Handle to_handle(std::shared_ptr<T> object) {
  return reinterpret_cast<Handle>(Registry::instance().add(std::move(object)));
}

template <typename T>
std::shared_ptr<T> lookup(const void* handle, const char* argument) {
  return Registry::instance().get<T>(handle, argument);
}

// ---------------------------------------------------------------------------------------------
// Argument helpers
// ---------------------------------------------------------------------------------------------

template <typename T>
T& out_arg(T* pointer, const char* argument) {
  if (pointer == nullptr) throw_invalid(fmt::format("output argument '{}' is NULL", argument));
  return *pointer;
}

inline const char* string_arg(const char* value, const std::string& argument) {
  if (value == nullptr) throw_invalid(fmt::format("'{}' is NULL", argument));
  return value;
}

std::vector<std::int64_t> shape_arg(const std::int64_t* shape, std::size_t ndim,
                                    const std::string& argument);

std::vector<std::string> group_names_arg(const char* const* groups, std::size_t count);

std::vector<SourceTensor> source_tensors_arg(const shadowsync_source_tensor_t* tensors,
                                             std::size_t count);

std::vector<SourceShard> source_shards_arg(const shadowsync_source_shard_t* shards,
                                           std::size_t count);

// The receive plan of `copies` (each a copy, or with `wire` NULL an engine tensor the plan keeps)
// and `quantized`, from `wire` into `engine`: ReceivePlan::build, which refuses it named
// (receiver_api.cpp; the receiver's create calls and shadowsync_receive_plan_needed_ranges).
ReceivePlan plan_arg(const Layout& wire, const Layout& engine, const shadowsync_plan_copy_t* copies,
                     std::size_t count, const shadowsync_plan_quantization_t* quantized,
                     std::size_t quantized_count);

// The routing plan of a handle, sharing the handle's object (the caller may destroy the handle
// while a sender or receiver keeps using the plan).
std::shared_ptr<const RoutingPlan> routing_plan_arg(shadowsync_routing_plan_t plan);

std::chrono::steady_clock::time_point deadline_after(std::int64_t timeout_ms);

// Update headers between C and C++ (layout_api.cpp). Both check the caller's struct (NULL,
// struct_magic, struct_version, size) and name it as `argument`; header_to_c writes min(size,
// sizeof) bytes and leaves the caller's size/struct_magic/struct_version as they are.
UpdateHeader header_from_c(const shadowsync_update_header_t* header, const char* argument);
void header_to_c(const UpdateHeader& header, shadowsync_update_header_t* out,
                 const char* argument);
void header_bytes_to_c(const UpdateHeader& header, void* buffer, std::size_t capacity,
                       std::size_t* written);

// A transport handle's transport, for a receiver or sender to take. It is removed from the
// registry only by commit_transport(), once the receiving call succeeded; until then the caller
// still owns it. Null handle: null transport (allowed where the C++ API allows it).
class TransportClaim {
 public:
  TransportClaim(shadowsync_transport_t handle, bool allow_null);
  ~TransportClaim();  // not committed: the handle is the caller's again
  TransportClaim(const TransportClaim&) = delete;
  TransportClaim& operator=(const TransportClaim&) = delete;

  std::unique_ptr<Transport> take();  // a forwarding owner of the shared transport
  void commit() noexcept;             // the call succeeded: the handle is gone

 private:
  shadowsync_transport_t handle_;
  std::shared_ptr<TransportObject> object_;
  bool committed_ = false;
};

// The copy of a size/magic/version config struct the library works from: min(size) bytes of the
// caller's, the rest defaults. Refuses a struct that was never initialized. `what` names the type.
template <typename Config>
Config read_config(const Config* user, const Config& defaults, const char* what) {
  Config config = defaults;
  if (user == nullptr) return config;
  if (user->magic != SHADOWSYNC_CONFIG_MAGIC) {
    throw_invalid(fmt::format("{}: magic {:#010x} is not SHADOWSYNC_CONFIG_MAGIC {:#010x}: "
                              "initialize it with its _INITIALIZER macro",
                              what, user->magic, SHADOWSYNC_CONFIG_MAGIC));
  }
  constexpr std::size_t kHeaderBytes = sizeof(std::size_t) + 2 * sizeof(std::uint32_t);
  if (user->size < kHeaderBytes) {
    throw_invalid(fmt::format("{}: size {} is smaller than its size/magic/version header ({})",
                              what, user->size, kHeaderBytes));
  }
  if (user->version == 0) throw_invalid(fmt::format("{}: version 0", what));
  std::memcpy(static_cast<void*>(&config), user, std::min(user->size, sizeof(Config)));
  config.size = sizeof(Config);
  return config;
}

// An optional field of a config struct: `fallback` while unset (SHADOWSYNC_CONFIG_UNDEF_INT /
// _INT64), else the value, as `T` (an int or a std::chrono duration). Range checks are the C++
// config's own (they name the C++ field).
template <typename T>
T read_int(std::int32_t value, T fallback) {
  return value == SHADOWSYNC_CONFIG_UNDEF_INT ? fallback : T(value);
}
template <typename T>
T read_int64(std::int64_t value, T fallback) {
  return value == SHADOWSYNC_CONFIG_UNDEF_INT64 ? fallback : T(value);
}

// A 0/1 field of a config struct: `value` when set (SHADOWSYNC_CONFIG_UNDEF_INT: `fallback`);
// anything else is refused naming the struct, the field and the value.
inline bool read_flag(std::int32_t value, bool fallback, const char* what, const char* field) {
  if (value == SHADOWSYNC_CONFIG_UNDEF_INT) return fallback;
  if (value != 0 && value != 1) {
    throw_invalid(fmt::format("{}: {} is {}, expected 0 or 1", what, field, value));
  }
  return value == 1;
}

}  // namespace shadowsync::c_api
