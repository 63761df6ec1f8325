// Moving routes (DESIGN §14): the capability a transport offers for sharded trainers, where M
// trainer ranks each hold part of every tensor and N engine ranks each need part of it. A
// transport that can move routes returns a RouteMover from Transport::route_mover(); the others
// return nullptr and carry whole buckets by broadcast as before (STYLE: capabilities are asked).
//
// One update is the wire layout's buckets in order (group by group, bucket by bucket: `sequence`
// counts them from 0 within the update). For every bucket, every trainer rank calls
// send_routes_async once (with zero bytes where it holds nothing the bucket's engines need: the
// doorbell still rings, so that a dead trainer rank fails the update on every engine rank and a
// rank publishing another version is caught), and every engine rank calls receive_routes_async
// once. Both are stream-ordered, as broadcasts are: they return once enqueued, and the stream's
// work completes when the bucket's bytes moved (trainer side: every engine rank finished reading
// this rank's packing of the bucket, so the caller may reuse that memory; engine side: every
// copy of the bucket landed in the slot or staging memory).
//
// Failures as for broadcasts: a peer lost, a doorbell of another version, sequence or byte count
// than the routing plan says is an asynchronous error (Transport::async_error names the rank, the
// bucket and both values); nothing is copied from a doorbell that fails its checks; the mover
// never times out by itself, except where its transport documents a bounded wait.
// Transport::abort() wakes every waiting task.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "core/in_place_copies.h"
#include "core/route_copies.h"
#include "core/routing_plan.h"
#include "shadowsync/backend.h"

namespace shadowsync {

// One bucket of one update, as both ends name it.
struct RoutedBucket {
  std::uint64_t version = 0;   // the update's version (UpdateHeader::version)
  std::uint64_t sequence = 0;  // the bucket's index within the update, from 0
  std::size_t group = 0;       // of the wire layout
  std::size_t bucket = 0;      // within the group
};

// Where an engine rank's copies of a bucket write (RouteCopy::dst_offset is from these).
struct RouteTargets {
  std::byte* slot = nullptr;     // the group's shadow slot arena
  std::byte* staging = nullptr;  // the receiver's staging memory for quantized tensors (or null)
};

class RouteMover {
 public:
  virtual ~RouteMover() = default;

  // The plan both ends were set up with (its fingerprint was checked at connection).
  virtual const RoutingPlan& routing_plan() const = 0;
  // This end's role: a trainer rank (0..M-1) or an engine rank (0..N-1); the other is -1.
  virtual int trainer_rank() const = 0;
  virtual int engine_rank() const = 0;

  // Trainer rank: `packed` holds this rank's bytes of the bucket in wire order, exactly
  // routing_plan().packed_range(trainer_rank(), group, bucket) long (`bytes`; anything else is
  // refused with Error(kInvalidArgument) naming both counts before anything is enqueued). The
  // memory stays untouched until the stream's work completes. One thread at a time.
  virtual void send_routes_async(const RoutedBucket& bucket, const void* packed,
                                 std::size_t bytes, Stream& stream) = 0;

  // Trainer rank, before an update's first send: offers to have the engines read this update's
  // bytes where they lie (`segments`: the rank's packing of every group the update sends, as
  // ShardPacking::append_in_place_segments gives it; the memory stays unchanged until the
  // update's last bucket was acked, as for packed memory). True: every send of the update passes
  // packed == nullptr and nothing is packed (one pass through memory instead of two). False (the
  // default; a transport that cannot): the caller packs as before. One thread at a time.
  // `why_not` says why when it returns false.
  virtual bool offer_in_place(std::span<const InPlaceSegment> segments, std::string& why_not) {
    (void)segments;
    why_not = "this transport reads no routes in place";
    return false;
  }

  // Engine rank: waits (on the stream, or on the calling thread where the transport says so) for
  // every trainer rank's doorbell of `bucket`, checks each (version, sequence, and that its byte
  // count is the plan's packed_range), runs `copies` (compose_route_copies for this engine rank,
  // group and bucket) from each trainer rank's packing into `targets`, then acknowledges to every
  // trainer rank. One thread at a time.
  virtual void receive_routes_async(const RoutedBucket& bucket,
                                    std::span<const RouteCopy> copies,
                                    const RouteTargets& targets, Stream& stream) = 0;

  // Engine rank: bytes its copies read so far, over all updates (what the transport carried into
  // this rank). Thread-safe.
  virtual std::uint64_t routed_bytes() const = 0;
  // Engine rank: of routed_bytes(), those its copies read in place. Thread-safe.
  virtual std::uint64_t routed_in_place_bytes() const { return 0; }
};

}  // namespace shadowsync
