// Route copies against the receive as it runs today: for M trainer ranks (uneven FSDP rows and
// ZeRO-3 flat partitions that cut rows) and N engine ranks (one, or a tensor-parallel split), the
// copies composed from the routes, applied from each trainer rank's packing of a random wire
// image, leave exactly the slot and staging bytes that "the whole bucket received, then the
// plan's pieces replayed" leaves, writing each byte as often as the pieces do; without a plan,
// each route lands at its wire offset. Read in place (in_place_copies.h), from each trainer
// rank's shards as ShardPacking's segments place them, the same copies land the same bytes; a
// table that misses a byte a copy reads refuses the copy. And the refusals, named.
#include <catch2/catch.hpp>

#include <algorithm>
#include <string>
#include <utility>

#include "core/in_place_copies.h"
#include "core/route_copies.h"
#include "core/shard_packing.h"
#include "core/routing_plan.h"
#include "error_message.h"
#include "route_replay.h"
#include "routing_fixture.h"
#include "shadowsync/error.h"
#include "shadowsync/receive_plan.h"

using namespace shadowsync;
using namespace shadowsync::testing;

namespace {

// Today's receive: each whole bucket lands, then its pieces run.
Landed whole_buckets(const Layout& wire, const ReceivePlan& plan, std::size_t slot_bytes,
                     const std::vector<unsigned char>& image) {
  Landed out(slot_bytes, plan.staging_bytes());
  const GroupLayout& group = wire.groups()[0];
  for (std::size_t k = 0; k < group.bucket_count(); ++k) {
    const unsigned char* landed = image.data() + group.bucket(k).offset;
    for (const PlanPiece& p : plan.pieces(0, k)) {
      out.copy_2d(p.to_staging, p.dst_offset, p.dst_pitch, landed + p.src_offset, p.src_pitch,
                  p.row_bytes, p.rows);
    }
  }
  return out;
}

// The composed copies of engine rank `engine`, each reading the slice its trainer rank stages
// for the bucket (packed_range) and nothing outside it, and one route only.
Landed routed(const Layout& wire, const RoutingPlan& routing, int engine,
              const std::vector<std::vector<std::vector<RouteCopy>>>& copies,
              std::size_t slot_bytes, std::size_t staging_bytes,
              const std::vector<std::vector<unsigned char>>& packed) {
  Landed out(slot_bytes, staging_bytes);
  const GroupLayout& group = wire.groups()[0];
  REQUIRE(copies.size() == 1);
  REQUIRE(copies[0].size() == group.bucket_count());
  for (std::size_t k = 0; k < group.bucket_count(); ++k) {
    for (const RouteCopy& c : copies[0][k]) {
      CAPTURE(k, c.trainer, c.packed_offset, c.rows, c.row_bytes);
      const ByteRange slice = routing.packed_range(c.trainer, 0, k);
      const std::size_t first = c.packed_offset;
      const std::size_t last = c.packed_offset + (c.rows - 1) * c.src_pitch + c.row_bytes;
      REQUIRE(last <= slice.end - slice.begin);
      CHECK((c.rows == 1 || (c.src_pitch >= c.row_bytes && c.dst_pitch >= c.row_bytes)));
      // One route of this engine rank from this trainer rank holds both ends of the copy.
      const auto holds = [&](const Route& r) {
        const std::size_t begin = r.source_offset - slice.begin;
        return r.engine == engine && r.trainer == c.trainer && first >= begin &&
               last <= begin + r.bytes;
      };
      const auto& routes = routing.routes(0, k);
      CHECK(std::count_if(routes.begin(), routes.end(), holds) == 1);
      out.copy_2d(c.to_staging, c.dst_offset, c.dst_pitch,
                  packed[c.trainer].data() + slice.begin + c.packed_offset, c.src_pitch,
                  c.row_bytes, c.rows);
    }
  }
  return out;
}

// Trainer rank r's local shards of group 0's tensors, as a trainer holds them: what it holds of
// each tensor in wire order (a box's rows, a flat range), back to back; empty where it holds
// nothing of the tensor.
std::vector<std::vector<unsigned char>> local_shards(const Layout& wire, const RoutingPlan& routing,
                                                     int r, const std::vector<unsigned char>& image) {
  const auto& tensors = wire.groups()[0].tensors();
  std::vector<std::vector<unsigned char>> shards(tensors.size());
  for (const ByteRange& held : routing.held(r, 0)) {
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      const std::size_t begin = std::max(held.begin, tensors[t].offset);
      const std::size_t end = std::min(held.end, tensors[t].offset + tensors[t].bytes);
      if (begin < end) shards[t].insert(shards[t].end(), image.begin() + begin, image.begin() + end);
    }
  }
  return shards;
}

// The same copies as routed(), each read in place: from the trainer ranks' local shards at the
// addresses their ShardPacking segments give.
Landed routed_in_place(const Layout& wire, const RoutingPlan& routing,
                       const std::vector<std::vector<std::vector<RouteCopy>>>& copies,
                       std::size_t slot_bytes, std::size_t staging_bytes,
                       const std::vector<unsigned char>& image) {
  std::vector<std::vector<std::vector<unsigned char>>> shards;
  std::vector<std::vector<InPlaceSegment>> segments;
  for (int r = 0; r < routing.trainer_count(); ++r) {
    shards.push_back(local_shards(wire, routing, r, image));
    std::vector<const std::byte*> data;
    for (const auto& shard : shards.back()) {
      data.push_back(shard.empty() ? nullptr : reinterpret_cast<const std::byte*>(shard.data()));
    }
    ShardPacking(wire, routing, r).append_in_place_segments(0, data, segments.emplace_back());
  }
  Landed out(slot_bytes, staging_bytes);
  std::vector<unsigned char> slot(slot_bytes);
  std::vector<unsigned char> staging(staging_bytes);
  for (std::size_t k = 0; k < wire.groups()[0].bucket_count(); ++k) {
    for (const RouteCopy& c : copies[0][k]) {
      CAPTURE(k, c.trainer, c.packed_offset, c.rows, c.row_bytes);
      std::vector<AddressedCopy> addressed;
      auto* base = reinterpret_cast<std::byte*>(c.to_staging ? staging.data() : slot.data());
      REQUIRE(address_in_place(c, routing.packed_range(c.trainer, 0, k).begin,
                               segments[c.trainer], base, addressed));
      for (const AddressedCopy& a : addressed) {
        const auto dst = static_cast<std::size_t>(a.dst - base);
        out.copy_2d(c.to_staging, dst, a.dst_pitch, reinterpret_cast<const unsigned char*>(a.src),
                    a.src_pitch, a.row_bytes, a.rows);
      }
    }
  }
  return out;
}

void check_same(const Landed& got, const Landed& want) {
  CHECK(got.bytes == want.bytes);  // a byte written twice or a row dropped shows here
  CHECK(got.slot_writes == want.slot_writes);
  CHECK(got.staging_writes == want.staging_writes);
  CHECK(got.slot == want.slot);
  CHECK(got.staging == want.staging);
}

}  // namespace

TEST_CASE("route copies land what the whole bucket and the plan's pieces land, each byte once") {
  const Layout wire = wire_layout();
  const auto image = random_image(wire.groups()[0].arena_bytes(), 11);
  for (const int engines : {1, 2}) {
    // Each engine rank's plan, and the layout its slots have (for the slot's size).
    const std::vector<ReceivePlan> plans = engine_plans(wire, engines);
    const std::vector<RankRanges> needs = needs_of(plans);
    for (const int trainers : {1, 2, 4}) {
      CAPTURE(engines, trainers);
      const auto held = trainer_shards(wire, trainers);
      const RoutingPlan routing = RoutingPlan::build(wire, held, needs);
      const auto packed = packings(held, image);
      for (int e = 0; e < engines; ++e) {
        CAPTURE(e);
        const ReceivePlan& plan = plans[e];
        REQUIRE(plan.staging_bytes() > 0);
        const std::size_t slot_bytes = slot_bytes_of(plan, wire.groups()[0].bucket_count());
        const Landed want = whole_buckets(wire, plan, slot_bytes, image);
        const auto copies = compose_route_copies(routing, e, wire, &plan);
        const Landed got =
            routed(wire, routing, e, copies, slot_bytes, plan.staging_bytes(), packed);
        check_same(got, want);
        // This plan reads each wire byte it needs once and writes each slot or staging byte
        // once: the copies move what the routes bring, no more.
        CHECK(want.bytes == routing.bytes_to(e));
        CHECK(*std::max_element(want.slot_writes.begin(), want.slot_writes.end()) == 1);
        CHECK(*std::max_element(want.staging_writes.begin(), want.staging_writes.end()) == 1);
      }
    }
  }
}

TEST_CASE("without a receive plan each route lands at its wire offset") {
  const Layout wire = wire_layout();
  const GroupLayout& group = wire.groups()[0];
  const auto image = random_image(group.arena_bytes(), 11);
  const std::vector<ByteRange> tensors = every_tensor(wire);
  for (const int trainers : {1, 2, 4}) {
    CAPTURE(trainers);
    const auto held = trainer_shards(wire, trainers);
    const RoutingPlan routing = RoutingPlan::build(wire, held, {{0, {tensors}}});
    const auto copies = compose_route_copies(routing, 0, wire, nullptr);
    const Landed got =
        routed(wire, routing, 0, copies, group.arena_bytes(), 0, packings(held, image));
    std::size_t tensor_bytes = 0;
    for (const ByteRange& r : tensors) {
      CHECK(std::equal(image.begin() + r.begin, image.begin() + r.end, got.slot.begin() + r.begin));
      CHECK(std::all_of(got.slot_writes.begin() + r.begin, got.slot_writes.begin() + r.end,
                        [](int n) { return n == 1; }));
      tensor_bytes += r.end - r.begin;
    }
    CHECK(got.bytes == tensor_bytes);  // the padding between tensors untouched
    std::size_t routes = 0;
    std::size_t copy_count = 0;
    for (std::size_t k = 0; k < group.bucket_count(); ++k) {
      routes += routing.routes(0, k).size();
      copy_count += copies[0][k].size();
    }
    CHECK(copy_count == routes);  // one copy per route
  }
}

TEST_CASE("route copies are refused for another wire, another engine rank or missing routes") {
  const Layout wire = wire_layout();
  const ReceivePlan plan = engine_plan(wire, 0, 1);
  const auto held = trainer_shards(wire, 2);
  SECTION("an engine rank outside the plan") {
    const RoutingPlan routing = RoutingPlan::build(wire, held, {{0, needed_by(plan)}});
    CHECK_THAT(message_of([&] { compose_route_copies(routing, 1, wire, &plan); }),
               Catch::Matchers::Contains("engine rank 1 is outside the routing plan's 0..0"));
  }
  SECTION("another wire layout") {
    const RoutingPlan routing = RoutingPlan::build(wire, held, {{0, needed_by(plan)}});
    const Layout other = Layout::build({{"q", DType::kFloat32, {13, 12}, "base"}});
    CHECK_THAT(message_of([&] { compose_route_copies(routing, 0, other, nullptr); }),
               Catch::Matchers::Contains("is not the one the routing plan was built on"));
  }
  SECTION("bytes a piece reads that no route brings") {
    // The engine rank asked for q only, but its plan reads every tensor.
    const RoutingPlan routing =
        RoutingPlan::build(wire, held, {{0, {regions_of_box(wire, "q", {0, 0}, {13, 12})}}});
    CHECK_THAT(message_of([&] { compose_route_copies(routing, 0, wire, &plan); }),
               Catch::Matchers::Contains("engine rank 0 reads bytes 768..864 of group 'base' "
                                         "(bucket 3), which no route brings to it"));
  }
}

TEST_CASE("route copies read in place from the trainer ranks' shards land what they land from "
          "the packings") {
  const Layout wire = wire_layout();
  const auto image = random_image(wire.groups()[0].arena_bytes(), 23);
  for (const int engines : {1, 2}) {
    const std::vector<ReceivePlan> plans = engine_plans(wire, engines);
    for (const int trainers : {1, 2, 4}) {
      CAPTURE(engines, trainers);
      const auto held = trainer_shards(wire, trainers);
      const RoutingPlan routing = RoutingPlan::build(wire, held, needs_of(plans));
      const auto packed = packings(held, image);
      for (int e = 0; e < engines; ++e) {
        CAPTURE(e);
        const std::size_t slot_bytes = slot_bytes_of(plans[e], wire.groups()[0].bucket_count());
        const auto copies = compose_route_copies(routing, e, wire, &plans[e]);
        const Landed want =
            routed(wire, routing, e, copies, slot_bytes, plans[e].staging_bytes(), packed);
        check_same(routed_in_place(wire, routing, copies, slot_bytes, plans[e].staging_bytes(),
                                   image),
                   want);
      }
    }
  }
  // Without a plan a route may span tensors, whose shards lie apart: its copy is cut at them.
  const std::vector<ByteRange> tensors = every_tensor(wire);
  const auto held = trainer_shards(wire, 2);
  const RoutingPlan routing = RoutingPlan::build(wire, held, {{0, {tensors}}});
  const auto copies = compose_route_copies(routing, 0, wire, nullptr);
  const std::size_t arena = wire.groups()[0].arena_bytes();
  check_same(routed_in_place(wire, routing, copies, arena, 0, image),
             routed(wire, routing, 0, copies, arena, 0, packings(held, image)));
}

TEST_CASE("a copy read in place is refused, with nothing appended, where the table misses a "
          "byte it reads") {
  std::vector<std::byte> shard_a(64);
  std::vector<std::byte> shard_b(64);
  std::vector<std::byte> slot(256);
  // Packing bytes 0..64 at shard_a, 64..128 at shard_b; a copy of 2 rows of 40 bytes, pitch 64,
  // from packing byte 10: rows 10..50 (in a) and 74..114 (in b).
  const std::vector<InPlaceSegment> table{{0, 0, 64, shard_a.data()}, {0, 64, 64, shard_b.data()}};
  const RouteCopy copy{.trainer = 0, .packed_offset = 10, .dst_offset = 16, .src_pitch = 64,
                       .dst_pitch = 100, .row_bytes = 40, .rows = 2};
  std::vector<AddressedCopy> out;
  REQUIRE(address_in_place(copy, 0, table, slot.data(), out));
  // Crossing two segments: one copy per row, each within its segment.
  REQUIRE(out.size() == 2);
  CHECK(out[0] == AddressedCopy{shard_a.data() + 10, 40, slot.data() + 16, 40, 40, 1});
  CHECK(out[1] == AddressedCopy{shard_b.data() + 10, 40, slot.data() + 116, 40, 40, 1});
  // Within one segment: the copy unchanged, its addresses resolved (packed_begin counts).
  out.clear();
  const RouteCopy within{.trainer = 0, .packed_offset = 2, .dst_offset = 0, .src_pitch = 20,
                         .dst_pitch = 30, .row_bytes = 10, .rows = 3};
  REQUIRE(address_in_place(within, 64, table, slot.data(), out));
  CHECK(out == std::vector<AddressedCopy>{{shard_b.data() + 2, 20, slot.data(), 30, 10, 3}});
  // A row that runs past the table's end: refused, nothing appended.
  out.clear();
  const RouteCopy past{.trainer = 0, .packed_offset = 100, .dst_offset = 0, .src_pitch = 40,
                       .dst_pitch = 40, .row_bytes = 40, .rows = 1};
  CHECK_FALSE(address_in_place(past, 0, table, slot.data(), out));
  CHECK(out.empty());
  // A gap in the table under the second row: refused, the first row's copy taken back.
  const std::vector<InPlaceSegment> gap{{0, 0, 64, shard_a.data()}, {0, 80, 48, shard_b.data()}};
  CHECK_FALSE(address_in_place(copy, 0, gap, slot.data(), out));
  CHECK(out.empty());
}
