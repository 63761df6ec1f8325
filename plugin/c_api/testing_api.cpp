// The C ABI's test hooks (c_api/shadowsync_testing.h): fault injection into a loopback world.
// Exported from libshadowsync_c.so like the rest of the C ABI; the shadowsync_testing_ prefix
// marks them.
#include "c_api/shadowsync_testing.h"

#include <fmt/format.h>

#include <chrono>

#include "c_api/c_api_internal.h"

using namespace shadowsync;
using namespace shadowsync::c_api;

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

}  // extern "C"
