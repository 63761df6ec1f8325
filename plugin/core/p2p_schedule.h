// The point-to-point schedule of a routing plan (DESIGN §14): which sends and receives each rank
// of one communicator of M trainer ranks and N engine ranks posts for one wire bucket, so that a
// transport of grouped sends and receives (NCCL's ncclSend/ncclRecv between ncclGroupStart and
// ncclGroupEnd) moves every route once, from the trainer rank that holds it to the engine rank
// that needs it.
//
// Communicator ranks: trainer rank t is rank t, engine rank e is rank M + e (world size M + N;
// with replicas, below, M + R x N).
//
// A trainer rank sends each of its routes of the bucket from its packing of the bucket (offsets
// from packed_range(t, group, bucket).begin). An engine rank receives each route into a landing
// buffer of the bucket, laid out by landing_layout(): the routes into it back to back, by trainer
// rank, then wire offset. Its RouteCopy list (compose_route_copies, offsets into the trainer
// ranks' packings) then runs from the landing buffer: landing_copy() rewrites a copy's source.
//
// Matching: NCCL pairs the sends and receives between two ranks by their order within the group
// alone; a size or order that differs truncates or hangs. Both ends therefore list the ops of one
// peer pair in one order, by wire offset (the plan's routes are sorted by trainer rank, engine
// rank, wire offset; routes between one pair are disjoint in the wire). Across peers the order
// does not matter inside a group.
//
// Engine replicas (data parallel): R replicas of the N engine ranks join the same communicator,
// M + R x N ranks, engine rank e of replica r at communicator rank M + r x N + e. Each route is
// sent once, to replica 0's rank, as above. Replica r's rank e then forwards its landed bucket
// (its whole landing buffer of the bucket, one op) to replica r + 1's rank e, in a group of its
// own after its receives: a chain. Each trainer rank sends a bucket once whatever R; each
// replica's rank receives it once and sends it at most once, so no link carries it twice; and
// since every rank enqueues its buckets in order on its own stream, consecutive buckets are in
// flight along the chain at once. Every replica lands the same bytes (same layout, same copies).
//
// Pure computation; thread-safe.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "core/route_copies.h"
#include "core/routing_plan.h"

namespace shadowsync {

// One send or receive of one rank for one bucket.
struct P2pOp {
  enum Kind { kSend, kRecv };
  Kind kind = kSend;
  int peer = 0;            // the other end's communicator rank
  std::size_t offset = 0;  // send: into this trainer rank's packing of the bucket;
                           // recv: into this engine rank's landing buffer of the bucket
  std::size_t bytes = 0;
  friend bool operator==(const P2pOp&, const P2pOp&) = default;
};

// A route into one engine rank and where it lies at both ends.
struct LandingRoute {
  int trainer = 0;
  std::size_t packed_offset = 0;   // in the trainer rank's packing of the bucket
  std::size_t landing_offset = 0;  // in the engine rank's landing buffer of the bucket
  std::size_t bytes = 0;
  friend bool operator==(const LandingRoute&, const LandingRoute&) = default;
};

// The landing buffer of engine rank `engine` for bucket `bucket` of group `group`: the routes
// into it back to back, by trainer rank, then wire offset (so, per trainer rank, by packed
// offset). The one source of both the engine's receive offsets and its copies' sources.
// Throws Error(kInvalidArgument) for an engine rank outside 0..N-1.
std::vector<LandingRoute> landing_layout(const RoutingPlan& routing, int engine, std::size_t group,
                                         std::size_t bucket);

// The largest landing buffer engine rank `engine` needs over every bucket of `wire` (the layout
// the plan was built on): what it allocates once.
std::size_t max_landing_bytes(const RoutingPlan& routing, const Layout& wire, int engine);

// Copy `copy` (from compose_route_copies, reading a trainer rank's packing) reading the landing
// buffer instead: packed_offset becomes the offset in the landing buffer `landing` describes,
// the rest unchanged. Throws Error(kInvalidArgument) naming the copy when no route of `landing`
// from its trainer rank holds all of it (copies composed for another engine rank or bucket).
RouteCopy landing_copy(std::span<const LandingRoute> landing, const RouteCopy& copy);

// Where communicator rank `comm_rank` sits among the M trainer ranks and R = `replicas` replicas
// of the N engine ranks: a trainer rank, or an engine rank and its replica (the others -1).
// Throws Error(kInvalidArgument) for a rank outside 0..M+R*N-1 or `replicas` < 1, naming them.
struct CommPlace {
  int trainer = -1;  // 0..M-1, or -1
  int engine = -1;   // 0..N-1, or -1
  int replica = -1;  // 0..R-1 for an engine rank, or -1
};
CommPlace comm_place(const RoutingPlan& routing, int comm_rank, int replicas);

// The receive group's ops of communicator rank `comm_rank` (0..M+R*N-1, R = `replicas`) for
// bucket `bucket` of group `group`: a trainer rank's sends (to replica 0), by engine rank, then
// wire offset; replica 0's engine rank's receives, by trainer rank, then wire offset (its landing
// order); replica r > 0's engine rank: one receive of the whole landing buffer from replica
// r - 1's. Empty where the rank has no route in the bucket. Throws Error(kInvalidArgument) for a
// rank outside 0..M+R*N-1 or `replicas` < 1.
std::vector<P2pOp> p2p_schedule(const RoutingPlan& routing, int comm_rank, std::size_t group,
                                std::size_t bucket, int replicas = 1);

// The forward group's op of communicator rank `comm_rank` for that bucket: an engine rank of
// replica r < R - 1 with routes in the bucket sends its whole landing buffer to replica r + 1's;
// empty otherwise (trainer ranks, the last replica, no routes). Posted after the receive group,
// on the same stream. Throws as p2p_schedule.
std::vector<P2pOp> p2p_forward(const RoutingPlan& routing, int comm_rank, std::size_t group,
                               std::size_t bucket, int replicas = 1);

// NCCL refuses two ranks of one communicator on one GPU. `gpus[r]` names the GPU of
// communicator rank r (any string unique to a GPU across hosts, e.g. host name and device UUID);
// throws Error(kInvalidArgument) naming both ranks and the GPU where two ranks share one ("use
// the same-host pull transport" where a trainer and an engine rank do), or where `gpus` does not
// have M + R x N entries (R = `replicas`).
void check_p2p_gpus(const RoutingPlan& routing, const std::vector<std::string>& gpus,
                    int replicas = 1);

}  // namespace shadowsync
