// A sharded trainer's routing plan for tests of moving routes (route copies, p2p_schedule, NCCL
// routes): one group "base" of 256-byte buckets, M trainer ranks holding uneven FSDP2 rows and
// ZeRO-3 partitions that cut rows, N = 1 or 2 engine ranks with a receive plan each (a
// tensor-parallel split, a fused tensor of strided rows, an FP8-staged tensor).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "core/routing_plan.h"
#include "shadowsync/layout.h"
#include "shadowsync/receive_plan.h"

namespace shadowsync::testing {

// Buckets of 256 bytes: q's rows of 48 bytes straddle bucket boundaries (the plan cuts them
// there); a and b go into one fused engine tensor (its rows strided: a 2-D copy whose pitches
// differ); w is quantized to FP8 by the engine (its pieces go to staging).
inline Layout wire_layout() {
  return Layout::build({{"q", DType::kFloat32, {13, 12}, "base"},
                        {"k", DType::kFloat32, {3, 8}, "base"},
                        {"a", DType::kFloat32, {8, 8}, "base"},
                        {"b", DType::kFloat32, {8, 8}, "base"},
                        {"w", DType::kFloat32, {6, 8}, "base"},
                        {"norm", DType::kFloat32, {8}, "base"}},
                       {.bucket_bytes = 256});
}

// M trainer ranks: q and k FSDP2 Shard(0) (uneven: the first ranks get one row more), a, b and w
// ZeRO-3 flat partitions cut 3 elements past each even share (mid-row), the norm replicated and
// sent by the last rank.
inline std::vector<RankRanges> trainer_shards(const Layout& wire, int ranks) {
  std::vector<RankRanges> out;
  for (int r = 0; r < ranks; ++r) {
    RankRanges held{r, {{}}};
    auto& ranges = held.ranges[0];
    for (const auto& [name, rows, cols] : {std::tuple{"q", 13, 12}, std::tuple{"k", 3, 8}}) {
      const int per = (rows + ranks - 1) / ranks;
      const int lo = r * per;
      const int hi = std::min(rows, lo + per);
      if (lo >= hi) continue;
      for (const ByteRange& b : regions_of_box(wire, name, {lo, 0}, {hi, cols})) {
        ranges.push_back(b);
      }
    }
    for (const auto& [name, elements] :
         {std::pair{"a", 64}, std::pair{"b", 64}, std::pair{"w", 48}}) {
      const auto cut = [&](int i) {
        return i == 0 ? 0 : i == ranks ? elements : elements * i / ranks + 3;
      };
      ranges.push_back(regions_of_elements(wire, name, cut(r), cut(r + 1) - cut(r)));
    }
    if (r == ranks - 1) ranges.push_back(regions_of_elements(wire, "norm", 0, 8));
    out.push_back(std::move(held));
  }
  return out;
}

// Engine rank `rank` of `ranks` (1 or 2): q and k column-parallel (rows split, uneven), a and b
// fused into ab (side by side in each row; with 2 ranks each holds its half of their columns),
// w quantized to FP8 (rows split), the norm whole.
inline ReceivePlan engine_plan(const Layout& wire, int rank, int ranks) {
  const std::int64_t q_rows = ranks == 1 ? 13 : rank == 0 ? 7 : 6;
  const std::int64_t k_rows = ranks == 1 ? 3 : rank == 0 ? 2 : 1;
  const std::int64_t cols = 8 / ranks;  // of a and of b
  const std::int64_t w_rows = 6 / ranks;
  const Layout engine = Layout::build({{"q", DType::kFloat32, {q_rows, 12}, "base"},
                                       {"k", DType::kFloat32, {k_rows, 8}, "base"},
                                       {"ab", DType::kFloat32, {8, 2 * cols}, "base"},
                                       {"w", DType::kFloat8E4M3, {w_rows, 8}, "base"},
                                       {"w_scale", DType::kFloat32, {1}, "base"},
                                       {"norm", DType::kFloat32, {8}, "base"}});
  return ReceivePlan::build(wire, engine,
                            {{"q", "q", {q_rows, 12}, rank * 7 * 12, {12, 1}, 0, {12, 1}},
                             {"k", "k", {k_rows, 8}, rank * 2 * 8, {8, 1}, 0, {8, 1}},
                             {"a", "ab", {8, cols}, rank * cols, {8, 1}, 0, {2 * cols, 1}},
                             {"b", "ab", {8, cols}, rank * cols, {8, 1}, cols, {2 * cols, 1}},
                             {"w", "w", {w_rows, 8}, rank * w_rows * 8, {8, 1}, 0, {8, 1}},
                             {"norm", "norm", {8}, 0, {1}, 0, {1}}},
                            {}, {{"w", "w_scale", 1}});
}

// The plans of engine ranks 0..ranks-1, in rank order.
inline std::vector<ReceivePlan> engine_plans(const Layout& wire, int ranks) {
  std::vector<ReceivePlan> plans;
  for (int e = 0; e < ranks; ++e) plans.push_back(engine_plan(wire, e, ranks));
  return plans;
}

// What each engine rank needs: what its plan (at its rank) reads.
inline std::vector<RankRanges> needs_of(const std::vector<ReceivePlan>& plans) {
  std::vector<RankRanges> needs;
  for (std::size_t e = 0; e < plans.size(); ++e) {
    needs.push_back({static_cast<int>(e), needed_by(plans[e])});
  }
  return needs;
}

// The routing plan of M trainer ranks to N engine ranks needing what their plans read.
inline RoutingPlan routing_plan(const Layout& wire, int trainers, int engines) {
  return RoutingPlan::build(wire, trainer_shards(wire, trainers),
                            needs_of(engine_plans(wire, engines)));
}

}  // namespace shadowsync::testing
