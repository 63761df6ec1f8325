// Internal to the same-host pull transport: the state a SameHostPullTransport shares with the
// tasks it enqueues on host streams (host flavour) or runs on its callers' threads (device
// flavour). The handshake (same_host_pull_handshake.cpp) fills it in; the data path
// (same_host_pull_transport.cpp) runs on it. Not installed.
#pragma once

#include <sys/mman.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/in_place_copies.h"
#include "transports/same_host/same_host_conversation.h"
#include "transports/same_host/same_host_pull_device.h"
#include "transports/same_host/same_host_pull_transport.h"

namespace shadowsync {

// Shared by the transport and every enqueued stream task, so that either may go first. Its
// peers: on a trainer rank, engine rank e at e; on an engine rank, trainer rank t at t.
// An engine process as messages name it: "engine rank 1", or "engine rank 1, replica 2" for a
// data-parallel replica other than 0.
std::string pull_engine_name(std::uint32_t engine_rank, std::uint32_t replica);

struct SameHostPullTransport::State : same_host::Conversation {
  // One trainer rank's staging as this process maps it: writable on the trainer, read-only on an
  // engine rank.
  struct Staging {
    std::byte* base = nullptr;
    std::size_t mapped_bytes = 0;  // kSlotCount slots
    std::size_t slot_bytes = 0;
    std::shared_ptr<void> device;  // the device flavour's mapping (DeviceSlots::owner); host: null
    std::byte* slot(std::uint32_t s) const { return base + std::size_t{s} * slot_bytes; }
  };
  // A doorbell a device-flavour trainer rang and whose acks it has not read yet.
  struct Unacked {
    RoutedBucket bucket;
    same_host::RouteRecord doorbell;
  };

  std::shared_ptr<const RoutingPlan> plan;
  int trainer_rank = -1;  // this end's role: one of the two is -1
  int engine_rank = -1;
  int replica = 0;  // engine: which data-parallel replica of its engine rank this process is
  std::vector<std::string> paths;  // trainer: its own; engine: trainer rank t's at t
  std::vector<Staging> staging;    // trainer: its own; engine: trainer rank t's at t
  std::atomic<std::uint64_t> routed_bytes{0};

  // Routes read in place (in_place_copies.h; the device flavour only). Trainer rank, its
  // caller's thread: the shard table of the last offer_in_place, whether the current update is
  // sent in place, the table's records as they go to the engines (sent with the next doorbell
  // when `table_unsent`), and the allocations it lies in, sorted by base.
  std::vector<InPlaceSegment> offered;
  bool in_place = false;
  std::vector<std::byte> table_frames;
  std::uint32_t table_records = 0;
  bool table_unsent = false;
  std::vector<same_host::SharedAllocation> shared;
  // Engine rank: each trainer rank's table, [trainer][group] sorted by packing offset, in this
  // process's addresses; the mappings each table's addresses lie in, [trainer] by handle (a
  // new table keeps those it names and lets the others go); and the bytes its copies read in
  // place.
  using Mappings =
      std::map<std::array<std::byte, same_host::kHandleBytes>, same_host::MappedAllocation>;
  std::vector<std::vector<std::vector<InPlaceSegment>>> tables;
  std::vector<Mappings> mapped;
  std::atomic<std::uint64_t> routed_in_place_bytes{0};

  // The device flavour: its calls run on the caller's thread (gated as same_host_device.h's: no
  // stream ever waits on a peer), with `backend`'s streams and events; every wait for a peer is
  // bounded by `peer_timeout` (SameHostConfig::doorbell_timeout).
  bool device = false;
  Backend* backend = nullptr;  // the caller's; it outlives the transport
  std::chrono::milliseconds peer_timeout{0};
  std::unique_ptr<Event> passed;   // recorded on the caller's stream, waited on by its thread
  std::optional<Unacked> unacked;  // trainer rank: the caller's thread only

  // The records a stream task (or a device-flavour caller) waits for from every peer, while it
  // waits: the doorbells of a bucket on an engine rank, its acks on a trainer rank. Under mutex;
  // describe_wait() words it for waiting_for().
  struct PeerWait {
    RoutedBucket bucket;
    std::vector<bool> arrived;  // [peer]
    same_host::Clock::time_point since;
  };
  std::optional<PeerWait> peer_wait;
  std::optional<std::string> describe_wait();

  // Engine processes per engine rank. A trainer rank's peers are seated replica by replica:
  // peer p is engine rank p % engine_count, replica p / engine_count.
  int replicas() const {
    return trainer_rank >= 0 ? static_cast<int>(peers.size()) / plan->engine_count() : 1;
  }
  // This end and its peer `p` as messages name them: "trainer rank 0", "engine rank 1" (", replica
  // 2" where there are replicas).
  std::string self_name() const;
  std::string peer_name(std::size_t p) const;

  ~State() override {
    for (const Staging& s : staging) {
      if (s.base != nullptr && !s.device) ::munmap(s.base, s.mapped_bytes);
    }
  }

  // One bucket on a trainer rank: `packed` into slot call % 2 (unless packed there), the
  // doorbell to every engine rank, every engine rank's ack.
  void run_send(const RoutedBucket& bucket, const std::byte* packed, std::size_t bytes,
                std::uint64_t call);
  void run_receive(const RoutedBucket& bucket, const std::vector<RouteCopy>& copies,
                   const RouteTargets& targets, std::uint64_t call);
  // The device flavour's, on the caller's thread: a send returns once its doorbell rang and the
  // previous bucket's acks came (the slot the caller packs next is free); flush_acks() reads the
  // last one's. A receive returns once its copies landed and were acked.
  void gated_send(const RoutedBucket& bucket, const std::byte* packed, std::size_t bytes,
                  Stream& stream, std::uint64_t call);
  void gated_receive(const RoutedBucket& bucket, std::span<const RouteCopy> copies,
                     const RouteTargets& targets, Stream& stream);
  void flush_acks();

  // The steps both flavours share. Each returns false once the transport is dead (aborted, or
  // failed: fail() then named the peer, the bucket and what went wrong).
  bool ring(const RoutedBucket& bucket, const same_host::RouteRecord& doorbell);
  bool await_acks(const RoutedBucket& bucket, const same_host::RouteRecord& doorbell,
                  std::optional<same_host::Clock::time_point> deadline);
  bool await_doorbells(const RoutedBucket& bucket, std::vector<same_host::RouteRecord>& doorbells,
                       std::optional<same_host::Clock::time_point> deadline);
  bool send_acks(const RoutedBucket& bucket, const std::vector<same_host::RouteRecord>& doorbells);
  // Engine rank: reads the `records` shard records trainer rank `t` sent after its doorbell of
  // `bucket`, maps what they name and makes them its table.
  bool read_table(std::size_t t, std::uint32_t records, const RoutedBucket& bucket,
                  same_host::Clock::time_point deadline);
  // Waits on the caller's thread until `stream` passed everything enqueued on it so far.
  bool await_stream(Stream& stream, const RoutedBucket& bucket, const char* what);
};

}  // namespace shadowsync
