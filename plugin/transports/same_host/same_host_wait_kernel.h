// Internal to the same-host transport's device flavour: how a stream waits for a counter in
// pinned host memory. Not installed.
//
// A one-thread kernel polls the counter until it reaches `value` (in wrap-around order, as the
// counters of same_host_device.h move). Why a kernel and not cuStreamWaitValue32: a stream-memory
// wait holds the hardware queue its stream is mapped to, so every other stream of the process on
// that queue (the engine's decode stream, the trainer's compute stream) waits with it, for as
// long as the peer takes. A polling kernel holds one thread of one SM instead and leaves the
// queues free. The copy that follows it stays on the copy engines.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace shadowsync::same_host {

// Enqueues the wait on `stream`; returns the launch's error (cudaSuccess when enqueued).
// `counter` is the device pointer of pinned, mapped host memory that host code only moves forward.
cudaError_t launch_wait_until(const std::uint32_t* counter, std::uint32_t value,
                              cudaStream_t stream);

}  // namespace shadowsync::same_host
