// The per-model phases of the update benchmark (see bench_phases.h).
#include <algorithm>
#include <exception>
#include <functional>
#include <optional>
#include <string>

#include "bench_phases.h"
#include "bench_runner.h"
#include "bench_text.h"

namespace shadowsync::bench {

void Bench::run_model(const ModelConfig& config) {
  const Layout layout = model_layout(config, o_.scale, o_.bucket_bytes);
  const std::size_t bytes = layout.total_bytes();
  const double gb = static_cast<double>(bytes) / 1e9;
  const std::size_t index = [&] {
    std::lock_guard lock(mutex_);
    ModelResult m;
    m.name = config.name;
    m.params = parameter_count(layout);
    m.bytes = bytes;
    m.tensors = layout.tensor_count();
    m.largest_tensor = largest_tensor_bytes(layout);
    m.bucket_bytes = layout.bucket_bytes();
    m.buckets = layout.groups()[0].bucket_count();
    r_.models.push_back(m);
    return r_.models.size() - 1;
  }();
  auto update = [&](auto&& f) { commit([&](Results& r) { f(r.models[index]); }); };
  const bool with_interference = config.name == o_.interference_model;
  const double need = estimate(8, gb, (o_.warmup + o_.swaps) * 0.004 + 0.4) + (with_interference ? 6 : 0);
  if (!have_budget(need, config.name)) return;
  progress(strf("%s: %.3g B params, %s, %zu tensors, %zu buckets of %s", config.name.c_str(),
                static_cast<double>(parameter_count(layout)) / 1e9, bytes_text(static_cast<double>(bytes)).c_str(),
                layout.tensor_count(), layout.groups()[0].bucket_count(), mib_text(layout.bucket_bytes()).c_str()));
  try {
    progress(strf("%s: trainer weights on rank 0 (%s), filled", config.name.c_str(), bytes_text(static_cast<double>(bytes)).c_str()));
    const TrainerWeights weights(p_, layout);

    // --- A: shadowsync -------------------------------------------------------------------
    try {
      Session::Construction trace;
      const Probe sender_before = probe(p_, 0);
      Session session(p_, layout, 0, &trace);
      auto engine_stream = p_.make_engine_stream(false);
      progress(strf("%s: shadowsync session up (receiver holds 2 slots); %d warm-up updates", config.name.c_str(), o_.warmup));
      run_updates(p_, session, weights, *engine_stream, o_.warmup);
      const Probe after_warmup = probe(p_, 1);
      const Probe sender_after = probe(p_, 0);
      update([&](ModelResult& m) {
        MemoryFigure slots = memory_between(trace.after_transports, trace.after_receiver, static_cast<double>(bytes));
        // The engine would hold one copy anyway: shadowsync's extra is the second slot.
        if (slots.device_bytes) *slots.device_bytes -= static_cast<double>(bytes);
        slots.backend_bytes -= static_cast<double>(bytes);
        m.mem_shadowsync = slots;
        if (trace.before_transports.free_device && trace.after_transports.free_device) {
          m.nccl_init_bytes = static_cast<double>(*trace.before_transports.free_device) -
                              static_cast<double>(*trace.after_transports.free_device);
        }
        if (trace.after_receiver.free_device && after_warmup.free_device) {
          m.nccl_connect_bytes = static_cast<double>(*trace.after_receiver.free_device) -
                                 static_cast<double>(*after_warmup.free_device);
        }
        m.sender_staging_bytes = static_cast<double>(sender_after.backend_allocated) -
                                 static_cast<double>(sender_before.backend_allocated);
      });
      const double fast = fast_path_ns(session, *engine_stream, o_.fast_path_calls);
      progress(strf("%s: fast path %.2f ns/call; %d swaps", config.name.c_str(), fast, o_.swaps));
      const UpdatesRun run = run_updates(p_, session, weights, *engine_stream, o_.swaps);
      double total_ms = 0;
      for (double t : run.transfer_ms) total_ms += t;
      update([&](ModelResult& m) {
        m.fast_path_ns = fast;
        m.stall_host_us = summarize(run.host_us);
        m.stall_stream_us = summarize(run.stream_us);
        m.transfer_gbps = summarize(run.gbps);
        m.transfer_ms = summarize(run.transfer_ms);
        m.transfer_aggregate_gbps = gb_per_s(static_cast<double>(run.bytes) * static_cast<double>(run.gbps.size()), total_ms / 1e3);
      });
      const Summary host = summarize(run.host_us), gbps = summarize(run.gbps);
      progress(strf("%s: swap stall host median %.1f us p99 %.1f us; transfer median %.1f GB/s (%.2f ms)",
                    config.name.c_str(), host.median, host.p99, gbps.median, summarize(run.transfer_ms).median));
      const int arena_updates = std::max(5, o_.swaps / 4);
      const UpdatesRun arena_run = run_updates(p_, session, weights, *engine_stream, arena_updates, true);
      const Summary arena_gbps = summarize(arena_run.gbps);
      update([&](ModelResult& m) { m.transfer_arena_gbps = arena_gbps; });
      progress(strf("%s: %d updates straight from the trainer's arena (no packing): %.1f GB/s median",
                    config.name.c_str(), arena_updates, arena_gbps.median));
      if (with_interference) {
        progress(strf("%s: decode interference (%s per step): %zu steps alone, %.1f s with updates streaming",
                      config.name.c_str(), bytes_text(static_cast<double>(decode_bytes_for(bytes))).c_str(),
                      o_.alone_steps, o_.during_seconds));
        const DecodeResult d = measure_interference(p_, session, weights, *engine_stream, decode_bytes_for(bytes),
                                                    o_.alone_steps, o_.during_seconds);
        commit([&](Results& r) { r.interference = d; });
        progress(strf("%s: decode alone %.3f ms, during transfer %.3f ms (%.3fx; %zu steps, %zu updates, %.1f GB/s while decoding)",
                      config.name.c_str(), d.alone_ms.median, d.during_ms.median, d.ratio_median,
                      d.steps_in_transfer, d.updates_ready, d.transfer_gbps.median));
      }
      session.settle(*engine_stream);
      progress(strf("%s: shadowsync session down", config.name.c_str()));
    } catch (const std::exception& e) {
      error(config.name + " shadowsync", e.what());
      update([&](ModelResult& m) { m.errors.push_back(cat("shadowsync: ", e.what())); });
    }

    // --- B: raw link, copy-at-boundary, per-parameter baseline ------------------------------
    try {
      DeviceBuffer live(p_.backend(1), bytes);  // the engine's own weights
      const Probe before_shadow = probe(p_, 1);
      DeviceBuffer shadow(p_.backend(1), bytes);
      progress(strf("%s: raw broadcast of %s, %d reps", config.name.c_str(), bytes_text(static_cast<double>(bytes)).c_str(), o_.raw_reps));
      const RawResult raw = raw_link(p_, *raw_pair_, weights.arena.data(), shadow.data(), bytes,
                                     std::min(o_.raw_chunk, bytes), o_.raw_reps);
      update([&](ModelResult& m) { m.raw = raw; });
      progress(strf("%s: raw %.1f GB/s (stream), %.1f GB/s (host)", config.name.c_str(), raw.stream_gbps.median, raw.host_gbps.median));

      progress(strf("%s: copy-at-boundary: background receive, %d timed copies", config.name.c_str(), o_.copy_reps));
      const CopyResult copy = copy_at_boundary(p_, *raw_pair_, layout, weights.arena.data(), shadow.data(),
                                               live.data(), o_.copy_reps);
      const Probe after_copy = probe(p_, 1);
      update([&](ModelResult& m) {
        m.copy = copy;
        m.mem_copy = memory_between(before_shadow, after_copy, static_cast<double>(bytes));
      });
      progress(strf("%s: copy-at-boundary stall %.2f ms median", config.name.c_str(), copy.stall_ms.median));
      const Summary raw_copy = raw_device_copy(p_, live.data(), shadow.data(), bytes, o_.raw_copy_reps);
      update([&](ModelResult& m) { m.raw_copy_ms = raw_copy; });
      progress(strf("%s: raw device copy of %s: %.3f ms median (%d reps)", config.name.c_str(),
                    bytes_text(static_cast<double>(bytes)).c_str(), raw_copy.median, o_.raw_copy_reps));
      shadow.reset();

      const Probe before_temp = probe(p_, 1);
      DeviceBuffer temp(p_.backend(1), largest_tensor_bytes(layout));
      progress(strf("%s: per-parameter baseline: %zu tensors, %d reps", config.name.c_str(), layout.tensor_count(), o_.baseline_reps));
      const BaselineResult baseline = per_parameter_baseline(p_, *raw_pair_, layout, weights.arena.data(),
                                                             live.data(), temp.data(), o_.baseline_reps);
      const Probe after_baseline = probe(p_, 1);
      update([&](ModelResult& m) {
        m.baseline = baseline;
        m.mem_baseline = memory_between(before_temp, after_baseline, static_cast<double>(largest_tensor_bytes(layout)));
      });
      progress(strf("%s: baseline stall %.1f ms median (%.1f GB/s)", config.name.c_str(), baseline.stall_ms.median, baseline.gbps));
    } catch (const std::exception& e) {
      error(config.name + " raw/copy/baseline", e.what());
      update([&](ModelResult& m) { m.errors.push_back(cat("raw/copy/baseline: ", e.what())); });
    }
  } catch (const std::exception& e) {
    error(config.name, e.what());
  }
}

UpdatesRun Bench::variant_updates(const Layout& layout, const TrainerWeights& weights,
                                  const SessionConfig& config,
                                  int count) {
  Session session(p_, layout, 0, nullptr, config);
  auto engine_stream = p_.make_engine_stream(false);
  run_updates(p_, session, weights, *engine_stream, o_.warmup);
  UpdatesRun run = run_updates(p_, session, weights, *engine_stream, count);
  session.settle(*engine_stream);
  return run;
}

void Bench::run_variants(const ModelConfig& config) {
  const Layout layout = model_layout(config, o_.scale, o_.bucket_bytes);
  const std::size_t bytes = layout.total_bytes();
  const double gb = static_cast<double>(bytes) / 1e9;
  std::optional<std::size_t> index;
  {
    std::lock_guard lock(mutex_);
    for (std::size_t i = 0; i < r_.models.size(); ++i) {
      if (r_.models[i].name == config.name) index = i;
    }
  }
  if (!index) return;  // the model's main phase was skipped before it started
  auto update = [&](auto&& f) { commit([&](Results& r) { f(r.models[*index]); }); };
  // Per session: a communicator, two slots, warm-up and measured updates.
  const auto need = [&](int count) { return estimate(3, gb, (o_.warmup + count) * 0.004 + 0.1); };

  const std::string no_remap = p_.backend(1).remap_unsupported_reason();
  if (!no_remap.empty()) update([&](ModelResult& m) { m.remap_unavailable = no_remap; });
  std::optional<TrainerWeights> weights;
  const auto measure = [&](const char* what, SessionConfig session_config, int count,
                           const std::function<void(ModelResult&, const UpdatesRun&)>& store) {
    if (!have_budget(need(count), cat(config.name, " ", what))) return;
    try {
      if (!weights) weights.emplace(p_, layout);
      progress(strf("%s: %s: new session, %d + %d updates", config.name.c_str(), what, o_.warmup, count));
      const UpdatesRun run = variant_updates(layout, *weights, session_config, count);
      update([&](ModelResult& m) { store(m, run); });
      const Summary host = summarize(run.host_us), stream = summarize(run.stream_us);
      progress(strf("%s: %s: swap host median %.1f us, engine stream median %.1f us; transfer median %.2f ms",
                    config.name.c_str(), what, host.median, stream.median, summarize(run.transfer_ms).median));
    } catch (const std::exception& e) {
      error(cat(config.name, " ", what), e.what());
      update([&](ModelResult& m) { m.errors.push_back(cat(what, ": ", e.what())); });
    }
  };
  SessionConfig copy_in;
  copy_in.strategy = SwapStrategy::kCopyIn;
  measure("copy_in swaps", copy_in, o_.strategy_swaps, [](ModelResult& m, const UpdatesRun& run) {
    m.copy_in_host_us = summarize(run.host_us);
    m.copy_in_stream_us = summarize(run.stream_us);
  });
  if (no_remap.empty()) {
    SessionConfig remap;
    remap.strategy = SwapStrategy::kRemap;
    measure("remap swaps", remap, o_.strategy_swaps, [](ModelResult& m, const UpdatesRun& run) {
      m.remap_host_us = summarize(run.host_us);
      m.remap_stream_us = summarize(run.stream_us);
    });
  } else {
    progress(strf("%s: remap not measured: %s", config.name.c_str(), no_remap.c_str()));
  }
  SessionConfig checksums;
  checksums.checksums = true;
  measure("checksums", checksums, o_.integrity_updates, [](ModelResult& m, const UpdatesRun& run) {
    m.checksums_transfer_ms = summarize(run.transfer_ms);
  });
  SessionConfig guard;
  guard.reject_nonfinite = true;
  measure("non-finite guard", guard, o_.integrity_updates, [](ModelResult& m, const UpdatesRun& run) {
    m.nonfinite_transfer_ms = summarize(run.transfer_ms);
  });
}

}  // namespace shadowsync::bench
