// The sender and its publishes through the C ABI: the trainer side.
#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "c_api/c_api_internal.h"

using namespace shadowsync;
using namespace shadowsync::c_api;

namespace {

// `routed`: a trainer rank of a routing plan, whose checksums default to off (routes carry none
// yet; the Sender refuses them set, by name).
SenderConfig sender_config(const shadowsync_sender_config_t* user, bool routed = false) {
  const shadowsync_sender_config_t defaults = SHADOWSYNC_SENDER_CONFIG_INITIALIZER;
  const auto c = read_config(user, defaults, "shadowsync_sender_config_t");
  SenderConfig config;
  config.checksums = !routed;
  config.root_rank = read_int(c.root_rank, config.root_rank);
  config.update_deadline = read_int64(c.update_deadline_ms, config.update_deadline);
  config.poll_interval = read_int64(c.poll_interval_us, config.poll_interval);
  config.checksums =
      read_flag(c.checksums, config.checksums, "shadowsync_sender_config_t", "checksums");
  return config;
}

StreamedPublish& streamed(PublishObject& publish) {
  if (!publish.streamed) {
    throw_invalid(fmt::format("update {}: not a streamed publish (made by "
                              "shadowsync_sender_publish, which takes every tensor at once)",
                              publish.handle.header().version));
  }
  return *publish.streamed;
}

}  // namespace

extern "C" {

shadowsync_status_t shadowsync_sender_create(shadowsync_layout_t layout,
                                             shadowsync_backend_t backend,
                                             shadowsync_transport_t transport,
                                             const shadowsync_sender_config_t* config,
                                             shadowsync_sender_t* sender) {
  return guard(__func__, [&] {
    auto& out = out_arg(sender, "sender");
    auto layout_object = lookup<LayoutObject>(layout, "layout");
    auto object = std::make_shared<SenderObject>();
    object->backend = lookup<BackendObject>(backend, "backend");
    const SenderConfig cpp_config = sender_config(config);
    TransportClaim claim(transport, /*allow_null=*/false);
    object->sender = std::make_unique<Sender>(layout_object->layout, *object->backend->backend,
                                              claim.take(), cpp_config);
    out = to_handle<shadowsync_sender_t>(std::move(object));
    claim.commit();
  });
}

shadowsync_status_t shadowsync_sender_create_for_trainer_rank(
    shadowsync_layout_t layout, shadowsync_routing_plan_t plan, int32_t trainer_rank,
    shadowsync_backend_t backend, shadowsync_transport_t transport,
    const shadowsync_sender_config_t* config, shadowsync_sender_t* sender) {
  return guard(__func__, [&] {
    auto& out = out_arg(sender, "sender");
    auto layout_object = lookup<LayoutObject>(layout, "layout");
    std::shared_ptr<const RoutingPlan> routing = routing_plan_arg(plan);
    auto object = std::make_shared<SenderObject>();
    object->backend = lookup<BackendObject>(backend, "backend");
    const SenderConfig cpp_config = sender_config(config, /*routed=*/true);
    TransportClaim claim(transport, /*allow_null=*/false);
    object->sender =
        std::make_unique<Sender>(layout_object->layout, *object->backend->backend, claim.take(),
                                 std::move(routing), trainer_rank, cpp_config);
    out = to_handle<shadowsync_sender_t>(std::move(object));
    claim.commit();
  });
}

shadowsync_status_t shadowsync_sender_publish_shards(shadowsync_sender_t sender, uint64_t version,
                                                     const char* const* groups,
                                                     size_t group_count,
                                                     const shadowsync_source_shard_t* shards,
                                                     size_t shard_count,
                                                     shadowsync_publish_t* publish) {
  return guard(__func__, [&] {
    auto& out = out_arg(publish, "publish");
    auto object = lookup<SenderObject>(sender, "sender");
    PublishHandle handle = object->sender->publish_shards(
        version, group_names_arg(groups, group_count), source_shards_arg(shards, shard_count));
    out = to_handle<shadowsync_publish_t>(std::make_shared<PublishObject>(std::move(handle)));
  });
}

shadowsync_status_t shadowsync_sender_staging_bytes(shadowsync_sender_t sender, uint64_t* bytes) {
  return guard(__func__, [&] {
    auto& out = out_arg(bytes, "bytes");
    out = lookup<SenderObject>(sender, "sender")->sender->staging_bytes();
  });
}

shadowsync_status_t shadowsync_sender_routes_in_place(shadowsync_sender_t sender,
                                                     int32_t* in_place, char* buffer,
                                                     size_t capacity, size_t* length) {
  return guard(__func__, [&] {
    auto& out = out_arg(in_place, "in_place");
    if (capacity > 0 && buffer == nullptr) {
      throw_invalid(fmt::format("'buffer' is NULL but capacity is {}", capacity));
    }
    const auto status = lookup<SenderObject>(sender, "sender")->sender->routes_in_place();
    out = !status ? -1 : status->in_place ? 1 : 0;
    const std::string why = status ? status->why_not : std::string();
    if (length != nullptr) *length = why.size();
    if (capacity == 0) return;
    const std::size_t n = std::min(why.size(), capacity - 1);
    std::memcpy(buffer, why.data(), n);
    buffer[n] = '\0';
  });
}

shadowsync_status_t shadowsync_sender_destroy(shadowsync_sender_t sender) {
  return guard(__func__, [&] { Registry::instance().remove<SenderObject>(sender, "sender"); });
}

shadowsync_status_t shadowsync_sender_replace_transport(shadowsync_sender_t sender,
                                                        shadowsync_transport_t transport) {
  return guard(__func__, [&] {
    auto object = lookup<SenderObject>(sender, "sender");
    TransportClaim claim(transport, /*allow_null=*/false);
    object->sender->replace_transport(claim.take());
    claim.commit();
  });
}

shadowsync_status_t shadowsync_sender_publish(shadowsync_sender_t sender, uint64_t version,
                                              const char* const* groups, size_t group_count,
                                              const shadowsync_source_tensor_t* tensors,
                                              size_t tensor_count, shadowsync_publish_t* publish) {
  return guard(__func__, [&] {
    auto& out = out_arg(publish, "publish");
    auto object = lookup<SenderObject>(sender, "sender");
    PublishHandle handle = object->sender->publish(version, group_names_arg(groups, group_count),
                                                   source_tensors_arg(tensors, tensor_count));
    out = to_handle<shadowsync_publish_t>(std::make_shared<PublishObject>(std::move(handle)));
  });
}

shadowsync_status_t shadowsync_sender_publish_streamed(shadowsync_sender_t sender,
                                                       uint64_t version, const char* const* groups,
                                                       size_t group_count,
                                                       shadowsync_publish_t* publish) {
  return guard(__func__, [&] {
    auto& out = out_arg(publish, "publish");
    auto object = lookup<SenderObject>(sender, "sender");
    StreamedPublish started =
        object->sender->publish_streamed(version, group_names_arg(groups, group_count));
    auto publish_object = std::make_shared<PublishObject>(started.handle());
    publish_object->streamed.emplace(std::move(started));
    out = to_handle<shadowsync_publish_t>(std::move(publish_object));
  });
}

shadowsync_status_t shadowsync_publish_supply(shadowsync_publish_t publish,
                                              const shadowsync_source_tensor_t* tensors,
                                              size_t count) {
  return guard(__func__, [&] {
    auto object = lookup<PublishObject>(publish, "publish");
    streamed(*object).supply(source_tensors_arg(tensors, count));
  });
}

shadowsync_status_t shadowsync_publish_next_tensor(shadowsync_publish_t publish, size_t* group,
                                                   size_t* tensor, size_t* remaining) {
  return guard(__func__, [&] {
    auto object = lookup<PublishObject>(publish, "publish");
    const StreamedPublish& s = streamed(*object);
    const std::size_t supplied = s.supplied();
    const auto& order = s.order();
    out_arg(remaining, "remaining") = order.size() - supplied;
    if (supplied < order.size()) {
      out_arg(group, "group") = order[supplied].first;
      out_arg(tensor, "tensor") = order[supplied].second;
    }
  });
}

shadowsync_status_t shadowsync_publish_header(shadowsync_publish_t publish,
                                              shadowsync_update_header_t* header) {
  return guard(__func__, [&] {
    auto object = lookup<PublishObject>(publish, "publish");
    header_to_c(object->handle.header(), header, "header");
  });
}

shadowsync_status_t shadowsync_publish_header_bytes(shadowsync_publish_t publish, void* buffer,
                                                    size_t capacity, size_t* written) {
  return guard(__func__, [&] {
    auto object = lookup<PublishObject>(publish, "publish");
    header_bytes_to_c(object->handle.header(), buffer, capacity, written);
  });
}

shadowsync_status_t shadowsync_publish_wait(shadowsync_publish_t publish, int64_t timeout_ms) {
  shadowsync_status_t result = SHADOWSYNC_SUCCESS;
  const shadowsync_status_t status = guard(__func__, [&] {
    auto object = lookup<PublishObject>(publish, "publish");
    const auto deadline = deadline_after(timeout_ms);
    if (!object->handle.wait_for(deadline - std::chrono::steady_clock::now())) {
      result = SHADOWSYNC_IN_PROGRESS;  // not a failure: no last error
    }
  });
  return status != SHADOWSYNC_SUCCESS ? status : result;
}

shadowsync_status_t shadowsync_publish_done(shadowsync_publish_t publish, int* done) {
  return guard(__func__, [&] {
    auto object = lookup<PublishObject>(publish, "publish");
    out_arg(done, "done") = object->handle.done() ? 1 : 0;
  });
}

shadowsync_status_t shadowsync_publish_destroy(shadowsync_publish_t publish) {
  return guard(__func__, [&] { Registry::instance().remove<PublishObject>(publish, "publish"); });
}

}  // extern "C"
