// Internal to the same-host transport: its device-memory flavour. Not installed.
//
// Staging. The sender's two slots are one cuMem allocation on its GPU, created exportable as a
// POSIX file descriptor; the fd rides to each receiver with the setup record (SCM_RIGHTS) and the
// setup's handle bytes say how large the allocation is and which GPU holds it. A receiver imports
// the fd and maps it for its own device: the same GPU, or a peer GPU of the host.
//
// Data path. A CUDA stream cannot wait on a socket, so each end runs a progress thread that owns
// the sockets, and streams wait (cuStreamWaitValue32, "counter >= value" in wrap-around order) on
// a counter in pinned host memory that only host code writes, so that it never moves back.
// Chunk c of the connection always travels in slot c % 2, so a receiver can enqueue its copy
// before the doorbell comes:
//   sender, chunk c on the caller's stream: [copy into slot c % 2 unless the caller packed it
//     there] -> host function "slot filled" (the progress thread rings every receiver) -> wait
//     "acked >= c+1" (the progress thread counts a chunk once every receiver acked it);
//   receiver, chunk c on the caller's stream: wait "gate >= c+1" -> cudaMemcpyAsync slot c % 2 ->
//     buffer (copy engines, no SMs) -> host function "copied" (the progress thread acks). The
//     progress thread opens the gate only for a doorbell that passed its checks (the chunk due,
//     its slot and byte count).
// A stream waits only on host code, never on another stream of its process: two streams that
// share one of the device's hardware queues (CUDA_DEVICE_MAX_CONNECTIONS) cannot deadlock.
// But a wait that the sender holds may hold more than its own stream: work of the process that
// the driver queues behind it (a copy-engine queue shared with the engine's own device-to-host
// copies, under investigation) waits for the sender too, and so does an engine step that needs
// it. SHADOWSYNC_SAME_HOST_KERNEL_COPY=1 makes the receiver's copy a kernel
// (same_host_copy_kernel.h); SHADOWSYNC_DEBUG_SAME_HOST=1 traces every chunk on stderr.
// A chunk's broadcast completes on the caller's stream only once every receiver copied it,
// which is what lets the caller pack the slot again (Transport::staging_buffer).
//
// Failure and teardown. An abort, a protocol violation or a lost peer releases every wait at
// once: the counter jumps past every chunk ever enqueued (later broadcasts complete at once, with
// async_error() set). A receiver's copies already enqueued then run: each moves the slot and the
// byte count the receiver itself chose into the buffer it was given for that update, which
// fails; the doorbell's own numbers are never used. The destructor waits, with a deadline, until
// the streams passed every operation that touches this link's memory before freeing it; memory
// a stuck stream might still touch is leaked with a warning rather than freed under it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "shadowsync/backend.h"
#include "shadowsync/same_host_transport.h"
#include "transports/same_host/same_host_frame.h"
#include "transports/same_host/same_host_socket.h"

namespace shadowsync::same_host {

class DeviceLink {
 public:
  // Sender: the staging slots on `backend`'s device; `backend` must be a CudaBackend
  // (Error(kInvalidArgument) otherwise, Error(kBackend) when the device cannot export memory).
  static std::unique_ptr<DeviceLink> create(Backend& backend, std::size_t slot_bytes);
  // Receiver: maps the sender's export for `backend`'s device. Error(kTransport) saying what was
  // tried when it cannot (another host's fd, a GPU without peer access to the sender's).
  static std::unique_ptr<DeviceLink> open(Backend& backend, Fd exported, const Setup& setup,
                                          const std::string& path);
  ~DeviceLink();
  DeviceLink(const DeviceLink&) = delete;
  DeviceLink& operator=(const DeviceLink&) = delete;

  int exported_fd() const;                            // sender: the fd to pass to each receiver
  std::array<std::byte, kHandleBytes> handle() const;  // sender: the setup's handle bytes
  std::byte* slot(std::uint32_t s) const;

  // Starts the progress thread on `state`'s sockets once the handshake is done. `state` outlives
  // this link (it owns it).
  void start(SameHostTransport::State& state);
  // Reserves the chunk numbers of a broadcast of `bytes` bytes and returns the first. The
  // transport calls it under its state's mutex, having checked that it is alive, so that
  // release() covers every chunk reserved before the transport died.
  std::uint64_t reserve(std::size_t bytes);
  // Enqueue a broadcast's chunks on `stream` (a CudaBackend stream of this link's device). The
  // caller's thread only, not under the state's mutex.
  void send_async(const std::byte* buffer, std::size_t bytes, std::uint64_t first_chunk,
                  Stream& stream);
  void receive_async(std::byte* buffer, std::size_t bytes, std::uint64_t first_chunk,
                     Stream& stream);
  // Every wait of every stream is released; the progress thread stops. Any thread; idempotent.
  void release() noexcept;

  struct Impl;

 private:
  explicit DeviceLink(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace shadowsync::same_host
