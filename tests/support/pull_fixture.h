// The routing scenario of the same-host pull transport's tests (host memory in
// tests/integration/test_same_host_pull.cpp, device memory in
// tests/gpu/test_same_host_pull_gpu.cpp): a wire layout of three tensors in 256-byte buckets, M
// trainer ranks holding rows of it, N engine ranks needing rows of it, and a byte pattern per
// update version.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "child_process.h"
#include "core/routing_plan.h"
#include "shadowsync/layout.h"
#include "socket_dir.h"

namespace shadowsync::testing {

// Buckets of 256 bytes over one group: q's 48-byte rows straddle bucket boundaries.
inline Layout wire_layout() {
  return Layout::build({{"q", DType::kFloat32, {13, 12}, "base"},
                        {"k", DType::kFloat32, {6, 8}, "base"},
                        {"norm", DType::kFloat32, {8}, "base"}},
                       {.bucket_bytes = 256});
}

// `trainers` ranks hold q and k by rows (FSDP2 Shard(0), uneven), the last one the norm too.
// `engines` ranks: with 1 every byte; with 2 rank 0 needs q's first 7 rows, k and the norm, rank
// 1 q's rows 6..12 and the norm (rows 6 and the norm go to both). `other_needs`: engine rank 0
// needs no norm (another plan of the same world size).
inline std::shared_ptr<const RoutingPlan> make_plan(int trainers, int engines,
                                                   bool other_needs = false) {
  const Layout wire = wire_layout();
  std::vector<RankRanges> held;
  for (int r = 0; r < trainers; ++r) {
    RankRanges ranks{r, {{}}};
    for (const auto& [name, rows, cols] : {std::tuple{"q", 13, 12}, std::tuple{"k", 6, 8}}) {
      const int per = (rows + trainers - 1) / trainers;
      const int lo = std::min(rows, r * per);
      const int hi = std::min(rows, lo + per);
      if (lo >= hi) continue;
      for (const ByteRange& b : regions_of_box(wire, name, {lo, 0}, {hi, cols})) {
        ranks.ranges[0].push_back(b);
      }
    }
    if (r == trainers - 1) ranks.ranges[0].push_back(regions_of_elements(wire, "norm", 0, 8));
    held.push_back(std::move(ranks));
  }
  std::vector<RankRanges> needed;
  for (int e = 0; e < engines; ++e) {
    RankRanges ranks{e, {{}}};
    auto& ranges = ranks.ranges[0];
    const auto add = [&](const std::vector<ByteRange>& more) {
      ranges.insert(ranges.end(), more.begin(), more.end());
    };
    if (engines == 1) {
      add(regions_of_box(wire, "q", {0, 0}, {13, 12}));
      add(regions_of_box(wire, "k", {0, 0}, {6, 8}));
    } else if (e == 0) {
      add(regions_of_box(wire, "q", {0, 0}, {7, 12}));
      add(regions_of_box(wire, "k", {0, 0}, {6, 8}));
    } else {
      add(regions_of_box(wire, "q", {6, 0}, {13, 12}));
    }
    if (!(other_needs && e == 0)) ranges.push_back(regions_of_elements(wire, "norm", 0, 8));
    needed.push_back(std::move(ranks));
  }
  return std::make_shared<const RoutingPlan>(RoutingPlan::build(wire, held, needed));
}

inline std::byte image_byte(std::uint64_t version, std::size_t i) {
  return static_cast<std::byte>((i * 31 + version * 101 + 7) & 0xff);
}

// Trainer rank `rank`'s packing of update `version`: what it holds, back to back in wire order.
inline std::vector<std::byte> packing(const RoutingPlan& plan, int rank, std::uint64_t version) {
  std::vector<std::byte> out;
  for (const ByteRange& r : plan.held(rank, 0)) {
    for (std::size_t i = r.begin; i < r.end; ++i) out.push_back(image_byte(version, i));
  }
  return out;
}

// One socket path per trainer rank, beside `dir`.
inline std::vector<std::string> socket_paths(const SocketDir& dir, int count) {
  const auto base = std::filesystem::path(dir.path()).parent_path();
  std::vector<std::string> out;
  for (int t = 0; t < count; ++t) out.push_back((base / fmt::format("trainer{}.sock", t)).string());
  return out;
}

inline std::uint64_t env_u64(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr ? 0 : std::strtoull(value, nullptr, 10);
}

// A trainer rank child: this binary running the hidden test case `test_spec`, told by the
// environment its path (SS_PULL_PATH), rank (SS_PULL_RANK), first version (SS_PULL_FIRST), number
// of updates (SS_PULL_COUNT) and the version to stop in (SS_PULL_STOP_AT, 0: none).
inline std::unique_ptr<ChildProcess> spawn_pull_trainer(const std::string& test_spec,
                                                        const std::string& path, int rank,
                                                        std::uint64_t first, std::uint64_t count,
                                                        std::uint64_t stop_at = 0,
                                                        int in_place = 0) {
  return spawn_self(test_spec, {"SS_PULL_PATH=" + path, "SS_PULL_RANK=" + std::to_string(rank),
                                "SS_PULL_FIRST=" + std::to_string(first),
                                "SS_PULL_COUNT=" + std::to_string(count),
                                "SS_PULL_STOP_AT=" + std::to_string(stop_at),
                                "SS_PULL_IN_PLACE=" + std::to_string(in_place)});
}

}  // namespace shadowsync::testing
