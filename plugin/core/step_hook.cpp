#include "shadowsync/step_hook.h"

#include <fmt/format.h>

#include "core/gated_swap.h"
#include "core/pending_update.h"
#include "core/slot_table.h"
#include "shadowsync/error.h"
#include "shadowsync/layout.h"

namespace shadowsync {

StepHook::StepHook(const Layout& layout, SlotTable& slots, bool record_step_times,
                   std::unique_ptr<StreamGate> gate, std::chrono::milliseconds gate_deadline)
    : layout_(layout),
      slots_(slots),
      step_times_(record_step_times ? std::make_unique<StepTimes>() : nullptr),
      gated_(gate != nullptr ? std::make_unique<GatedSwap>(std::move(gate), gate_deadline)
                             : nullptr) {
  previous_.reserve(layout.groups().size());
}

StepHook::~StepHook() = default;

std::uint64_t StepHook::gated_swaps() const { return gated_ != nullptr ? gated_->gates() : 0; }

std::uint64_t StepHook::gates_abandoned() const {
  return gated_ != nullptr ? gated_->abandoned() : 0;
}

std::optional<std::uint64_t> StepHook::gate_or_apply(Stream& engine_stream) {
  if (gate_closed_) {
    // The engine came back without after_launch (a step that launched nothing after all):
    // finish that gate first; the work behind it runs on whatever it makes live.
    if (const auto applied = finish_gated(engine_stream)) return applied;
  }
  // Only remaps can wait behind a gate: a copy enqueued at after_launch would run after the step
  // that should read its bytes (a LoRA group in the engine's own storage is copied in).
  bool every_group_remapped = gated_->enabled();
  for (std::size_t g = 0; every_group_remapped && g < slots_.size(); ++g) {
    every_group_remapped = !slots_.copies_in(g);
  }
  if (!every_group_remapped) return apply_pending(engine_stream);
  gated_->close(engine_stream);
  gate_closed_ = true;
  return std::nullopt;
}

std::optional<std::uint64_t> StepHook::finish_gated(Stream& engine_stream) {
  gate_closed_ = false;
  if (!gated_->claim()) return std::nullopt;  // the watchdog opened it: the update stays pending
  std::optional<std::uint64_t> applied;
  try {
    applied = apply_pending(engine_stream, /*work_before_done=*/true);
  } catch (...) {
    gated_->open();
    throw;
  }
  gated_->open();
  return applied;
}

std::optional<std::uint64_t> StepHook::apply_pending(Stream& engine_stream, bool work_before_done) {
  // exchange, not load: the receiver may take the update back at the same moment; exactly one of
  // the two gets it.
  const PendingUpdate* update = pending_.exchange(nullptr, std::memory_order_acq_rel);
  if (update == nullptr) return std::nullopt;

  const auto started = std::chrono::steady_clock::now();
  previous_.clear();
  for (const GroupSwap& swap : update->swaps) {
    SlotTable::Group& group = slots_.group(swap.group);
    previous_.push_back(
        GroupSwap{swap.group, slots_.live_slot(swap.group), group.live_content_version});
    // Records the release event of what the engine stops reading (invariant 2).
    slots_.make_live(swap.group, swap.slot, engine_stream, work_before_done);
    group.live_content_version = swap.content_version;
  }
  const std::uint64_t version = update->version;
  // Before applied_version_: the receiver closes the window only after it saw this swap finish.
  rollback_window_.store(rollback_word(kOpen, version), std::memory_order_release);
  if (swap_callback_) swap_callback_(AppliedUpdate{version, &update->swaps});
  using std::chrono::duration_cast, std::chrono::nanoseconds;
  last_swap_started_ns_.store(duration_cast<nanoseconds>(started.time_since_epoch()).count(),
                              std::memory_order_release);
  last_swap_ns_.store(duration_cast<nanoseconds>(std::chrono::steady_clock::now() - started).count(),
                      std::memory_order_release);

  // The record belongs to the receiver again once this store is seen: touch it no more.
  applied_version_.store(version, std::memory_order_release);
  applied_version_.notify_all();  // the receiver may be waiting for this swap to finish
  return version;
}

std::uint64_t StepHook::rollback(Stream& engine_stream) {
  if (gate_closed_) finish_gated(engine_stream);  // its remap would wait for the closed gate
  if (slots_.strategy() == SwapStrategy::kCopyIn) {
    // The copy overwrote the live bytes in place and no copy of them is kept (that would cost a
    // third copy of the weights, or a copy back into a shadow the receiver may be writing).
    throw Error(ErrorCode::kInvalidArgument,
                "rollback: not supported with ReceiverConfig::swap_strategy copy_in (the swap "
                "copied the update over the live weights; their previous bytes are not kept); "
                "use rebind or remap to roll back");
  }
  for (std::size_t g = 0; g < slots_.size(); ++g) {
    if (!slots_.copies_in(g)) continue;
    // A group in the engine's own storage is copied into at each swap, as under copy_in.
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("rollback: not supported while group '{}' lives in the engine's own "
                            "storage (Receiver::use_engine_storage under swap_strategy {}: its "
                            "swap copied the update over the live bytes, which are not kept)",
                            layout_.groups()[g].name(), swap_strategy_name(slots_.strategy())));
  }
  std::uint64_t window = rollback_window_.load(std::memory_order_acquire);
  for (;;) {
    const auto kind = static_cast<RollbackKind>(window & 3);
    const std::uint64_t version = window >> 2;
    if (kind != kOpen) {
      switch (kind) {
        case kNothingApplied:
          throw Error(ErrorCode::kInvalidArgument, "rollback: no update has been applied yet");
        case kRolledBack:
          throw Error(ErrorCode::kInvalidArgument,
                      fmt::format("rollback: update {} was already rolled back (one level is "
                                  "kept)",
                                  version));
        default:
          throw Error(ErrorCode::kSuperseded,
                      fmt::format("rollback: no longer possible, update {} started receiving "
                                  "into the previous slots",
                                  version));
      }
    }
    // The receiver may close the window at the same instant: exactly one of the two wins.
    if (rollback_window_.compare_exchange_weak(window, rollback_word(kRolledBack, version),
                                               std::memory_order_acq_rel,
                                               std::memory_order_acquire)) {
      break;
    }
  }
  const std::uint64_t undone = applied_version();
  // previous_ names the slots the last swap left: they become live again, and previous_ then
  // describes what is live (the callback and the receiver read it as such).
  for (const GroupSwap& swap : previous_) {
    slots_.make_live(swap.group, swap.slot, engine_stream);  // records a release: invariant 2
    slots_.group(swap.group).live_content_version = swap.content_version;
  }
  if (swap_callback_) swap_callback_(AppliedUpdate{undone, &previous_, /*rollback=*/true});
  rollbacks_done_.fetch_add(1, std::memory_order_release);
  rollbacks_done_.notify_all();
  return undone;
}

const std::vector<GroupSwap>* StepHook::close_rollback_window(std::uint64_t version) {
  const std::uint64_t window =
      rollback_window_.exchange(rollback_word(kClosed, version), std::memory_order_acq_rel);
  if ((window & 3) != kRolledBack) return nullptr;
  // The engine claimed the rollback first; it is flipping pointers: wait until it is done.
  const std::uint64_t wanted = ++rollbacks_adopted_;
  for (std::uint64_t seen = rollbacks_done_.load(std::memory_order_acquire); seen < wanted;
       seen = rollbacks_done_.load(std::memory_order_acquire)) {
    rollbacks_done_.wait(seen, std::memory_order_acquire);
  }
  return &previous_;
}

bool StepHook::wait_applied(std::uint64_t version, std::chrono::steady_clock::time_point deadline,
                            Stream& engine_stream) {
  if (gate_closed_) finish_gated(engine_stream);  // its remap would wait for the closed gate
  for (;;) {
    apply_pending(engine_stream);
    if (applied_version() >= version) return true;
    if (failed_version() >= version) return false;  // nothing more is coming for it
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::unique_lock lock(publish_mutex_);
    const bool woken = publish_cv_.wait_until(lock, deadline, [&] {
      return pending_.load(std::memory_order_acquire) != nullptr || failed_version() >= version;
    });
    if (!woken) return applied_version() >= version;
  }
}

void StepHook::note_failed(std::uint64_t version) {
  if (version > failed_version_.load(std::memory_order_relaxed)) {
    failed_version_.store(version, std::memory_order_release);
  }
  { std::lock_guard lock(publish_mutex_); }
  publish_cv_.notify_all();
}

void StepHook::publish(const PendingUpdate* update) {
  pending_.store(update, std::memory_order_release);
  // Lock then notify: a waiter that checked the predicate under the lock cannot miss it.
  { std::lock_guard lock(publish_mutex_); }
  publish_cv_.notify_all();
}

const PendingUpdate* StepHook::retract() {
  return pending_.exchange(nullptr, std::memory_order_acq_rel);
}

void StepHook::wait_swap_finished(std::uint64_t version) const {
  // The engine took the update and is flipping pointers: a few microseconds of straight-line code.
  for (std::uint64_t seen = applied_version_.load(std::memory_order_acquire); seen < version;
       seen = applied_version_.load(std::memory_order_acquire)) {
    applied_version_.wait(seen, std::memory_order_acquire);
  }
}

std::byte* StepHook::live_arena(std::size_t group) const { return slots_.live_data(group); }

void* StepHook::live_tensor(std::size_t group, std::size_t tensor) const {
  return slots_.live_tensor(group, tensor, layout_.groups()[group].tensors()[tensor].offset);
}

std::uint64_t StepHook::live_content_version(std::size_t group) const {
  return slots_.group(group).live_content_version;
}

void StepHook::set_swap_callback(std::function<void(const AppliedUpdate&)> callback) {
  swap_callback_ = std::move(callback);
}

}  // namespace shadowsync
