// The knob sweep and the sender-fault phase of the update benchmark (see bench_phases.h).
#include <algorithm>
#include <chrono>
#include <exception>
#include <string>
#include <vector>

#include "bench_phases.h"
#include "bench_runner.h"
#include "bench_text.h"

namespace shadowsync::bench {

void Bench::run_faults() {
  const std::string name = std::find(o_.models.begin(), o_.models.end(), "llama3-8b") != o_.models.end()
                               ? std::string("llama3-8b")
                               : o_.models.back();
  const ModelConfig& config = *find_model(name);
  const Layout layout = model_layout(config, o_.scale, o_.bucket_bytes);
  const double gb = static_cast<double>(layout.total_bytes()) / 1e9;
  const double deadline_s = o_.fault_deadline_ms / 1e3;
  // Per repetition: the deadline, two new communicators, one update.
  if (!have_budget(estimate(4 + 2 * o_.fault_reps * (deadline_s + 2), gb, 0.05), "sender fault")) return;
  SessionConfig session_config;
  session_config.bucket_deadline = std::chrono::milliseconds(o_.fault_deadline_ms);
  session_config.failures_expected = true;
  try {
    const TrainerWeights weights(p_, layout);
    Session session(p_, layout, 0, nullptr, session_config);
    auto engine_stream = p_.make_engine_stream(false);
    commit([&](Results& r) {
      FaultPhase f;
      f.model = name;
      f.bytes = layout.total_bytes();
      f.buckets = layout.groups()[0].bucket_count();
      f.bucket_deadline_ms = static_cast<double>(session.receiver_config().bucket_deadline.count());
      f.poll_interval_us = static_cast<double>(session.receiver_config().poll_interval.count());
      r.fault = f;
    });
    run_updates(p_, session, weights, *engine_stream, o_.warmup);
    for (const SenderFault fault : {SenderFault::kStalled, SenderFault::kAborted}) {
      progress(strf("sender fault on %s: %s sender mid-update, %d reps, bucket deadline %d ms",
                    name.c_str(), fault_name(fault), o_.fault_reps, o_.fault_deadline_ms));
      FaultResult result;
      std::string failure;
      try {
        sender_fault(session, weights, layout, *engine_stream, fault, o_.fault_reps, result);
      } catch (const std::exception& e) {
        failure = e.what();
      }
      commit([&](Results& r) { r.fault->variants.push_back(result); });
      const Summary s = summarize(result.report_ms);
      progress(strf("sender fault: %s: report %.1f ms median, %.1f ms max after t0 (%zu samples); recovered %d of %d",
                    fault_name(fault), s.median, s.max, s.n, result.recovered, result.reps));
      if (!failure.empty()) {
        error(cat("sender fault (", fault_name(fault), ")"), failure);
        break;  // the session may be unusable now
      }
    }
    // Nothing to settle: each repetition ends with its recovery update applied.
  } catch (const std::exception& e) {
    error("sender fault", e.what());
  }
}

void Bench::run_sweep(const ModelConfig& config) {
  const Layout layout = model_layout(config, o_.scale, o_.bucket_bytes);
  const std::size_t bytes = layout.total_bytes();
  const double gb = static_cast<double>(bytes) / 1e9;
  const std::size_t decode_bytes = decode_bytes_for(bytes);
  const double per_row = estimate(3 + o_.sweep_during_seconds, gb, o_.sweep_updates * 0.01);
  if (!have_budget(per_row * 2, "knob sweep")) return;
  commit([&](Results& r) { r.sweep_model = config.name; });
  progress(strf("sweep on %s: bucket sizes, NCCL max CTAs, engine stream priority", config.name.c_str()));
  try {
    const TrainerWeights weights(p_, layout);
    const std::size_t raw_bytes = std::min(o_.sweep_raw_bytes, bytes);
    DeviceBuffer raw_dst(p_.backend(1), raw_bytes);

    // Rows sharing one session (bucket = the default): default, raised priority, max CTAs.
    {
      Session session(p_, layout, 0);
      auto engine_stream = p_.make_engine_stream(false);
      run_updates(p_, session, weights, *engine_stream, o_.warmup);
      std::vector<int> ctas = {0};
      ctas.insert(ctas.end(), o_.sweep_ctas.begin(), o_.sweep_ctas.end());
      for (const int max_ctas : ctas) {
        SweepRow row;
        row.knob = max_ctas == 0 ? "default" : "max_ctas";
        row.bucket_bytes = layout.bucket_bytes();
        row.max_ctas = max_ctas;
        if (!have_budget(per_row, cat("sweep row max_ctas=", max_ctas))) break;
        try {
          if (max_ctas != 0) {
            progress(strf("sweep: max CTAs %d: new communicators", max_ctas));
            session.replace_transports(max_ctas);
            run_updates(p_, session, weights, *engine_stream, 1);  // connects the peers
          }
          sweep_row_body(row, session, weights, *engine_stream, decode_bytes);
          // The link limit with the same CTA bound, on a communicator of its own.
          if (max_ctas == 0) {
            row.raw = raw_link(p_, *raw_pair_, weights.arena.data(), raw_dst.data(), raw_bytes,
                               std::min(o_.raw_chunk, raw_bytes), o_.raw_reps);
          } else {
            TransportPair pair = p_.make_transports(max_ctas);
            row.raw = raw_link(p_, pair, weights.arena.data(), raw_dst.data(), raw_bytes,
                               std::min(o_.raw_chunk, raw_bytes), o_.raw_reps);
          }
          progress(strf("sweep: max CTAs %s: idle %.1f GB/s, raw %.1f GB/s, decode %.3fx, lost %.2f ms/update",
                        max_ctas == 0 ? "default" : std::to_string(max_ctas).c_str(),
                        row.gbps ? row.gbps->median : 0.0, row.raw->stream_gbps.median,
                        row.decode->ratio_median, row.decode->lost_ms_per_update));
        } catch (const std::exception& e) {
          row.error = e.what();
          error(cat("sweep max_ctas=", max_ctas), e.what());
        }
        commit([&](Results& r) { r.sweep.push_back(row); });
        if (max_ctas == 0 && row.error.empty()) {
          // Same session and CTAs, engine stream at the device's greatest priority.
          SweepRow raised;
          raised.knob = "engine_priority";
          raised.bucket_bytes = layout.bucket_bytes();
          raised.raised_priority = true;
          if (have_budget(per_row, "sweep row engine priority raised")) {
            try {
              auto raised_stream = p_.make_engine_stream(true);
              session.settle(*engine_stream);
              raised.decode = measure_interference(p_, session, weights, *raised_stream, decode_bytes,
                                                   o_.sweep_alone_steps, o_.sweep_during_seconds);
              session.settle(*raised_stream);
              progress(strf("sweep: engine priority raised: decode %.3fx, lost %.2f ms/update",
                            raised.decode->ratio_median, raised.decode->lost_ms_per_update));
            } catch (const std::exception& e) {
              raised.error = e.what();
              error("sweep engine priority", e.what());
            }
            commit([&](Results& r) { r.sweep.push_back(raised); });
          }
        }
        if (!row.error.empty() && max_ctas != 0) break;  // the session may be unusable now
      }
      session.settle(*engine_stream);
    }

    // Rows with a session each: the other bucket sizes.
    for (const std::size_t bucket : o_.sweep_buckets) {
      if (bucket == layout.bucket_bytes()) continue;  // the default row
      SweepRow row;
      row.knob = "bucket";
      row.bucket_bytes = bucket;
      if (!have_budget(per_row, cat("sweep row bucket=", mib_text(bucket)))) break;
      try {
        progress(strf("sweep: bucket %s: new session", mib_text(bucket).c_str()));
        const Layout bucketed = model_layout(config, o_.scale, bucket);
        Session session(p_, bucketed, 0);
        auto engine_stream = p_.make_engine_stream(false);
        run_updates(p_, session, weights, *engine_stream, o_.warmup);
        sweep_row_body(row, session, weights, *engine_stream, decode_bytes);
        session.settle(*engine_stream);
        progress(strf("sweep: bucket %s: idle %.1f GB/s, decode %.3fx, lost %.2f ms/update",
                      mib_text(bucket).c_str(), row.gbps ? row.gbps->median : 0.0,
                      row.decode->ratio_median, row.decode->lost_ms_per_update));
      } catch (const std::exception& e) {
        row.error = e.what();
        error(cat("sweep bucket=", mib_text(bucket)), e.what());
      }
      commit([&](Results& r) { r.sweep.push_back(row); });
    }
  } catch (const std::exception& e) {
    error("sweep", e.what());
  }
}

void Bench::sweep_row_body(SweepRow& row, Session& session, const TrainerWeights& weights,
                           Stream& engine_stream,
                           std::size_t decode_bytes) {
  const UpdatesRun run = run_updates(p_, session, weights, engine_stream, o_.sweep_updates);
  row.gbps = summarize(run.gbps);
  row.decode = measure_interference(p_, session, weights, engine_stream, decode_bytes,
                                    o_.sweep_alone_steps, o_.sweep_during_seconds);
}

}  // namespace shadowsync::bench
