// NCCL routes without a GPU (plugin/transports/nccl/nccl_route_mover.h): every rank of a routing
// plan of M = 1, 2, 4 trainer ranks and N = 1, 2 engine ranks gets a route mover on a
// communicator that records its calls and carries each send's bytes to the receive it pairs
// with (by peer pair and order, as NCCL pairs them) as a copy on the receiver's HostBackend
// stream. Checked: one group per bucket per rank, the calls inside it are p2p_schedule's (from
// the bucket's packing, into the landing buffer), nothing is posted before receive_routes_async,
// the landing buffer is allocated once, and the slot and staging bytes equal the plan's pieces
// replayed on the whole image. With R = 2, 3 engine replicas in the communicator too: the trainer
// ranks' calls do not change (every send goes to replica 0), each replica's engine rank receives
// the bucket from the one before and forwards it to the next in a group of its own, and every
// replica lands the same bytes. Then the refusals, which post nothing, and the group closed when
// a call inside it fails. NcclTransport itself needs a GPU beyond its set-up refusals
// (checked here); across two GPUs it runs in tests/gpu.
#include <catch2/catch.hpp>

#if defined(SHADOWSYNC_WITH_CUDA)

#include <fmt/format.h>

#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/p2p_schedule.h"
#include "core/route_copies.h"
#include "core/routing_plan.h"
#include "error_message.h"
#include "routing_fixture.h"
#include "shadowsync/error.h"
#include "shadowsync/host_backend.h"
#include "shadowsync/nccl_transport.h"
#include "transports/nccl/nccl_route_mover.h"

using namespace shadowsync;
using shadowsync::nccl_detail::NcclRouteMover;
using shadowsync::nccl_detail::P2pCommunicator;
using shadowsync::testing::engine_plan;
using shadowsync::testing::message_of;
using shadowsync::testing::routing_plan;
using shadowsync::testing::wire_layout;

namespace {

struct Call {
  enum Kind { kGroupStart, kGroupEnd, kSend, kRecv };
  Kind kind;
  int peer = -1;
  const void* buffer = nullptr;
  std::size_t bytes = 0;
  friend bool operator==(const Call&, const Call&) = default;
};

// The sends not yet received, by (from, to) in posting order: what NCCL pairs receives with.
using Wire = std::map<std::pair<int, int>, std::deque<std::pair<const void*, std::size_t>>>;

// A communicator rank that records its calls. A receive takes the oldest send of its pair (its
// byte count must match, as NCCL's must) and copies it on the stream, as NCCL would land it.
class RecordingComm final : public P2pCommunicator {
 public:
  RecordingComm(int rank, Wire& wire, Backend& backend)
      : rank_(rank), wire_(wire), backend_(backend) {}

  void group_begin() override {
    CHECK(depth_ == 0);  // the mover opens one group at a time
    ++depth_;
    calls.push_back({Call::kGroupStart});
  }
  void group_end() override {
    CHECK(depth_ == 1);
    --depth_;
    calls.push_back({Call::kGroupEnd});
  }
  void send_async(const void* buffer, std::size_t bytes, int peer, Stream&) override {
    CHECK(depth_ == 1);  // inside a group
    calls.push_back({Call::kSend, peer, buffer, bytes});
    if (fail_at_op-- == 0) throw Error(ErrorCode::kTransport, "injected: the send failed");
    wire_[{rank_, peer}].push_back({buffer, bytes});
  }
  void recv_async(void* buffer, std::size_t bytes, int peer, Stream& stream) override {
    CHECK(depth_ == 1);
    calls.push_back({Call::kRecv, peer, buffer, bytes});
    auto& sent = wire_[{peer, rank_}];
    REQUIRE(!sent.empty());                 // a receive no send pairs with: NCCL would hang
    REQUIRE(sent.front().second == bytes);  // NCCL would truncate or fail
    backend_.memcpy_async(buffer, sent.front().first, bytes, stream);
    sent.pop_front();
  }

  std::vector<Call> calls;
  int fail_at_op = -1;  // >= 0: the send with this index (from 0) throws

 private:
  const int rank_;
  Wire& wire_;
  Backend& backend_;
  int depth_ = 0;
};

std::vector<std::byte> random_image(std::size_t bytes) {
  std::mt19937 rng(4343);
  std::vector<std::byte> image(bytes);
  for (auto& b : image) b = static_cast<std::byte>(rng());
  return image;
}

// The calls p2p_schedule and p2p_forward say rank `rank` makes for one bucket (of R = `replicas`
// engine replicas): the receive group around its ops, then the forward group where it forwards,
// addressed from `base` (its packing of the bucket, or its landing buffer).
std::vector<Call> scheduled(const RoutingPlan& routing, int rank, std::size_t bucket,
                            const std::byte* base, int replicas) {
  std::vector<Call> calls;
  for (const auto& ops : {p2p_schedule(routing, rank, 0, bucket, replicas),
                          p2p_forward(routing, rank, 0, bucket, replicas)}) {
    if (ops.empty() && !calls.empty()) continue;  // the receive group opens even when empty
    calls.push_back({Call::kGroupStart});
    for (const P2pOp& op : ops) {
      calls.push_back({op.kind == P2pOp::kSend ? Call::kSend : Call::kRecv, op.peer,
                       base + op.offset, op.bytes});
    }
    calls.push_back({Call::kGroupEnd});
  }
  return calls;
}

// An engine rank's receive targets.
struct Targets {
  std::vector<std::byte> slot;
  std::vector<std::byte> staging;
  RouteTargets pointers() { return {slot.data(), staging.empty() ? nullptr : staging.data()}; }
};

Targets targets_for(const ReceivePlan& plan, std::size_t buckets) {
  std::size_t slot = 0;
  for (std::size_t k = 0; k < buckets; ++k) {
    for (const PlanPiece& p : plan.pieces(0, k)) {
      if (!p.to_staging)
        slot = std::max(slot, p.dst_offset + (p.rows - 1) * p.dst_pitch + p.row_bytes);
    }
  }
  return {std::vector<std::byte>(slot, std::byte{0xEE}),
          std::vector<std::byte>(plan.staging_bytes(), std::byte{0xEE})};
}

// What the plan's pieces leave from the whole image.
Targets reference(const Layout& wire, const ReceivePlan& plan,
                  const std::vector<std::byte>& image) {
  const GroupLayout& group = wire.groups()[0];
  Targets out = targets_for(plan, group.bucket_count());
  for (std::size_t k = 0; k < group.bucket_count(); ++k) {
    for (const PlanPiece& p : plan.pieces(0, k)) {
      auto& to = p.to_staging ? out.staging : out.slot;
      for (std::size_t r = 0; r < p.rows; ++r) {
        std::memcpy(to.data() + p.dst_offset + r * p.dst_pitch,
                    image.data() + group.bucket(k).offset + p.src_offset + r * p.src_pitch,
                    p.row_bytes);
      }
    }
  }
  return out;
}

}  // namespace

TEST_CASE(
    "NCCL routes: one group per bucket per rank holding p2p_schedule's calls, the plan's "
    "bytes landed; engine replicas forward along a chain, the trainer sends once") {
  const Layout wire = wire_layout();
  const GroupLayout& group = wire.groups()[0];
  const std::size_t buckets = group.bucket_count();
  for (const int replicas : {1, 2, 3}) {
    for (const int engines : {1, 2}) {
      for (const int trainers : {1, 2, 4}) {
        CAPTURE(replicas, engines, trainers);
        const auto routing =
            std::make_shared<const RoutingPlan>(routing_plan(wire, trainers, engines));
        const int world = trainers + replicas * engines;
        HostBackend backend;
        Wire in_flight;
        std::vector<std::unique_ptr<RecordingComm>> comms;
        std::vector<std::unique_ptr<NcclRouteMover>> movers;
        const std::size_t allocated_before = backend.bytes_allocated();
        std::size_t landing_bytes = 0;
        for (int rank = 0; rank < world; ++rank) {
          comms.push_back(std::make_unique<RecordingComm>(rank, in_flight, backend));
          movers.push_back(std::make_unique<NcclRouteMover>(*comms[rank], routing, wire, rank,
                                                            backend, replicas));
          if (rank >= trainers) {
            CHECK(movers[rank]->engine_rank() == (rank - trainers) % engines);
            CHECK(movers[rank]->replica() == (rank - trainers) / engines);
            landing_bytes += max_landing_bytes(*routing, wire, movers[rank]->engine_rank());
          }
        }
        // Set-up allocates each engine rank's landing buffer once and posts nothing.
        CHECK(backend.bytes_allocated() - allocated_before == landing_bytes);
        for (const auto& comm : comms) CHECK(comm->calls.empty());

        std::vector<ReceivePlan> plans;
        std::vector<std::vector<std::vector<RouteCopy>>> copies;  // [engine][bucket]
        for (int e = 0; e < engines; ++e) {
          plans.push_back(engine_plan(wire, e, engines));
          copies.push_back(compose_route_copies(*routing, e, wire, &plans[e])[0]);
        }
        std::vector<Targets> targets;  // [communicator rank - M]: every replica's engine ranks
        std::vector<std::unique_ptr<Stream>> streams;
        for (int rank = trainers; rank < world; ++rank) {
          targets.push_back(targets_for(plans[(rank - trainers) % engines], buckets));
          streams.push_back(backend.create_stream(StreamPriority::kLow));
        }
        const auto trainer_stream = backend.create_stream(StreamPriority::kNormal);

        // Two updates of two images: the landing buffer is reused, nothing leaks across.
        for (const std::uint64_t version : {7u, 8u}) {
          CAPTURE(version);
          const auto image = random_image(group.arena_bytes() + version);
          std::vector<std::vector<std::byte>> packed(trainers);
          for (int t = 0; t < trainers; ++t) {
            for (const ByteRange& r : routing->held(t, 0)) {
              packed[t].insert(packed[t].end(), image.begin() + r.begin, image.begin() + r.end);
            }
          }
          std::vector<std::size_t> calls_before(comms.size());
          for (std::size_t rank = 0; rank < comms.size(); ++rank) {
            calls_before[rank] = comms[rank]->calls.size();
          }
          for (int t = 0; t < trainers; ++t) {
            for (std::size_t k = 0; k < buckets; ++k) {
              const ByteRange slice = routing->packed_range(t, 0, k);
              movers[t]->send_routes_async({version, k, 0, k}, packed[t].data() + slice.begin,
                                           slice.end - slice.begin, *trainer_stream);
            }
          }
          // Every trainer rank sent its update; no engine rank posted a receive yet.
          for (int rank = trainers; rank < world; ++rank) {
            CHECK(comms[rank]->calls.size() == calls_before[rank]);
          }
          // Bucket by bucket along the chain, each rank's stream drained before the next
          // replica reads its landing buffer (as NCCL's receive waits for the send's bytes).
          for (std::size_t k = 0; k < buckets; ++k) {
            for (int rank = trainers; rank < world; ++rank) {
              const int e = (rank - trainers) % engines;
              movers[rank]->receive_routes_async({version, k, 0, k}, copies[e][k],
                                                 targets[rank - trainers].pointers(),
                                                 *streams[rank - trainers]);
              backend.stream_synchronize(*streams[rank - trainers]);
            }
          }
          for (const auto& [pair, sends] : in_flight) {
            CAPTURE(pair.first, pair.second);
            CHECK(sends.empty());  // every send was received
          }

          // The calls, bucket by bucket: exactly the schedule's, in groups of their own.
          for (int rank = 0; rank < world; ++rank) {
            CAPTURE(rank);
            std::vector<Call> want;
            for (std::size_t k = 0; k < buckets; ++k) {
              const std::byte* base =
                  rank < trainers ? packed[rank].data() + routing->packed_range(rank, 0, k).begin
                                  : movers[rank]->landing();
              const auto bucket_calls = scheduled(*routing, rank, k, base, replicas);
              want.insert(want.end(), bucket_calls.begin(), bucket_calls.end());
            }
            const std::vector<Call> got(comms[rank]->calls.begin() + calls_before[rank],
                                        comms[rank]->calls.end());
            CHECK(got == want);
            // A trainer rank sends only to replica 0, so once per bucket whatever R; the last
            // replica forwards nothing.
            for (const Call& c : got) {
              if (c.kind != Call::kSend) continue;
              if (rank < trainers) CHECK(c.peer < trainers + engines);
              CHECK(rank < trainers + (replicas - 1) * engines);
            }
          }
          for (int rank = trainers; rank < world; ++rank) {
            CAPTURE(rank);
            const int e = (rank - trainers) % engines;
            const Targets want = reference(wire, plans[e], image);
            CHECK(targets[rank - trainers].slot == want.slot);
            CHECK(targets[rank - trainers].staging == want.staging);
            // These plans read every byte routed to the rank once.
            CHECK(movers[rank]->routed_bytes() == (version - 6) * routing->bytes_to(e));
          }
        }
        CHECK(backend.bytes_allocated() - allocated_before == landing_bytes);
      }
    }
  }
}

TEST_CASE("NCCL routes: refusals post nothing; a failure inside a group still closes it") {
  const Layout wire = wire_layout();
  const auto routing = std::make_shared<const RoutingPlan>(routing_plan(wire, 2, 2));
  const ReceivePlan plan0 = engine_plan(wire, 0, 2);
  const ReceivePlan plan1 = engine_plan(wire, 1, 2);
  HostBackend backend;
  Wire in_flight;
  const auto stream = backend.create_stream(StreamPriority::kLow);
  RecordingComm trainer_comm(0, in_flight, backend);
  RecordingComm engine_comm(2, in_flight, backend);
  NcclRouteMover trainer(trainer_comm, routing, wire, 0, backend);
  NcclRouteMover engine(engine_comm, routing, wire, 2, backend);  // engine rank 0
  CHECK(trainer.trainer_rank() == 0);
  CHECK(trainer.engine_rank() == -1);
  CHECK(engine.engine_rank() == 0);
  const ByteRange slice = routing->packed_range(0, 0, 0);
  const std::size_t bytes = slice.end - slice.begin;
  REQUIRE(bytes > 0);
  std::vector<std::byte> packed(bytes);
  const auto copies0 = compose_route_copies(*routing, 0, wire, &plan0)[0];
  const auto copies1 = compose_route_copies(*routing, 1, wire, &plan1)[0];
  Targets targets = targets_for(plan0, wire.groups()[0].bucket_count());

  CHECK(message_of([&] {
          trainer.send_routes_async({3, 0, 0, 0}, packed.data(), bytes + 1, *stream);
        }) == fmt::format("NCCL routes: trainer rank 0 sends {} bytes of bucket 0 of group 0 "
                          "(update 3); the routing plan's packed range is {} bytes ({}..{})",
                          bytes + 1, bytes, slice.begin, slice.end));
  CHECK_THAT(message_of([&] {
               trainer.send_routes_async({3, 1, 0, 1}, packed.data(), bytes, *stream);
             }),
             Catch::Matchers::Contains("send_routes_async for bucket 1 of update 3, but no update "
                                       "is in progress"));
  CHECK_THAT(message_of([&] {
               engine.send_routes_async({3, 0, 0, 0}, packed.data(), bytes, *stream);
             }),
             Catch::Matchers::Contains("send_routes_async on communicator rank 2, an engine rank"));
  CHECK_THAT(message_of([&] {
               trainer.receive_routes_async({3, 0, 0, 0}, copies0[0], targets.pointers(), *stream);
             }),
             Catch::Matchers::Contains("receive_routes_async on communicator rank 0, a trainer "
                                       "rank"));
  CHECK_THAT(message_of([&] {
               trainer.send_routes_async({3, 0, 9, 0}, packed.data(), bytes, *stream);
             }),
             Catch::Matchers::Contains("for bucket 0 of group 9, which the wire layout does not "
                                       "have (1 groups)"));
  // A copy of engine rank 1's that reads a route engine rank 0 does not get.
  std::vector<RouteCopy> foreign;
  std::size_t k = 0;
  for (; k < copies1.size() && foreign.empty(); ++k) {
    const auto layout0 = landing_layout(*routing, 0, 0, k);
    for (const RouteCopy& c : copies1[k]) {
      if (message_of([&] { landing_copy(layout0, c); }) != "<no error>") {
        foreign.push_back(c);
        break;
      }
    }
  }
  REQUIRE(!foreign.empty());
  CHECK_THAT(message_of([&] {
               engine.receive_routes_async({3, 0, 0, k - 1}, foreign, targets.pointers(), *stream);
             }),
             Catch::Matchers::Contains("which no route of this bucket into this engine rank "
                                       "holds"));
  REQUIRE(!copies0[0].empty());
  REQUIRE(!copies0[0].front().to_staging);
  CHECK_THAT(message_of([&] {
               engine.receive_routes_async({3, 0, 0, 0}, copies0[0], {}, *stream);
             }),
             Catch::Matchers::Contains("into its slot but no slot memory was given"));
  CHECK(trainer_comm.calls.empty());
  CHECK(engine_comm.calls.empty());

  SECTION("a send that fails inside the group: the group is closed, the error passes on") {
    trainer_comm.fail_at_op = 0;
    CHECK(message_of([&] {
            trainer.send_routes_async({3, 0, 0, 0}, packed.data(), bytes, *stream);
          }) == "injected: the send failed");
    REQUIRE(trainer_comm.calls.size() >= 3);
    CHECK(trainer_comm.calls.front().kind == Call::kGroupStart);
    CHECK(trainer_comm.calls[1].kind == Call::kSend);
    CHECK(trainer_comm.calls.back().kind == Call::kGroupEnd);
    CHECK(trainer_comm.calls.size() == 3);
  }
  SECTION("buckets in sequence within an update; sequence 0 starts the next") {
    trainer.send_routes_async({3, 0, 0, 0}, packed.data(), bytes, *stream);
    CHECK_THAT(message_of([&] {
                 trainer.send_routes_async({4, 1, 0, 1}, packed.data(), bytes, *stream);
               }),
               Catch::Matchers::Contains("for bucket 1 of update 4, but bucket 1 of update 3 is "
                                         "next"));
    trainer.send_routes_async({4, 0, 0, 0}, packed.data(), bytes, *stream);
    CHECK(trainer_comm.calls.front().kind == Call::kGroupStart);
    CHECK(trainer_comm.calls.back().kind == Call::kGroupEnd);
  }
  backend.stream_synchronize(*stream);
}

TEST_CASE("NcclTransport::create_routed refuses GPUs not named per rank, two ranks on one GPU, a "
          "rank outside the communicator and a host backend before NCCL") {
  const Layout wire = wire_layout();
  const auto routing = std::make_shared<const RoutingPlan>(routing_plan(wire, 2, 1));
  HostBackend backend;
  const NcclUniqueId id{};
  CHECK(message_of([&] {
          NcclTransport::create_routed(id, 2, 0, routing, wire, backend,
                                       {{"h/GPU-0", "h/GPU-1", "h/GPU-0"}});
        }) ==
        "trainer rank 0 and engine rank 0 (communicator rank 2) are both on GPU 'h/GPU-0': "
        "NCCL cannot connect two ranks of one communicator on one GPU; use the same-host "
        "pull transport for a trainer and an engine sharing a GPU");
  CHECK_THAT(message_of([&] {
               NcclTransport::create_routed(id, 2, 0, routing, wire, backend,
                                            {{"h/GPU-0", "h/GPU-1", "h/GPU-2"}, 2});
             }),
             Catch::Matchers::Contains("3 GPUs given for a communicator of 4 ranks (2 trainer and "
                                       "1 engine ranks in each of 2 replicas)"));
  CHECK_THAT(message_of([&] {
               NcclTransport::create_routed(id, 4, 0, routing, wire, backend,
                                            {{"h/GPU-0", "h/GPU-1", "h/GPU-2", "h/GPU-3"}, 2});
             }),
             Catch::Matchers::Contains("communicator rank 4 is outside 0..3"));
  CHECK(message_of([&] {
          NcclTransport::create_routed(id, 2, 0, routing, wire, backend,
                                       {{"h/GPU-0", "h/GPU-1", "h/GPU-2"}});
        }) ==
        "NcclTransport::create_routed: backend 'host' given; NCCL moves device memory: give the "
        "CUDA backend of device 0");
}

#else

TEST_CASE("NCCL routes are built only with CUDA") {
  SUCCEED("this build has no NcclTransport; the CUDA build runs these tests without a GPU");
}

#endif
