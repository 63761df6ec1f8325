// The copies an engine rank runs to land its routes (routing_plan.h) where they belong: a route's
// bytes arrive as a slice of a trainer rank's packing (not as a wire bucket), so the receive
// plan's pieces, which read a whole received bucket, are recut into copies that each read one
// route. Pulling routes straight into slot positions (DESIGN §14, same host) or out of a
// per-trainer receive buffer both run these copies: one pass through the engine's memory, no
// bucket assembled first.
//
// Without a receive plan an engine rank's slots have the wire layout: each route is one copy to
// its wire offset. With one, each PlanPiece is cut by the routes it reads into at most three
// copies per route (the part of a row where the route starts, the whole rows as one 2-D copy,
// the part of a row where it ends); a copy never reads two routes, and the copies of a bucket
// write exactly the bytes its pieces write, each once, slot or staging alike (the plan's
// quantize steps then run as after a received bucket).
//
// Pure computation at set-up; not installed.
#pragma once

#include <cstddef>
#include <vector>

#include "core/routing_plan.h"
#include "shadowsync/layout.h"
#include "shadowsync/receive_plan.h"

namespace shadowsync {

// `rows` rows of `row_bytes` each: from trainer rank `trainer`'s packing of the bucket (offsets
// from packed_range(trainer, group, bucket).begin, the first byte it stages for the bucket) into
// the engine group's slot arena (offsets from its first byte), or with `to_staging` into the
// receiver's staging memory for quantized tensors. One Backend::memcpy_2d_async; pitches are
// never below row_bytes.
struct RouteCopy {
  int trainer = 0;
  std::size_t packed_offset = 0;
  std::size_t dst_offset = 0;
  std::size_t src_pitch = 0;
  std::size_t dst_pitch = 0;
  std::size_t row_bytes = 0;
  std::size_t rows = 0;
  bool to_staging = false;
  friend bool operator==(const RouteCopy&, const RouteCopy&) = default;
};

// The copies of engine rank `engine`, [group][bucket] of the wire layout, in the order of the
// plan's pieces (by wire offset without a plan). `wire` is the layout the routing plan was built
// on, and `plan` (null: none) the engine rank's receive plan over that same wire layout; the
// routes must cover every byte the plan reads (needed_by(*plan) as the rank's needs).
// Throws Error(kLayoutMismatch) naming both fingerprints when `wire` or the plan's wire is not
// the routing plan's, Error(kInvalidArgument) for an engine rank outside 0..N-1 and, naming the
// group, bucket and bytes, for bytes a piece reads that no route brings to this rank.
std::vector<std::vector<std::vector<RouteCopy>>> compose_route_copies(const RoutingPlan& routing,
                                                                      int engine,
                                                                      const Layout& wire,
                                                                      const ReceivePlan* plan);

}  // namespace shadowsync
