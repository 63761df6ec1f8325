// LoopbackTransport: ranks are threads of one process, each with its own HostBackend stream. A
// broadcast is collective: each rank's stream blocks in it until every rank has joined and the
// bytes are copied, as with NCCL. Faults can be injected per rank and per broadcast call.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "shadowsync/host_backend.h"
#include "shadowsync/transport.h"

namespace shadowsync {

// One communicator: `world_size` ranks. Create one transport per rank. After an abort the
// communicator is dead; make a new LoopbackCommunicator for the next rendezvous (as with NCCL).
class LoopbackCommunicator {
 public:
  explicit LoopbackCommunicator(int world_size);
  ~LoopbackCommunicator();

  // The transport of `rank`; each rank once. Its streams must come from a HostBackend.
  std::unique_ptr<Transport> transport(int rank);

  // Fault injection. `call` counts broadcast calls of that rank from 0. Thread-safe.
  // Before joining broadcast `call`, rank sleeps `delay` (a slow link).
  void inject_delay(int rank, std::uint64_t call, std::chrono::microseconds delay);
  // From broadcast `call` on, `rank` never joins (its process died); other ranks block until
  // their deadline aborts the communicator. The dropped rank itself reports an error.
  void inject_drop(int rank, std::uint64_t call);
  // After broadcast `call` lands on `rank`, the byte at `offset` of its buffer is flipped.
  void inject_flip(int rank, std::uint64_t call, std::size_t offset);

  std::uint64_t broadcasts_completed() const;  // collectives every rank finished. Thread-safe.

  struct State;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace shadowsync
