// The shadowsync demo: a trainer thread publishes new weights (base and LoRA updates mixed)
// while a fake engine keeps decoding; each update is received in the background and swapped in
// between two steps. Runs on the host backend and the loopback transport: no GPU needed.
//
//   ./scripts/demo.sh [--updates N] [--layers L]
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>

#include "host_engine.h"
#include "shadowsync/host_backend.h"
#include "shadowsync/loopback_transport.h"
#include "shadowsync/receiver.h"
#include "shadowsync/sender.h"
#include "weights.h"

using namespace shadowsync;
using Clock = std::chrono::steady_clock;

namespace {

struct Options {
  int updates = 20;
  int layers = 8;
};

Options parse(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&] {
      if (i + 1 >= argc) throw std::runtime_error(fmt::format("{} needs a value", arg));
      const int v = std::atoi(argv[++i]);
      if (v <= 0) throw std::runtime_error(fmt::format("{} must be positive, got '{}'", arg, argv[i]));
      return v;
    };
    if (arg == "--updates") {
      options.updates = value();
    } else if (arg == "--layers") {
      options.layers = value();
    } else {
      throw std::runtime_error(
          fmt::format("unknown argument '{}' (usage: demo [--updates N] [--layers L])", arg));
    }
  }
  return options;
}

// A small Llama-like model in bf16 with two LoRA adapters on the attention projections.
Layout demo_layout(int layers) {
  constexpr std::int64_t kHidden = 256, kFfn = 688, kVocab = 2048, kRank = 8;
  std::vector<TensorSpec> specs;
  specs.push_back({"embed_tokens.weight", DType::kBFloat16, {kVocab, kHidden}});
  for (int l = 0; l < layers; ++l) {
    const std::string p = fmt::format("layers.{}.", l);
    specs.push_back({p + "self_attn.qkv_proj.weight", DType::kBFloat16, {3 * kHidden, kHidden}});
    specs.push_back({p + "self_attn.o_proj.weight", DType::kBFloat16, {kHidden, kHidden}});
    specs.push_back({p + "mlp.gate_up_proj.weight", DType::kBFloat16, {2 * kFfn, kHidden}});
    specs.push_back({p + "mlp.down_proj.weight", DType::kBFloat16, {kHidden, kFfn}});
    specs.push_back({p + "input_layernorm.weight", DType::kBFloat16, {kHidden}});
    for (const char* adapter : {"math", "code"}) {
      specs.push_back({fmt::format("{}.{}lora_A", adapter, p), DType::kBFloat16, {kRank, kHidden},
                       adapter});
      specs.push_back({fmt::format("{}.{}lora_B", adapter, p), DType::kBFloat16,
                       {3 * kHidden, kRank}, adapter});
    }
  }
  specs.push_back({"lm_head.weight", DType::kBFloat16, {kVocab, kHidden}});
  return Layout::build(std::move(specs), {.bucket_bytes = std::size_t{1} << 20});
}

std::string group_names(const Layout& layout, const std::vector<std::size_t>& groups) {
  std::string text;
  for (const auto g : groups) text += (text.empty() ? "" : "+") + layout.groups()[g].name();
  return text;
}

struct Transfer {
  std::uint64_t steps_at_begin = 0;
  std::uint64_t steps_at_ready = 0;
  UpdateReport report;
};

}  // namespace

int main(int argc, char** argv) try {
  const Options options = parse(argc, argv);
  const Layout layout = demo_layout(options.layers);
  fmt::print("shadowsync demo: {} tensors in {} groups, {:.1f} MiB, {} updates, host backend\n",
             layout.tensor_count(), layout.groups().size(), layout.total_bytes() / 1048576.0,
             options.updates);

  HostBackend backend;
  LoopbackCommunicator communicator(2);
  Sender sender(layout, backend, communicator.transport(0));
  Receiver receiver(layout, backend, communicator.transport(1));
  // A decode step "computes" for 300 us between reading the two halves of its weights.
  examples::HostEngine engine(backend, receiver, {.compute_time = std::chrono::microseconds(300)});

  std::mutex mutex;
  std::map<std::uint64_t, Transfer> transfers;
  receiver.set_observer([&](const UpdateReport& report) {
    std::lock_guard lock(mutex);
    if (report.outcome != UpdateOutcome::kReady) return;  // superseded ones print below
    Transfer& t = transfers[report.version];
    t.report = report;
    t.steps_at_ready = engine.steps_done();
  });

  std::atomic<bool> trainer_done{false};
  std::thread trainer([&] {
    std::mt19937 rng(2026);
    const std::vector<std::vector<std::string>> kinds = {
        {"base"}, {"math"}, {"code"}, {"base", "math"}, {"math", "code"}, {"base", "math", "code"}};
    for (int v = 1; v <= options.updates; ++v) {
      const auto& groups = v == 1 ? kinds.back() : kinds[rng() % kinds.size()];
      examples::TrainerWeights tensors(layout, groups, v);  // "the optimizer step"
      PublishHandle handle = sender.publish(v, groups, tensors.sources());
      {
        std::lock_guard lock(mutex);
        transfers[v].steps_at_begin = engine.steps_done();
      }
      receiver.begin_update(handle.header());  // in production the control plane carries this
      handle.wait();
      std::this_thread::sleep_for(std::chrono::milliseconds(4));  // the next training step
    }
    trainer_done = true;
  });

  int applied_count = 0;
  double max_stall_us = 0;
  const auto deadline = Clock::now() + std::chrono::minutes(2);
  while (receiver.step_hook().applied_version() < static_cast<std::uint64_t>(options.updates)) {
    if (Clock::now() > deadline) throw std::runtime_error("the last update never applied");
    const auto before = Clock::now();
    const auto applied = engine.step();
    const double stall_us = std::chrono::duration<double, std::micro>(Clock::now() - before).count();
    engine.synchronize();  // a real engine samples tokens here
    if (!applied) continue;
    ++applied_count;
    max_stall_us = std::max(max_stall_us, stall_us);
    std::lock_guard lock(mutex);
    for (auto& [version, t] : transfers) {
      if (version > *applied || t.report.version == 0) continue;
      if (version < *applied) {
        fmt::print("superseded v={} ({}): a newer update arrived before the next step\n", version,
                   group_names(layout, t.report.groups));
      } else {
        fmt::print(
            "applied v={} groups={} bytes={:.2f} MiB transfer={:.2f} ms stall={:.1f} us "
            "steps_during_transfer={}\n",
            version, group_names(layout, t.report.groups), t.report.bytes / 1048576.0,
            std::chrono::duration<double, std::milli>(t.report.transfer).count(), stall_us,
            t.steps_at_ready - t.steps_at_begin);
      }
      t.report.version = 0;  // printed
    }
  }
  trainer.join();
  engine.synchronize();
  if (!engine.first_torn().empty()) fmt::print("first torn step: {}\n", engine.first_torn());
  fmt::print("summary: backend={} updates_applied={} torn_steps={} max_stall_us={:.1f}\n",
             backend.name(), applied_count, engine.torn_steps(), max_stall_us);
  return engine.torn_steps() == 0 ? 0 : 1;
} catch (const std::exception& error) {
  fmt::print(stderr, "demo: {}\n", error.what());
  return 2;
}
