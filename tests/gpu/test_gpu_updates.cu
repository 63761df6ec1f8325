// The stress test of tests/integration/test_stress.cpp on real GPUs: a trainer thread on GPU 0
// publishes N mixed updates (base only, LoRA only, both; the last of each phase carries every
// group) through NCCL to R receivers, each on its own GPU r+1, while a GpuFakeEngine decodes on
// every receiver's GPU and the oracle (tests/support/pattern.h) checks every step: no torn step,
// every group at the version the applied-update history says, applied versions strictly
// increasing, the final version applied, no failed update.
//
// Usage: test_gpu_updates [--receivers R] [--updates N] [--mode sync|events|both]
//                         [--layout small|medium] [--seed S]
//   --mode both runs N updates with an engine that synchronizes its stream after every step
//   (versions 1..N), then N more with an engine that waits only on events (N+1..2N).
//   --layout medium: base of 64 tensors, ~507 MiB bf16/fp32, two LoRA adapters of ~8 MiB,
//   64 MiB buckets. small: ~2 MiB in 256 KiB buckets (for compute-sanitizer runs).
//
// A standalone program (no Catch2): exit 0 passes, 1 fails, 2 bad arguments, 77 skips (fewer than
// R+1 GPUs; ctest's SKIP_RETURN_CODE). Every wait has a deadline, and a watchdog ends the process
// if anything (NCCL included) hangs past the overall one.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "fake_engine.h"
#include "gpu_fake_engine.cuh"
#include "watchdog.h"
#include "shadowsync/backend.h"
#include "shadowsync/cuda_backend.h"
#include "shadowsync/error.h"
#include "shadowsync/layout.h"
#include "shadowsync/nccl_transport.h"
#include "shadowsync/receiver.h"
#include "shadowsync/sender.h"
#include "shadowsync/update_header.h"

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using shadowsync::CudaBackend;
using shadowsync::DeviceBuffer;
using shadowsync::DType;
using shadowsync::Layout;
using shadowsync::NcclTransport;
using shadowsync::NcclTransportConfig;
using shadowsync::NcclUniqueId;
using shadowsync::PublishHandle;
using shadowsync::Receiver;
using shadowsync::ReceiverConfig;
using shadowsync::Sender;
using shadowsync::SenderConfig;
using shadowsync::SourceTensor;
using shadowsync::StreamPriority;
using shadowsync::TensorSpec;
using shadowsync::UpdateOutcome;
using shadowsync::UpdateReport;
using shadowsync::testing::GpuFakeEngine;
using shadowsync::testing::GpuFakeEngineOptions;
using shadowsync::testing::StepRecord;
using shadowsync::testing::UpdateHistory;

constexpr auto kWatchdogTimeout = 300s;  // the whole run, NCCL init and teardown included
constexpr auto kWaitTimeout = 60s;       // any single wait (a phase barrier, a publish, a fill)
constexpr auto kPhaseTimeout = 180s;     // one phase of updates on the engine side

enum class Mode { kSync, kEvents };
const char* mode_name(Mode mode) { return mode == Mode::kSync ? "sync" : "events"; }

struct Options {
  int receivers = 1;
  std::uint64_t updates = 1000;
  std::string mode = "both";
  std::string layout = "medium";
  std::uint64_t seed = 7;
};

template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

void usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s [--receivers R] [--updates N] [--mode sync|events|both] "
               "[--layout small|medium] [--seed S]\n",
               argv0);
}

std::optional<Options> parse(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::optional<std::string> {
      if (i + 1 >= argc) return std::nullopt;
      return std::string(argv[++i]);
    };
    auto number = [&](std::uint64_t minimum) -> std::optional<std::uint64_t> {
      const auto text = value();
      if (!text || text->empty()) return std::nullopt;
      char* end = nullptr;
      const unsigned long long n = std::strtoull(text->c_str(), &end, 10);
      if (*end != '\0' || n < minimum) return std::nullopt;
      return n;
    };
    if (arg == "--receivers") {
      const auto n = number(1);
      if (!n || *n > 64) return std::nullopt;
      options.receivers = static_cast<int>(*n);
    } else if (arg == "--updates") {
      const auto n = number(1);
      if (!n) return std::nullopt;
      options.updates = *n;
    } else if (arg == "--seed") {
      const auto n = number(0);
      if (!n) return std::nullopt;
      options.seed = *n;
    } else if (arg == "--mode") {
      const auto v = value();
      if (!v || (*v != "sync" && *v != "events" && *v != "both")) return std::nullopt;
      options.mode = *v;
    } else if (arg == "--layout") {
      const auto v = value();
      if (!v || (*v != "small" && *v != "medium")) return std::nullopt;
      options.layout = *v;
    } else {
      return std::nullopt;
    }
  }
  return options;
}

// ~507 MiB base (64 tensors, bf16 and fp32, some with partial 8-byte tail words, some crossing
// bucket boundaries) and two LoRA adapters of ~8 MiB; 64 MiB buckets.
Layout medium_layout() {
  std::vector<TensorSpec> specs;
  specs.push_back({"embed", DType::kBFloat16, {6000, 2048}, "base"});
  for (int l = 0; l < 15; ++l) {
    const std::string p = cat("layers.", l, ".");
    specs.push_back({p + "wqkv", DType::kBFloat16, {3072, 2048}, "base"});
    specs.push_back({p + "wo", DType::kBFloat16, {2048, 2048}, "base"});
    specs.push_back({p + "mlp", DType::kBFloat16, {2731, 2048}, "base"});
    specs.push_back({p + "norm", DType::kBFloat16, {2051}, "base"});  // 4102 B: partial tail word
  }
  specs.push_back({"final_norm", DType::kFloat32, {2048}, "base"});
  specs.push_back({"rope", DType::kFloat32, {999}, "base"});  // 3996 B: partial tail word
  specs.push_back({"head", DType::kBFloat16, {6000, 2048}, "base"});
  for (int l = 0; l < 4; ++l) {
    specs.push_back({cat("lora_a.", l, ".A"), DType::kBFloat16, {256, 2048}, "lora_a"});
    specs.push_back({cat("lora_a.", l, ".B"), DType::kBFloat16, {2048, 256}, "lora_a"});
  }
  for (int l = 0; l < 4; ++l) {
    specs.push_back({cat("lora_b.", l, ".A"), DType::kFloat32, {128, 2048}, "lora_b"});
    specs.push_back({cat("lora_b.", l, ".B"), DType::kFloat32, {2048, 128}, "lora_b"});
  }
  specs.push_back({"lora_b.scale", DType::kBFloat16, {333}, "lora_b"});  // 666 B
  return Layout::build(std::move(specs), {.bucket_bytes = std::size_t{64} << 20});
}

// ~2 MiB in 256 KiB buckets: quick under compute-sanitizer.
Layout small_layout() {
  std::vector<TensorSpec> specs;
  specs.push_back({"embed", DType::kBFloat16, {512, 256}, "base"});
  for (int l = 0; l < 4; ++l) {
    specs.push_back({cat("layers.", l, ".w"), DType::kBFloat16, {768, 256}, "base"});
    specs.push_back({cat("layers.", l, ".norm"), DType::kBFloat16, {257}, "base"});
  }
  specs.push_back({"head", DType::kFloat32, {300, 256}, "base"});
  specs.push_back({"bias", DType::kInt8, {777}, "base"});
  specs.push_back({"a.A", DType::kBFloat16, {64, 256}, "lora_a"});
  specs.push_back({"a.B", DType::kBFloat16, {256, 64}, "lora_a"});
  specs.push_back({"b.A", DType::kFloat32, {70}, "lora_b"});
  specs.push_back({"b.B", DType::kFloat16, {96, 64}, "lora_b"});
  return Layout::build(std::move(specs), {.bucket_bytes = std::size_t{256} << 10});
}

// ---------------------------------------------------------------------------------------------
// State shared by the trainer and the receiver threads.
// ---------------------------------------------------------------------------------------------

struct ReceiverResult {
  int index = 0;
  std::string error;                    // an exception on the receiver thread
  std::vector<std::string> phase_lines; // one summary per phase
  std::vector<StepRecord> records;
  std::vector<std::uint64_t> applied;   // what before_step returned, in order
  std::uint64_t steps = 0;
  std::uint64_t full_steps = 0;
  std::uint64_t torn_steps = 0;    // device counter
  std::uint64_t torn_records = 0;  // torn steps seen in the records
  std::string first_torn;
  std::uint64_t final_applied = 0;
  shadowsync::ReceiverStats stats;
  // Transfer figures of the updates received (UpdateReport, outcome kReady).
  std::uint64_t ready_reports = 0;
  double bytes = 0;
  double seconds = 0;
  double base_bytes = 0;
  double base_seconds = 0;
  std::uint64_t failed_reports = 0;
  std::string first_failed_report;
};

class Shared {
 public:
  Shared(const Layout& layout, const Options& options, std::vector<Mode> phases)
      : layout(layout), options(options), phases(std::move(phases)),
        receivers(static_cast<std::size_t>(options.receivers), nullptr),
        ready_for_phase(this->phases.size(), 0) {}

  const Layout& layout;
  const Options& options;
  const std::vector<Mode> phases;
  NcclUniqueId id;

  void fail(const std::string& why) {
    {
      std::lock_guard lock(mutex_);
      if (first_failure_.empty()) first_failure_ = why;
    }
    failed_.store(true);
    cv_.notify_all();
  }
  bool failed() const { return failed_.load(); }
  std::string first_failure() const {
    std::lock_guard lock(mutex_);
    return first_failure_;
  }

  // Waits until `condition` (checked under the lock) holds; false on deadline (then the run is
  // failed with `what`) or, with stop_on_failure, as soon as the run has failed.
  bool wait(const std::function<bool()>& condition, const std::string& what,
            std::chrono::milliseconds timeout = kWaitTimeout, bool stop_on_failure = true) {
    std::unique_lock lock(mutex_);
    const bool ok = cv_.wait_for(
        lock, timeout, [&] { return (stop_on_failure && failed_.load()) || condition(); });
    if (stop_on_failure && failed_.load()) return false;
    if (!ok) {
      lock.unlock();
      fail(cat("timed out after ", std::chrono::duration_cast<std::chrono::seconds>(timeout).count(),
               " s waiting for ", what));
      return false;
    }
    return true;
  }
  template <typename F>
  void update(F&& f) {
    {
      std::lock_guard lock(mutex_);
      f();
    }
    cv_.notify_all();
  }

  // Guarded by the mutex (update()/wait()):
  std::vector<Receiver*> receivers;      // set by each receiver thread once it is ready
  std::vector<int> ready_for_phase;      // receivers whose engine for the phase is up
  bool trainer_done = false;             // the trainer makes no more calls into receivers
  UpdateHistory history;

 private:
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::atomic<bool> failed_{false};
  std::string first_failure_;
};

NcclTransportConfig transport_config() {
  NcclTransportConfig config;
  config.init_timeout = 120s;
  config.enqueue_timeout = 60s;
  config.finalize_timeout = 30s;
  return config;
}

// A hot, bounded wait for an event (the trainer waits for its fill kernels before publishing).
void wait_event(CudaBackend& backend, shadowsync::Event& event, const char* what) {
  const auto deadline = Clock::now() + kWaitTimeout;
  while (!backend.event_query(event)) {
    if (Clock::now() > deadline) {
      throw std::runtime_error(cat("device ", backend.device(), ": ", what,
                                   " did not complete within ", kWaitTimeout.count(), " s"));
    }
    std::this_thread::yield();
  }
}

void random_pause(std::mt19937_64& rng) {
  // Mostly nothing; sometimes a yield or a short sleep, to shuffle the interleavings.
  const auto dice = rng() % 1000;
  if (dice < 900) return;
  if (dice < 995) {
    std::this_thread::yield();
    return;
  }
  std::this_thread::sleep_for(std::chrono::microseconds(rng() % 200));
}

// ---------------------------------------------------------------------------------------------
// The trainer: GPU 0, rank 0.
// ---------------------------------------------------------------------------------------------

void trainer_main(Shared& shared) {
  const Layout& layout = shared.layout;
  const std::uint64_t n = shared.options.updates;
  const int world = shared.options.receivers + 1;
  CudaBackend backend(0);
  std::unique_ptr<NcclTransport> transport =
      NcclTransport::create(shared.id, 0, world, 0, transport_config());
  SenderConfig sender_config;
  sender_config.update_deadline = 30'000ms;
  Sender sender(layout, backend, std::move(transport), sender_config);

  // Two sets of trainer tensors, each laid out as one arena image per group: Sender::publish gets
  // them as scattered tensors (packed through staging), publish_arenas as arenas (sent as they
  // are). A set is refilled only after the publish that last used it is done.
  const std::size_t groups = layout.groups().size();
  std::vector<std::vector<DeviceBuffer>> sets(2);
  std::vector<std::vector<SourceTensor>> sources(2);
  std::vector<std::vector<const void*>> arenas(2);
  for (int s = 0; s < 2; ++s) {
    for (std::size_t g = 0; g < groups; ++g) {
      const auto& group = layout.groups()[g];
      sets[s].emplace_back(backend, group.arena_bytes());
      for (const auto& placement : group.tensors()) {
        sources[s].push_back(SourceTensor{placement.spec.name,
                                          sets[s][g].data() + placement.offset,
                                          placement.spec.dtype, placement.spec.shape});
      }
    }
  }
  auto stream = backend.create_stream(StreamPriority::kNormal);
  auto filled = backend.create_event();
  std::optional<PublishHandle> last_use[2];

  const std::vector<std::vector<std::string>> kinds = {
      {"base"}, {"lora_a"}, {"lora_b"}, {"lora_a", "lora_b"}, {"base", "lora_a"},
      {"base", "lora_a", "lora_b"}};
  std::vector<std::string> all_groups;
  for (const auto& group : layout.groups()) all_groups.push_back(group.name());

  auto wait_handle = [&](const PublishHandle& handle) {
    if (!handle.wait_for(kWaitTimeout)) {
      throw std::runtime_error(cat("publish of version ", handle.header().version,
                                   " not done within ", kWaitTimeout.count(), " s"));
    }
  };

  std::mt19937_64 rng(shared.options.seed);
  for (std::size_t phase = 0; phase < shared.phases.size(); ++phase) {
    const int receivers = shared.options.receivers;
    if (!shared.wait([&] { return shared.ready_for_phase[phase] == receivers; },
                     cat("every receiver's engine for phase ", phase + 1))) {
      return;
    }
    std::vector<Receiver*> targets;
    shared.update([&] { targets = shared.receivers; });
    for (std::uint64_t i = 1; i <= n; ++i) {
      if (shared.failed()) return;
      const std::uint64_t v = phase * n + i;
      // The last update of a phase carries every group, so the final state is fully determined.
      // The very first is packed (publish()), so the sender's staging is allocated before any
      // transfer is in flight.
      const std::vector<std::string>& names = i == n ? all_groups : kinds[rng() % kinds.size()];
      const int set = static_cast<int>(v % 2);
      if (last_use[set]) wait_handle(*last_use[set]);

      std::vector<std::size_t> indices;
      std::vector<const void*> group_arenas;
      for (const std::string& name : names) {
        const std::size_t g = layout.group_index(name);
        indices.push_back(g);
        group_arenas.push_back(sets[set][g].data());
        shadowsync::testing::fill_group_async(backend, *stream, layout, g, v, sets[set][g].data());
      }
      backend.event_record(*filled, *stream);
      wait_event(backend, *filled, "the trainer's fill kernels");
      shared.update([&] { shared.history.add(v, indices); });

      const bool packed = v == 1 || rng() % 4 != 0;
      PublishHandle handle = packed ? sender.publish(v, names, sources[set])
                                    : sender.publish_arenas(v, names, group_arenas);
      last_use[set] = handle;
      for (Receiver* receiver : targets) receiver->begin_update(handle.header());

      const auto dice = rng() % 8;
      if (dice < 3) wait_handle(handle);  // sometimes the trainer waits for its send,
      if (dice == 0) {                    // and sometimes until every engine runs the new version
        const auto deadline = Clock::now() + kWaitTimeout;
        for (Receiver* receiver : targets) {
          while (receiver->step_hook().applied_version() < v) {
            if (shared.failed()) return;
            if (Clock::now() > deadline) {
              throw std::runtime_error(cat("version ", v, " not applied by every engine within ",
                                           kWaitTimeout.count(), " s"));
            }
            std::this_thread::yield();
          }
        }
      }
      random_pause(rng);
    }
  }
  for (auto& handle : last_use) {
    if (handle) wait_handle(*handle);
  }
}

// ---------------------------------------------------------------------------------------------
// A receiver: GPU r+1, rank r+1, with its engine.
// ---------------------------------------------------------------------------------------------

void receiver_main(Shared& shared, int r, ReceiverResult& result) {
  const Layout& layout = shared.layout;
  const std::uint64_t n = shared.options.updates;
  const int device = r + 1;
  CudaBackend backend(device);
  std::unique_ptr<NcclTransport> transport = NcclTransport::create(
      shared.id, r + 1, shared.options.receivers + 1, device, transport_config());
  ReceiverConfig config;
  config.update_deadline = 30'000ms;
  std::mutex reports_mutex;  // before the receiver: its thread reports until it is destroyed
  Receiver receiver(layout, backend, std::move(transport), config);

  receiver.set_observer([&](const UpdateReport& report) {
    std::lock_guard lock(reports_mutex);
    if (report.outcome == UpdateOutcome::kReady) {
      const double seconds = std::chrono::duration<double>(report.transfer).count();
      ++result.ready_reports;
      result.bytes += static_cast<double>(report.bytes);
      result.seconds += seconds;
      if (std::find(report.groups.begin(), report.groups.end(), std::size_t{0}) !=
          report.groups.end()) {
        result.base_bytes += static_cast<double>(report.bytes);
        result.base_seconds += seconds;
      }
    } else if (report.outcome == UpdateOutcome::kFailed) {
      if (result.failed_reports++ == 0) result.first_failed_report = report.error;
    }
  });

  // Receivers stay alive until the trainer makes no more calls into them, however this ends.
  struct Leave {
    Shared& shared;
    ~Leave() {
      shared.wait([&] { return shared.trainer_done; }, "the trainer to finish", 120s,
                  /*stop_on_failure=*/false);
    }
  } leave{shared};

  shared.update([&] { shared.receivers[static_cast<std::size_t>(r)] = &receiver; });
  std::mt19937_64 rng(shared.options.seed * 1000 + static_cast<std::uint64_t>(r) + 1);
  for (std::size_t phase = 0; phase < shared.phases.size(); ++phase) {
    const Mode mode = shared.phases[phase];
    const std::uint64_t final_version = (phase + 1) * n;
    GpuFakeEngineOptions options;
    options.host_sync_each_step = mode == Mode::kSync;
    options.full_check_every = 16;
    options.max_steps_in_flight = 8;
    // Created between phases, with no transfer in flight (the trainer waits for every engine).
    GpuFakeEngine engine(backend, receiver, options);
    shared.update([&] { ++shared.ready_for_phase[phase]; });

    const auto start = Clock::now();
    const auto deadline = start + kPhaseTimeout;
    std::size_t swaps = 0;
    while (receiver.step_hook().applied_version() < final_version) {
      if (shared.failed()) return;
      if (Clock::now() > deadline) {
        throw std::runtime_error(cat("phase ", phase + 1, " (", mode_name(mode), "): version ",
                                     final_version, " not applied within ",
                                     std::chrono::duration_cast<std::chrono::seconds>(kPhaseTimeout).count(),
                                     " s; applied ", receiver.step_hook().applied_version()));
      }
      if (auto applied = engine.step()) {
        result.applied.push_back(*applied);
        ++swaps;
      }
      random_pause(rng);
    }
    engine.step();  // one step on the final version
    engine.synchronize();
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();

    result.steps += engine.steps_done();
    result.full_steps += engine.full_steps_enqueued();
    result.torn_steps += engine.torn_steps();
    result.torn_records += engine.torn_records();
    if (result.first_torn.empty() && !engine.first_torn().empty()) {
      result.first_torn = cat("phase ", phase + 1, " (", mode_name(mode), "): ", engine.first_torn());
    }
    std::vector<StepRecord> records = engine.records();
    result.records.insert(result.records.end(), records.begin(), records.end());
    result.phase_lines.push_back(cat(
        "receiver ", r, " (GPU ", device, ") phase ", phase + 1, " mode=", mode_name(mode),
        ": steps=", engine.steps_done(), " full_checks=", engine.full_steps_enqueued(),
        " (", engine.bytes_per_full_check() >> 20, " MiB each) samples/step=",
        engine.samples_per_step(), " swaps=", swaps, " records=", records.size(),
        " torn_steps=", engine.torn_steps(), " steps/s=",
        static_cast<std::uint64_t>(static_cast<double>(engine.steps_done()) / std::max(seconds, 1e-9)),
        " seconds=", seconds));
  }
  receiver.drain();
  result.final_applied = receiver.step_hook().applied_version();
  result.stats = receiver.stats();
}

std::string check_receiver(const ReceiverResult& result, const UpdateHistory& history,
                           std::uint64_t total_updates) {
  if (!result.error.empty()) return result.error;
  if (result.torn_steps != 0 || result.torn_records != 0) {
    return cat(result.torn_steps, " torn steps (", result.torn_records,
               " in the records); first: ", result.first_torn);
  }
  if (const std::string why = history.check(result.records); !why.empty()) {
    return "update history: " + why;
  }
  if (result.final_applied != total_updates) {
    return cat("final applied version ", result.final_applied, ", want ", total_updates);
  }
  if (result.applied.empty() || result.applied.back() != total_updates) {
    return cat("the last swap made version ", result.applied.empty() ? 0 : result.applied.back(),
               " live, want ", total_updates);
  }
  for (std::size_t i = 1; i < result.applied.size(); ++i) {
    if (result.applied[i] <= result.applied[i - 1]) {
      return cat("applied versions do not increase: swap ", i, " made ", result.applied[i],
                 " live after ", result.applied[i - 1]);
    }
  }
  if (result.stats.updates_failed != 0 || result.failed_reports != 0) {
    return cat(result.stats.updates_failed, " failed updates; first: ", result.first_failed_report,
               " / ", result.stats.last_error);
  }
  if (result.stats.updates_ready != total_updates) {
    return cat(result.stats.updates_ready, " updates received, want ", total_updates);
  }
  if (result.applied.size() + result.stats.updates_superseded != total_updates) {
    return cat(result.applied.size(), " swaps + ", result.stats.updates_superseded,
               " superseded != ", total_updates, " updates (an update was lost)");
  }
  return {};
}

double gbps(double bytes, double seconds) { return seconds > 0 ? bytes / seconds / 1e9 : 0.0; }

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const std::optional<Options> parsed = parse(argc, argv);
  if (!parsed) {
    usage(argv[0]);
    return 2;
  }
  const Options options = *parsed;

  int device_count = 0;
  const cudaError_t status = cudaGetDeviceCount(&device_count);
  if (status != cudaSuccess || device_count < options.receivers + 1) {
    const std::string reason =
        status == cudaSuccess ? std::string()
                              : cat(" (cudaGetDeviceCount: ", cudaGetErrorString(status), ")");
    std::printf("SKIP: needs %d GPUs, found %d%s\n", options.receivers + 1,
                status == cudaSuccess ? device_count : 0, reason.c_str());
    return 77;
  }

  std::vector<Mode> phases;
  if (options.mode == "sync" || options.mode == "both") phases.push_back(Mode::kSync);
  if (options.mode == "events" || options.mode == "both") phases.push_back(Mode::kEvents);
  const std::uint64_t total_updates = options.updates * phases.size();

  // Ends the process if anything hangs past the overall deadline, NCCL calls included.
  shadowsync::testing::Watchdog watchdog(kWatchdogTimeout, [&] {
    std::printf("gpu_updates: receivers=%d updates=%llu mode=%s torn_steps=? final_version=? "
                "result=FAIL (watchdog)\n",
                options.receivers, static_cast<unsigned long long>(options.updates),
                options.mode.c_str());
  });

  const Layout layout = options.layout == "small" ? small_layout() : medium_layout();
  std::printf("gpu_updates: layout=%s groups=%zu tensors=%zu bytes=%zu (%.1f MiB) bucket=%zu KiB "
              "seed=%llu devices=%d\n",
              options.layout.c_str(), layout.groups().size(), layout.tensor_count(),
              layout.total_bytes(), static_cast<double>(layout.total_bytes()) / (1 << 20),
              layout.bucket_bytes() >> 10, static_cast<unsigned long long>(options.seed),
              device_count);
  for (const auto& group : layout.groups()) {
    std::printf("gpu_updates:   group %s: %zu tensors, %.2f MiB, %zu buckets\n",
                group.name().c_str(), group.tensors().size(),
                static_cast<double>(group.arena_bytes()) / (1 << 20), group.bucket_count());
  }

  Shared shared(layout, options, phases);
  std::vector<ReceiverResult> results(static_cast<std::size_t>(options.receivers));
  std::string trainer_error;
  const auto start = Clock::now();
  try {
    shared.id = NcclTransport::generate_unique_id();
  } catch (const std::exception& e) {
    watchdog.stop();
    std::fprintf(stderr, "FAIL: NcclUniqueId::generate: %s\n", e.what());
    return 1;
  }

  std::vector<std::thread> threads;
  threads.emplace_back([&] {
    try {
      trainer_main(shared);
    } catch (const std::exception& e) {
      trainer_error = e.what();
      shared.fail(cat("trainer: ", e.what()));
    }
    shared.update([&] { shared.trainer_done = true; });
  });
  for (int r = 0; r < options.receivers; ++r) {
    threads.emplace_back([&, r] {
      ReceiverResult& result = results[static_cast<std::size_t>(r)];
      result.index = r;
      try {
        receiver_main(shared, r, result);
      } catch (const std::exception& e) {
        result.error = e.what();
        shared.fail(cat("receiver ", r, ": ", e.what()));
      }
    });
  }
  for (std::thread& t : threads) t.join();
  watchdog.stop();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();

  bool pass = !shared.failed();
  std::uint64_t torn_total = 0;
  std::uint64_t final_version = total_updates;
  double bytes = 0;
  double transfer_seconds = 0;
  double base_bytes = 0;
  double base_seconds = 0;
  for (const ReceiverResult& result : results) {
    for (const std::string& line : result.phase_lines) std::printf("%s\n", line.c_str());
    const std::string why = check_receiver(result, shared.history, total_updates);
    pass = pass && why.empty();
    torn_total += result.torn_steps;
    final_version = std::min(final_version, result.final_applied);
    bytes += result.bytes;
    transfer_seconds += result.seconds;
    base_bytes += result.base_bytes;
    base_seconds += result.base_seconds;
    std::printf("receiver %d (GPU %d): steps=%llu full_checks=%llu records=%zu swaps=%zu "
                "superseded=%llu failed=%llu torn_steps=%llu final_version=%llu "
                "transfer_GBps=%.1f base_GBps=%.1f check=%s%s\n",
                result.index, result.index + 1, static_cast<unsigned long long>(result.steps),
                static_cast<unsigned long long>(result.full_steps), result.records.size(),
                result.applied.size(),
                static_cast<unsigned long long>(result.stats.updates_superseded),
                static_cast<unsigned long long>(result.stats.updates_failed),
                static_cast<unsigned long long>(result.torn_steps),
                static_cast<unsigned long long>(result.final_applied),
                gbps(result.bytes, result.seconds), gbps(result.base_bytes, result.base_seconds),
                why.empty() ? "ok" : "FAIL: ", why.c_str());
  }
  if (!trainer_error.empty()) std::fprintf(stderr, "FAIL: trainer: %s\n", trainer_error.c_str());
  if (shared.failed()) std::fprintf(stderr, "FAIL: %s\n", shared.first_failure().c_str());

  std::printf("gpu_updates: transfer mean_GBps=%.1f (all updates, bytes / transfer time) "
              "base_GBps=%.1f (updates carrying base) wall_seconds=%.1f\n",
              gbps(bytes, transfer_seconds), gbps(base_bytes, base_seconds), seconds);
  std::printf("gpu_updates: receivers=%d updates=%llu mode=%s torn_steps=%llu final_version=%llu "
              "result=%s mean_GBps=%.1f\n",
              options.receivers, static_cast<unsigned long long>(options.updates),
              options.mode.c_str(), static_cast<unsigned long long>(torn_total),
              static_cast<unsigned long long>(final_version), pass ? "PASS" : "FAIL",
              gbps(bytes, transfer_seconds));
  return pass ? 0 : 1;
}
