// The sender (trainer side): packs a group's scattered tensors into the arena byte image bucket
// by bucket, through two staging buffers so that packing bucket k+1 overlaps broadcasting bucket
// k, one broadcast per bucket. publish() returns at once; a worker thread drives the update.
//
// Threads: the calls below say which threads may make them; one worker thread of the sender
// sends the updates, one at a time in the order they were published. Streams: the sender's own
// two (packing and broadcasting); the caller's tensors are read on them. Ownership: the sender
// owns its staging buffers, streams, thread and transport; the backend must outlive it; the
// caller's tensors must stay valid until the handle is done (publish, publish_arenas) or the
// supply() that handed them over returned (publish_streamed).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "shadowsync/backend.h"
#include "shadowsync/layout.h"
#include "shadowsync/transport.h"
#include "shadowsync/update_header.h"

namespace shadowsync {

struct SenderConfig {
  int root_rank = 0;  // this process's rank in the transport
  std::chrono::milliseconds update_deadline{60'000};
  std::chrono::microseconds poll_interval{200};
  // Compute a checksum of every bucket on the sender's streams and broadcast them as one small
  // block after the last bucket (see carries_checksums in update_header.h); receivers verify them
  // before offering the update. On by default: both sides overlap the checksums with the
  // transfer, so what they add is about one bucket's checksum (~0.15 ms for 512 MiB on an H200:
  // +0.3 % of an 8B update's transfer at 368 GB/s; docs/benchmarks.md). Needs a backend whose
  // supports_integrity() is true (both built-in backends); set false for one that has not.
  bool checksums = true;
};

// One tensor as the trainer holds it: memory of the sender's backend, contiguous.
struct SourceTensor {
  std::string name;
  const void* data = nullptr;
  DType dtype = DType::kBFloat16;
  std::vector<std::int64_t> shape;
};

// What one trainer rank holds of a wire tensor (DESIGN §14): a box of index ranges over the
// tensor's dimensions, begin[d] <= index[d] < end[d] (an FSDP2 Shard(d) slice, a Megatron
// column- or row-parallel slice), or elements [first, first + count) of the row-major tensor (a
// ZeRO-3 flat partition).
struct TensorRegion {
  enum class Kind { kBox, kElements };
  Kind kind = Kind::kBox;
  std::vector<std::int64_t> begin;  // kBox
  std::vector<std::int64_t> end;    // kBox
  std::int64_t first = 0;           // kElements
  std::int64_t count = 0;           // kElements

  static TensorRegion box(std::vector<std::int64_t> begin, std::vector<std::int64_t> end) {
    return {Kind::kBox, std::move(begin), std::move(end), 0, 0};
  }
  static TensorRegion elements(std::int64_t first, std::int64_t count) {
    return {Kind::kElements, {}, {}, first, count};
  }
};

// One trainer rank's shard of a wire tensor: `region` of it, in memory of the sender's backend,
// contiguous in row-major order of the region (the local tensor FSDP2's to_local() gives, a
// Megatron slice, a ZeRO-3 partition without its padding).
struct SourceShard {
  std::string name;
  const void* data = nullptr;
  DType dtype = DType::kBFloat16;
  TensorRegion region;
};

class RoutingPlan;  // plugin/core/routing_plan.h: which trainer rank sends which bytes (§14)

// Tracks one publish. Copyable; all copies see the same update. Thread-safe.
class PublishHandle {
 public:
  const UpdateHeader& header() const;  // what the receivers must be given (begin_update)
  bool done() const;                   // finished, successfully or not
  // Blocks until done; throws the update's Error if it failed.
  void wait() const;
  // As wait(), but returns false if `timeout` passes first.
  bool wait_for(std::chrono::nanoseconds timeout) const;

  struct State;
  explicit PublishHandle(std::shared_ptr<State> state) : state_(std::move(state)) {}

 private:
  std::shared_ptr<State> state_;
};

// A publish whose tensors the caller supplies while it runs, in layout order: ZeRO-3 style
// trainers gather each bucket's parameters just in time and free them again, instead of holding
// the whole gathered model until the update is done. Made by Sender::publish_streamed. Move-only:
// destroying it (or cancel()) before every tensor was supplied fails the update (the receivers
// discard it). Its handle() outlives it.
class StreamedPublish {
 public:
  struct State;
  StreamedPublish(PublishHandle handle, std::shared_ptr<State> state);
  StreamedPublish(StreamedPublish&&) noexcept;
  StreamedPublish& operator=(StreamedPublish&&) noexcept;
  StreamedPublish(const StreamedPublish&) = delete;
  StreamedPublish& operator=(const StreamedPublish&) = delete;
  ~StreamedPublish();  // cancel() unless complete

  const PublishHandle& handle() const { return handle_; }
  const UpdateHeader& header() const { return handle_.header(); }

  // The order tensors must be supplied in: the update's groups in layout order, each group's
  // tensors in spec order, as (group index, tensor index). Thread-safe.
  const std::vector<std::pair<std::size_t, std::size_t>>& order() const;
  std::size_t supplied() const;  // tensors supplied so far. Thread-safe.

  // Supplies the next tensors of order() (any number, across groups and buckets). Checks each
  // like publish() (name in order, dtype, shape, non-null data) and throws Error(kInvalidArgument)
  // naming the tensor and both values, consuming nothing. Then blocks until their bytes have been
  // copied out into the sender's staging buffers: when it returns the caller may free them. A
  // staging buffer is reused only once its bucket was broadcast, so this also waits for the
  // receivers to keep up (the update's deadline bounds it). Throws the update's Error if the update
  // failed; nothing more can be supplied then. One caller thread at a time.
  void supply(const std::vector<SourceTensor>& tensors);

  // Gives up on an incomplete update: it fails with Error(kInvalidArgument), the transport is
  // aborted (the receivers discard it). Nothing once every tensor was supplied. Thread-safe.
  void cancel() noexcept;

 private:
  PublishHandle handle_;
  std::shared_ptr<State> state_;
};

class Sender {
 public:
  Sender(Layout layout, Backend& backend, std::unique_ptr<Transport> transport,
         SenderConfig config = {});
  // Trainer rank `trainer_rank` of a sharded trainer (DESIGN §14): it publishes only its shards
  // (publish_shards), each bucket's bytes it holds packed into one of two staging slots of
  // routing->max_packed_bytes(trainer_rank) (staging_bytes()) and handed to the transport's
  // RouteMover, which every engine rank pulls its routes from. `transport` (null: given later by
  // replace_transport) must move routes for trainer rank `trainer_rank` of the same plan.
  // Routed updates carry no checksums yet (a per-route checksum is a follow-up): the default
  // config here has them off, and SenderConfig::checksums set is refused. Throws
  // Error(kInvalidArgument) naming both values for a null plan, a rank outside 0..M-1, a
  // transport without a RouteMover or of another rank or plan, and Error(kLayoutMismatch) for a
  // plan of another wire layout (both fingerprints); nothing is started then.
  Sender(Layout layout, Backend& backend, std::unique_ptr<Transport> transport,
         std::shared_ptr<const RoutingPlan> routing, int trainer_rank,
         SenderConfig config = {.checksums = false});
  ~Sender();
  Sender(const Sender&) = delete;
  Sender& operator=(const Sender&) = delete;

  // Publishes `groups` at `version` from the trainer's tensors. Every tensor of those groups must
  // be in `tensors` with its spec's dtype and shape; tensors of other known groups are ignored.
  // Checks everything first and throws Error naming the tensor and both values (nothing is
  // sent). The tensors must stay unchanged until the handle is done. Thread-safe.
  PublishHandle publish(std::uint64_t version, const std::vector<std::string>& groups,
                        const std::vector<SourceTensor>& tensors);

  // Publishes from arenas that already have the layout's byte image (one per group, in the
  // order of `groups`): broadcast straight from them, no packing. Thread-safe.
  PublishHandle publish_arenas(std::uint64_t version, const std::vector<std::string>& groups,
                               const std::vector<const void*>& arenas);

  // Starts publishing `groups` at `version` with no tensor yet: the header is ready at once (send
  // it to the receivers), the caller supplies the tensors through the returned object in layout
  // order while buckets are broadcast. The update's deadline (SenderConfig::update_deadline)
  // covers the whole of it, gathering included. Thread-safe.
  StreamedPublish publish_streamed(std::uint64_t version, const std::vector<std::string>& groups);

  // A routed sender (the constructor with a routing plan): publishes `groups` at `version` from
  // this trainer rank's shards. Every tensor of those groups the plan says this rank holds must
  // be in `shards`, with its spec's dtype and exactly the region the plan was built with;
  // shards of tensors it holds nothing of (a replicated tensor another rank sends) and of other
  // groups are ignored. Checks everything first and throws Error(kInvalidArgument) naming the
  // tensor, the rank and both values (nothing is sent). Every trainer rank publishes the same
  // versions and groups; the engine ranks are given the header of any of them. The shards must
  // stay unchanged until the handle is done. Thread-safe.
  PublishHandle publish_shards(std::uint64_t version, const std::vector<std::string>& groups,
                               const std::vector<SourceShard>& shards);

  // Installs a new transport after a failure aborted the old one. A routed sender's must move
  // routes of its plan for its rank (refused as in the constructor). Thread-safe.
  void replace_transport(std::unique_ptr<Transport> transport);

  const Layout& layout() const { return layout_; }
  // The staging memory the sender packs into, allocated at the first update (or the transport's
  // own): two buckets, or for a routed sender two slots of the plan's max_packed_bytes of its
  // rank, the only trainer memory a routed publish adds. Thread-safe.
  std::size_t staging_bytes() const;

  // A routed sender's last update: whether its routes were read in place by the engines, where
  // the shards lie (nothing packed; the same-host pull transport on GPUs), and if not, why (host
  // memory, a transport that cannot, memory CUDA IPC cannot share). nullopt before the first
  // routed update. Thread-safe.
  struct RoutesInPlace {
    bool in_place = false;
    std::string why_not;  // empty when in place
  };
  std::optional<RoutesInPlace> routes_in_place() const;

 private:
  struct Impl;
  Layout layout_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shadowsync
