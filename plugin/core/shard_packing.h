// How one trainer rank of a routing plan packs its shards (DESIGN §14): for every bucket, the
// slice of its packing the routes read (RoutingPlan::packed_range) as runs of one tensor each,
// one memcpy per (tensor, bucket). A rank's packing of a group is what it holds in wire order,
// and what it holds of one tensor in wire order is its local shard in row-major order (a box's
// rows are wire order; a flat range is itself): so a tensor's bytes in one bucket's slice are
// one contiguous part of its shard. Derived once, when the sender is made.
//
// Immutable once built; thread-safe to read.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/in_place_copies.h"
#include "core/routing_plan.h"
#include "shadowsync/layout.h"
#include "shadowsync/sender.h"

namespace shadowsync {

// `bytes` of tensor `tensor` (index in its group), from `local_offset` of the rank's shard of
// it, to `packed_offset` of the bucket's slice (from packed_range(...).begin).
struct PackRun {
  std::size_t tensor = 0;
  std::size_t local_offset = 0;
  std::size_t packed_offset = 0;
  std::size_t bytes = 0;
};

class ShardPacking {
 public:
  // Throws Error(kInvalidArgument) when the plan has the rank hold bytes that are no tensor's
  // (alignment padding: give regions of tensors), naming the group and the bytes.
  ShardPacking(const Layout& wire, const RoutingPlan& plan, int trainer);

  const std::vector<PackRun>& runs(std::size_t group, std::size_t bucket) const {
    return runs_[group][bucket];
  }
  // The bytes of bucket `bucket`'s slice (packed_range's length).
  std::size_t packed_bytes(std::size_t group, std::size_t bucket) const {
    return slices_[group][bucket].end - slices_[group][bucket].begin;
  }

  // Where this rank's packing of group `group` lies when engines read it in place: each run at
  // its shard's address (`tensors`: the group's entry of what check() returns), in packing
  // order, with offsets over the whole group's packing; a tensor's runs in consecutive buckets
  // are merged (one segment never spans two tensors). Appended to `out`.
  void append_in_place_segments(std::size_t group, const std::vector<const std::byte*>& tensors,
                                std::vector<InPlaceSegment>& out) const;

  // Checks the shards of an update of `groups` against the plan (what Sender::publish_shards
  // promises) and returns, per listed group and tensor, the data of its shard (null where the
  // rank holds nothing of the tensor). Throws Error(kInvalidArgument) naming the tensor, the
  // rank and both values; Error(kLayoutMismatch) from regions_of_box/_of_elements for a region
  // outside its tensor.
  std::vector<std::vector<const std::byte*>> check(std::uint64_t version,
                                                   const std::vector<std::uint32_t>& groups,
                                                   const std::vector<SourceShard>& shards) const;

 private:
  const Layout& wire_;
  const int trainer_;
  std::vector<std::vector<std::vector<PackRun>>> runs_;     // [group][bucket]
  std::vector<std::vector<ByteRange>> slices_;              // [group][bucket]: packed_range
  std::vector<std::vector<std::vector<ByteRange>>> held_;   // [group][tensor], wire offsets
};

}  // namespace shadowsync
