// The C ABI (shadowsync.h) from C++: handles that are NULL, destroyed or of the wrong kind, config
// structs, header bytes, statuses and the thread's last error, and updates end to end (plain and
// streamed) on the host backend. Runs in the sanitizer builds too: a crash or a use-after-free
// behind a bad handle would show there. tests/c_abi/compile_check.c covers the header as C11.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <functional>
#include <future>
#include <limits>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <time.h>

#include "deadline.h"
#include "pattern.h"
#include "socket_dir.h"
#include "shadowsync/shadowsync.h"
#include "c_api/shadowsync_testing.h"
#include "core/routing_plan.h"

using namespace shadowsync;
using namespace shadowsync::testing;

namespace {

std::string last_error() { return shadowsync_get_last_error(); }

#define REQUIRE_OK(call)                                    \
  do {                                                      \
    const shadowsync_status_t status_ = (call);             \
    INFO(#call << ": " << shadowsync_get_last_error());     \
    REQUIRE(status_ == SHADOWSYNC_SUCCESS);                 \
  } while (0)

// Specs of a small model over several 1 KiB buckets, with one adapter.
struct Specs {
  std::vector<std::vector<std::int64_t>> shapes = {{300, 4}, {257}, {7}, {16, 8}};
  std::vector<shadowsync_tensor_spec_t> specs = {
      {"embed", "bf16", nullptr, 2, "base"},
      {"w", "float32", nullptr, 1, nullptr},
      {"norm", "torch.float16", nullptr, 1, "base"},
      {"lora.A", "fp32", nullptr, 2, "lora"},
  };
  Specs() {
    for (std::size_t i = 0; i < specs.size(); ++i) specs[i].shape = shapes[i].data();
  }
};

shadowsync_layout_t make_layout() {
  Specs s;
  shadowsync_layout_t layout = nullptr;
  REQUIRE_OK(shadowsync_layout_create(s.specs.data(), s.specs.size(), 1024, &layout));
  return layout;
}

// The C++ layout equal to make_layout(): for the pattern oracle.
Layout cpp_layout() {
  return Layout::build({{"embed", DType::kBFloat16, {300, 4}, "base"},
                        {"w", DType::kFloat32, {257}, "base"},
                        {"norm", DType::kFloat16, {7}, "base"},
                        {"lora.A", DType::kFloat32, {16, 8}, "lora"}},
                       {.bucket_bytes = 1024});
}

// C views of pattern tensors.
struct CTensors {
  CTensors(const Layout& layout, const std::vector<std::string>& groups, std::uint64_t version)
      : host(layout, groups, version) {
    for (const SourceTensor& s : host.sources()) {
      // dtype names are NUL-terminated literals.
      tensors.push_back({s.name.c_str(), s.data, dtype_name(s.dtype).data(), s.shape.data(),
                         s.shape.size()});
    }
  }
  HostTensors host;
  std::vector<shadowsync_source_tensor_t> tensors;
};

// One receiver and one sender on a loopback pair, the engine's stream, all through the C ABI.
struct Pair {
  explicit Pair(const shadowsync_receiver_config_t* rconfig = nullptr,
                const shadowsync_sender_config_t* sconfig = nullptr) {
    layout = make_layout();
    REQUIRE_OK(shadowsync_host_backend_create(&backend));
    REQUIRE_OK(shadowsync_stream_create(backend, 0, &engine));
    REQUIRE_OK(shadowsync_loopback_create(2, &loopback));
    shadowsync_transport_t t0 = nullptr;
    shadowsync_transport_t t1 = nullptr;
    REQUIRE_OK(shadowsync_loopback_transport(loopback, 0, &t0));
    REQUIRE_OK(shadowsync_loopback_transport(loopback, 1, &t1));
    REQUIRE_OK(shadowsync_receiver_create(layout, backend, t1, rconfig, &receiver));
    REQUIRE_OK(shadowsync_sender_create(layout, backend, t0, sconfig, &sender));
  }
  ~Pair() {
    shadowsync_receiver_destroy(receiver);
    shadowsync_sender_destroy(sender);
    shadowsync_stream_destroy(engine);
    shadowsync_loopback_destroy(loopback);
    shadowsync_backend_destroy(backend);
    shadowsync_layout_destroy(layout);
  }
  std::vector<std::byte> header_bytes(shadowsync_publish_t publish) const {
    std::vector<std::byte> bytes(SHADOWSYNC_MAX_HEADER_BYTES);
    size_t written = 0;
    REQUIRE_OK(shadowsync_publish_header_bytes(publish, bytes.data(), bytes.size(), &written));
    bytes.resize(written);
    return bytes;
  }
  shadowsync_layout_t layout = nullptr;
  shadowsync_backend_t backend = nullptr;
  shadowsync_stream_t engine = nullptr;
  shadowsync_loopback_t loopback = nullptr;
  shadowsync_receiver_t receiver = nullptr;
  shadowsync_sender_t sender = nullptr;
};

// Every live byte of a group decodes to `version` under the oracle's pattern.
bool live_group_is(const Layout& layout, shadowsync_receiver_t receiver, std::size_t group,
                   std::uint64_t version) {
  const auto& g = layout.groups()[group];
  for (std::size_t t = 0; t < g.tensors().size(); ++t) {
    void* data = nullptr;
    REQUIRE_OK(shadowsync_receiver_live_tensor(receiver, group, t, &data));
    const std::size_t bytes = g.tensors()[t].bytes;
    for (std::size_t word = 0; word < (bytes + 7) / 8; ++word) {
      if (read_version(static_cast<const std::byte*>(data), bytes, group, t, word, version) !=
          version) {
        return false;
      }
    }
  }
  return true;
}

}  // namespace

TEST_CASE("C ABI: every status has a string, unknown ones too") {
  for (int s = 0; s <= SHADOWSYNC_NUM_RESULTS + 1; ++s) {
    const char* text = shadowsync_get_error_string(static_cast<shadowsync_status_t>(s));
    REQUIRE(text != nullptr);
    CHECK(std::strlen(text) > 0);
  }
  CHECK_THAT(shadowsync_get_error_string(SHADOWSYNC_TRANSPORT_ERROR),
             Catch::Contains("NCCL_DEBUG=INFO"));
  CHECK_THAT(shadowsync_get_error_string(SHADOWSYNC_NUM_RESULTS), Catch::Contains("unknown"));
  CHECK(shadowsync_get_c_api_version() == SHADOWSYNC_C_API_VERSION);
  const char* canonical = nullptr;
  size_t bytes = 0;
  REQUIRE_OK(shadowsync_dtype_info("torch.bfloat16", &canonical, &bytes));
  CHECK(std::string(canonical) == "bf16");
  CHECK(bytes == 2);
  CHECK(shadowsync_dtype_info("complex64", &canonical, &bytes) == SHADOWSYNC_INVALID_ARGUMENT);
  CHECK_THAT(last_error(), Catch::Contains("shadowsync_dtype_info: unsupported dtype 'complex64'"));
}

TEST_CASE("C ABI: NULL, destroyed, foreign and wrong-kind handles are refused, never followed") {
  shadowsync_layout_t layout = make_layout();
  REQUIRE_OK(shadowsync_layout_destroy(layout));
  uint64_t fingerprint = 0;
  CHECK(shadowsync_layout_fingerprint(layout, &fingerprint) == SHADOWSYNC_INVALID_HANDLE);
  CHECK_THAT(last_error(), Catch::Contains("is not a live shadowsync_layout_t"));
  CHECK(shadowsync_layout_destroy(layout) == SHADOWSYNC_INVALID_HANDLE);

  shadowsync_backend_t backend = nullptr;
  REQUIRE_OK(shadowsync_host_backend_create(&backend));
  // A backend handle where a receiver is expected.
  CHECK(shadowsync_receiver_drain(reinterpret_cast<shadowsync_receiver_t>(backend)) ==
        SHADOWSYNC_INVALID_HANDLE);
  CHECK_THAT(last_error(),
             Catch::Contains("is a shadowsync_backend_t, not a shadowsync_receiver_t"));
  // Addresses that were never handles: a heap pointer and a small integer.
  auto heap = std::make_unique<int>(7);
  CHECK(shadowsync_receiver_drain(reinterpret_cast<shadowsync_receiver_t>(heap.get())) ==
        SHADOWSYNC_INVALID_HANDLE);
  CHECK(shadowsync_sender_destroy(reinterpret_cast<shadowsync_sender_t>(std::uintptr_t{16})) ==
        SHADOWSYNC_INVALID_HANDLE);
  REQUIRE_OK(shadowsync_backend_destroy(backend));

  // Every entry point that takes a handle, with NULL, and valid outputs otherwise.
  uint64_t u64 = 0;
  size_t size = 0;
  int flag = 0;
  void* pointer = nullptr;
  const char* text = nullptr;
  shadowsync_group_info_t group_info{};
  shadowsync_tensor_info_t tensor_info{};
  shadowsync_update_header_t header = SHADOWSYNC_UPDATE_HEADER_INITIALIZER;
  shadowsync_receiver_stats_t stats = SHADOWSYNC_RECEIVER_STATS_INITIALIZER;
  shadowsync_stream_t stream = nullptr;
  shadowsync_transport_t transport = nullptr;
  shadowsync_receiver_t receiver = nullptr;
  shadowsync_sender_t sender = nullptr;
  shadowsync_publish_t publish = nullptr;
  char buffer[64];
  const std::vector<std::pair<const char*, std::function<shadowsync_status_t()>>> calls = {
      {"layout_fingerprint", [&] { return shadowsync_layout_fingerprint(nullptr, &u64); }},
      {"layout_group_count", [&] { return shadowsync_layout_group_count(nullptr, &size); }},
      {"layout_group_info", [&] { return shadowsync_layout_group_info(nullptr, 0, &group_info); }},
      {"layout_tensor_info",
       [&] { return shadowsync_layout_tensor_info(nullptr, 0, 0, &tensor_info); }},
      {"layout_find_tensor",
       [&] { return shadowsync_layout_find_tensor(nullptr, "w", &size, &size); }},
      {"layout_find_group", [&] { return shadowsync_layout_find_group(nullptr, "base", &size); }},
      {"backend_destroy", [&] { return shadowsync_backend_destroy(nullptr); }},
      {"backend_name", [&] { return shadowsync_backend_name(nullptr, &text); }},
      {"stream_create", [&] { return shadowsync_stream_create(nullptr, 0, &stream); }},
      {"stream_wrap_cuda", [&] { return shadowsync_stream_wrap_cuda(nullptr, nullptr, &stream); }},
      {"stream_synchronize", [&] { return shadowsync_stream_synchronize(nullptr); }},
      {"stream_destroy", [&] { return shadowsync_stream_destroy(nullptr); }},
      {"loopback_transport",
       [&] { return shadowsync_loopback_transport(nullptr, 0, &transport); }},
      {"testing_loopback_inject_delay",
       [&] { return shadowsync_testing_loopback_inject_delay(nullptr, 0, 0, 1); }},
      {"testing_loopback_inject_drop",
       [&] { return shadowsync_testing_loopback_inject_drop(nullptr, 0, 0); }},
      {"testing_loopback_inject_flip",
       [&] { return shadowsync_testing_loopback_inject_flip(nullptr, 0, 0, 0); }},
      {"loopback_destroy", [&] { return shadowsync_loopback_destroy(nullptr); }},
      {"transport_destroy", [&] { return shadowsync_transport_destroy(nullptr); }},
      {"receiver_create",
       [&] { return shadowsync_receiver_create(nullptr, nullptr, nullptr, nullptr, &receiver); }},
      {"receiver_destroy", [&] { return shadowsync_receiver_destroy(nullptr); }},
      {"receiver_begin_update", [&] { return shadowsync_receiver_begin_update(nullptr, &header); }},
      {"receiver_begin_update_bytes",
       [&] { return shadowsync_receiver_begin_update_bytes(nullptr, buffer, 8); }},
      {"receiver_abort_update", [&] { return shadowsync_receiver_abort_update(nullptr); }},
      {"receiver_replace_transport",
       [&] { return shadowsync_receiver_replace_transport(nullptr, nullptr); }},
      {"receiver_drain", [&] { return shadowsync_receiver_drain(nullptr); }},
      {"receiver_before_step", [&] { return shadowsync_receiver_before_step(nullptr, nullptr, &u64); }},
      {"receiver_apply_pending_now",
       [&] { return shadowsync_receiver_apply_pending_now(nullptr, nullptr, &u64); }},
      {"receiver_after_launch",
       [&] { return shadowsync_receiver_after_launch(nullptr, nullptr, &u64); }},
      {"receiver_wait_applied",
       [&] { return shadowsync_receiver_wait_applied(nullptr, 1, 0, nullptr); }},
      {"receiver_applied_version", [&] { return shadowsync_receiver_applied_version(nullptr, &u64); }},
      {"receiver_live_tensor", [&] { return shadowsync_receiver_live_tensor(nullptr, 0, 0, &pointer); }},
      {"receiver_live_tensor_by_name",
       [&] { return shadowsync_receiver_live_tensor_by_name(nullptr, "w", &pointer); }},
      {"receiver_live_arena", [&] { return shadowsync_receiver_live_arena(nullptr, 0, &pointer); }},
      {"receiver_live_content_version",
       [&] { return shadowsync_receiver_live_content_version(nullptr, 0, &u64); }},
      {"receiver_set_swap_callback",
       [&] { return shadowsync_receiver_set_swap_callback(nullptr, nullptr, nullptr); }},
      {"receiver_stats", [&] { return shadowsync_receiver_stats(nullptr, &stats); }},
      {"receiver_last_update_error",
       [&] { return shadowsync_receiver_last_update_error(nullptr, buffer, sizeof buffer, &size); }},
      {"sender_create",
       [&] { return shadowsync_sender_create(nullptr, nullptr, nullptr, nullptr, &sender); }},
      {"sender_destroy", [&] { return shadowsync_sender_destroy(nullptr); }},
      {"sender_replace_transport",
       [&] { return shadowsync_sender_replace_transport(nullptr, nullptr); }},
      {"sender_publish",
       [&] { return shadowsync_sender_publish(nullptr, 1, nullptr, 0, nullptr, 0, &publish); }},
      {"sender_publish_streamed",
       [&] { return shadowsync_sender_publish_streamed(nullptr, 1, nullptr, 0, &publish); }},
      {"publish_supply", [&] { return shadowsync_publish_supply(nullptr, nullptr, 0); }},
      {"publish_next_tensor",
       [&] { return shadowsync_publish_next_tensor(nullptr, &size, &size, &size); }},
      {"publish_header", [&] { return shadowsync_publish_header(nullptr, &header); }},
      {"publish_header_bytes",
       [&] { return shadowsync_publish_header_bytes(nullptr, buffer, sizeof buffer, &size); }},
      {"publish_wait", [&] { return shadowsync_publish_wait(nullptr, 0); }},
      {"publish_done", [&] { return shadowsync_publish_done(nullptr, &flag); }},
      {"publish_destroy", [&] { return shadowsync_publish_destroy(nullptr); }},
  };
  for (const auto& [name, call] : calls) {
    INFO(name << ": " << shadowsync_get_last_error());
    CHECK(call() == SHADOWSYNC_INVALID_HANDLE);
    // Its own message, naming the function (a leftover from the previous call would not).
    CHECK_THAT(last_error(), Catch::StartsWith(std::string("shadowsync_") + name + ":") &&
                                 Catch::Contains("NULL shadowsync_"));
  }
}

TEST_CASE("C ABI: config structs are copied by size; an uninitialized one is refused") {
  shadowsync_layout_t layout = make_layout();
  shadowsync_backend_t backend = nullptr;
  REQUIRE_OK(shadowsync_host_backend_create(&backend));
  shadowsync_loopback_t loopback = nullptr;
  REQUIRE_OK(shadowsync_loopback_create(2, &loopback));
  shadowsync_transport_t transport = nullptr;
  REQUIRE_OK(shadowsync_loopback_transport(loopback, 1, &transport));
  shadowsync_receiver_t receiver = nullptr;

  SECTION("stack garbage: refused by its magic, the transport stays the caller's") {
    shadowsync_receiver_config_t garbage;
    std::memset(&garbage, 0xa5, sizeof garbage);
    CHECK(shadowsync_receiver_create(layout, backend, transport, &garbage, &receiver) ==
          SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(),
               Catch::Contains("shadowsync_receiver_config_t: magic 0xa5a5a5a5 is not "
                               "SHADOWSYNC_CONFIG_MAGIC") &&
                   Catch::Contains("_INITIALIZER"));
  }
  SECTION("a size smaller than the size/magic/version header") {
    shadowsync_receiver_config_t config = SHADOWSYNC_RECEIVER_CONFIG_INITIALIZER;
    config.size = 4;
    CHECK(shadowsync_receiver_create(layout, backend, transport, &config, &receiver) ==
          SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("size 4 is smaller"));
  }
  SECTION("a value the receiver refuses is named") {
    shadowsync_receiver_config_t config = SHADOWSYNC_RECEIVER_CONFIG_INITIALIZER;
    config.poll_interval_us = 0;
    CHECK(shadowsync_receiver_create(layout, backend, transport, &config, &receiver) ==
          SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(),
               Catch::Contains("ReceiverConfig::poll_interval (us) must be positive, got 0"));
  }
  SECTION("an older caller's smaller struct: the fields it lacks take defaults") {
    shadowsync_receiver_config_t config = SHADOWSYNC_RECEIVER_CONFIG_INITIALIZER;
    config.root_rank = 0;
    config.update_deadline_ms = 0;  // beyond the old size: must not be read
    config.size = offsetof(shadowsync_receiver_config_t, update_deadline_ms);
    REQUIRE_OK(shadowsync_receiver_create(layout, backend, transport, &config, &receiver));
    REQUIRE_OK(shadowsync_receiver_destroy(receiver));
    // The transport was taken.
    CHECK(shadowsync_transport_destroy(transport) == SHADOWSYNC_INVALID_HANDLE);
    transport = nullptr;
  }
  SECTION("swap_strategy: a value outside the enum is named") {
    shadowsync_receiver_config_t config = SHADOWSYNC_RECEIVER_CONFIG_INITIALIZER;
    config.swap_strategy = 7;
    CHECK(shadowsync_receiver_create(layout, backend, transport, &config, &receiver) ==
          SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("swap_strategy 7 is not a shadowsync_swap_strategy_t"));
    config.swap_strategy = SHADOWSYNC_SWAP_COPY_IN;
    config.engine_uses_cuda_graphs = 2;
    CHECK(shadowsync_receiver_create(layout, backend, transport, &config, &receiver) ==
          SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("engine_uses_cuda_graphs is 2, expected 0 or 1"));
  }
  SECTION("rebind with CUDA graphs declared is refused, naming both settings") {
    shadowsync_receiver_config_t config = SHADOWSYNC_RECEIVER_CONFIG_INITIALIZER;
    config.engine_uses_cuda_graphs = 1;  // swap_strategy left at its default, rebind
    CHECK(shadowsync_receiver_create(layout, backend, transport, &config, &receiver) ==
          SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("swap_strategy is rebind") &&
                                 Catch::Contains("engine_uses_cuda_graphs is true"));
  }
  SECTION("remap on the host backend is refused, suggesting copy_in") {
    shadowsync_receiver_config_t config = SHADOWSYNC_RECEIVER_CONFIG_INITIALIZER;
    config.swap_strategy = SHADOWSYNC_SWAP_REMAP;
    CHECK(shadowsync_receiver_create(layout, backend, transport, &config, &receiver) ==
          SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("swap_strategy is remap, but backend 'host'") &&
                                 Catch::Contains("copy_in"));
  }
  SECTION("a caller built before swap_strategy existed gets rebind, its default") {
    shadowsync_receiver_config_t config = SHADOWSYNC_RECEIVER_CONFIG_INITIALIZER;
    config.root_rank = 0;
    config.swap_strategy = SHADOWSYNC_SWAP_REMAP;  // beyond the old size: must not be read
    config.engine_uses_cuda_graphs = 1;
    config.size = offsetof(shadowsync_receiver_config_t, swap_strategy);
    REQUIRE_OK(shadowsync_receiver_create(layout, backend, transport, &config, &receiver));
    REQUIRE_OK(shadowsync_receiver_destroy(receiver));
    transport = nullptr;  // taken
  }
  SECTION("a decode_slowdown_budget the receiver refuses is named with its value") {
    const std::pair<double, const char*> bad[] = {
        {std::numeric_limits<double>::quiet_NaN(), "is nan"},
        {0.5, "is 0.5"},
        {-1.0, "is -1"},
        {std::numeric_limits<double>::infinity(), "is inf"}};
    for (const auto& [budget, shown] : bad) {
      shadowsync_receiver_config_t config = SHADOWSYNC_RECEIVER_CONFIG_INITIALIZER;
      config.decode_slowdown_budget = budget;
      CHECK(shadowsync_receiver_create(layout, backend, transport, &config, &receiver) ==
            SHADOWSYNC_INVALID_ARGUMENT);
      CHECK_THAT(last_error(), Catch::Contains("ReceiverConfig::decode_slowdown_budget") &&
                                   Catch::Contains(shown) && Catch::Contains("at least 1.0"));
      CHECK(receiver == nullptr);  // nothing was created
    }
  }
  SECTION("gated_swaps is refused without swap_strategy remap, naming both") {
    shadowsync_receiver_config_t config = SHADOWSYNC_RECEIVER_CONFIG_INITIALIZER;
    config.gated_swaps = 1;
    CHECK(shadowsync_receiver_create(layout, backend, transport, &config, &receiver) ==
          SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("ReceiverConfig::gated_swaps is set, but "
                                             "ReceiverConfig::swap_strategy is rebind"));
    CHECK(receiver == nullptr);
    config.gated_swaps = 2;
    CHECK(shadowsync_receiver_create(layout, backend, transport, &config, &receiver) ==
          SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("gated_swaps"));
  }
  SECTION("a caller built before the pacing fields existed gets no pacing") {
    shadowsync_receiver_config_t config = SHADOWSYNC_RECEIVER_CONFIG_INITIALIZER;
    config.decode_slowdown_budget = 0.5;  // beyond the old size: must not be read
    config.max_receive_bytes_per_second = 1;
    config.size = offsetof(shadowsync_receiver_config_t, decode_slowdown_budget);
    REQUIRE_OK(shadowsync_receiver_create(layout, backend, transport, &config, &receiver));
    REQUIRE_OK(shadowsync_receiver_destroy(receiver));
    transport = nullptr;  // taken
  }
  if (transport != nullptr) {
    // Every refusal above left the transport with the caller: it can still be destroyed.
    REQUIRE_OK(shadowsync_transport_destroy(transport));
  }
  REQUIRE_OK(shadowsync_loopback_destroy(loopback));
  REQUIRE_OK(shadowsync_backend_destroy(backend));
  REQUIRE_OK(shadowsync_layout_destroy(layout));
}

TEST_CASE("C ABI: layout queries and header bytes") {
  shadowsync_layout_t layout = make_layout();
  const Layout reference = cpp_layout();
  uint64_t fingerprint = 0;
  REQUIRE_OK(shadowsync_layout_fingerprint(layout, &fingerprint));
  CHECK(fingerprint == reference.fingerprint());
  size_t groups = 0;
  REQUIRE_OK(shadowsync_layout_group_count(layout, &groups));
  CHECK(groups == 2);
  shadowsync_group_info_t info{};
  REQUIRE_OK(shadowsync_layout_group_info(layout, 1, &info));
  CHECK(std::string(info.name) == "lora");
  CHECK(info.tensor_count == 1);
  CHECK(info.bucket_count == reference.groups()[1].bucket_count());
  shadowsync_tensor_info_t tensor{};
  REQUIRE_OK(shadowsync_layout_tensor_info(layout, 0, 1, &tensor));
  CHECK(std::string(tensor.name) == "w");
  CHECK(std::string(tensor.dtype) == "fp32");
  CHECK(tensor.ndim == 1);
  CHECK(tensor.shape[0] == 257);
  CHECK(tensor.offset == reference.groups()[0].tensors()[1].offset);
  CHECK(shadowsync_layout_tensor_info(layout, 0, 4, &tensor) == SHADOWSYNC_INVALID_ARGUMENT);
  CHECK_THAT(last_error(), Catch::Contains("tensor index 4 out of range (group 'base' has 3"));
  size_t g = 9;
  size_t t = 9;
  REQUIRE_OK(shadowsync_layout_find_tensor(layout, "lora.A", &g, &t));
  CHECK((g == 1 && t == 0));
  CHECK(shadowsync_layout_find_group(layout, "nope", &g) == SHADOWSYNC_INVALID_ARGUMENT);

  // A spec that Layout::build refuses, named.
  std::int64_t bad_shape[] = {4, 0};
  shadowsync_tensor_spec_t bad = {"x", "bf16", bad_shape, 2, nullptr};
  shadowsync_layout_t refused = nullptr;
  CHECK(shadowsync_layout_create(&bad, 1, 0, &refused) == SHADOWSYNC_INVALID_ARGUMENT);
  CHECK_THAT(last_error(), Catch::Contains("'x'"));
  bad.dtype = "complex";
  CHECK(shadowsync_layout_create(&bad, 1, 0, &refused) == SHADOWSYNC_INVALID_ARGUMENT);
  CHECK_THAT(last_error(), Catch::Contains("tensor 'x': unsupported dtype 'complex'"));
  bad.dtype = nullptr;
  CHECK(shadowsync_layout_create(&bad, 1, 0, &refused) == SHADOWSYNC_INVALID_ARGUMENT);
  CHECK_THAT(last_error(), Catch::Contains("'specs[0].dtype' is NULL"));

  // Header to bytes and back; too small a buffer says how much is needed.
  shadowsync_update_header_t header = SHADOWSYNC_UPDATE_HEADER_INITIALIZER;
  const UpdateHeader made = make_update_header(reference, 3, {"base", "lora"});
  header.magic = made.magic;
  header.protocol_version = made.protocol_version;
  header.version = 3;
  header.layout_fingerprint = made.layout_fingerprint;
  header.group_count = 2;
  header.groups[0] = 0;
  header.groups[1] = 1;
  header.bucket_count = made.bucket_count;
  unsigned char small[8];
  size_t written = 0;
  CHECK(shadowsync_header_serialize(&header, small, sizeof small, &written) ==
        SHADOWSYNC_INVALID_ARGUMENT);
  CHECK(written == 44);
  std::vector<unsigned char> bytes(written);
  REQUIRE_OK(shadowsync_header_serialize(&header, bytes.data(), bytes.size(), &written));
  shadowsync_update_header_t back = SHADOWSYNC_UPDATE_HEADER_INITIALIZER;
  REQUIRE_OK(shadowsync_header_parse(bytes.data(), bytes.size(), &back));
  CHECK(std::memcmp(&back, &header, sizeof header) == 0);
  CHECK(shadowsync_header_parse(bytes.data(), bytes.size() - 3, &back) == SHADOWSYNC_BAD_HEADER);
  CHECK(shadowsync_header_parse(nullptr, 0, &back) == SHADOWSYNC_BAD_HEADER);
  header.group_count = SHADOWSYNC_MAX_HEADER_GROUPS + 1;
  CHECK(shadowsync_header_serialize(&header, bytes.data(), bytes.size(), &written) ==
        SHADOWSYNC_BAD_HEADER);
  REQUIRE_OK(shadowsync_layout_destroy(layout));
}

TEST_CASE("C ABI: the update header struct is versioned like the config structs") {
  Specs s;
  shadowsync_layout_t layout = nullptr;
  REQUIRE_OK(shadowsync_layout_create(s.specs.data(), s.specs.size(), 1024, &layout));
  const UpdateHeader made = make_update_header(cpp_layout(), 4, {"base"});
  const std::vector<std::byte> wire = serialize_update_header(made);

  SECTION("the initializer") {
    const shadowsync_update_header_t header = SHADOWSYNC_UPDATE_HEADER_INITIALIZER;
    CHECK(header.size == sizeof(shadowsync_update_header_t));
    CHECK(header.struct_magic == SHADOWSYNC_CONFIG_MAGIC);
    CHECK(header.struct_version == SHADOWSYNC_UPDATE_HEADER_STRUCT_VERSION);
    CHECK(header.group_count == 0);
  }
  SECTION("an uninitialized struct is refused for reading and for writing") {
    shadowsync_update_header_t garbage;
    std::memset(&garbage, 0x5a, sizeof garbage);
    CHECK(shadowsync_header_parse(wire.data(), wire.size(), &garbage) ==
          SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("SHADOWSYNC_UPDATE_HEADER_INITIALIZER"));
    std::byte bytes[SHADOWSYNC_MAX_HEADER_BYTES];
    size_t written = 0;
    CHECK(shadowsync_header_serialize(&garbage, bytes, sizeof bytes, &written) ==
          SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("struct_magic"));
  }
  SECTION("a size below struct version 1, or struct_version 0, is refused") {
    shadowsync_update_header_t header = SHADOWSYNC_UPDATE_HEADER_INITIALIZER;
    header.size = offsetof(shadowsync_update_header_t, bucket_count);
    CHECK(shadowsync_header_parse(wire.data(), wire.size(), &header) ==
          SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("smaller than struct version 1"));
    header.size = sizeof header;
    header.struct_version = 0;
    CHECK(shadowsync_header_parse(wire.data(), wire.size(), &header) ==
          SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("struct_version 0"));
  }
  SECTION("a newer caller's larger struct: its tail and its prefix are left alone") {
    struct Newer {
      shadowsync_update_header_t header;
      std::uint64_t appended;
    } newer;
    std::memset(&newer, 0x5a, sizeof newer);
    newer.header.size = sizeof newer;
    newer.header.struct_magic = SHADOWSYNC_CONFIG_MAGIC;
    newer.header.struct_version = SHADOWSYNC_UPDATE_HEADER_STRUCT_VERSION + 1;
    REQUIRE_OK(shadowsync_header_parse(wire.data(), wire.size(), &newer.header));
    CHECK(newer.header.size == sizeof newer);
    CHECK(newer.header.struct_version == SHADOWSYNC_UPDATE_HEADER_STRUCT_VERSION + 1);
    CHECK(newer.header.version == 4);
    CHECK(newer.header.group_count == 1);
    CHECK(newer.appended == 0x5a5a5a5a5a5a5a5aull);
    std::byte bytes[SHADOWSYNC_MAX_HEADER_BYTES];
    size_t written = 0;
    REQUIRE_OK(shadowsync_header_serialize(&newer.header, bytes, sizeof bytes, &written));
    CHECK(std::vector<std::byte>(bytes, bytes + written) == wire);
  }
  REQUIRE_OK(shadowsync_layout_destroy(layout));
}

TEST_CASE("C ABI: copy_in keeps the live arenas where they are across updates") {
  shadowsync_receiver_config_t rconfig = SHADOWSYNC_RECEIVER_CONFIG_INITIALIZER;
  rconfig.swap_strategy = SHADOWSYNC_SWAP_COPY_IN;
  rconfig.engine_uses_cuda_graphs = 1;
  Pair pair(&rconfig);
  const Layout layout = cpp_layout();
  void* live_before[2] = {nullptr, nullptr};
  for (size_t g = 0; g < 2; ++g) {
    REQUIRE_OK(shadowsync_receiver_live_arena(pair.receiver, g, &live_before[g]));
  }
  for (std::uint64_t v = 1; v <= 3; ++v) {
    CTensors tensors(layout, {"base", "lora"}, v);
    const char* groups[] = {"base", "lora"};
    shadowsync_publish_t publish = nullptr;
    REQUIRE_OK(shadowsync_sender_publish(pair.sender, v, groups, 2, tensors.tensors.data(),
                                         tensors.tensors.size(), &publish));
    const auto bytes = pair.header_bytes(publish);
    REQUIRE_OK(shadowsync_receiver_begin_update_bytes(pair.receiver, bytes.data(), bytes.size()));
    REQUIRE_OK(shadowsync_publish_wait(publish, 20000));
    REQUIRE_OK(shadowsync_publish_destroy(publish));
    REQUIRE_OK(shadowsync_receiver_wait_applied(pair.receiver, v, 20000, pair.engine));
    REQUIRE_OK(shadowsync_stream_synchronize(pair.engine));  // the copy runs on the engine stream
    for (size_t g = 0; g < 2; ++g) {
      void* live = nullptr;
      REQUIRE_OK(shadowsync_receiver_live_arena(pair.receiver, g, &live));
      CHECK(live == live_before[g]);
      CHECK(live_group_is(layout, pair.receiver, g, v));
    }
  }
}

TEST_CASE("C ABI: an update end to end, with the swap callback and stats") {
  shadowsync_receiver_config_t rconfig = SHADOWSYNC_RECEIVER_CONFIG_INITIALIZER;
  rconfig.update_deadline_ms = 20000;
  Pair pair(&rconfig);
  const Layout layout = cpp_layout();

  struct Seen {
    std::uint64_t version = 0;
    std::vector<std::size_t> groups;
  } seen;
  REQUIRE_OK(shadowsync_receiver_set_swap_callback(
      pair.receiver,
      [](void* user, uint64_t version, const shadowsync_group_swap_t* swaps, size_t count) {
        auto* s = static_cast<Seen*>(user);
        s->version = version;
        for (size_t i = 0; i < count; ++i) s->groups.push_back(swaps[i].group);
      },
      &seen));

  CTensors v1(layout, {"base", "lora"}, 1);
  const char* groups[] = {"base", "lora"};
  shadowsync_publish_t publish = nullptr;
  REQUIRE_OK(shadowsync_sender_publish(pair.sender, 1, groups, 2, v1.tensors.data(),
                                       v1.tensors.size(), &publish));
  const auto bytes = pair.header_bytes(publish);
  REQUIRE_OK(shadowsync_receiver_begin_update_bytes(pair.receiver, bytes.data(), bytes.size()));
  REQUIRE_OK(shadowsync_publish_wait(publish, 20000));
  int done = 0;
  REQUIRE_OK(shadowsync_publish_done(publish, &done));
  CHECK(done == 1);
  REQUIRE_OK(shadowsync_publish_destroy(publish));

  // The same header again: stale now.
  CHECK(shadowsync_receiver_begin_update_bytes(pair.receiver, bytes.data(), bytes.size()) ==
        SHADOWSYNC_STALE_VERSION);
  CHECK_THAT(last_error(), Catch::Contains("shadowsync_receiver_begin_update_bytes: update 1"));
  // Garbage bytes: a bad header, nothing queued.
  const unsigned char garbage[40] = {1, 2, 3};
  CHECK(shadowsync_receiver_begin_update_bytes(pair.receiver, garbage, sizeof garbage) ==
        SHADOWSYNC_BAD_HEADER);

  REQUIRE_OK(shadowsync_receiver_wait_applied(pair.receiver, 1, 20000, pair.engine));
  CHECK(seen.version == 1);
  CHECK(seen.groups == std::vector<std::size_t>{0, 1});
  CHECK(live_group_is(layout, pair.receiver, 0, 1));
  CHECK(live_group_is(layout, pair.receiver, 1, 1));
  void* by_name = nullptr;
  void* by_index = nullptr;
  REQUIRE_OK(shadowsync_receiver_live_tensor_by_name(pair.receiver, "lora.A", &by_name));
  REQUIRE_OK(shadowsync_receiver_live_tensor(pair.receiver, 1, 0, &by_index));
  CHECK(by_name == by_index);
  CHECK(shadowsync_receiver_live_tensor_by_name(pair.receiver, "ghost", &by_name) ==
        SHADOWSYNC_INVALID_ARGUMENT);
  uint64_t content = 0;
  REQUIRE_OK(shadowsync_receiver_live_content_version(pair.receiver, 1, &content));
  CHECK(content == 1);

  shadowsync_receiver_stats_t stats = SHADOWSYNC_RECEIVER_STATS_INITIALIZER;
  REQUIRE_OK(shadowsync_receiver_stats(pair.receiver, &stats));
  CHECK(stats.updates_ready == 1);
  CHECK(stats.applied_version == 1);
  CHECK(stats.last_accepted_version == 1);
  CHECK(stats.has_pending == 0);
  // An older caller's smaller stats struct gets only what fits.
  shadowsync_receiver_stats_t old{};
  old.size = offsetof(shadowsync_receiver_stats_t, updates_failed);
  old.updates_failed = 77;
  REQUIRE_OK(shadowsync_receiver_stats(pair.receiver, &old));
  CHECK(old.updates_ready == 1);
  CHECK(old.updates_failed == 77);
  shadowsync_receiver_stats_t unset{};
  CHECK(shadowsync_receiver_stats(pair.receiver, &unset) == SHADOWSYNC_INVALID_ARGUMENT);

  // wait_applied for a version nobody sends: a timeout, with the detail.
  CHECK(shadowsync_receiver_wait_applied(pair.receiver, 2, 20, pair.engine) == SHADOWSYNC_TIMEOUT);
  CHECK_THAT(last_error(), Catch::Contains("version 2 not applied within 20 ms (applied: 1"));

  // A stream of another backend is refused by the step hook.
  shadowsync_backend_t other = nullptr;
  shadowsync_stream_t foreign = nullptr;
  REQUIRE_OK(shadowsync_host_backend_create(&other));
  REQUIRE_OK(shadowsync_stream_create(other, 0, &foreign));
  uint64_t applied = 0;
  CHECK(shadowsync_receiver_before_step(pair.receiver, foreign, &applied) ==
        SHADOWSYNC_INVALID_ARGUMENT);
  CHECK_THAT(last_error(), Catch::Contains("belongs to another backend"));
  REQUIRE_OK(shadowsync_stream_destroy(foreign));
  REQUIRE_OK(shadowsync_backend_destroy(other));
  // A CUDA stream cannot be wrapped by a host backend.
  shadowsync_stream_t wrapped = nullptr;
  CHECK(shadowsync_stream_wrap_cuda(pair.backend, nullptr, &wrapped) == SHADOWSYNC_NOT_SUPPORTED);
}

TEST_CASE("C ABI: a streamed publish supplies tensors in layout order") {
  Pair pair;
  const Layout layout = cpp_layout();
  CTensors v1(layout, {"base"}, 1);
  const char* groups[] = {"base"};
  shadowsync_publish_t publish = nullptr;
  REQUIRE_OK(shadowsync_sender_publish_streamed(pair.sender, 1, groups, 1, &publish));
  const auto bytes = pair.header_bytes(publish);
  REQUIRE_OK(shadowsync_receiver_begin_update_bytes(pair.receiver, bytes.data(), bytes.size()));
  size_t group = 9;
  size_t tensor = 9;
  size_t remaining = 0;
  REQUIRE_OK(shadowsync_publish_next_tensor(publish, &group, &tensor, &remaining));
  CHECK((group == 0 && tensor == 0 && remaining == 3));
  CHECK(shadowsync_publish_wait(publish, 0) == SHADOWSYNC_IN_PROGRESS);
  // Out of order: refused, nothing consumed.
  CHECK(shadowsync_publish_supply(publish, &v1.tensors[1], 1) == SHADOWSYNC_INVALID_ARGUMENT);
  CHECK_THAT(last_error(), Catch::Contains("tensor 'w' supplied where 'embed'"));
  REQUIRE_OK(shadowsync_publish_supply(publish, &v1.tensors[0], 1));
  REQUIRE_OK(shadowsync_publish_supply(publish, &v1.tensors[1], 2));
  REQUIRE_OK(shadowsync_publish_next_tensor(publish, &group, &tensor, &remaining));
  CHECK(remaining == 0);
  REQUIRE_OK(shadowsync_publish_wait(publish, 20000));
  REQUIRE_OK(shadowsync_receiver_wait_applied(pair.receiver, 1, 20000, pair.engine));
  CHECK(live_group_is(layout, pair.receiver, 0, 1));
  REQUIRE_OK(shadowsync_publish_destroy(publish));

  // A plain publish is not streamed.
  CTensors v2(layout, {"base"}, 2);
  REQUIRE_OK(shadowsync_sender_publish(pair.sender, 2, groups, 1, v2.tensors.data(),
                                       v2.tensors.size(), &publish));
  CHECK(shadowsync_publish_supply(publish, v2.tensors.data(), 1) == SHADOWSYNC_INVALID_ARGUMENT);
  CHECK_THAT(last_error(), Catch::Contains("not a streamed publish"));
  REQUIRE_OK(shadowsync_receiver_begin_update_bytes(pair.receiver, pair.header_bytes(publish).data(),
                                                    pair.header_bytes(publish).size()));
  REQUIRE_OK(shadowsync_publish_wait(publish, 20000));
  REQUIRE_OK(shadowsync_publish_destroy(publish));
}

TEST_CASE("C ABI: a failed update reports its status through publish_wait and the stats") {
  shadowsync_receiver_config_t rconfig = SHADOWSYNC_RECEIVER_CONFIG_INITIALIZER;
  rconfig.bucket_deadline_ms = 300;
  shadowsync_sender_config_t sconfig = SHADOWSYNC_SENDER_CONFIG_INITIALIZER;
  sconfig.update_deadline_ms = 300;
  Pair pair(&rconfig, &sconfig);
  const Layout layout = cpp_layout();
  // The receiver's rank dies at its first broadcast: the sender times out and aborts.
  REQUIRE_OK(shadowsync_testing_loopback_inject_drop(pair.loopback, 1, 0));
  CTensors v1(layout, {"base"}, 1);
  const char* groups[] = {"base"};
  shadowsync_publish_t publish = nullptr;
  REQUIRE_OK(shadowsync_sender_publish(pair.sender, 1, groups, 1, v1.tensors.data(),
                                       v1.tensors.size(), &publish));
  REQUIRE_OK(shadowsync_receiver_begin_update_bytes(pair.receiver, pair.header_bytes(publish).data(),
                                                    pair.header_bytes(publish).size()));
  CHECK(shadowsync_publish_wait(publish, 20000) == SHADOWSYNC_TRANSPORT_ERROR);
  CHECK_THAT(last_error(), Catch::Contains("shadowsync_publish_wait: update 1: send failed"));
  REQUIRE_OK(shadowsync_publish_destroy(publish));
  shadowsync_receiver_stats_t stats = SHADOWSYNC_RECEIVER_STATS_INITIALIZER;
  REQUIRE_OK(shadowsync_receiver_drain(pair.receiver));  // the receive has finished, failed
  REQUIRE_OK(shadowsync_receiver_stats(pair.receiver, &stats));
  CHECK(stats.updates_failed == 1);
  CHECK(stats.needs_transport == 1);
  char text[16];
  size_t length = 0;
  REQUIRE_OK(shadowsync_receiver_last_update_error(pair.receiver, text, sizeof text, &length));
  CHECK(length > sizeof text);
  CHECK(std::strlen(text) == sizeof text - 1);  // truncated, terminated
  uint64_t applied = 7;
  REQUIRE_OK(shadowsync_receiver_before_step(pair.receiver, pair.engine, &applied));
  CHECK(applied == 0);  // nothing reached the engine
}

namespace {

// Publishes `groups` of `tensors` at `version`, announces it and waits until it was sent (or
// failed: the status is returned).
shadowsync_status_t send_update(Pair& pair, std::uint64_t version,
                                const std::vector<const char*>& groups, CTensors& tensors) {
  shadowsync_publish_t publish = nullptr;
  REQUIRE_OK(shadowsync_sender_publish(pair.sender, version, groups.data(), groups.size(),
                                       tensors.tensors.data(), tensors.tensors.size(), &publish));
  const auto bytes = pair.header_bytes(publish);
  REQUIRE_OK(shadowsync_receiver_begin_update_bytes(pair.receiver, bytes.data(), bytes.size()));
  const shadowsync_status_t status = shadowsync_publish_wait(publish, 20000);
  REQUIRE_OK(shadowsync_publish_destroy(publish));
  return status;
}

}  // namespace

TEST_CASE("C ABI test hooks: a byte flipped in transit fails the update at its checksum") {
  shadowsync_receiver_config_t rconfig = SHADOWSYNC_RECEIVER_CONFIG_INITIALIZER;
  rconfig.require_checksums = 1;
  Pair pair(&rconfig, nullptr);  // the sender sends checksums by default
  const Layout layout = cpp_layout();
  REQUIRE_OK(shadowsync_testing_loopback_inject_flip(pair.loopback, 1, 0, 100));
  CTensors v1(layout, {"base"}, 1);
  REQUIRE_OK(send_update(pair, 1, {"base"}, v1));  // every collective completed
  REQUIRE_OK(shadowsync_receiver_drain(pair.receiver));
  shadowsync_receiver_stats_t stats = SHADOWSYNC_RECEIVER_STATS_INITIALIZER;
  REQUIRE_OK(shadowsync_receiver_stats(pair.receiver, &stats));
  CHECK(stats.updates_failed == 1);
  CHECK(stats.last_failure_status == SHADOWSYNC_TRANSPORT_ERROR);
  CHECK(stats.last_failed_group == 0);
  CHECK(stats.last_failed_bucket == 0);
  CHECK(shadowsync_testing_loopback_inject_delay(pair.loopback, 0, 0, -1) ==
        SHADOWSYNC_INVALID_ARGUMENT);
  CHECK_THAT(last_error(), Catch::Contains("delay_us is negative"));
}

TEST_CASE("C ABI: destroying a receiver while the engine thread waits on it is safe") {
  Pair pair;
  std::atomic<shadowsync_status_t> result{SHADOWSYNC_NUM_RESULTS};
  std::atomic<bool> started{false};
  std::thread engine([&] {
    started = true;
    result = shadowsync_receiver_wait_applied(pair.receiver, 5, 300, pair.engine);
  });
  while (!started) std::this_thread::yield();
  REQUIRE_OK(shadowsync_receiver_destroy(pair.receiver));
  engine.join();
  // TIMEOUT when the wait began first (the object outlived the destroy), INVALID_HANDLE otherwise.
  CHECK((result == SHADOWSYNC_TIMEOUT || result == SHADOWSYNC_INVALID_HANDLE));
  CHECK(shadowsync_receiver_drain(pair.receiver) == SHADOWSYNC_INVALID_HANDLE);
}

TEST_CASE("C ABI: the CUDA entry points fail cleanly without CUDA or without a device") {
  shadowsync_backend_t backend = nullptr;
  const shadowsync_status_t status = shadowsync_cuda_backend_create(0, &backend);
  if (shadowsync_has_cuda() == 0) {
    CHECK(status == SHADOWSYNC_NOT_SUPPORTED);
    uint8_t id[SHADOWSYNC_NCCL_UNIQUE_ID_BYTES];
    CHECK(shadowsync_nccl_unique_id(id) == SHADOWSYNC_NOT_SUPPORTED);
    shadowsync_transport_t transport = nullptr;
    CHECK(shadowsync_nccl_transport_create(id, 0, 2, 0, nullptr, &transport) ==
          SHADOWSYNC_NOT_SUPPORTED);
  } else if (status == SHADOWSYNC_SUCCESS) {
    REQUIRE_OK(shadowsync_backend_destroy(backend));  // a GPU machine
  } else {
    CHECK((status == SHADOWSYNC_INVALID_ARGUMENT || status == SHADOWSYNC_BACKEND_ERROR));
  }
  CHECK(shadowsync_cuda_backend_create(-1, &backend) != SHADOWSYNC_SUCCESS);
}


TEST_CASE("C ABI: integrity flags, and where a refused update failed, through the stats") {
  const Layout layout = cpp_layout();
  SECTION("a flag that is neither 0 nor 1 is named") {
    shadowsync_receiver_config_t rconfig = SHADOWSYNC_RECEIVER_CONFIG_INITIALIZER;
    rconfig.reject_nonfinite = 2;
    shadowsync_backend_t backend = nullptr;
    REQUIRE_OK(shadowsync_host_backend_create(&backend));
    shadowsync_layout_t c_layout = make_layout();
    shadowsync_receiver_t receiver = nullptr;
    CHECK(shadowsync_receiver_create(c_layout, backend, nullptr, &rconfig, &receiver) ==
          SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("shadowsync_receiver_config_t: reject_nonfinite is 2, "
                                             "expected 0 or 1"));
    rconfig.reject_nonfinite = SHADOWSYNC_CONFIG_UNDEF_INT;
    rconfig.abort_deadline_ms = 0;
    CHECK(shadowsync_receiver_create(c_layout, backend, nullptr, &rconfig, &receiver) ==
          SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("ReceiverConfig::abort_deadline (ms) must be "
                                             "positive, got 0"));
    shadowsync_sender_config_t sconfig = SHADOWSYNC_SENDER_CONFIG_INITIALIZER;
    sconfig.checksums = -1;
    shadowsync_sender_t sender = nullptr;
    CHECK(shadowsync_sender_create(c_layout, backend, nullptr, &sconfig, &sender) ==
          SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("checksums is -1, expected 0 or 1"));
    REQUIRE_OK(shadowsync_layout_destroy(c_layout));
    REQUIRE_OK(shadowsync_backend_destroy(backend));
  }
  SECTION("require_checksums refuses a header without them; with them the update applies") {
    shadowsync_receiver_config_t rconfig = SHADOWSYNC_RECEIVER_CONFIG_INITIALIZER;
    rconfig.require_checksums = 1;
    shadowsync_sender_config_t quick = SHADOWSYNC_SENDER_CONFIG_INITIALIZER;
    quick.update_deadline_ms = 200;  // its update is never announced: let it fail soon
    quick.checksums = 0;             // on by default
    CTensors v1(layout, {"base"}, 1);  // first: it must outlive every sender that reads it
    Pair plain(&rconfig, &quick);
    const char* groups[] = {"base"};
    shadowsync_publish_t publish = nullptr;
    REQUIRE_OK(shadowsync_sender_publish(plain.sender, 1, groups, 1, v1.tensors.data(),
                                         v1.tensors.size(), &publish));
    const auto bytes = plain.header_bytes(publish);
    CHECK(shadowsync_receiver_begin_update_bytes(plain.receiver, bytes.data(), bytes.size()) ==
          SHADOWSYNC_BAD_HEADER);
    CHECK_THAT(last_error(), Catch::Contains("carries no checksums") &&
                                 Catch::Contains("require_checksums"));
    REQUIRE_OK(shadowsync_publish_destroy(publish));

    shadowsync_sender_config_t sconfig = SHADOWSYNC_SENDER_CONFIG_INITIALIZER;
    sconfig.checksums = 1;
    Pair summed(&rconfig, &sconfig);
    REQUIRE_OK(send_update(summed, 1, {"base"}, v1));
    REQUIRE_OK(shadowsync_receiver_wait_applied(summed.receiver, 1, 20000, summed.engine));
    CHECK(live_group_is(layout, summed.receiver, 0, 1));
    shadowsync_receiver_stats_t stats = SHADOWSYNC_RECEIVER_STATS_INITIALIZER;
    REQUIRE_OK(shadowsync_receiver_stats(summed.receiver, &stats));
    CHECK(stats.last_failed_version == 0);
    CHECK(stats.last_failure_status == SHADOWSYNC_SUCCESS);
    CHECK(stats.last_failed_group == -1);
    CHECK(stats.stuck_aborts == 0);
  }
  SECTION("reject_nonfinite: the group and tensor of a NaN are in the stats") {
    shadowsync_receiver_config_t rconfig = SHADOWSYNC_RECEIVER_CONFIG_INITIALIZER;
    rconfig.reject_nonfinite = 1;
    Pair pair(&rconfig);
    CTensors v1(layout, {"base"}, 1);
    // A NaN in "w" (fp32, tensor 1 of group "base").
    const std::uint32_t nan_bits = 0x7fc00000u;
    std::memcpy(const_cast<void*>(v1.tensors[1].data), &nan_bits, sizeof nan_bits);
    REQUIRE(std::string(v1.tensors[1].name) == "w");
    REQUIRE_OK(send_update(pair, 1, {"base"}, v1));  // sent fine: the receiver refuses it
    REQUIRE_OK(shadowsync_receiver_drain(pair.receiver));
    shadowsync_receiver_stats_t stats = SHADOWSYNC_RECEIVER_STATS_INITIALIZER;
    REQUIRE_OK(shadowsync_receiver_stats(pair.receiver, &stats));
    CHECK(stats.updates_failed == 1);
    CHECK(stats.last_failed_version == 1);
    CHECK(stats.last_failure_status == SHADOWSYNC_INVALID_ARGUMENT);
    CHECK(stats.last_failed_group == 0);
    CHECK(stats.last_failed_tensor == 1);
    CHECK(stats.last_failed_bucket == -1);
    CHECK(stats.needs_transport == 0);  // a refusal by a check leaves the transport alone
    // The next good update applies over the same transport.
    CTensors v2(layout, {"base"}, 2);
    REQUIRE_OK(send_update(pair, 2, {"base"}, v2));
    REQUIRE_OK(shadowsync_receiver_wait_applied(pair.receiver, 2, 20000, pair.engine));
    CHECK(live_group_is(layout, pair.receiver, 0, 2));
  }
}

TEST_CASE("C ABI: rollback flips back one level and says when it cannot") {
  Pair pair;
  const Layout layout = cpp_layout();
  uint64_t undone = 0;
  CHECK(shadowsync_receiver_rollback(pair.receiver, pair.engine, &undone) ==
        SHADOWSYNC_INVALID_ARGUMENT);
  CHECK_THAT(last_error(), Catch::Contains("shadowsync_receiver_rollback: rollback: no update has "
                                           "been applied yet"));
  for (std::uint64_t v = 1; v <= 2; ++v) {
    CTensors tensors(layout, {"base"}, v);
    REQUIRE_OK(send_update(pair, v, {"base"}, tensors));
    REQUIRE_OK(shadowsync_receiver_wait_applied(pair.receiver, v, 20000, pair.engine));
  }
  REQUIRE_OK(shadowsync_receiver_rollback(pair.receiver, pair.engine, &undone));
  CHECK(undone == 2);
  CHECK(live_group_is(layout, pair.receiver, 0, 1));
  uint64_t content = 0;
  REQUIRE_OK(shadowsync_receiver_live_content_version(pair.receiver, 0, &content));
  CHECK(content == 1);
  uint64_t applied = 0;
  REQUIRE_OK(shadowsync_receiver_applied_version(pair.receiver, &applied));
  CHECK(applied == 2);  // versions made live only increase
  CHECK(shadowsync_receiver_rollback(pair.receiver, pair.engine, nullptr) ==
        SHADOWSYNC_INVALID_ARGUMENT);
  CHECK_THAT(last_error(), Catch::Contains("already rolled back"));

  // Once the next update started receiving into the previous slot: superseded.
  CTensors v3(layout, {"base"}, 3);
  REQUIRE_OK(send_update(pair, 3, {"base"}, v3));
  REQUIRE_OK(shadowsync_receiver_wait_applied(pair.receiver, 3, 20000, pair.engine));
  CTensors v4(layout, {"base"}, 4);
  REQUIRE_OK(send_update(pair, 4, {"base"}, v4));
  REQUIRE_OK(shadowsync_receiver_drain(pair.receiver));
  CHECK(shadowsync_receiver_rollback(pair.receiver, pair.engine, nullptr) == SHADOWSYNC_SUPERSEDED);
  CHECK_THAT(last_error(), Catch::Contains("update 4 started receiving"));
  CHECK(live_group_is(layout, pair.receiver, 0, 3));
}

namespace {

constexpr char kSameHostToken[] = "ssk1-ded952b6063bf160ed7d94ce93798cced35abbce9b811bd0d11a58d3eaf21707";
constexpr size_t kSameHostTokenBytes = sizeof kSameHostToken - 1;

}  // namespace

TEST_CASE("C ABI: same-host transports across threads carry updates; bad input is refused") {
  shadowsync::testing::SocketDir dir{"shadowsync_c_api"};
  const std::string path = dir.path();
  const Layout layout = cpp_layout();
  shadowsync_layout_t c_layout = make_layout();
  shadowsync_backend_t sender_backend = nullptr;
  shadowsync_backend_t receiver_backend = nullptr;
  REQUIRE_OK(shadowsync_host_backend_create(&sender_backend));
  REQUIRE_OK(shadowsync_host_backend_create(&receiver_backend));
  shadowsync_transport_t out = nullptr;

  SECTION("bad arguments name the argument and its value, and nothing listens") {
    CHECK(shadowsync_same_host_transport_serve(nullptr, kSameHostToken, kSameHostTokenBytes, 1,
                                               sender_backend, SHADOWSYNC_SAME_HOST_MEMORY_HOST,
                                               1024, 0, &out) == SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("'path' is NULL"));
    CHECK(shadowsync_same_host_transport_serve(path.c_str(), nullptr, 32, 1, sender_backend,
                                               SHADOWSYNC_SAME_HOST_MEMORY_HOST, 1024, 0,
                                               &out) == SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("'token' is NULL but token_bytes is 32"));
    CHECK(shadowsync_same_host_transport_serve(path.c_str(), "short", 5, 1, sender_backend,
                                               SHADOWSYNC_SAME_HOST_MEMORY_HOST, 1024, 0,
                                               &out) == SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("it has 5 bytes, fewer than the 16 required"));
    CHECK(shadowsync_same_host_transport_serve(path.c_str(), kSameHostToken, kSameHostTokenBytes,
                                               0, sender_backend,
                                               SHADOWSYNC_SAME_HOST_MEMORY_HOST, 1024, 0,
                                               &out) == SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("0 receivers, expected 1..65535"));
    CHECK(shadowsync_same_host_transport_serve(
              path.c_str(), kSameHostToken, kSameHostTokenBytes, 1, sender_backend,
              static_cast<shadowsync_same_host_memory_t>(7), 1024, 0, &out) ==
          SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("'memory' is 7; expected"));
    // The device flavour: not in a build without CUDA; with CUDA, not on a host backend.
    const shadowsync_status_t device = shadowsync_same_host_transport_serve(
        path.c_str(), kSameHostToken, kSameHostTokenBytes, 1, sender_backend,
        SHADOWSYNC_SAME_HOST_MEMORY_DEVICE, 1024, 0, &out);
    if (shadowsync_has_cuda() == 0) {
      CHECK(device == SHADOWSYNC_NOT_SUPPORTED);
      CHECK_THAT(last_error(), Catch::Contains("built without CUDA"));
    } else {
      CHECK(device == SHADOWSYNC_INVALID_ARGUMENT);
      CHECK_THAT(last_error(),
                 Catch::Contains("SHADOWSYNC_SAME_HOST_MEMORY_DEVICE needs a cuda backend, but "
                                 "'backend' is 'host'"));
    }
    CHECK(shadowsync_same_host_transport_serve(path.c_str(), kSameHostToken, kSameHostTokenBytes,
                                               1, sender_backend,
                                               SHADOWSYNC_SAME_HOST_MEMORY_HOST, 1024, -5,
                                               &out) == SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("connect_timeout_ms is -5; expected a positive"));
    CHECK(shadowsync_same_host_transport_serve(path.c_str(), kSameHostToken, kSameHostTokenBytes,
                                               1, nullptr, SHADOWSYNC_SAME_HOST_MEMORY_HOST, 1024,
                                               0, &out) == SHADOWSYNC_INVALID_HANDLE);
    CHECK(shadowsync_same_host_transport_serve(path.c_str(), kSameHostToken, kSameHostTokenBytes,
                                               1, sender_backend,
                                               SHADOWSYNC_SAME_HOST_MEMORY_HOST, 1024, 0,
                                               nullptr) == SHADOWSYNC_INVALID_ARGUMENT);
    CHECK(shadowsync_same_host_transport_connect(path.c_str(), kSameHostToken,
                                                 kSameHostTokenBytes, 0, receiver_backend, 0,
                                                 &out) == SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("rank 0 is outside 1..65535"));
    CHECK(shadowsync_same_host_transport_connect(path.c_str(), kSameHostToken,
                                                 kSameHostTokenBytes, 1, receiver_backend, -1,
                                                 &out) == SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("connect_timeout_ms is -1"));
    CHECK(out == nullptr);
    CHECK_FALSE(std::filesystem::exists(path));
  }

  SECTION("a wrong token is refused on both sides") {
    auto sender = std::async(std::launch::async, [&] {
      shadowsync_transport_t t = nullptr;
      const shadowsync_status_t status = shadowsync_same_host_transport_serve(
          path.c_str(), kSameHostToken, kSameHostTokenBytes, 1, sender_backend,
          SHADOWSYNC_SAME_HOST_MEMORY_HOST, 1024, 1500, &t);
      return std::make_pair(status, last_error());
    });
    const char wrong[] = "ssk1-63797165b3dfe0a594bfd143e51ff27ac4b85e06f81699463bcc565a25d9897c";
    const shadowsync_status_t refused = shadowsync_same_host_transport_connect(
        path.c_str(), wrong, sizeof wrong - 1, 1, receiver_backend, 10000, &out);
    CHECK(refused == SHADOWSYNC_TRANSPORT_ERROR);
    CHECK_THAT(last_error(), Catch::Contains("the sender refused") &&
                                 Catch::Contains("wrong token"));
    const auto [status, message] = sender.get();
    CHECK(status == SHADOWSYNC_TIMEOUT);
    CHECK_THAT(message, Catch::Contains("0 of 1 receivers connected") &&
                            Catch::Contains("wrong token"));
  }

  SECTION("an update end to end, three times") {
    // Catch's assertions stay on this thread: the other one returns what it got.
    auto connected = std::async(std::launch::async, [&] {
      shadowsync_transport_t t = nullptr;
      const shadowsync_status_t status = shadowsync_same_host_transport_connect(
          path.c_str(), kSameHostToken, kSameHostTokenBytes, 1, receiver_backend, 10000, &t);
      return std::make_tuple(status, t, last_error());
    });
    shadowsync_transport_t sender_transport = nullptr;
    REQUIRE_OK(shadowsync_same_host_transport_serve(
        path.c_str(), kSameHostToken, kSameHostTokenBytes, 1, sender_backend,
        SHADOWSYNC_SAME_HOST_MEMORY_HOST, 1024, 10000, &sender_transport));
    const auto [connect_status, receiver_transport, connect_error] = connected.get();
    INFO("connect: " << connect_error);
    REQUIRE(connect_status == SHADOWSYNC_SUCCESS);
    shadowsync_stream_t engine = nullptr;
    REQUIRE_OK(shadowsync_stream_create(receiver_backend, 0, &engine));
    // The transports hold their backends: the handles may go first.
    REQUIRE_OK(shadowsync_backend_destroy(sender_backend));
    shadowsync_backend_t sender_side = nullptr;
    REQUIRE_OK(shadowsync_host_backend_create(&sender_side));
    sender_backend = sender_side;
    shadowsync_receiver_t receiver = nullptr;
    shadowsync_sender_t sender = nullptr;
    REQUIRE_OK(shadowsync_receiver_create(c_layout, receiver_backend, receiver_transport, nullptr,
                                          &receiver));
    REQUIRE_OK(shadowsync_sender_create(c_layout, sender_backend, sender_transport, nullptr,
                                        &sender));
    for (std::uint64_t version = 1; version <= 3; ++version) {
      CTensors tensors(layout, {"base", "lora"}, version);
      const char* groups[] = {"base", "lora"};
      shadowsync_publish_t publish = nullptr;
      REQUIRE_OK(shadowsync_sender_publish(sender, version, groups, 2, tensors.tensors.data(),
                                           tensors.tensors.size(), &publish));
      std::vector<std::byte> bytes(SHADOWSYNC_MAX_HEADER_BYTES);
      size_t written = 0;
      REQUIRE_OK(shadowsync_publish_header_bytes(publish, bytes.data(), bytes.size(), &written));
      REQUIRE_OK(shadowsync_receiver_begin_update_bytes(receiver, bytes.data(), written));
      REQUIRE_OK(shadowsync_publish_wait(publish, 20000));
      REQUIRE_OK(shadowsync_publish_destroy(publish));
      REQUIRE_OK(shadowsync_receiver_wait_applied(receiver, version, 20000, engine));
      CHECK(live_group_is(layout, receiver, 0, version));
      CHECK(live_group_is(layout, receiver, 1, version));
    }
    REQUIRE_OK(shadowsync_receiver_destroy(receiver));
    REQUIRE_OK(shadowsync_sender_destroy(sender));
    REQUIRE_OK(shadowsync_stream_destroy(engine));
  }

  REQUIRE_OK(shadowsync_backend_destroy(sender_backend));
  REQUIRE_OK(shadowsync_backend_destroy(receiver_backend));
  REQUIRE_OK(shadowsync_layout_destroy(c_layout));
}

TEST_CASE("C ABI: the stats carry the last ready update's transfer time and pacing") {
  const Layout layout = cpp_layout();
  CTensors v1(layout, {"base"}, 1);
  SECTION("unpaced: the transfer time, and every pacing field 0") {
    Pair pair;
    shadowsync_receiver_stats_t stats = SHADOWSYNC_RECEIVER_STATS_INITIALIZER;
    REQUIRE_OK(shadowsync_receiver_stats(pair.receiver, &stats));
    CHECK(stats.last_transfer_ns == 0);  // no update yet
    REQUIRE_OK(send_update(pair, 1, {"base"}, v1));
    REQUIRE_OK(shadowsync_receiver_wait_applied(pair.receiver, 1, 20000, pair.engine));
    REQUIRE_OK(shadowsync_receiver_stats(pair.receiver, &stats));
    CHECK(stats.last_transfer_ns > 0);
    CHECK(stats.last_paced == 0);
    CHECK(stats.last_pacing_budget == 0.0);
    CHECK(stats.last_pacing_steps == 0);
    CHECK(stats.last_idle_step_ns == 0);
    CHECK(stats.last_duty == 0.0);
  }
  SECTION("the last swap: how long the engine thread spent in it, callback included, and when") {
    Pair pair;
    // The swap callback stands in for an adapter's rebinding work of a known length.
    static constexpr auto kCallbackWork = std::chrono::milliseconds(30);
    REQUIRE_OK(shadowsync_receiver_set_swap_callback(
        pair.receiver,
        [](void*, uint64_t, const shadowsync_group_swap_t*, size_t) {
          std::this_thread::sleep_for(kCallbackWork);
        },
        nullptr));
    shadowsync_receiver_stats_t stats = SHADOWSYNC_RECEIVER_STATS_INITIALIZER;
    REQUIRE_OK(shadowsync_receiver_stats(pair.receiver, &stats));
    CHECK(stats.last_swap_ns == 0);  // no swap yet
    CHECK(stats.last_swap_started_ns == 0);
    REQUIRE_OK(send_update(pair, 1, {"base"}, v1));
    wait_until([&] {
      return shadowsync_receiver_stats(pair.receiver, &stats) == SHADOWSYNC_SUCCESS &&
             stats.has_pending == 1;
    }, "update 1 received and waiting for a step");
    // The documented clock: CLOCK_MONOTONIC, so a caller can place the swap among its own times.
    const auto monotonic_ns = [] {
      timespec now{};
      clock_gettime(CLOCK_MONOTONIC, &now);
      return static_cast<int64_t>(now.tv_sec) * 1'000'000'000 + now.tv_nsec;
    };
    const int64_t before = monotonic_ns();
    uint64_t applied = 0;
    REQUIRE_OK(shadowsync_receiver_before_step(pair.receiver, pair.engine, &applied));
    const int64_t after = monotonic_ns();
    REQUIRE(applied == 1);
    REQUIRE_OK(shadowsync_receiver_stats(pair.receiver, &stats));
    CHECK(stats.last_swap_ns >= std::chrono::nanoseconds(kCallbackWork).count());
    CHECK(stats.last_swap_ns <= after - before);
    CHECK(stats.last_swap_started_ns >= before);
    CHECK(stats.last_swap_started_ns + stats.last_swap_ns <= after);
  }
  SECTION("paced: a budget and a rate cap, an engine thread stepping at a known pace") {
    constexpr auto kStep = std::chrono::milliseconds(2);
    constexpr std::uint64_t kBytesPerSecond = 50'000;  // the update's ~3.4 KB take ~70 ms
    shadowsync_receiver_config_t rconfig = SHADOWSYNC_RECEIVER_CONFIG_INITIALIZER;
    rconfig.update_deadline_ms = 20000;
    rconfig.decode_slowdown_budget = 1.05;
    rconfig.max_receive_bytes_per_second = kBytesPerSecond;
    Pair pair(&rconfig);
    std::atomic<bool> stop{false};
    std::atomic<std::uint64_t> steps{0};
    std::atomic<int> step_failures{0};
    // The engine thread: the step hook, then a step of kStep (simulated work, not a wait).
    std::thread engine([&] {
      while (!stop.load()) {
        uint64_t applied = 0;
        if (shadowsync_receiver_before_step(pair.receiver, pair.engine, &applied) !=
            SHADOWSYNC_SUCCESS) {
          ++step_failures;
        }
        std::this_thread::sleep_for(kStep);
        ++steps;
      }
    });
    try {
      // A baseline of idle steps first.
      wait_until([&] { return steps.load() >= 16; }, "16 idle engine steps");
      REQUIRE_OK(send_update(pair, 1, {"base"}, v1));
      wait_until(
          [&] {
            uint64_t applied = 0;
            return shadowsync_receiver_applied_version(pair.receiver, &applied) ==
                       SHADOWSYNC_SUCCESS &&
                   applied == 1;
          },
          "update 1 applied by the engine thread");
    } catch (...) {
      stop = true;
      engine.join();
      throw;
    }
    stop = true;
    engine.join();
    CHECK(step_failures.load() == 0);
    shadowsync_receiver_stats_t stats = SHADOWSYNC_RECEIVER_STATS_INITIALIZER;
    REQUIRE_OK(shadowsync_receiver_stats(pair.receiver, &stats));
    CHECK(stats.updates_ready == 1);
    CHECK(stats.last_paced == 1);
    CHECK(stats.last_pacing_budget == 1.05);
    CHECK(stats.last_deadline_limited == 0);
    // A step is kStep of sleep plus the hook: never shorter; on a loaded machine much longer.
    CHECK(stats.last_idle_step_ns >= std::chrono::nanoseconds(kStep).count());
    CHECK(stats.last_idle_step_ns < std::chrono::nanoseconds(std::chrono::milliseconds(500)).count());
    // The cap held the buckets back: the engine stepped meanwhile.
    CHECK(stats.last_held_back_ns > 0);
    CHECK(stats.last_pacing_steps > 0);
    CHECK(stats.last_step_during_ns > 0);
    CHECK(stats.last_step_ratio > 0.0);
    CHECK(stats.last_busy_ns > 0);
    CHECK(stats.last_duty > 0.0);
    CHECK(stats.last_duty < 1.0);
    CHECK(stats.last_transfer_ns >= stats.last_held_back_ns);
  }
}

TEST_CASE("C ABI: remap arenas on the host backend, and receivers made with engine arenas") {
  shadowsync_layout_t layout = make_layout();
  shadowsync_backend_t backend = nullptr;
  REQUIRE_OK(shadowsync_host_backend_create(&backend));
  shadowsync_loopback_t loopback = nullptr;
  REQUIRE_OK(shadowsync_loopback_create(2, &loopback));
  shadowsync_transport_t transport = nullptr;
  REQUIRE_OK(shadowsync_loopback_transport(loopback, 1, &transport));

  SECTION("an arena on the host backend is not supported, naming why") {
    shadowsync_remap_arena_t arena = nullptr;
    CHECK(shadowsync_remap_arena_create(backend, 4096, &arena) == SHADOWSYNC_NOT_SUPPORTED);
    CHECK_THAT(last_error(), Catch::Contains("shadowsync_remap_arena_create") &&
                                 Catch::Contains("a remap arena of 4096 bytes on backend 'host'") &&
                                 Catch::Contains("no virtual memory remapping"));
    CHECK(arena == nullptr);
  }
  SECTION("an arena of 0 bytes is an invalid argument (before the backend is asked)") {
    shadowsync_remap_arena_t arena = nullptr;
    CHECK(shadowsync_remap_arena_create(backend, 0, &arena) == SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("'bytes' is 0"));
    CHECK(arena == nullptr);
  }
  SECTION("NULL arenas with a count are refused; the transport stays the caller's") {
    shadowsync_receiver_config_t config = SHADOWSYNC_RECEIVER_CONFIG_INITIALIZER;
    config.swap_strategy = SHADOWSYNC_SWAP_REMAP;
    shadowsync_receiver_t receiver = nullptr;
    CHECK(shadowsync_receiver_create_with_arenas(layout, nullptr, nullptr, 0, nullptr, 1, backend,
                                                 transport, &config, &receiver) ==
          SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("shadowsync_receiver_create_with_arenas") &&
                                 Catch::Contains("'arenas' is NULL but the count is 1"));
    CHECK(receiver == nullptr);
    REQUIRE_OK(shadowsync_transport_destroy(transport));  // not taken
    transport = nullptr;
  }
  SECTION("a handle of another kind in the arenas is refused, naming its index") {
    shadowsync_remap_arena_t arenas[2] = {nullptr,
                                          reinterpret_cast<shadowsync_remap_arena_t>(layout)};
    shadowsync_receiver_t receiver = nullptr;
    CHECK(shadowsync_receiver_create_with_arenas(layout, nullptr, nullptr, 0, arenas, 2, backend,
                                                 transport, nullptr, &receiver) ==
          SHADOWSYNC_INVALID_HANDLE);
    CHECK_THAT(last_error(), Catch::Contains("arenas[1]"));
    CHECK(receiver == nullptr);
    REQUIRE_OK(shadowsync_transport_destroy(transport));  // not taken
    transport = nullptr;
  }
  SECTION("no arenas and no wire layout: as shadowsync_receiver_create") {
    shadowsync_receiver_t receiver = nullptr;
    REQUIRE_OK(shadowsync_receiver_create_with_arenas(layout, nullptr, nullptr, 0, nullptr, 0,
                                                      backend, transport, nullptr, &receiver));
    CHECK(receiver != nullptr);
    void* live = nullptr;
    REQUIRE_OK(shadowsync_receiver_live_arena(receiver, 0, &live));
    CHECK(live != nullptr);
    REQUIRE_OK(shadowsync_receiver_destroy(receiver));
    // The transport was taken, as by shadowsync_receiver_create.
    CHECK(shadowsync_transport_destroy(transport) == SHADOWSYNC_INVALID_HANDLE);
    transport = nullptr;
  }
  SECTION("only NULL arenas, with copy_in: accepted, nothing changes") {
    shadowsync_receiver_config_t config = SHADOWSYNC_RECEIVER_CONFIG_INITIALIZER;
    config.swap_strategy = SHADOWSYNC_SWAP_COPY_IN;
    shadowsync_remap_arena_t arenas[2] = {nullptr, nullptr};
    shadowsync_receiver_t receiver = nullptr;
    REQUIRE_OK(shadowsync_receiver_create_with_arenas(layout, nullptr, nullptr, 0, arenas, 2,
                                                      backend, transport, &config, &receiver));
    REQUIRE_OK(shadowsync_receiver_destroy(receiver));
    transport = nullptr;  // taken
  }
  if (transport != nullptr) REQUIRE_OK(shadowsync_transport_destroy(transport));
  REQUIRE_OK(shadowsync_loopback_destroy(loopback));
  REQUIRE_OK(shadowsync_backend_destroy(backend));
  REQUIRE_OK(shadowsync_layout_destroy(layout));
}

namespace {

// The routing tests' wire: q [13, 8] and k [3, 8] (fp32, Shard(0) over the trainer ranks) and a
// norm [8] rank 0 sends; buckets of 256 bytes.
shadowsync_layout_t make_routing_wire() {
  const std::int64_t q[] = {13, 8}, k[] = {3, 8}, norm[] = {8};
  const shadowsync_tensor_spec_t specs[] = {{"q", "fp32", q, 2, nullptr},
                                            {"k", "fp32", k, 2, nullptr},
                                            {"norm", "fp32", norm, 1, nullptr}};
  shadowsync_layout_t layout = nullptr;
  REQUIRE_OK(shadowsync_layout_create(specs, 3, 256, &layout));
  return layout;
}

std::vector<shadowsync_wire_range_t> region_ranges(shadowsync_layout_t layout,
                                                   const shadowsync_tensor_region_t& region) {
  std::size_t count = 0;
  CHECK(shadowsync_layout_region_ranges(layout, &region, nullptr, 0, &count) ==
        SHADOWSYNC_INVALID_ARGUMENT);  // capacity 0: the count only
  std::vector<shadowsync_wire_range_t> out(count);
  REQUIRE_OK(shadowsync_layout_region_ranges(layout, &region, out.data(), out.size(), &count));
  REQUIRE(count == out.size());
  return out;
}

// What trainer rank `rank` of two holds: its rows of q and k (7 and 6, 2 and 1), rank 0 the norm.
std::vector<shadowsync_wire_range_t> held_by(shadowsync_layout_t wire, int rank) {
  std::vector<shadowsync_wire_range_t> held;
  for (const auto& [name, rows, split] : {std::tuple{"q", 13, 7}, std::tuple{"k", 3, 2}}) {
    const std::int64_t begin[] = {rank == 0 ? 0 : split, 0};
    const std::int64_t end[] = {rank == 0 ? split : rows, 8};
    const shadowsync_tensor_region_t box = {name, SHADOWSYNC_REGION_BOX, 2, begin, end, 0, 0};
    for (const auto& r : region_ranges(wire, box)) held.push_back(r);
  }
  if (rank == 0) {
    const shadowsync_tensor_region_t norm = {"norm", SHADOWSYNC_REGION_ELEMENTS, 0, nullptr,
                                             nullptr, 0, 8};
    for (const auto& r : region_ranges(wire, norm)) held.push_back(r);
  }
  return held;
}

std::vector<RankRanges> cpp_ranks(const std::vector<std::vector<shadowsync_wire_range_t>>& lists) {
  std::vector<RankRanges> out;
  for (std::size_t i = 0; i < lists.size(); ++i) {
    RankRanges ranks{static_cast<int>(i), {{}}};
    for (const auto& r : lists[i]) ranks.ranges[r.group].push_back({r.begin, r.end});
    out.push_back(std::move(ranks));
  }
  return out;
}

}  // namespace

TEST_CASE("C ABI: a routing plan from regions, its routes and counts as the C++ plan has them") {
  shadowsync_layout_t wire = make_routing_wire();
  const Layout cpp_wire = Layout::build({{"q", DType::kFloat32, {13, 8}, "base"},
                                         {"k", DType::kFloat32, {3, 8}, "base"},
                                         {"norm", DType::kFloat32, {8}, "base"}},
                                        {.bucket_bytes = 256});
  // A box of whole rows is one range; half of every row (Megatron row-parallel) one per row.
  const std::int64_t rows_begin[] = {1, 0}, rows_end[] = {3, 8};
  const auto rows = region_ranges(wire, {"q", SHADOWSYNC_REGION_BOX, 2, rows_begin, rows_end, 0, 0});
  REQUIRE(rows.size() == 1);
  CHECK((rows[0].group == 0 && rows[0].begin == 32 && rows[0].end == 96));
  const std::int64_t half_begin[] = {0, 4}, half_end[] = {5, 8};
  CHECK(region_ranges(wire, {"q", SHADOWSYNC_REGION_BOX, 2, half_begin, half_end, 0, 0}).size() ==
        5);

  const std::vector<std::vector<shadowsync_wire_range_t>> held = {held_by(wire, 0),
                                                                  held_by(wire, 1)};
  // Given in reverse: ranks are named, not positional.
  const shadowsync_rank_ranges_t trainers[] = {{1, held[1].data(), held[1].size()},
                                               {0, held[0].data(), held[0].size()}};
  shadowsync_routing_plan_t plan = nullptr;
  REQUIRE_OK(shadowsync_routing_plan_create(wire, trainers, 2, nullptr, 0, &plan));

  // The C++ plan of the same inputs: one engine rank needing every tensor.
  std::vector<ByteRange> every;
  for (const TensorPlacement& t : cpp_wire.groups()[0].tensors()) {
    every.push_back({t.offset, t.offset + t.bytes});
  }
  const RoutingPlan cpp = RoutingPlan::build(cpp_wire, cpp_ranks(held), {{0, {every}}});

  shadowsync_routing_plan_info_t info = SHADOWSYNC_ROUTING_PLAN_INFO_INITIALIZER;
  REQUIRE_OK(shadowsync_routing_plan_info(plan, &info));
  CHECK(info.trainer_count == 2);
  CHECK(info.engine_count == 1);
  CHECK(info.fingerprint == cpp.fingerprint());
  std::uint64_t bytes = 0;
  REQUIRE_OK(shadowsync_routing_plan_bytes_to_engine(plan, 0, &bytes));
  CHECK(bytes == (104 + 24 + 8) * 4);
  std::uint64_t sent = 0;
  for (int t = 0; t < 2; ++t) {
    REQUIRE_OK(shadowsync_routing_plan_bytes_from_trainer(plan, t, &bytes));
    CHECK(bytes == cpp.bytes_from(t));
    sent += bytes;
    REQUIRE_OK(shadowsync_routing_plan_max_packed_bytes(plan, t, &bytes));
    CHECK(bytes == cpp.max_packed_bytes(t));
  }
  CHECK(sent == (104 + 24 + 8) * 4);

  std::uint64_t routes = 0;
  for (std::size_t b = 0; b < cpp_wire.groups()[0].bucket_count(); ++b) {
    const auto& want = cpp.routes(0, b);
    std::size_t count = 0;
    std::vector<shadowsync_route_t> got(want.size() + 1);
    REQUIRE_OK(shadowsync_routing_plan_routes(plan, 0, b, got.data(), got.size(), &count));
    REQUIRE(count == want.size());
    for (std::size_t i = 0; i < count; ++i) {
      const shadowsync_route_t& r = got[i];
      CHECK(Route{r.trainer, r.engine, r.group, r.bucket, r.wire_offset, r.source_offset,
                  r.bytes} == want[i]);
      CHECK(r.reserved == 0);
    }
    routes += count;
    for (int t = 0; t < 2; ++t) {
      std::uint64_t begin = 1, end = 1;
      REQUIRE_OK(shadowsync_routing_plan_packed_range(plan, t, 0, b, &begin, &end));
      CHECK(ByteRange{begin, end} == cpp.packed_range(t, 0, b));
    }
  }
  CHECK(info.route_count == routes);

  // A smaller struct (an older caller's) is filled up to its size only.
  struct {
    shadowsync_routing_plan_info_t info;
    unsigned char guard[8];
  } small;
  std::memset(&small, 0xAB, sizeof(small));
  small.info.size = offsetof(shadowsync_routing_plan_info_t, fingerprint);
  REQUIRE_OK(shadowsync_routing_plan_info(plan, &small.info));
  CHECK(small.info.engine_count == 1);
  CHECK(small.info.fingerprint == 0xABABABABABABABABull);

  SECTION("too small a capacity: nothing written, *count says how many") {
    REQUIRE(cpp.routes(0, 0).size() >= 2);
    shadowsync_route_t one[1] = {};
    one[0].trainer = -7;
    std::size_t count = 0;
    CHECK(shadowsync_routing_plan_routes(plan, 0, 0, one, 1, &count) ==
          SHADOWSYNC_INVALID_ARGUMENT);
    CHECK(count == cpp.routes(0, 0).size());
    CHECK(one[0].trainer == -7);
    CHECK_THAT(last_error(),
               Catch::Contains("shadowsync_routing_plan_routes") &&
                   Catch::Contains("'routes' holds 1 entries (capacity), " +
                                   std::to_string(count) + " are needed"));
    CHECK(shadowsync_routing_plan_routes(plan, 0, 0, nullptr, 4, &count) ==
          SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("'routes' is NULL but the capacity is 4"));
  }
  SECTION("indices out of range are refused, named") {
    std::size_t count = 0;
    CHECK(shadowsync_routing_plan_routes(plan, 1, 0, nullptr, 0, &count) ==
          SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(),
               Catch::Contains("group index 1 out of range (the wire layout has 1 groups)"));
    CHECK(shadowsync_routing_plan_routes(plan, 0, 4, nullptr, 0, &count) ==
          SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("bucket 4 out of range (group 'base' has 4 buckets)"));
    CHECK(shadowsync_routing_plan_bytes_to_engine(plan, 1, &bytes) == SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("engine rank 1 is outside the routing plan's ranks 0..0"));
    CHECK(shadowsync_routing_plan_max_packed_bytes(plan, -1, &bytes) ==
          SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("trainer rank -1 is outside the routing plan's ranks 0..1"));
    shadowsync_routing_plan_info_t zero = SHADOWSYNC_ROUTING_PLAN_INFO_INITIALIZER;
    zero.size = 0;
    CHECK(shadowsync_routing_plan_info(plan, &zero) == SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("info->size is 0"));
  }
  SECTION("a destroyed plan and a handle of another kind are refused") {
    REQUIRE_OK(shadowsync_routing_plan_destroy(plan));
    CHECK(shadowsync_routing_plan_info(plan, &info) == SHADOWSYNC_INVALID_HANDLE);
    CHECK_THAT(last_error(), Catch::Contains("is not a live shadowsync_routing_plan_t"));
    CHECK(shadowsync_routing_plan_info(reinterpret_cast<shadowsync_routing_plan_t>(wire), &info) ==
          SHADOWSYNC_INVALID_HANDLE);
    plan = nullptr;
  }
  if (plan != nullptr) REQUIRE_OK(shadowsync_routing_plan_destroy(plan));
  REQUIRE_OK(shadowsync_layout_destroy(wire));
}

TEST_CASE("C ABI: routing plans and regions are refused with the ranks, tensors and bytes named") {
  shadowsync_layout_t wire = make_routing_wire();
  std::vector<std::vector<shadowsync_wire_range_t>> held = {held_by(wire, 0), held_by(wire, 1)};
  shadowsync_routing_plan_t plan = nullptr;
  const auto create = [&](std::vector<shadowsync_rank_ranges_t> trainers) {
    return shadowsync_routing_plan_create(wire, trainers.data(), trainers.size(), nullptr, 0,
                                          &plan);
  };
  SECTION("a rank missing and one outside") {
    CHECK(create({{0, held[0].data(), held[0].size()}, {2, held[1].data(), held[1].size()}}) ==
          SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("shadowsync_routing_plan_create") &&
                                 Catch::Contains("trainer ranks 0..1 expected (2 lists given, one "
                                                 "per rank): rank 1 missing, rank 2 outside"));
  }
  SECTION("bytes two trainer ranks both hold") {
    held[1].push_back(held[0].back());  // the norm
    CHECK(create({{0, held[0].data(), held[0].size()}, {1, held[1].data(), held[1].size()}}) ==
          SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("trainer ranks 0 and 1 both hold bytes 0..32 of "
                                             "tensor 'norm'"));
  }
  SECTION("bytes no trainer rank holds") {
    held[0].pop_back();  // nobody sends the norm
    CHECK(create({{0, held[0].data(), held[0].size()}, {1, held[1].data(), held[1].size()}}) ==
          SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("engine rank 0 needs bytes 0..32 of tensor 'norm' "
                                             "(group 'base'), which no trainer rank holds"));
  }
  SECTION("a range of a group the wire does not have") {
    held[1][0].group = 3;
    CHECK(create({{0, held[0].data(), held[0].size()}, {1, held[1].data(), held[1].size()}}) ==
          SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("'trainers[1].ranges[0]' (rank 1): group 3 with "
                                             "reserved 0; the wire layout has groups 0..0"));
  }
  SECTION("NULL ranges with a count") {
    CHECK(create({{0, nullptr, 2}}) == SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("'trainers[0].ranges' is NULL but its count is 2"));
  }
  SECTION("regions outside their tensor, of unknown tensors or kinds") {
    std::size_t count = 0;
    shadowsync_wire_range_t out[4];
    const std::int64_t begin[] = {0, 0}, end[] = {14, 8};
    shadowsync_tensor_region_t region = {"q", SHADOWSYNC_REGION_BOX, 2, begin, end, 0, 0};
    CHECK(shadowsync_layout_region_ranges(wire, &region, out, 4, &count) ==
          SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("tensor 'q' of shape [13, 8]: the box [0, 0]..[14, 8] "
                                             "is empty or outside it"));
    region = {"q", SHADOWSYNC_REGION_ELEMENTS, 0, nullptr, nullptr, 100, 5};
    CHECK(shadowsync_layout_region_ranges(wire, &region, out, 4, &count) ==
          SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("tensor 'q' of 104 elements: elements 100..105"));
    region = {"v", SHADOWSYNC_REGION_ELEMENTS, 0, nullptr, nullptr, 0, 1};
    CHECK(shadowsync_layout_region_ranges(wire, &region, out, 4, &count) ==
          SHADOWSYNC_LAYOUT_MISMATCH);
    CHECK_THAT(last_error(), Catch::Contains("tensor 'v' is not in the wire layout"));
    region = {"q", 7, 0, nullptr, nullptr, 0, 1};
    CHECK(shadowsync_layout_region_ranges(wire, &region, out, 4, &count) ==
          SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("kind 7 is not SHADOWSYNC_REGION_BOX"));
  }
  CHECK(plan == nullptr);
  REQUIRE_OK(shadowsync_layout_destroy(wire));
}

using Ranges = std::vector<std::pair<std::uint64_t, std::uint64_t>>;

// Wire ranges of group 0 as (begin, end) pairs, asked as the header says: capacity 0 first (the
// count only), then that many. `ask(out, capacity, &count)` is the call.
template <typename Ask>
Ranges needed_ranges(Ask ask) {
  std::size_t count = 0;
  CHECK(ask(nullptr, 0, &count) == SHADOWSYNC_INVALID_ARGUMENT);
  std::vector<shadowsync_wire_range_t> out(count);
  REQUIRE_OK(ask(out.data(), out.size(), &count));
  Ranges ranges;
  for (const auto& r : out) {
    CHECK(r.group == 0);
    ranges.emplace_back(r.begin, r.end);
  }
  return ranges;
}

// The plan's reads, or every tensor without one, either way.
TEST_CASE("C ABI: an engine rank's needs, of a receiver or of its receive plan alone") {
  shadowsync_layout_t wire = make_routing_wire();
  shadowsync_backend_t backend = nullptr;
  REQUIRE_OK(shadowsync_host_backend_create(&backend));
  const auto of_receiver = [](shadowsync_receiver_t receiver) {
    return needed_ranges(
        [&](shadowsync_wire_range_t* out, std::size_t capacity, std::size_t* count) {
          return shadowsync_receiver_needed_ranges(receiver, out, capacity, count);
        });
  };
  const auto of_plan = [](shadowsync_layout_t layout, shadowsync_layout_t wire_layout,
                          const shadowsync_plan_copy_t* copies, std::size_t copy_count) {
    return needed_ranges(
        [&](shadowsync_wire_range_t* out, std::size_t capacity, std::size_t* count) {
          return shadowsync_receive_plan_needed_ranges(layout, wire_layout, copies, copy_count,
                                                       nullptr, 0, out, capacity, count);
        });
  };
  SECTION("without a plan: every tensor of its layout") {
    // q at 0, k and the norm each at the next 256-byte boundary.
    const Ranges every{{0, 416}, {512, 608}, {768, 800}};
    shadowsync_receiver_t receiver = nullptr;
    REQUIRE_OK(shadowsync_receiver_create(wire, backend, nullptr, nullptr, &receiver));
    CHECK(of_receiver(receiver) == every);
    REQUIRE_OK(shadowsync_receiver_destroy(receiver));
    CHECK(of_plan(wire, nullptr, nullptr, 0) == every);
  }
  const std::int64_t q[] = {6, 8}, norm[] = {8};
  const shadowsync_tensor_spec_t specs[] = {{"q", "fp32", q, 2, nullptr},
                                            {"norm", "fp32", norm, 1, nullptr}};
  shadowsync_layout_t engine = nullptr;
  REQUIRE_OK(shadowsync_layout_create(specs, 2, 0, &engine));
  const std::int64_t strides[] = {8, 1}, one[] = {1};
  SECTION("with a plan: the rows it reads (rank 1 of a column-parallel split)") {
    const shadowsync_plan_copy_t copies[] = {
        {"q", "q", 2, q, 7 * 8, strides, 0, strides},
        {"norm", "norm", 1, norm, 0, one, 0, one},
    };
    const Ranges rows{{7 * 32, 416}, {768, 800}};
    shadowsync_receiver_t receiver = nullptr;
    REQUIRE_OK(shadowsync_receiver_create_with_plan(engine, wire, copies, 2, backend, nullptr,
                                                    nullptr, &receiver));
    CHECK(of_receiver(receiver) == rows);
    REQUIRE_OK(shadowsync_receiver_destroy(receiver));
    CHECK(of_plan(engine, wire, copies, 2) == rows);
  }
  SECTION("a plan the receiver would refuse is refused alike, named") {
    const shadowsync_plan_copy_t copies[] = {
        {"q", "q", 2, q, 8 * 8, strides, 0, strides},  // rows 8..13 of 13
        {"norm", "norm", 1, norm, 0, one, 0, one},
    };
    shadowsync_wire_range_t out[4];
    std::size_t count = 0;
    CHECK(shadowsync_receive_plan_needed_ranges(engine, wire, copies, 2, nullptr, 0, out, 4,
                                                &count) == SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("plan copy 0 ('q' -> 'q')") &&
                                 Catch::Contains("outside tensor 'q' of 104 elements"));
    CHECK(shadowsync_receive_plan_needed_ranges(engine, wire, nullptr, 2, nullptr, 0, out, 4,
                                                &count) == SHADOWSYNC_INVALID_ARGUMENT);
    CHECK_THAT(last_error(), Catch::Contains("'copies' is NULL but the count is 2"));
    CHECK(shadowsync_receive_plan_needed_ranges(nullptr, wire, copies, 2, nullptr, 0, out, 4,
                                                &count) == SHADOWSYNC_INVALID_HANDLE);
    CHECK_THAT(last_error(), Catch::Contains("layout"));
  }
  REQUIRE_OK(shadowsync_layout_destroy(engine));
  REQUIRE_OK(shadowsync_backend_destroy(backend));
  REQUIRE_OK(shadowsync_layout_destroy(wire));
}
