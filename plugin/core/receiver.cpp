#include "shadowsync/receiver.h"

#include <blockingconcurrentqueue.h>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <future>
#include <mutex>
#include <optional>
#include <thread>

#include "core/check_receiver_config.h"
#include "core/check_root_rank.h"
#include "core/pacer.h"
#include "core/receive_checks.h"
#include "core/receiver_abort.h"
#include "core/refusal.h"
#include "core/slot_planner.h"
#include "core/slot_table.h"
#include "shadowsync/error.h"

namespace shadowsync {
namespace {

using Clock = std::chrono::steady_clock;

// How long the receiver waits for its stream to drain after aborting the transport. An aborted
// collective returns at once on both transports; if it does not, the slots can no longer be
// trusted and the receiver stops taking updates rather than race with a stuck kernel.
constexpr std::chrono::seconds kAbortDrainLimit{10};

struct Command {
  enum class Kind { kBegin, kReplaceTransport, kReleaseTransport, kDrain, kShutdown };
  Kind kind = Kind::kBegin;
  UpdateHeader header;
  UpdateChecks checks;  // kBegin
  std::unique_ptr<Transport> transport;
  std::string why;  // kReleaseTransport
  std::shared_ptr<std::promise<void>> drained;
};

}  // namespace

struct Receiver::Impl {
  Impl(Receiver& owner, Backend& backend, std::unique_ptr<Transport> transport,
       ReceiverConfig config)
      : owner(owner),
        backend(backend),
        config(config),
        transport(std::move(transport)),
        planner(*owner.slots_),
        stream(backend.create_stream(StreamPriority::kLow)),
        done_event(backend.create_event()),
        checks(owner.wire_layout(), owner.layout_, backend, config.reject_nonfinite),
        pacer(config.decode_slowdown_budget, config.max_receive_bytes_per_second,
              owner.hook_->step_times()) {
    std::size_t max_buckets = 0;  // of an update that carries every group
    for (const auto& g : owner.wire_layout().groups()) max_buckets += g.bucket_count();
    if (owner.plan_) bucket_buffer = DeviceBuffer(backend, owner.plan_->max_bucket_bytes());
    // One more event for a trailing checksum block.
    for (std::size_t i = 0; i <= max_buckets; ++i) bucket_events.push_back(backend.create_event());
  }

  void run();
  void receive(const UpdateHeader& header, const UpdateChecks& asked);
  void resolve_offer();
  // Waits until the first `until` posted buckets completed (`completed` counts them; a bucket's
  // deadline runs from `bucket_start`, the last completion or hold). Nothing: they did.
  // Otherwise why the receive failed.
  std::optional<Refusal> wait_for_buckets(std::size_t& completed, std::size_t until,
                                          Clock::time_point start,
                                          Clock::time_point& bucket_start);
  // Pacing: waits `hold` before the next bucket is posted, watching for what ends a receive.
  std::optional<Refusal> hold_back(std::chrono::nanoseconds hold);
  // Pacing by a budget, the update complete: waits until an engine step started after
  // `steps_at_completion` (the count when its last bucket completed), at most `limit`, and
  // records the wait in `pacing`. A swap delays the step it runs before, and on an engine whose
  // host runs a step ahead (vLLM) the one in flight too; if that one met the last bucket, the
  // clients see one token gap longer by both. Nothing: waited; else why the receive stops.
  std::optional<Refusal> wait_for_clean_step(std::uint64_t steps_at_completion,
                                             std::chrono::nanoseconds limit,
                                             PacingReport& pacing);
  // Why a receive stops early: shutdown, abort_update, a failed transport; nothing otherwise.
  std::optional<Refusal> interrupted();
  // A plan's kept tensors (receive_plan.h): copies their live bytes into each target slot that
  // has not had them yet, on `stream`, before anything lands there.
  void seed_kept(const std::vector<ReceiveTarget>& targets);
  // Waits for the checks enqueued while the buckets were posted and compares; nothing when they
  // pass or nothing was asked. `sent_block_done`: the event of the sender's checksum block.
  std::optional<Refusal> verify(const std::vector<ReceiveTarget>& targets, Event* sent_block_done,
                                Clock::time_point start);
  // Waits (up to kAbortDrainLimit each) until neither stream of the receiver has work queued;
  // false if one is still busy then.
  bool drain_streams();
  void discard(const UpdateHeader& header, const Refusal& refusal);
  // A teardown of the transport overran ReceiverConfig::abort_deadline (the watcher thread).
  void count_stuck(const std::string& message);
  void report(const UpdateReport& report);  // count + notify
  void count(const UpdateReport& report);   // stats only
  void notify(const UpdateReport& report);  // the observer only

  Receiver& owner;
  Backend& backend;
  const ReceiverConfig config;
  std::unique_ptr<Transport> transport;  // receiver thread only
  // Receiver thread only: why `transport` is null, for the message of an update that finds none
  // (read only while it is).
  std::string why_no_transport =
      "the receiver was made without one and replace_transport was never called; give it the "
      "transport to the trainer first";
  SlotPlanner planner;                   // receiver thread only
  std::unique_ptr<Stream> stream;        // the receives
  std::unique_ptr<Event> done_event;
  std::vector<std::unique_ptr<Event>> bucket_events;
  // With a receive plan: where each wire bucket lands before its pieces are copied out. One is
  // enough: the receive, the checksum and the pieces of a bucket and the next bucket's receive are
  // all on `stream`, in that order.
  DeviceBuffer bucket_buffer;
  // Per group and slot: the slot holds the plan's kept tensors. Empty until the first receive.
  std::vector<std::array<bool, 2>> kept_seeded;  // receiver thread only
  ReceiveChecks checks;  // receiver thread only
  Pacer pacer;           // receiver thread only

  moodycamel::BlockingConcurrentQueue<Command> commands;
  std::atomic<bool> abort_requested{false};
  std::atomic<bool> stopping{false};
  std::thread thread;

  std::mutex accept_mutex;  // begin_update callers
  std::uint64_t last_accepted_version = 0;

  // kCoordinated: the update held ready until commit(). Set by the receiver thread, cleared by
  // commit() on the engine thread.
  std::mutex commit_mutex;
  std::condition_variable committed;
  const PendingUpdate* held_ready = nullptr;
  std::uint64_t held_version = 0;
  // Waits until no update is held ready (committed), the receiver stops, or `deadline` passes.
  bool wait_for_commit(Clock::time_point deadline);

  mutable std::mutex stats_mutex;
  ReceiverStats stats;
  std::function<void(const UpdateReport&)> observer;
};

namespace {

Refusal refusal_of(ErrorCode code, std::string why) {
  Refusal refusal;
  refusal.code = code;
  refusal.why = std::move(why);
  return refusal;
}

// The plan's checks that need the receiver's config and layout; before anything is allocated.
std::unique_ptr<const ReceivePlan> checked_plan(std::unique_ptr<const ReceivePlan> plan,
                                                const Layout& layout,
                                                const ReceiverConfig& config) {
  if (!plan) return plan;
  if (plan->engine_fingerprint() != layout.fingerprint()) {
    throw Error(ErrorCode::kLayoutMismatch,
                fmt::format("the receive plan was built for engine layout {:#018x}, but the "
                            "receiver's layout is {:#018x}",
                            plan->engine_fingerprint(), layout.fingerprint()));
  }
  if (config.reject_nonfinite) {
    throw Error(ErrorCode::kInvalidArgument,
                "ReceiverConfig::reject_nonfinite is not available with a receive plan (it counts "
                "per trainer tensor, which a plan spreads over buckets and engine tensors); "
                "checksums are");
  }
  return plan;
}

// The engine's remap arenas against the config and the layout; before anything is allocated.
void check_engine_arenas(const EngineArenas& arenas, const Layout& layout,
                         const ReceiverConfig& config) {
  const auto given = std::count_if(arenas.begin(), arenas.end(),
                                   [](const auto& arena) { return arena != nullptr; });
  if (given == 0) return;
  if (config.swap_strategy == SwapStrategy::kCopyIn) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("engine arenas were given for {} group(s), but swap_strategy is {}: "
                            "an engine arena is swapped by remapping it (swap_strategy remap) or "
                            "by flipping between its two slots (swap_strategy rebind)",
                            given, swap_strategy_name(config.swap_strategy)));
  }
  if (arenas.size() > layout.groups().size()) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{} engine arena entries were given, but the layout has {} groups",
                            arenas.size(), layout.groups().size()));
  }
  for (std::size_t g = 0; g < arenas.size(); ++g) {
    if (!arenas[g]) continue;
    const GroupLayout& group = layout.groups()[g];
    if (arenas[g]->bytes() != group.arena_bytes()) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("the engine arena of group '{}' holds {} bytes, but the layout's "
                              "group needs {}: the arena must be laid out as the group is",
                              group.name(), arenas[g]->bytes(), group.arena_bytes()));
    }
  }
}

}  // namespace

Receiver::Receiver(Layout layout, Backend& backend, std::unique_ptr<Transport> transport,
                   ReceiverConfig config, EngineArenas engine_arenas)
    : Receiver(std::move(layout), nullptr, backend, std::move(transport), config,
               std::move(engine_arenas)) {}

Receiver::Receiver(Layout layout, ReceivePlan plan, Backend& backend,
                   std::unique_ptr<Transport> transport, ReceiverConfig config,
                   EngineArenas engine_arenas)
    : Receiver(std::move(layout), std::make_unique<const ReceivePlan>(std::move(plan)), backend,
               std::move(transport), config, std::move(engine_arenas)) {}

Receiver::Receiver(Layout layout, std::unique_ptr<const ReceivePlan> plan, Backend& backend,
                   std::unique_ptr<Transport> transport, ReceiverConfig config,
                   EngineArenas engine_arenas)
    // The config and the engine's arenas are checked first, before the slots are allocated.
    : layout_((check_receiver_config(config, transport.get(), backend),
               check_engine_arenas(engine_arenas, layout, config), std::move(layout))),
      plan_(checked_plan(std::move(plan), layout_, config)),
      slots_(std::make_unique<SlotTable>(layout_, backend, config.swap_strategy, engine_arenas)),
      hook_(std::make_unique<StepHook>(
          layout_, *slots_,
          config.decode_slowdown_budget.has_value() || config.max_receive_bytes_per_second != 0,
          config.gated_swaps ? backend.create_stream_gate() : nullptr, config.gate_deadline)),
      impl_(std::make_unique<Impl>(*this, backend, std::move(transport), config)) {
  impl_->thread = std::thread([this] { impl_->run(); });
}

Receiver::~Receiver() { shutdown(); }

void Receiver::begin_update(const UpdateHeader& header, const UpdateChecks& checks) {
  if (impl_->stopping.load()) {
    throw Error(ErrorCode::kShutdown,
                fmt::format("update {}: the receiver is shut down", header.version));
  }
  std::lock_guard lock(impl_->accept_mutex);
  validate_update_header(header, wire_layout(), impl_->last_accepted_version);
  const bool checksums = carries_checksums(header, wire_layout());
  if (!checksums && impl_->config.require_checksums) {
    throw Error(ErrorCode::kBadHeader,
                fmt::format("update {}: carries no checksums (bucket count {}, the layout's), but "
                            "ReceiverConfig::require_checksums is set; set SenderConfig::checksums "
                            "on the sender",
                            header.version, header.bucket_count));
  }
  if (checksums && !impl_->backend.supports_integrity()) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("update {}: carries checksums, but backend '{}' cannot verify them "
                            "(supports_integrity() is false)",
                            header.version, impl_->backend.name()));
  }
  if (checks.verify_matches_live && !impl_->backend.supports_integrity()) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("update {}: verify_matches_live asked, but backend '{}' cannot compare "
                            "bytes (supports_integrity() is false); send it without the self-check",
                            header.version, impl_->backend.name()));
  }
  impl_->last_accepted_version = header.version;
  {
    std::lock_guard stats_lock(impl_->stats_mutex);
    impl_->stats.last_accepted_version = header.version;
  }
  Command command;
  command.kind = Command::Kind::kBegin;
  command.header = header;
  command.checks = checks;
  impl_->commands.enqueue(std::move(command));
}

void Receiver::use_engine_storage(std::size_t group, const std::vector<void*>& tensors) {
  std::lock_guard lock(impl_->accept_mutex);  // no update may be accepted meanwhile
  const auto refuse = [&](const std::string& why) {
    throw Error(ErrorCode::kInvalidArgument, fmt::format("use_engine_storage: {}", why));
  };
  const SwapStrategy strategy = impl_->config.swap_strategy;
  if (strategy == SwapStrategy::kRebind) {
    refuse("swap_strategy is rebind; copy_in (or remap, for a group without an engine arena) "
           "copies into the engine's storage");
  }
  if (group >= layout_.groups().size()) {
    refuse(fmt::format("group index {} out of range (the layout has {} groups)", group,
                       layout_.groups().size()));
  }
  const GroupLayout& g = layout_.groups()[group];
  if (slots_->group(group).engine_arena) {
    refuse(fmt::format("group '{}' is swapped by remapping the engine arena it was given; its "
                       "live memory is that arena, not tensors of the engine",
                       g.name()));
  }
  if (tensors.size() != g.tensors().size()) {
    refuse(fmt::format("group '{}' has {} tensors but {} addresses were given", g.name(),
                       g.tensors().size(), tensors.size()));
  }
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    if (tensors[t] == nullptr) refuse(fmt::format("the address of tensor '{}' is null", g.tensors()[t].spec.name));
  }
  if (impl_->last_accepted_version != 0) {
    refuse(fmt::format("update {} was already accepted; give the engine's storage before the "
                       "first update",
                       impl_->last_accepted_version));
  }
  slots_->use_engine_storage(group, layout_, tensors);
}

void Receiver::abort_update() { impl_->abort_requested.store(true); }

void Receiver::replace_transport(std::unique_ptr<Transport> transport) {
  if (!transport) throw Error(ErrorCode::kInvalidArgument, "replace_transport: transport is null");
  check_root_rank(impl_->config.root_rank, transport.get(), "ReceiverConfig::root_rank");
  Command command;
  command.kind = Command::Kind::kReplaceTransport;
  command.transport = std::move(transport);
  impl_->commands.enqueue(std::move(command));
}

void Receiver::release_transport(std::string why) {
  Command command;
  command.kind = Command::Kind::kReleaseTransport;
  command.why = std::move(why);
  impl_->commands.enqueue(std::move(command));
}

void Receiver::set_observer(std::function<void(const UpdateReport&)> observer) {
  std::lock_guard lock(impl_->stats_mutex);
  impl_->observer = std::move(observer);
}

ReceiverStats Receiver::stats() const {
  std::lock_guard lock(impl_->stats_mutex);
  return impl_->stats;
}

void Receiver::drain() {
  if (!impl_->thread.joinable()) return;
  Command command;
  command.kind = Command::Kind::kDrain;
  command.drained = std::make_shared<std::promise<void>>();
  auto done = command.drained->get_future();
  impl_->commands.enqueue(std::move(command));
  done.wait();
}

void Receiver::shutdown() {
  if (impl_->stopping.exchange(true)) {
    if (impl_->thread.joinable()) impl_->thread.join();
    return;
  }
  Command command;
  command.kind = Command::Kind::kShutdown;
  impl_->commands.enqueue(std::move(command));
  if (impl_->thread.joinable()) impl_->thread.join();
  // Nothing may still write (or read) the slots when they are freed.
  impl_->backend.stream_synchronize(*impl_->stream);
  if (Stream* checks = impl_->checks.stream()) impl_->backend.stream_synchronize(*checks);
}

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

std::uint64_t Receiver::commit(std::uint64_t version, Stream& engine_stream) {
  if (impl_->config.commit_mode != CommitMode::kCoordinated) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("commit({}): the receiver's commit_mode is auto, where updates go live "
                            "at the next step by themselves; set ReceiverConfig::commit_mode to "
                            "coordinated",
                            version));
  }
  std::lock_guard lock(impl_->commit_mutex);
  if (impl_->held_ready == nullptr || impl_->held_version != version) {
    const std::string ready = impl_->held_ready == nullptr
                                  ? std::string("none is")
                                  : fmt::format("update {} is", impl_->held_version);
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("commit({}): {} ready on this rank (applied version {}); commit a "
                            "version every rank reported ready",
                            version, ready, hook_->applied_version()));
  }
  hook_->publish(impl_->held_ready);
  const std::optional<std::uint64_t> applied = hook_->apply_pending_now(engine_stream);
  impl_->held_ready = nullptr;
  impl_->held_version = 0;
  {
    std::lock_guard stats_lock(impl_->stats_mutex);
    impl_->stats.ready_version = 0;
  }
  impl_->committed.notify_all();
  return applied.value_or(version);
}

void Receiver::Impl::receive(const UpdateHeader& header, const UpdateChecks& asked) {
  const Layout& layout = owner.wire_layout();
  if (!transport) {
    UpdateReport failed;
    failed.version = header.version;
    failed.outcome = UpdateOutcome::kFailed;
    failed.code = ErrorCode::kTransport;
    failed.error = fmt::format("update {}: no transport ({})", header.version, why_no_transport);
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
        header.version, held_version, config.update_deadline.count());
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
  // bucket at a time: posted, waited for, then held back as long as the pacer says.
  if (pacer.active()) {
    // The baseline leaves out the last swap's step: it is longer by the swap (a copy_in of every
    // weight under CUDA graphs: 16 GB at 8B, about one raw device copy, 10.6 ms on an H100).
    const StepHook& hook = *owner.hook_;
    const auto swap_end = hook.last_swap_started() + hook.last_swap_duration();
    pacer.begin(std::chrono::duration_cast<std::chrono::nanoseconds>(swap_end.time_since_epoch())
                    .count());
  }
  std::size_t posted = 0;
  std::size_t completed = 0;  // buckets (and the checksum block) done
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
      if (plan == nullptr) {
        transport->broadcast_async(arena + bucket.offset, bucket.bytes, config.root_rank, *stream);
        backend.event_record(bucket_done, *stream);
        if (checks.active()) checks.enqueue_bucket(group, target.group, arena, k, bucket_done);
      } else {
        std::byte* landed = bucket_buffer.data();
        transport->broadcast_async(landed, bucket.bytes, config.root_rank, *stream);
        if (checks.checksums()) checks.enqueue_bucket_checksum(landed, bucket.bytes, *stream);
        for (const PlanPiece& p : plan->pieces(target.group, k)) {
          backend.memcpy_2d_async(arena + p.dst_offset, p.dst_pitch, landed + p.src_offset,
                                  p.src_pitch, p.row_bytes, p.rows, *stream);
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
  if (!failure && checks.checksums()) {
    // The sender's checksums, one per bucket, as one more broadcast (update_header.h says why).
    transport->broadcast_async(checks.sent_checksums(), posted * sizeof(std::uint64_t),
                               config.root_rank, *stream);
    sent_block_done = bucket_events[posted++].get();
    backend.event_record(*sent_block_done, *stream);
  }

  if (!failure) failure = wait_for_buckets(completed, posted, start, bucket_start);
  if (!failure && asked.verify_matches_live) {
    // Every bucket and plan copy has completed (waited for above): the slots are whole. The
    // receiver thread may read the live table: no swap runs while a receive is in flight.
    checks.enqueue_match_live(targets, owner.layout_, *owner.slots_);
  }
  const std::uint64_t steps_at_completion = pacer.steps_started();
  PacingReport pacing = pacer.active() ? pacer.finish() : PacingReport{};
  if (!failure) failure = verify(targets, sent_block_done, start);
  const auto transfer = Clock::now() - start;
  if (const auto limit = pacer.clean_step_limit(); limit && !failure) {
    failure = wait_for_clean_step(steps_at_completion, *limit, pacing);
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
  for (const UpdateReport& r : reports) count(r);
  const PendingUpdate* offered = &planner.complete();
  if (config.commit_mode == CommitMode::kCoordinated) {
    std::lock_guard lock(commit_mutex);
    held_ready = offered;  // goes live only in commit()
    held_version = header.version;
    std::lock_guard stats_lock(stats_mutex);
    stats.ready_version = header.version;
  } else {
    owner.hook_->publish(offered);
  }
  for (const UpdateReport& r : reports) notify(r);
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
                                    "buckets done",
                                    config.update_deadline.count(), completed, until));
    }
    if (now - bucket_start > config.bucket_deadline) {
      return refusal_of(ErrorCode::kTimeout,
                        fmt::format("bucket {} of {} did not complete within its deadline of {} "
                                    "ms",
                                    completed, until, config.bucket_deadline.count()));
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
