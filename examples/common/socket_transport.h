// A Transport between processes on the host backend, over loopback TCP: the CPU stand-in for
// NCCL in examples/control_channel.cpp (which tests/integration/test_control_e2e.cpp runs as two
// processes). Not part of the library: it shows what a Transport implementation has to do. Like
// NCCL, rank 0 makes a rendezvous id that the control channel carries to the other ranks (here:
// its port and a random cookie in the 128 opaque bytes), the other ranks join with it, and a
// broadcast is a task on a host stream that blocks until the bytes moved. The root writes each
// bucket to every peer in turn. abort() shuts the sockets down, so a task blocked on a dead peer
// returns at once.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "shadowsync/host_backend.h"
#include "shadowsync/transport.h"

namespace shadowsync::examples {

class SocketTransport final : public Transport {
 public:
  // Rank 0: listens on 127.0.0.1 (any port). Send id() to the other ranks, then accept_peers().
  static std::unique_ptr<SocketTransport> listen(HostBackend& backend, int world_size);
  // Rank `rank` (1..world_size-1) joins the root named by `id`.
  static std::unique_ptr<SocketTransport> connect(HostBackend& backend, const RendezvousId& id,
                                                  int rank, int world_size,
                                                  std::chrono::steady_clock::time_point deadline);
  ~SocketTransport() override;

  const RendezvousId& id() const;
  // Rank 0: waits until every other rank joined (cookie checked). Throws Error(kTimeout).
  void accept_peers(std::chrono::steady_clock::time_point deadline);

  std::string_view name() const override { return "socket"; }
  int rank() const override;
  int world_size() const override;
  void broadcast_async(void* buffer, std::size_t bytes, int root, Stream& stream) override;
  std::optional<std::string> async_error() override;
  void abort() noexcept override;

  struct State;

 private:
  SocketTransport(HostBackend& backend, std::shared_ptr<State> state);
  HostBackend& backend_;
  std::shared_ptr<State> state_;
};

}  // namespace shadowsync::examples
