// The trainer side of the control channel: connects to every engine, authenticates (both ways),
// checks each engine's layout, then sends the rendezvous, update headers and aborts, and tracks
// per engine which version is live from its acks, so the trainer can bound staleness.
//
// Threads: the constructor connects and handshakes on the calling thread; then one I/O thread
// reads acks and errors from every engine (poll), while sends happen on the calling thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shadowsync/control_config.h"
#include "shadowsync/error.h"
#include "shadowsync/layout.h"
#include "shadowsync/transport.h"
#include "shadowsync/update_header.h"

namespace shadowsync {

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

class TrainerChannel {
 public:
  // Connects to every engine in order, runs the handshake and exchanges hellos. Throws
  // Error(kInvalidArgument) without a token or engine, Error(kLayoutMismatch) if an engine's
  // layout differs (naming both fingerprints), Error(kTimeout) or Error(kTransport) naming the
  // engine that could not be reached or failed the handshake (a wrong token shows up as the
  // engine closing the connection; the engine logs why).
  TrainerChannel(const Layout& layout, TrainerChannelConfig config);
  ~TrainerChannel();  // goodbye("trainer shutting down") to every engine, then close
  TrainerChannel(const TrainerChannel&) = delete;
  TrainerChannel& operator=(const TrainerChannel&) = delete;

  std::size_t engine_count() const;
  std::vector<EngineStatus> engines() const;  // Thread-safe.
  // The highest version any engine had accepted when it said hello: a restarted trainer's next
  // version must be above it (receivers refuse versions that do not increase). Thread-safe.
  std::uint64_t highest_accepted_version() const;

  // Sends engine i its rank `first_rank + i` in a communicator of `world_size` ranks (default:
  // the trainer is rank 0 and the engines follow, world_size = engines + 1). Returns once sent;
  // then create this side's transport, and wait_rendezvous(). Throws Error(kTransport) naming
  // an engine that is disconnected. Thread-safe.
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
