// The handle registry and the argument helpers every entry point uses.
#include <fmt/format.h>

#include "c_api/c_api_internal.h"
#include "shadowsync/dtype.h"

namespace shadowsync::c_api {

const char* kind_name(Kind kind) noexcept {
  switch (kind) {
    case Kind::kLayout: return "shadowsync_layout_t";
    case Kind::kBackend: return "shadowsync_backend_t";
    case Kind::kStream: return "shadowsync_stream_t";
    case Kind::kTransport: return "shadowsync_transport_t";
    case Kind::kLoopback: return "shadowsync_loopback_t";
    case Kind::kReceiver: return "shadowsync_receiver_t";
    case Kind::kSender: return "shadowsync_sender_t";
    case Kind::kPublish: return "shadowsync_publish_t";
    case Kind::kRemapArena: return "shadowsync_remap_arena_t";
    case Kind::kRoutingPlan: return "shadowsync_routing_plan_t";
  }
  return "handle";
}

Registry& Registry::instance() {
  // Never destroyed: objects the caller did not destroy must not be torn down by static
  // destructors at exit, in an order nobody chose, while their threads may still run.
  static Registry* registry = new Registry;
  return *registry;
}

namespace {

template <typename Map>
auto find_in(Map& entries, const void* handle, Kind kind, const char* argument) {
  if (handle == nullptr) {
    throw StatusError(SHADOWSYNC_INVALID_HANDLE,
                      fmt::format("'{}' is a NULL {}", argument, kind_name(kind)));
  }
  auto it = entries.find(reinterpret_cast<std::uintptr_t>(handle));
  if (it == entries.end()) {
    throw StatusError(SHADOWSYNC_INVALID_HANDLE,
                      fmt::format("'{}' ({}) is not a live {}: destroyed already, taken by a "
                                  "receiver or sender, or never created",
                                  argument, handle, kind_name(kind)));
  }
  if (it->second.kind != kind) {
    throw StatusError(SHADOWSYNC_INVALID_HANDLE,
                      fmt::format("'{}' ({}) is a {}, not a {}", argument, handle,
                                  kind_name(it->second.kind), kind_name(kind)));
  }
  return it;
}

}  // namespace

std::unordered_map<std::uintptr_t, Registry::Entry>::const_iterator Registry::find(
    const void* handle, Kind kind, const char* argument) const {
  return find_in(entries_, handle, kind, argument);
}

std::unordered_map<std::uintptr_t, Registry::Entry>::iterator Registry::find(
    const void* handle, Kind kind, const char* argument) {
  return find_in(entries_, handle, kind, argument);
}

std::vector<std::int64_t> shape_arg(const std::int64_t* shape, std::size_t ndim,
                                    const std::string& argument) {
  if (ndim > 0 && shape == nullptr) {
    throw_invalid(fmt::format("'{}.shape' is NULL but ndim is {}", argument, ndim));
  }
  constexpr std::size_t kMaxDims = 64;  // a corrupt ndim must not allocate gigabytes
  if (ndim > kMaxDims) {
    throw_invalid(fmt::format("'{}.ndim' is {}, more than {}", argument, ndim, kMaxDims));
  }
  return std::vector<std::int64_t>(shape, shape + ndim);
}

std::vector<std::string> group_names_arg(const char* const* groups, std::size_t count) {
  if (count > 0 && groups == nullptr) {
    throw_invalid(fmt::format("'groups' is NULL but group_count is {}", count));
  }
  std::vector<std::string> names;
  names.reserve(count);
  for (std::size_t i = 0; i < count; ++i) {
    names.emplace_back(string_arg(groups[i], fmt::format("groups[{}]", i)));
  }
  return names;
}

std::vector<SourceTensor> source_tensors_arg(const shadowsync_source_tensor_t* tensors,
                                             std::size_t count) {
  if (count > 0 && tensors == nullptr) {
    throw_invalid(fmt::format("'tensors' is NULL but the count is {}", count));
  }
  std::vector<SourceTensor> sources;
  sources.reserve(count);
  for (std::size_t i = 0; i < count; ++i) {
    const shadowsync_source_tensor_t& t = tensors[i];
    const std::string argument = fmt::format("tensors[{}]", i);
    SourceTensor source;
    source.name = string_arg(t.name, argument + ".name");
    source.data = t.data;
    try {
      source.dtype = dtype_from_string(string_arg(t.dtype, argument + ".dtype"));
    } catch (const Error& e) {
      throw_invalid(fmt::format("tensor '{}': {}", source.name, e.what()));
    }
    source.shape = shape_arg(t.shape, t.ndim, argument);
    sources.push_back(std::move(source));
  }
  return sources;
}

std::vector<SourceShard> source_shards_arg(const shadowsync_source_shard_t* shards,
                                           std::size_t count) {
  if (count > 0 && shards == nullptr) {
    throw_invalid(fmt::format("'shards' is NULL but the count is {}", count));
  }
  std::vector<SourceShard> out;
  out.reserve(count);
  for (std::size_t i = 0; i < count; ++i) {
    const shadowsync_source_shard_t& s = shards[i];
    const std::string argument = fmt::format("shards[{}]", i);
    SourceShard shard;
    shard.name = string_arg(s.region.tensor, argument + ".region.tensor");
    shard.data = s.data;
    try {
      shard.dtype = dtype_from_string(string_arg(s.dtype, argument + ".dtype"));
    } catch (const Error& e) {
      throw_invalid(fmt::format("shard of tensor '{}': {}", shard.name, e.what()));
    }
    switch (s.region.kind) {
      case SHADOWSYNC_REGION_BOX: {
        const auto begin = shape_arg(s.region.begin, s.region.ndim, argument + ".region.begin");
        const auto end = shape_arg(s.region.end, s.region.ndim, argument + ".region.end");
        shard.region = TensorRegion::box(begin, end);
        break;
      }
      case SHADOWSYNC_REGION_ELEMENTS:
        shard.region = TensorRegion::elements(s.region.first, s.region.count);
        break;
      default:
        throw_invalid(fmt::format("shard of tensor '{}': region kind {} is not "
                                  "SHADOWSYNC_REGION_BOX (0) or SHADOWSYNC_REGION_ELEMENTS (1)",
                                  shard.name, s.region.kind));
    }
    out.push_back(std::move(shard));
  }
  return out;
}

std::shared_ptr<const RoutingPlan> routing_plan_arg(shadowsync_routing_plan_t plan) {
  std::shared_ptr<RoutingPlanObject> object = lookup<RoutingPlanObject>(plan, "plan");
  const RoutingPlan* routing = &object->plan;
  return std::shared_ptr<const RoutingPlan>(std::move(object), routing);
}

std::chrono::steady_clock::time_point deadline_after(std::int64_t timeout_ms) {
  using Clock = std::chrono::steady_clock;
  // A negative timeout waits without limit; a year is the same in practice and cannot overflow.
  constexpr std::int64_t kForeverMs = std::int64_t{365} * 24 * 3600 * 1000;
  if (timeout_ms < 0 || timeout_ms > kForeverMs) timeout_ms = kForeverMs;
  return Clock::now() + std::chrono::milliseconds(timeout_ms);
}

}  // namespace shadowsync::c_api
