// Internal to the same-host transport: its device-memory flavour. Not installed.
//
// Staging. The sender's two slots are one cuMem allocation on its GPU, created exportable as a
// POSIX file descriptor; the fd rides to each receiver with the setup record (SCM_RIGHTS) and the
// setup's handle bytes say how large the allocation is and which GPU holds it. A receiver imports
// the fd and maps it for its own device: the same GPU, or a peer GPU of the host.
//
// Data path. A CUDA stream cannot wait on a socket, so each end runs a progress thread that owns
// the sockets. Chunk c of the connection always travels in slot c % 2.
//   sender, chunk c: the CALLER'S THREAD first waits until every receiver acked chunk c - 2
//     (slot c % 2 is free again: the progress thread counts the acks in "acked chunks", a word
//     only host code writes), then enqueues on the caller's stream [copy into slot c % 2 unless
//     the caller packed it there] -> event "slot filled" (once it completed, every receiver is
//     rung by whichever sees it first: the progress thread, or the caller's thread while it
//     spins for acks); before send_async returns, it waits for the ack of the chunk before its
//     last, so that the caller may pack the other slot;
//   receiver, chunk c: the CALLER'S THREAD waits (ChunkGate, same_host_gate.h) until the progress
//     thread received chunk c's doorbell and it passed its checks (the chunk due, its slot and
//     byte count); only then does it enqueue, on the caller's stream, cudaMemcpyAsync slot ->
//     buffer and an event "copied" (the progress thread acks). No stream of the receiver
//     ever waits on a counter.
// The rule: a receiver never leaves GPU work waiting for something only the peer process can
// provide. A stream parked on the sender's doorbell holds more than itself: lazy loading of a
// kernel's module, cudaFree in the engine's caching allocator, cudaDeviceSynchronize or
// torch.cuda.synchronize() wait for every stream of the context, so the engine's own step would
// block on the host until the trainer rings - and a trainer that paces itself on the engine's
// steps never rings (the stall this replaced; a kernel copy instead of a copy engine did not
// help, nor did more hardware queues). Host-gated, a receive blocks its caller, the receiver's
// own thread, never the engine's; the wait ends when the doorbell passed, when the link is
// released (abort() from any thread, a protocol violation, a sender that closed its socket;
// async_error() says which), or after SameHostConfig::doorbell_timeout (the transport then
// fails, naming the chunk and the option). Whatever ends it other than the doorbell, nothing
// more of the broadcast is enqueued.
// The sender's wait for acks is on its caller's thread too (a stream parked on the receivers'
// acks made the GPU time-slice the two processes for as long as it waited); an ack needs only
// the receivers' library threads (their receiver thread, their progress thread) and their
// streams, never the trainer: see send_async.
// Completion is seen by polling: a chunk's operations are followed by a CUDA event (no host
// function: it would hold the stream and wake CUDA's callback thread), which the progress thread
// queries, spinning while a chunk is in flight, and acts on at once (the sender rings, a receiver
// acks). SHADOWSYNC_DEBUG_SAME_HOST=1 traces every chunk on stderr and prints the per-chunk
// timeline's medians when the link goes away; timeline() returns them on request.
// A chunk's broadcast completes on the caller's stream only once every receiver copied it,
// which is what lets the caller pack the slot again (Transport::staging_buffer).
//
// Failure and teardown. An abort, a protocol violation or a lost peer releases every wait at
// once: the sender's counter jumps past every chunk ever enqueued, a receiver's caller stops
// waiting (later broadcasts complete at once, with async_error() set). A receiver's copies
// already enqueued had their doorbell checked; each moves the slot and the byte count the
// receiver itself chose into the buffer it was given for that update, which fails; the
// doorbell's own numbers are never used. The destructor waits, with a deadline, until
// the streams passed every operation that touches this link's memory before freeing it; memory
// a stuck stream might still touch is leaked with a warning rather than freed under it.
#pragma once

#include <array>
#include <chrono>
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
  // `ack_timeout` bounds send_async's and flush()'s waits for acks without progress.
  static std::unique_ptr<DeviceLink> create(Backend& backend, std::size_t slot_bytes,
                                            std::chrono::milliseconds ack_timeout);
  // Receiver: maps the sender's export for `backend`'s device. Error(kTransport) saying what was
  // tried when it cannot (another host's fd, a GPU without peer access to the sender's).
  // `doorbell_timeout` bounds receive_async's wait for each chunk's doorbell.
  static std::unique_ptr<DeviceLink> open(Backend& backend, Fd exported, const Setup& setup,
                                          const std::string& path,
                                          std::chrono::milliseconds doorbell_timeout);
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
  // Enqueue a broadcast's chunks on `stream` (a CudaBackend stream of this link's device), each
  // copied into its slot unless the caller packed it there, its doorbell rung once that is done.
  // Host-gated like a receive: before chunk c reuses slot c % 2, the caller's thread waits until
  // every receiver acked chunk c - 2; before it returns, until they acked the chunk before its
  // last. The stream never waits on the receivers (a stream parked on another process makes two
  // processes' contexts share the GPU by time slices for as long as it waits, and slows the
  // engine's decode the whole time). Returns early, enqueueing nothing more, once the link is
  // released or an ack is late (the transport fails, naming SameHostConfig::doorbell_timeout).
  // The caller's thread only, not under the state's mutex.
  void send_async(const std::byte* buffer, std::size_t bytes, std::uint64_t first_chunk,
                  Stream& stream);
  // Sender: blocks until every receiver acked every chunk reserved so far (or the link is
  // released, or an ack is late: the transport fails). The caller's thread only.
  void flush();
  // Blocks the caller chunk by chunk until each chunk's doorbell passed its checks, enqueueing
  // its copy and ack only then (host-gated, see above); returns early, having enqueued nothing
  // more, once the link is released or a doorbell is late (the transport fails, async_error()
  // names SameHostConfig::doorbell_timeout). Call it from a thread of your own (the Receiver's),
  // never the engine's.
  void receive_async(std::byte* buffer, std::size_t bytes, std::uint64_t first_chunk,
                     Stream& stream);
  // Every wait of every stream is released; the progress thread stops. Any thread; idempotent.
  void release() noexcept;
  // One line: the medians of this side's per-chunk timeline since the last call
  // (same_host_timeline.h). Any thread; a diagnostic, exact once the traffic stopped.
  std::string timeline();

  struct Impl;

 private:
  explicit DeviceLink(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace shadowsync::same_host
