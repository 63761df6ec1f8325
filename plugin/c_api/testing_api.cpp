// The C ABI's test hooks (c_api/shadowsync_testing.h): fault injection into a loopback world,
// loopback routes of a routing plan, an engine arena in host memory, and the host backend's FP8
// quantization on plain memory.
// Not in the product library libshadowsync_c.so: built, with the tests only, into
// libshadowsync_c_testing.so and the static shadowsync_c_api_testing (plugin/c_api/CMakeLists.txt).
#include "c_api/shadowsync_testing.h"

#include <fmt/format.h>

#include <chrono>
#include <memory>
#include <vector>

#include "c_api/c_api_internal.h"
#include "shadowsync/host_backend.h"
#include "transports/loopback/loopback_routes.h"

using namespace shadowsync;
using namespace shadowsync::c_api;

namespace {

// Two host slots and a live slot index: what a receiver that rebinds over an engine arena uses
// of it (slot_address, live_slot). It has no live range to remap.
class HostSlotsArena final : public RemappableArena {
 public:
  HostSlotsArena(std::size_t bytes, int live_slot)
      : bytes_(bytes), slots_{std::vector<std::byte>(bytes), std::vector<std::byte>(bytes)},
        live_slot_(live_slot) {}

  std::byte* live_address() const override { return slot_address(live_slot_); }
  std::size_t bytes() const override { return bytes_; }
  int live_slot() const override { return live_slot_; }
  std::byte* slot_address(int slot) const override { return slots_[slot].data(); }
  void remap_live(int, Stream&, bool) override {
    throw Error(ErrorCode::kBackend,
                "a testing host arena cannot remap: it serves receivers that rebind over it");
  }

 private:
  std::size_t bytes_;
  mutable std::vector<std::byte> slots_[2];
  int live_slot_;
};

}  // namespace

extern "C" {

shadowsync_status_t shadowsync_testing_loopback_inject_delay(shadowsync_loopback_t loopback,
                                                             int rank, uint64_t call,
                                                             int64_t delay_us) {
  return guard(__func__, [&] {
    auto object = lookup<LoopbackObject>(loopback, "loopback");
    if (delay_us < 0) throw_invalid(fmt::format("delay_us is negative: {}", delay_us));
    object->communicator.inject_delay(rank, call, std::chrono::microseconds(delay_us));
  });
}

shadowsync_status_t shadowsync_testing_loopback_inject_drop(shadowsync_loopback_t loopback,
                                                            int rank, uint64_t call) {
  return guard(__func__, [&] {
    auto object = lookup<LoopbackObject>(loopback, "loopback");
    object->communicator.inject_drop(rank, call);
  });
}

shadowsync_status_t shadowsync_testing_loopback_inject_flip(shadowsync_loopback_t loopback,
                                                            int rank, uint64_t call,
                                                            size_t offset) {
  return guard(__func__, [&] {
    auto object = lookup<LoopbackObject>(loopback, "loopback");
    object->communicator.inject_flip(rank, call, offset);
  });
}

shadowsync_status_t shadowsync_testing_host_arena_create(shadowsync_backend_t backend, size_t bytes,
                                                       int live_slot,
                                                       shadowsync_remap_arena_t* arena) {
  return guard(__func__, [&] {
    auto& out = out_arg(arena, "arena");
    auto object = std::make_shared<RemapArenaObject>();
    object->backend = lookup<BackendObject>(backend, "backend");
    if (object->backend->cuda) throw_invalid("a testing host arena needs the host backend");
    if (bytes == 0) throw_invalid("'bytes' is 0: an arena holds at least one byte");
    if (live_slot != 0 && live_slot != 1) {
      throw_invalid(fmt::format("live_slot must be 0 or 1, got {}", live_slot));
    }
    object->arena = std::make_shared<HostSlotsArena>(bytes, live_slot);
    out = to_handle<shadowsync_remap_arena_t>(std::move(object));
  });
}

shadowsync_status_t shadowsync_testing_quantize_fp8(const void* src, const char* dtype,
                                                   size_t elements, size_t parts, void* dst,
                                                   float* scales) {
  return guard(__func__, [&] {
    if (dtype == nullptr) throw_invalid("'dtype' is NULL");
    HostBackend backend;
    auto stream = backend.create_stream(StreamPriority::kLow);
    backend.quantize_fp8_async(src, dtype_from_string(dtype), elements, parts, dst, scales,
                               *stream);
    backend.stream_synchronize(*stream);
  });
}

shadowsync_status_t shadowsync_testing_route_loopback_create(shadowsync_routing_plan_t plan,
                                                            shadowsync_transport_t* trainers,
                                                            size_t trainer_count,
                                                            shadowsync_transport_t* engines,
                                                            size_t engine_count) {
  return guard(__func__, [&] {
    std::shared_ptr<const RoutingPlan> routing = routing_plan_arg(plan);
    const auto counts = [&](const char* what, size_t given, int planned, const void* out) {
      if (given != static_cast<size_t>(planned)) {
        throw_invalid(fmt::format("{} transports asked for {} {} ranks, but the routing plan has "
                                  "{}",
                                  given, what, what, planned));
      }
      if (given > 0 && out == nullptr) throw_invalid(fmt::format("'{}s' is NULL", what));
    };
    counts("trainer", trainer_count, routing->trainer_count(), trainers);
    counts("engine", engine_count, routing->engine_count(), engines);
    LoopbackRouteCommunicator communicator(std::move(routing));  // its transports keep it
    std::vector<std::shared_ptr<TransportObject>> made;
    for (size_t t = 0; t < trainer_count + engine_count; ++t) {
      auto object = std::make_shared<TransportObject>();
      object->transport = t < trainer_count
                              ? communicator.trainer_transport(static_cast<int>(t))
                              : communicator.engine_transport(static_cast<int>(t - trainer_count));
      made.push_back(std::move(object));
    }
    for (size_t t = 0; t < made.size(); ++t) {
      auto handle = to_handle<shadowsync_transport_t>(std::move(made[t]));
      if (t < trainer_count) {
        trainers[t] = handle;
      } else {
        engines[t - trainer_count] = handle;
      }
    }
  });
}

}  // extern "C"
