// The update benchmark's results as JSON (see bench_report.h).
#include <optional>
#include <string>

#include "bench_goals.h"
#include "bench_report.h"

namespace shadowsync::bench {

Json to_json(const MemoryFigure& m) {
  return Json::object()
      .set("device_bytes", m.device_bytes)
      .set("backend_bytes", m.backend_bytes)
      .set("theoretical_bytes", m.theoretical);
}
Json to_json(const RawResult& r) {
  return Json::object()
      .set("stream_gbps", to_json(r.stream_gbps))
      .set("host_gbps", to_json(r.host_gbps))
      .set("bytes", r.bytes)
      .set("chunk_bytes", r.chunk);
}
Json to_json(const DecodeResult& d) {
  return Json::object()
      .set("decode_bytes_per_step", d.decode_bytes)
      .set("alone_ms", to_json(d.alone_ms))
      .set("during_transfer_ms", to_json(d.during_ms))
      .set("window_ms", to_json(d.window_ms))
      .set("ratio_median", d.ratio_median)
      .set("ratio_p99", d.ratio_p99)
      .set("steps_in_window", d.steps_total)
      .set("steps_during_transfer", d.steps_in_transfer)
      .set("updates_ready", d.updates_ready)
      .set("updates_superseded", d.updates_superseded)
      .set("transfer_busy_fraction", d.busy_fraction)
      .set("transfer_gbps_while_decoding", to_json(d.transfer_gbps))
      .set("transfer_ms_while_decoding", to_json(d.transfer_ms))
      .set("lost_decode_ms_per_update", d.lost_ms_per_update);
}

namespace {

template <typename T, typename F>
Json optional_json(const std::optional<T>& value, F&& f) {
  return value ? f(*value) : Json();
}

}  // namespace

Json results_json(const Results& r, const Options& o) {
  const bool cpu = r.mode == "cpu";
  Json root = Json::object();
  root.set("schema", "shadowsync-bench-updates/1")
      .set("mode", r.mode)
      .set("label", cpu ? "CPU smoke, not GPU figures" : "GPU figures")
      .set("machine", r.machine)
      .set("machine_detail", r.machine_detail)
      .set("date", r.date)
      .set("commit", o.commit)
      .set("command", o.command)
      .set("complete", r.complete)
      .set("end", r.end_reason)
      .set("elapsed_s", r.elapsed_s);
  root.set("options", Json::object()
                          .set("scale", o.scale)
                          .set("swaps", o.swaps)
                          .set("warmup", o.warmup)
                          .set("bucket_bytes", o.bucket_bytes)
                          .set("decode_bytes", o.decode_bytes)
                          .set("alone_steps", o.alone_steps)
                          .set("during_seconds", o.during_seconds)
                          .set("budget_s", o.budget_s)
                          .set("raw_chunk_bytes", o.raw_chunk)
                          .set("baseline_reps", o.baseline_reps)
                          .set("copy_reps", o.copy_reps)
                          .set("strategy_swaps", o.strategy_swaps)
                          .set("integrity_updates", o.integrity_updates)
                          .set("raw_copy_reps", o.raw_copy_reps)
                          .set("fault_reps", o.fault_reps)
                          .set("fault_bucket_deadline_ms", o.fault_deadline_ms));
  root.set("stream_priority_range",
           Json::object().set("least", r.priorities.least).set("greatest", r.priorities.greatest));
  Json models = Json::array();
  for (const ModelResult& m : r.models) {
    Json j = Json::object();
    j.set("name", m.name)
        .set("params", m.params)
        .set("bytes", m.bytes)
        .set("tensors", m.tensors)
        .set("largest_tensor_bytes", m.largest_tensor)
        .set("bucket_bytes", m.bucket_bytes)
        .set("buckets", m.buckets);
    const auto summary = [](const std::optional<Summary>& s) {
      return optional_json(s, [](const Summary& x) { return to_json(x); });
    };
    const auto strategy = [&](const std::optional<Summary>& host, const std::optional<Summary>& stream) {
      return host ? Json::object().set("host_us", summary(host)).set("engine_stream_us", summary(stream)) : Json();
    };
    j.set("stall", Json::object()
                       .set("host_us", summary(m.stall_host_us))
                       .set("engine_stream_us", summary(m.stall_stream_us))
                       .set("fast_path_ns", m.fast_path_ns)
                       .set("copy_in", strategy(m.copy_in_host_us, m.copy_in_stream_us))
                       .set("remap", strategy(m.remap_host_us, m.remap_stream_us))
                       .set("remap_unavailable", m.remap_unavailable.empty() ? Json() : Json(m.remap_unavailable))
                       .set("raw_device_copy_ms", summary(m.raw_copy_ms)));
    const auto check = [&](const std::optional<Summary>& checked) {
      if (!checked) return Json();
      Json c = Json::object().set("transfer_ms", to_json(*checked));
      if (m.transfer_ms && m.transfer_ms->median > 0) {
        c.set("overhead_fraction", checked->median / m.transfer_ms->median - 1);
      }
      return c;
    };
    j.set("integrity", Json::object()
                           .set("plain_transfer_ms", summary(m.transfer_ms))
                           .set("checksums", check(m.checksums_transfer_ms))
                           .set("nonfinite_guard", check(m.nonfinite_transfer_ms)));
    j.set("transfer", Json::object()
                          .set("gbps", optional_json(m.transfer_gbps, [](const Summary& s) { return to_json(s); }))
                          .set("ms", optional_json(m.transfer_ms, [](const Summary& s) { return to_json(s); }))
                          .set("aggregate_gbps", m.transfer_aggregate_gbps)
                          .set("from_arena_gbps", optional_json(m.transfer_arena_gbps, [](const Summary& s) { return to_json(s); }))
                          .set("raw", optional_json(m.raw, [](const RawResult& x) { return to_json(x); })));
    j.set("baseline", optional_json(m.baseline, [](const BaselineResult& b) {
      return Json::object().set("stall_ms", to_json(b.stall_ms)).set("gbps", b.gbps).set("tensors", b.tensors);
    }));
    j.set("copy_at_boundary", optional_json(m.copy, [](const CopyResult& c) {
      return Json::object()
          .set("stall_ms", to_json(c.stall_ms))
          .set("enqueue_us", to_json(c.enqueue_us))
          .set("background_receive_gbps", c.receive_gbps);
    }));
    j.set("memory", Json::object()
                        .set("shadowsync_extra", optional_json(m.mem_shadowsync, [](const MemoryFigure& x) { return to_json(x); }))
                        .set("baseline_extra", optional_json(m.mem_baseline, [](const MemoryFigure& x) { return to_json(x); }))
                        .set("copy_at_boundary_extra", optional_json(m.mem_copy, [](const MemoryFigure& x) { return to_json(x); }))
                        .set("nccl_init_bytes", m.nccl_init_bytes)
                        .set("nccl_connect_bytes", m.nccl_connect_bytes)
                        .set("sender_staging_bytes", m.sender_staging_bytes));
    Json errors = Json::array();
    for (const std::string& e : m.errors) errors.push(e);
    j.set("errors", errors);
    models.push(j);
  }
  root.set("models", models);
  root.set("interference", r.interference
                               ? Json(to_json(*r.interference)).set("model", r.interference_model)
                               : Json());
  Json sweep = Json::array();
  for (const SweepRow& row : r.sweep) {
    sweep.push(Json::object()
                   .set("knob", row.knob)
                   .set("bucket_bytes", row.bucket_bytes)
                   .set("max_ctas", row.max_ctas)
                   .set("engine_priority", row.raised_priority ? "raised" : "default")
                   .set("idle_gbps", optional_json(row.gbps, [](const Summary& s) { return to_json(s); }))
                   .set("raw", optional_json(row.raw, [](const RawResult& x) { return to_json(x); }))
                   .set("decode", optional_json(row.decode, [](const DecodeResult& d) { return to_json(d); }))
                   .set("error", row.error));
  }
  root.set("sweep", Json::object().set("model", r.sweep_model).set("rows", sweep));
  root.set("sender_fault", optional_json(r.fault, [](const FaultPhase& f) {
    Json variants = Json::array();
    for (const FaultResult& v : f.variants) {
      Json samples = Json::array();
      for (double x : v.report_ms) samples.push(x);
      Json codes = Json::array();
      for (const std::string& c : v.codes) codes.push(c);
      variants.push(Json::object()
                        .set("variant", v.variant)
                        .set("reps", v.reps)
                        .set("recovered", v.recovered)
                        .set("report_ms", to_json(summarize(v.report_ms)))
                        .set("samples_ms", samples)
                        .set("codes", codes)
                        .set("first_error", v.first_error));
    }
    return Json::object()
        .set("model", f.model)
        .set("bytes", f.bytes)
        .set("buckets", f.buckets)
        .set("bucket_deadline_ms", f.bucket_deadline_ms)
        .set("poll_interval_us", f.poll_interval_us)
        .set("settle_ms", static_cast<double>(kFaultSettle.count()))
        .set("variants", variants);
  }));
  Json goals = Json::array();
  for (const Goal& g : evaluate_goals(r, o)) {
    goals.push(Json::object()
                   .set("goal", g.name)
                   .set("target", g.target)
                   .set("measured", g.measured)
                   .set("verdict", g.verdict));
  }
  root.set("goals", goals);
  Json recs = Json::array();
  for (const Recommendation& rec : recommend(r)) {
    recs.push(Json::object().set("knob", rec.knob).set("value", rec.value).set("evidence", rec.evidence));
  }
  root.set("recommendations", recs);
  Json verdicts = Json::array();
  for (const std::string& line : integrity_verdicts(r, o)) verdicts.push(line);
  root.set("integrity_verdicts", verdicts);
  Json skipped = Json::array();
  for (const std::string& s : r.skipped) skipped.push(s);
  root.set("skipped", skipped);
  Json errors = Json::array();
  for (const std::string& e : r.errors) errors.push(e);
  root.set("errors", errors);
  return root;
}

}  // namespace shadowsync::bench
