// The point-to-point schedule of a routing plan (plugin/core/p2p_schedule.h) for M = 1, 2, 4
// trainer ranks (uneven FSDP rows, ZeRO-3 partitions cutting rows) and N = 1, 2 engine ranks (a
// tensor-parallel split with a fused tensor and an FP8-staged one): every send has exactly one
// receive at the same position of both ends' per-peer order with the same byte count (else NCCL
// truncates or hangs); an engine rank receives bytes_to(e); and running the schedule with memcpy
// between per-rank buffers of a random image, then the engine's copies from its landing buffer,
// leaves the slot and staging bytes of "whole bucket received, then the plan's pieces". With
// engine replicas, the trainer ranks' sends do not change and each replica forwards its landing
// buffer to the next.
#include <catch2/catch.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "core/p2p_schedule.h"
#include "core/route_copies.h"
#include "core/routing_plan.h"
#include "error_message.h"
#include "route_replay.h"
#include "routing_fixture.h"
#include "shadowsync/error.h"
#include "shadowsync/receive_plan.h"

using namespace shadowsync;
using namespace shadowsync::testing;

namespace {

// The ops of one kind between communicator ranks `from` and `to`, in `from`'s posting order.
std::vector<P2pOp> ops_with(const std::vector<P2pOp>& ops, P2pOp::Kind kind, int peer) {
  std::vector<P2pOp> out;
  for (const P2pOp& op : ops) {
    if (op.kind == kind && op.peer == peer) out.push_back(op);
  }
  return out;
}

}  // namespace

TEST_CASE("every send meets one receive, and the schedule lands what the plan's pieces land") {
  const Layout wire = wire_layout();
  const GroupLayout& group = wire.groups()[0];
  const auto image = random_image(group.arena_bytes(), 43);
  for (const int engines : {1, 2}) {
    const std::vector<ReceivePlan> plans = engine_plans(wire, engines);
    const std::vector<RankRanges> needs = needs_of(plans);
    for (const int trainers : {1, 2, 4}) {
      CAPTURE(engines, trainers);
      const auto held = trainer_shards(wire, trainers);
      const RoutingPlan routing = RoutingPlan::build(wire, held, needs);
      const auto packed = packings(held, image);
      const int world = trainers + engines;
      std::vector<Landed> got;
      std::vector<Landed> want;
      std::vector<std::vector<std::vector<RouteCopy>>> copies;  // [engine][bucket]
      for (int e = 0; e < engines; ++e) {
        const std::size_t slot = slot_bytes_of(plans[e], group.bucket_count());
        got.emplace_back(slot, plans[e].staging_bytes());
        want.emplace_back(slot, plans[e].staging_bytes());
        copies.push_back(compose_route_copies(routing, e, wire, &plans[e])[0]);
      }
      std::vector<std::size_t> received(engines, 0);
      std::size_t most_landing = 0;
      for (std::size_t k = 0; k < group.bucket_count(); ++k) {
        CAPTURE(k);
        std::vector<std::vector<P2pOp>> ops(world);
        for (int rank = 0; rank < world; ++rank) ops[rank] = p2p_schedule(routing, rank, 0, k);
        // Trainer ranks only send, to engine ranks; engine ranks only receive, from trainers.
        for (int rank = 0; rank < world; ++rank) {
          for (const P2pOp& op : ops[rank]) {
            const bool trainer = rank < trainers;
            CHECK(op.kind == (trainer ? P2pOp::kSend : P2pOp::kRecv));
            CHECK((trainer ? op.peer >= trainers && op.peer < world
                           : op.peer >= 0 && op.peer < trainers));
            CHECK(op.bytes > 0);
          }
        }
        // The landing buffers of the bucket, then each pair's ops matched position by position
        // and run as memcpy.
        std::vector<std::vector<unsigned char>> landing(engines);
        for (int e = 0; e < engines; ++e) {
          std::size_t bytes = 0;
          for (const P2pOp& op : ops[trainers + e]) bytes = std::max(bytes, op.offset + op.bytes);
          landing[e].assign(bytes, 0xCC);
          most_landing = std::max(most_landing, bytes);
        }
        for (int t = 0; t < trainers; ++t) {
          const ByteRange slice = routing.packed_range(t, 0, k);
          for (int e = 0; e < engines; ++e) {
            CAPTURE(t, e);
            const auto sends = ops_with(ops[t], P2pOp::kSend, trainers + e);
            const auto recvs = ops_with(ops[trainers + e], P2pOp::kRecv, t);
            REQUIRE(sends.size() == recvs.size());
            for (std::size_t i = 0; i < sends.size(); ++i) {
              CAPTURE(i);
              REQUIRE(sends[i].bytes == recvs[i].bytes);
              REQUIRE(sends[i].offset + sends[i].bytes <= slice.end - slice.begin);
              std::memcpy(landing[e].data() + recvs[i].offset,
                          packed[t].data() + slice.begin + sends[i].offset, sends[i].bytes);
              received[e] += recvs[i].bytes;
            }
          }
        }
        // The engine's copies, from its landing buffer.
        for (int e = 0; e < engines; ++e) {
          const auto layout = landing_layout(routing, e, 0, k);
          for (const RouteCopy& c : copies[e][k]) {
            const RouteCopy l = landing_copy(layout, c);
            REQUIRE(l.packed_offset + (l.rows - 1) * l.src_pitch + l.row_bytes <=
                    landing[e].size());
            got[e].copy_2d(l.to_staging, l.dst_offset, l.dst_pitch,
                           landing[e].data() + l.packed_offset, l.src_pitch, l.row_bytes, l.rows);
          }
          for (const PlanPiece& p : plans[e].pieces(0, k)) {
            want[e].copy_2d(p.to_staging, p.dst_offset, p.dst_pitch,
                            image.data() + group.bucket(k).offset + p.src_offset, p.src_pitch,
                            p.row_bytes, p.rows);
          }
        }
      }
      std::size_t most = 0;
      for (int e = 0; e < engines; ++e) {
        CAPTURE(e);
        CHECK(received[e] == routing.bytes_to(e));
        CHECK(got[e].slot == want[e].slot);
        CHECK(got[e].staging == want[e].staging);
        CHECK(got[e].slot_writes == want[e].slot_writes);
        CHECK(got[e].staging_writes == want[e].staging_writes);
        most = std::max(most, max_landing_bytes(routing, wire, e));
      }
      CHECK(most == most_landing);
    }
  }
}

TEST_CASE("engine replicas: the trainer ranks send once, each replica forwards the bucket to the "
          "next") {
  const Layout wire = wire_layout();
  const GroupLayout& group = wire.groups()[0];
  for (const int engines : {1, 2}) {
    const std::vector<ReceivePlan> plans = engine_plans(wire, engines);
    const std::vector<RankRanges> needs = needs_of(plans);
    for (const int trainers : {1, 2, 4}) {
      const RoutingPlan routing = RoutingPlan::build(wire, trainer_shards(wire, trainers), needs);
      for (const int replicas : {2, 3}) {
        CAPTURE(engines, trainers, replicas);
        const int world = trainers + replicas * engines;
        for (std::size_t k = 0; k < group.bucket_count(); ++k) {
          CAPTURE(k);
          // Trainer ranks: the same sends as without replicas (to replica 0), no forward.
          for (int t = 0; t < trainers; ++t) {
            CHECK(p2p_schedule(routing, t, 0, k, replicas) == p2p_schedule(routing, t, 0, k));
            CHECK(p2p_forward(routing, t, 0, k, replicas).empty());
          }
          for (int e = 0; e < engines; ++e) {
            CAPTURE(e);
            const auto first = p2p_schedule(routing, trainers + e, 0, k, replicas);
            CHECK(first == p2p_schedule(routing, trainers + e, 0, k));
            std::size_t landing = 0;
            for (const P2pOp& op : first) landing = std::max(landing, op.offset + op.bytes);
            // Replica r's rank e: what r - 1's forwards (one op each, the whole landing
            // buffer), and forwards it to r + 1's, except the last replica.
            for (int r = 0; r < replicas; ++r) {
              CAPTURE(r);
              const int rank = trainers + r * engines + e;
              const auto forward = p2p_forward(routing, rank, 0, k, replicas);
              if (r == replicas - 1 || landing == 0) {
                CHECK(forward.empty());
              } else {
                REQUIRE(forward.size() == 1);
                CHECK(forward[0] == P2pOp{P2pOp::kSend, rank + engines, 0, landing});
                const auto next = p2p_schedule(routing, rank + engines, 0, k, replicas);
                REQUIRE(next.size() == 1);
                CHECK(next[0] == P2pOp{P2pOp::kRecv, rank, 0, landing});
              }
              if (r > 0 && landing == 0) {
                CHECK(p2p_schedule(routing, rank, 0, k, replicas).empty());
              }
            }
          }
          // Every send in the communicator meets one receive, whatever ranks post them.
          std::size_t sends = 0;
          std::size_t receives = 0;
          for (int rank = 0; rank < world; ++rank) {
            for (const auto& ops : {p2p_schedule(routing, rank, 0, k, replicas),
                                    p2p_forward(routing, rank, 0, k, replicas)}) {
              for (const P2pOp& op : ops) {
                REQUIRE(op.peer >= 0);
                REQUIRE(op.peer < world);
                const auto theirs = p2p_schedule(routing, op.peer, 0, k, replicas);
                const auto their_forward = p2p_forward(routing, op.peer, 0, k, replicas);
                const P2pOp::Kind other = op.kind == P2pOp::kSend ? P2pOp::kRecv : P2pOp::kSend;
                std::size_t matching = ops_with(theirs, other, rank).size() +
                                       ops_with(their_forward, other, rank).size();
                CHECK(matching == ops_with(ops, op.kind, op.peer).size());
                (op.kind == P2pOp::kSend ? sends : receives) += op.bytes;
              }
            }
          }
          CHECK(sends == receives);
        }
      }
    }
  }
}

TEST_CASE("a landing copy is refused for a copy no route into the rank holds") {
  const Layout wire = wire_layout();
  const ReceivePlan plan = engine_plan(wire, 0, 1);
  const RoutingPlan routing =
      RoutingPlan::build(wire, trainer_shards(wire, 2), {{0, needed_by(plan)}});
  const auto layout = landing_layout(routing, 0, 0, 0);
  REQUIRE(!layout.empty());
  const LandingRoute& r = layout.front();
  // One byte past the route (a copy never spans two routes), and a trainer rank with none.
  const RouteCopy past{r.trainer, r.packed_offset, 0, r.bytes + 1, r.bytes + 1, r.bytes + 1, 1};
  const RouteCopy stranger{7, 0, 0, 1, 1, 1, 1};
  CHECK(landing_copy(layout, {r.trainer, r.packed_offset, 5, r.bytes, r.bytes, r.bytes, 1}) ==
        RouteCopy{r.trainer, r.landing_offset, 5, r.bytes, r.bytes, r.bytes, 1});
  CHECK(message_of([&] { landing_copy(layout, past); }) ==
        fmt::format("a route copy reads bytes {}..{} of trainer rank {}'s packing, which no "
                    "route of this bucket into this engine rank holds: the copies were composed "
                    "for another engine rank, bucket or routing plan",
                    r.packed_offset, r.packed_offset + r.bytes + 1, r.trainer));
  CHECK_THAT(message_of([&] { landing_copy(layout, stranger); }),
             Catch::Matchers::Contains("bytes 0..1 of trainer rank 7's packing"));
}

TEST_CASE("communicator ranks outside the plan and ranks sharing a GPU are refused, named") {
  const Layout wire = wire_layout();
  const ReceivePlan plan = engine_plan(wire, 0, 1);
  const RoutingPlan routing =
      RoutingPlan::build(wire, trainer_shards(wire, 2), {{0, needed_by(plan)}});
  CHECK_THAT(message_of([&] { p2p_schedule(routing, 3, 0, 0); }),
             Catch::Matchers::Contains("communicator rank 3 is outside 0..2 (trainer ranks 0..1, "
                                       "then engine ranks)"));
  CHECK_THAT(message_of([&] { landing_layout(routing, 1, 0, 0); }),
             Catch::Matchers::Contains("engine rank 1 is outside the routing plan's 0..0"));
  CHECK(message_of([&] {
          check_p2p_gpus(routing, {"h/GPU-0", "h/GPU-1", "h/GPU-2"});
        }) == "<no error>");
  CHECK(message_of([&] {
          check_p2p_gpus(routing, {"h/GPU-0", "h/GPU-1", "h/GPU-1"});
        }) ==
        "trainer rank 1 and engine rank 0 (communicator rank 2) are both on GPU 'h/GPU-1': NCCL "
        "cannot connect two ranks of one communicator on one GPU; use the same-host pull "
        "transport for a trainer and an engine sharing a GPU");
  CHECK_THAT(message_of([&] {
               check_p2p_gpus(routing, {"h/GPU-0", "h/GPU-0", "h/GPU-2"});
             }),
             Catch::Matchers::Contains("trainer rank 0 and trainer rank 1 are both on GPU "
                                       "'h/GPU-0'") &&
                 Catch::Matchers::Contains("give each rank a GPU of its own"));
  CHECK_THAT(message_of([&] { check_p2p_gpus(routing, {"h/GPU-0"}); }),
             Catch::Matchers::Contains("1 GPUs given for a communicator of 3 ranks (2 trainer and "
                                       "1 engine ranks)"));
  // Engine replicas: R x N engine ranks after the trainer ranks, each named with its replica.
  CHECK_THAT(message_of([&] { p2p_schedule(routing, 5, 0, 0, 3); }),
             Catch::Matchers::Contains("communicator rank 5 is outside 0..4 (trainer ranks 0..1, "
                                       "then engine ranks of 3 replicas)"));
  CHECK_THAT(message_of([&] { p2p_forward(routing, 0, 0, 0, 0); }),
             Catch::Matchers::Contains("0 engine replicas: there must be at least 1"));
  CHECK(message_of([&] {
          check_p2p_gpus(routing, {"h/GPU-0", "h/GPU-1", "h/GPU-2", "h/GPU-3"}, 2);
        }) == "<no error>");
  CHECK(message_of([&] {
          check_p2p_gpus(routing, {"h/GPU-0", "h/GPU-1", "h/GPU-2", "h/GPU-2"}, 2);
        }) ==
        "engine rank 0 of replica 0 (communicator rank 2) and engine rank 0 of replica 1 "
        "(communicator rank 3) are both on GPU 'h/GPU-2': NCCL cannot connect two ranks of one "
        "communicator on one GPU; give each rank a GPU of its own");
  CHECK(message_of([&] {
          check_p2p_gpus(routing, {"h/GPU-0", "h/GPU-1", "h/GPU-2"}, 2);
        }) ==
        "3 GPUs given for a communicator of 4 ranks (2 trainer and 1 engine ranks in each of 2 "
        "replicas): name the GPU of every rank, trainer ranks first, then each replica's engine "
        "ranks");
}
