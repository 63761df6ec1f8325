// How an update ends on the receiver thread: a failed one is discarded (its transport aborted and
// the streams drained when the transport failed, the previous offer restored), and every outcome
// is counted in the stats and handed to the observer.
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <mutex>
#include <string>

#include "core/receiver_abort.h"
#include "core/receiver_impl.h"

namespace shadowsync {
namespace {

// How long the receiver waits for its stream to drain after aborting the transport. An aborted
// collective returns at once on both transports; if it does not, the slots can no longer be
// trusted and the receiver stops taking updates rather than race with a stuck kernel.
constexpr std::chrono::seconds kAbortDrainLimit{10};

}  // namespace

void Receiver::Impl::discard(const UpdateHeader& header, const Refusal& refusal) {
  // Invariant 6: nothing of this update is offered; the live slots were never written.
  if (refusal.transport_failed) {
    abort_transport_watched(transport, header.version, config,
                            [this](const std::string& message) { count_stuck(message); });
    why_no_transport =
        "the last one was aborted after a failure; call replace_transport with a new one";
    if (!drain_streams()) {
      std::fprintf(stderr,
                   "shadowsync: receiver streams still busy %lld s after aborting update %llu; "
                   "the receiver stops taking updates\n",
                   static_cast<long long>(kAbortDrainLimit.count()),
                   static_cast<unsigned long long>(header.version));
      stopping.store(true);
    }
  }

  const std::uint64_t retracted = planner.retracted_version();
  const PendingUpdate* restored = planner.fail();
  if (restored != nullptr) owner.hook_->publish(restored);

  UpdateReport failed;
  failed.version = header.version;
  failed.outcome = UpdateOutcome::kFailed;
  failed.code = refusal.code;
  failed.failed_group = refusal.group;
  failed.failed_bucket = refusal.bucket;
  failed.failed_tensor = refusal.tensor;
  failed.error = fmt::format("update {} ({}) discarded: {}", header.version,
                             describe_groups(header, owner.layout_), refusal.why);
  report(failed);
  owner.hook_->note_failed(header.version);  // after the report: a waiter finds its error
  if (retracted != 0 && restored == nullptr) {
    UpdateReport lost;
    lost.version = retracted;
    lost.outcome = UpdateOutcome::kSuperseded;
    lost.code = ErrorCode::kSuperseded;
    lost.error = fmt::format("update {} was taken back for update {}, which failed after "
                             "overwriting part of it; send a new update",
                             retracted, header.version);
    report(lost);
  }
}

bool Receiver::Impl::drain_streams() {
  // The receives first: the checks wait on their events, so they can only finish after them.
  for (Stream* s : {stream.get(), checks.stream()}) {
    if (s == nullptr) continue;
    backend.event_record(*done_event, *s);
    if (!backend.event_wait_for(*done_event, kAbortDrainLimit)) return false;
  }
  return true;
}

void Receiver::Impl::count_stuck(const std::string& message) {
  std::lock_guard lock(stats_mutex);
  ++stats.stuck_aborts;
  stats.last_error = message;
}

void Receiver::Impl::report(const UpdateReport& update_report) {
  count(update_report);
  notify(update_report);
}

void Receiver::Impl::count(const UpdateReport& update_report) {
  std::lock_guard lock(stats_mutex);
  switch (update_report.outcome) {
    case UpdateOutcome::kReady:
      ++stats.updates_ready;
      stats.bytes_received += update_report.bytes;
      stats.last_transfer = update_report.transfer;
      stats.last_pacing = update_report.pacing;
      break;
    case UpdateOutcome::kFailed:
      ++stats.updates_failed;
      stats.last_error = update_report.error;
      stats.last_failure = update_report;
      stats.needs_transport = !transport;
      break;
    case UpdateOutcome::kSuperseded:
      ++stats.updates_superseded;
      break;
  }
}

void Receiver::Impl::notify(const UpdateReport& update_report) {
  std::function<void(const UpdateReport&)> callback;
  {
    std::lock_guard lock(stats_mutex);
    callback = observer;
  }
  if (callback) callback(update_report);
}

}  // namespace shadowsync
