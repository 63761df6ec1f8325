// Step-hook costs on the host backend: the fast path (nothing pending) and the swap of a layout
// with the tensor structure of a 7B Llama model (291 tensors, plus a LoRA adapter on q/v).
// A benchmark that prints figures, not a test: it never fails on timing.
//
//   ./build/bench/bench_step_hook [--swaps N] [--scale S]
//
// --scale divides the model's dimensions (default 8: a 7B layout is 13.5 GB per slot, and the
// host backend holds two slots; a rebind swap costs the same whatever the bytes).
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

#include "deadline.h"
#include "pattern.h"
#include "shadowsync/host_backend.h"
#include "shadowsync/loopback_transport.h"
#include "shadowsync/receiver.h"
#include "shadowsync/sender.h"

using namespace shadowsync;
using Clock = std::chrono::steady_clock;

namespace {

Layout llama7b_layout(std::int64_t scale) {
  const std::int64_t hidden = 4096 / scale, ffn = 11008 / scale, vocab = 32000 / scale;
  constexpr std::int64_t kRank = 16;
  std::vector<TensorSpec> specs;
  specs.push_back({"model.embed_tokens.weight", DType::kBFloat16, {vocab, hidden}});
  for (int l = 0; l < 32; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    for (const char* proj : {"q_proj", "k_proj", "v_proj", "o_proj"}) {
      specs.push_back({p + "self_attn." + proj + ".weight", DType::kBFloat16, {hidden, hidden}});
    }
    specs.push_back({p + "mlp.gate_proj.weight", DType::kBFloat16, {ffn, hidden}});
    specs.push_back({p + "mlp.up_proj.weight", DType::kBFloat16, {ffn, hidden}});
    specs.push_back({p + "mlp.down_proj.weight", DType::kBFloat16, {hidden, ffn}});
    specs.push_back({p + "input_layernorm.weight", DType::kBFloat16, {hidden}});
    specs.push_back({p + "post_attention_layernorm.weight", DType::kBFloat16, {hidden}});
    for (const char* proj : {"q_proj", "v_proj"}) {
      specs.push_back({fmt::format("lora.{}{}.lora_A", p, proj), DType::kBFloat16,
                       {kRank, hidden}, "lora"});
      specs.push_back({fmt::format("lora.{}{}.lora_B", p, proj), DType::kBFloat16,
                       {hidden, kRank}, "lora"});
    }
  }
  specs.push_back({"model.norm.weight", DType::kBFloat16, {hidden}});
  specs.push_back({"lm_head.weight", DType::kBFloat16, {vocab, hidden}});
  return Layout::build(std::move(specs), {.bucket_bytes = std::size_t{64} << 20});
}

struct Summary {
  double median, p99, max;
};

Summary summarize(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const auto at = [&](double q) {
    return values[std::min(values.size() - 1, static_cast<std::size_t>(q * values.size()))];
  };
  return {at(0.5), at(0.99), values.back()};
}

}  // namespace

int main(int argc, char** argv) try {
  int swaps = 200;
  std::int64_t scale = 8;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--swaps" && i + 1 < argc) {
      swaps = std::atoi(argv[++i]);
    } else if (arg == "--scale" && i + 1 < argc) {
      scale = std::atoll(argv[++i]);
    } else {
      fmt::print(stderr, "usage: bench_step_hook [--swaps N] [--scale S]\n");
      return 2;
    }
  }
  if (swaps <= 0 || scale <= 0) throw std::runtime_error("--swaps and --scale must be positive");

  const Layout layout = llama7b_layout(scale);
  HostBackend backend;
  LoopbackCommunicator communicator(2);
  Sender sender(layout, backend, communicator.transport(0));
  Receiver receiver(layout, backend, communicator.transport(1));
  StepHook& hook = receiver.step_hook();
  auto engine_stream = backend.create_stream(StreamPriority::kNormal);

  // What an engine adapter does in its swap callback: rebind every tensor to the new arena.
  std::vector<std::vector<void*>> bound(layout.groups().size());
  for (std::size_t g = 0; g < layout.groups().size(); ++g) {
    bound[g].resize(layout.groups()[g].tensors().size());
  }
  hook.set_swap_callback([&](const AppliedUpdate& update) {
    for (const GroupSwap& swap : *update.swaps) {
      for (std::size_t t = 0; t < bound[swap.group].size(); ++t) {
        bound[swap.group][t] = hook.live_tensor(swap.group, t);
      }
    }
  });

  // Fast path: nothing pending.
  constexpr int kFastCalls = 50'000'000;
  std::uint64_t sink = 0;
  const auto fast_start = Clock::now();
  for (int i = 0; i < kFastCalls; ++i) sink += hook.before_step(*engine_stream).has_value();
  const double fast_ns =
      std::chrono::duration<double, std::nano>(Clock::now() - fast_start).count() / kFastCalls;

  // The same with a pacing budget: the hook also stamps each step's start (a clock read).
  double paced_fast_ns = 0.0;
  {
    ReceiverConfig paced;
    paced.decode_slowdown_budget = 1.05;
    Receiver paced_receiver(layout, backend, nullptr, paced);
    StepHook& paced_hook = paced_receiver.step_hook();
    const auto paced_start = Clock::now();
    for (int i = 0; i < kFastCalls; ++i) sink += paced_hook.before_step(*engine_stream).has_value();
    paced_fast_ns =
        std::chrono::duration<double, std::nano>(Clock::now() - paced_start).count() / kFastCalls;
  }

  // Swaps: base + LoRA updates and LoRA-only updates, each received, then applied.
  std::vector<double> full_us, lora_us;
  const testing::HostTensors full(layout, {"base", "lora"}, 1);
  const testing::HostTensors lora(layout, {"lora"}, 2);
  for (int i = 1; i <= swaps; ++i) {
    const bool lora_only = i % 2 == 0;
    const auto& source = lora_only ? lora : full;
    const std::vector<std::string> groups =
        lora_only ? std::vector<std::string>{"lora"} : std::vector<std::string>{"base", "lora"};
    PublishHandle handle = sender.publish(i, groups, source.sources());
    receiver.begin_update(handle.header());
    handle.wait();
    testing::wait_until([&] { return hook.has_pending(); }, "update offered");
    const auto start = Clock::now();
    const auto applied = hook.before_step(*engine_stream);
    const double us = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
    if (applied != std::optional<std::uint64_t>{static_cast<std::uint64_t>(i)}) {
      throw std::runtime_error(fmt::format("swap {} did not apply", i));
    }
    (lora_only ? lora_us : full_us).push_back(us);
  }
  backend.stream_synchronize(*engine_stream);

  const Summary full_s = summarize(full_us), lora_s = summarize(lora_us);
  fmt::print("bench_step_hook: host backend, llama-7b tensor structure ({} tensors, dims / {}, "
             "{:.1f} MiB per slot), {} swaps\n",
             layout.tensor_count(), scale, layout.total_bytes() / 1048576.0, swaps);
  fmt::print("| what | median | p99 | max |\n|---|---|---|---|\n");
  fmt::print("| fast path (nothing pending), per call | {:.2f} ns | | |\n", fast_ns);
  fmt::print("| fast path with a pacing budget (stamps the step), per call | {:.2f} ns | | |\n",
             paced_fast_ns);
  fmt::print("| swap base+lora, rebinding {} tensors | {:.2f} us | {:.2f} us | {:.2f} us |\n",
             layout.tensor_count(), full_s.median, full_s.p99, full_s.max);
  fmt::print("| swap lora only, rebinding {} tensors | {:.2f} us | {:.2f} us | {:.2f} us |\n",
             layout.groups()[1].tensors().size(), lora_s.median, lora_s.p99, lora_s.max);
  fmt::print("{{\"bench\":\"step_hook\",\"backend\":\"host\",\"tensors\":{},\"fast_path_ns\":{:.3f},"
             "\"fast_path_paced_ns\":{:.3f},\"swap_full_median_us\":{:.3f},\"swap_full_p99_us\":{:.3f},"
             "\"swap_lora_median_us\":{:.3f},\"swap_lora_p99_us\":{:.3f},\"sink\":{}}}\n",
             layout.tensor_count(), fast_ns, paced_fast_ns, full_s.median, full_s.p99, lora_s.median, lora_s.p99,
             sink);
  return 0;
} catch (const std::exception& error) {
  fmt::print(stderr, "bench_step_hook: {}\n", error.what());
  return 1;
}
