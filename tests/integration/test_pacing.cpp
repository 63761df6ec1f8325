// Pacing (ReceiverConfig::decode_slowdown_budget, max_receive_bytes_per_second) against an engine
// whose steps take a known time and run at half speed while a bucket is in flight: the way a
// memory-bound decode step shares HBM bandwidth with a copy. A budget must hold (the mean step
// while an update streams in, what decode tokens/s sees, stays within budget x the idle step) and
// the transfer must slow down to pay for it; without a budget the same update slows the steps by
// far more. The mean, not the median: here, as on a GPU, only the steps that meet a bucket run
// slower, and a median can stay at the idle step while the mean is well over the budget.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <iterator>
#include <limits>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "deadline.h"
#include "shadowsync/host_backend.h"
#include "shadowsync/receiver.h"
#include "shadowsync/update_header.h"

using namespace shadowsync;
using namespace shadowsync::testing;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

constexpr std::size_t kBucketBytes = 4096;
constexpr std::size_t kBuckets = 32;
// A bucket keeps the link busy this long; unpaced, an update keeps it busy 32 x 2 ms.
constexpr auto kBucketTime = 2ms;
// The engine, unless a test says otherwise: its step at full speed, and how much slower it runs
// while a bucket is in flight.
struct EngineModel {
  std::chrono::milliseconds idle_step = 4ms;
  double slowdown_while_busy = 2.0;
};

// How far over the budget the engine's mean step may be, for the noise of a shared CPU. Under
// a sanitizer the threads run several times slower and are scheduled unevenly, so the budget
// gets more room there; the unpaced update still measures far above it (about 1.9).
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
constexpr double kStepNoise = 1.20;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer) || __has_feature(address_sanitizer)
constexpr double kStepNoise = 1.20;
#else
constexpr double kStepNoise = 1.08;
#endif
#else
constexpr double kStepNoise = 1.08;
#endif

// How far the receiver's step ratio may be from the engine's own: the two count nearly the same
// steps (the receiver from its receive's start, the engine over the transfer before ready).
constexpr double kReportAgreement = 0.04;

Layout test_layout() {
  std::vector<TensorSpec> specs;
  specs.push_back({"w", DType::kFloat32,
                   {static_cast<std::int64_t>(kBuckets * kBucketBytes / sizeof(float))}});
  return Layout::build(std::move(specs), {.bucket_bytes = kBucketBytes});
}

// When the link carried what: the last data bucket's end and the checksum block's post.
struct LinkLog {
  std::mutex mutex;
  Clock::time_point last_bucket_done{};
  Clock::time_point block_posted{};
  bool block_done = false;
};

// Rank 1 of 2: every broadcast keeps the link busy for a fixed time on the receiver's stream
// (a host stream task), then writes a fill byte over the bucket. With `bucket_checksum` set, a
// broadcast of kBuckets checksums is the sender's checksum block: it writes that checksum (of a
// filled bucket) for every bucket, at once, as a few bytes would take.
class SimulatedLink final : public Transport {
 public:
  SimulatedLink(HostBackend& backend, std::atomic<int>& busy, LinkLog& log,
                std::optional<std::uint64_t> bucket_checksum)
      : backend_(backend), busy_(busy), log_(log), bucket_checksum_(bucket_checksum) {}
  std::string_view name() const override { return "simulated link (test)"; }
  int rank() const override { return 1; }
  int world_size() const override { return 2; }
  void broadcast_async(void* buffer, std::size_t bytes, int /*root*/, Stream& stream) override {
    if (bucket_checksum_ && bytes == kBuckets * sizeof(std::uint64_t)) {
      {
        std::lock_guard lock(log_.mutex);
        log_.block_posted = Clock::now();
      }
      backend_.launch_async(stream, [this, buffer] {
        auto* sums = static_cast<std::uint64_t*>(buffer);
        std::fill(sums, sums + kBuckets, *bucket_checksum_);
        std::lock_guard lock(log_.mutex);
        log_.block_done = true;
      });
      return;
    }
    backend_.launch_async(stream, [this, buffer, bytes] {
      busy_.fetch_add(1);
      // Simulated transfer time: the work a real link would do, not a wait for a condition.
      std::this_thread::sleep_for(kBucketTime);
      std::memset(buffer, 0x5a, bytes);
      busy_.fetch_sub(1);
      std::lock_guard lock(log_.mutex);
      log_.last_bucket_done = Clock::now();
    });
  }
  std::optional<std::string> async_error() override { return std::nullopt; }
  void abort() noexcept override {}

 private:
  HostBackend& backend_;
  std::atomic<int>& busy_;
  LinkLog& log_;
  const std::optional<std::uint64_t> bucket_checksum_;
};

// The engine thread: steps back to back, each calling the step hook first. A step needs
// `idle_step` of work at full speed and progresses at 1 / slowdown_while_busy speed while the link
// is busy (checked every 100 us).
class ContendedEngine {
 public:
  struct Step {
    Clock::time_point start;
    Clock::duration duration;
    bool met_bucket = false;             // the link was busy at some check during the step
    std::optional<std::uint64_t> swapped;  // the version its before_step made live
  };

  // `between_steps`, when set, runs on the engine thread before each step's hook, as vLLM serves
  // a call between two steps; a version it returns was made live there.
  using BetweenSteps = std::function<std::optional<std::uint64_t>(Stream&)>;

  ContendedEngine(HostBackend& backend, Receiver& receiver, const std::atomic<int>& busy,
                  EngineModel model, BetweenSteps between_steps = nullptr)
      : receiver_(receiver),
        busy_(busy),
        model_(model),
        between_steps_(std::move(between_steps)),
        stream_(backend.create_stream(StreamPriority::kNormal)) {
    thread_ = std::thread([this] { run(); });
  }
  ~ContendedEngine() {
    stop_.store(true);
    thread_.join();
  }

  std::vector<Step> steps() const {
    std::lock_guard lock(mutex_);
    return steps_;
  }
  std::size_t step_count() const {
    std::lock_guard lock(mutex_);
    return steps_.size();
  }

 private:
  void run() {
    while (!stop_.load()) {
      const auto start = Clock::now();
      std::optional<std::uint64_t> swapped;
      if (between_steps_) swapped = between_steps_(*stream_);
      if (const auto hooked = receiver_.step_hook().before_step(*stream_)) swapped = hooked;
      bool met_bucket = false;
      double progress = 0.0;
      auto last = start;
      while (progress < 1.0) {
        std::this_thread::sleep_for(100us);  // the step's work, simulated
        const auto now = Clock::now();
        const bool busy = busy_.load() > 0;
        met_bucket = met_bucket || busy;
        const double speed = busy ? 1.0 / model_.slowdown_while_busy : 1.0;
        progress += speed * std::chrono::duration<double>(now - last).count() /
                    std::chrono::duration<double>(model_.idle_step).count();
        last = now;
      }
      std::lock_guard lock(mutex_);
      steps_.push_back({start, Clock::now() - start, met_bucket, swapped});
    }
  }

  Receiver& receiver_;
  const std::atomic<int>& busy_;
  const EngineModel model_;
  const BetweenSteps between_steps_;
  std::unique_ptr<Stream> stream_;
  std::atomic<bool> stop_{false};
  mutable std::mutex mutex_;
  std::vector<Step> steps_;
  std::thread thread_;
};

// A receiver over the SimulatedLink and the last update it reported: what the tests stream
// through. Members in construction order (the receiver uses the ones before it).
struct LinkRig {
  explicit LinkRig(const ReceiverConfig& config,
                   std::optional<std::uint64_t> bucket_checksum = std::nullopt)
      : receiver(layout, backend,
                 std::make_unique<SimulatedLink>(backend, busy, link_log, bucket_checksum),
                 config) {
    receiver.set_observer([this](const UpdateReport& r) {
      report = r;
      ready.store(true);
    });
  }
  HostBackend backend;
  std::atomic<int> busy{0};
  LinkLog link_log;
  const Layout layout = test_layout();
  Receiver receiver;
  std::atomic<bool> ready{false};
  UpdateReport report;
};

// The mean duration of the steps that started in [from, to) and ended before `to`.
double mean_step_ms(const std::vector<ContendedEngine::Step>& steps, Clock::time_point from,
                      Clock::time_point to) {
  std::vector<double> ms;
  for (const auto& s : steps) {
    if (s.start >= from && s.start + s.duration <= to) {
      ms.push_back(std::chrono::duration<double, std::milli>(s.duration).count());
    }
  }
  INFO("steps in the window: " << ms.size());
  REQUIRE(ms.size() >= 5);
  double sum = 0.0;
  for (const double v : ms) sum += v;
  return sum / static_cast<double>(ms.size());
}

struct Measured {
  double idle_step_ms;
  double step_during_ms;
  double ratio;
  std::chrono::nanoseconds transfer;
  PacingReport pacing;
  std::vector<ContendedEngine::Step> steps;  // every step, up to the one that made it live
};

// Lets the engine step alone for 30 steps, then streams one update while it steps, and measures
// the engine's step times in both windows. With `warmups`, that many updates go first, each after
// 30 idle steps, as a receiver that has paced before (its duty persists across updates).
Measured stream_one_update(ReceiverConfig config, EngineModel model = {}, int warmups = 0) {
  LinkRig rig(config);
  auto& [backend, busy, link_log, layout, receiver, ready, report] = rig;
  ContendedEngine engine(backend, receiver, busy, model);
  Clock::time_point idle_start{};
  for (std::uint64_t version = 1;; ++version) {
    const std::size_t idle_from = engine.step_count();
    wait_until([&] { return engine.step_count() >= idle_from + 30; }, "30 idle engine steps");
    const auto idle_end = Clock::now();
    ready.store(false);
    receiver.begin_update(make_update_header(layout, version, {"base"}));
    wait_until([&] { return ready.load(); }, "the update to be received", 60s);
    const auto ready_at = Clock::now();
    wait_until([&] { return receiver.step_hook().applied_version() == version; },
               "the engine to apply the update");
    REQUIRE(report.outcome == UpdateOutcome::kReady);
    if (version <= static_cast<std::uint64_t>(warmups)) {
      idle_start = Clock::now();
      continue;
    }
    wait_until(
        [&] {
          const auto all = engine.steps();
          return std::any_of(all.begin(), all.end(),
                             [&](const ContendedEngine::Step& s) { return s.swapped == version; });
        },
        "the step that made the update live to end");
    const auto steps = engine.steps();
    // The receive's window: a budget holds the complete update for a clean step before the offer.
    const auto received_at = ready_at - report.pacing.clean_step_wait;
    Measured m;
    m.idle_step_ms = mean_step_ms(steps, idle_start, idle_end);
    m.step_during_ms = mean_step_ms(steps, received_at - report.transfer, received_at);
    m.ratio = m.step_during_ms / m.idle_step_ms;
    m.transfer = report.transfer;
    m.pacing = report.pacing;
    m.steps = steps;
    return m;
  }
}

double ms(std::chrono::nanoseconds d) { return std::chrono::duration<double, std::milli>(d).count(); }

}  // namespace

TEST_CASE("a decode-slowdown budget holds, and the transfer slows down to pay for it",
          "[pacing]") {
  const Measured unpaced = stream_one_update({});
  ReceiverConfig config;
  config.decode_slowdown_budget = 1.10;
  const Measured paced = stream_one_update(config);
  INFO("unpaced: idle " << unpaced.idle_step_ms << " ms, during " << unpaced.step_during_ms
                        << " ms, ratio " << unpaced.ratio << ", transfer "
                        << ms(unpaced.transfer) << " ms");
  INFO("budget 1.10: idle " << paced.idle_step_ms << " ms, during " << paced.step_during_ms
                            << " ms, ratio " << paced.ratio << ", transfer "
                            << ms(paced.transfer) << " ms; report: idle "
                            << ms(paced.pacing.idle_step) << " ms, ratio "
                            << paced.pacing.step_ratio << ", steps " << paced.pacing.steps
                            << ", held " << ms(paced.pacing.held_back) << " ms, duty "
                            << paced.pacing.duty);
  // The engine model is real: unpaced, the update slows the steps far beyond the budget.
  CHECK(unpaced.ratio > 1.4);
  CHECK_FALSE(unpaced.pacing.paced);
  // The budget holds, as the engine measured it (a little noise allowed) ...
  CHECK(paced.ratio <= 1.10 * kStepNoise);
  // ... and as the receiver reports it: the mean of every step of the update (Pacer collects
  // them after each bucket; until it did, the report took the newest 32 only and, paced steps
  // being bimodal, said 1.23 where the engine measured 1.08 on a loaded CI machine).
  CHECK(paced.pacing.paced);
  CHECK(paced.pacing.budget == 1.10);
  CHECK(paced.pacing.step_ratio > 0.0);
  CHECK(paced.pacing.step_ratio <= 1.10 * kStepNoise);
  CHECK(std::abs(paced.pacing.step_ratio - paced.ratio) <= kReportAgreement);
  // Whatever the noise, paced is well below unpaced.
  CHECK(paced.ratio < 1.0 + 0.5 * (unpaced.ratio - 1.0));
  CHECK(paced.pacing.idle_step > 0ns);
  CHECK(std::abs(ms(paced.pacing.idle_step) - paced.idle_step_ms) < 0.2 * paced.idle_step_ms);
  CHECK(paced.pacing.steps >= 5);
  CHECK_FALSE(paced.pacing.deadline_limited);
  // The transfer paid for it: held back between buckets, several times longer than unpaced.
  CHECK(paced.pacing.held_back > paced.pacing.busy);
  CHECK(paced.pacing.duty < 0.5);
  CHECK(paced.transfer > 3 * unpaced.transfer);
}

// Few steps slowed, each by much: a bucket (2 ms) slows the step it meets to 4x, most steps
// meet none. That is how the steps looked in real vLLM on a GPU (a copy or the trainer's pack
// beside a step makes it far longer; the others are normal). The median step stays at the idle
// step while the mean, what tokens/s sees, does not: a pacer that held the median within the
// budget let the mean run far past it. After one warm-up update, as a receiver that paced before.
TEST_CASE("a budget holds when the few steps a bucket meets run much slower", "[pacing]") {
  ReceiverConfig config;
  config.decode_slowdown_budget = 1.10;
  const Measured paced =
      stream_one_update(config, {.idle_step = 4ms, .slowdown_while_busy = 4.0}, 1);
  INFO("budget 1.10, steps 4x slower while a bucket is in flight: idle " << paced.idle_step_ms
       << " ms, during " << paced.step_during_ms << " ms, ratio " << paced.ratio << ", transfer "
       << ms(paced.transfer) << " ms; report: ratio " << paced.pacing.step_ratio << ", duty "
       << paced.pacing.duty);
  CHECK(paced.ratio <= 1.10 * kStepNoise);
  CHECK(paced.pacing.step_ratio <= 1.10 * kStepNoise);
  // The report says what the engine saw (a median said 1.0 here while the engine ran 1.09-1.17x).
  CHECK(std::abs(paced.pacing.step_ratio - paced.ratio) <= kReportAgreement);
}

// A swap delays the step it runs before and, on an engine whose host prepares a step while the
// one before runs (vLLM's), the token of that one too. Offered as soon as its last bucket
// completed, the update went live at the next step, whose predecessor was the step the last
// bucket slowed: one token gap longer by both (Llama-3-8B on one H200, paced to 1.08: the
// swap's gap 6.3 ms against a 5.3 ms step, the rest of the window's steps as slow; the GPU's own
// step at the swap as long as any other). With a budget, or offer_after_clean_step without one,
// the receiver waits for a step that started after the last bucket: the step that makes the
// update live and the one before it met no bucket.
void check_the_swap_and_the_step_before_meet_no_bucket(const ReceiverConfig& config,
                                                       const EngineModel& model) {
  for (int run = 0; run < 3; ++run) {
    const Measured measured = stream_one_update(config, model, 1);
    const auto& steps = measured.steps;
    const auto swap = std::find_if(steps.begin(), steps.end(), [](const auto& s) {
      return s.swapped.has_value() && *s.swapped == 2;
    });
    REQUIRE(swap != steps.end());
    REQUIRE(swap != steps.begin());
    INFO("run " << run << ": held " << ms(measured.pacing.clean_step_wait)
                << " ms for a clean step" << (measured.pacing.clean_step_missed ? " (none came)" : ""));
    CHECK_FALSE(swap->met_bucket);
    CHECK_FALSE(std::prev(swap)->met_bucket);
    CHECK_FALSE(measured.pacing.clean_step_missed);
    CHECK(measured.pacing.clean_step_wait > 0ns);
    CHECK(ms(measured.pacing.clean_step_wait) <= 4 * measured.idle_step_ms + 50.0);
  }
}

TEST_CASE("with a budget, the swap and the step before it meet no bucket", "[pacing]") {
  ReceiverConfig config;
  config.decode_slowdown_budget = 1.10;
  check_the_swap_and_the_step_before_meet_no_bucket(config,
                                                    {.idle_step = 4ms, .slowdown_while_busy = 4.0});
}

TEST_CASE("offer_after_clean_step without a budget: the swap and the step before meet no bucket",
          "[pacing]") {
  ReceiverConfig config;
  config.offer_after_clean_step = true;
  // The engine the unpaced measurement above steps (the buckets go back to back: the transfer
  // must span a few steps for the window's mean).
  check_the_swap_and_the_step_before_meet_no_bucket(config, {});
  // Nothing was paced, and the report says so.
  const Measured measured = stream_one_update(config, {}, 1);
  CHECK_FALSE(measured.pacing.paced);
  CHECK(measured.pacing.held_back == 0ns);
}

// The checksum of one bucket as the SimulatedLink fills it, computed by the backend.
std::uint64_t filled_bucket_checksum(HostBackend& backend) {
  std::vector<std::byte> bucket(kBucketBytes, std::byte{0x5a});
  auto* sum = static_cast<std::uint64_t*>(backend.allocate(sizeof(std::uint64_t)));
  auto stream = backend.create_stream(StreamPriority::kNormal);
  backend.checksum_async(bucket.data(), bucket.size(), sum, *stream);
  backend.stream_synchronize(*stream);
  const std::uint64_t value = *sum;
  backend.deallocate(sum);
  return value;
}

// vLLM's finish_weight_update: the caller commits as soon as the trainer's send returned (the
// checksum block, the update's last broadcast, done), and the engine thread, between two steps,
// waits there for the update to be ready and makes it live; no step runs meanwhile. With
// checksums, offer_after_clean_step holds the block back until a step started after the last
// bucket: so the send returns after a clean step, and the swap's step and the one before it met
// no bucket. Held after the block instead, the update would wait for a step the waiting engine
// cannot start (4 idle steps, clean_step_missed) and go live after the step the last bucket
// slowed.
TEST_CASE("checksums on: a commit right after the send swaps after a step no bucket slowed",
          "[pacing]") {
  ReceiverConfig config;
  config.offer_after_clean_step = true;
  config.commit_mode = CommitMode::kCoordinated;
  HostBackend checksum_backend;
  LinkRig rig(config, filled_bucket_checksum(checksum_backend));
  auto& [backend, busy, link_log, layout, receiver, ready, report] = rig;
  std::atomic<std::uint64_t> to_commit{0};
  ContendedEngine engine(backend, receiver, busy, {}, [&](Stream& stream) {
    std::optional<std::uint64_t> committed;
    const std::uint64_t version = to_commit.load();
    bool sent = false;
    {
      std::lock_guard lock(link_log.mutex);
      sent = link_log.block_done;
    }
    if (version == 0 || !sent) return committed;
    wait_until([&] { return ready.load(); }, "the sent update to be ready for the commit", 10s);
    committed = receiver.commit(version, stream);
    to_commit.store(0);
    return committed;
  });
  for (std::uint64_t version = 1; version <= 2; ++version) {
    const std::size_t idle_from = engine.step_count();
    wait_until([&] { return engine.step_count() >= idle_from + 30; }, "30 idle engine steps");
    {
      std::lock_guard lock(link_log.mutex);
      link_log.block_done = false;
    }
    ready.store(false);
    to_commit.store(version);
    receiver.begin_update(make_update_header(layout, version, {"base"}, /*checksums=*/true));
    wait_until([&] { return receiver.step_hook().applied_version() == version; },
               "the engine to commit the update", 60s);
    REQUIRE(report.outcome == UpdateOutcome::kReady);
  }
  wait_until(
      [&] {
        const auto all = engine.steps();
        return std::any_of(all.begin(), all.end(),
                           [](const ContendedEngine::Step& s) { return s.swapped == 2u; });
      },
      "the step that made update 2 live to end");
  const auto steps = engine.steps();
  const auto swap = std::find_if(steps.begin(), steps.end(),
                                 [](const auto& s) { return s.swapped == 2u; });
  REQUIRE(swap != steps.begin());
  Clock::time_point last_bucket_done;
  Clock::time_point block_posted;
  {
    std::lock_guard lock(link_log.mutex);
    last_bucket_done = link_log.last_bucket_done;
    block_posted = link_log.block_posted;
  }
  const bool step_between = std::any_of(steps.begin(), steps.end(), [&](const auto& s) {
    return s.start > last_bucket_done && s.start < block_posted;
  });
  INFO("held " << ms(report.pacing.clean_step_wait) << " ms for a clean step"
               << (report.pacing.clean_step_missed ? " (none came)" : ""));
  CHECK(step_between);
  CHECK_FALSE(report.pacing.clean_step_missed);
  CHECK_FALSE(swap->met_bucket);
  CHECK_FALSE(std::prev(swap)->met_bucket);
}

// An idle engine starts no step: the complete update is offered after 4 idle steps anyway, and
// wait_applied makes it live.
TEST_CASE("with a budget and an idle engine, the update is offered after 4 idle steps",
          "[pacing]") {
  ReceiverConfig config;
  config.decode_slowdown_budget = 1.10;
  LinkRig rig(config);
  auto& [backend, busy, link_log, layout, receiver, ready, report] = rig;
  auto stream = backend.create_stream(StreamPriority::kNormal);
  for (int step = 0; step < 30; ++step) {  // the idle step the limit is counted in: about 2 ms
    REQUIRE_FALSE(receiver.step_hook().before_step(*stream).has_value());
    std::this_thread::sleep_for(2ms);  // the step's work, simulated
  }
  receiver.begin_update(make_update_header(layout, 1, {"base"}));
  wait_until([&] { return ready.load(); }, "the update to be received and offered", 60s);
  INFO("held " << ms(report.pacing.clean_step_wait) << " ms; idle step "
               << ms(report.pacing.idle_step) << " ms");
  REQUIRE(report.outcome == UpdateOutcome::kReady);
  CHECK(report.pacing.clean_step_missed);
  CHECK(report.pacing.idle_step > 0ns);
  CHECK(report.pacing.clean_step_wait >= 4 * report.pacing.idle_step);
  CHECK(receiver.step_hook().applied_version() == 0);
  CHECK(receiver.step_hook().wait_applied(1, Clock::now() + 10s, *stream));
  CHECK(receiver.step_hook().applied_version() == 1);
}

TEST_CASE("a rate cap spaces the buckets to the rate", "[pacing]") {
  ReceiverConfig config;
  // 5 ms per 4 KiB bucket: 2.5 times a bucket's own 2 ms.
  config.max_receive_bytes_per_second = kBucketBytes * 200;
  const Measured capped = stream_one_update(config);
  INFO("transfer " << ms(capped.transfer) << " ms, held " << ms(capped.pacing.held_back)
                   << " ms");
  CHECK(capped.pacing.paced);
  CHECK_FALSE(capped.pacing.budget.has_value());
  // 31 holds follow 31 buckets, each up to 5 ms from the bucket's post; the last has none.
  CHECK(ms(capped.transfer) >= 31 * 5.0);
  CHECK(capped.pacing.held_back > 20 * 2ms);
}

TEST_CASE("pacing never makes an update miss its deadline", "[pacing]") {
  ReceiverConfig config;
  config.decode_slowdown_budget = 1.0;  // no slowdown allowed: only the deadline bounds it
  config.update_deadline = 600ms;
  const Measured m = stream_one_update(config);
  INFO("transfer " << ms(m.transfer) << " ms, held " << ms(m.pacing.held_back) << " ms");
  CHECK(m.pacing.deadline_limited);
  CHECK(m.transfer < 600ms);
  CHECK(m.transfer > 200ms);  // it did hold back: unpaced takes about 64 ms
}

TEST_CASE("a budget below 1.0, NaN or infinite is refused before anything is allocated",
          "[pacing]") {
  const Layout layout = test_layout();
  for (const double bad : {0.95, 0.0, -1.0, std::numeric_limits<double>::quiet_NaN(),
                           std::numeric_limits<double>::infinity()}) {
    HostBackend backend;
    ReceiverConfig config;
    config.decode_slowdown_budget = bad;
    INFO("budget " << bad);
    try {
      Receiver receiver(layout, backend, nullptr, config);
      FAIL("accepted");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kInvalidArgument);
      CHECK_THAT(e.what(), Catch::Contains("ReceiverConfig::decode_slowdown_budget is"));
      CHECK_THAT(e.what(), Catch::Contains("at least 1.0"));
    }
    CHECK(backend.bytes_allocated() == 0);
  }
}

TEST_CASE("the step hook records step times only when pacing is set", "[pacing]") {
  HostBackend backend;
  const Layout layout = test_layout();
  auto stream = backend.create_stream(StreamPriority::kNormal);
  {
    Receiver receiver(layout, backend, nullptr, {});
    CHECK(receiver.step_hook().step_times() == nullptr);
  }
  ReceiverConfig config;
  config.decode_slowdown_budget = 1.05;
  Receiver receiver(layout, backend, nullptr, config);
  const StepTimes* times = receiver.step_hook().step_times();
  REQUIRE(times != nullptr);
  for (int i = 0; i < 5; ++i) receiver.step_hook().before_step(*stream);
  CHECK(times->count() == 5);
  CHECK(times->intervals_since(0, 100).size() == 4);
}
