// Internal to the same-host transport's device flavour: a chunk copy done by SMs instead of a
// copy engine (same_host_copy_kernel.cu). Not installed.
//
// Why it exists: a receiver enqueues each chunk's copy behind a wait on a host counter that only
// the sender's doorbell opens. A cudaMemcpyAsync there is work for a copy engine queued behind
// that wait; if the driver feeds the copies of several streams of the process through one copy
// queue, every later copy of the process (the engine's own device-to-host reads of its logits)
// waits for the sender too. A kernel keeps the chunk's work on the waiting stream's own queue.
// Chosen with SHADOWSYNC_SAME_HOST_KERNEL_COPY=1 while that is being measured (see
// same_host_device.cpp).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace shadowsync::same_host {

// Enqueues on `stream` a copy of `bytes` bytes from `src` to `dst` (device-accessible, not
// overlapping) and returns the launch's error (cudaSuccess when enqueued). Nothing for 0 bytes.
cudaError_t launch_chunk_copy(void* dst, const void* src, std::size_t bytes, cudaStream_t stream);

}  // namespace shadowsync::same_host
