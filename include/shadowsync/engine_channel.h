// The engine side of the control channel: listens for the trainer, authenticates it, and turns
// its frames into calls on the engine's Receiver (begin_update, replace_transport, abort_update);
// sends back acks (`applied version v at engine step s`) and errors.
//
// The engine listens and the trainer connects because the engine is the long-lived service and
// the trainer comes and goes: when a trainer goes away the engine keeps serving its live weights
// and simply waits for the next connection; a restarted trainer dials the same address, hands
// over a new NCCL unique id, and updates resume. No reconnect loop, no address to re-register.
//
// Threads: one I/O thread polls the listening socket, every connection and a wake-up pipe; it
// never calls into the receiver. One worker thread runs what the trainer asked for, in order
// (rendezvous, headers, aborts), because the transport factory may block for minutes (NCCL init
// waits for every rank) and a header must not overtake the rendezvous before it. So an endpoint
// has exactly two threads however many peers connect.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "shadowsync/control_config.h"
#include "shadowsync/error.h"
#include "shadowsync/receiver.h"
#include "shadowsync/transport.h"

namespace shadowsync {

// What a trainer sent for a rendezvous: the communicator to join and this engine's place in it.
struct RendezvousRequest {
  RendezvousId unique_id;
  int rank = 1;            // 1..world_size-1 (the trainer's sender is usually rank 0)
  int world_size = 2;
};

// Creates this engine's transport for a rendezvous (e.g. NcclTransport::create). Runs on the
// channel's worker thread and may block; throw (or return null) to refuse: the trainer is told.
using TransportFactory = std::function<std::unique_ptr<Transport>(const RendezvousRequest&)>;

struct EngineChannelConfig {
  ControlConfig control;
  // Loopback unless told otherwise: the channel has no confidentiality (no TLS).
  std::string bind_address = "127.0.0.1";  // numeric IPv4
  std::uint16_t port = 0;                  // 0: any free port; port() tells which
  std::uint32_t rank = 0;                  // this engine's rank, reported in its hello
  // Connections still in their handshake beyond this are closed at once: unauthenticated peers
  // cannot pile up. The authenticated trainer does not count.
  std::size_t max_pending_connections = 8;
};

struct EngineChannelStats {
  std::uint64_t connections_accepted = 0;
  std::uint64_t connections_refused = 0;      // over max_pending_connections
  std::uint64_t authentication_failures = 0;  // wrong token, replayed handshake
  std::uint64_t protocol_errors = 0;          // malformed or unexpected frames, timeouts
  std::uint64_t trainers_authenticated = 0;   // trainers that completed the hello
  std::uint64_t rendezvous_done = 0;          // transports installed
  std::uint64_t rendezvous_failed = 0;
  std::uint64_t headers_accepted = 0;  // passed to Receiver::begin_update
  std::uint64_t headers_refused = 0;   // begin_update threw; an error went back
  std::uint64_t acks_sent = 0;
  std::uint64_t reports_dropped = 0;   // report_applied found the queue full
  std::uint64_t connections_open = 0;  // in the handshake or the trainer's
  bool trainer_connected = false;
};

class EngineChannel {
 public:
  // Resolves the token (throws Error(kInvalidArgument) without one), binds and listens (throws
  // Error(kTransport) naming the address), and starts the threads. `receiver` must outlive this.
  EngineChannel(Receiver& receiver, TransportFactory factory, EngineChannelConfig config = {});
  ~EngineChannel();  // shutdown()
  EngineChannel(const EngineChannel&) = delete;
  EngineChannel& operator=(const EngineChannel&) = delete;

  // The port it listens on. Thread-safe.
  std::uint16_t port() const;

  // The engine made `version` live before step `engine_step`: the trainer is told. Never
  // blocks and does not allocate: one write of 24 bytes to a non-blocking pipe that the I/O
  // thread drains. With no trainer connected the latest report goes into the next hello. If the
  // pipe is full (thousands of unread reports: the I/O thread is stuck) the report is dropped
  // and counted; a later one supersedes it. Engine thread (any thread).
  void report_applied(std::uint64_t version, std::uint64_t engine_step) noexcept;

  // An update failed after it was accepted (Receiver observer, kFailed): the trainer is told.
  // Thread-safe.
  void report_failed(std::uint64_t version, ErrorCode code, std::string_view message);

  EngineChannelStats stats() const;  // Thread-safe.

  // Says goodbye to the trainer, closes every connection and stops both threads. A transport
  // factory still running is waited for. Idempotent. Thread-safe.
  void shutdown();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shadowsync
