// The routing plan of a sharded trainer: routes replayed byte by byte against the wire arena
// image (every needed byte arrives once, from the rank that holds it, at its place), bytes per
// engine rank equal to what its receive plan reads, and the refusals, named.
#include <catch2/catch.hpp>

#include <cstring>
#include <functional>

#include "error_message.h"
#include "route_replay.h"
#include "shadowsync/error.h"
#include "shadowsync/receive_plan.h"
#include "core/routing_plan.h"

using namespace shadowsync;
using shadowsync::testing::every_tensor;
using shadowsync::testing::message_of;
using shadowsync::testing::packings;
using shadowsync::testing::random_image;

namespace {

// q [13, 8] (rows divisible by no rank count, across two buckets), k [3, 8], a norm [8];
// buckets of 256 bytes.
Layout wire_layout() {
  return Layout::build({{"q", DType::kFloat32, {13, 8}, "base"},
                        {"k", DType::kFloat32, {3, 8}, "base"},
                        {"norm", DType::kFloat32, {8}, "base"}},
                       {.bucket_bytes = 256});
}

// FSDP2 Shard(0) over `ranks` (uneven: the first ranks get one row more), the norm replicated
// and sent by rank 0.
std::vector<RankRanges> fsdp_shards(const Layout& wire, int ranks) {
  std::vector<RankRanges> out;
  for (int r = 0; r < ranks; ++r) {
    RankRanges held{r, {{}}};
    for (const auto& [name, rows] : {std::pair{"q", 13}, std::pair{"k", 3}}) {
      const int per = (rows + ranks - 1) / ranks;
      const int lo = r * per;
      const int hi = std::min(rows, lo + per);
      if (lo >= hi) continue;
      for (const ByteRange& b : regions_of_box(wire, name, {lo, 0}, {hi, 8})) {
        held.ranges[0].push_back(b);
      }
    }
    if (r == 0) held.ranges[0].push_back(regions_of_elements(wire, "norm", 0, 8));
    out.push_back(std::move(held));
  }
  return out;
}

// Replays the plan: each trainer rank packs what it holds of `image` in wire order; each engine
// rank gets its routes at their wire offsets. Returns each engine rank's buffer (0xEE where
// nothing arrived) and fails on a byte that arrives twice.
std::vector<std::vector<unsigned char>> replay(const Layout& wire, const RoutingPlan& plan,
                                               const std::vector<RankRanges>& trainers,
                                               const std::vector<unsigned char>& image) {
  const auto packed = packings(trainers, image);
  const std::size_t arena = wire.groups()[0].arena_bytes();
  std::vector<std::vector<unsigned char>> engines(plan.engine_count(),
                                                  std::vector<unsigned char>(arena, 0xEE));
  std::vector<std::vector<int>> arrivals(plan.engine_count(), std::vector<int>(arena, 0));
  for (std::size_t b = 0; b < wire.groups()[0].bucket_count(); ++b) {
    const Bucket bucket = wire.groups()[0].bucket(b);
    for (const Route& r : plan.routes(0, b)) {
      REQUIRE(r.bucket == b);
      REQUIRE(r.wire_offset >= bucket.offset);
      REQUIRE(r.wire_offset + r.bytes <= bucket.offset + bucket.bytes);
      REQUIRE(r.source_offset + r.bytes <= packed[r.trainer].size());
      std::memcpy(engines[r.engine].data() + r.wire_offset,
                  packed[r.trainer].data() + r.source_offset, r.bytes);
      for (std::size_t i = 0; i < r.bytes; ++i) {
        REQUIRE(++arrivals[r.engine][r.wire_offset + i] == 1);
      }
    }
  }
  return engines;
}

}  // namespace

TEST_CASE("every byte an engine rank needs arrives once, from the trainer rank that holds it") {
  const Layout wire = wire_layout();
  const auto image = random_image(wire.groups()[0].arena_bytes(), 7);
  for (const int trainers : {1, 2, 4}) {
    CAPTURE(trainers);
    const auto held = fsdp_shards(wire, trainers);
    const std::vector<RankRanges> engines = {{0, {every_tensor(wire)}}};
    const RoutingPlan plan = RoutingPlan::build(wire, held, engines);
    const auto got = replay(wire, plan, held, image);
    for (const ByteRange& r : every_tensor(wire)) {
      CHECK(std::equal(image.begin() + r.begin, image.begin() + r.end, got[0].begin() + r.begin));
    }
    CHECK(plan.bytes_to(0) == (104 + 24 + 8) * 4);
    std::size_t sent = 0;
    for (int t = 0; t < trainers; ++t) sent += plan.bytes_from(t);
    CHECK(sent == plan.bytes_to(0));
  }
}

TEST_CASE("each tensor-parallel engine rank receives exactly the bytes its receive plan reads") {
  // Two engine ranks, each with half of q's and k's rows (a column-parallel layer) and the whole
  // norm: what needed_by reads off each rank's receive plan.
  const Layout wire = wire_layout();
  std::vector<RankRanges> engines;
  std::size_t plan_bytes[2] = {0, 0};
  for (int r = 0; r < 2; ++r) {
    const std::int64_t q_rows = r == 0 ? 7 : 6;
    const std::int64_t k_rows = r == 0 ? 2 : 1;
    const Layout engine = Layout::build({{"q", DType::kFloat32, {q_rows, 8}, "base"},
                                         {"k", DType::kFloat32, {k_rows, 8}, "base"},
                                         {"norm", DType::kFloat32, {8}, "base"}});
    const ReceivePlan plan = ReceivePlan::build(
        wire, engine,
        {{"q", "q", {q_rows, 8}, r * 7 * 8, {8, 1}, 0, {8, 1}},
         {"k", "k", {k_rows, 8}, r * 2 * 8, {8, 1}, 0, {8, 1}},
         {"norm", "norm", {8}, 0, {1}, 0, {1}}});
    engines.push_back({r, needed_by(plan)});
    plan_bytes[r] = static_cast<std::size_t>((q_rows + k_rows) * 8 + 8) * 4;
  }
  const auto held = fsdp_shards(wire, 2);
  const RoutingPlan plan = RoutingPlan::build(wire, held, engines);
  const auto image = random_image(wire.groups()[0].arena_bytes(), 7);
  const auto got = replay(wire, plan, held, image);
  for (int r = 0; r < 2; ++r) {
    CHECK(plan.bytes_to(r) == plan_bytes[r]);
    for (const ByteRange& need : engines[r].ranges[0]) {
      CHECK(std::equal(image.begin() + need.begin, image.begin() + need.end,
                       got[r].begin() + need.begin));
    }
  }
  // A Megatron row-parallel slice (Shard(1): half of every row) is many ranges, one per row.
  CHECK(regions_of_box(wire, "q", {0, 4}, {5, 8}).size() == 5);
  CHECK(regions_of_box(wire, "q", {1, 0}, {3, 8}).size() == 1);  // whole rows: merged
}

TEST_CASE("a trainer rank packs each bucket as one slice of what it holds") {
  const Layout wire = wire_layout();
  const std::vector<RankRanges> engines = {{0, {every_tensor(wire)}}};
  for (const int trainers : {1, 2, 4}) {
    CAPTURE(trainers);
    const auto held = fsdp_shards(wire, trainers);
    const RoutingPlan plan = RoutingPlan::build(wire, held, engines);
    for (int t = 0; t < trainers; ++t) {
      CAPTURE(t);
      std::size_t held_bytes = 0;
      for (const ByteRange& r : plan.held(t, 0)) held_bytes += r.end - r.begin;
      std::size_t packed_bytes = 0;
      std::size_t largest = 0;
      for (std::size_t b = 0; b < wire.groups()[0].bucket_count(); ++b) {
        const ByteRange packed = plan.packed_range(t, 0, b);
        std::size_t routed = 0;
        for (const Route& r : plan.routes(0, b)) {
          if (r.trainer != t) continue;
          CHECK(r.source_offset >= packed.begin);
          CHECK(r.source_offset + r.bytes <= packed.end);
          routed += r.bytes;
        }
        // One engine rank needs every byte: the slice is exactly what the routes read.
        CHECK(packed.end - packed.begin == routed);
        packed_bytes += packed.end - packed.begin;
        largest = std::max(largest, packed.end - packed.begin);
      }
      CHECK(packed_bytes == held_bytes);
      CHECK(packed_bytes == plan.bytes_from(t));
      CHECK(plan.max_packed_bytes(t) == largest);
    }
  }
  // held() is sorted and merged: one rank holds every tensor, each one range (q's 13 rows
  // merged), apart where the layout pads between tensors.
  const RoutingPlan one = RoutingPlan::build(wire, fsdp_shards(wire, 1), engines);
  CHECK(one.held(0, 0) == every_tensor(wire));
}

TEST_CASE("the routing plan's fingerprint follows the sharding") {
  const Layout wire = wire_layout();
  const std::vector<RankRanges> engines = {{0, {every_tensor(wire)}}};
  const auto two = RoutingPlan::build(wire, fsdp_shards(wire, 2), engines).fingerprint();
  CHECK(two == RoutingPlan::build(wire, fsdp_shards(wire, 2), engines).fingerprint());
  CHECK(two != RoutingPlan::build(wire, fsdp_shards(wire, 4), engines).fingerprint());
}

TEST_CASE("a routing plan refuses bad shardings, naming the ranks and the bytes") {
  const Layout wire = wire_layout();
  const std::vector<RankRanges> engines = {{0, {every_tensor(wire)}}};
  auto held = fsdp_shards(wire, 2);
  SECTION("bytes two trainer ranks hold") {
    held[1].ranges[0].push_back(regions_of_elements(wire, "norm", 4, 4));  // rank 0 sends it
    CHECK_THAT(message_of([&] { RoutingPlan::build(wire, held, engines); }),
               Catch::Matchers::Contains("trainer ranks 0 and 1 both hold bytes 16..32 of tensor "
                                         "'norm'"));
  }
  SECTION("bytes no trainer rank holds") {
    held[0].ranges[0].pop_back();  // nobody sends the norm
    CHECK_THAT(message_of([&] { RoutingPlan::build(wire, held, engines); }),
               Catch::Matchers::Contains("engine rank 0 needs bytes 0..32 of tensor 'norm' "
                                         "(group 'base'), which no trainer rank holds"));
  }
  SECTION("ranks missing, outside or twice: each named") {
    held[1].rank = 0;
    CHECK_THAT(message_of([&] { RoutingPlan::build(wire, held, engines); }),
               Catch::Matchers::Contains("trainer ranks 0..1 expected (2 lists given, one per "
                                         "rank): rank 1 missing, rank 0 given twice"));
    held = fsdp_shards(wire, 3);
    held[1].rank = 3;
    CHECK_THAT(message_of([&] { RoutingPlan::build(wire, held, engines); }),
               Catch::Matchers::Contains("trainer ranks 0..2 expected (3 lists given, one per "
                                         "rank): rank 1 missing, rank 3 outside"));
    std::vector<RankRanges> two_engines = {engines[0], engines[0]};
    two_engines[1].rank = -1;
    CHECK_THAT(message_of([&] { RoutingPlan::build(wire, fsdp_shards(wire, 2), two_engines); }),
               Catch::Matchers::Contains("engine ranks 0..1 expected (2 lists given, one per "
                                         "rank): rank 1 missing, rank -1 outside"));
  }
  SECTION("a box outside its tensor") {
    CHECK_THAT(message_of([&] { regions_of_box(wire, "q", {0, 0}, {14, 8}); }),
               Catch::Matchers::Contains("tensor 'q' of shape [13, 8]: the box [0, 0]..[14, 8] "
                                         "is empty or outside it"));
  }
}
