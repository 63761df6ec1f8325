// bench_same_host_one_gpu's output (see same_host_report.h).
#include "same_host_report.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "bench_text.h"
#include "shadowsync/layout.h"

namespace shadowsync::bench::same_host {

namespace {

constexpr const char* kSchema = "shadowsync-bench-same-host/1";

const Clock::time_point g_start = Clock::now();

Json gbps_json(double bytes, const std::vector<double>& ms) {
  if (ms.empty()) return Json();
  const bench::Summary s = bench::summarize(ms);
  return Json::object()
      .set("median", gbps(bytes, s.median))
      .set("min", gbps(bytes, s.max))
      .set("max", gbps(bytes, s.min));
}

Json model_json(const ModelRun& r) {
  const auto M = static_cast<double>(r.bytes);
  Json j =
      Json::object()
          .set("name", r.name)
          .set("bytes", r.bytes)
          .set("tensors", r.tensors)
          .set("buckets", r.buckets)
          .set("largest_tensor_bytes", r.largest_tensor)
          .set("sources", Json::object()
                              .set("mode", r.sources)
                              .set("bytes", r.source_bytes)
                              .set("note", r.sources_note))
          .set("seconds", r.seconds)
          .set(
              "transport_timeline",
              Json::object().set("sender", r.sender_timeline).set("receiver", r.receiver_timeline));
  if (!r.raw_ms.empty()) {
    j.set("raw_copy",
          Json::object().set("ms", summary_json(r.raw_ms)).set("gbps", gbps_json(M, r.raw_ms)));
  }
  if (!r.transport_ms.empty()) {
    j.set("transport", Json::object()
                           .set("ms", summary_json(r.transport_ms))
                           .set("gbps", gbps_json(M, r.transport_ms))
                           .set("engine_observed_ms", summary_json(r.transport_engine_ms))
                           .set("ratio_to_raw", median(r.raw_ms) / median(r.transport_ms))
                           .set("added_ms", median(r.transport_ms) - median(r.raw_ms)));
  }
  if (!r.publish_ms.empty()) {
    j.set("end_to_end", Json::object()
                            .set("publish_ms", summary_json(r.publish_ms))
                            .set("gbps", gbps_json(M, r.publish_ms))
                            .set("receiver_transfer_ms", summary_json(r.receiver_transfer_ms))
                            .set("ratio_to_raw", median(r.raw_ms) / median(r.publish_ms))
                            .set("ratio_to_two_copies", 2 * median(r.raw_ms) / median(r.publish_ms))
                            .set("added_ms", median(r.publish_ms) - 2 * median(r.raw_ms)));
    j.set("stall", Json::object()
                       .set("swap_strategy", "rebind")
                       .set("host_us", summary_json(r.stall_host_us))
                       .set("engine_stream_us", summary_json(r.stall_stream_us)));
  }
  if (!r.decode.empty()) {
    Json rows = Json::array();
    const double alone = median(r.decode.front().ms);
    for (const DecodeRow& row : r.decode) {
      rows.push(Json::object()
                    .set("variant", row.variant)
                    .set("ms", summary_json(row.ms))
                    .set("ratio_median", median(row.ms) / alone)
                    .set("ratio_p99",
                         bench::summarize(row.ms).p99 / bench::summarize(r.decode.front().ms).p99)
                    .set("copy_gbps", row.copy_gbps)
                    .set("copies", row.copies)
                    .set("busy_fraction", row.busy));
    }
    j.set("decode", Json::object().set("bytes", r.decode_bytes).set("rows", rows));
  }
  if (r.memory.slot_bytes > 0) {
    const MemoryFigures& m = r.memory;
    j.set("memory", Json::object()
                        .set("slot_bytes", m.slot_bytes)
                        .set("connection_delta_bytes", m.connection_delta)
                        .set("trainer_serve_backend_delta_bytes", m.trainer_serve_backend_delta)
                        .set("engine_connect_backend_delta_bytes", m.engine_connect_backend_delta)
                        .set("receiver_delta_bytes", m.receiver_delta)
                        .set("receiver_backend_delta_bytes", m.receiver_backend_delta)
                        .set("sender_delta_bytes", m.sender_delta)
                        .set("sender_backend_delta_bytes", m.sender_backend_delta)
                        .set("updates_delta_bytes", m.updates_delta)
                        .set("trainer_backend_bytes_after_updates", m.trainer_backend_after_updates)
                        .set("trainer_extra_bytes", m.connection_delta + m.sender_delta)
                        .set("engine_beyond_live_bytes",
                             m.receiver_delta - static_cast<std::int64_t>(r.bytes)));
  }
  Json skipped = Json::array();
  for (const std::string& s : r.skipped) skipped.push(s);
  j.set("skipped", skipped);
  if (!r.error.empty()) j.set("error", r.error);
  return j;
}

std::string ms_pair(const std::vector<double>& v) {
  if (v.empty()) return "-";
  const bench::Summary s = bench::summarize(v);
  return strf("%.3f / %.3f", s.median, s.min);
}

}  // namespace

double elapsed_s() { return bench::to_s(Clock::now() - g_start); }

void progress(const std::string& line) {
  std::printf("[%6.1f s] %s\n", elapsed_s(), line.c_str());
  std::fflush(stdout);
}

std::vector<Goal> goals_of(const ModelRun& r) {
  std::vector<Goal> goals;
  if (!r.raw_ms.empty() && !r.transport_ms.empty()) {
    const double ratio = median(r.raw_ms) / median(r.transport_ms);
    goals.push_back(
        {r.name, "transport GB/s >= 0.90 x raw device copy", ratio, 0.90, "x", ratio >= 0.90});
  }
  if (!r.raw_ms.empty() && !r.publish_ms.empty()) {
    const double ratio = 2 * median(r.raw_ms) / median(r.publish_ms);
    goals.push_back({r.name, "end-to-end GB/s >= 0.90 x two raw device copies (pack + receive)",
                     ratio, 0.90, "x", ratio >= 0.90});
  }
  if (!r.publish_ms.empty()) {
    const MemoryFigures& m = r.memory;
    const double trainer = static_cast<double>(m.connection_delta + m.sender_delta);
    goals.push_back({r.name, "trainer extra device memory <= two staging buckets", trainer,
                     static_cast<double>(2 * m.slot_bytes + kMemorySlack), "bytes",
                     trainer <= static_cast<double>(2 * m.slot_bytes + kMemorySlack)});
    // Beyond the live weights: the shadow, plus whatever the connection took beyond the
    // trainer's two slots (which could only be the engine's side of connect()).
    const double beyond =
        static_cast<double>(m.receiver_delta) - static_cast<double>(r.bytes) +
        std::max<double>(0, static_cast<double>(m.connection_delta - 2 * m.slot_bytes));
    goals.push_back({r.name, "engine extra device memory <= the shadow", beyond,
                     static_cast<double>(r.bytes + kMemorySlack), "bytes",
                     beyond <= static_cast<double>(r.bytes + kMemorySlack)});
  }
  return goals;
}

std::string tables(const std::vector<ModelRun>& runs) {
  std::string t;
  t += "Transfer (ms median / min; GB/s of the median; goals: transport >= 0.90 x raw, end to end "
       ">= 0.90 x two raw copies):\n\n";
  t += table_head({"model", "GB", "sources", "raw copy ms", "raw GB/s", "transport ms",
                   "transport GB/s", "transport / raw", "added ms", "end-to-end ms", "e2e GB/s",
                   "e2e / raw", "e2e / two copies", "receiver transfer ms"});
  for (const ModelRun& r : runs) {
    if (r.raw_ms.empty()) continue;
    const auto M = static_cast<double>(r.bytes);
    const double raw = median(r.raw_ms);
    const double tr = median(r.transport_ms);
    const double e2e = median(r.publish_ms);
    t += strf(
        "| %s | %.2f | %s | %s | %.0f | %s | %.0f | %.2f | %+.3f | %s | %.0f | %.2f | %.2f | %s "
        "|\n",
        r.name.c_str(), gb(M), r.sources.c_str(), ms_pair(r.raw_ms).c_str(), gbps(M, raw),
        ms_pair(r.transport_ms).c_str(), gbps(M, tr), tr > 0 ? raw / tr : 0, tr - raw,
        ms_pair(r.publish_ms).c_str(), gbps(M, e2e), e2e > 0 ? raw / e2e : 0,
        e2e > 0 ? 2 * raw / e2e : 0, ms_pair(r.receiver_transfer_ms).c_str());
  }
  t += "\nEngine stall per swap (rebind, at a step boundary; p99 is the maximum below 100 "
       "swaps):\n\n";
  t += table_head({"model", "swaps", "host us median", "host us p99", "engine stream us median"});
  for (const ModelRun& r : runs) {
    if (r.stall_host_us.empty()) continue;
    const bench::Summary h = bench::summarize(r.stall_host_us);
    t += strf("| %s | %zu | %.1f | %.1f | %.1f |\n", r.name.c_str(), h.n, h.median, h.p99,
              median(r.stall_stream_us));
  }
  t +=
      "\nDecode step (ms median / p99; x = median over alone; copy GB/s: the copy's own rate while "
      "decoding):\n\n";
  t += table_head({"model", "decode GB", "variant", "steps", "ms median / p99", "x median",
                   "copy GB/s", "copies", "window with a copy in flight"});
  for (const ModelRun& r : runs) {
    if (r.decode.empty()) continue;
    const double alone = median(r.decode.front().ms);
    for (const DecodeRow& row : r.decode) {
      const bench::Summary s = bench::summarize(row.ms);
      t += strf("| %s | %.2f | %s | %zu | %.3f / %.3f | %.2f | %s | %d | %s |\n", r.name.c_str(),
                gb(r.decode_bytes), row.variant.c_str(), s.n, s.median, s.p99, s.median / alone,
                row.copy_gbps > 0 ? strf("%.0f", row.copy_gbps).c_str() : "-", row.copies,
                row.copies > 0 ? strf("%.0f %%", 100 * row.busy).c_str() : "-");
    }
  }
  t += "\nExtra device memory (GB; device-wide cudaMemGetInfo deltas, each while the other process "
       "was idle; backend = Backend::bytes_allocated):\n\n";
  t += table_head({"model", "two slots", "connection (serve + connect)", "trainer Sender (backend)",
                   "trainer extra", "goal <=", "engine Receiver (backend)", "engine beyond live",
                   "goal <= (shadow)", "across updates"});
  for (const ModelRun& r : runs) {
    if (r.publish_ms.empty()) continue;
    const MemoryFigures& m = r.memory;
    t += strf(
        "| %s | %.3f | %.3f | %.3f (%.3f) | %.3f | %.3f | %.3f (%.3f) | %.3f | %.3f | %.3f |\n",
        r.name.c_str(), gb(2 * m.slot_bytes), gb(m.connection_delta), gb(m.sender_delta),
        gb(m.sender_backend_delta), gb(m.connection_delta + m.sender_delta),
        gb(2 * m.slot_bytes + kMemorySlack), gb(m.receiver_delta), gb(m.receiver_backend_delta),
        gb(m.receiver_delta - static_cast<std::int64_t>(r.bytes)), gb(r.bytes + kMemorySlack),
        gb(m.updates_delta));
  }
  std::string notes;
  for (const ModelRun& r : runs) {
    if (!r.sources_note.empty())
      notes += strf("* %s: %s.\n", r.name.c_str(), r.sources_note.c_str());
    if (!r.sender_timeline.empty())
      notes += strf("* %s, transport alone: %s.\n", r.name.c_str(), r.sender_timeline.c_str());
    if (!r.receiver_timeline.empty())
      notes += strf("* %s, transport alone: %s.\n", r.name.c_str(), r.receiver_timeline.c_str());
    for (const std::string& s : r.skipped)
      notes += strf("* %s: skipped %s.\n", r.name.c_str(), s.c_str());
    if (!r.error.empty()) notes += strf("* %s: FAILED: %s\n", r.name.c_str(), r.error.c_str());
  }
  if (!notes.empty()) t += "\nNotes:\n\n" + notes;
  std::string goals;
  for (const ModelRun& r : runs) {
    for (const Goal& g : goals_of(r)) {
      goals += g.unit == "bytes"
                   ? strf("* %s: %s: %.3f GB (<= %.3f GB): %s\n", g.model.c_str(), g.name.c_str(),
                          gb(g.value), gb(g.target), g.met ? "met" : "MISSED")
                   : strf("* %s: %s: %.2f: %s\n", g.model.c_str(), g.name.c_str(), g.value,
                          g.met ? "met" : "MISSED");
    }
  }
  if (!goals.empty()) t += "\nGoals:\n\n" + goals;
  return t;
}

void write_outputs(const Options& o, const RunInfo& info, const std::vector<ModelRun>& runs,
                   bool complete, const std::vector<std::string>& errors) {
  Json models = Json::array();
  Json goals = Json::array();
  Json skipped = Json::array();
  for (const ModelRun& r : runs) {
    models.push(model_json(r));
    for (const Goal& g : goals_of(r)) {
      goals.push(Json::object()
                     .set("model", g.model)
                     .set("goal", g.name)
                     .set("value", g.value)
                     .set("target", g.target)
                     .set("unit", g.unit)
                     .set("met", g.met));
    }
    for (const std::string& s : r.skipped) skipped.push(cat(r.name, ": ", s));
  }
  Json error_list = Json::array();
  for (const std::string& e : errors) error_list.push(e);
  const Json run = Json::object()
                       .set("schema", kSchema)
                       .set("label", o.trainer_device == o.device
                                         ? "GPU figures (one GPU, trainer and engine processes)"
                                         : "GPU figures (trainer and engine processes on two GPUs)")
                       .set("machine", info.machine)
                       .set("device", info.device)
                       .set("device_memory_bytes", info.device_memory)
                       .set("date", info.date)
                       .set("commit", o.commit)
                       .set("command", info.command)
                       .set("elapsed_s", elapsed_s())
                       .set("complete", complete)
                       .set("config", Json::object()
                                          .set("engine_device", o.device)
                                          .set("trainer_device", o.trainer_device)
                                          .set("updates", o.updates)
                                          .set("warmup_updates", kWarmup)
                                          .set("reps", o.reps)
                                          .set("bucket_bytes", kDefaultBucketBytes)
                                          .set("memory", "device")
                                          .set("swap_strategy", "rebind")
                                          .set("checksums", o.checksums)
                                          .set("decode_gib", o.decode_gib)
                                          .set("decode_steps", o.decode_steps)
                                          .set("during_seconds", o.during_s)
                                          .set("sm_copy_ctas", info.sm_copy_ctas)
                                          .set("sm_copy_threads", info.sm_copy_threads)
                                          .set("sources", o.sources)
                                          .set("token", info.token_source)
                                          .set("budget_s", o.budget_s))
                       .set("models", models)
                       .set("goals", goals)
                       .set("skipped", skipped)
                       .set("errors", error_list);
  std::filesystem::create_directories(o.out_dir);
  const std::string stem = cat(o.out_dir, "/bench-same-host-", info.stamp);
  std::ofstream(stem + ".json") << run.dump();
  std::ofstream md(stem + ".md");
  if (o.trainer_device == o.device) {
    md << "# Same-host transport (device memory), one GPU\n\n"
       << "GPU figures: the trainer and the engine are two processes on one GPU.\n\n";
  } else {
    md << "# Same-host transport (device memory), two GPUs\n\n"
       << "GPU figures: the trainer process on GPU " << o.trainer_device
       << ", the engine process on GPU " << o.device
       << " (the engine's copy engines read the trainer's staging across GPUs; the raw copy and "
          "the copy references are on the engine's GPU). The memory figures are the engine GPU's "
          "(cudaMemGetInfo there): the trainer's slots, on its own GPU, are not in them.\n\n";
  }
  md << "* machine: " << info.machine << " (" << info.device << ")\n"
     << "* date: " << info.date << "\n* commit: " << o.commit << "\n* command: `" << info.command
     << "`\n* complete: " << (complete ? "yes" : "no") << strf(" (%.0f s)", elapsed_s()) << "\n\n"
     << tables(runs);
  for (const std::string& e : errors) md << "\nERROR: " << e << "\n";
}

}  // namespace shadowsync::bench::same_host
