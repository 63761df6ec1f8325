// Routes read in place (DESIGN §14, same host): where a trainer rank's shards are in device
// memory an engine process can map, the engine's copies read them there, and the trainer packs
// nothing: one pass through the GPU's memory per update instead of two. A RouteCopy names its
// source as an offset into the trainer rank's packing of the bucket; a shard table (the trainer's
// InPlaceSegments) says where each part of that packing lies, and these functions turn the
// copies of a bucket into copies between addresses.
//
// Pure computation; not installed.
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "core/route_copies.h"

namespace shadowsync {

// `bytes` of a trainer rank's packing of group `group` (offsets over the whole group, as
// RoutingPlan::packed_range gives them), from `packing_offset`, lie at `address` (in the process
// that holds the table: the trainer's own shards, or their mapping in an engine process).
struct InPlaceSegment {
  std::size_t group = 0;
  std::size_t packing_offset = 0;
  std::size_t bytes = 0;
  const std::byte* address = nullptr;
  friend bool operator==(const InPlaceSegment&, const InPlaceSegment&) = default;
};

// A RouteCopy with both ends resolved: one Backend::memcpy_2d_async.
struct AddressedCopy {
  const std::byte* src = nullptr;
  std::size_t src_pitch = 0;
  std::byte* dst = nullptr;
  std::size_t dst_pitch = 0;
  std::size_t row_bytes = 0;
  std::size_t rows = 0;
  friend bool operator==(const AddressedCopy&, const AddressedCopy&) = default;
};

// Appends to `out` the copies that do `copy` from the segments of its trainer rank and group
// (`segments`: sorted by packing_offset, not overlapping; `packed_begin`: where the bucket's
// slice of the packing begins) into `dst` (the copy's target base: slot or staging). A copy
// within one segment stays one copy; one that crosses segments is cut at their boundaries, by
// rows, and a row that crosses, into pieces. Returns false and appends nothing when a byte it
// reads lies in no segment.
bool address_in_place(const RouteCopy& copy, std::size_t packed_begin,
                      std::span<const InPlaceSegment> segments, std::byte* dst,
                      std::vector<AddressedCopy>& out);

// The copy of one route as a transport runs it: from `packed` (the trainer rank's packing of the
// bucket, staged) when not null, else in place, as address_in_place. False as address_in_place.
bool address_route_copy(const RouteCopy& copy, const std::byte* packed, std::size_t packed_begin,
                        std::span<const InPlaceSegment> segments, std::byte* dst,
                        std::vector<AddressedCopy>& out);

}  // namespace shadowsync
