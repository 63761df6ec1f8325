// The receiver and its step hook through the C ABI: the engine side.
#include <fmt/format.h>

#include <cstring>

#include "c_api/c_api_internal.h"

using namespace shadowsync;
using namespace shadowsync::c_api;

namespace shadowsync::c_api {

ReceivePlan plan_arg(const Layout& wire, const Layout& engine, const shadowsync_plan_copy_t* copies,
                     std::size_t count, const shadowsync_plan_quantization_t* quantized,
                     std::size_t quantized_count) {
  if (quantized_count > 0 && quantized == nullptr) {
    throw_invalid(fmt::format("'quantized' is NULL but the count is {}", quantized_count));
  }
  std::vector<PlanQuantization> quantizations;
  for (std::size_t i = 0; i < quantized_count; ++i) {
    const std::string argument = fmt::format("quantized[{}]", i);
    quantizations.push_back({string_arg(quantized[i].engine, argument + ".engine"),
                             string_arg(quantized[i].scale, argument + ".scale"),
                             quantized[i].parts});
  }
  if (count > 0 && copies == nullptr) {
    throw_invalid(fmt::format("'copies' is NULL but the count is {}", count));
  }
  std::vector<PlanCopy> out;
  std::vector<std::string> kept;
  out.reserve(count);
  for (std::size_t i = 0; i < count; ++i) {
    const shadowsync_plan_copy_t& c = copies[i];
    const std::string argument = fmt::format("copies[{}]", i);
    if (c.wire == nullptr) {
      kept.push_back(string_arg(c.engine, argument + ".engine"));
      continue;
    }
    const auto dims = [&](const std::int64_t* values, const char* field) {
      if (c.ndim > 0 && values == nullptr) {
        throw_invalid(fmt::format("'{}.{}' is NULL but ndim is {}", argument, field, c.ndim));
      }
      return shape_arg(values, c.ndim, argument);
    };
    PlanCopy copy;
    copy.wire = string_arg(c.wire, argument + ".wire");
    copy.engine = string_arg(c.engine, argument + ".engine");
    copy.shape = dims(c.shape, "shape");
    copy.src_offset = c.src_offset;
    copy.src_strides = dims(c.src_strides, "src_strides");
    copy.dst_offset = c.dst_offset;
    copy.dst_strides = dims(c.dst_strides, "dst_strides");
    out.push_back(std::move(copy));
  }
  return ReceivePlan::build(wire, engine, out, kept, quantizations);
}

}  // namespace shadowsync::c_api

namespace {

ReceiverConfig receiver_config(const shadowsync_receiver_config_t* user) {
  const shadowsync_receiver_config_t defaults = SHADOWSYNC_RECEIVER_CONFIG_INITIALIZER;
  const auto c = read_config(user, defaults, "shadowsync_receiver_config_t");
  constexpr const char* kWhat = "shadowsync_receiver_config_t";
  ReceiverConfig config;
  config.root_rank = read_int(c.root_rank, config.root_rank);
  config.update_deadline = read_int64(c.update_deadline_ms, config.update_deadline);
  config.bucket_deadline = read_int64(c.bucket_deadline_ms, config.bucket_deadline);
  config.poll_interval = read_int64(c.poll_interval_us, config.poll_interval);
  switch (c.swap_strategy) {
    case SHADOWSYNC_CONFIG_UNDEF_INT:
    case SHADOWSYNC_SWAP_REBIND:
      config.swap_strategy = SwapStrategy::kRebind;
      break;
    case SHADOWSYNC_SWAP_COPY_IN:
      config.swap_strategy = SwapStrategy::kCopyIn;
      break;
    case SHADOWSYNC_SWAP_REMAP:
      config.swap_strategy = SwapStrategy::kRemap;
      break;
    default:
      throw_invalid(fmt::format("shadowsync_receiver_config_t: swap_strategy {} is not a "
                                "shadowsync_swap_strategy_t (0 rebind, 1 copy_in, 2 remap)",
                                c.swap_strategy));
  }
  config.engine_uses_cuda_graphs = read_flag(c.engine_uses_cuda_graphs,
                                             config.engine_uses_cuda_graphs, kWhat,
                                             "engine_uses_cuda_graphs");
  config.require_checksums =
      read_flag(c.require_checksums, config.require_checksums, kWhat, "require_checksums");
  config.reject_nonfinite =
      read_flag(c.reject_nonfinite, config.reject_nonfinite, kWhat, "reject_nonfinite");
  config.abort_deadline = read_int64(c.abort_deadline_ms, config.abort_deadline);
  config.exit_on_stuck_abort =
      read_flag(c.exit_on_stuck_abort, config.exit_on_stuck_abort, kWhat, "exit_on_stuck_abort");
  switch (c.commit_mode) {
    case SHADOWSYNC_CONFIG_UNDEF_INT:
    case SHADOWSYNC_COMMIT_AUTO:
      config.commit_mode = CommitMode::kAuto;
      break;
    case SHADOWSYNC_COMMIT_COORDINATED:
      config.commit_mode = CommitMode::kCoordinated;
      break;
    default:
      throw_invalid(fmt::format("shadowsync_receiver_config_t: commit_mode {} is not 0 (auto) or "
                                "1 (coordinated)",
                                c.commit_mode));
  }
  // 0 is the C struct's "unset"; any other value, NaN and values below 1.0 included, goes to the
  // C++ config, whose check refuses it naming ReceiverConfig::decode_slowdown_budget and the value.
  if (c.decode_slowdown_budget != 0.0) config.decode_slowdown_budget = c.decode_slowdown_budget;
  config.max_receive_bytes_per_second = c.max_receive_bytes_per_second;
  config.gated_swaps = read_flag(c.gated_swaps, config.gated_swaps, kWhat, "gated_swaps");
  config.gate_deadline = read_int64(c.gate_deadline_ms, config.gate_deadline);
  config.offer_after_clean_step = read_flag(c.offer_after_clean_step,
                                            config.offer_after_clean_step, kWhat,
                                            "offer_after_clean_step");
  return config;
}

static_assert(SHADOWSYNC_STUCK_ABORT_EXIT_STATUS == kStuckAbortExitStatus);

// Index of a named group / tensor of a failure report in the receiver's layout; -1 when unnamed.
std::int64_t group_index(const Layout& layout, const std::string& name) {
  const auto& groups = layout.groups();
  for (std::size_t g = 0; g < groups.size(); ++g) {
    if (groups[g].name() == name) return static_cast<std::int64_t>(g);
  }
  return -1;
}

std::int64_t tensor_index(const Layout& layout, std::int64_t group, const std::string& name) {
  if (group < 0 || name.empty()) return -1;
  const auto& tensors = layout.groups()[static_cast<std::size_t>(group)].tensors();
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    if (tensors[t].spec.name == name) return static_cast<std::int64_t>(t);
  }
  return -1;
}

// The engine's stream, which must come from the receiver's backend.
std::shared_ptr<StreamObject> engine_stream(const ReceiverObject& receiver,
                                            shadowsync_stream_t stream) {
  auto object = lookup<StreamObject>(stream, "stream");
  if (object->backend != receiver.backend) {
    throw_invalid(fmt::format("'stream' belongs to another backend ('{}') than the receiver's "
                              "('{}'): use a stream of the receiver's backend",
                              object->backend->backend->name(),
                              receiver.backend->backend->name()));
  }
  return object;
}

void check_group(const Receiver& receiver, std::size_t group) {
  const std::size_t groups = receiver.layout().groups().size();
  if (group >= groups) {
    throw_invalid(fmt::format("group index {} out of range (the layout has {} groups)", group,
                              groups));
  }
}

// live_arena and live_content_version: `query` (one of the two) of group index `group` into `*out`
// (the argument named `out_name`), after checking the receiver, `out` and the index, in that order.
template <typename Out, typename Query>
shadowsync_status_t query_group(const char* function, shadowsync_receiver_t receiver,
                                std::size_t group, Out* out, const char* out_name, Query query) {
  return guard(function, [&] {
    auto object = lookup<ReceiverObject>(receiver, "receiver");
    auto& value = out_arg(out, out_name);
    check_group(*object->receiver, group);
    value = (object->receiver->step_hook().*query)(group);
  });
}

// before_step, after_launch and apply_pending_now: `apply` on the engine's stream, reporting
// the version it made live in `applied_version` (0: none; NULL: not wanted).
shadowsync_status_t apply_on_engine_stream(
    const char* function, shadowsync_receiver_t receiver, shadowsync_stream_t stream,
    uint64_t* applied_version, std::optional<std::uint64_t> (StepHook::*apply)(Stream&)) {
  return guard(function, [&] {
    auto object = lookup<ReceiverObject>(receiver, "receiver");
    auto stream_object = engine_stream(*object, stream);
    const auto applied = (object->receiver->step_hook().*apply)(*stream_object->stream);
    if (applied_version != nullptr) *applied_version = applied.value_or(0);
  });
}

// Claims the engine arenas of shadowsync_receiver_create_with_arenas for `object` (each from the
// receiver's backend and in no other live receiver's use); released again if the receiver is not
// made. EngineArenas in group order.
class ArenaClaim {
 public:
  ArenaClaim(ReceiverObject& object, const shadowsync_remap_arena_t* arenas, std::size_t count)
      : object_(object) {
    if (count > 0 && arenas == nullptr) {
      throw_invalid(fmt::format("'arenas' is NULL but the count is {}", count));
    }
    for (std::size_t g = 0; g < count; ++g) {
      if (arenas[g] == nullptr) {
        engine_arenas_.emplace_back();
        continue;
      }
      const std::string argument = fmt::format("arenas[{}]", g);
      auto arena = lookup<RemapArenaObject>(arenas[g], argument.c_str());
      // Another backend object of the same device is fine (a worker makes its own).
      if (arena->backend->cuda != object.backend->cuda ||
          arena->backend->device != object.backend->device) {
        throw_invalid(fmt::format("'{}' lies on {}, but the receiver's backend is {}", argument,
                                  arena->backend->where(), object.backend->where()));
      }
      if (arena->in_use.exchange(true)) {
        throw_invalid(fmt::format("'{}' is the live memory of another receiver: destroy that "
                                  "receiver first",
                                  argument));
      }
      object.arenas.push_back(arena);
      engine_arenas_.push_back(arena->arena);
    }
  }
  ~ArenaClaim() {
    if (committed_) return;
    for (auto& arena : object_.arenas) arena->in_use.store(false);
    object_.arenas.clear();
  }
  ArenaClaim(const ArenaClaim&) = delete;
  ArenaClaim& operator=(const ArenaClaim&) = delete;

  const EngineArenas& engine_arenas() const { return engine_arenas_; }
  void commit() { committed_ = true; }

 private:
  ReceiverObject& object_;
  EngineArenas engine_arenas_;
  bool committed_ = false;
};

// The receiver of shadowsync_receiver_create(_with_plan, _with_arenas), after its own arguments
// were read.
shadowsync_receiver_t create_receiver(const Layout& layout, std::optional<ReceivePlan> plan,
                                      shadowsync_backend_t backend,
                                      shadowsync_transport_t transport,
                                      const shadowsync_receiver_config_t* config,
                                      const shadowsync_remap_arena_t* arenas = nullptr,
                                      std::size_t arena_count = 0) {
  auto object = std::make_shared<ReceiverObject>();
  object->backend = lookup<BackendObject>(backend, "backend");
  const ReceiverConfig cpp_config = receiver_config(config);
  ArenaClaim arena_claim(*object, arenas, arena_count);
  TransportClaim claim(transport, /*allow_null=*/true);
  Backend& device = *object->backend->backend;
  object->receiver =
      plan ? std::make_unique<Receiver>(layout, std::move(*plan), device, claim.take(), cpp_config,
                                        arena_claim.engine_arenas())
           : std::make_unique<Receiver>(layout, device, claim.take(), cpp_config,
                                        arena_claim.engine_arenas());
  const auto& groups = layout.groups();
  for (std::size_t g = 0; g < groups.size(); ++g) {
    for (std::size_t t = 0; t < groups[g].tensors().size(); ++t) {
      object->by_name.emplace(groups[g].tensors()[t].spec.name, std::make_pair(g, t));
    }
  }
  auto handle = to_handle<shadowsync_receiver_t>(std::move(object));
  claim.commit();
  arena_claim.commit();
  return handle;
}

// A receiver whose updates come in `wire_layout` through the plan of `copies` and `quantized`
// (no plan where `wire_layout` is NULL), over `arenas` where given: what every create call but
// the plain one shares.
shadowsync_receiver_t create_planned_receiver(
    shadowsync_layout_t layout, shadowsync_layout_t wire_layout,
    const shadowsync_plan_copy_t* copies, std::size_t copy_count,
    const shadowsync_plan_quantization_t* quantized, std::size_t quantized_count,
    const shadowsync_remap_arena_t* arenas, std::size_t arena_count, shadowsync_backend_t backend,
    shadowsync_transport_t transport, const shadowsync_receiver_config_t* config) {
  auto layout_object = lookup<LayoutObject>(layout, "layout");
  std::optional<ReceivePlan> plan;
  if (wire_layout != nullptr) {
    auto wire_object = lookup<LayoutObject>(wire_layout, "wire_layout");
    plan = plan_arg(wire_object->layout, layout_object->layout, copies, copy_count, quantized,
                    quantized_count);
  }
  return create_receiver(layout_object->layout, std::move(plan), backend, transport, config,
                         arenas, arena_count);
}

}  // namespace

extern "C" {

shadowsync_status_t shadowsync_receiver_create(shadowsync_layout_t layout,
                                               shadowsync_backend_t backend,
                                               shadowsync_transport_t transport,
                                               const shadowsync_receiver_config_t* config,
                                               shadowsync_receiver_t* receiver) {
  return guard(__func__, [&] {
    auto& out = out_arg(receiver, "receiver");
    auto layout_object = lookup<LayoutObject>(layout, "layout");
    out = create_receiver(layout_object->layout, std::nullopt, backend, transport, config);
  });
}

shadowsync_status_t shadowsync_receiver_create_with_plan(
    shadowsync_layout_t layout, shadowsync_layout_t wire_layout,
    const shadowsync_plan_copy_t* copies, size_t count, shadowsync_backend_t backend,
    shadowsync_transport_t transport, const shadowsync_receiver_config_t* config,
    shadowsync_receiver_t* receiver) {
  return guard(__func__, [&] {
    auto& out = out_arg(receiver, "receiver");
    lookup<LayoutObject>(wire_layout, "wire_layout");  // required here: NULL is refused, named
    out = create_planned_receiver(layout, wire_layout, copies, count, nullptr, 0, nullptr, 0,
                                  backend, transport, config);
  });
}

shadowsync_status_t shadowsync_receiver_create_with_arenas(
    shadowsync_layout_t layout, shadowsync_layout_t wire_layout,
    const shadowsync_plan_copy_t* copies, size_t copy_count,
    const shadowsync_remap_arena_t* arenas, size_t count, shadowsync_backend_t backend,
    shadowsync_transport_t transport, const shadowsync_receiver_config_t* config,
    shadowsync_receiver_t* receiver) {
  return guard(__func__, [&] {
    auto& out = out_arg(receiver, "receiver");
    out = create_planned_receiver(layout, wire_layout, copies, copy_count, nullptr, 0, arenas,
                                  count, backend, transport, config);
  });
}

shadowsync_status_t shadowsync_receiver_create_with_quantized_plan(
    shadowsync_layout_t layout, shadowsync_layout_t wire_layout,
    const shadowsync_plan_copy_t* copies, size_t copy_count,
    const shadowsync_plan_quantization_t* quantized, size_t quantized_count,
    const shadowsync_remap_arena_t* arenas, size_t count, shadowsync_backend_t backend,
    shadowsync_transport_t transport, const shadowsync_receiver_config_t* config,
    shadowsync_receiver_t* receiver) {
  return guard(__func__, [&] {
    auto& out = out_arg(receiver, "receiver");
    lookup<LayoutObject>(wire_layout, "wire_layout");  // required here: NULL is refused, named
    out = create_planned_receiver(layout, wire_layout, copies, copy_count, quantized,
                                  quantized_count, arenas, count, backend, transport, config);
  });
}

shadowsync_status_t shadowsync_receiver_use_engine_storage(shadowsync_receiver_t receiver,
                                                          size_t group, void* const* tensors,
                                                          size_t count) {
  return guard(__func__, [&] {
    auto object = lookup<ReceiverObject>(receiver, "receiver");
    if (count > 0 && tensors == nullptr) {
      throw_invalid(fmt::format("'tensors' is NULL but the count is {}", count));
    }
    check_group(*object->receiver, group);
    object->receiver->use_engine_storage(group, std::vector<void*>(tensors, tensors + count));
  });
}

shadowsync_status_t shadowsync_receiver_commit(shadowsync_receiver_t receiver,
                                               shadowsync_stream_t stream, uint64_t version,
                                               uint64_t* applied_version) {
  return guard(__func__, [&] {
    auto object = lookup<ReceiverObject>(receiver, "receiver");
    auto stream_object = engine_stream(*object, stream);
    const std::uint64_t applied = object->receiver->commit(version, *stream_object->stream);
    if (applied_version != nullptr) *applied_version = applied;
  });
}

shadowsync_status_t shadowsync_receiver_destroy(shadowsync_receiver_t receiver) {
  return guard(__func__, [&] {
    auto object = Registry::instance().remove<ReceiverObject>(receiver, "receiver");
    // Stop now even if another thread is still inside a call (it keeps the object alive).
    object->receiver->shutdown();
  });
}

shadowsync_status_t shadowsync_receiver_begin_update(shadowsync_receiver_t receiver,
                                                     const shadowsync_update_header_t* header) {
  return guard(__func__, [&] {
    auto object = lookup<ReceiverObject>(receiver, "receiver");
    object->receiver->begin_update(header_from_c(header, "header"));
  });
}

shadowsync_status_t shadowsync_receiver_begin_update_bytes(shadowsync_receiver_t receiver,
                                                           const void* bytes, size_t size) {
  return guard(__func__, [&] {
    auto object = lookup<ReceiverObject>(receiver, "receiver");
    if (bytes == nullptr && size > 0) throw_invalid("'bytes' is NULL");
    object->receiver->begin_update(
        parse_update_header({static_cast<const std::byte*>(bytes), size}));
  });
}

shadowsync_status_t shadowsync_receiver_begin_update_checked(shadowsync_receiver_t receiver,
                                                             const void* bytes, size_t size,
                                                             uint32_t flags) {
  return guard(__func__, [&] {
    auto object = lookup<ReceiverObject>(receiver, "receiver");
    if (bytes == nullptr && size > 0) throw_invalid("'bytes' is NULL");
    constexpr uint32_t known = SHADOWSYNC_CHECK_VERIFY_MATCHES_LIVE;
    if ((flags & ~known) != 0) {
      throw_invalid(fmt::format("'flags' {:#x} holds unknown bits {:#x} (known: {:#x})", flags,
                                flags & ~known, known));
    }
    UpdateChecks checks;
    checks.verify_matches_live = (flags & SHADOWSYNC_CHECK_VERIFY_MATCHES_LIVE) != 0;
    object->receiver->begin_update(
        parse_update_header({static_cast<const std::byte*>(bytes), size}), checks);
  });
}

shadowsync_status_t shadowsync_receiver_abort_update(shadowsync_receiver_t receiver) {
  return guard(__func__,
               [&] { lookup<ReceiverObject>(receiver, "receiver")->receiver->abort_update(); });
}

shadowsync_status_t shadowsync_receiver_replace_transport(shadowsync_receiver_t receiver,
                                                          shadowsync_transport_t transport) {
  return guard(__func__, [&] {
    auto object = lookup<ReceiverObject>(receiver, "receiver");
    TransportClaim claim(transport, /*allow_null=*/false);
    object->receiver->replace_transport(claim.take());
    claim.commit();
  });
}

shadowsync_status_t shadowsync_receiver_use_routing_plan(shadowsync_receiver_t receiver,
                                                         shadowsync_routing_plan_t plan,
                                                         int32_t engine_rank) {
  return guard(__func__, [&] {
    auto object = lookup<ReceiverObject>(receiver, "receiver");
    object->receiver->use_routing_plan(routing_plan_arg(plan), engine_rank);
  });
}

shadowsync_status_t shadowsync_receiver_drain(shadowsync_receiver_t receiver) {
  return guard(__func__, [&] { lookup<ReceiverObject>(receiver, "receiver")->receiver->drain(); });
}

shadowsync_status_t shadowsync_receiver_before_step(shadowsync_receiver_t receiver,
                                                    shadowsync_stream_t stream,
                                                    uint64_t* applied_version) {
  return apply_on_engine_stream(__func__, receiver, stream, applied_version,
                                &StepHook::before_step);
}

shadowsync_status_t shadowsync_receiver_after_launch(shadowsync_receiver_t receiver,
                                                     shadowsync_stream_t stream,
                                                     uint64_t* applied_version) {
  return apply_on_engine_stream(__func__, receiver, stream, applied_version,
                                &StepHook::after_launch);
}

shadowsync_status_t shadowsync_receiver_apply_pending_now(shadowsync_receiver_t receiver,
                                                          shadowsync_stream_t stream,
                                                          uint64_t* applied_version) {
  return apply_on_engine_stream(__func__, receiver, stream, applied_version,
                                &StepHook::apply_pending_now);
}

shadowsync_status_t shadowsync_receiver_wait_applied(shadowsync_receiver_t receiver,
                                                     uint64_t version, int64_t timeout_ms,
                                                     shadowsync_stream_t stream) {
  return guard(__func__, [&] {
    auto object = lookup<ReceiverObject>(receiver, "receiver");
    auto stream_object = engine_stream(*object, stream);
    StepHook& hook = object->receiver->step_hook();
    if (!hook.wait_applied(version, deadline_after(timeout_ms), *stream_object->stream)) {
      if (hook.failed_version() >= version) {
        const ReceiverStats stats = object->receiver->stats();
        throw Error(stats.last_failure.code,
                    fmt::format("version {} will not be applied: {}", version, stats.last_error));
      }
      throw Error(ErrorCode::kTimeout,
                  fmt::format("version {} not applied within {} ms (applied: {}, last accepted: "
                              "{})",
                              version, timeout_ms, hook.applied_version(),
                              object->receiver->stats().last_accepted_version));
    }
  });
}

shadowsync_status_t shadowsync_receiver_applied_version(shadowsync_receiver_t receiver,
                                                        uint64_t* version) {
  return guard(__func__, [&] {
    auto object = lookup<ReceiverObject>(receiver, "receiver");
    out_arg(version, "version") = object->receiver->step_hook().applied_version();
  });
}

shadowsync_status_t shadowsync_receiver_ready_version(shadowsync_receiver_t receiver,
                                                      uint64_t* version) {
  return guard(__func__, [&] {
    auto object = lookup<ReceiverObject>(receiver, "receiver");
    out_arg(version, "version") = object->receiver->ready_version();
  });
}

shadowsync_status_t shadowsync_receiver_discard(shadowsync_receiver_t receiver, uint64_t version,
                                                int* was_ready) {
  return guard(__func__, [&] {
    auto object = lookup<ReceiverObject>(receiver, "receiver");
    const bool held = object->receiver->discard(version);
    if (was_ready != nullptr) *was_ready = held ? 1 : 0;
  });
}

shadowsync_status_t shadowsync_receiver_live_tensor(shadowsync_receiver_t receiver, size_t group,
                                                    size_t tensor, void** data) {
  return guard(__func__, [&] {
    auto object = lookup<ReceiverObject>(receiver, "receiver");
    auto& out = out_arg(data, "data");
    check_group(*object->receiver, group);
    const auto& g = object->receiver->layout().groups()[group];
    if (tensor >= g.tensors().size()) {
      throw_invalid(fmt::format("tensor index {} out of range (group '{}' has {} tensors)", tensor,
                                g.name(), g.tensors().size()));
    }
    out = object->receiver->step_hook().live_tensor(group, tensor);
  });
}

shadowsync_status_t shadowsync_receiver_live_tensor_by_name(shadowsync_receiver_t receiver,
                                                            const char* name, void** data) {
  return guard(__func__, [&] {
    auto object = lookup<ReceiverObject>(receiver, "receiver");
    auto& out = out_arg(data, "data");
    const auto it = object->by_name.find(string_arg(name, "name"));
    if (it == object->by_name.end()) {
      throw_invalid(fmt::format("tensor '{}' is not in the receiver's layout", name));
    }
    out = object->receiver->step_hook().live_tensor(it->second.first, it->second.second);
  });
}

shadowsync_status_t shadowsync_receiver_live_arena(shadowsync_receiver_t receiver, size_t group,
                                                   void** data) {
  return query_group(__func__, receiver, group, data, "data", &StepHook::live_arena);
}

shadowsync_status_t shadowsync_receiver_live_content_version(shadowsync_receiver_t receiver,
                                                             size_t group, uint64_t* version) {
  return query_group(__func__, receiver, group, version, "version",
                     &StepHook::live_content_version);
}

shadowsync_status_t shadowsync_receiver_rollback(shadowsync_receiver_t receiver,
                                                 shadowsync_stream_t stream,
                                                 uint64_t* undone_version) {
  return guard(__func__, [&] {
    auto object = lookup<ReceiverObject>(receiver, "receiver");
    auto stream_object = engine_stream(*object, stream);
    const std::uint64_t undone = object->receiver->step_hook().rollback(*stream_object->stream);
    if (undone_version != nullptr) *undone_version = undone;
  });
}

shadowsync_status_t shadowsync_receiver_set_swap_callback(shadowsync_receiver_t receiver,
                                                          shadowsync_swap_callback_t callback,
                                                          void* user_data) {
  return guard(__func__, [&] {
    auto object = lookup<ReceiverObject>(receiver, "receiver");
    if (callback == nullptr) {
      object->receiver->step_hook().set_swap_callback(nullptr);
      return;
    }
    object->receiver->step_hook().set_swap_callback([callback, user_data](const AppliedUpdate& u) {
      std::vector<shadowsync_group_swap_t> swaps;
      swaps.reserve(u.swaps->size());
      for (const GroupSwap& s : *u.swaps) {
        swaps.push_back(shadowsync_group_swap_t{s.group, s.slot, s.content_version});
      }
      callback(user_data, u.version, swaps.data(), swaps.size());
    });
  });
}

shadowsync_status_t shadowsync_receiver_stats(shadowsync_receiver_t receiver,
                                              shadowsync_receiver_stats_t* stats) {
  return guard(__func__, [&] {
    auto object = lookup<ReceiverObject>(receiver, "receiver");
    auto& out = out_arg(stats, "stats");
    if (out.size < sizeof(out.size)) {
      throw_invalid(fmt::format("stats->size is {}: set it to sizeof(shadowsync_receiver_stats_t) "
                                "({}), e.g. with SHADOWSYNC_RECEIVER_STATS_INITIALIZER",
                                out.size, sizeof(shadowsync_receiver_stats_t)));
    }
    const ReceiverStats s = object->receiver->stats();
    shadowsync_receiver_stats_t full{};
    full.size = out.size;
    full.updates_ready = s.updates_ready;
    full.updates_failed = s.updates_failed;
    full.updates_superseded = s.updates_superseded;
    full.bytes_received = s.bytes_received;
    full.last_accepted_version = s.last_accepted_version;
    full.applied_version = object->receiver->step_hook().applied_version();
    full.needs_transport = s.needs_transport ? 1 : 0;
    full.has_pending = object->receiver->step_hook().has_pending() ? 1 : 0;
    full.stuck_aborts = s.stuck_aborts;
    const UpdateReport& failure = s.last_failure;
    full.last_failed_version = failure.version;
    // shadowsync_status_t has the ErrorCode values.
    full.last_failure_status = failure.version != 0 ? static_cast<int32_t>(failure.code) : 0;
    const Layout& layout = object->receiver->layout();
    const std::int64_t group = group_index(layout, failure.failed_group);
    full.last_failed_group = static_cast<int32_t>(group);
    full.last_failed_bucket =
        failure.failed_bucket ? static_cast<int64_t>(*failure.failed_bucket) : -1;
    full.last_failed_tensor = tensor_index(layout, group, failure.failed_tensor);
    full.ready_version = s.ready_version;
    full.last_transfer_ns = s.last_transfer.count();
    const PacingReport& pacing = s.last_pacing;
    if (pacing.paced) {  // unpaced: every pacing field stays 0
      full.last_paced = 1;
      full.last_deadline_limited = pacing.deadline_limited ? 1 : 0;
      full.last_pacing_budget = pacing.budget.value_or(0.0);
      full.last_idle_step_ns = pacing.idle_step.count();
      full.last_step_during_ns = pacing.step_during.count();
      full.last_step_ratio = pacing.step_ratio;
      full.last_pacing_steps = pacing.steps;
      full.last_busy_ns = pacing.busy.count();
      full.last_held_back_ns = pacing.held_back.count();
      full.last_duty = pacing.duty;
    }
    // Not pacing: offer_after_clean_step alone (no budget, no cap) waits for a clean step too.
    full.last_clean_step_wait_ns = pacing.clean_step_wait.count();
    full.last_clean_step_missed = pacing.clean_step_missed ? 1 : 0;
    if (const ReceivePlan* plan = object->receiver->plan()) {
      full.plan_pieces = plan->piece_count();
      full.plan_staging_bytes = plan->staging_bytes();
    }
    full.routed_bytes = s.routed_bytes;
    full.trainer_count = s.trainer_count;
    full.routing_fingerprint = s.routing_fingerprint;
    full.routed_in_place_bytes = s.routed_in_place_bytes;
    const StepHook& hook = object->receiver->step_hook();
    full.gated_swaps = hook.gated_swaps();
    full.gates_abandoned = hook.gates_abandoned();
    full.last_swap_ns = hook.last_swap_duration().count();
    full.last_swap_started_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                    hook.last_swap_started().time_since_epoch())
                                    .count();
    std::memcpy(static_cast<void*>(&out), &full, std::min(out.size, sizeof(full)));
  });
}

shadowsync_status_t shadowsync_receiver_last_update_error(shadowsync_receiver_t receiver,
                                                          char* buffer, size_t capacity,
                                                          size_t* length) {
  return guard(__func__, [&] {
    auto object = lookup<ReceiverObject>(receiver, "receiver");
    const std::string error = object->receiver->stats().last_error;
    if (length != nullptr) *length = error.size();
    if (capacity == 0) return;
    if (buffer == nullptr) throw_invalid(fmt::format("'buffer' is NULL but capacity is {}", capacity));
    const std::size_t n = std::min(error.size(), capacity - 1);
    std::memcpy(buffer, error.data(), n);
    buffer[n] = '\0';
  });
}

}  // extern "C"
