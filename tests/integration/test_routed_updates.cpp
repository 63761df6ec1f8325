// Updates from a sharded trainer (DESIGN §14) over loopback routes: M trainer ranks (Senders made
// with the routing plan, each publishing only its shards) and N engine ranks (Receivers with
// use_routing_plan; two engine ranks split every tensor as tensor parallelism does, through
// their receive plans). Each engine rank's slots come out as the full tensors put through its
// plan, the routes carry exactly the plan's bytes into it, a trainer rank that dies fails the
// update on every engine rank with nothing going live, a slow engine rank holds the trainers
// back, and every refusal is named. Read in place (the communicator's read_in_place), the same
// updates land with nothing packed, every byte counted as read where the shards lie, though each
// update's shards are new memory (a new shard table every update).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/routing_plan.h"
#include "deadline.h"
#include "error_message.h"
#include "shadowsync/error.h"
#include "shadowsync/host_backend.h"
#include "shadowsync/loopback_transport.h"
#include "shadowsync/receiver.h"
#include "shadowsync/sender.h"
#include "transports/loopback/loopback_routes.h"

using namespace shadowsync;
using shadowsync::testing::message_of;
using shadowsync::testing::wait_until;

namespace {

// Buckets of 256 bytes: q's 48-byte rows straddle them. q and k are sharded by rows (FSDP2
// Shard(0), uneven), c by columns (Shard(1): part of every row), z as flat partitions cut mid-row
// (ZeRO-3); the norm is replicated and sent by the last trainer rank.
struct TensorShape {
  const char* name;
  std::int64_t rows;
  std::int64_t cols;  // 0: one-dimensional
};
constexpr TensorShape kTensors[] = {
    {"q", 13, 12}, {"k", 3, 8}, {"c", 8, 8}, {"z", 6, 8}, {"norm", 8, 0}};

Layout wire_layout() {
  std::vector<TensorSpec> specs;
  for (const TensorShape& t : kTensors) {
    specs.push_back({t.name, DType::kFloat32,
                     t.cols == 0 ? std::vector<std::int64_t>{t.rows}
                                 : std::vector<std::int64_t>{t.rows, t.cols},
                     "base"});
  }
  return Layout::build(specs, {.bucket_bytes = 256});
}

std::int64_t elements_of(const TensorShape& t) { return t.rows * (t.cols == 0 ? 1 : t.cols); }

// Trainer rank `rank` of `ranks`: the region of each tensor it holds (a tensor it holds nothing
// of is left out).
std::vector<std::pair<std::string, TensorRegion>> trainer_regions(int rank, int ranks) {
  std::vector<std::pair<std::string, TensorRegion>> out;
  const auto chunk = [&](std::int64_t n) {  // torch.chunk: ceil(n / ranks) each, the last short
    const std::int64_t per = (n + ranks - 1) / ranks;
    return std::pair{std::min(n, rank * per), std::min(n, (rank + 1) * per)};
  };
  for (const char* name : {"q", "k"}) {
    const TensorShape& t = name[0] == 'q' ? kTensors[0] : kTensors[1];
    const auto [lo, hi] = chunk(t.rows);
    if (lo < hi) out.emplace_back(name, TensorRegion::box({lo, 0}, {hi, t.cols}));
  }
  const auto [c_lo, c_hi] = chunk(8);
  if (c_lo < c_hi) out.emplace_back("c", TensorRegion::box({0, c_lo}, {8, c_hi}));
  const auto cut = [&](int i) -> std::int64_t { return i == 0 ? 0 : i == ranks ? 48 : 48 * i / ranks + 3; };
  out.emplace_back("z", TensorRegion::elements(cut(rank), cut(rank + 1) - cut(rank)));
  if (rank == ranks - 1) out.emplace_back("norm", TensorRegion::box({0}, {8}));
  return out;
}

// The full tensors of update `version`: a value per (version, tensor, element).
std::vector<std::vector<float>> full_tensors(std::uint64_t version) {
  std::vector<std::vector<float>> out;
  for (std::size_t t = 0; t < std::size(kTensors); ++t) {
    auto& values = out.emplace_back(static_cast<std::size_t>(elements_of(kTensors[t])));
    for (std::size_t i = 0; i < values.size(); ++i) {
      values[i] = static_cast<float>(version * 10000 + t * 1000 + i);
    }
  }
  return out;
}

std::size_t tensor_index(const std::string& name) {
  for (std::size_t t = 0; t < std::size(kTensors); ++t) {
    if (name == kTensors[t].name) return t;
  }
  throw std::runtime_error("no tensor " + name);
}

// A region of a full tensor, contiguous in its row-major order (what to_local() holds).
std::vector<float> extract(const std::vector<float>& full, const TensorShape& t,
                           const TensorRegion& region) {
  if (region.kind == TensorRegion::Kind::kElements) {
    return {full.begin() + region.first, full.begin() + region.first + region.count};
  }
  if (t.cols == 0) return {full.begin() + region.begin[0], full.begin() + region.end[0]};
  std::vector<float> out;
  for (std::int64_t r = region.begin[0]; r < region.end[0]; ++r) {
    for (std::int64_t c = region.begin[1]; c < region.end[1]; ++c) out.push_back(full[r * t.cols + c]);
  }
  return out;
}

// Engine rank `rank` of 2: q and k column-parallel (rows split, uneven), c row-parallel (columns
// split), z rows split, the norm whole.
Layout engine_layout(int rank) {
  return Layout::build({{"q", DType::kFloat32, {rank == 0 ? 7 : 6, 12}, "base"},
                        {"k", DType::kFloat32, {rank == 0 ? 2 : 1, 8}, "base"},
                        {"c", DType::kFloat32, {8, 4}, "base"},
                        {"z", DType::kFloat32, {3, 8}, "base"},
                        {"norm", DType::kFloat32, {8}, "base"}});
}

ReceivePlan engine_plan(const Layout& wire, int rank) {
  const std::int64_t q_rows = rank == 0 ? 7 : 6;
  const std::int64_t k_rows = rank == 0 ? 2 : 1;
  return ReceivePlan::build(wire, engine_layout(rank),
                            {{"q", "q", {q_rows, 12}, rank * 7 * 12, {12, 1}, 0, {12, 1}},
                             {"k", "k", {k_rows, 8}, rank * 2 * 8, {8, 1}, 0, {8, 1}},
                             {"c", "c", {8, 4}, rank * 4, {8, 1}, 0, {4, 1}},
                             {"z", "z", {3, 8}, rank * 24, {8, 1}, 0, {8, 1}},
                             {"norm", "norm", {8}, 0, {1}, 0, {1}}});
}

std::vector<unsigned char> wire_image(const Layout& wire, const std::vector<std::vector<float>>& full) {
  const GroupLayout& group = wire.groups()[0];
  std::vector<unsigned char> image(group.arena_bytes(), 0);
  for (std::size_t t = 0; t < full.size(); ++t) {
    std::memcpy(image.data() + group.tensors()[t].offset, full[t].data(), full[t].size() * 4);
  }
  return image;
}

// What engine rank `rank`'s slot must hold: the wire image, or without a plan, put through its
// plan's pieces bucket by bucket.
std::vector<unsigned char> reference(const Layout& wire, const ReceivePlan* plan, int rank,
                                     const std::vector<unsigned char>& image) {
  if (plan == nullptr) return image;
  std::vector<unsigned char> out(engine_layout(rank).groups()[0].arena_bytes(), 0);
  const GroupLayout& group = wire.groups()[0];
  for (std::size_t k = 0; k < group.bucket_count(); ++k) {
    const unsigned char* landed = image.data() + group.bucket(k).offset;
    for (const PlanPiece& p : plan->pieces(0, k)) {
      for (std::size_t r = 0; r < p.rows; ++r) {
        std::memcpy(out.data() + p.dst_offset + r * p.dst_pitch,
                    landed + p.src_offset + r * p.src_pitch, p.row_bytes);
      }
    }
  }
  return out;
}

std::vector<ByteRange> every_tensor(const Layout& wire) {
  std::vector<ByteRange> out;
  for (const TensorPlacement& t : wire.groups()[0].tensors()) {
    out.push_back({t.offset, t.offset + t.bytes});
  }
  return out;
}

// M trainer-rank Senders and N engine-rank Receivers (coordinated commit) of one routing plan,
// over one LoopbackRouteCommunicator.
struct RoutedRig {
  RoutedRig(int trainers, int engines, ReceiverConfig config = {}, bool in_place = false)
      : wire(wire_layout()) {
    std::vector<RankRanges> held;
    for (int t = 0; t < trainers; ++t) {
      RankRanges ranges{t, {{}}};
      for (const auto& [name, region] : trainer_regions(t, trainers)) {
        if (region.kind == TensorRegion::Kind::kElements) {
          ranges.ranges[0].push_back(regions_of_elements(wire, name, region.first, region.count));
        } else {
          for (const ByteRange& b : regions_of_box(wire, name, region.begin, region.end)) {
            ranges.ranges[0].push_back(b);
          }
        }
      }
      held.push_back(std::move(ranges));
    }
    std::vector<RankRanges> needs;
    for (int e = 0; e < engines; ++e) {
      if (engines > 1) plans.push_back(std::make_unique<ReceivePlan>(engine_plan(wire, e)));
      needs.push_back({e, engines > 1 ? needed_by(*plans.back())
                                      : std::vector<std::vector<ByteRange>>{every_tensor(wire)}});
    }
    plan = std::make_shared<const RoutingPlan>(RoutingPlan::build(wire, held, needs));
    communicator = std::make_unique<LoopbackRouteCommunicator>(plan);
    communicator->read_in_place(in_place);
    for (int t = 0; t < trainers; ++t) {
      senders.push_back(std::make_unique<Sender>(wire, backend, communicator->trainer_transport(t),
                                                 plan, t));
    }
    config.commit_mode = CommitMode::kCoordinated;
    for (int e = 0; e < engines; ++e) {
      auto transport = communicator->engine_transport(e);
      receivers.push_back(
          engines > 1
              ? std::make_unique<Receiver>(engine_layout(e), *plans[e], backend,
                                           std::move(transport), config)
              : std::make_unique<Receiver>(wire, backend, std::move(transport), config));
      receivers.back()->use_routing_plan(plan, e);
    }
  }

  ~RoutedRig() {
    for (auto& receiver : receivers) receiver->shutdown();
  }

  // Every trainer rank publishes its shards of `version`; every engine rank begins the update.
  std::vector<PublishHandle> publish(std::uint64_t version) {
    tensors = full_tensors(version);
    shards.assign(senders.size(), {});
    std::vector<PublishHandle> handles;
    for (std::size_t t = 0; t < senders.size(); ++t) {
      std::vector<SourceShard> given;
      for (const auto& [name, region] : trainer_regions(static_cast<int>(t),
                                                        static_cast<int>(senders.size()))) {
        const std::size_t i = tensor_index(name);
        shards[t].push_back(extract(tensors[i], kTensors[i], region));
        given.push_back({name, shards[t].back().data(), DType::kFloat32, region});
      }
      handles.push_back(senders[t]->publish_shards(version, {"base"}, given));
    }
    for (auto& receiver : receivers) receiver->begin_update(handles[0].header());
    return handles;
  }

  // Waits for every publish and every engine rank to hold `version` ready, commits it on each.
  void apply(std::uint64_t version, std::vector<PublishHandle>& handles) {
    for (auto& handle : handles) REQUIRE(handle.wait_for(shadowsync::testing::kTestDeadline));
    for (auto& receiver : receivers) {
      wait_until([&] { return receiver->stats().ready_version == version; },
                 "update " + std::to_string(version) + " ready");
      receiver->commit(version, *engine_stream);
    }
    backend.stream_synchronize(*engine_stream);
  }

  // Every engine rank's live slot is the reference of `version`.
  void check_live(std::uint64_t version) {
    const auto image = wire_image(wire, full_tensors(version));
    for (std::size_t e = 0; e < receivers.size(); ++e) {
      CAPTURE(e, version);
      const auto want =
          reference(wire, plans.empty() ? nullptr : plans[e].get(), static_cast<int>(e), image);
      const std::byte* live = receivers[e]->step_hook().live_arena(0);
      CHECK(receivers[e]->step_hook().applied_version() == version);
      CHECK(std::memcmp(live, want.data(), want.size()) == 0);
    }
  }

  // A new communicator for every rank (after a failure aborted the old one).
  void reconnect() {
    communicator = std::make_unique<LoopbackRouteCommunicator>(plan);
    for (std::size_t t = 0; t < senders.size(); ++t) {
      senders[t]->replace_transport(communicator->trainer_transport(static_cast<int>(t)));
    }
    for (std::size_t e = 0; e < receivers.size(); ++e) {
      receivers[e]->replace_transport(communicator->engine_transport(static_cast<int>(e)));
    }
  }

  std::uint64_t buckets() const { return wire.groups()[0].bucket_count(); }

  const Layout wire;
  HostBackend backend;
  std::unique_ptr<Stream> engine_stream = backend.create_stream(StreamPriority::kNormal);
  std::vector<std::unique_ptr<ReceivePlan>> plans;  // N = 2 only
  std::shared_ptr<const RoutingPlan> plan;
  std::unique_ptr<LoopbackRouteCommunicator> communicator;
  std::vector<std::unique_ptr<Sender>> senders;
  std::vector<std::unique_ptr<Receiver>> receivers;
  std::vector<std::vector<float>> tensors;            // the full tensors of the last publish
  std::vector<std::vector<std::vector<float>>> shards;  // [trainer][shard]: outlive the publish
};

}  // namespace

TEST_CASE("M trainer ranks each send only their shards; every engine rank gets its parameters") {
  for (const int trainers : {1, 2, 4}) {
    for (const int engines : {1, 2}) {
      CAPTURE(trainers, engines);
      RoutedRig rig(trainers, engines);
      for (std::uint64_t v = 1; v <= 3; ++v) {
        auto handles = rig.publish(v);
        rig.apply(v, handles);
        rig.check_live(v);
        for (int e = 0; e < engines; ++e) {
          const ReceiverStats stats = rig.receivers[e]->stats();
          CHECK(stats.routed_bytes == rig.plan->bytes_to(e));
          CHECK(stats.routed_in_place_bytes == 0);  // packed: the communicator reads none in place
          CHECK(stats.trainer_count == trainers);
          CHECK(stats.routing_fingerprint == rig.plan->fingerprint());
        }
      }
      const auto packed = rig.senders[0]->routes_in_place();
      REQUIRE(packed.has_value());
      CHECK_FALSE(packed->in_place);
      CHECK_THAT(packed->why_not, Catch::Contains("reads no routes in place"));
      // The only memory a trainer rank adds: two slots of its largest bucket slice.
      for (int t = 0; t < trainers; ++t) {
        CHECK(rig.senders[t]->staging_bytes() == 2 * rig.plan->max_packed_bytes(t));
      }
      for (int t = 0; t < trainers; ++t) CHECK(rig.plan->max_packed_bytes(t) <= rig.wire.bucket_bytes());
    }
  }
}

TEST_CASE("routes read in place land every engine rank's parameters, nothing packed") {
  for (const int trainers : {1, 2, 4}) {
    for (const int engines : {1, 2}) {
      CAPTURE(trainers, engines);
      RoutedRig rig(trainers, engines, {}, /*in_place=*/true);
      CHECK_FALSE(rig.senders[0]->routes_in_place().has_value());  // before the first update
      for (std::uint64_t v = 1; v <= 3; ++v) {
        CAPTURE(v);
        auto handles = rig.publish(v);  // each update's shards are new memory: a new table
        rig.apply(v, handles);
        rig.check_live(v);
        for (int e = 0; e < engines; ++e) {
          const ReceiverStats stats = rig.receivers[e]->stats();
          CHECK(stats.routed_bytes == rig.plan->bytes_to(e));
          CHECK(stats.routed_in_place_bytes == rig.plan->bytes_to(e));
        }
        for (const auto& sender : rig.senders) {
          const auto status = sender->routes_in_place();
          REQUIRE(status.has_value());
          CHECK(status->in_place);
          CHECK(status->why_not.empty());
        }
      }
    }
  }
}

TEST_CASE("a trainer rank that dies fails the update on every engine rank; nothing goes live") {
  RoutedRig rig(2, 2);
  auto first = rig.publish(1);
  rig.apply(1, first);
  // Trainer rank 1 dies after the first bucket of update 2.
  rig.communicator->inject_drop(1, rig.buckets() + 1);
  auto second = rig.publish(2);
  for (auto& handle : second) {
    CHECK_THROWS_AS(handle.wait_for(shadowsync::testing::kTestDeadline), Error);
  }
  CHECK_THAT(message_of([&] { second[1].wait(); }),
             Catch::Contains("trainer rank 1 dropped at route call"));
  for (auto& receiver : rig.receivers) {
    wait_until([&] { return receiver->stats().updates_failed == 1; }, "update 2 failed");
    const ReceiverStats stats = receiver->stats();
    CHECK(stats.ready_version == 0);
    CHECK(stats.last_failure.version == 2);
    CHECK_THAT(stats.last_error, Catch::Contains("aborted by trainer rank 1"));
    CHECK(stats.needs_transport);
  }
  rig.check_live(1);  // the live weights are update 1's, on every engine rank

  rig.reconnect();
  auto third = rig.publish(3);
  rig.apply(3, third);
  rig.check_live(3);
}

TEST_CASE("a slow engine rank holds every trainer rank back: no slot is repacked under it") {
  // Mutation 41: a trainer rank's send that completes once engine rank 0 acknowledged lets its
  // staging slot be repacked two buckets later while engine rank 1 still reads it.
  RoutedRig rig(2, 2);
  for (std::uint64_t call = 0; call < 3; ++call) {
    rig.communicator->inject_delay(1, call, std::chrono::milliseconds(20));
  }
  auto handles = rig.publish(1);
  rig.apply(1, handles);
  rig.check_live(1);
}

TEST_CASE("routed senders refuse what does not fit their routing plan, named") {
  RoutedRig rig(2, 1);
  Sender& sender = *rig.senders[0];
  const std::vector<SourceTensor> none;
  CHECK_THAT(message_of([&] { sender.publish(1, {"base"}, none); }),
             Catch::Contains("Sender::publish (update 1): this sender is trainer rank 0 of a "
                             "routing plan, which publishes only its shards; call publish_shards"));
  CHECK_THAT(message_of([&] { sender.publish_streamed(1, {"base"}); }),
             Catch::Contains("Sender::publish_streamed (update 1)"));
  CHECK_THAT(message_of([&] { sender.publish_arenas(1, {"base"}, {nullptr}); }),
             Catch::Contains("Sender::publish_arenas (update 1)"));

  HostBackend& backend = rig.backend;
  Sender unrouted(rig.wire, backend, nullptr);
  CHECK_THAT(message_of([&] { unrouted.publish_shards(1, {"base"}, {}); }),
             Catch::Contains("this sender has no routing plan"));

  // The transport must move routes of the plan for this rank.
  LoopbackCommunicator plain(2);
  CHECK_THAT(message_of([&] { Sender s(rig.wire, backend, plain.transport(0), rig.plan, 0); }),
             Catch::Contains("transport 'loopback' moves no routes (route_mover() is null), but "
                             "this sender is trainer rank 0"));
  LoopbackRouteCommunicator other(rig.plan);
  CHECK_THAT(message_of([&] { Sender s(rig.wire, backend, other.trainer_transport(1), rig.plan, 0); }),
             Catch::Contains("the sender is trainer rank 0, but its transport 'loopback' is "
                             "trainer rank 1"));
  CHECK_THAT(message_of([&] { Sender s(rig.wire, backend, nullptr, rig.plan, 2); }),
             Catch::Contains("trainer rank 2 is outside 0..1 (the routing plan has 2 trainer "
                             "ranks)"));
  CHECK_THAT(message_of([&] { Sender s(rig.wire, backend, nullptr, rig.plan, 0, SenderConfig{}); }),
             Catch::Contains("SenderConfig::checksums is set, but trainer rank 0 of a routing "
                             "plan sends routes, which carry no checksums yet"));

  // Shards against the plan, before a byte moves.
  std::vector<float> data(13 * 12, 0.0f);
  const auto shards_of = [&](int rank) {
    std::vector<SourceShard> out;
    for (const auto& [name, region] : trainer_regions(rank, 2)) {
      out.push_back({name, data.data(), DType::kFloat32, region});
    }
    return out;
  };
  auto wrong_rows = shards_of(0);
  wrong_rows[0].region = TensorRegion::box({0, 0}, {6, 12});  // q: the plan says rows 0..7
  CHECK_THAT(message_of([&] { sender.publish_shards(1, {"base"}, wrong_rows); }),
             Catch::Contains("update 1: trainer rank 0: the shard of tensor 'q' is box [0, 0]..[6, "
                             "12] (bytes 0..288 of the tensor), but the routing plan has this rank "
                             "hold bytes 0..336"));
  auto missing = shards_of(0);
  missing.erase(missing.begin() + 2);  // c
  CHECK_THAT(message_of([&] { sender.publish_shards(1, {"base"}, missing); }),
             Catch::Contains("update 1: trainer rank 0 holds bytes 0..16, 32..48, 64..80, 96..112 "
                             "and 4 more ranges of tensor 'c' (group 'base') in the routing plan, "
                             "but no shard of it was given"));
  auto wrong_dtype = shards_of(0);
  wrong_dtype[1].dtype = DType::kBFloat16;
  CHECK_THAT(message_of([&] { sender.publish_shards(1, {"base"}, wrong_dtype); }),
             Catch::Contains("trainer rank 0: the shard of tensor 'k' has dtype bf16, the "
                             "layout fp32"));
  // Nothing was published: the next update still goes through.
  auto handles = rig.publish(1);
  rig.apply(1, handles);
  rig.check_live(1);
}

TEST_CASE("routed receivers refuse what does not fit their routing plan, named") {
  RoutedRig rig(2, 2);
  Receiver& receiver = *rig.receivers[0];
  CHECK_THAT(message_of([&] { receiver.use_routing_plan(rig.plan, 2); }),
             Catch::Contains("use_routing_plan: engine rank 2 is outside 0..1 (the routing plan "
                             "has 2 engine ranks)"));
  const Layout other_wire = Layout::build({{"q", DType::kFloat32, {13, 12}, "base"}},
                                          {.bucket_bytes = 256});
  const auto other_plan = std::make_shared<const RoutingPlan>(RoutingPlan::build(
      other_wire, {{0, {{{0, 13 * 12 * 4}}}}}, {{0, {{{0, 13 * 12 * 4}}}}}));
  CHECK_THAT(message_of([&] { receiver.use_routing_plan(other_plan, 0); }),
             Catch::Contains("use_routing_plan: the routing plan was built on wire layout"));

  ReceiverConfig checked;
  checked.require_checksums = true;
  Receiver strict(rig.wire, rig.backend, nullptr, checked);
  CHECK_THAT(message_of([&] { strict.use_routing_plan(rig.plan, 0); }),
             Catch::Contains("use_routing_plan: ReceiverConfig::require_checksums is set, but "
                             "routed updates carry no checksums yet"));

  // Routed and unrouted ends refuse each other's headers.
  Receiver unrouted(rig.wire, rig.backend, nullptr);
  UpdateHeader routed_header = make_update_header(rig.wire, 1, {"base"});
  routed_header.layout_fingerprint = rig.plan->fingerprint();
  const auto refused = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kLayoutMismatch);
      return std::string(e.what());
    }
    return std::string("<no error>");
  };
  CHECK_THAT(refused([&] { unrouted.begin_update(routed_header); }),
             Catch::Contains("the sender is a trainer rank of a routing plan and this receiver "
                             "has none"));
  const UpdateHeader plain_header = make_update_header(rig.wire, 1, {"base"});
  Receiver routed(rig.wire, rig.backend, nullptr);
  routed.use_routing_plan(std::make_shared<const RoutingPlan>(RoutingPlan::build(
                              rig.wire, {{0, {every_tensor(rig.wire)}}},
                              {{0, {every_tensor(rig.wire)}}})),
                          0);
  CHECK_THAT(refused([&] { routed.begin_update(plain_header); }),
             Catch::Contains("differs from this receiver's routing plan") &&
                 Catch::Contains("the sender has no routing plan"));

  // Once an update began, the plan stays.
  auto handles = rig.publish(1);
  rig.apply(1, handles);
  CHECK_THAT(message_of([&] { receiver.use_routing_plan(rig.plan, 0); }),
             Catch::Contains("use_routing_plan: update 1 was already accepted"));
}

TEST_CASE("a routed update fails, named, on a transport that does not move the plan's routes") {
  RoutedRig rig(2, 1);
  UpdateHeader header = make_update_header(rig.wire, 1, {"base"});
  header.layout_fingerprint = rig.plan->fingerprint();

  // No route mover at all.
  LoopbackCommunicator plain(2);
  Receiver receiver(rig.wire, rig.backend, plain.transport(1));
  receiver.use_routing_plan(rig.plan, 0);
  receiver.begin_update(header);
  wait_until([&] { return receiver.stats().updates_failed == 1; }, "update 1 failed");
  CHECK_THAT(receiver.stats().last_error,
             Catch::Contains("update 1: transport 'loopback' moves no routes (route_mover() is "
                             "null), but this receiver is engine rank 0 of a routing plan"));

  // A transport of a plan with 4 trainer ranks.
  RoutedRig four(4, 1);
  LoopbackRouteCommunicator four_ranks(four.plan);
  Receiver other(rig.wire, rig.backend, four_ranks.engine_transport(0));
  other.use_routing_plan(rig.plan, 0);
  other.begin_update(header);
  wait_until([&] { return other.stats().updates_failed == 1; }, "update 1 failed");
  CHECK_THAT(other.stats().last_error,
             Catch::Contains("update 1: the routing plan has 2 trainer ranks, transport "
                             "'loopback' 4"));
}

TEST_CASE("trainer ranks publishing different versions fail the update, named") {
  RoutedRig rig(2, 1);
  rig.tensors = full_tensors(1);
  std::vector<PublishHandle> handles;
  std::vector<std::vector<float>> data;
  for (int t = 0; t < 2; ++t) {
    std::vector<SourceShard> given;
    for (const auto& [name, region] : trainer_regions(t, 2)) {
      const std::size_t i = tensor_index(name);
      data.push_back(extract(rig.tensors[i], kTensors[i], region));
    }
    std::size_t at = data.size() - trainer_regions(t, 2).size();
    for (const auto& [name, region] : trainer_regions(t, 2)) {
      given.push_back({name, data[at++].data(), DType::kFloat32, region});
    }
    handles.push_back(rig.senders[t]->publish_shards(t == 0 ? 5 : 6, {"base"}, given));
  }
  rig.receivers[0]->begin_update(handles[0].header());
  wait_until([&] { return rig.receivers[0]->stats().updates_failed == 1; }, "update 5 failed");
  CHECK_THAT(rig.receivers[0]->stats().last_error,
             Catch::Contains("trainer rank 1 posted bucket 0 (group 0, sequence 0) of update 6, "
                             "but engine rank 0 receives bucket 0 (group 0, sequence 0) of update "
                             "5"));
  for (auto& handle : handles) {
    CHECK_THROWS_AS(handle.wait_for(shadowsync::testing::kTestDeadline), Error);
  }
}
