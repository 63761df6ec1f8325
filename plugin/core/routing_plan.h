// The routing plan of a sharded trainer (DESIGN §14): which bytes of the wire layout go from
// which trainer rank to which engine rank, so that every byte moves once, from the rank that
// holds it, to each rank that needs it, and no rank ever holds a full tensor it does not own.
//
// Everything is in bytes of a group's wire arena image (the trainer's tensors, full and
// unsharded, laid out as Layout places them), cut at the wire's bucket boundaries: a bucket
// stays the unit of an update, and an engine rank's bucket is complete once every route into it
// landed. A trainer rank holds byte ranges of that image (its shards: FSDP2 rows, Megatron
// slices, a ZeRO-3 flat partition; regions_of_box and regions_of_elements make them from tensor
// coordinates) and packs what it holds of a group in wire order: a route's source is an offset
// into that packing. An engine rank needs byte ranges (what its receive plan reads:
// needed_by(plan); all of them without a plan).
//
// Both sides build the same plan from the same inputs and compare fingerprints. Immutable once
// built; thread-safe to read. Not installed (the C ABI and Python reach it through a handle);
// transports that offer a RouteMover (route_mover.h) move its routes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "shadowsync/layout.h"
#include "shadowsync/receive_plan.h"

namespace shadowsync {

// Bytes [begin, end) of a group's wire arena.
struct ByteRange {
  std::size_t begin = 0;
  std::size_t end = 0;
  friend bool operator==(const ByteRange&, const ByteRange&) = default;
};

// What one trainer rank holds (`held`) or one engine rank needs (`needed`), per group of the
// wire layout: byte ranges in any order (they are sorted and merged).
struct RankRanges {
  int rank = 0;
  std::vector<std::vector<ByteRange>> ranges;  // [group]
};

// One route: `bytes` bytes of bucket `bucket` of group `group`, at `wire_offset` of the group's
// arena, from trainer rank `trainer` (at `source_offset` of what it holds of the group, packed in
// wire order) to engine rank `engine`.
struct Route {
  int trainer = 0;
  int engine = 0;
  std::size_t group = 0;
  std::size_t bucket = 0;
  std::size_t wire_offset = 0;
  std::size_t source_offset = 0;
  std::size_t bytes = 0;
  friend bool operator==(const Route&, const Route&) = default;
};

class RoutingPlan {
 public:
  // Intersects what the trainer ranks hold with what the engine ranks need. Refused with
  // Error(kInvalidArgument), naming the ranks, the tensor and the bytes: trainer or engine ranks
  // that are not 0..M-1 / 0..N-1 each once (every rank missing, outside or given twice named:
  // "trainer ranks 0..2 expected (3 lists given, one per rank): rank 1 missing, rank 3
  // outside"), a range outside its group's arena or a list of
  // another number of groups, bytes two trainer ranks both hold (a replicated tensor is sent by
  // one: the caller says which), and bytes an engine rank needs that no trainer rank holds.
  static RoutingPlan build(const Layout& wire, const std::vector<RankRanges>& trainers,
                           const std::vector<RankRanges>& engines);

  // The routes of bucket `bucket` of group `group`, by trainer rank, then engine rank, then
  // wire offset.
  const std::vector<Route>& routes(std::size_t group, std::size_t bucket) const {
    return routes_[group][bucket];
  }
  int trainer_count() const { return trainer_count_; }
  // The wire layout's group count, and the bucket count of group `group` (in range).
  std::size_t group_count() const { return routes_.size(); }
  std::size_t bucket_count(std::size_t group) const { return routes_[group].size(); }
  int engine_count() const { return engine_count_; }
  // Bytes engine rank `engine` receives per update, and trainer rank `trainer` sends.
  std::size_t bytes_to(int engine) const { return bytes_to_[engine]; }
  std::size_t bytes_from(int trainer) const { return bytes_from_[trainer]; }
  // Of the wire layout and every route: equal on both sides or the set-up is refused.
  std::uint64_t fingerprint() const { return fingerprint_; }
  // The fingerprint of the wire layout it was built on.
  std::uint64_t wire_fingerprint() const { return wire_fingerprint_; }

  // The slice of trainer rank `trainer`'s packing of group `group` (what it holds, in wire
  // order) that the routes of bucket `bucket` from it read, to any engine rank: one contiguous
  // slice, since a bucket is a contiguous part of the wire. What the rank stages for that bucket;
  // a route's source_offset - begin is where its bytes lie in it. Empty ({0, 0}) when no route
  // of the bucket comes from the rank. Indices must be in range.
  ByteRange packed_range(int trainer, std::size_t group, std::size_t bucket) const {
    return packed_[group][bucket][trainer];
  }
  // The largest packed_range of trainer rank `trainer` over every group and bucket: the staging
  // a rank needs for one bucket at a time.
  std::size_t max_packed_bytes(int trainer) const { return max_packed_[trainer]; }
  // What trainer rank `trainer` holds of group `group`, sorted and merged: its packing is these
  // ranges back to back.
  const std::vector<ByteRange>& held(int trainer, std::size_t group) const {
    return held_[trainer][group];
  }

 private:
  RoutingPlan() = default;

  std::vector<std::vector<std::vector<Route>>> routes_;       // [group][bucket]
  std::vector<std::vector<std::vector<ByteRange>>> packed_;  // [group][bucket][trainer]
  std::vector<std::vector<std::vector<ByteRange>>> held_;    // [trainer][group]
  std::vector<std::size_t> max_packed_;                      // [trainer]
  std::vector<std::size_t> bytes_to_;
  std::vector<std::size_t> bytes_from_;
  int trainer_count_ = 0;
  int engine_count_ = 0;
  std::uint64_t fingerprint_ = 0;
  std::uint64_t wire_fingerprint_ = 0;
};

// The byte ranges of wire tensor `tensor` inside the box `begin[d] <= index[d] < end[d]` of
// its dimensions (an FSDP2 Shard(d) slice, a Megatron column- or row-parallel slice), merged.
// Throws Error(kInvalidArgument) naming the tensor and the box when the box is empty or outside
// the tensor's shape, Error(kLayoutMismatch) for a tensor the layout does not have.
std::vector<ByteRange> regions_of_box(const Layout& wire, const std::string& tensor,
                                      const std::vector<std::int64_t>& begin,
                                      const std::vector<std::int64_t>& end);

// The byte range of elements [first, first + count) of wire tensor `tensor` in row-major order
// (a ZeRO-3 flat partition's share of a flattened parameter). Same refusals.
ByteRange regions_of_elements(const Layout& wire, const std::string& tensor, std::int64_t first,
                              std::int64_t count);

// What a receiver with `plan` reads of the wire arena, per group: its pieces' rows, merged.
std::vector<std::vector<ByteRange>> needed_by(const ReceivePlan& plan);

}  // namespace shadowsync
