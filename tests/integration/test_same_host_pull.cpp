// SameHostPullTransport across processes: two trainer ranks are child processes (this binary,
// running the hidden test case "[.pull_trainer]"), two engine ranks live in the test process, and
// both sides call the RouteMover directly (no Sender or Receiver): each trainer rank packs what it
// holds of update v's wire image (a pattern of v) per bucket, each engine rank runs its route
// copies into a slot arena, which must then hold update v's bytes wherever the rank needs them.
// A trainer rank SIGKILLed after its 2nd doorbell fails both engines' bucket by name with nothing
// of it copied; new children on the same paths and new engine transports apply the next update.
// Engine replicas: every replica's process of an engine rank pulls the same bytes from the same
// staging. Then the handshake's refusals by their text, and 20 connect/abort cycles that leave
// nothing behind.
#include <catch2/catch.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <future>

#include <fmt/format.h>

#include "child_process.h"
#include "core/route_copies.h"
#include "core/routing_plan.h"
#include "deadline.h"
#include "error_message.h"
#include "process_resources.h"
#include "pull_fixture.h"
#include "shadowsync/error.h"
#include "shadowsync/host_backend.h"
#include "socket_dir.h"
#include "transports/same_host/same_host_pull_transport.h"

using namespace shadowsync;
using namespace shadowsync::testing;

namespace {

const std::string kToken = "ssk1-4e217b3e708068e355dd91215ccb2ea999ee8d7530f4fd84340f63a34056aa56";

SameHostConfig config(std::chrono::milliseconds connect_timeout = std::chrono::seconds(20)) {
  SameHostConfig c;
  c.connect_timeout = connect_timeout;
  return c;
}



}  // namespace

// A trainer rank of the 2 x 2 plan. Environment: SS_PULL_PATH, SS_PULL_RANK, SS_PULL_FIRST (first
// version), SS_PULL_COUNT (updates), SS_PULL_STOP_AT (a version: once its 2nd bucket was acked,
// print "rang\n" and wait to be killed; 0: none).
TEST_CASE("same-host pull trainer child", "[.pull_trainer]") {
  const auto plan = make_plan(2, 2);
  const int rank = static_cast<int>(env_u64("SS_PULL_RANK"));
  HostBackend backend;
  auto transport = SameHostPullTransport::serve(std::getenv("SS_PULL_PATH"), kToken, plan, rank, 2,
                                                backend, SameHostMemory::kHost, config());
  auto stream = backend.create_stream(StreamPriority::kNormal);
  std::unique_ptr<Event> slot_free[2] = {backend.create_event(), backend.create_event()};
  const std::uint64_t first = env_u64("SS_PULL_FIRST");
  const std::uint64_t stop_at = env_u64("SS_PULL_STOP_AT");
  const std::size_t buckets = plan->bucket_count(0);
  std::uint64_t sends = 0;  // the b-th send goes in slot b % 2, over every update
  for (std::uint64_t v = first; v < first + env_u64("SS_PULL_COUNT"); ++v) {
    const std::vector<std::byte> packed = packing(*plan, rank, v);
    for (std::size_t k = 0; k < buckets; ++k) {
      const int slot = static_cast<int>(sends++ % 2);
      // Packed again only once every engine read what the slot held (its send completed).
      REQUIRE(backend.event_wait_for(*slot_free[slot], std::chrono::seconds(20)));
      const ByteRange range = plan->packed_range(rank, 0, k);
      void* staging = transport->staging_buffer(slot, range.end - range.begin);
      REQUIRE(staging != nullptr);
      std::memcpy(staging, packed.data() + range.begin, range.end - range.begin);
      transport->send_routes_async({v, k, 0, k}, staging, range.end - range.begin, *stream);
      backend.event_record(*slot_free[slot], *stream);
      if (v == stop_at && k == 1) {
        backend.stream_synchronize(*stream);
        std::fputs("rang\n", stdout);
        std::fflush(stdout);
        for (;;) ::pause();
      }
    }
    backend.stream_synchronize(*stream);
    INFO(transport->async_error().value_or(""));
    REQUIRE_FALSE(transport->async_error().has_value());
  }
}

namespace {

std::unique_ptr<ChildProcess> spawn_trainer(const std::string& path, int rank, std::uint64_t first,
                                            std::uint64_t count, std::uint64_t stop_at = 0) {
  return spawn_pull_trainer("[.pull_trainer]", path, rank, first, count, stop_at);
}

// An engine rank in the test process: its transport, a slot arena (0xEE where nothing landed),
// and an event recorded after each bucket's receive.
struct EngineRank {
  const int rank;
  std::shared_ptr<const RoutingPlan> plan;
  int replica = 0;  // of the engine's data-parallel replicas
  HostBackend backend;
  std::unique_ptr<Stream> stream = backend.create_stream(StreamPriority::kNormal);
  std::unique_ptr<SameHostPullTransport> transport;
  std::vector<std::vector<RouteCopy>> copies;  // [bucket]
  std::vector<std::byte> arena;
  std::vector<std::unique_ptr<Event>> landed;  // [bucket]

  EngineRank(int r, std::shared_ptr<const RoutingPlan> p) : rank(r), plan(std::move(p)) {
    const Layout wire = wire_layout();
    copies = compose_route_copies(*plan, rank, wire, nullptr)[0];
    arena.assign(wire.groups()[0].arena_bytes(), std::byte{0xEE});
    for (std::size_t k = 0; k < copies.size(); ++k) landed.push_back(backend.create_event());
  }
  ~EngineRank() {
    if (transport) transport->abort();
    backend.stream_synchronize(*stream);
  }

  void receive(std::uint64_t v, std::size_t first_bucket = 0) {
    for (std::size_t k = first_bucket; k < copies.size(); ++k) {
      transport->route_mover()->receive_routes_async({v, k, 0, k}, copies[k],
                                                     {arena.data(), nullptr}, *stream);
      backend.event_record(*landed[k], *stream);
    }
  }
  bool wait_landed(std::size_t k, std::chrono::milliseconds timeout = kTestDeadline) {
    return backend.event_wait_for(*landed[k], timeout);
  }
  // The bytes of [begin, end) this rank needs that do not hold update v's image.
  std::size_t wrong_bytes(std::uint64_t v, std::size_t begin, std::size_t end) const {
    std::size_t wrong = 0;
    for (const Route& r : all_routes()) {
      for (std::size_t i = std::max(begin, r.wire_offset);
           i < std::min(end, r.wire_offset + r.bytes); ++i) {
        if (arena[i] != image_byte(v, i)) ++wrong;
      }
    }
    return wrong;
  }
  std::vector<Route> all_routes() const {
    std::vector<Route> out;
    for (std::size_t k = 0; k < copies.size(); ++k) {
      for (const Route& r : plan->routes(0, k)) {
        if (r.engine == rank) out.push_back(r);
      }
    }
    return out;
  }
};

// Both engine ranks connect, side by side (each trainer admits both).
void connect_engines(std::vector<std::unique_ptr<EngineRank>>& engines,
                     const std::vector<std::string>& paths) {
  std::vector<std::future<std::unique_ptr<SameHostPullTransport>>> connecting;
  for (auto& e : engines) {
    connecting.push_back(std::async(std::launch::async, [&paths, &e] {
      return SameHostPullTransport::connect_engine_rank(paths, kToken, e->plan, e->rank, e->backend,
                                                        config(), e->replica);
    }));
  }
  for (std::size_t i = 0; i < engines.size(); ++i) engines[i]->transport = connecting[i].get();
}

std::size_t wire_bytes() { return wire_layout().groups()[0].arena_bytes(); }

}  // namespace

TEST_CASE(
    "same-host pull: 2 trainer processes x 2 engine ranks; a trainer rank killed "
    "mid-update fails both engines' bucket, named, and new trainers' next update lands") {
  SocketDir dir{"shadowsync_pull"};
  const auto paths = socket_paths(dir, 2);
  const auto plan = make_plan(2, 2);
  REQUIRE(plan->bucket_count(0) >= 4);
  std::vector<std::unique_ptr<ChildProcess>> trainers;
  trainers.push_back(spawn_trainer(paths[0], 0, 1, 5));
  trainers.push_back(spawn_trainer(paths[1], 1, 1, 5, /*stop_at=*/5));
  std::vector<std::unique_ptr<EngineRank>> engines;
  for (int e = 0; e < 2; ++e) engines.push_back(std::make_unique<EngineRank>(e, plan));
  connect_engines(engines, paths);
  CHECK(engines[0]->transport->name() == "same_host_pull");
  CHECK(engines[1]->transport->rank() == 3);
  CHECK(engines[1]->transport->world_size() == 4);

  const std::size_t last = plan->bucket_count(0) - 1;
  for (std::uint64_t v = 1; v <= 4; ++v) {
    CAPTURE(v);
    engines[0]->receive(v);
    if (v == 1) {
      // Engine rank 1 comes late. Bucket 2 reuses bucket 0's slots, so no trainer may ring it
      // before engine rank 1 read bucket 0: engine rank 0 cannot land it meanwhile.
      CHECK_FALSE(engines[0]->wait_landed(2, std::chrono::milliseconds(300)));
      // What a deadline's message would name meanwhile: each trainer rank's stream waits for
      // engine rank 1's ack of bucket 0 before it rings bucket 1, so engine rank 0 waits for
      // both trainer ranks' doorbell of bucket 1.
      wait_until(
          [&] {
            return engines[0]->transport->waiting_for().value_or("").starts_with(
                "the doorbell of bucket 1 of update 1 (group 0, bucket 1) from trainer ranks 0, 1, "
                "for ");
          },
          "engine rank 0 to say it waits for both trainer ranks' doorbell of bucket 1");
    }
    engines[1]->receive(v);
    for (auto& e : engines) {
      REQUIRE(e->wait_landed(last));
      INFO(e->transport->async_error().value_or(""));
      REQUIRE_FALSE(e->transport->async_error().has_value());
      CHECK(e->wrong_bytes(v, 0, wire_bytes()) == 0);
      CHECK(e->transport->routed_bytes() == v * plan->bytes_to(e->rank));
    }
  }

  // Update 5: trainer rank 1 dies once its 2nd bucket was acked.
  for (auto& e : engines) e->receive(5);
  wait_for_output(*trainers[1], "rang\n");
  // Trainer rank 1 stopped before ringing bucket 2; trainer rank 0 rang it (its slot was free):
  // each engine rank names the late trainer rank, and the one that was not.
  for (auto& e : engines) {
    CAPTURE(e->rank);
    std::string said;
    wait_until(
        [&] {
          said = e->transport->waiting_for().value_or("");
          return said.ends_with("ms (trainer rank 0 sent its)");
        },
        "the engine rank to say trainer rank 0 rang bucket 2 of update 5");
    CHECK_THAT(said, Catch::StartsWith("the doorbell of bucket 2 of update 5 (group 0, bucket 2) "
                                       "from trainer rank 1, for "));
  }
  ::kill(trainers[1]->pid, SIGKILL);
  trainers[1]->reap();
  const std::size_t bucket2 = wire_layout().groups()[0].bucket(2).offset;
  for (auto& e : engines) {
    CAPTURE(e->rank);
    REQUIRE(e->wait_landed(last));  // the tasks after the failure return at once
    const auto error = e->transport->async_error();
    REQUIRE(error.has_value());
    CHECK_THAT(*error, Catch::Contains("trainer rank 1 closed its socket (its process died?) "
                                       "before the doorbell of bucket 2 of update 5"));
    CHECK(e->wrong_bytes(5, 0, bucket2) == 0);  // buckets 0 and 1 landed
    // Nothing of bucket 2 on, from either trainer rank: update 4's bytes are still there.
    CHECK(e->wrong_bytes(4, bucket2, wire_bytes()) == 0);
  }
  // What a receiver does on failure: abort. Trainer rank 0, waiting for acks, sees EOF.
  for (auto& e : engines) e->transport->abort();
  ::kill(trainers[0]->pid, SIGKILL);
  trainers[0]->reap();

  // New trainer processes on the same paths, new engine transports: the next update lands.
  trainers.clear();
  trainers.push_back(spawn_trainer(paths[0], 0, 6, 1));
  trainers.push_back(spawn_trainer(paths[1], 1, 6, 1));
  connect_engines(engines, paths);
  for (auto& e : engines) e->receive(6);
  for (auto& e : engines) {
    REQUIRE(e->wait_landed(last));
    INFO(e->transport->async_error().value_or(""));
    REQUIRE_FALSE(e->transport->async_error().has_value());
    CHECK(e->wrong_bytes(6, 0, wire_bytes()) == 0);
  }
  for (auto& t : trainers) require_exited_zero(*t);
}

namespace {

// Serves trainer rank `rank` of `plan` at `path` on a thread; the error message, or "" once it
// admitted every engine.
std::future<std::string> serve_async(const std::string& path,
                                     std::shared_ptr<const RoutingPlan> plan, int rank,
                                     HostBackend& backend, std::chrono::milliseconds timeout,
                                     std::unique_ptr<SameHostPullTransport>* kept = nullptr,
                                     int replicas = 1) {
  return std::async(std::launch::async, [=, &backend] {
    try {
      auto served = SameHostPullTransport::serve(path, kToken, plan, rank,
                                                 replicas * plan->engine_count(), backend,
                                                 SameHostMemory::kHost, config(timeout));
      if (kept != nullptr) *kept = std::move(served);
      return std::string();
    } catch (const Error& e) {
      return std::string(e.what());
    }
  });
}

std::string connect_error(const std::vector<std::string>& paths,
                          std::shared_ptr<const RoutingPlan> plan, int engine_rank,
                          HostBackend& backend,
                          std::chrono::milliseconds timeout = std::chrono::seconds(10),
                          int replica = 0) {
  return message_of([&] {
    SameHostPullTransport::connect_engine_rank(paths, kToken, plan, engine_rank, backend,
                                               config(timeout), replica);
  });
}

}  // namespace

TEST_CASE("same-host pull: the handshake's refusals, named") {
  HostBackend backend;
  constexpr auto kShort = std::chrono::milliseconds(1000);  // serves that are meant to time out

  // Each scenario in its own directory, all side by side: most end in a serve's timeout.
  SocketDir world_dir{"shadowsync_pull_world"};
  const auto world = socket_paths(world_dir, 2);
  auto world_0 = serve_async(world[0], make_plan(2, 1), 0, backend, std::chrono::seconds(10));
  auto world_1 = serve_async(world[1], make_plan(4, 1), 1, backend, kShort);
  auto world_engine = std::async(std::launch::async,
                                 [&] { return connect_error(world, make_plan(2, 1), 0, backend); });

  SocketDir plan_dir{"shadowsync_pull_plan"};
  const auto planned = socket_paths(plan_dir, 1);
  const auto engine_plan = make_plan(1, 2);
  const auto trainer_plan = make_plan(1, 2, /*other_needs=*/true);
  REQUIRE(engine_plan->fingerprint() != trainer_plan->fingerprint());
  auto plan_0 = serve_async(planned[0], trainer_plan, 0, backend, kShort);
  auto plan_engine = std::async(std::launch::async,
                                [&] { return connect_error(planned, engine_plan, 0, backend); });

  SocketDir order_dir{"shadowsync_pull_order"};
  const auto ordered = socket_paths(order_dir, 2);
  auto order_0 = serve_async(ordered[0], make_plan(2, 1), 0, backend, kShort);
  auto order_1 = serve_async(ordered[1], make_plan(2, 1), 1, backend, std::chrono::seconds(10));
  auto order_engine = std::async(std::launch::async, [&] {
    return connect_error({ordered[1], ordered[0]}, make_plan(2, 1), 0, backend);
  });

  SocketDir missing_dir{"shadowsync_pull_missing"};
  const auto missing = socket_paths(missing_dir, 3);
  auto missing_0 = serve_async(missing[0], make_plan(3, 1), 0, backend, std::chrono::seconds(10));
  auto missing_1 = serve_async(missing[1], make_plan(3, 1), 1, backend, std::chrono::seconds(10));
  auto missing_engine = std::async(std::launch::async, [&] {
    return connect_error(missing, make_plan(3, 1), 0, backend, std::chrono::milliseconds(300));
  });

  // Engine rank 0 taken twice: the second process is refused, rank 1 then completes the serve.
  SocketDir taken_dir{"shadowsync_pull_taken"};
  const auto taken = socket_paths(taken_dir, 1);
  std::unique_ptr<SameHostPullTransport> taken_trainer;
  auto taken_0 =
      serve_async(taken[0], make_plan(1, 2), 0, backend, std::chrono::seconds(10), &taken_trainer);
  auto first = SameHostPullTransport::connect_engine_rank(taken, kToken, make_plan(1, 2), 0,
                                                          backend, config());
  const std::string taken_error = connect_error(taken, make_plan(1, 2), 0, backend);
  auto second = SameHostPullTransport::connect_engine_rank(taken, kToken, make_plan(1, 2), 1,
                                                           backend, config());
  CHECK(taken_0.get().empty());
  CHECK(taken_trainer != nullptr);
  CHECK_THAT(taken_error, Catch::Contains("engine rank 0: trainer rank 0 at " + taken[0] +
                                          " already admitted another engine process as engine "
                                          "rank 0"));

  CHECK_THAT(world_engine.get(), Catch::Contains("engine rank 0 was set up for 2 trainer ranks, "
                                                 "trainer rank 1 at " +
                                                 world[1] + " for 4"));
  CHECK(world_0.get().empty());
  CHECK_THAT(world_1.get(), Catch::Contains("engine rank 0 was set up for 2 trainer ranks and 1 "
                                            "engine ranks, trainer rank 1 at " +
                                            world[1] + " for 4 and 1"));

  CHECK_THAT(plan_engine.get(),
             Catch::Contains(fmt::format("engine rank 0's routing plan (fingerprint {:#018x}) "
                                         "differs from trainer rank 0's at {} ({:#018x})",
                                         engine_plan->fingerprint(), planned[0],
                                         trainer_plan->fingerprint())));
  CHECK_THAT(plan_0.get(), Catch::Contains("has routing plan"));

  CHECK_THAT(order_engine.get(), Catch::Contains(ordered[1] + " is served by trainer rank 1; "
                                                              "expected 0"));
  CHECK(order_1.get().empty());
  CHECK_THAT(order_0.get(), Catch::Contains("0 of 1 engine processes connected"));

  CHECK_THAT(missing_engine.get(),
             Catch::Contains("trainer rank 2 (" + missing[2] + ") never served within 300 ms"));
  CHECK(missing_0.get().empty());
  CHECK(missing_1.get().empty());

  CHECK_THAT(message_of([&] {
               SameHostPullTransport::serve(taken[0], kToken, make_plan(1, 1), 0, 1, backend,
                                            SameHostMemory::kDevice, config());
             }),
             // With CUDA: "device memory needs a CudaBackend, got the 'host' backend"; without:
             // "the device memory flavour needs a CudaBackend and a build with CUDA".
             Catch::Contains("needs a CudaBackend"));
}

TEST_CASE(
    "same-host pull: engine replicas: 2 trainer ranks pack each bucket once, the 2 replicas of "
    "both engine ranks land it; a replica that dies fails the trainer rank, named") {
  SocketDir dir{"shadowsync_pull_replicas"};
  const auto paths = socket_paths(dir, 2);
  const auto plan = make_plan(2, 2);
  constexpr int kReplicas = 2;
  HostBackend trainer_backend;
  std::unique_ptr<SameHostPullTransport> trainers[2];
  std::future<std::string> serving[2];
  for (int t = 0; t < 2; ++t) {
    serving[t] = serve_async(paths[t], plan, t, trainer_backend, std::chrono::seconds(20),
                             &trainers[t], kReplicas);
  }
  std::vector<std::unique_ptr<EngineRank>> engines;  // replica by replica, as the trainer seats
  for (int r = 0; r < kReplicas; ++r) {
    for (int e = 0; e < 2; ++e) {
      engines.push_back(std::make_unique<EngineRank>(e, plan));
      engines.back()->replica = r;
    }
  }
  connect_engines(engines, paths);
  for (auto& s : serving) REQUIRE(s.get().empty());

  std::unique_ptr<Stream> streams[2] = {trainer_backend.create_stream(StreamPriority::kNormal),
                                        trainer_backend.create_stream(StreamPriority::kNormal)};
  std::vector<std::vector<std::byte>> packed(2);  // read by the stream tasks until synchronized
  // Trainer rank t sends update v: one send_routes_async per bucket, whatever the replicas.
  const auto send = [&](int t, std::uint64_t v) {
    packed[t] = packing(*plan, t, v);
    for (std::size_t k = 0; k < plan->bucket_count(0); ++k) {
      const ByteRange range = plan->packed_range(t, 0, k);
      trainers[t]->send_routes_async({v, k, 0, k}, packed[t].data() + range.begin,
                                     range.end - range.begin, *streams[t]);
    }
  };
  const std::size_t last = plan->bucket_count(0) - 1;
  for (std::uint64_t v = 1; v <= 2; ++v) {
    CAPTURE(v);
    for (int t = 0; t < 2; ++t) send(t, v);
    for (auto& e : engines) e->receive(v);
    for (auto& e : engines) {
      CAPTURE(e->rank, e->replica);
      REQUIRE(e->wait_landed(last));
      INFO(e->transport->async_error().value_or(""));
      REQUIRE_FALSE(e->transport->async_error().has_value());
      CHECK(e->wrong_bytes(v, 0, wire_bytes()) == 0);
      CHECK(e->transport->routed_bytes() == v * plan->bytes_to(e->rank));
    }
    for (int t = 0; t < 2; ++t) {
      trainer_backend.stream_synchronize(*streams[t]);
      REQUIRE_FALSE(trainers[t]->async_error().has_value());
    }
  }

  // Update 3: replica 1 of engine rank 0 is gone (its process died: the peers see EOF) before it
  // acked bucket 0. Each trainer rank fails naming it; the rest see the failure as they would
  // from a Sender, which aborts its transport.
  for (int t = 0; t < 2; ++t) send(t, 3);
  engines[2]->transport->abort();
  for (int t = 0; t < 2; ++t) {
    trainer_backend.stream_synchronize(*streams[t]);
    const std::string error = trainers[t]->async_error().value_or("");
    CHECK_THAT(error, Catch::Contains(fmt::format("same-host pull trainer rank {}: engine rank 0, "
                                                  "replica 1, closed its socket",
                                                  t)) &&
                          Catch::Contains("bucket 0 of update 3"));
    trainers[t]->abort();
  }
  for (std::size_t i : {0, 1, 3}) {
    auto& e = engines[i];
    e->receive(3);
    REQUIRE(e->wait_landed(last));
    CHECK(e->transport->async_error().has_value());
  }
}

TEST_CASE("same-host pull: refusals of engine replicas, named; a seat given back") {
  HostBackend backend;
  const auto plan = make_plan(1, 1);
  CHECK_THAT(message_of([&] {
               SocketDir dir{"shadowsync_pull_odd"};
               SameHostPullTransport::serve(socket_paths(dir, 1)[0], kToken, make_plan(1, 2), 0,
                                            3, backend, SameHostMemory::kHost, config());
             }),
             Catch::Contains("3 engine processes, but the routing plan has 2 engine ranks; serve "
                             "replicas x engine ranks processes"));

  // A trainer rank serving 2 replicas of its one engine rank: replica 0 comes, a second replica
  // 0 and a replica 2 are refused, replica 1 never comes.
  SocketDir dir{"shadowsync_pull_replica_refusals"};
  const auto paths = socket_paths(dir, 1);
  auto serving = serve_async(paths[0], plan, 0, backend, std::chrono::milliseconds(4000), nullptr,
                             /*replicas=*/2);
  auto first = SameHostPullTransport::connect_engine_rank(paths, kToken, plan, 0, backend,
                                                          config());
  CHECK_THAT(connect_error(paths, plan, 0, backend, std::chrono::seconds(10), 0),
             Catch::Contains("engine rank 0: trainer rank 0 at " + paths[0] +
                             " already admitted another engine process as engine rank 0"));
  CHECK_THAT(connect_error(paths, plan, 0, backend, std::chrono::seconds(10), 2),
             Catch::Contains("engine rank 0, replica 2: trainer rank 0 at " + paths[0] +
                             " serves 2 replica(s) of each engine rank (replicas 0..1)"));
  const std::string timed_out = serving.get();
  CHECK_THAT(timed_out, Catch::Contains("1 of 2 engine processes connected") &&
                            Catch::Contains("rank(s) 0 (replica 1) not admitted") &&
                            Catch::Contains("engine rank 0, replica 2: replica 2 is outside the 2 "
                                            "replica(s) trainer rank 0 serves"));
  CHECK_THAT(message_of([&] {
               SameHostPullTransport::connect_engine_rank(paths, kToken, plan, 0, backend,
                                                          config(), -1);
             }),
             Catch::Contains("replica -1 is outside 0..65535"));

  // An admitted process that dies before the others came gives its seat back: its restart is
  // admitted, not refused as taken, and the serve completes.
  SocketDir again_dir{"shadowsync_pull_replica_again"};
  const auto again = socket_paths(again_dir, 1);
  std::unique_ptr<SameHostPullTransport> trainer;
  auto serving_again = serve_async(again[0], plan, 0, backend, std::chrono::seconds(20), &trainer,
                                   /*replicas=*/2);
  auto died = SameHostPullTransport::connect_engine_rank(again, kToken, plan, 0, backend,
                                                         config(), 1);
  died.reset();  // its peers see EOF, as if its process had died
  auto restarted = SameHostPullTransport::connect_engine_rank(again, kToken, plan, 0, backend,
                                                              config(), 1);
  auto other = SameHostPullTransport::connect_engine_rank(again, kToken, plan, 0, backend,
                                                          config(), 0);
  CHECK(serving_again.get().empty());
  REQUIRE(trainer != nullptr);
  CHECK_FALSE(trainer->async_error().has_value());
}

TEST_CASE("same-host pull: 20 connect/abort cycles leave no fd, thread or memory file behind") {
  SocketDir dir{"shadowsync_pull_cycles"};
  const auto paths = socket_paths(dir, 2);
  const auto plan = make_plan(2, 1);
  HostBackend trainer_backend;
  // One stream per trainer rank: each one's send waits for the engine, which waits for both.
  auto trainer_stream = trainer_backend.create_stream(StreamPriority::kNormal);
  auto trainer_1_stream = trainer_backend.create_stream(StreamPriority::kNormal);
  EngineRank engine(0, plan);
  const auto cycle = [&](int i) {
    std::unique_ptr<SameHostPullTransport> trainers[2];
    auto serving_0 =
        serve_async(paths[0], plan, 0, trainer_backend, std::chrono::seconds(10), &trainers[0]);
    auto serving_1 =
        serve_async(paths[1], plan, 1, trainer_backend, std::chrono::seconds(10), &trainers[1]);
    engine.transport = SameHostPullTransport::connect_engine_rank(paths, kToken, plan, 0,
                                                                  engine.backend, config());
    REQUIRE(serving_0.get().empty());
    REQUIRE(serving_1.get().empty());
    engine.receive(i, /*first_bucket=*/0);
    const ByteRange range = plan->packed_range(0, 0, 0);
    const std::vector<std::byte> packed = packing(*plan, 0, i);
    trainers[0]->send_routes_async({static_cast<std::uint64_t>(i), 0, 0, 0},
                                   packed.data() + range.begin, range.end - range.begin,
                                   *trainer_stream);
    if (i % 2 == 1) {
      // Trainer rank 1 never rings: the engine waits until aborted, trainer rank 0 for its ack
      // until the engine's socket closes.
      engine.transport->abort();
      trainer_backend.stream_synchronize(*trainer_stream);
      // Before its doorbell or its ack, as the abort raced the trainer's task.
      const std::string error = trainers[0]->async_error().value_or("");
      CHECK_THAT(error, Catch::Contains("engine rank 0 closed its socket (its process died?) "
                                        "before"));
      CHECK_THAT(error, Catch::Contains(fmt::format("bucket 0 of update {}", i)));
    } else {
      const ByteRange range_1 = plan->packed_range(1, 0, 0);
      const std::vector<std::byte> packed_1 = packing(*plan, 1, i);
      trainers[1]->send_routes_async({static_cast<std::uint64_t>(i), 0, 0, 0},
                                     packed_1.data() + range_1.begin, range_1.end - range_1.begin,
                                     *trainer_1_stream);
      REQUIRE(engine.wait_landed(0));
      trainer_backend.stream_synchronize(*trainer_stream);
      trainer_backend.stream_synchronize(*trainer_1_stream);
      CHECK_FALSE(engine.transport->async_error().has_value());
      trainers[0]->abort();
    }
    REQUIRE(engine.wait_landed(engine.copies.size() - 1));
    engine.transport.reset();
  };
  cycle(0);  // warm up: lazily made things (the async pool, OpenSSL's tables) exist from here on
  const ProcessResources baseline = ProcessResources::now();
  CHECK(same_host_memory_files() == 0);
  for (int i = 1; i <= 20; ++i) cycle(i);
  wait_back_to(baseline, "20 pull connect/abort cycles");
  CHECK(same_host_memory_files() == 0);
  CHECK(engine.wrong_bytes(20, 0, wire_layout().groups()[0].bucket(1).offset) == 0);
}

TEST_CASE("same-host pull: broadcasts and misuse are refused, named") {
  SocketDir dir{"shadowsync_pull_misuse"};
  const auto paths = socket_paths(dir, 1);
  const auto plan = make_plan(1, 1);
  HostBackend backend;
  auto stream = backend.create_stream(StreamPriority::kNormal);
  std::unique_ptr<SameHostPullTransport> trainer;
  auto serving = serve_async(paths[0], plan, 0, backend, std::chrono::seconds(10), &trainer);
  auto engine =
      SameHostPullTransport::connect_engine_rank(paths, kToken, plan, 0, backend, config());
  REQUIRE(serving.get().empty());
  std::vector<std::byte> buffer(64);
  CHECK_THAT(message_of([&] { engine->broadcast_async(buffer.data(), 64, 0, *stream); }),
             Catch::Contains("moves routes only") && Catch::Contains("route_mover()"));
  CHECK(engine->route_mover() == engine.get());
  CHECK(engine->staging_buffer(0, 1) == nullptr);
  CHECK(trainer->staging_buffer(1, trainer->slot_bytes()) != nullptr);
  CHECK(trainer->staging_buffer(0, trainer->slot_bytes() + 1) == nullptr);
  CHECK(trainer->slot_bytes() >= plan->max_packed_bytes(0));
  const ByteRange range = plan->packed_range(0, 0, 0);
  CHECK_THAT(message_of([&] {
               trainer->send_routes_async({1, 0, 0, 0}, buffer.data(), range.end - range.begin + 1,
                                          *stream);
             }),
             Catch::Contains(
                 fmt::format("{} bytes for bucket 0 of update 1", range.end - range.begin + 1)) &&
                 Catch::Contains(fmt::format("is {} bytes", range.end - range.begin)));
  CHECK_THAT(message_of([&] {
               trainer->send_routes_async({1, 0, 0, 0}, trainer->staging_buffer(1, 1),
                                          range.end - range.begin, *stream);
             }),
             Catch::Contains("packed in staging slot 1, but goes in slot 0"));
  RouteCopy outside;
  outside.packed_offset = range.end - range.begin;
  outside.row_bytes = 1;
  outside.rows = 1;
  outside.src_pitch = outside.dst_pitch = 1;
  CHECK_THAT(message_of([&] {
               engine->receive_routes_async({1, 0, 0, 0}, std::span(&outside, 1),
                                            {buffer.data(), nullptr}, *stream);
             }),
             Catch::Contains("reads bytes"));
  CHECK_THAT(message_of([&] {
               engine->send_routes_async({1, 0, 0, 0}, nullptr, 0, *stream);
             }),
             Catch::Contains("only trainer ranks send routes"));
  CHECK_THAT(message_of([&] {
               engine->receive_routes_async({1, 0, 99, 0}, {}, {buffer.data(), nullptr}, *stream);
             }),
             Catch::Contains("group 99, bucket 0 is outside the routing plan"));
}
