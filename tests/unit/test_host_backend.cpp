// HostBackend: CUDA stream and event semantics on host threads. Every wait has a deadline that
// fails the test; nothing sleeps to win a race.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <future>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "shadowsync/error.h"
#include "shadowsync/host_backend.h"

namespace {

using namespace std::chrono_literals;
using shadowsync::Error;
using shadowsync::ErrorCode;
using shadowsync::HostBackend;
using shadowsync::HostBackendOptions;
using shadowsync::StreamPriority;

constexpr auto kDeadline = 5s;  // generous: only a bug makes a wait take this long

// A gate that stream tasks block on until the test opens it. Declare it after the streams that
// wait on it: its destructor opens it, so a failed check never leaves a stream blocked forever.
class Gate {
 public:
  Gate() : opened_(promise_.get_future().share()) {}
  ~Gate() { open(); }
  void open() {
    if (!is_open_.exchange(true)) promise_.set_value();
  }
  // A task that blocks its stream until open() is called.
  std::function<void()> blocker() const {
    return [f = opened_] { f.wait(); };
  }

 private:
  std::promise<void> promise_;
  std::shared_future<void> opened_;
  std::atomic<bool> is_open_{false};
};

struct ForeignStream final : shadowsync::Stream {};
struct ForeignEvent final : shadowsync::Event {};

}  // namespace

TEST_CASE("host backend: tasks on one stream run in enqueue order", "[host_backend]") {
  HostBackend backend;
  std::vector<int> order;  // touched by the stream thread only until synchronize
  auto stream = backend.create_stream(StreamPriority::kNormal);

  constexpr int kTasks = 2000;
  for (int i = 0; i < kTasks; ++i) backend.launch_async(*stream, [&order, i] { order.push_back(i); });
  backend.stream_synchronize(*stream);

  REQUIRE(order.size() == kTasks);
  for (int i = 0; i < kTasks; ++i) REQUIRE(order[i] == i);
}

TEST_CASE("host backend: copies chain in order on a stream", "[host_backend]") {
  HostBackend backend;
  std::vector<std::uint8_t> a(4096), b(4096, 0), c(4096, 0);
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<std::uint8_t>(i * 7 + 3);
  auto stream = backend.create_stream(StreamPriority::kLow);

  backend.memcpy_async(b.data(), a.data(), a.size(), *stream);
  backend.memcpy_async(c.data(), b.data(), b.size(), *stream);  // reads b after the first copy
  backend.stream_synchronize(*stream);

  REQUIRE(c == a);
}

TEST_CASE("host backend: enqueueing does not run work synchronously", "[host_backend]") {
  HostBackend backend;
  std::atomic<bool> ran{false};
  auto stream = backend.create_stream(StreamPriority::kNormal);
  Gate gate;

  backend.launch_async(*stream, gate.blocker());
  backend.launch_async(*stream, [&ran] { ran = true; });
  REQUIRE_FALSE(ran.load());  // the stream is held at the gate: nothing after it can have run
  gate.open();
  backend.stream_synchronize(*stream);
  REQUIRE(ran.load());
}

TEST_CASE("host backend: an event recorded behind a blocked task completes only after it",
          "[host_backend]") {
  HostBackend backend;
  auto stream = backend.create_stream(StreamPriority::kNormal);
  auto event = backend.create_event();
  Gate gate;

  backend.launch_async(*stream, gate.blocker());
  backend.event_record(*event, *stream);

  REQUIRE_FALSE(backend.event_query(*event));
  // Cannot complete while the gate is shut, so a short bounded wait must time out.
  REQUIRE_FALSE(backend.event_wait_for(*event, 20ms));
  REQUIRE_FALSE(backend.event_query(*event));

  gate.open();
  REQUIRE(backend.event_wait_for(*event, kDeadline));
  REQUIRE(backend.event_query(*event));
}

TEST_CASE("host backend: a stream waiting on another stream's event sees its writes",
          "[host_backend]") {
  HostBackend backend;
  int value = 0;  // written on A, read on B: only the event orders them (TSan checks this)
  int observed = -1;
  auto a = backend.create_stream(StreamPriority::kNormal);
  auto b = backend.create_stream(StreamPriority::kLow);
  auto written = backend.create_event();
  auto read_done = backend.create_event();
  Gate gate;

  backend.launch_async(*a, gate.blocker());
  backend.launch_async(*a, [&value] { value = 42; });
  backend.event_record(*written, *a);

  backend.stream_wait_event(*b, *written);
  backend.launch_async(*b, [&value, &observed] { observed = value; });
  backend.event_record(*read_done, *b);

  REQUIRE_FALSE(backend.event_wait_for(*read_done, 20ms));  // B is held behind A's gate

  gate.open();
  REQUIRE(backend.event_wait_for(*read_done, kDeadline));
  REQUIRE(observed == 42);
}

TEST_CASE("host backend: re-recording an event does not change an earlier wait on it",
          "[host_backend]") {
  HostBackend backend;
  auto a = backend.create_stream(StreamPriority::kNormal);
  auto b = backend.create_stream(StreamPriority::kNormal);
  auto c = backend.create_stream(StreamPriority::kNormal);
  auto event = backend.create_event();
  auto b_done = backend.create_event();
  Gate gate;

  backend.launch_async(*a, gate.blocker());
  backend.event_record(*event, *a);      // captures A's blocked work
  backend.stream_wait_event(*b, *event);  // B waits for that capture
  backend.event_record(*b_done, *b);

  backend.event_record(*event, *c);  // re-record on an idle stream: completes quickly
  REQUIRE(backend.event_wait_for(*event, kDeadline));

  // B still waits for what the event captured when B called stream_wait_event.
  REQUIRE_FALSE(backend.event_wait_for(*b_done, 20ms));

  gate.open();
  REQUIRE(backend.event_wait_for(*b_done, kDeadline));
}

TEST_CASE("host backend: an event never recorded is complete", "[host_backend]") {
  HostBackend backend;
  auto stream = backend.create_stream(StreamPriority::kNormal);
  auto event = backend.create_event();
  auto after = backend.create_event();

  REQUIRE(backend.event_query(*event));
  REQUIRE(backend.event_wait_for(*event, 0ns));
  REQUIRE(backend.event_wait_for(*event, std::chrono::nanoseconds::max()));

  backend.stream_wait_event(*stream, *event);  // must not block the stream
  backend.event_record(*after, *stream);
  REQUIRE(backend.event_wait_for(*after, kDeadline));
}

TEST_CASE("host backend: event waits with extreme timeouts", "[host_backend]") {
  HostBackend backend;
  auto stream = backend.create_stream(StreamPriority::kNormal);
  auto event = backend.create_event();
  backend.event_record(*event, *stream);
  REQUIRE(backend.event_wait_for(*event, std::chrono::nanoseconds::max()));  // no overflow
  REQUIRE(backend.event_wait_for(*event, -1s));                             // already complete

  Gate gate;
  backend.launch_async(*stream, gate.blocker());
  backend.event_record(*event, *stream);
  REQUIRE_FALSE(backend.event_wait_for(*event, -1s));
  REQUIRE_FALSE(backend.event_wait_for(*event, 0ns));
  gate.open();
  REQUIRE(backend.event_wait_for(*event, kDeadline));
}

TEST_CASE("host backend: stream_synchronize waits for all enqueued work", "[host_backend]") {
  HostBackend backend;
  std::atomic<int> done{0};
  auto stream = backend.create_stream(StreamPriority::kNormal);
  for (int i = 0; i < 100; ++i) backend.launch_async(*stream, [&done] { ++done; });
  backend.stream_synchronize(*stream);
  REQUIRE(done.load() == 100);
}

TEST_CASE("host backend: stream_synchronize from the stream's own task is refused",
          "[host_backend]") {
  HostBackend backend;
  auto stream = backend.create_stream(StreamPriority::kNormal);
  std::atomic<int> code{0};
  backend.launch_async(*stream, [&] {
    try {
      backend.stream_synchronize(*stream);
    } catch (const Error& e) {
      code = static_cast<int>(e.code());
    }
  });
  backend.stream_synchronize(*stream);
  REQUIRE(code.load() == static_cast<int>(ErrorCode::kInvalidArgument));
}

TEST_CASE("host backend: a throwing task does not stop its stream", "[host_backend]") {
  HostBackend backend;
  std::atomic<bool> later_ran{false};
  auto stream = backend.create_stream(StreamPriority::kNormal);
  backend.launch_async(*stream, [] { throw std::runtime_error("expected test failure"); });
  backend.launch_async(*stream, [] { throw 7; });
  backend.launch_async(*stream, [&later_ran] { later_ran = true; });
  backend.stream_synchronize(*stream);
  REQUIRE(later_ran.load());
}

TEST_CASE("host backend: many threads enqueue on one stream", "[host_backend]") {
  HostBackend backend;
  std::atomic<int> tally{0};
  auto stream = backend.create_stream(StreamPriority::kNormal);
  constexpr int kThreads = 4, kPerThread = 500;
  {
    std::vector<std::jthread> producers;
    for (int t = 0; t < kThreads; ++t) {
      producers.emplace_back([&] {
        for (int i = 0; i < kPerThread; ++i) backend.launch_async(*stream, [&tally] { ++tally; });
      });
    }
  }
  backend.stream_synchronize(*stream);
  REQUIRE(tally.load() == kThreads * kPerThread);
}

TEST_CASE("host backend: destroying a stream drains its queue", "[host_backend]") {
  HostBackend backend;
  std::atomic<int> done{0};
  {
    auto stream = backend.create_stream(StreamPriority::kNormal);
    for (int i = 0; i < 100; ++i) backend.launch_async(*stream, [&done] { ++done; });
  }
  REQUIRE(done.load() == 100);
}

TEST_CASE("host backend: allocations are zeroed, aligned and accounted", "[host_backend]") {
  HostBackend backend;
  REQUIRE(backend.name() == "host");
  REQUIRE(backend.bytes_allocated() == 0);

  void* small = backend.allocate(100);
  void* large = backend.allocate(1000);
  REQUIRE(backend.bytes_allocated() == 1100);
  for (void* p : {small, large}) REQUIRE(reinterpret_cast<std::uintptr_t>(p) % 256 == 0);
  const auto* bytes = static_cast<const std::uint8_t*>(large);
  for (int i = 0; i < 1000; ++i) REQUIRE(bytes[i] == 0);

  backend.deallocate(small);
  REQUIRE(backend.bytes_allocated() == 1000);
  backend.deallocate(nullptr);  // no-op
  int not_ours = 0;
  backend.deallocate(&not_ours);  // ignored, not freed
  backend.deallocate(small);      // double free: ignored
  REQUIRE(backend.bytes_allocated() == 1000);
  backend.deallocate(large);
  REQUIRE(backend.bytes_allocated() == 0);

  {
    shadowsync::DeviceBuffer buffer(backend, 300);
    REQUIRE(buffer.size() == 300);
    REQUIRE(backend.bytes_allocated() == 300);
    shadowsync::DeviceBuffer moved = std::move(buffer);
    REQUIRE(backend.bytes_allocated() == 300);
  }
  REQUIRE(backend.bytes_allocated() == 0);
}

TEST_CASE("host backend: allocation errors", "[host_backend]") {
  HostBackend backend;
  try {
    backend.allocate(0);
    FAIL("allocate(0) did not throw");
  } catch (const Error& e) {
    REQUIRE(e.code() == ErrorCode::kInvalidArgument);
  }
  try {
    backend.allocate(std::numeric_limits<std::size_t>::max());
    FAIL("allocate(SIZE_MAX) did not throw");
  } catch (const Error& e) {
    REQUIRE(e.code() == ErrorCode::kBackend);
    REQUIRE_THAT(e.what(), Catch::Contains(std::to_string(std::numeric_limits<std::size_t>::max())));
  }
  REQUIRE(backend.bytes_allocated() == 0);
}

TEST_CASE("host backend: allocations are thread-safe", "[host_backend]") {
  HostBackend backend;
  {
    std::vector<std::jthread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&backend, t] {
        for (int i = 0; i < 200; ++i) {
          void* p = backend.allocate(64 + t);
          backend.deallocate(p);
        }
      });
    }
  }
  REQUIRE(backend.bytes_allocated() == 0);
}

TEST_CASE("host backend: jitter keeps order within a stream and across events",
          "[host_backend]") {
  HostBackendOptions options;
  options.max_task_jitter = 200us;
  options.jitter_seed = 12345;
  HostBackend backend(options);
  std::vector<int> order;  // stream A's thread only, then read after synchronize
  int value = 0;
  int observed = -1;
  auto a = backend.create_stream(StreamPriority::kNormal);
  auto b = backend.create_stream(StreamPriority::kNormal);
  auto event = backend.create_event();

  constexpr int kTasks = 200;
  for (int i = 0; i < kTasks; ++i) backend.launch_async(*a, [&order, i] { order.push_back(i); });
  backend.launch_async(*a, [&value] { value = 7; });
  backend.event_record(*event, *a);
  backend.stream_wait_event(*b, *event);
  backend.launch_async(*b, [&value, &observed] { observed = value; });

  backend.stream_synchronize(*b);
  backend.stream_synchronize(*a);
  REQUIRE(observed == 7);
  REQUIRE(order.size() == kTasks);
  for (int i = 0; i < kTasks; ++i) REQUIRE(order[i] == i);
}

TEST_CASE("host backend: negative jitter is rejected", "[host_backend]") {
  HostBackendOptions options;
  options.max_task_jitter = -1us;
  try {
    HostBackend backend(options);
    FAIL("negative jitter was accepted");
  } catch (const Error& e) {
    REQUIRE(e.code() == ErrorCode::kInvalidArgument);
  }
}

TEST_CASE("host backend: streams and events from elsewhere are rejected", "[host_backend]") {
  HostBackend backend;
  ForeignStream foreign_stream;
  ForeignEvent foreign_event;
  auto stream = backend.create_stream(StreamPriority::kNormal);
  auto event = backend.create_event();
  int x = 0, y = 0;

  auto expect_invalid = [](auto&& call, const char* what) {
    try {
      call();
      FAIL("no error for a " << what);
    } catch (const Error& e) {
      REQUIRE(e.code() == ErrorCode::kInvalidArgument);
      REQUIRE_THAT(e.what(), Catch::Contains("HostBackend") && Catch::Contains(what));
    }
  };
  expect_invalid([&] { backend.memcpy_async(&x, &y, sizeof x, foreign_stream); }, "ForeignStream");
  expect_invalid([&] { backend.launch_async(foreign_stream, [] {}); }, "ForeignStream");
  expect_invalid([&] { backend.event_record(*event, foreign_stream); }, "ForeignStream");
  expect_invalid([&] { backend.stream_synchronize(foreign_stream); }, "ForeignStream");
  expect_invalid([&] { backend.stream_wait_event(foreign_stream, *event); }, "ForeignStream");
  expect_invalid([&] { backend.event_record(foreign_event, *stream); }, "ForeignEvent");
  expect_invalid([&] { backend.stream_wait_event(*stream, foreign_event); }, "ForeignEvent");
  expect_invalid([&] { backend.event_query(foreign_event); }, "ForeignEvent");
  expect_invalid([&] { backend.event_wait_for(foreign_event, 0ns); }, "ForeignEvent");
}

TEST_CASE("host backend: streams and events may outlive the backend", "[host_backend]") {
  std::unique_ptr<shadowsync::Stream> stream;
  std::unique_ptr<shadowsync::Event> event;
  std::atomic<bool> ran{false};
  Gate gate;
  {
    HostBackend backend;
    stream = backend.create_stream(StreamPriority::kNormal);
    event = backend.create_event();
    backend.launch_async(*stream, gate.blocker());
    backend.launch_async(*stream, [&ran] { ran = true; });
  }
  gate.open();
  stream.reset();  // drains
  REQUIRE(ran.load());
}

TEST_CASE("host backend: quantize_fp8_async rounds to the nearest e4m3 per part, as vLLM does",
          "[host_backend][fp8]") {
  HostBackend backend;
  auto stream = backend.create_stream(StreamPriority::kLow);
  // Part 0's largest magnitude is 448: scale 1, so each value is rounded as it is. Ties go to the
  // even mantissa; below 2^-6 the steps are 2^-9 (subnormals). Part 1 is all zeros: vLLM's scale
  // is 0 and each 0 * (1 / 0) clamps to 448. Part 2's scale is 2 / 448.
  const std::vector<float> src = {1.0f,      -448.0f,    0.5f,          3.0f,
                                  1.0625f,   1.1875f,    0.001953125f,  0.0009765625f,
                                  0.0029296875f, 500.0f / 2, -0.0f,     240.0f,
                                  0.0f,      0.0f,       0.0f,          0.0f,
                                  0.0f,      0.0f,       0.0f,          0.0f,
                                  0.0f,      0.0f,       0.0f,          0.0f,
                                  2.0f,      -1.0f,      0.5f,          0.0f,
                                  0.0f,      0.0f,       0.0f,          0.0f,
                                  0.0f,      0.0f,       0.0f,          0.0f};
  std::vector<std::uint8_t> dst(src.size(), 0xAA);
  std::vector<float> scales(3, -1.0f);
  backend.quantize_fp8_async(src.data(), shadowsync::DType::kFloat32, src.size(), 3, dst.data(),
                             scales.data(), *stream);
  backend.stream_synchronize(*stream);
  CHECK(scales[0] == 1.0f);
  CHECK(scales[1] == 0.0f);
  CHECK(scales[2] == 2.0f / 448.0f);
  const std::vector<std::uint8_t> part0 = {0x38, 0xFE, 0x30, 0x44, 0x38, 0x3A,
                                           0x01, 0x00, 0x02, 0x78, 0x80, 0x77};
  CHECK(std::vector<std::uint8_t>(dst.begin(), dst.begin() + 12) == part0);
  CHECK(std::vector<std::uint8_t>(dst.begin() + 12, dst.begin() + 24) ==
        std::vector<std::uint8_t>(12, 0x7E));
  // 2 * (448 / 2) = 448 and -224, 112: exact.
  CHECK(dst[24] == 0x7E);
  CHECK(dst[25] == 0xF6);
  CHECK(dst[26] == 0x6E);
  CHECK(dst[27] == 0x00);
}

TEST_CASE("host backend: quantize_fp8_async refuses what it cannot quantize, enqueuing nothing",
          "[host_backend][fp8]") {
  HostBackend backend;
  auto stream = backend.create_stream(StreamPriority::kLow);
  std::vector<std::uint16_t> src(8, 0x3f80);  // bf16 1.0
  std::vector<std::uint8_t> dst(8, 0xAA);
  float scales[3] = {-1.0f, -1.0f, -1.0f};
  const auto refused = [&](shadowsync::DType dtype, std::size_t elements, std::size_t parts,
                           void* out, const char* says) {
    try {
      backend.quantize_fp8_async(src.data(), dtype, elements, parts, out, scales, *stream);
      FAIL("not refused");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kInvalidArgument);
      CHECK_THAT(e.what(), Catch::Matchers::Contains(says));
    }
  };
  refused(shadowsync::DType::kInt8, 8, 1, dst.data(), "source dtype int8 cannot be quantized");
  refused(shadowsync::DType::kBFloat16, 8, 3, dst.data(), "8 elements do not split into 3");
  refused(shadowsync::DType::kBFloat16, 8, 1, src.data(), "apart");
  backend.stream_synchronize(*stream);
  CHECK(dst == std::vector<std::uint8_t>(8, 0xAA));
  CHECK(scales[0] == -1.0f);
}
