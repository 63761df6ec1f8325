// Gated swaps (ReceiverConfig::gated_swaps, plugin/core/gated_swap.h): before_step closes a gate
// on the engine stream instead of swapping, the engine enqueues its step behind it, and
// after_launch remaps once the step before the gate has ended, then opens it. Runs on remap arenas
// in host memory (remap_host_backend.h: remap on the CPU) with the host backend's gate (a task
// that holds the stream's thread until open()), probed: the test sees who waits for the work
// before the gate (ProbedRemapBackend below).
//
// What each step read is recorded by the step itself (the version of every word of the live
// arena, or torn), and compared with what the engine thread knew once the step was launched.
//
// Checked to fail without their behaviour (each broken by hand once, then restored): with
// GatedSwap::claim not waiting for the work before the gate, the first test sees after_launch
// return while the step before the gate is still held (and that step read the new version); it
// holds the step until after_launch's thread waits for it or after_launch returns, so this does
// not depend on who wins a race; with after_launch not remapping (the gate opened without the
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
#include <future>
#include <memory>
#include <optional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "counting_backend.h"
#include "deadline.h"
#include "fake_engine.h"
#include "pattern.h"
#include "remap_host_backend.h"
#include "shadowsync/error.h"
#include "shadowsync/host_backend.h"
#include "shadowsync/loopback_transport.h"
#include "shadowsync/receiver.h"
#include "shadowsync/sender.h"

using namespace shadowsync;
using namespace shadowsync::testing;

namespace {

Layout one_group_layout() {
  return Layout::build({{"embed", DType::kBFloat16, {97, 16}, "base"},
                        {"l0.w", DType::kFloat32, {300}, "base"},
                        {"l1.w", DType::kFloat16, {513}, "base"}},
                       {.bucket_bytes = 2048});
}

ReceiverConfig gated_config(std::chrono::milliseconds gate_deadline) {
  ReceiverConfig config;
  config.swap_strategy = SwapStrategy::kRemap;
  config.engine_uses_cuda_graphs = true;
  config.gated_swaps = true;
  config.gate_deadline = gate_deadline;
  return config;
}

HostBackendOptions backend_options(bool jitter) {
  HostBackendOptions options;
  if (jitter) {
    options.max_task_jitter = std::chrono::microseconds(20);
    options.jitter_seed = 5;
  }
  return options;
}

// Tells the test when the thread that calls after_launch waits for the work before the gate, and
// when its after_launch returned. With the step before the gate held, the wait must come and the
// return must not: a remap then would move the live pages under that step.
struct AfterLaunchProbe {
  // On the thread that calls after_launch, before it.
  void enter() {
    std::lock_guard lock(mutex);
    thread = std::this_thread::get_id();
  }
  // On that thread, once after_launch returned.
  void leave() {
    {
      std::lock_guard lock(mutex);
      returned = true;
    }
    changed.notify_all();
  }
  // From the gate, on whichever thread waits for the work before it (the watchdog waits too).
  void waits_for_work_before() {
    {
      std::lock_guard lock(mutex);
      if (std::this_thread::get_id() != thread) return;
      waiting = true;
    }
    changed.notify_all();
  }

  std::mutex mutex;
  std::condition_variable changed;
  std::thread::id thread;  // none until enter()
  bool waiting = false;
  bool returned = false;
};

// The host backend's gate, telling the probe who waits for the work before it.
class ProbedGate final : public StreamGate {
 public:
  ProbedGate(std::unique_ptr<StreamGate> gate, AfterLaunchProbe& probe)
      : gate_(std::move(gate)), probe_(probe) {}
  void close(Stream& stream) override { gate_->close(stream); }
  bool wait_work_before(std::chrono::nanoseconds timeout) override {
    probe_.waits_for_work_before();
    return gate_->wait_work_before(timeout);
  }
  void open() noexcept override { gate_->open(); }

 private:
  const std::unique_ptr<StreamGate> gate_;
  AfterLaunchProbe& probe_;
};

// RemapHostBackend (remap_host_backend.h: remap arenas in host memory) whose gates are probed.
class ProbedRemapBackend final : public CountingBackend {
 public:
  ProbedRemapBackend(HostBackend& inner, AfterLaunchProbe& probe)
      : CountingBackend(inner), probe_(probe) {}
  std::string_view name() const override { return "host-remap"; }
  std::string remap_unsupported_reason() const override { return ""; }
  std::unique_ptr<RemappableArena> create_remappable_arena(std::size_t bytes) override {
    return std::make_unique<HostArena>(bytes, 0, &inner());
  }
  std::unique_ptr<StreamGate> create_stream_gate() override {
    return std::make_unique<ProbedGate>(inner().create_stream_gate(), probe_);
  }

 private:
  AfterLaunchProbe& probe_;
};

// An engine whose steps record the version they read in the live arena (every word of every
// tensor; kTornVersion when two words disagree).
class ReadingEngine {
 public:
  ReadingEngine(HostBackend& backend, StepHook& hook, const Layout& layout)
      : backend_(backend), hook_(hook), layout_(layout),
        stream_(backend.create_stream(StreamPriority::kNormal)) {}
  ~ReadingEngine() { backend_.stream_synchronize(*stream_); }

  Stream& stream() { return *stream_; }
  StepHook& hook() { return hook_; }

  // Enqueues a step that reads the live arena when it runs; returns its index in seen().
  std::size_t launch(std::function<void()> first = {}) {
    const std::size_t index = seen_.size();
    std::uint64_t* seen = &seen_.emplace_back(0);  // a deque: stays put while more are added
    const std::byte* live = hook().live_arena(0);
    backend_.launch_async(*stream_, [this, seen, live, first = std::move(first)] {
      if (first) first();
      *seen = read(live);
    });
    return index;
  }
  void synchronize() { backend_.stream_synchronize(*stream_); }
  // After synchronize().
  std::uint64_t seen(std::size_t step) const { return seen_[step]; }
  // The version the live arena holds now, read on the calling thread: while nothing swaps.
  std::uint64_t read_live() const { return read(hook_.live_arena(0)); }

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

  HostBackend& backend_;
  StepHook& hook_;
  const Layout& layout_;
  std::unique_ptr<Stream> stream_;
  std::deque<std::uint64_t> seen_;  // written by the stream's thread, read after synchronize
};

// The set-up of every test here: a sender and a gated receiver on the CPU (as LoopbackRig wires
// them, on a backend whose gates are probed), and an engine that reads.
struct GatedRig {
  explicit GatedRig(std::chrono::milliseconds gate_deadline, bool jitter = false)
      : layout(one_group_layout()), backend(backend_options(jitter)), endpoints(backend, probe),
        communicator(2), sender(layout, endpoints, communicator.transport(0)),
        receiver(layout, endpoints, communicator.transport(1), gated_config(gate_deadline)),
        engine(backend, receiver.step_hook(), layout) {}

  // Publishes pattern tensors of the base group at `version` and begins the update.
  PublishHandle publish(std::uint64_t version) {
    const std::vector<std::string> groups = {"base"};
    while (!published.empty() && published.front().first.done()) published.pop_front();
    auto tensors = std::make_unique<HostTensors>(layout, groups, version);
    PublishHandle handle = sender.publish(version, groups, tensors->sources());
    published.emplace_back(handle, std::move(tensors));
    receiver.begin_update(handle.header());
    return handle;
  }
  // Sends update `version` and waits until the receiver offers it.
  void offer(std::uint64_t version) {
    publish(version).wait();
    wait_until([&] { return receiver.stats().updates_ready >= version &&
                            receiver.step_hook().has_pending(); },
               "update " + std::to_string(version) + " offered to the engine");
  }

  const Layout layout;
  AfterLaunchProbe probe;
  HostBackend backend;  // the engine's streams
  ProbedRemapBackend endpoints;
  LoopbackCommunicator communicator;
  // Each publish's tensors, until it is done (they outlive the sender and the receiver).
  std::deque<std::pair<PublishHandle, std::unique_ptr<HostTensors>>> published;
  Sender sender;
  Receiver receiver;
  ReadingEngine engine;
};

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

TEST_CASE("gated swap: before_step returns while the step before is in flight; after_launch "
          "waits for that step before it remaps; the step behind the gate runs on the new "
          "version, the step before on the old") {
  Latch latch;  // outlives the rig: the held step may still be leaving its wait
  GatedRig g(std::chrono::milliseconds(10'000));
  ReadingEngine& engine = g.engine;
  StepHook& hook = engine.hook();
  AfterLaunchProbe& probe = g.probe;
  std::future<std::optional<std::uint64_t>> after_launch;  // waited for after the latch opens
  struct OpenAtExit {
    ~OpenAtExit() { latch.open(); }  // whatever fails, the held step ends
    Latch& latch;
  } const open_at_exit{latch};

  g.offer(1);
  const std::size_t before = engine.launch([&] { latch.wait(); });  // the step in flight

  // The gate closes; nothing is swapped yet and the engine thread is back at once, the step
  // before still held by the latch.
  CHECK_FALSE(hook.before_step(engine.stream()).has_value());
  CHECK(hook.gated_swaps() == 1);
  CHECK(hook.applied_version() == 0);
  CHECK(hook.has_pending());
  const std::size_t behind = engine.launch();  // enqueued behind the gate

  // after_launch on a thread of its own (the engine thread's role passes to it until it returns):
  // with the step before still held, it must wait for that step, not remap.
  after_launch = std::async(std::launch::async, [&] {
    probe.enter();
    const std::optional<std::uint64_t> applied = hook.after_launch(engine.stream());
    probe.leave();
    return applied;
  });
  {
    std::unique_lock lock(probe.mutex);
    if (!probe.changed.wait_for(lock, kTestDeadline,
                                [&] { return probe.waiting || probe.returned; })) {
      FAIL("after_launch neither waited for the step before the gate nor returned within "
           << kTestDeadline.count() << " s");
    }
    INFO("after_launch returned while the step before the gate was held: it did not wait");
    CHECK_FALSE(probe.returned);
  }
  CHECK(hook.applied_version() == 0);  // nothing made live while the step before runs
  CHECK(engine.read_live() == 0);      // and no page of the live range moved

  latch.open();
  REQUIRE(after_launch.wait_for(kTestDeadline) == std::future_status::ready);
  const std::optional<std::uint64_t> applied = after_launch.get();
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
  ReadingEngine& engine = g.engine;
  StepHook& hook = engine.hook();

  g.offer(1);
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
  g.offer(2);
  CHECK(hook.before_step(engine.stream()) == std::optional<std::uint64_t>(2));
  CHECK(hook.gated_swaps() == 1);
}

TEST_CASE("gated swap: an engine that comes back to before_step without after_launch finishes "
          "the gate there; wait_applied and rollback finish it too") {
  GatedRig g(std::chrono::milliseconds(10'000));
  ReadingEngine& engine = g.engine;
  StepHook& hook = engine.hook();

  g.offer(1);
  CHECK_FALSE(hook.before_step(engine.stream()).has_value());
  const std::size_t behind = engine.launch();
  CHECK(hook.before_step(engine.stream()) == std::optional<std::uint64_t>(1));
  engine.synchronize();
  CHECK(engine.seen(behind) == 1);

  g.offer(2);
  CHECK_FALSE(hook.before_step(engine.stream()).has_value());
  const std::size_t behind_2 = engine.launch();
  CHECK(hook.wait_applied(2, deadline_from_now(), engine.stream()));
  engine.synchronize();
  CHECK(engine.seen(behind_2) == 2);

  g.offer(3);
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
  ReadingEngine& engine = g.engine;
  StepHook& hook = engine.hook();

  std::vector<std::pair<std::size_t, std::uint64_t>> expected;  // step, version
  // As an engine with asynchronous scheduling: step k is launched while step k - 1 still runs
  // (each step ends before the one after next is launched, so the stream never runs far ahead).
  std::unique_ptr<Event> ended[2] = {g.backend.create_event(), g.backend.create_event()};
  std::size_t launched = 0;
  for (std::uint64_t v = 1; v <= 200; ++v) {
    PublishHandle handle = g.publish(v);
    const auto deadline = deadline_from_now();
    while (hook.applied_version() < v) {
      if (std::chrono::steady_clock::now() > deadline) FAIL("update " << v << " never applied");
      Event& slot = *ended[launched++ % 2];
      REQUIRE(g.backend.event_wait_for(slot, kTestDeadline));
      hook.before_step(engine.stream());
      const std::size_t step = engine.launch();
      hook.after_launch(engine.stream());
      g.backend.event_record(slot, engine.stream());
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
