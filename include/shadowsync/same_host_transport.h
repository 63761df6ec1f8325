// SameHostTransport: the Transport interface between processes of one host (a trainer and its
// engines as CPU processes, or on one GPU / GPUs of one host), over a Unix domain socket and
// staging memory the sender shares once per connection.
//
// Connection. The sender (rank 0, the root of every broadcast) listens on a Unix socket at `path`;
// each receiver (ranks 1..receivers) connects. Both ends prove the shared token with an
// HMAC-SHA256 challenge-response over fresh nonces (each side over the other's nonce, distinct
// labels per role) before anything else is sent; only then does the sender share its staging
// memory: two slots of `slot_bytes`, in one memory file (memfd, passed with SCM_RIGHTS) for the
// host flavour. Once every receiver is connected the sender closes its listener and unlinks the
// socket file; a file left by a sender that died while waiting is detected (connect() is refused)
// and replaced by the next sender. The socket's directory must be the user's own and closed to
// everyone else (mode 0700, created when absent); any other directory, or a path that exists and
// is not a socket, is refused with an error naming what was found.
//
// Data. A broadcast of n bytes is cut into chunks of at most slot_bytes. For each chunk the
// sender's stream task puts the bytes in a slot (nothing to do when the caller packed them there:
// staging_buffer()), rings a doorbell on every receiver's socket ("chunk <sequence> is in slot s,
// offset o, n bytes") and waits for every receiver's ack before the task ends; a slot is thus
// reused only once every receiver copied it out. A receiver's stream task waits for the doorbell
// of exactly the chunk it expects (its own call count), checks it (slot and byte range inside the
// staging memory, the byte count it was asked to receive), copies slot -> buffer and acks. A
// doorbell that fails a check is a protocol violation: nothing is copied, async_error() names it,
// and the stream task returns.
//
// Streams. The host flavour runs on HostBackend streams: the stream task itself blocks in poll()
// on the sockets and an eventfd that abort() signals, as a loopback collective blocks its stream
// (a host stream is a thread of its own: nothing else of the process waits for it). The device
// flavour runs on CudaBackend streams, whose work the whole CUDA context may wait for, and keeps
// one rule: a receiver never leaves GPU work waiting for something only the peer process can
// provide. Lazy loading of a kernel's module, cudaFree in a caching allocator, a device-wide
// synchronize (torch.cuda.synchronize()) in the engine's process wait for every stream of the
// context; a receive stream parked on the sender's doorbell would block the engine's own step on
// the host until the trainer rings, and a trainer that waits for engine steps would never ring.
// So on a device-flavour receiver broadcast_async blocks its calling thread until each chunk's
// doorbell arrived and passed its checks, and only then enqueues the chunk's copy (slot ->
// buffer) and its ack: call it from a thread of your own (the Receiver's), never the engine's.
// The wait ends without enqueueing anything more when abort() is called from any thread, the
// sender closed its socket or broke the protocol, or SameHostConfig::doorbell_timeout passes
// (then the transport fails, and async_error() names the chunk and the option). The sender's
// broadcast_async returns at once; its stream waits for the receivers' acks, which need only the
// receivers' own library threads and streams, never the trainer's host code.
//
// Failures, as NcclTransport: a peer that closes its socket (its process died) or breaks the
// protocol sets async_error(); the transport never times out by itself (callers poll against
// their deadlines and call abort()), except that a device-flavour receiver's wait for a doorbell
// inside broadcast_async is bounded by SameHostConfig::doorbell_timeout. abort() wakes every waiting stream task, shuts the sockets
// down and makes the transport dead: later broadcasts complete at once with async_error() set.
// A new connection needs a new transport (serve/connect again), as after ncclCommAbort.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "shadowsync/backend.h"
#include "shadowsync/transport.h"

namespace shadowsync {

enum class SameHostMemory {
  kHost = 0,    // staging in a shared memory file; HostBackend streams
  kDevice = 1,  // staging in device memory shared through the CUDA driver; CudaBackend streams
};

struct SameHostConfig {
  // serve(): how long to wait for every receiver to connect and authenticate. connect(): how long
  // to wait for a sender to listen (the engine may start first, or wait for a restarted trainer).
  std::chrono::milliseconds connect_timeout{std::chrono::seconds(60)};
  // Each peer's handshake must complete within this (serve(): from its connection on, for each
  // peer on its own; connect(): from the connection on).
  std::chrono::milliseconds handshake_timeout{std::chrono::seconds(5)};
  // Device flavour, receiver: how long broadcast_async waits on its calling thread for each
  // chunk's doorbell before the transport fails (async_error() names this option). The default
  // matches ReceiverConfig::bucket_deadline's; keep it at least that long, or the transport gives
  // up on a slow sender before the receiver would. Must be positive. Not used by the host
  // flavour, whose stream tasks wait until abort().
  std::chrono::milliseconds doorbell_timeout{std::chrono::seconds(10)};
};

class SameHostTransport final : public Transport {
 public:
  // Sender side (rank 0 of 1 + receivers). Checks (or creates, mode 0700) the socket's
  // directory, listens on `path`, and blocks until `receivers` receivers connected and proved
  // `token`. Every connection's handshake runs beside the others', each within
  // config.handshake_timeout, so a peer that connects and says nothing delays no receiver; one
  // that fails or stalls is dropped and the wait goes on. Throws Error(kTimeout) after
  // config.connect_timeout naming how many came, the ranks missing and each peer that stalled or
  // was refused (its pid and uid, and what it did not send).
  // `slot_bytes` is the size of each of the two staging slots: the sender's bucket size
  // (Layout::bucket_bytes()). Bad arguments, paths and directories: Error(kInvalidArgument).
  static std::unique_ptr<SameHostTransport> serve(const std::string& path, std::string_view token,
                                                  int receivers, Backend& backend,
                                                  SameHostMemory memory, std::size_t slot_bytes,
                                                  SameHostConfig config = {});

  // Receiver side: connects to the sender at `path` as `rank` (1..receivers), retrying until one
  // listens or config.connect_timeout passes (Error(kTimeout)), proves `token` and checks the
  // sender's proof (Error(kTransport) naming which side refused), then maps the staging memory
  // (Error(kTransport) saying what was tried when it cannot).
  static std::unique_ptr<SameHostTransport> connect(const std::string& path,
                                                    std::string_view token, int rank,
                                                    Backend& backend, SameHostConfig config = {});

  ~SameHostTransport() override;
  SameHostTransport(const SameHostTransport&) = delete;
  SameHostTransport& operator=(const SameHostTransport&) = delete;

  std::string_view name() const override { return "same_host"; }
  int rank() const override;
  int world_size() const override;
  // `root` must be 0 (the sender); `stream` must come from a HostBackend (host flavour) or a
  // CudaBackend on the transport's device (device flavour). On a device-flavour receiver it
  // blocks the calling thread until each chunk's doorbell came (see "Streams" above).
  void broadcast_async(void* buffer, std::size_t bytes, int root, Stream& stream) override;
  void* staging_buffer(int index, std::size_t bytes) override;
  // Device flavour, sender: waits until every receiver acked every chunk (broadcast_async returns
  // before the last chunk of a broadcast was copied out). Nothing otherwise.
  void flush() override;
  std::optional<std::string> async_error() override;
  void abort() noexcept override;

  SameHostMemory memory() const;
  std::size_t slot_bytes() const;
  // A diagnostic of the device flavour: one line of medians of this side's per-chunk timeline
  // (sender: enqueued, slot filled, doorbell rung, acked; receiver: doorbell, gate opened, copy
  // enqueued, copy done, ack sent) over the chunks since the last call, which it forgets. Take
  // it once the traffic stopped. Empty for the host flavour. Any thread.
  std::string timeline_summary();

  struct State;

 private:
  explicit SameHostTransport(std::shared_ptr<State> state);
  void check_broadcast(const void* buffer, std::size_t bytes, int root) const;
  void broadcast_on_device(void* buffer, std::size_t bytes, int root, Stream& stream);
  std::shared_ptr<State> state_;
};

}  // namespace shadowsync
