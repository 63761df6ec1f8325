#include "core/route_copies.h"

#include <fmt/format.h>

#include <algorithm>

#include "shadowsync/error.h"

namespace shadowsync {
namespace {

// The routes of bucket `bucket` of group `group` into `engine`, by wire offset (build orders
// them by trainer rank first). They are disjoint: an engine rank's needs are merged and each
// byte has one holder.
std::vector<Route> routes_into(const RoutingPlan& routing, int engine, std::size_t group,
                               std::size_t bucket) {
  std::vector<Route> out;
  for (const Route& r : routing.routes(group, bucket)) {
    if (r.engine == engine) out.push_back(r);
  }
  std::sort(out.begin(), out.end(),
            [](const Route& a, const Route& b) { return a.wire_offset < b.wire_offset; });
  return out;
}

// Where wire byte `at` of route `r` lies in its trainer rank's packing of the bucket.
std::size_t packed_offset(const RoutingPlan& routing, const Route& r, std::size_t at) {
  return r.source_offset - routing.packed_range(r.trainer, r.group, r.bucket).begin +
         (at - r.wire_offset);
}

// Appends the copies of piece `p` of bucket `bucket` (at wire offset `bucket_offset`) that read
// the routes `into`: walks the piece's rows, each step one copy from the route holding the next
// byte not yet copied: the rest of a row that starts or ends outside the route, or else every
// whole row the route holds from there on (one 2-D copy with the piece's pitches).
void cut_piece(const RoutingPlan& routing, int engine, const GroupLayout& group, std::size_t bucket,
               std::size_t bucket_offset, const PlanPiece& p, const std::vector<Route>& into,
               std::vector<RouteCopy>& out) {
  const std::size_t base = bucket_offset + p.src_offset;
  std::size_t row = 0;
  std::size_t in_row = 0;  // bytes of `row` already copied
  while (row < p.rows) {
    const std::size_t row_start = base + row * p.src_pitch;
    const std::size_t at = row_start + in_row;
    auto next = std::upper_bound(into.begin(), into.end(), at,
                                 [](std::size_t x, const Route& r) { return x < r.wire_offset; });
    if (next == into.begin() || std::prev(next)->wire_offset + std::prev(next)->bytes <= at) {
      const std::size_t end = next == into.end()
                                  ? row_start + p.row_bytes
                                  : std::min(row_start + p.row_bytes, next->wire_offset);
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("engine rank {} reads bytes {}..{} of group '{}' (bucket {}), which "
                              "no route brings to it: give the routing plan needed_by(its "
                              "receive plan) as this rank's needs",
                              engine, at, end, group.name(), bucket));
    }
    const Route& r = *std::prev(next);
    const std::size_t route_end = r.wire_offset + r.bytes;
    const std::size_t dst = p.dst_offset + row * p.dst_pitch + in_row;
    if (in_row > 0 || row_start + p.row_bytes > route_end) {
      // Part of a row: the route starts or ends inside it.
      const std::size_t length = std::min(p.row_bytes - in_row, route_end - at);
      out.push_back(
          {r.trainer, packed_offset(routing, r, at), dst, length, length, length, 1, p.to_staging});
      in_row += length;
      if (in_row == p.row_bytes) {
        ++row;
        in_row = 0;
      }
      continue;
    }
    // Whole rows from `row` on, as many as the route holds: it maps wire bytes to its packing
    // one to one, so the rows keep the piece's source pitch there.
    const std::size_t rows =
        std::min(p.rows - row, (route_end - row_start - p.row_bytes) / p.src_pitch + 1);
    out.push_back({r.trainer, packed_offset(routing, r, at), dst, p.src_pitch, p.dst_pitch,
                   p.row_bytes, rows, p.to_staging});
    row += rows;
  }
}

}  // namespace

std::vector<std::vector<std::vector<RouteCopy>>> compose_route_copies(const RoutingPlan& routing,
                                                                      int engine,
                                                                      const Layout& wire,
                                                                      const ReceivePlan* plan) {
  if (engine < 0 || engine >= routing.engine_count()) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("engine rank {} is outside the routing plan's 0..{}", engine,
                            routing.engine_count() - 1));
  }
  if (wire.fingerprint() != routing.wire_fingerprint()) {
    throw Error(ErrorCode::kLayoutMismatch,
                fmt::format("wire layout {:#018x} is not the one the routing plan was built on "
                            "({:#018x})",
                            wire.fingerprint(), routing.wire_fingerprint()));
  }
  if (plan != nullptr && plan->wire().fingerprint() != routing.wire_fingerprint()) {
    throw Error(ErrorCode::kLayoutMismatch,
                fmt::format("the receive plan's wire layout {:#018x} is not the one the routing "
                            "plan was built on ({:#018x})",
                            plan->wire().fingerprint(), routing.wire_fingerprint()));
  }
  const auto& groups = wire.groups();
  std::vector<std::vector<std::vector<RouteCopy>>> out(groups.size());
  for (std::size_t g = 0; g < groups.size(); ++g) {
    out[g].resize(groups[g].bucket_count());
    for (std::size_t k = 0; k < groups[g].bucket_count(); ++k) {
      const std::vector<Route> into = routes_into(routing, engine, g, k);
      auto& copies = out[g][k];
      if (plan == nullptr) {
        // The slots have the wire layout: each route lands at its own wire offset.
        for (const Route& r : into) {
          copies.push_back({r.trainer, packed_offset(routing, r, r.wire_offset), r.wire_offset,
                            r.bytes, r.bytes, r.bytes, 1, false});
        }
        continue;
      }
      for (const PlanPiece& p : plan->pieces(g, k)) {
        cut_piece(routing, engine, groups[g], k, groups[g].bucket(k).offset, p, into, copies);
      }
    }
  }
  return out;
}

}  // namespace shadowsync
