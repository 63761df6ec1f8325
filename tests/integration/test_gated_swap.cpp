// Gated swaps (ReceiverConfig::gated_swaps, plugin/core/gated_swap.h): before_step closes a gate
// on the engine stream instead of swapping, the engine enqueues its step behind it, and
// after_launch remaps once the step before the gate has ended, then opens it. Runs on
// RemapHostBackend (remap_host_backend.h: remap on the CPU) with the host backend's gate (a task
// that holds the stream's thread until open()).
//
// What each step read is recorded by the step itself (the version of every word of the live
// arena, or torn), and compared with what the engine thread knew once the step was launched.
//
// Checked to fail without their behaviour (each broken by hand once, then restored): with
// GatedSwap::claim not waiting for the work before the gate, the first test sees the step before
// the gate read the new version; with after_launch not remapping (the gate opened without the
// swap), the step behind the gate reads the old version; with the watchdog not opening the gate,
// the second test hangs in its synchronize until the ctest timeout; with gate_or_apply not
// finishing an earlier gate, the third test's step reads the old version. The first is kept as
// mutation 19 (tests/mutations/, scripts/mutation_check.sh).
#include <catch2/catch.hpp>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <mutex>
#include <string>
#include <vector>

#include "deadline.h"
#include "fake_engine.h"
#include "loopback_rig.h"
#include "pattern.h"
#include "remap_host_backend.h"
#include "shadowsync/error.h"

using namespace shadowsync;
using namespace shadowsync::testing;

namespace {

Layout one_group_layout() {
  return Layout::build({{"embed", DType::kBFloat16, {97, 16}, "base"},
                        {"l0.w", DType::kFloat32, {300}, "base"},
                        {"l1.w", DType::kFloat16, {513}, "base"}},
                       {.bucket_bytes = 2048});
}

RigOptions gated_options(std::chrono::milliseconds gate_deadline, bool jitter = false) {
  RigOptions o;
  o.receiver.swap_strategy = SwapStrategy::kRemap;
  o.receiver.engine_uses_cuda_graphs = true;
  o.receiver.gated_swaps = true;
  o.receiver.gate_deadline = gate_deadline;
  o.remap_on_host = true;
  if (jitter) {
    o.backend.max_task_jitter = std::chrono::microseconds(20);
    o.backend.jitter_seed = 5;
  }
  return o;
}

// An engine whose steps record the version they read in the live arena (every word of every
// tensor; kTornVersion when two words disagree).
class ReadingEngine {
 public:
  ReadingEngine(LoopbackRig& rig, const Layout& layout)
      : rig_(rig), layout_(layout), stream_(rig.backend().create_stream(StreamPriority::kNormal)) {}
  ~ReadingEngine() { rig_.backend().stream_synchronize(*stream_); }

  Stream& stream() { return *stream_; }
  StepHook& hook() { return rig_.receiver().step_hook(); }

  // Enqueues a step that reads the live arena when it runs; returns its index in seen().
  std::size_t launch(std::function<void()> first = {}) {
    const std::size_t index = seen_.size();
    std::uint64_t* seen = &seen_.emplace_back(0);  // a deque: stays put while more are added
    const std::byte* live = hook().live_arena(0);
    rig_.backend().launch_async(*stream_, [this, seen, live, first = std::move(first)] {
      if (first) first();
      *seen = read(live);
    });
    return index;
  }
  void synchronize() { rig_.backend().stream_synchronize(*stream_); }
  // After synchronize().
  std::uint64_t seen(std::size_t step) const { return seen_[step]; }

 private:
  std::uint64_t read(const std::byte* live) const {
    std::optional<std::uint64_t> version;
    const auto& tensors = layout_.groups()[0].tensors();
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      for (std::size_t w = 0; w < tensors[t].bytes / 8; ++w) {
        const std::uint64_t v = read_version(live + tensors[t].offset, tensors[t].bytes, 0, t, w,
                                             version.value_or(0));
        if (version && *version != v) return kTornVersion;
        version = v;
      }
    }
    return version.value_or(kTornVersion);
  }

  LoopbackRig& rig_;
  const Layout& layout_;
  std::unique_ptr<Stream> stream_;
  std::deque<std::uint64_t> seen_;  // written by the stream's thread, read after synchronize
};

// The set-up of every test here: a gated receiver on the CPU and an engine that reads.
struct GatedRig {
  explicit GatedRig(std::chrono::milliseconds gate_deadline, bool jitter = false)
      : layout(one_group_layout()), rig(layout, gated_options(gate_deadline, jitter)),
        engine(rig, layout) {}
  const Layout layout;
  LoopbackRig rig;
  ReadingEngine engine;
};

// Sends update `version` of the base group and waits until the receiver offers it.
void offer(LoopbackRig& rig, std::uint64_t version) {
  rig.publish(version, {"base"}).wait();
  rig.wait_offered(version);
}

// A latch a stream task waits on: holds the step before the gate until the test lets it end.
struct Latch {
  void open() {
    {
      std::lock_guard lock(mutex);
      opened = true;
    }
    cv.notify_all();
  }
  void wait() {
    std::unique_lock lock(mutex);
    cv.wait(lock, [&] { return opened; });
  }
  std::mutex mutex;
  std::condition_variable cv;
  bool opened = false;
};

}  // namespace

TEST_CASE("gated swap: before_step returns while the step before is in flight; the step behind "
          "the gate runs on the new version, the step before on the old") {
  GatedRig g(std::chrono::milliseconds(10'000));
  LoopbackRig& rig = g.rig;
  ReadingEngine& engine = g.engine;
  StepHook& hook = engine.hook();

  offer(rig, 1);
  Latch latch;
  const std::size_t before = engine.launch([&] { latch.wait(); });  // the step in flight

  // The gate closes; nothing is swapped yet and the engine thread is back at once, the step
  // before still held by the latch.
  CHECK_FALSE(hook.before_step(engine.stream()).has_value());
  CHECK(hook.gated_swaps() == 1);
  CHECK(hook.applied_version() == 0);
  CHECK(hook.has_pending());
  const std::size_t behind = engine.launch();  // enqueued behind the gate

  latch.open();
  const std::optional<std::uint64_t> applied = hook.after_launch(engine.stream());
  REQUIRE(applied.has_value());
  CHECK(*applied == 1);
  CHECK(hook.applied_version() == 1);
  CHECK_FALSE(hook.after_launch(engine.stream()).has_value());  // nothing left to finish
  const std::size_t after = engine.launch();
  engine.synchronize();
  CHECK(engine.seen(before) == 0);
  CHECK(engine.seen(behind) == 1);
  CHECK(engine.seen(after) == 1);
  CHECK(hook.gates_abandoned() == 0);
}

TEST_CASE("gated swap: an engine thread that waits for its stream behind the gate is let go by "
          "the watchdog; the step runs on the old version and the update goes live at the next "
          "step, without a gate") {
  GatedRig g(std::chrono::milliseconds(20));
  LoopbackRig& rig = g.rig;
  ReadingEngine& engine = g.engine;
  StepHook& hook = engine.hook();

  offer(rig, 1);
  CHECK_FALSE(hook.before_step(engine.stream()).has_value());
  const std::size_t behind = engine.launch();
  engine.synchronize();  // would wait forever for the closed gate without the watchdog
  CHECK(hook.gates_abandoned() == 1);
  CHECK_FALSE(hook.after_launch(engine.stream()).has_value());  // abandoned: nothing made live
  CHECK(hook.applied_version() == 0);
  CHECK(hook.has_pending());
  CHECK(engine.seen(behind) == 0);

  // The next step swaps synchronously: no second gate.
  const std::optional<std::uint64_t> applied = hook.before_step(engine.stream());
  REQUIRE(applied.has_value());
  CHECK(*applied == 1);
  CHECK(hook.gated_swaps() == 1);
  const std::size_t next = engine.launch();
  engine.synchronize();
  CHECK(engine.seen(next) == 1);

  // Later updates too.
  offer(rig, 2);
  CHECK(hook.before_step(engine.stream()) == std::optional<std::uint64_t>(2));
  CHECK(hook.gated_swaps() == 1);
}

TEST_CASE("gated swap: an engine that comes back to before_step without after_launch finishes "
          "the gate there; wait_applied and rollback finish it too") {
  GatedRig g(std::chrono::milliseconds(10'000));
  LoopbackRig& rig = g.rig;
  ReadingEngine& engine = g.engine;
  StepHook& hook = engine.hook();

  offer(rig, 1);
  CHECK_FALSE(hook.before_step(engine.stream()).has_value());
  const std::size_t behind = engine.launch();
  CHECK(hook.before_step(engine.stream()) == std::optional<std::uint64_t>(1));
  engine.synchronize();
  CHECK(engine.seen(behind) == 1);

  offer(rig, 2);
  CHECK_FALSE(hook.before_step(engine.stream()).has_value());
  const std::size_t behind_2 = engine.launch();
  CHECK(hook.wait_applied(2, deadline_from_now(), engine.stream()));
  engine.synchronize();
  CHECK(engine.seen(behind_2) == 2);

  offer(rig, 3);
  CHECK(hook.before_step(engine.stream()) == std::nullopt);
  const std::size_t behind_3 = engine.launch();
  CHECK(hook.rollback(engine.stream()) == 3);  // finishes the gate (3 live), then undoes it
  const std::size_t after_rollback = engine.launch();
  engine.synchronize();
  CHECK(engine.seen(behind_3) == 3);
  CHECK(engine.seen(after_rollback) == 2);
  CHECK(hook.gates_abandoned() == 0);
}

TEST_CASE("gated swap: 200 updates while the engine steps, every step reads one version, the one "
          "the engine thread knew once it was launched") {
  GatedRig g(std::chrono::milliseconds(10'000), /*jitter=*/true);
  LoopbackRig& rig = g.rig;
  ReadingEngine& engine = g.engine;
  StepHook& hook = engine.hook();

  std::vector<std::pair<std::size_t, std::uint64_t>> expected;  // step, version
  // As an engine with asynchronous scheduling: step k is launched while step k - 1 still runs
  // (each step ends before the one after next is launched, so the stream never runs far ahead).
  std::unique_ptr<Event> ended[2] = {rig.backend().create_event(), rig.backend().create_event()};
  std::size_t launched = 0;
  for (std::uint64_t v = 1; v <= 200; ++v) {
    PublishHandle handle = rig.publish(v, {"base"});
    const auto deadline = deadline_from_now();
    while (hook.applied_version() < v) {
      if (std::chrono::steady_clock::now() > deadline) FAIL("update " << v << " never applied");
      Event& slot = *ended[launched++ % 2];
      REQUIRE(rig.backend().event_wait_for(slot, kTestDeadline));
      hook.before_step(engine.stream());
      const std::size_t step = engine.launch();
      hook.after_launch(engine.stream());
      rig.backend().event_record(slot, engine.stream());
      expected.emplace_back(step, hook.live_content_version(0));
    }
    handle.wait();
  }
  engine.synchronize();
  std::size_t wrong = 0;
  std::string first;
  for (const auto& [step, version] : expected) {
    if (engine.seen(step) == version) continue;
    if (wrong++ == 0) {
      first = "step " + std::to_string(step) + " read " + std::to_string(engine.seen(step)) +
              ", expected " + std::to_string(version);
    }
  }
  INFO(first);
  CHECK(wrong == 0);
  CHECK(hook.gated_swaps() == 200);  // every update went live behind a gate
  CHECK(hook.gates_abandoned() == 0);
}

TEST_CASE("gated swap: refused with a strategy other than remap, naming both settings") {
  const Layout layout = one_group_layout();
  CountingBackend backend;
  ReceiverConfig config;
  config.swap_strategy = SwapStrategy::kCopyIn;
  config.gated_swaps = true;
  CHECK_THROWS_WITH(Receiver(layout, backend, nullptr, config),
                    Catch::Contains("ReceiverConfig::gated_swaps is set, but "
                                    "ReceiverConfig::swap_strategy is copy_in"));
  CHECK(backend.inner().bytes_allocated() == 0);
  config.swap_strategy = SwapStrategy::kRemap;
  config.gate_deadline = std::chrono::milliseconds(0);
  CHECK_THROWS_WITH(Receiver(layout, backend, nullptr, config),
                    Catch::Contains("ReceiverConfig::gate_deadline (ms) must be positive, got 0"));
}
