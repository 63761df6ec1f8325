// Remap arenas through the C ABI: the live memory an engine makes before it meets a receiver
// (shadowsync_receiver_create_with_arenas takes them).
#include <fmt/format.h>

#include "c_api/c_api_internal.h"

using namespace shadowsync;
using namespace shadowsync::c_api;

extern "C" {

shadowsync_status_t shadowsync_remap_arena_create(shadowsync_backend_t backend, size_t bytes,
                                                  shadowsync_remap_arena_t* arena) {
  return guard(__func__, [&] {
    auto& out = out_arg(arena, "arena");
    auto object = std::make_shared<RemapArenaObject>();
    object->backend = lookup<BackendObject>(backend, "backend");
    Backend& device = *object->backend->backend;
    if (bytes == 0) throw_invalid("'bytes' is 0: a remap arena holds at least one byte");
    if (const std::string why = device.remap_unsupported_reason(); !why.empty()) {
      throw_not_supported(fmt::format("a remap arena of {} bytes on backend '{}': {}", bytes,
                                      device.name(), why));
    }
    object->arena = device.create_remappable_arena(bytes);
    out = to_handle<shadowsync_remap_arena_t>(std::move(object));
  });
}

shadowsync_status_t shadowsync_remap_arena_info(shadowsync_remap_arena_t arena,
                                                shadowsync_remap_arena_info_t* info) {
  return guard(__func__, [&] {
    auto object = lookup<RemapArenaObject>(arena, "arena");
    auto& out = out_arg(info, "info");
    const RemappableArena& a = *object->arena;
    out.live = a.live_address();
    out.slot[0] = a.slot_address(0);
    out.slot[1] = a.slot_address(1);
    out.bytes = a.bytes();
    out.live_slot = a.live_slot();
  });
}

shadowsync_status_t shadowsync_remap_arena_destroy(shadowsync_remap_arena_t arena) {
  return guard(__func__, [&] { Registry::instance().remove<RemapArenaObject>(arena, "arena"); });
}

}  // extern "C"
