#include "core/p2p_schedule.h"

#include <fmt/format.h>

#include <algorithm>

#include "shadowsync/error.h"

namespace shadowsync {
namespace {

// Where route `r` starts in its trainer rank's packing of its bucket.
std::size_t packed_start(const RoutingPlan& routing, const Route& r) {
  return r.source_offset - routing.packed_range(r.trainer, r.group, r.bucket).begin;
}

void check_engine(const RoutingPlan& routing, int engine) {
  if (engine < 0 || engine >= routing.engine_count()) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("engine rank {} is outside the routing plan's 0..{}", engine,
                            routing.engine_count() - 1));
  }
}

std::size_t landing_size(const std::vector<LandingRoute>& landing) {
  return landing.empty() ? 0 : landing.back().landing_offset + landing.back().bytes;
}

}  // namespace

CommPlace comm_place(const RoutingPlan& routing, int comm_rank, int replicas) {
  const int trainers = routing.trainer_count();
  const int engines = routing.engine_count();
  if (replicas < 1) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{} engine replicas: there must be at least 1", replicas));
  }
  const long long world = trainers + static_cast<long long>(replicas) * engines;
  if (comm_rank < 0 || comm_rank >= world) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("communicator rank {} is outside 0..{} (trainer ranks 0..{}, then "
                            "engine ranks{})",
                            comm_rank, world - 1, trainers - 1,
                            replicas > 1 ? fmt::format(" of {} replicas", replicas) : ""));
  }
  if (comm_rank < trainers) return {comm_rank, -1, -1};
  return {-1, (comm_rank - trainers) % engines, (comm_rank - trainers) / engines};
}

std::vector<LandingRoute> landing_layout(const RoutingPlan& routing, int engine, std::size_t group,
                                         std::size_t bucket) {
  check_engine(routing, engine);
  // The plan's routes are by trainer rank, engine rank, wire offset: filtering one engine rank
  // keeps (trainer rank, wire offset), the order both ends of every pair post in.
  std::vector<LandingRoute> out;
  std::size_t at = 0;
  for (const Route& r : routing.routes(group, bucket)) {
    if (r.engine != engine) continue;
    out.push_back({r.trainer, packed_start(routing, r), at, r.bytes});
    at += r.bytes;
  }
  return out;
}

std::size_t max_landing_bytes(const RoutingPlan& routing, const Layout& wire, int engine) {
  check_engine(routing, engine);
  std::size_t most = 0;
  for (std::size_t g = 0; g < wire.groups().size(); ++g) {
    for (std::size_t k = 0; k < wire.groups()[g].bucket_count(); ++k) {
      std::size_t bytes = 0;
      for (const Route& r : routing.routes(g, k)) {
        if (r.engine == engine) bytes += r.bytes;
      }
      most = std::max(most, bytes);
    }
  }
  return most;
}

RouteCopy landing_copy(std::span<const LandingRoute> landing, const RouteCopy& copy) {
  const std::size_t first = copy.packed_offset;
  const std::size_t last =
      copy.rows == 0 ? first : first + (copy.rows - 1) * copy.src_pitch + copy.row_bytes;
  // Per trainer rank the landing routes are by packed offset: the last one starting at or before
  // the copy's first byte is the only one that can hold it.
  auto after = std::upper_bound(landing.begin(), landing.end(), std::pair{copy.trainer, first},
                                [](const std::pair<int, std::size_t>& key, const LandingRoute& r) {
                                  return key < std::pair{r.trainer, r.packed_offset};
                                });
  if (after != landing.begin()) {
    const LandingRoute& r = *std::prev(after);
    if (r.trainer == copy.trainer && last <= r.packed_offset + r.bytes) {
      RouteCopy out = copy;
      out.packed_offset = r.landing_offset + (first - r.packed_offset);
      return out;
    }
  }
  throw Error(ErrorCode::kInvalidArgument,
              fmt::format("a route copy reads bytes {}..{} of trainer rank {}'s packing, which no "
                          "route of this bucket into this engine rank holds: the copies were "
                          "composed for another engine rank, bucket or routing plan",
                          first, last, copy.trainer));
}

std::vector<P2pOp> p2p_schedule(const RoutingPlan& routing, int comm_rank, std::size_t group,
                                std::size_t bucket, int replicas) {
  const CommPlace at = comm_place(routing, comm_rank, replicas);
  const int trainers = routing.trainer_count();
  std::vector<P2pOp> ops;
  if (at.trainer >= 0) {
    // Already by engine rank, then wire offset within this trainer rank's routes.
    for (const Route& r : routing.routes(group, bucket)) {
      if (r.trainer != comm_rank) continue;
      ops.push_back({P2pOp::kSend, trainers + r.engine, packed_start(routing, r), r.bytes});
    }
    return ops;
  }
  const std::vector<LandingRoute> landing = landing_layout(routing, at.engine, group, bucket);
  if (at.replica > 0) {
    if (!landing.empty()) {
      ops.push_back({P2pOp::kRecv, comm_rank - routing.engine_count(), 0, landing_size(landing)});
    }
    return ops;
  }
  for (const LandingRoute& r : landing) {
    ops.push_back({P2pOp::kRecv, r.trainer, r.landing_offset, r.bytes});
  }
  return ops;
}

std::vector<P2pOp> p2p_forward(const RoutingPlan& routing, int comm_rank, std::size_t group,
                               std::size_t bucket, int replicas) {
  const CommPlace at = comm_place(routing, comm_rank, replicas);
  if (at.engine < 0 || at.replica == replicas - 1) return {};
  const std::size_t bytes = landing_size(landing_layout(routing, at.engine, group, bucket));
  if (bytes == 0) return {};
  return {{P2pOp::kSend, comm_rank + routing.engine_count(), 0, bytes}};
}

void check_p2p_gpus(const RoutingPlan& routing, const std::vector<std::string>& gpus,
                    int replicas) {
  const int trainers = routing.trainer_count();
  const int engines = routing.engine_count();
  (void)comm_place(routing, 0, replicas);  // refuses replicas < 1
  const std::size_t world = static_cast<std::size_t>(trainers) +
                            static_cast<std::size_t>(replicas) * static_cast<std::size_t>(engines);
  if (gpus.size() != world) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{} GPUs given for a communicator of {} ranks ({} trainer and {} "
                            "engine ranks{}): name the GPU of every rank, trainer ranks first{}",
                            gpus.size(), world, trainers, engines,
                            replicas > 1 ? fmt::format(" in each of {} replicas", replicas) : "",
                            replicas > 1 ? ", then each replica's engine ranks" : ""));
  }
  const auto name = [&](std::size_t rank) {
    const CommPlace at = comm_place(routing, static_cast<int>(rank), replicas);
    if (at.trainer >= 0) return fmt::format("trainer rank {}", rank);
    return replicas > 1 ? fmt::format("engine rank {} of replica {} (communicator rank {})",
                                      at.engine, at.replica, rank)
                        : fmt::format("engine rank {} (communicator rank {})", at.engine, rank);
  };
  for (std::size_t b = 0; b < world; ++b) {
    for (std::size_t a = 0; a < b; ++a) {
      if (gpus[a] != gpus[b]) continue;
      const bool mixed = static_cast<int>(a) < trainers && static_cast<int>(b) >= trainers;
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("{} and {} are both on GPU '{}': NCCL cannot connect two ranks of "
                              "one communicator on one GPU{}",
                              name(a), name(b), gpus[a],
                              mixed ? "; use the same-host pull transport for a trainer and an "
                                      "engine sharing a GPU"
                                    : "; give each rank a GPU of its own"));
    }
  }
}

}  // namespace shadowsync
