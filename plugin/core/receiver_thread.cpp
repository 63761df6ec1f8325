// The receiver thread: its command loop (Receiver's methods enqueue the commands), and one
// update's receive, from the previous offer's resolution to the new offer. What it waits on
// meanwhile is in receiver_waits.cpp, how a failed receive ends in receiver_outcomes.cpp.
#include <fmt/format.h>

#include <mutex>
#include <optional>
#include <vector>

#include "core/receiver_abort.h"
#include "core/receiver_impl.h"

namespace shadowsync {

void Receiver::Impl::run() {
  for (;;) {
    Command command;
    commands.wait_dequeue(command);  // blocks while idle: no busy loop
    switch (command.kind) {
      case Command::Kind::kBegin:
        abort_requested.store(false);  // an abort only targets an update already in flight
        if (stopping.load()) break;
        receive(command.header, command.checks);
        break;
      case Command::Kind::kReplaceTransport:
        transport = std::move(command.transport);
        {
          std::lock_guard lock(stats_mutex);
          stats.needs_transport = false;
        }
        break;
      case Command::Kind::kUseRoutingPlan:
        routing = std::move(command.routing);
        // Routes land straight where they belong: the bucket buffer of a plan goes unused.
        bucket_buffer = DeviceBuffer();
        {
          std::lock_guard lock(stats_mutex);
          stats.trainer_count = routing->plan->trainer_count();
          stats.routing_fingerprint = routing->plan->fingerprint();
        }
        break;
      case Command::Kind::kReleaseTransport:
        if (transport) {
          // NCCL: finalize and destroy, with the departed trainer's end.
          release_transport_watched(transport, command.why, config,
                                    [this](const std::string& message) { count_stuck(message); });
          why_no_transport =
              fmt::format("released: {}; the next rendezvous installs a new one", command.why);
          std::lock_guard lock(stats_mutex);
          stats.needs_transport = true;
        }
        break;
      case Command::Kind::kDrain:
        command.drained->set_value();
        break;
      case Command::Kind::kShutdown:
        return;
    }
  }
}

void Receiver::Impl::resolve_offer() {
  const PendingUpdate* offered = planner.offer();
  if (offered == nullptr) return;
  {
    std::lock_guard lock(commit_mutex);
    if (held_discarded) {  // dropped while held ready: the engine never saw it
      held_discarded = false;
      planner.on_discarded();
      return;
    }
  }
  if (owner.hook_->retract() != nullptr) {
    planner.on_retracted();  // latest wins; its groups stay pending
  } else {
    owner.hook_->wait_swap_finished(offered->version);
    planner.on_applied();
  }
}

bool Receiver::Impl::wait_for_commit(Clock::time_point deadline) {
  std::unique_lock lock(commit_mutex);
  while (held_ready != nullptr) {
    if (stopping.load() || Clock::now() > deadline) return false;
    committed.wait_for(lock, config.poll_interval);
  }
  return true;
}

void Receiver::Impl::receive(const UpdateHeader& header, const UpdateChecks& asked) {
  const Layout& layout = owner.wire_layout();
  {
    std::lock_guard lock(commit_mutex);
    if (discard_when_ready < header.version) discard_when_ready = 0;  // a newer update: moot
  }
  if (!transport) {
    UpdateReport failed;
    failed.version = header.version;
    failed.outcome = UpdateOutcome::kFailed;
    failed.code = ErrorCode::kTransport;
    failed.error = fmt::format("update {}: no transport ({})", header.version, why_no_transport);
    report(failed);
    return;
  }

  RouteMover* mover = nullptr;
  if (std::optional<Refusal> wrong = check_route_mover(mover)) {
    // Its peers (trainer ranks of another set-up) would wait for this rank's acks: end them.
    abort_transport_watched(transport, header.version, config,
                            [this](const std::string& message) { count_stuck(message); });
    why_no_transport = fmt::format("the last one was aborted: {}; call replace_transport with "
                                   "one of the routing plan",
                                   wrong->why);
    UpdateReport failed;
    failed.version = header.version;
    failed.outcome = UpdateOutcome::kFailed;
    failed.code = wrong->code;
    failed.error = fmt::format("update {}: {}", header.version, wrong->why);
    report(failed);
    return;
  }

  if (config.commit_mode == CommitMode::kCoordinated &&
      !wait_for_commit(Clock::now() + config.update_deadline)) {
    UpdateReport failed;
    failed.version = header.version;
    failed.outcome = UpdateOutcome::kFailed;
    failed.code = stopping.load() ? ErrorCode::kShutdown : ErrorCode::kTimeout;
    std::lock_guard lock(commit_mutex);
    failed.error = fmt::format(
        "update {}: update {} is ready and was not committed within {} ms (commit_mode "
        "coordinated keeps a ready update until commit(); its slots cannot take another)",
        header.version, held_version.load(), config.update_deadline.count());
    report(failed);
    return;
  }
  resolve_offer();
  // From here on the previous slots may be written: rollback() is no longer possible. If the
  // engine rolled back just before, its slots are live again.
  if (const std::vector<GroupSwap>* live_now = owner.hook_->close_rollback_window(header.version)) {
    planner.on_rolled_back(*live_now);
  }
  const std::vector<ReceiveTarget> targets = planner.begin(header.version, header.groups);
  const auto start = Clock::now();

  // Invariant 2: no byte lands in a slot before the engine stream passed its last read of it.
  for (const ReceiveTarget& target : targets) {
    backend.stream_wait_event(*stream, *owner.slots_->group(target.group).release[target.slot]);
  }
  seed_kept(targets);
  // Without a plan straight into the shadow arena: one broadcast per bucket, no staging, no
  // per-tensor work. With one, into the bucket buffer, then the plan's pieces into the shadow.
  checks.begin(carries_checksums(header, layout), asked.verify_matches_live);
  const ReceivePlan* plan = owner.plan_.get();
  std::size_t bucket_count = 0;
  for (const ReceiveTarget& target : targets) {
    bucket_count += layout.groups()[target.group].bucket_count();
  }
  // Unpaced, every bucket is posted at once and the receive is waited for at the end. Paced, one
  // bucket at a time: posted, waited for, then held back as long as the pacer says. Paced or
  // waiting for a clean step, the pacer learns the engine's idle step first.
  if (pacer.learns_steps()) {
    // The baseline leaves out the last swap's step: it is longer by the swap (a copy_in of every
    // weight under CUDA graphs: 16 GB at 8B, about one raw device copy, 10.6 ms on an H100).
    const StepHook& hook = *owner.hook_;
    const auto swap_end = hook.last_swap_started() + hook.last_swap_duration();
    pacer.begin(std::chrono::duration_cast<std::chrono::nanoseconds>(swap_end.time_since_epoch())
                    .count());
  }
  std::size_t posted = 0;
  std::size_t completed = 0;  // buckets (and the checksum block) done
  std::uint64_t sequence = 0;  // routed: the bucket's index within the update
  const std::uint64_t routed_before = mover != nullptr ? mover->routed_bytes() : 0;
  const std::uint64_t in_place_before = mover != nullptr ? mover->routed_in_place_bytes() : 0;
  std::size_t bytes = 0;
  auto bucket_start = start;
  std::optional<Refusal> failure;
  for (const ReceiveTarget& target : targets) {
    const GroupLayout& group = layout.groups()[target.group];
    std::byte* arena = owner.slots_->slot_data(target.group, target.slot);
    for (std::size_t k = 0; k < group.bucket_count() && !failure; ++k) {
      const Bucket bucket = group.bucket(k);
      Event& bucket_done = *bucket_events[posted++];
      bytes += bucket.bytes;
      if (mover != nullptr) {
        // Every trainer rank's routes of the bucket, straight to the slot (or the staging of a
        // quantized tensor) as the receive plan places them: no bucket buffer.
        mover->receive_routes_async(
            {.version = header.version, .sequence = sequence++, .group = target.group, .bucket = k},
            routing->copies[target.group][k], {.slot = arena, .staging = staging.data()},
            *stream);
        if (plan != nullptr) {
          for (const PlanQuantizeStep& q : plan->quantize_steps(target.group, k)) {
            backend.quantize_fp8_async(staging.data() + q.staging_offset, q.source, q.elements,
                                       q.parts, arena + q.dst_offset,
                                       reinterpret_cast<float*>(arena + q.scale_offset), *stream);
          }
        }
        backend.event_record(bucket_done, *stream);
        if (plan == nullptr && checks.active()) {
          checks.enqueue_bucket(group, target.group, arena, k, bucket_done);
        }
      } else if (plan == nullptr) {
        transport->broadcast_async(arena + bucket.offset, bucket.bytes, config.root_rank, *stream);
        backend.event_record(bucket_done, *stream);
        if (checks.active()) checks.enqueue_bucket(group, target.group, arena, k, bucket_done);
      } else {
        std::byte* landed = bucket_buffer.data();
        transport->broadcast_async(landed, bucket.bytes, config.root_rank, *stream);
        if (checks.checksums()) checks.enqueue_bucket_checksum(landed, bucket.bytes, *stream);
        for (const PlanPiece& p : plan->pieces(target.group, k)) {
          std::byte* dst = (p.to_staging ? staging.data() : arena) + p.dst_offset;
          backend.memcpy_2d_async(dst, p.dst_pitch, landed + p.src_offset, p.src_pitch,
                                  p.row_bytes, p.rows, *stream);
        }
        // The tensors whose last bytes this bucket brought: quantized into the shadow.
        for (const PlanQuantizeStep& q : plan->quantize_steps(target.group, k)) {
          backend.quantize_fp8_async(staging.data() + q.staging_offset, q.source, q.elements,
                                     q.parts, arena + q.dst_offset,
                                     reinterpret_cast<float*>(arena + q.scale_offset), *stream);
        }
        backend.event_record(bucket_done, *stream);
      }
      if (!pacer.active()) continue;
      // From the post (a same-host receive returns from broadcast_async once the sender's
      // bytes are there) to the completion: the time the bucket competed with decoding.
      const auto posted_at = Clock::now();
      failure = wait_for_buckets(completed, posted, start, bucket_start);
      if (failure) break;
      const auto now = Clock::now();
      const auto hold =
          pacer.hold_after(bucket.bytes, now - posted_at, bucket_count - posted,
                           config.update_deadline - (now - start));
      if (posted < bucket_count && hold.count() > 0) {
        failure = hold_back(hold);
        bucket_start = Clock::now();
      }
    }
    if (failure) break;
  }
  Event* sent_block_done = nullptr;
  // The clean step (offer_after_clean_step, or a budget) is waited for before the checksum block
  // where there is one: that block, a few bytes, is then the only receive work after the clean
  // step, and the sender's publish returns only once the engine ran a step no bucket slowed. A
  // caller that commits right after the send (vLLM's finish_weight_update, which holds the engine
  // while it runs: no step could start during the wait) thus swaps at a clean step as well.
  PacingReport clean_step;
  const auto clean_step_limit = pacer.clean_step_limit();
  const bool clean_step_before_block = clean_step_limit && checks.checksums();
  if (!failure && checks.checksums()) {
    if (clean_step_before_block) {
      failure = wait_for_buckets(completed, posted, start, bucket_start);
      if (!failure) {
        failure = wait_for_clean_step(pacer.steps_started(), *clean_step_limit, clean_step);
      }
    }
    if (!failure) {
      // The sender's checksums, one per bucket, as one more broadcast (update_header.h says why).
      transport->broadcast_async(checks.sent_checksums(), posted * sizeof(std::uint64_t),
                                 config.root_rank, *stream);
      sent_block_done = bucket_events[posted++].get();
      backend.event_record(*sent_block_done, *stream);
    }
  }

  if (!failure) failure = wait_for_buckets(completed, posted, start, bucket_start);
  if (!failure && asked.verify_matches_live) {
    // Every bucket and plan copy has completed (waited for above): the slots are whole. The
    // receiver thread may read the live table: no swap runs while a receive is in flight.
    checks.enqueue_match_live(targets, owner.layout_, *owner.slots_);
  }
  const std::uint64_t steps_at_completion = pacer.steps_started();
  PacingReport pacing = pacer.active() ? pacer.finish() : PacingReport{};
  pacing.clean_step_wait = clean_step.clean_step_wait;
  pacing.clean_step_missed = clean_step.clean_step_missed;
  if (!failure) failure = verify(targets, sent_block_done, start);
  const auto transfer = Clock::now() - start;
  if (clean_step_limit && !clean_step_before_block && !failure) {
    failure = wait_for_clean_step(steps_at_completion, *clean_step_limit, pacing);
  }
  if (failure) {
    discard(header, *failure);
    return;
  }

  // Invariant 3: only a completed receive is offered.
  std::vector<UpdateReport> reports;
  if (const std::uint64_t superseded = planner.retracted_version(); superseded != 0) {
    UpdateReport report_superseded;
    report_superseded.version = superseded;
    report_superseded.outcome = UpdateOutcome::kSuperseded;
    reports.push_back(std::move(report_superseded));
  }
  UpdateReport ready;
  ready.version = header.version;
  ready.outcome = UpdateOutcome::kReady;
  for (const ReceiveTarget& target : targets) ready.groups.push_back(target.group);
  ready.bytes = bytes;
  ready.transfer = transfer;
  ready.pacing = pacing;
  reports.push_back(std::move(ready));

  // Counted before the offer is visible, so that stats never lag behind what the engine applied.
  if (mover != nullptr) {
    std::lock_guard lock(stats_mutex);
    stats.routed_bytes = mover->routed_bytes() - routed_before;
    stats.routed_in_place_bytes = mover->routed_in_place_bytes() - in_place_before;
  }
  for (const UpdateReport& r : reports) count(r);
  const PendingUpdate* offered = &planner.complete();
  if (config.commit_mode == CommitMode::kCoordinated) {
    std::lock_guard lock(commit_mutex);
    if (discard_when_ready == header.version) {  // discard() came while it was arriving
      discard_when_ready = 0;
      planner.on_discarded();
    } else {
      held_ready = offered;  // goes live only in commit()
      held_version = header.version;
      std::lock_guard stats_lock(stats_mutex);
      stats.ready_version = header.version;
    }
  } else {
    owner.hook_->publish(offered);
  }
  for (const UpdateReport& r : reports) notify(r);
}

std::optional<Refusal> Receiver::Impl::check_route_mover(RouteMover*& mover) const {
  if (!routing) return std::nullopt;
  const RoutingPlan& plan = *routing->plan;
  const auto wrong = [](std::string why) {
    Refusal refusal;
    refusal.code = ErrorCode::kInvalidArgument;
    refusal.why = std::move(why);
    return refusal;
  };
  mover = transport->route_mover();
  if (mover == nullptr) {
    return wrong(fmt::format("transport '{}' moves no routes (route_mover() is null), but this "
                             "receiver is engine rank {} of a routing plan; replace_transport "
                             "with one of that plan",
                             transport->name(), routing->engine_rank));
  }
  const RoutingPlan& theirs = mover->routing_plan();
  if (theirs.trainer_count() != plan.trainer_count()) {
    return wrong(fmt::format("the routing plan has {} trainer ranks, transport '{}' {}",
                             plan.trainer_count(), transport->name(), theirs.trainer_count()));
  }
  if (theirs.engine_count() != plan.engine_count()) {
    return wrong(fmt::format("the routing plan has {} engine ranks, transport '{}' {}",
                             plan.engine_count(), transport->name(), theirs.engine_count()));
  }
  if (mover->engine_rank() != routing->engine_rank) {
    return wrong(fmt::format("this receiver is engine rank {} of the routing plan, its transport "
                             "'{}' {} {}",
                             routing->engine_rank, transport->name(),
                             mover->engine_rank() >= 0 ? "engine rank" : "trainer rank",
                             mover->engine_rank() >= 0 ? mover->engine_rank()
                                                       : mover->trainer_rank()));
  }
  if (theirs.fingerprint() != plan.fingerprint()) {
    return wrong(fmt::format("the routing plan {:#018x} differs from transport '{}''s {:#018x} "
                             "(the trainer ranks' regions or the engine ranks' needs differ)",
                             plan.fingerprint(), transport->name(), theirs.fingerprint()));
  }
  return std::nullopt;
}

void Receiver::Impl::seed_kept(const std::vector<ReceiveTarget>& targets) {
  const ReceivePlan* plan = owner.plan_.get();
  if (plan == nullptr) return;
  SlotTable& slots = *owner.slots_;
  if (kept_seeded.empty()) {
    // The live slots hold the engine's weights, kept tensors included, by the first receive
    // (the engine put them there, or adopted them into the live arena, before any update).
    kept_seeded.assign(slots.size(), {false, false});
    for (std::size_t g = 0; g < slots.size(); ++g) kept_seeded[g][slots.live_slot(g)] = true;
  }
  for (const ReceiveTarget& target : targets) {
    bool& seeded = kept_seeded[target.group][target.slot];
    if (seeded) continue;
    const auto& tensors = owner.layout_.groups()[target.group].tensors();
    std::byte* slot = slots.slot_data(target.group, target.slot);
    for (const std::size_t t : plan->kept(target.group)) {
      const TensorPlacement& kept = tensors[t];
      // The receiver thread may read the table now: no swap can run (see slot_table.h).
      backend.memcpy_async(slot + kept.offset, slots.live_tensor(target.group, t, kept.offset),
                           kept.bytes, *stream);
    }
    seeded = true;  // on `stream`, before every later write to the slot
  }
}

}  // namespace shadowsync
