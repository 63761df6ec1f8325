// The control channel between one trainer and its engine processes: small authenticated messages
// over TCP (the rendezvous, update headers, acks, errors, aborts). Weights are the model, so the
// channel is a security boundary: every connection proves both ways that it holds a shared token
// (HMAC-SHA256 over fresh nonces; the token never crosses the wire), and every later frame carries
// an authentication tag and a sequence number. There is no confidentiality (no TLS).
//
// Each engine listens (EngineChannel) and the trainer connects to all of them (TrainerChannel),
// because the engine is the long-lived service and the trainer comes and goes: when a trainer goes
// away the engine keeps serving its live weights and waits for the next connection; a restarted
// trainer dials the same address, hands over a new rendezvous (which transport to build and where
// to find the trainer's end of it), and updates resume. No reconnect loop, no address to
// re-register.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shadowsync/error.h"
#include "shadowsync/layout.h"
#include "shadowsync/receiver.h"
#include "shadowsync/transport.h"
#include "shadowsync/update_header.h"

namespace shadowsync {

// --- settings both ends share --------------------------------------------------------------------

// The environment variable read when ControlConfig::token is empty.
inline constexpr const char* kControlTokenEnv = "SHADOWSYNC_CONTROL_TOKEN";
// A shorter token could be guessed offline from one recorded handshake (nonces and proofs travel
// in the clear), so short ones are refused. 32 random bytes, hex-encoded, is a good token.
inline constexpr std::size_t kMinControlTokenBytes = 16;

struct ControlConfig {
  // The shared secret; both ends must hold the same. Empty: read SHADOWSYNC_CONTROL_TOKEN. It is
  // used as the HMAC-SHA256 key and never sent.
  std::string token;
  // From accept (engine) or connect (trainer) until both hellos were exchanged. A peer that
  // connects and sends nothing is dropped after this.
  std::chrono::milliseconds handshake_timeout{5'000};
  // Once the first byte of a frame arrived, the rest must arrive within this (a peer trickling
  // bytes cannot hold a connection half-read). An idle connection between frames has no timeout:
  // a trainer may be silent for a whole training step; TCP keepalive finds dead peers.
  std::chrono::milliseconds frame_timeout{5'000};
  // A frame must be written within this, or the connection is dropped (a peer that stops
  // reading cannot stall the writer).
  std::chrono::milliseconds send_timeout{5'000};
  // Receives one line per event worth a human's attention (a peer refused, a trainer replaced).
  // Empty: "shadowsync control: ..." on stderr. Called from the endpoint's threads, possibly
  // concurrently: it must be thread-safe.
  std::function<void(std::string_view)> log;
};

// `configured` if not empty, else the value of SHADOWSYNC_CONTROL_TOKEN. Throws
// Error(kInvalidArgument) when both are empty or the token is too weak (check_token in token.h:
// shorter than kMinControlTokenBytes, or plainly not random)
// (the message never contains the token). Thread-safe.
std::string resolve_control_token(const std::string& configured);

// --- the rendezvous: which transport, and where ---------------------------------------------------

// The transports a rendezvous can name. The numbers are the wire's (the control frame's).
enum class TransportKind : std::uint16_t {
  kNccl = 1,      // NcclTransport: every rank joins with the trainer's ncclUniqueId
  kSameHost = 2,  // SameHostTransport: each engine connects to the trainer's Unix socket
};

// "nccl", "same_host" (Transport::name() of the transport it names); "unknown" otherwise.
constexpr std::string_view to_string(TransportKind kind) noexcept {
  switch (kind) {
    case TransportKind::kNccl:
      return "nccl";
    case TransportKind::kSameHost:
      return "same_host";
  }
  return "unknown";
}

// A Unix socket path fits sockaddr_un::sun_path (108 bytes) with its NUL.
inline constexpr std::size_t kMaxSameHostPathBytes = 107;

// Where the engines find the trainer's end of a transport: the kind, and its address in that
// kind's terms. Make one with nccl() or same_host().
struct TransportAddress {
  TransportKind kind = TransportKind::kNccl;
  RendezvousId unique_id;  // kNccl: from NcclTransport::generate_unique_id()
  std::string path;        // kSameHost: the socket SameHostTransport::serve() listens on

  static TransportAddress nccl(const RendezvousId& id) {
    TransportAddress address;
    address.unique_id = id;
    return address;
  }
  static TransportAddress same_host(std::string socket_path) {
    TransportAddress address;
    address.kind = TransportKind::kSameHost;
    address.path = std::move(socket_path);
    return address;
  }
};

// --- the engine's end ----------------------------------------------------------------------------

// What a trainer sent for a rendezvous: the transport to build, where the trainer's end of it is,
// and this engine's place in it. For kSameHost the engine proves the same token as on the control
// channel (resolve_control_token), e.g. SameHostTransport::connect(request.transport.path, token,
// request.rank, backend).
struct RendezvousRequest {
  TransportAddress transport;
  int rank = 1;  // 1..world_size-1 (the trainer's sender is usually rank 0)
  int world_size = 2;
};

// Creates this engine's transport for a rendezvous (e.g. NcclTransport::create). Runs on a
// thread of the channel's and may block; throw (or return null) to refuse: the trainer is told.
// When the trainer that asked leaves before it returns, the channel stops waiting for it and
// serves the next trainer; what it returns then is destroyed, never installed. It must be safe to
// call again while such a given-up call still runs.
using TransportFactory = std::function<std::unique_ptr<Transport>(const RendezvousRequest&)>;

struct EngineChannelConfig {
  ControlConfig control;
  // Loopback unless told otherwise: the channel has no confidentiality (no TLS).
  std::string bind_address = "127.0.0.1";  // numeric IPv4
  std::uint16_t port = 0;                  // 0: any free port; port() tells which
  std::uint32_t rank = 0;                  // this engine's rank, reported in its hello
  // At most this many connections that have not proved the token yet (each also has
  // control.handshake_timeout): when one more connects, the oldest of them is closed, so
  // unauthenticated peers cannot pile up, nor hold every slot and lock a trainer out (a trainer
  // proves the token within a round trip). Peers that proved it and the trainer do not count.
  std::size_t max_pending_connections = 8;
};

struct EngineChannelStats {
  std::uint64_t connections_accepted = 0;
  std::uint64_t connections_refused = 0;      // closed for a newer one: max_pending_connections
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

// Listens for the trainer, authenticates it, and turns its frames into calls on the engine's
// Receiver (begin_update, replace_transport, abort_update); sends back acks (`applied version v
// at engine step s`) and errors. The newest authenticated trainer wins: one that completes the
// hello replaces the trainer connected before (which is told why).
//
// Threads: one I/O thread polls the listening socket, every connection and a wake-up pipe; it
// never calls into the receiver. One worker thread runs what the trainer asked for, in order
// (rendezvous, headers, aborts), because the transport factory may block for minutes (NCCL init
// waits for every rank) and a header must not overtake the rendezvous before it. So an endpoint
// has two threads however many peers connect, and one more while a transport factory runs (or
// runs on after its trainer left: see TransportFactory).
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
  // factory still running is waited for. Then releases the receiver's transport
  // (Receiver::release_transport): no trainer can reach this engine any more, and the one told
  // goodbye tears its end down, which NCCL's teardown needs from both ends. Idempotent. Not
  // concurrently with itself.
  void shutdown();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// --- the trainer's end ---------------------------------------------------------------------------

struct EngineAddress {
  std::string host = "127.0.0.1";  // numeric IPv4
  std::uint16_t port = 0;
};

struct TrainerChannelConfig {
  ControlConfig control;
  std::vector<EngineAddress> engines;  // at least one
  // Per engine: the TCP connect, the handshake and the hellos.
  std::chrono::milliseconds connect_timeout{10'000};
};

// What the trainer knows about one engine.
struct EngineStatus {
  EngineAddress address;
  std::uint32_t rank = 0;  // from its hello
  bool connected = false;
  std::string disconnect_reason;            // when not connected
  std::uint64_t last_accepted_version = 0;  // at hello time: a new trainer continues above it
  std::uint64_t applied_version = 0;        // live on the engine (hello, then acks)
  std::uint64_t applied_step = 0;           // engine step at which it became live
  // The last update the engine refused or failed, if any.
  std::uint64_t error_version = 0;
  ErrorCode error_code = ErrorCode::kInternal;
  std::string error;
};

// Connects to every engine, authenticates (both ways), checks each engine's layout, then sends
// the rendezvous, update headers and aborts, and tracks per engine which version is live from its
// acks, so the trainer can bound staleness.
//
// Threads: the constructor connects and handshakes on the calling thread; then one I/O thread
// reads acks and errors from every engine (poll), while sends happen on the calling threads.
class TrainerChannel {
 public:
  // Connects to every engine in order, runs the handshake and exchanges hellos. Throws
  // Error(kInvalidArgument) without a token or engine, Error(kLayoutMismatch) if an engine's
  // layout differs (naming both fingerprints), Error(kTimeout) or Error(kTransport) naming the
  // engine that could not be reached or failed the handshake (a wrong token shows up as the
  // engine closing the connection; the engine logs why).
  TrainerChannel(const Layout& layout, TrainerChannelConfig config);
  ~TrainerChannel();  // close()
  TrainerChannel(const TrainerChannel&) = delete;
  TrainerChannel& operator=(const TrainerChannel&) = delete;

  // Says goodbye ("trainer shutting down") to every engine still connected, closes the
  // connections and stops the I/O thread; afterwards every engine reads as disconnected. Call it
  // before the Sender whose transport the engines share is destroyed: an engine releases its end
  // when its trainer leaves (Receiver::release_transport), and NCCL's teardown within a node waits
  // for both ends, so a Sender destroyed while the channel is still open waits for the engine.
  // Idempotent. Not concurrently with the other calls.
  void close();

  std::size_t engine_count() const;
  std::vector<EngineStatus> engines() const;  // Thread-safe.
  // The highest version any engine had accepted when it said hello: a restarted trainer's next
  // version must be above it (receivers refuse versions that do not increase). Thread-safe.
  std::uint64_t highest_accepted_version() const;

  // Sends engine i the transport to build (`address`) and its rank `first_rank + i` in it, of
  // `world_size` ranks (default: the trainer is rank 0 and the engines follow, world_size =
  // engines + 1). Returns once sent; then create this side's transport (NCCL: create it; same
  // host: serve() on address.path, which returns once every engine connected), and
  // wait_rendezvous(). Throws Error(kInvalidArgument) for ranks that do not fit or an address
  // the engines could not use (a same-host path that is empty, longer than
  // kMaxSameHostPathBytes or holds a NUL byte), naming it; Error(kTransport) naming an engine
  // that is disconnected. Thread-safe.
  void send_rendezvous(const TransportAddress& address, int world_size = 0, int first_rank = 1);
  // The NCCL rendezvous: send_rendezvous(TransportAddress::nccl(id), ...).
  void send_rendezvous(const RendezvousId& id, int world_size = 0, int first_rank = 1);
  // Waits until every engine installed its transport for the last send_rendezvous. Throws
  // Error(kTransport) naming each engine that refused or disconnected; false when `deadline`
  // passes first. Thread-safe.
  bool wait_rendezvous(std::chrono::steady_clock::time_point deadline);

  // Sends the header to every engine. Throws Error(kTransport) naming the engines it could not
  // reach (it still sent to the others). Thread-safe.
  void send_update_header(const UpdateHeader& header);

  // Blocks until every engine acked version `version` or a later one. Returns false when
  // `deadline` passes first. Throws Error naming the engine if one refused or failed that
  // version (with the engine's error code) or disconnected. Thread-safe.
  bool wait_until_all_applied(std::uint64_t version,
                              std::chrono::steady_clock::time_point deadline);

  // Asks every engine to abort the update in flight (Receiver::abort_update). Thread-safe.
  void abort_update(std::uint64_t version, const std::string& reason);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shadowsync
