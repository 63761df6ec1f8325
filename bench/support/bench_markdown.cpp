// The update benchmark's results as Markdown (see bench_report.h).
#include <optional>
#include <string>

#include "bench_goals.h"
#include "bench_report.h"
#include "bench_text.h"

namespace shadowsync::bench {

std::string results_markdown(const Results& r, const Options& o) {
  const bool cpu = r.mode == "cpu";
  const std::string label = cpu ? "CPU smoke, not GPU figures" : "GPU figures";
  std::string md;
  md += "# shadowsync update benchmark: " + label + "\n\n";
  if (cpu) {
    md += "> **CPU smoke, not GPU figures.** HostBackend streams are CPU threads, the loopback "
          "transport is memcpy, model dimensions are divided by " +
          std::to_string(o.scale) +
          ". These numbers only show that every phase runs; they say nothing about GPUs.\n\n";
  }
  md += "| stamp | |\n|---|---|\n";
  md += "| machine | " + r.machine + " |\n";
  md += "| date (UTC) | " + r.date + " |\n";
  md += "| commit | " + o.commit + " |\n";
  md += "| command | `" + o.command + "` |\n";
  md += strf("| elapsed | %.1f s (%s) |\n", r.elapsed_s, r.end_reason.c_str());
  md += strf("| stream priorities | least %d (the receiver's kLow), greatest %d |\n\n",
             r.priorities.least, r.priorities.greatest);

  md += "## Goals (" + label + ")\n\n| goal | target | measured | verdict |\n|---|---|---|---|\n";
  for (const Goal& g : evaluate_goals(r, o)) {
    md += "| " + g.name + " | " + g.target + " | " + (g.measured.empty() ? "—" : g.measured) + " | **" +
          g.verdict + "** |\n";
  }

  md += "\n## Engine stall per update (" + label + ")\n\n";
  md += "Shadowsync: host time in `before_step()` when it swaps (rebind; the callback rebinds every "
        "tensor pointer), and engine-stream time between stamps around it. Copy-at-boundary: the "
        "shadow-to-live copy on the engine stream. Per-parameter baseline: the whole paused update.\n\n";
  md += "| model | params | bytes | tensors | shadowsync host µs (median / p99) | engine stream µs "
        "(median / p99) | fast path ns | copy-at-boundary ms (median / p99) | per-parameter "
        "baseline ms (median / p99) | baseline / shadowsync |\n|---|---|---|---|---|---|---|---|---|---|\n";
  for (const ModelResult& m : r.models) {
    std::string ratio = "—";
    if (m.baseline && m.stall_host_us && m.stall_host_us->median > 0) {
      ratio = strf("%.0fx", m.baseline->stall_ms.median * 1000.0 / m.stall_host_us->median);
    }
    md += strf("| %s | %.3g B | %s | %zu | %s | %s | %s | %s | %s | %s |\n", m.name.c_str(),
               static_cast<double>(m.params) / 1e9, bytes_text(static_cast<double>(m.bytes)).c_str(), m.tensors,
               med_p99(m.stall_host_us).c_str(), med_p99(m.stall_stream_us, "%.2f").c_str(),
               m.fast_path_ns ? strf("%.1f", *m.fast_path_ns).c_str() : "—",
               med_p99(m.copy ? std::optional<Summary>(m.copy->stall_ms) : std::nullopt, "%.2f").c_str(),
               med_p99(m.baseline ? std::optional<Summary>(m.baseline->stall_ms) : std::nullopt, "%.1f").c_str(),
               ratio.c_str());
  }

  md += "\n## Swap strategies (" + label + ")\n\n";
  md += strf("Per swap: host time in `before_step()` and engine-stream time between stamps around it. "
             "rebind: the rows above (%d swaps). copy_in and remap: a sender/receiver pair each, "
             "%d swaps after %d unmeasured; no swap callback (the live addresses do not move). "
             "copy_in's stamps are queued "
             "behind a 1 ms hold, so they time its copy on the engine stream; remap synchronizes the "
             "engine stream, so it runs on an idle stream and its stamps bracket the host's remap. Raw "
             "copy: one plain device-to-device copy of the same bytes on an engine stream, behind the "
             "same hold, %d times.\n\n",
             o.swaps, o.strategy_swaps, o.warmup, o.raw_copy_reps);
  md += "| model | bytes | strategy | host µs (median / p99) | engine stream µs (median / p99) | "
        "raw device copy ms (median / p99) | engine stream / raw copy |\n|---|---|---|---|---|---|---|\n";
  for (const ModelResult& m : r.models) {
    const std::string bytes = bytes_text(static_cast<double>(m.bytes));
    const std::string raw = med_p99(m.raw_copy_ms, "%.3f");
    md += strf("| %s | %s | rebind | %s | %s | | |\n", m.name.c_str(), bytes.c_str(),
               med_p99(m.stall_host_us).c_str(), med_p99(m.stall_stream_us, "%.2f").c_str());
    std::string ratio = "—";
    if (m.copy_in_stream_us && m.raw_copy_ms && m.raw_copy_ms->median > 0) {
      ratio = strf("%.3fx", m.copy_in_stream_us->median / 1e3 / m.raw_copy_ms->median);
    }
    md += strf("| %s | %s | copy_in | %s | %s | %s | %s |\n", m.name.c_str(), bytes.c_str(),
               med_p99(m.copy_in_host_us).c_str(), med_p99(m.copy_in_stream_us).c_str(), raw.c_str(),
               ratio.c_str());
    if (!m.remap_unavailable.empty()) {
      md += strf("| %s | %s | remap | not available: %s | | | |\n", m.name.c_str(), bytes.c_str(),
                 m.remap_unavailable.c_str());
    } else {
      md += strf("| %s | %s | remap | %s | %s | | |\n", m.name.c_str(), bytes.c_str(),
                 med_p99(m.remap_host_us).c_str(), med_p99(m.remap_stream_us).c_str());
    }
  }

  md += "\n## Transfer bandwidth (" + label + ")\n\n";
  md += "Shadowsync: bytes / `UpdateReport.transfer` (first bucket posted to update ready), engine "
        "idle, the trainer's tensors packed by `Sender::publish`; from arena: `Sender::publish_arenas` "
        "(no packing). Raw: broadcast of the same bytes on a communicator of its own, in chunks of at most " +
        mib_text(o.raw_chunk) +
        ", timed on the receiver's stream (the link) and by the host from a common start to "
        "completion observed.\n\n";
  md += "| model | bytes | bucket | shadowsync GB/s median (min–max) | aggregate | from arena GB/s | "
        "raw GB/s stream / host | shadowsync / raw | baseline GB/s | copy-at-boundary background receive GB/s |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n";
  for (const ModelResult& m : r.models) {
    std::string shadow = "—", raw = "—", ratio = "—";
    if (m.transfer_gbps) {
      shadow = strf("%.1f (%.1f–%.1f)", m.transfer_gbps->median, m.transfer_gbps->min, m.transfer_gbps->max);
    }
    if (m.raw) {
      raw = strf("%.1f / %.1f", m.raw->stream_gbps.median, m.raw->host_gbps.median);
      if (m.transfer_gbps && m.raw->stream_gbps.median > 0) {
        ratio = strf("%.0f%%", 100 * m.transfer_gbps->median / m.raw->stream_gbps.median);
      }
    }
    md += strf("| %s | %s | %s (%zu) | %s | %s | %s | %s | %s | %s | %s |\n", m.name.c_str(),
               bytes_text(static_cast<double>(m.bytes)).c_str(), mib_text(m.bucket_bytes).c_str(), m.buckets,
               shadow.c_str(),
               m.transfer_aggregate_gbps ? strf("%.1f", *m.transfer_aggregate_gbps).c_str() : "—",
               m.transfer_arena_gbps ? strf("%.1f", m.transfer_arena_gbps->median).c_str() : "—",
               raw.c_str(), ratio.c_str(), m.baseline ? strf("%.1f", m.baseline->gbps).c_str() : "—",
               m.copy ? strf("%.1f", m.copy->receive_gbps).c_str() : "—");
  }

  md += "\n## Integrity cost (" + label + ")\n\n";
  md += strf("Transfer time (`UpdateReport.transfer`, which includes the receiver's checks) with "
             "checksums on (`SenderConfig::checksums` + `ReceiverConfig::require_checksums`) and with "
             "the non-finite guard (`ReceiverConfig::reject_nonfinite`), a sender/receiver pair "
             "each, %d updates after %d unmeasured, against the plain transfers of the stall rows "
             "(%d updates).\n\n",
             o.integrity_updates, o.warmup, o.swaps);
  md += "| model | bytes | plain ms (median, min–max) | checksums ms (median, min–max) | checksums cost | "
        "non-finite guard ms (median, min–max) | guard cost |\n|---|---|---|---|---|---|---|\n";
  for (const ModelResult& m : r.models) {
    const auto cell = [](const std::optional<Summary>& x) {
      return x ? strf("%.2f (%.2f–%.2f)", x->median, x->min, x->max) : std::string("—");
    };
    const auto cost = [&](const std::optional<Summary>& x) {
      if (!x || !m.transfer_ms || m.transfer_ms->median <= 0) return std::string("—");
      return strf("%+.1f%%", 100 * (x->median / m.transfer_ms->median - 1));
    };
    md += strf("| %s | %s | %s | %s | %s | %s | %s |\n", m.name.c_str(),
               bytes_text(static_cast<double>(m.bytes)).c_str(), cell(m.transfer_ms).c_str(),
               cell(m.checksums_transfer_ms).c_str(), cost(m.checksums_transfer_ms).c_str(),
               cell(m.nonfinite_transfer_ms).c_str(), cost(m.nonfinite_transfer_ms).c_str());
  }
  md += "\n";
  for (const std::string& line : integrity_verdicts(r, o)) md += "* **" + line + "**\n";

  md += "\n## Decode interference (" + label + ")\n\n";
  if (r.interference) {
    const DecodeResult& d = *r.interference;
    md += strf("%s; each decode step reads %s of the live weights (a different window each step); "
               "engine stream at default priority; while decoding, the next update is published as soon as the engine applied the last one.\n\n",
               r.interference_model.c_str(), bytes_text(static_cast<double>(d.decode_bytes)).c_str());
    md += "| | median ms | p99 ms | steps |\n|---|---|---|---|\n";
    md += strf("| alone | %.3f | %.3f | %zu |\n", d.alone_ms.median, d.alone_ms.p99, d.alone_ms.n);
    md += strf("| during a transfer | %.3f | %.3f | %zu |\n", d.during_ms.median, d.during_ms.p99, d.during_ms.n);
    md += strf("| whole window | %.3f | %.3f | %zu |\n", d.window_ms.median, d.window_ms.p99, d.window_ms.n);
    md += strf("| during / alone | %.3fx | %.3fx | |\n\n", d.ratio_median, d.ratio_p99);
    md += strf("Transfers while decoding: %zu ready (%zu superseded), %.1f GB/s median, %.1f ms each; "
               "a transfer was in flight %.0f%% of the window; decode time lost per update %.2f ms.\n",
               d.updates_ready, d.updates_superseded, d.transfer_gbps.median, d.transfer_ms.median,
               100 * d.busy_fraction, d.lost_ms_per_update);
  } else {
    md += "not measured\n";
  }

  md += "\n## Extra device memory on the receiver (" + label + ")\n\n";
  md += "Beyond the engine's own copy of the weights. Measured: free-memory delta " +
        std::string(cpu ? "(not available on the host backend)" : "(cudaMemGetInfo)") +
        " and the backend's allocation count; theoretical: what the scheme must hold.\n\n";
  md += "| model | scheme | measured (device) | allocated (backend) | theoretical |\n|---|---|---|---|---|\n";
  for (const ModelResult& m : r.models) {
    const auto row = [&](const char* scheme, const std::optional<MemoryFigure>& f) {
      if (!f) return;
      md += strf("| %s | %s | %s | %s | %s |\n", m.name.c_str(), scheme,
                 f->device_bytes ? bytes_text(*f->device_bytes).c_str() : "—",
                 bytes_text(f->backend_bytes).c_str(), bytes_text(f->theoretical).c_str());
    };
    row("shadowsync (shadow slot)", m.mem_shadowsync);
    row("per-parameter baseline (temp)", m.mem_baseline);
    row("copy-at-boundary (shadow)", m.mem_copy);
  }
  std::string nccl, staging;
  for (const ModelResult& m : r.models) {
    if (m.nccl_init_bytes || m.nccl_connect_bytes) {
      nccl += strf("%s%s: %s at init, %s more at the first transfer", nccl.empty() ? "" : "; ", m.name.c_str(),
                   m.nccl_init_bytes ? bytes_text(*m.nccl_init_bytes).c_str() : "—",
                   m.nccl_connect_bytes ? bytes_text(*m.nccl_connect_bytes).c_str() : "—");
    }
    if (m.sender_staging_bytes) {
      staging += strf("%s%s %s", staging.empty() ? "" : "; ", m.name.c_str(), bytes_text(*m.sender_staging_bytes).c_str());
    }
  }
  md += "\nNCCL communicator of a sender/receiver pair (receiver device, measured): " +
        (nccl.empty() ? "not measured" : nccl) +
        ".\nSender staging (trainer device, two buckets): " + (staging.empty() ? "not measured" : staging) + ".\n";

  md += "\n## Knob sweep (" + label + ")\n\n";
  if (r.sweep.empty()) {
    md += "not run\n";
  } else {
    md += r.sweep_model +
          "; idle GB/s with the engine idle; decode figures as in the interference section; "
          "lost = decode time the engine loses per update.\n\n";
    md += "| knob | bucket | max CTAs | engine priority | idle GB/s | raw GB/s (stream) | GB/s while "
          "decoding | decode alone ms | during ms (median / p99) | during / alone | lost ms / update | note |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|\n";
    for (const SweepRow& row : r.sweep) {
      std::string idle = row.gbps ? strf("%.1f", row.gbps->median) : "—";
      std::string raw = row.raw ? strf("%.1f", row.raw->stream_gbps.median) : "—";
      std::string wd = "—", alone = "—", during = "—", ratio = "—", lost = "—";
      if (row.decode) {
        const DecodeResult& d = *row.decode;
        wd = strf("%.1f", d.transfer_gbps.median);
        alone = strf("%.3f", d.alone_ms.median);
        during = strf("%.3f / %.3f", d.during_ms.median, d.during_ms.p99);
        ratio = strf("%.3fx", d.ratio_median);
        lost = strf("%.2f", d.lost_ms_per_update);
      }
      md += strf("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", row.knob.c_str(),
                 mib_text(row.bucket_bytes).c_str(),
                 row.max_ctas == 0 ? "default" : std::to_string(row.max_ctas).c_str(),
                 row.raised_priority ? "raised" : "default", idle.c_str(), raw.c_str(), wd.c_str(),
                 alone.c_str(), during.c_str(), ratio.c_str(), lost.c_str(), row.error.c_str());
    }
    md += "\n### Suggested defaults (by the rule shown; the table is the evidence)\n\n";
    for (const Recommendation& rec : recommend(r)) {
      md += "* **" + rec.knob + ": " + rec.value + "**: " + rec.evidence + "\n";
    }
  }
  md += "\n## Sender fault to engine report (" + label + ")\n\n";
  if (!r.fault) {
    md += "not run\n";
  } else {
    const FaultPhase& f = *r.fault;
    md += strf("%s (%s, %zu buckets); bucket deadline **%.0f ms** (`ReceiverConfig::bucket_deadline`, "
               "shortened for this phase; default 10000 ms), poll interval **%.0f µs** "
               "(`ReceiverConfig::poll_interval`). The sender publishes with `publish_streamed` and "
               "supplies the first half of the tensors; then it supplies nothing more (stalled; t0: "
               "its last supply returned) or, %lld ms later, its transport is aborted (aborted; t0: "
               "the abort). Timed from t0 to the receiver's failure report, which comes after the "
               "receiver aborted its own transport. Then new transports on both ends and one more "
               "update, which must apply (recovered).\n\n",
               f.model.c_str(), bytes_text(static_cast<double>(f.bytes)).c_str(), f.buckets,
               f.bucket_deadline_ms, f.poll_interval_us, static_cast<long long>(kFaultSettle.count()));
    md += "| variant | t0 → report ms (median / max) | samples ms | report − deadline ms (median) | "
          "codes | recovered |\n|---|---|---|---|---|---|\n";
    for (const FaultResult& v : f.variants) {
      const Summary s = summarize(v.report_ms);
      std::string samples, codes;
      for (double x : v.report_ms) samples += strf("%s%.1f", samples.empty() ? "" : ", ", x);
      for (const std::string& c : v.codes) codes += (codes.empty() ? "" : ", ") + c;
      md += strf("| %s | %s | %s | %s | %s | %d of %d |\n", v.variant.c_str(),
                 s.n ? strf("%.1f / %.1f", s.median, s.max).c_str() : "—", samples.c_str(),
                 s.n ? strf("%+.1f", s.median - f.bucket_deadline_ms).c_str() : "—", codes.c_str(),
                 v.recovered, v.reps);
    }
    for (const FaultResult& v : f.variants) {
      if (!v.first_error.empty()) md += "\n" + v.variant + ", the receiver's report: `" + v.first_error + "`\n";
    }
  }

  if (!r.skipped.empty() || !r.errors.empty()) {
    md += "\n## Skipped and errors\n\n";
    for (const std::string& s : r.skipped) md += "* skipped: " + s + "\n";
    for (const std::string& e : r.errors) md += "* error: " + e + "\n";
  }
  return md;
}

}  // namespace shadowsync::bench
