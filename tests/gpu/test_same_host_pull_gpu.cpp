// SameHostPullTransport's device flavour (SameHostMemory::kDevice): the scenario of
// tests/integration/test_same_host_pull.cpp with every slot and arena in GPU memory. Two trainer
// ranks are child processes (this binary running the hidden case "[.pull_gpu_trainer]"), each
// with its staging on GPU 0; two engine ranks live in this process, engine rank e on GPU
// e % (the GPUs there are), so that with two GPUs engine rank 1 pulls across GPUs. Each rank's
// receive blocks its thread until every doorbell came (host-gated), so each engine rank receives
// on a thread of its own, as a Receiver's thread would.
//  * 3 updates: each engine rank's arena holds the update's bytes wherever it needs them, and its
//    routed bytes are what the plan routes to it;
//  * trainer rank 1 SIGKILLed once its 2nd bucket was acked: both engine ranks fail, naming it,
//    with nothing of the 3rd bucket on copied; new trainer processes on the same paths and new
//    engine transports apply the next update;
//  * a trainer rank that never rings: the receive ends at SameHostConfig::doorbell_timeout,
//    naming it, having enqueued nothing;
//  * an engine rank on a GPU connecting to a trainer rank that serves host memory: refused, named.
//  * routes read in place: each trainer rank's packing lies in two cudaMalloc allocations (cut
//    mid-route), which the engines read where they lie; the second is freed and allocated again
//    before the 2nd update (at the same address, as the allocator likes to): the engines read the
//    new one. Packings in a cudaMallocAsync pool, which CUDA IPC cannot share, go through the
//    staging slots instead.
//
// Skips (77, "SKIPPED: ...") without a usable CUDA device (tests/support/catch_main.cpp).
#include <cuda_runtime_api.h>
#include <signal.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "child_process.h"
#include "core/in_place_copies.h"
#include "core/route_copies.h"
#include "deadline.h"
#include "pull_fixture.h"
#include "shadowsync/cuda_backend.h"
#include "shadowsync/error.h"
#include "shadowsync/host_backend.h"
#include "transports/same_host/same_host_pull_transport.h"
#include "watchdog.h"

using namespace shadowsync;
using namespace shadowsync::testing;
using namespace std::chrono_literals;

namespace {

const std::string kToken = "ssk1-9d0b7c1e2f3a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f9012345678";

SameHostConfig config(std::chrono::milliseconds doorbell_timeout = 10s) {
  SameHostConfig c;
  c.connect_timeout = 30s;
  c.doorbell_timeout = doorbell_timeout;
  return c;
}


int gpu_count() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}

}  // namespace

namespace {

// A trainer rank's packing in device memory of its own, cut in two allocations at `cut`, for
// routes read in place; `pool`: in a cudaMallocAsync pool (which CUDA IPC cannot share).
struct DevicePacking {
  std::size_t cut = 0;
  std::size_t bytes = 0;
  bool pool = false;
  std::array<std::byte*, 2> parts{};

  DevicePacking(std::size_t total, bool in_pool) : cut(total / 2 + 3), bytes(total), pool(in_pool) {
    REQUIRE(total > cut);
    allocate(0);
    allocate(1);
  }
  ~DevicePacking() {
    for (std::byte* p : parts) (void)(pool ? cudaFreeAsync(p, nullptr) : cudaFree(p));
    (void)cudaDeviceSynchronize();
  }
  std::size_t size(int i) const { return i == 0 ? cut : bytes - cut; }
  void allocate(int i) {
    void* p = nullptr;
    REQUIRE((pool ? cudaMallocAsync(&p, size(i), nullptr) : cudaMalloc(&p, size(i))) ==
            cudaSuccess);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    parts[static_cast<std::size_t>(i)] = static_cast<std::byte*>(p);
  }
  // Freed and made again (the caching allocators of trainers do this): another allocation,
  // likely at the same address.
  void reallocate_second() {
    const std::byte* before = parts[1];
    REQUIRE(cudaFree(parts[1]) == cudaSuccess);
    allocate(1);
    std::printf("trainer: part 2 made again %s\n",
                parts[1] == before ? "at the same address" : "elsewhere");
  }
  // Complete before it returns (a copy from pageable memory may return before its DMA landed),
  // as a trainer's optimizer step is before it publishes.
  void fill(const std::vector<std::byte>& packed) {
    REQUIRE(cudaMemcpy(parts[0], packed.data(), cut, cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(cudaMemcpy(parts[1], packed.data() + cut, bytes - cut, cudaMemcpyHostToDevice) ==
            cudaSuccess);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  }
  std::vector<InPlaceSegment> segments() const {
    return {{0, 0, cut, parts[0]}, {0, cut, bytes - cut, parts[1]}};
  }
};

}  // namespace

// A trainer rank of the 2 x 2 plan, its staging on GPU 0. Environment: SS_PULL_PATH,
// SS_PULL_RANK, SS_PULL_FIRST (first version), SS_PULL_COUNT (updates), SS_PULL_STOP_AT (a
// version: once its 2nd bucket was acked, print "rang\n" and wait to be killed; 0: none),
// SS_PULL_IN_PLACE (1: offer its packing in place from a DevicePacking, whose second part is
// made again before the 2nd update; 2: the same in a pool, whose offer must be refused; 0: pack).
TEST_CASE("same-host pull gpu trainer child", "[.pull_gpu_trainer]") {
  const auto plan = make_plan(2, 2);
  const int rank = static_cast<int>(env_u64("SS_PULL_RANK"));
  CudaBackend backend(0);
  auto transport = SameHostPullTransport::serve(std::getenv("SS_PULL_PATH"), kToken, plan, rank, 2,
                                                backend, SameHostMemory::kDevice, config());
  auto stream = backend.create_stream(StreamPriority::kNormal);
  const std::uint64_t first = env_u64("SS_PULL_FIRST");
  const std::uint64_t stop_at = env_u64("SS_PULL_STOP_AT");
  std::uint64_t sends = 0;  // the b-th send goes in slot b % 2, over every update
  const std::uint64_t in_place = env_u64("SS_PULL_IN_PLACE");
  std::unique_ptr<DevicePacking> device;
  if (in_place != 0) {
    device = std::make_unique<DevicePacking>(packing(*plan, rank, first).size(), in_place == 2);
  }
  for (std::uint64_t v = first; v < first + env_u64("SS_PULL_COUNT"); ++v) {
    const std::vector<std::byte> packed = packing(*plan, rank, v);
    bool offered = false;
    if (device) {
      // The previous update was acked by every engine (flush below): its memory may change.
      if (v == first + 1 && in_place == 1) device->reallocate_second();
      device->fill(packed);
      std::string why_not;
      offered = transport->offer_in_place(device->segments(), why_not);
      INFO(why_not);
      REQUIRE(offered == (in_place == 1));
      // Refused for the pool, saying so.
      if (in_place == 2) CHECK_THAT(why_not, Catch::Contains("CUDA IPC cannot share"));
    }
    for (std::size_t k = 0; k < plan->bucket_count(0); ++k) {
      const ByteRange range = plan->packed_range(rank, 0, k);
      const std::size_t bytes = range.end - range.begin;
      if (offered) {
        ++sends;
        transport->send_routes_async({v, k, 0, k}, nullptr, bytes, *stream);
        continue;
      }
      // The slot is free: the send before returned once every engine read what it held.
      void* staging = transport->staging_buffer(static_cast<int>(sends++ % 2), bytes);
      REQUIRE(staging != nullptr);
      if (bytes > 0) backend.memcpy_async(staging, packed.data() + range.begin, bytes, *stream);
      transport->send_routes_async({v, k, 0, k}, staging, bytes, *stream);
      if (v == stop_at && k == 1) {
        transport->flush();  // the 2nd bucket's acks
        REQUIRE_FALSE(transport->async_error().has_value());
        std::fputs("rang\n", stdout);
        std::fflush(stdout);
        for (;;) ::pause();
      }
    }
    transport->flush();
    INFO(transport->async_error().value_or(""));
    REQUIRE_FALSE(transport->async_error().has_value());
  }
}

namespace {

std::unique_ptr<ChildProcess> spawn_trainer(const std::string& path, int rank, std::uint64_t first,
                                            std::uint64_t count, std::uint64_t stop_at = 0,
                                            int in_place = 0) {
  return spawn_pull_trainer("[.pull_gpu_trainer]", path, rank, first, count, stop_at, in_place);
}

// An engine rank in the test process: its transport and a slot arena on its GPU (0xEE where
// nothing landed).
struct EngineRank {
  const int rank;
  std::shared_ptr<const RoutingPlan> plan;
  CudaBackend backend;
  std::unique_ptr<Stream> stream = backend.create_stream(StreamPriority::kLow);
  std::unique_ptr<SameHostPullTransport> transport;
  std::vector<std::vector<RouteCopy>> copies;  // [bucket]
  std::byte* arena = nullptr;
  std::size_t arena_bytes = 0;

  EngineRank(int r, std::shared_ptr<const RoutingPlan> p, int device)
      : rank(r), plan(std::move(p)), backend(device) {
    const Layout wire = wire_layout();
    copies = compose_route_copies(*plan, rank, wire, nullptr)[0];
    arena_bytes = wire.groups()[0].arena_bytes();
    arena = static_cast<std::byte*>(backend.allocate(arena_bytes));
    const std::vector<std::byte> fill(arena_bytes, std::byte{0xEE});
    backend.memcpy_async(arena, fill.data(), arena_bytes, *stream);
    backend.stream_synchronize(*stream);
  }
  ~EngineRank() {
    if (transport) transport->abort();
    transport.reset();
    backend.deallocate(arena);
  }

  void connect(const std::vector<std::string>& paths,
               std::chrono::milliseconds doorbell_timeout = 10s) {
    transport = SameHostPullTransport::connect_engine_rank(paths, kToken, plan, rank, backend,
                                                           config(doorbell_timeout));
  }
  // Every bucket of update v, on a thread of its own (each receive blocks until its doorbells).
  std::future<void> receive(std::uint64_t v) {
    return std::async(std::launch::async, [this, v] {
      for (std::size_t k = 0; k < copies.size(); ++k) {
        transport->route_mover()->receive_routes_async({v, k, 0, k}, copies[k], {arena, nullptr},
                                                       *stream);
      }
      backend.stream_synchronize(*stream);
    });
  }
  // The bytes of [begin, end) this rank needs that do not hold update v's image.
  std::size_t wrong_bytes(std::uint64_t v, std::size_t begin, std::size_t end) {
    std::vector<std::byte> host(arena_bytes);
    backend.memcpy_async(host.data(), arena, arena_bytes, *stream);
    backend.stream_synchronize(*stream);
    std::size_t wrong = 0;
    for (std::size_t k = 0; k < copies.size(); ++k) {
      for (const Route& r : plan->routes(0, k)) {
        if (r.engine != rank) continue;
        for (std::size_t i = std::max(begin, r.wire_offset);
             i < std::min(end, r.wire_offset + r.bytes); ++i) {
          if (host[i] != image_byte(v, i)) ++wrong;
        }
      }
    }
    return wrong;
  }
};

void connect_engines(std::vector<std::unique_ptr<EngineRank>>& engines,
                     const std::vector<std::string>& paths) {
  std::vector<std::future<void>> connecting;
  for (auto& e : engines) {
    connecting.push_back(std::async(std::launch::async, [&paths, &e] { e->connect(paths); }));
  }
  for (auto& c : connecting) c.get();
}

void receive_all(std::vector<std::unique_ptr<EngineRank>>& engines, std::uint64_t v) {
  std::vector<std::future<void>> receiving;
  for (auto& e : engines) receiving.push_back(e->receive(v));
  for (auto& r : receiving) {
    REQUIRE(r.wait_for(kTestDeadline) == std::future_status::ready);
    r.get();
  }
}

std::size_t wire_bytes() { return wire_layout().groups()[0].arena_bytes(); }

}  // namespace

TEST_CASE(
    "same-host pull gpu: 2 trainer processes x 2 engine ranks in device memory; a trainer rank "
    "killed mid-update fails both engines' bucket, named, and new trainers' next update lands") {
  Watchdog watchdog(240s);
  SocketDir dir{"shadowsync_pull_gpu"};
  const auto paths = socket_paths(dir, 2);
  const auto plan = make_plan(2, 2);
  REQUIRE(plan->bucket_count(0) >= 4);
  const int gpus = gpu_count();
  std::vector<std::unique_ptr<ChildProcess>> trainers;
  trainers.push_back(spawn_trainer(paths[0], 0, 1, 4));
  trainers.push_back(spawn_trainer(paths[1], 1, 1, 4, /*stop_at=*/4));
  std::vector<std::unique_ptr<EngineRank>> engines;
  for (int e = 0; e < 2; ++e) engines.push_back(std::make_unique<EngineRank>(e, plan, e % gpus));
  connect_engines(engines, paths);
  std::printf("engine rank 1 on GPU %d, trainer ranks on GPU 0\n", 1 % gpus);

  for (std::uint64_t v = 1; v <= 3; ++v) {
    CAPTURE(v);
    receive_all(engines, v);
    for (auto& e : engines) {
      INFO(e->transport->async_error().value_or(""));
      REQUIRE_FALSE(e->transport->async_error().has_value());
      CHECK(e->wrong_bytes(v, 0, wire_bytes()) == 0);
      CHECK(e->transport->routed_bytes() == v * plan->bytes_to(e->rank));
    }
  }

  // Update 4: trainer rank 1 dies once its 2nd bucket was acked.
  std::vector<std::future<void>> receiving;
  for (auto& e : engines) receiving.push_back(e->receive(4));
  wait_for_output(*trainers[1], "rang\n");
  ::kill(trainers[1]->pid, SIGKILL);
  trainers[1]->reap();
  for (auto& r : receiving) {
    REQUIRE(r.wait_for(kTestDeadline) == std::future_status::ready);  // the later calls return
    r.get();
  }
  const std::size_t bucket2 = wire_layout().groups()[0].bucket(2).offset;
  for (auto& e : engines) {
    CAPTURE(e->rank);
    const auto error = e->transport->async_error();
    REQUIRE(error.has_value());
    CHECK_THAT(*error, Catch::Contains("trainer rank 1 closed its socket (its process died?) "
                                       "before the doorbell of bucket 2 of update 4"));
    CHECK(e->wrong_bytes(4, 0, bucket2) == 0);            // buckets 0 and 1 landed
    CHECK(e->wrong_bytes(3, bucket2, wire_bytes()) == 0);  // nothing of bucket 2 on
  }
  for (auto& e : engines) e->transport->abort();  // what a receiver does: trainer 0 sees EOF
  ::kill(trainers[0]->pid, SIGKILL);
  trainers[0]->reap();

  trainers.clear();
  trainers.push_back(spawn_trainer(paths[0], 0, 5, 1));
  trainers.push_back(spawn_trainer(paths[1], 1, 5, 1));
  connect_engines(engines, paths);
  receive_all(engines, 5);
  for (auto& e : engines) {
    INFO(e->transport->async_error().value_or(""));
    REQUIRE_FALSE(e->transport->async_error().has_value());
    CHECK(e->wrong_bytes(5, 0, wire_bytes()) == 0);
  }
  for (auto& t : trainers) require_exited_zero(*t);
}

TEST_CASE("same-host pull gpu: routes read in place land, a shard table made again is read, and "
          "memory CUDA IPC cannot share is packed") {
  Watchdog watchdog(240s);
  SocketDir dir{"shadowsync_pull_gpu_in_place"};
  const auto paths = socket_paths(dir, 2);
  const auto plan = make_plan(2, 2);
  const int gpus = gpu_count();
  for (const int in_place : {1, 2}) {
    CAPTURE(in_place);
    std::vector<std::unique_ptr<ChildProcess>> trainers;
    for (int t = 0; t < 2; ++t) trainers.push_back(spawn_trainer(paths[t], t, 1, 3, 0, in_place));
    std::vector<std::unique_ptr<EngineRank>> engines;
    for (int e = 0; e < 2; ++e) engines.push_back(std::make_unique<EngineRank>(e, plan, e % gpus));
    connect_engines(engines, paths);
    for (std::uint64_t v = 1; v <= 3; ++v) {
      CAPTURE(v);
      receive_all(engines, v);
      for (auto& e : engines) {
        CAPTURE(e->rank);
        if (e->transport->async_error()) {  // a trainer that failed says why in its output
          for (auto& t : trainers) {
            t->reap(std::chrono::seconds(5));
            UNSCOPED_INFO("trainer output: " << t->output);
          }
        }
        INFO(e->transport->async_error().value_or(""));
        REQUIRE_FALSE(e->transport->async_error().has_value());
        CHECK(e->wrong_bytes(v, 0, wire_bytes()) == 0);
        CHECK(e->transport->routed_bytes() == v * plan->bytes_to(e->rank));
        // Every byte read where the trainers' packings lie, or none.
        CHECK(e->transport->routed_in_place_bytes() ==
              (in_place == 1 ? v * plan->bytes_to(e->rank) : 0));
      }
    }
    for (auto& t : trainers) {
      require_exited_zero(*t);
      // Whether the reallocation reused the address (the case a stale mapping would hide).
      const auto at = t->output.find("trainer: part 2");
      if (at != std::string::npos) {
        std::printf("%s\n", t->output.substr(at, t->output.find('\n', at) - at).c_str());
      }
    }
  }
}

TEST_CASE("same-host pull gpu: a trainer rank that never rings ends the receive at "
          "doorbell_timeout, named, with nothing copied") {
  Watchdog watchdog(120s);
  SocketDir dir{"shadowsync_pull_gpu_timeout"};
  const auto paths = socket_paths(dir, 1);
  const auto plan = make_plan(1, 1);
  CudaBackend trainer_backend(0);
  auto serving = std::async(std::launch::async, [&] {
    return SameHostPullTransport::serve(paths[0], kToken, plan, 0, 1, trainer_backend,
                                        SameHostMemory::kDevice, config());
  });
  EngineRank engine(0, plan, 0);
  engine.connect(paths, 500ms);
  auto trainer = serving.get();
  const auto start = std::chrono::steady_clock::now();
  auto receiving = engine.receive(1);
  REQUIRE(receiving.wait_for(kTestDeadline) == std::future_status::ready);
  receiving.get();
  const auto waited = std::chrono::steady_clock::now() - start;
  CHECK(waited >= 500ms);
  const auto error = engine.transport->async_error();
  REQUIRE(error.has_value());
  CHECK_THAT(*error, Catch::Contains("trainer rank 0 sent nothing for 500 ms "
                                     "(SameHostConfig::doorbell_timeout) before the doorbell of "
                                     "bucket 0 of update 1"));
  std::vector<std::byte> host(engine.arena_bytes);
  engine.backend.memcpy_async(host.data(), engine.arena, engine.arena_bytes, *engine.stream);
  engine.backend.stream_synchronize(*engine.stream);
  CHECK(std::all_of(host.begin(), host.end(), [](std::byte b) { return b == std::byte{0xEE}; }));
}

TEST_CASE("same-host pull gpu: an engine rank on a GPU refuses trainer ranks serving host "
          "memory, named") {
  Watchdog watchdog(60s);
  SocketDir dir{"shadowsync_pull_gpu_flavour"};
  const auto paths = socket_paths(dir, 1);
  const auto plan = make_plan(1, 1);
  HostBackend trainer_backend;
  auto serving = std::async(std::launch::async, [&] {
    return SameHostPullTransport::serve(paths[0], kToken, plan, 0, 1, trainer_backend,
                                        SameHostMemory::kHost, config());
  });
  EngineRank engine(0, plan, 0);
  try {
    engine.connect(paths);
    FAIL("connect_engine_rank took host memory with a CudaBackend");
  } catch (const Error& error) {
    CHECK(error.code() == ErrorCode::kInvalidArgument);
    CHECK_THAT(error.what(), Catch::Contains("engine rank 0: trainer rank 0 (" + paths[0] +
                                             ") shares host memory, but this engine rank's "
                                             "backend is 'cuda'"));
  }
  serving.get().reset();
}
