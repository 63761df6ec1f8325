/* Test hooks of the C ABI: fault injection into a loopback world (shadowsync_loopback_t of
 * shadowsync.h) and an engine arena in host memory, for the project's own tests
 * (tests/unit/test_c_api.cpp, python/tests/).
 *
 * Not part of the stable C ABI:
 *  - This header is private to plugin/c_api/ and not installed; SHADOWSYNC_C_API_VERSION does not
 *    cover it, and its functions may change or go away in any release.
 *  - The functions are not in the product library libshadowsync_c.so. Builds with the tests
 *    make them into libshadowsync_c_testing.so (libshadowsync_c.so plus these hooks, which the
 *    Python tests load through SHADOWSYNC_LIBRARY: a hook takes handles of its own library
 *    instance) and the static library shadowsync_c_api_testing (for C++ tests beside the C ABI
 *    archive). The prefix shadowsync_testing_ names them as test hooks wherever they show up
 *    (nm, a ctypes declaration). Production code must not call them.
 *
 * Conventions are those of shadowsync.h: a status per call, the detail in
 * shadowsync_get_last_error(), SHADOWSYNC_INVALID_HANDLE for a handle that is not a live loopback.
 * All are thread-safe. `call` counts the rank's broadcasts from 0 (LoopbackCommunicator::inject_*
 * of loopback_transport.h). */
#ifndef SHADOWSYNC_SHADOWSYNC_TESTING_H_
#define SHADOWSYNC_SHADOWSYNC_TESTING_H_

#include "shadowsync/shadowsync.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Before joining broadcast `call`, `rank` sleeps `delay_us` microseconds (a slow link).
 * SHADOWSYNC_INVALID_ARGUMENT for a negative delay. */
SHADOWSYNC_API shadowsync_status_t shadowsync_testing_loopback_inject_delay(
    shadowsync_loopback_t loopback, int rank, uint64_t call, int64_t delay_us);

/* From broadcast `call` on, `rank` never joins (its process died): the other ranks block until
 * their deadline aborts the world; the dropped rank reports an error. */
SHADOWSYNC_API shadowsync_status_t shadowsync_testing_loopback_inject_drop(
    shadowsync_loopback_t loopback, int rank, uint64_t call);

/* After broadcast `call` lands on `rank`, the byte at `offset` of its buffer is flipped (bytes
 * corrupted in transit; a receiver with checksums refuses the update). */
SHADOWSYNC_API shadowsync_status_t shadowsync_testing_loopback_inject_flip(
    shadowsync_loopback_t loopback, int rank, uint64_t call, size_t offset);

/* An engine arena in host memory on the host backend `backend`: two zero-filled slots of `bytes`
 * each, `live_slot` (0 or 1) the one it shows. For receivers that rebind over an engine arena
 * (shadowsync_receiver_create_with_arenas with swap_strategy rebind), tested on the CPU; it cannot
 * remap (a remap receiver would get SHADOWSYNC_BACKEND_ERROR at its first swap).
 * SHADOWSYNC_INVALID_ARGUMENT for 0 bytes, a live slot other than 0 or 1, or a CUDA backend.
 * Destroyed with shadowsync_remap_arena_destroy. */
SHADOWSYNC_API shadowsync_status_t shadowsync_testing_host_arena_create(
    shadowsync_backend_t backend, size_t bytes, int live_slot, shadowsync_remap_arena_t* arena);

/* HostBackend::quantize_fp8_async on a stream of its own, waited for: `elements` elements of
 * `dtype` ("bf16", "fp16", "fp32") at `src` in `parts` equal parts into `dst` (float8_e4m3fn,
 * `elements` bytes) and `scales` (`parts` floats), as vLLM quantizes a weight after loading
 * (plugin/core/fp8_quantize.h). Plain host memory, no handles: tests compare it with another
 * implementation. SHADOWSYNC_INVALID_ARGUMENT as the backend call refuses. */
SHADOWSYNC_API shadowsync_status_t shadowsync_testing_quantize_fp8(const void* src,
                                                                  const char* dtype,
                                                                  size_t elements, size_t parts,
                                                                  void* dst, float* scales);

/* Loopback routes (plugin/transports/loopback/loopback_routes.h): one in-process communicator of
 * `plan`'s M trainer ranks and N engine ranks, pulling routes on host streams. Writes the
 * transport of trainer rank t to trainers[t] and of engine rank e to engines[e] (each to give to
 * shadowsync_sender_create_for_trainer_rank or to a receiver with
 * shadowsync_receiver_use_routing_plan, or to destroy). SHADOWSYNC_INVALID_ARGUMENT, nothing
 * made, when trainer_count or engine_count is not the plan's (naming both). */
SHADOWSYNC_API shadowsync_status_t shadowsync_testing_route_loopback_create(
    shadowsync_routing_plan_t plan, shadowsync_transport_t* trainers, size_t trainer_count,
    shadowsync_transport_t* engines, size_t engine_count);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* SHADOWSYNC_SHADOWSYNC_TESTING_H_ */
