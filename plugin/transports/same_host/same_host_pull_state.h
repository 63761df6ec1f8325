// Internal to the same-host pull transport: the state a SameHostPullTransport shares with the
// tasks it enqueues on host streams. The handshake (same_host_pull_handshake.cpp) fills it in;
// the data path (same_host_pull_transport.cpp) runs on it. Not installed.
#pragma once

#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "transports/same_host/same_host_pull_transport.h"
#include "transports/same_host/same_host_socket.h"

namespace shadowsync {

// Shared by the transport and every enqueued stream task, so that either may go first.
struct SameHostPullTransport::State {
  // One trainer rank's staging as this process maps it: writable on the trainer, read-only on an
  // engine rank.
  struct Staging {
    std::byte* base = nullptr;
    std::size_t mapped_bytes = 0;  // kSlotCount slots
    std::size_t slot_bytes = 0;
    std::byte* slot(std::uint32_t s) const { return base + std::size_t{s} * slot_bytes; }
  };

  std::shared_ptr<const RoutingPlan> plan;
  int trainer_rank = -1;  // this end's role: one of the two is -1
  int engine_rank = -1;
  std::vector<std::string> paths;    // trainer: its own; engine: trainer rank t's at t
  std::vector<Staging> staging;      // trainer: its own; engine: trainer rank t's at t
  same_host::Fd wake;                // eventfd: readable once aborted
  std::vector<same_host::Fd> peers;  // trainer: engine rank e at e; engine: trainer rank t at t

  std::mutex mutex;
  std::condition_variable turn_changed;
  std::uint64_t calls_enqueued = 0;  // the caller's thread only
  std::uint64_t calls_done = 0;      // under mutex
  bool aborted = false;              // under mutex
  bool broken = false;               // under mutex: a failure put the ranks out of step
  std::optional<std::string> error;  // under mutex: the first failure
  std::atomic<std::uint64_t> routed_bytes{0};

  ~State() {
    for (const Staging& s : staging) {
      if (s.base != nullptr) ::munmap(s.base, s.mapped_bytes);
    }
  }

  void fail(std::string reason) {
    std::lock_guard lock(mutex);
    if (!error) error = std::move(reason);
    broken = true;
    turn_changed.notify_all();
  }

  void do_abort(std::string reason) noexcept {
    {
      std::lock_guard lock(mutex);
      if (aborted) return;
      aborted = true;
      if (!error) error = std::move(reason);
      turn_changed.notify_all();
    }
    const std::uint64_t one = 1;
    if (wake) [[maybe_unused]]
      auto written = ::write(wake.get(), &one, sizeof(one));
    // The peers see EOF at once and fail their update, as if this process had died.
    for (same_host::Fd& peer : peers) ::shutdown(peer.get(), SHUT_RDWR);
  }

  // Waits until call `call` may run: calls run in the order they were enqueued, whatever
  // streams they went to, since each is one step of the same conversation with the peers.
  // False when the transport is dead (the call then does nothing: as an aborted NCCL
  // collective, it completes with async_error() set).
  bool wait_turn(std::uint64_t call) {
    std::unique_lock lock(mutex);
    turn_changed.wait(lock, [&] { return aborted || broken || calls_done == call; });
    return !aborted && !broken;
  }
  void end_turn() {
    std::lock_guard lock(mutex);
    ++calls_done;
    turn_changed.notify_all();
  }

  void run_send(const RoutedBucket& bucket, const std::byte* packed, std::size_t bytes,
                std::uint64_t call);
  void run_receive(const RoutedBucket& bucket, const std::vector<RouteCopy>& copies,
                   const RouteTargets& targets, std::uint64_t call);
};

}  // namespace shadowsync
