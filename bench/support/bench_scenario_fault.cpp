// A trainer that fails mid-update (see bench_scenarios.h).
#include <chrono>
#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "bench_scenarios.h"

namespace shadowsync::bench {

const char* fault_name(SenderFault fault) {
  return fault == SenderFault::kStalled ? "stalled" : "aborted";
}

void sender_fault(Session& s, const TrainerWeights& weights, const Layout& layout,
                  Stream& engine_stream, SenderFault fault, int reps, FaultResult& result) {
  result.variant = fault_name(fault);
  // The tensors whose bytes end in the first half of the arena: at least one, never all.
  const std::vector<TensorPlacement>& placements = layout.groups().at(0).tensors();
  std::vector<SourceTensor> first_half;
  for (std::size_t t = 0; t + 1 < placements.size(); ++t) {
    if (t > 0 && placements[t].offset + placements[t].bytes > layout.total_bytes() / 2) break;
    first_half.push_back(weights.sources[t]);
  }
  for (int r = 0; r < reps; ++r) {
    ++result.reps;
    const std::uint64_t live = s.hook().applied_version();
    StreamedPublish publish = s.publish_streamed();
    const std::uint64_t v = publish.header().version;
    publish.supply(first_half);
    if (fault == SenderFault::kAborted) std::this_thread::sleep_for(kFaultSettle);
    const auto t0 = Clock::now();
    if (fault == SenderFault::kAborted) s.abort_sender_transport();
    const Session::Report report = s.wait_report(v, cat("the receiver's report of ", result.variant, " update ", v));
    if (report.outcome != UpdateOutcome::kFailed) {
      throw BenchError(cat(result.variant, " update ", v, " was not reported failed"));
    }
    result.report_ms.push_back(to_ms(report.at - t0));
    result.codes.push_back(shadowsync::to_string(report.code));
    if (r == 0) result.first_error = report.error;
    if (s.hook().has_pending() || s.hook().applied_version() != live) {
      throw BenchError(cat("after the failed update ", v, " the engine no longer serves version ", live));
    }

    // The trainer gives up on the update and both ends rendezvous again.
    publish.cancel();
    bool ended = false;
    try {
      ended = publish.handle().wait_for(kWaitLimit);
    } catch (const std::exception&) {
      ended = true;  // failed, as it must
    }
    if (!ended) throw BenchError(cat("the cancelled publish of update ", v, " did not end"));
    s.replace_transports(0);
    PublishHandle good = s.publish(weights);
    const std::uint64_t g = good.header().version;
    s.wait_resolved(g, cat("update ", g, " after the ", result.variant, " one"));
    if (!s.ready_report(g)) {
      throw BenchError(cat("update ", g, " after the ", result.variant, " one failed: ",
                           s.wait_report(g, "its report").error));
    }
    if (!good.wait_for(kWaitLimit)) throw BenchError(cat("publish of version ", g, " not done"));
    if (s.hook().apply_pending_now(engine_stream) != std::optional<std::uint64_t>(g)) {
      throw BenchError(cat("update ", g, " after the ", result.variant, " one did not apply"));
    }
    ++result.recovered;
  }
}

}  // namespace shadowsync::bench
