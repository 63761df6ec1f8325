// Internal to the same-host pull transport: the state a SameHostPullTransport shares with the
// tasks it enqueues on host streams. The handshake (same_host_pull_handshake.cpp) fills it in;
// the data path (same_host_pull_transport.cpp) runs on it. Not installed.
#pragma once

#include <sys/mman.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "transports/same_host/same_host_conversation.h"
#include "transports/same_host/same_host_pull_transport.h"

namespace shadowsync {

// Shared by the transport and every enqueued stream task, so that either may go first. Its
// peers: on a trainer rank, engine rank e at e; on an engine rank, trainer rank t at t.
struct SameHostPullTransport::State : same_host::Conversation {
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
  std::vector<std::string> paths;  // trainer: its own; engine: trainer rank t's at t
  std::vector<Staging> staging;    // trainer: its own; engine: trainer rank t's at t
  std::atomic<std::uint64_t> routed_bytes{0};

  ~State() override {
    for (const Staging& s : staging) {
      if (s.base != nullptr) ::munmap(s.base, s.mapped_bytes);
    }
  }

  void run_send(const RoutedBucket& bucket, const std::byte* packed, std::size_t bytes,
                std::uint64_t call);
  void run_receive(const RoutedBucket& bucket, const std::vector<RouteCopy>& copies,
                   const RouteTargets& targets, std::uint64_t call);
};

}  // namespace shadowsync
