// The same-host pull transport through the C ABI (shadowsync_same_host_pull_serve / _connect): a
// trainer rank and an engine rank of a routing plan made from C find each other, the plan handle
// may go before the transports, and each refusal has its status and names what to fix.
#include <catch2/catch.hpp>

#include <filesystem>
#include <future>
#include <string>
#include <vector>

#include "shadowsync/shadowsync.h"
#include "socket_dir.h"

using namespace shadowsync::testing;

namespace {

const std::string kToken = "ssk1-4e217b3e708068e355dd91215ccb2ea999ee8d7530f4fd84340f63a34056aa56";

std::string last_error() { return shadowsync_get_last_error(); }

#define REQUIRE_OK(call)                                \
  do {                                                  \
    const shadowsync_status_t status_ = (call);         \
    INFO(#call << ": " << shadowsync_get_last_error()); \
    REQUIRE(status_ == SHADOWSYNC_SUCCESS);             \
  } while (false)

// q [13, 8] and the norm [8], fp32, buckets of 256 bytes; `trainers` ranks split q's rows
// (the last one holds the rest and the norm); one engine rank needs every byte.
struct Plan {
  shadowsync_layout_t wire = nullptr;
  shadowsync_routing_plan_t plan = nullptr;

  explicit Plan(int trainers) {
    const std::int64_t q[] = {13, 8}, norm[] = {8};
    const shadowsync_tensor_spec_t specs[] = {{"q", "fp32", q, 2, nullptr},
                                              {"norm", "fp32", norm, 1, nullptr}};
    REQUIRE_OK(shadowsync_layout_create(specs, 2, 256, &wire));
    std::vector<std::vector<shadowsync_wire_range_t>> held(trainers);
    for (int t = 0; t < trainers; ++t) {
      const std::int64_t begin[] = {13 * t / trainers, 0};
      const std::int64_t end[] = {13 * (t + 1) / trainers, 8};
      const shadowsync_tensor_region_t rows = {"q", SHADOWSYNC_REGION_BOX, 2, begin, end, 0, 0};
      held[t].resize(1);
      std::size_t count = 0;
      REQUIRE_OK(shadowsync_layout_region_ranges(wire, &rows, held[t].data(), 1, &count));
    }
    const shadowsync_tensor_region_t whole_norm = {
        "norm", SHADOWSYNC_REGION_ELEMENTS, 0, nullptr, nullptr, 0, 8};
    shadowsync_wire_range_t norm_range{};
    std::size_t count = 0;
    REQUIRE_OK(shadowsync_layout_region_ranges(wire, &whole_norm, &norm_range, 1, &count));
    held.back().push_back(norm_range);
    std::vector<shadowsync_rank_ranges_t> ranks;
    for (int t = 0; t < trainers; ++t) ranks.push_back({t, held[t].data(), held[t].size()});
    REQUIRE_OK(shadowsync_routing_plan_create(wire, ranks.data(), ranks.size(), nullptr, 0, &plan));
  }
  ~Plan() {
    if (plan != nullptr) shadowsync_routing_plan_destroy(plan);
    shadowsync_layout_destroy(wire);
  }
};

std::vector<std::string> socket_paths(const SocketDir& dir, int count) {
  const auto base = std::filesystem::path(dir.path()).parent_path();
  std::vector<std::string> out;
  for (int t = 0; t < count; ++t) {
    out.push_back((base / ("trainer" + std::to_string(t) + ".sock")).string());
  }
  return out;
}

}  // namespace

TEST_CASE("C ABI: a same-host pull trainer rank and engine rank connect; refusals are named") {
  SocketDir dir{"shadowsync_c_pull"};
  const auto paths = socket_paths(dir, 2);
  Plan plan(2);
  shadowsync_backend_t backend = nullptr;
  REQUIRE_OK(shadowsync_host_backend_create(&backend));

  SECTION("both trainer ranks serve 2 replicas, both connect, the plan handle goes first") {
    // Catch is not thread-safe: the serving threads only call, the test thread checks.
    struct Served {
      shadowsync_status_t status;
      std::string error;
      shadowsync_transport_t transport;
    };
    std::vector<std::future<Served>> serving;
    for (int t = 0; t < 2; ++t) {
      serving.push_back(std::async(std::launch::async, [&, t] {
        Served served{SHADOWSYNC_SUCCESS, {}, nullptr};
        served.status = shadowsync_same_host_pull_serve(
            paths[t].c_str(), kToken.data(), kToken.size(), plan.plan, t, 2, backend,
            SHADOWSYNC_SAME_HOST_MEMORY_HOST, 10000, &served.transport);
        if (served.status != SHADOWSYNC_SUCCESS) served.error = last_error();
        return served;
      }));
    }
    const char* c_paths[] = {paths[0].c_str(), paths[1].c_str()};
    shadowsync_transport_t engine = nullptr;
    REQUIRE_OK(shadowsync_same_host_pull_connect(c_paths, 2, kToken.data(), kToken.size(),
                                                 plan.plan, 0, backend, 10000, &engine));
    // Replica 0 came (the call without _replica): a second replica 0 and a replica 2 are refused.
    shadowsync_transport_t replica = nullptr;
    CHECK(shadowsync_same_host_pull_connect_replica(c_paths, 2, kToken.data(), kToken.size(),
                                                    plan.plan, 0, 0, backend, 10000,
                                                    &replica) == SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("already admitted another engine process as engine "
                                             "rank 0; it serves replicas 0..1"));
    CHECK(shadowsync_same_host_pull_connect_replica(c_paths, 2, kToken.data(), kToken.size(),
                                                    plan.plan, 0, 2, backend, 10000,
                                                    &replica) == SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("engine rank 0, replica 2: trainer rank 0 at " +
                                             paths[0] + " serves 2 replica(s)"));
    CHECK(replica == nullptr);
    REQUIRE_OK(shadowsync_same_host_pull_connect_replica(c_paths, 2, kToken.data(), kToken.size(),
                                                         plan.plan, 0, 1, backend, 10000,
                                                         &replica));
    std::vector<shadowsync_transport_t> trainers;
    for (auto& s : serving) {
      Served served = s.get();
      INFO(served.error);
      CHECK(served.status == SHADOWSYNC_SUCCESS);
      trainers.push_back(served.transport);
    }
    REQUIRE_OK(shadowsync_routing_plan_destroy(plan.plan));  // the transports keep the plan
    plan.plan = nullptr;
    REQUIRE_OK(shadowsync_backend_destroy(backend));  // and the backend
    backend = nullptr;
    REQUIRE_OK(shadowsync_transport_destroy(engine));
    REQUIRE_OK(shadowsync_transport_destroy(replica));
    for (auto* t : trainers) {
      REQUIRE(t != nullptr);
      REQUIRE_OK(shadowsync_transport_destroy(t));
    }
  }
  SECTION("device memory: not in a build without CUDA; with CUDA, not on a host backend") {
    shadowsync_transport_t served = nullptr;
    const shadowsync_status_t device = shadowsync_same_host_pull_serve(
        paths[0].c_str(), kToken.data(), kToken.size(), plan.plan, 0, 1, backend,
        SHADOWSYNC_SAME_HOST_MEMORY_DEVICE, 0, &served);
    if (shadowsync_has_cuda() == 0) {
      CHECK(device == SHADOWSYNC_NOT_SUPPORTED);
      CHECK_THAT(last_error(), Catch::Contains("built without CUDA"));
    } else {
      CHECK(device == SHADOWSYNC_INVALID_ARGUMENT);
      CHECK_THAT(last_error(),
                 Catch::Contains("same-host pull transport on '" + paths[0] +
                                 "': 'memory' SHADOWSYNC_SAME_HOST_MEMORY_DEVICE needs a cuda "
                                 "backend, but 'backend' is 'host'"));
    }
    CHECK(served == nullptr);
    CHECK(shadowsync_same_host_pull_serve(paths[0].c_str(), kToken.data(), kToken.size(), plan.plan,
                                          0, 1, backend,
                                          static_cast<shadowsync_same_host_memory_t>(7), 0,
                                          &served) == SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("'memory' is 7; expected"));
  }
  SECTION("no engine processes") {
    shadowsync_transport_t served = nullptr;
    CHECK(shadowsync_same_host_pull_serve(paths[0].c_str(), kToken.data(), kToken.size(), plan.plan,
                                          0, 0, backend, SHADOWSYNC_SAME_HOST_MEMORY_HOST, 0,
                                          &served) == SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("0 engine processes, but the routing plan has 1 "
                                             "engine ranks"));
  }
  SECTION("a path count other than the plan's trainer ranks, and NULL paths") {
    const char* one[] = {paths[0].c_str()};
    shadowsync_transport_t engine = nullptr;
    CHECK(shadowsync_same_host_pull_connect(one, 1, kToken.data(), kToken.size(), plan.plan, 0,
                                            backend, 0, &engine) == SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("1 trainer paths, but the routing plan has 2 trainer "
                                             "ranks"));
    CHECK(shadowsync_same_host_pull_connect(nullptr, 2, kToken.data(), kToken.size(), plan.plan, 0,
                                            backend, 0, &engine) == SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("'paths' is NULL but the count is 2"));
  }
  SECTION("a trainer rank that never serves") {
    const char* c_paths[] = {paths[0].c_str(), paths[1].c_str()};
    shadowsync_transport_t engine = nullptr;
    CHECK(shadowsync_same_host_pull_connect(c_paths, 2, kToken.data(), kToken.size(), plan.plan, 0,
                                            backend, 50, &engine) == SHADOWSYNC_TIMEOUT);
    CHECK_THAT(last_error(),
               Catch::Contains("trainer rank 0 (" + paths[0] + ") never served within 50 ms"));
  }
  SECTION("a handle of another kind as the plan") {
    shadowsync_transport_t served = nullptr;
    CHECK(shadowsync_same_host_pull_serve(paths[0].c_str(), kToken.data(), kToken.size(),
                                          reinterpret_cast<shadowsync_routing_plan_t>(plan.wire), 0,
                                          1, backend, SHADOWSYNC_SAME_HOST_MEMORY_HOST, 0,
                                          &served) == SHADOWSYNC_INVALID_HANDLE);
  }
  if (backend != nullptr) REQUIRE_OK(shadowsync_backend_destroy(backend));
}

TEST_CASE("shadowsync_nccl_routed_transport_create refuses by name before NCCL is called") {
  Plan plan(2);  // 2 trainer ranks and 1 engine rank: a communicator of 3
  shadowsync_backend_t backend = nullptr;
  REQUIRE_OK(shadowsync_host_backend_create(&backend));
  const std::uint8_t id[SHADOWSYNC_NCCL_UNIQUE_ID_BYTES] = {};
  shadowsync_transport_t transport = nullptr;
  CHECK(shadowsync_nccl_routed_transport_create(id, 0, 0, plan.plan, backend, nullptr, 3, nullptr,
                                                &transport) == SHADOWSYNC_INVALID_ARGUMENT);
  CHECK_THAT(last_error(), Catch::Contains("'gpus' is NULL but the count is 3"));
  const char* three[] = {"h/GPU-0", "h/GPU-1", "h/GPU-2"};
  if (shadowsync_has_cuda()) {
    const char* shared[] = {"h/GPU-0", "h/GPU-1", "h/GPU-0"};
    CHECK(shadowsync_nccl_routed_transport_create(id, 2, 0, plan.plan, backend, shared, 3, nullptr,
                                                  &transport) == SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("trainer rank 0 and engine rank 0 (communicator rank "
                                             "2) are both on GPU 'h/GPU-0'"));
    CHECK(shadowsync_nccl_routed_transport_create(id, 0, 0, plan.plan, backend, three, 2, nullptr,
                                                  &transport) == SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("2 GPUs given for a communicator of 3 ranks (2 "
                                             "trainer and 1 engine ranks)"));
    CHECK(shadowsync_nccl_routed_transport_create(id, 0, 0, plan.plan, backend, three, 3, nullptr,
                                                  &transport) == SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("backend 'host' given; NCCL moves device memory"));
  } else {
    CHECK(shadowsync_nccl_routed_transport_create(id, 0, 0, plan.plan, backend, three, 3, nullptr,
                                                  &transport) == SHADOWSYNC_NOT_SUPPORTED);
    CHECK_THAT(last_error(), Catch::Contains("built without CUDA/NCCL"));
  }
  CHECK(transport == nullptr);
  REQUIRE_OK(shadowsync_backend_destroy(backend));
}
