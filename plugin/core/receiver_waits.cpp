// What the receiver thread waits on during a receive (receiver_thread.cpp): the buckets posted on
// its stream, the pacer's holds, the first engine step after a paced update, the checks of the
// received bytes. Each wait also watches for what ends a receive early: shutdown, abort_update,
// a failed transport, the update's and the bucket's deadlines.
#include <fmt/format.h>

#include <algorithm>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/receiver_impl.h"
#include "core/transport_wait.h"

namespace shadowsync {
namespace {

Refusal refusal_of(ErrorCode code, std::string why) {
  Refusal refusal;
  refusal.code = code;
  refusal.why = std::move(why);
  return refusal;
}

}  // namespace

std::optional<Refusal> Receiver::Impl::interrupted() {
  if (stopping.load()) return refusal_of(ErrorCode::kShutdown, "the receiver is shutting down");
  if (abort_requested.exchange(false)) {
    return refusal_of(ErrorCode::kTransport, "aborted by request");
  }
  if (auto error = transport->async_error()) {
    return refusal_of(ErrorCode::kTransport, fmt::format("transport failed: {}", *error));
  }
  return std::nullopt;
}

std::optional<Refusal> Receiver::Impl::wait_for_buckets(std::size_t& completed, std::size_t until,
                                                        Clock::time_point start,
                                                        Clock::time_point& bucket_start) {
  while (completed < until) {
    if (backend.event_wait_for(*bucket_events[completed], config.poll_interval)) {
      ++completed;
      bucket_start = Clock::now();
      continue;
    }
    pacer.poll();
    const auto now = Clock::now();
    if (auto refusal = interrupted()) return refusal;
    if (now - start > config.update_deadline) {
      return refusal_of(ErrorCode::kTimeout,
                        fmt::format("deadline of {} ms for the whole update passed with {} of {} "
                                    "buckets done{}",
                                    config.update_deadline.count(), completed, until,
                                    transport_wait_clause(*transport)));
    }
    if (now - bucket_start > config.bucket_deadline) {
      return refusal_of(ErrorCode::kTimeout,
                        fmt::format("bucket {} of {} did not complete within its deadline of {} "
                                    "ms{}",
                                    completed, until, config.bucket_deadline.count(),
                                    transport_wait_clause(*transport)));
    }
  }
  // An aborted collective also completes, with garbage: completion alone proves nothing.
  if (auto error = transport->async_error()) {
    return refusal_of(ErrorCode::kTransport, fmt::format("transport failed: {}", *error));
  }
  return std::nullopt;
}

std::optional<Refusal> Receiver::Impl::hold_back(std::chrono::nanoseconds hold) {
  const auto from = Clock::now();
  const auto until = from + hold;
  std::optional<Refusal> refusal;
  // The hold is the point of pacing, not a wait for a condition: sleep through it in slices
  // short enough to react to a shutdown, an abort or a failed peer as fast as a receive does.
  for (auto now = from; now < until && !refusal; now = Clock::now()) {
    refusal = interrupted();
    if (!refusal) {
      std::this_thread::sleep_for(std::min<Clock::duration>(until - now, config.poll_interval));
      pacer.poll();
    }
  }
  pacer.held(Clock::now() - from);
  return refusal;
}

std::optional<Refusal> Receiver::Impl::wait_for_clean_step(std::uint64_t steps_at_completion,
                                                           std::chrono::nanoseconds limit,
                                                           PacingReport& pacing) {
  const auto from = Clock::now();
  const auto until = from + limit;
  // Polled like a hold (the step hook's fast path stays one load: it signals nothing).
  for (auto now = from; pacer.steps_started() == steps_at_completion; now = Clock::now()) {
    if (now >= until) {
      pacing.clean_step_missed = true;
      break;
    }
    if (auto refusal = interrupted()) return refusal;
    std::this_thread::sleep_for(std::min<Clock::duration>(until - now, config.poll_interval));
  }
  pacing.clean_step_wait = Clock::now() - from;
  return std::nullopt;
}

std::optional<Refusal> Receiver::Impl::verify(const std::vector<ReceiveTarget>& targets,
                                              Event* sent_block_done, Clock::time_point start) {
  if (!checks.active()) return std::nullopt;
  checks.enqueue_results(sent_block_done);
  Refusal refusal;
  refusal.transport_failed = false;  // every collective completed: the transport is healthy
  while (!checks.results_ready(config.poll_interval)) {
    if (stopping.load()) {
      refusal.code = ErrorCode::kShutdown;
      refusal.why = "the receiver is shutting down";
      return refusal;
    }
    if (abort_requested.exchange(false)) {  // as in wait_for_buckets (abort_update's contract)
      refusal.code = ErrorCode::kTransport;
      refusal.why = "aborted by request";
      refusal.transport_failed = true;
      return refusal;
    }
    if (Clock::now() - start > config.update_deadline) {
      refusal.code = ErrorCode::kTimeout;
      refusal.why = fmt::format("deadline of {} ms for the whole update passed while its bytes "
                                "were checked",
                                config.update_deadline.count());
      return refusal;
    }
  }
  return checks.compare(targets);
}

}  // namespace shadowsync
