// The engine side of a receiver: called by the engine thread between two decode steps. With
// nothing pending, before_step is one atomic load. With an update pending, it makes every group
// of the update live at once and records, on the engine stream, the release event of each slot
// that is no longer read. How depends on the swap strategy (SwapStrategy below,
// ReceiverConfig::swap_strategy).
//
// Threads: the engine thread calls everything except what is marked thread-safe; the receiver
// thread reaches the private half (publish, retract, ...) as a friend. Streams: every swap is
// enqueued on the `engine_stream` the caller passes, the stream the engine's steps run on.
// Ownership: the hook belongs to its Receiver and reads the receiver's slots; it owns nothing a
// swap allocates (a swap allocates nothing).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string_view>
#include <vector>

#include "shadowsync/backend.h"
#include "shadowsync/step_times.h"

namespace shadowsync {

// How a swap makes an update's bytes visible to the engine. Chosen per receiver
// (ReceiverConfig::swap_strategy); docs/guides/swap-strategies.md says when to pick which.
enum class SwapStrategy {
  // The live pointer table flips to the other slot (live_arena() moves); the engine reads its
  // weights through it, or its adapter rebinds its tensors in the swap callback. Microseconds, no
  // copy. Not for engines that replay CUDA graphs captured over the weights: a graph keeps the
  // old addresses.
  kRebind,
  // The live storage never moves (live_arena() is fixed): the swap enqueues one device copy per
  // group of the update, shadow -> live, on the engine stream, and returns without waiting for
  // it. Any engine, CUDA graphs included, any backend. Costs bytes / device-copy bandwidth on the
  // engine stream; no rollback.
  kCopyIn,
  // The live weights sit at a reserved virtual range (CUDA VMM) that the swap remaps onto the
  // other slot's physical memory: the address stays (live_arena() is fixed), no byte is copied.
  // CUDA graphs included; CUDA backend on a device with VMM only. Contract: the swap first
  // synchronizes the engine stream (a kernel still reading the live range must not see its pages
  // unmapped), so the host blocks until the engine's enqueued work is done: free when the engine
  // already synchronized at the step boundary, a stall of the work in flight otherwise.
  kRemap,
};

// "rebind", "copy_in", "remap": the names the C ABI's and Python's docs and errors use.
constexpr std::string_view swap_strategy_name(SwapStrategy strategy) {
  switch (strategy) {
    case SwapStrategy::kRebind:
      return "rebind";
    case SwapStrategy::kCopyIn:
      return "copy_in";
    case SwapStrategy::kRemap:
      return "remap";
  }
  return "unknown";
}

class GatedSwap;
class Layout;
class SlotTable;
struct PendingUpdate;

// One group made live by a swap.
struct GroupSwap {
  std::size_t group = 0;             // index into Layout::groups()
  int slot = 0;                      // the slot that is live now (0 or 1); copy_in: the shadow
                                     // the bytes were copied from (the live storage is slot 0)
  std::uint64_t content_version = 0; // version of the update whose bytes the slot holds
};

// What a swap made live. Views into the receiver's records: valid during the callback only.
struct AppliedUpdate {
  std::uint64_t version = 0;
  const std::vector<GroupSwap>* swaps = nullptr;
  // True for the swap of rollback(): `swaps` are the slots made live again, each with the
  // content version it holds; `version` is the update that was undone.
  bool rollback = false;
};

class StepHook {
 public:
  // `record_step_times`: before_step also stamps when each step starts (step_times()), for a
  // receiver that paces by a decode-slowdown budget or offers updates after a clean step. `gate` (remap only; null: none): gated
  // swaps (ReceiverConfig::gated_swaps, after_launch), a gate the watchdog opens `gate_deadline`
  // after the work before it completed if the engine has not claimed the swap by then.
  StepHook(const Layout& layout, SlotTable& slots, bool record_step_times = false,
           std::unique_ptr<StreamGate> gate = nullptr,
           std::chrono::milliseconds gate_deadline = std::chrono::milliseconds(50));
  ~StepHook();
  StepHook(const StepHook&) = delete;
  StepHook& operator=(const StepHook&) = delete;

  // Call before each engine step. Returns the version it made live, or nothing when no update
  // was pending (the fast path: one acquire load, no stores, no backend calls; with a pacing
  // budget, also a clock read and a stamp in step_times()).
  // Engine thread only; `engine_stream` is the stream the engine's steps run on.
  // With gated swaps (ReceiverConfig::gated_swaps) a pending update whose every group is
  // remapped is not made live here: before_step closes a gate on the engine stream and returns
  // nothing; the engine enqueues its step behind the gate and after_launch makes the update live
  // for that step (plugin/core/gated_swap.h).
  std::optional<std::uint64_t> before_step(Stream& engine_stream) {
    if (step_times_ != nullptr) step_times_->record();
    if (pending_.load(std::memory_order_acquire) == nullptr) return std::nullopt;
    return gated_ != nullptr ? gate_or_apply(engine_stream) : apply_pending(engine_stream);
  }

  // Gated swaps: call once the step's work is enqueued on the engine stream, before the engine
  // waits for that stream (a synchronize, a copy to pageable memory, .item()): with a gate closed
  // by before_step, waits for the work before it, remaps, opens it, and returns the version made
  // live, which the step just enqueued runs on. Nothing (one branch) otherwise, and nothing when
  // the watchdog opened the gate first (the step ran on the previous version; the update goes
  // live at the next before_step). Engine thread only.
  std::optional<std::uint64_t> after_launch(Stream& engine_stream) {
    if (!gate_closed_) return std::nullopt;
    return finish_gated(engine_stream);
  }

  // Applies a pending update now, if there is one (an idle engine). Engine thread only.
  std::optional<std::uint64_t> apply_pending_now(Stream& engine_stream) {
    if (gate_closed_) {
      if (const auto applied = finish_gated(engine_stream)) return applied;
    }
    return apply_pending(engine_stream);
  }

  // Applies pending updates as they become ready until the applied version is at least
  // `version`. Returns false if `deadline` passes first, or at once when an update of `version`
  // or later failed (failed_version()) and none since went live. Engine thread only (it swaps).
  bool wait_applied(std::uint64_t version, std::chrono::steady_clock::time_point deadline,
                    Stream& engine_stream);
  // The receiver discarded update `version` (after reporting it): wakes wait_applied. Receiver
  // thread.
  void note_failed(std::uint64_t version);
  // The latest update the receiver discarded (0: none). Thread-safe.
  std::uint64_t failed_version() const { return failed_version_.load(std::memory_order_acquire); }

  // Undoes the last swap in one swap: every group it flipped reads its previous slot again, which
  // still holds the bytes it had (the receiver writes no slot until the next update starts
  // receiving). Records the release event of each slot it leaves on `engine_stream`, runs the swap
  // callback (AppliedUpdate::rollback), and returns the version undone. applied_version() stays
  // (versions made live only increase); live_content_version() tells what each group holds now.
  // Not under copy_in, which keeps no previous bytes: throws Error(kInvalidArgument) naming the
  // strategy, nothing changes. Under remap it remaps back (synchronizing the engine stream).
  // One level: throws Error(kInvalidArgument) when nothing was applied yet or the last swap was
  // already undone, and Error(kSuperseded) naming the update once a newer update started writing
  // the previous slots; nothing changes then. Engine thread only.
  std::uint64_t rollback(Stream& engine_stream);

  // True while a received update waits for the next step. Thread-safe.
  bool has_pending() const { return pending_.load(std::memory_order_acquire) != nullptr; }

  // Last version made live; 0 before the first. Thread-safe.
  std::uint64_t applied_version() const { return applied_version_.load(std::memory_order_acquire); }

  // The live pointer table. Engine thread only; under rebind valid until the next swap, under
  // copy_in and remap the same address for the receiver's whole life.
  // Null for a group whose live storage is the engine's own (Receiver::use_engine_storage).
  std::byte* live_arena(std::size_t group) const;
  void* live_tensor(std::size_t group, std::size_t tensor) const;
  // Version of the update whose bytes the group's live slot holds (0: never updated).
  std::uint64_t live_content_version(std::size_t group) const;

  // When the engine's steps started; null unless constructed with record_step_times.
  const StepTimes* step_times() const { return step_times_.get(); }

  // Gated swaps: gates closed so far, and those the watchdog had to open (then the hook swaps
  // without a gate). Zero without gated swaps. Thread-safe.
  std::uint64_t gated_swaps() const;
  std::uint64_t gates_abandoned() const;

  // The last swap that made an update live (before_step, apply_pending_now, wait_applied):
  // when it started and how long the engine thread spent in it, swap callback included: the
  // host side of the engine's stop (for remap, its engine-stream synchronization too). Zero
  // before the first. Measured on the swap path only. Thread-safe (each field on its own).
  std::chrono::steady_clock::time_point last_swap_started() const {
    return std::chrono::steady_clock::time_point(
        std::chrono::nanoseconds(last_swap_started_ns_.load(std::memory_order_acquire)));
  }
  std::chrono::nanoseconds last_swap_duration() const {
    return std::chrono::nanoseconds(last_swap_ns_.load(std::memory_order_acquire));
  }

  // Called on the engine thread after each swap, before before_step returns: where an adapter
  // rebinds its engine's tensors to the new live pointers. Set before the first update.
  void set_swap_callback(std::function<void(const AppliedUpdate&)> callback);

 private:
  friend class Receiver;

  // `work_before_done`: a gated swap, whose remaps need not (must not) wait for the stream.
  std::optional<std::uint64_t> apply_pending(Stream& engine_stream, bool work_before_done = false);
  std::optional<std::uint64_t> gate_or_apply(Stream& engine_stream);
  std::optional<std::uint64_t> finish_gated(Stream& engine_stream);
  // Receiver thread: offer a completed update / take it back if the engine has not.
  void publish(const PendingUpdate* update);
  const PendingUpdate* retract();
  // Receiver thread: block until the engine finished the swap of `version` it has taken.
  void wait_swap_finished(std::uint64_t version) const;
  // Receiver thread, once the offer is resolved and before update `version` writes any slot:
  // closes the rollback window. Returns the slots a rollback made live since the last call (the
  // receiver's planner adopts them), after waiting for that rollback to finish; else nullptr.
  const std::vector<GroupSwap>* close_rollback_window(std::uint64_t version);

  // The rollback window: what rollback() may do now, as one word so that the engine's claim and
  // the receiver's close are a single atomic step each: the kind in the low two bits, a version
  // (for messages) above.
  enum RollbackKind : std::uint64_t { kNothingApplied = 0, kOpen = 1, kRolledBack = 2, kClosed = 3 };
  static std::uint64_t rollback_word(RollbackKind kind, std::uint64_t version) {
    return (version << 2) | kind;
  }

  const Layout& layout_;
  SlotTable& slots_;
  const std::unique_ptr<StepTimes> step_times_;  // null: nothing recorded (no budget)
  const std::unique_ptr<GatedSwap> gated_;       // null: no gated swaps
  bool gate_closed_ = false;                     // engine thread: after_launch has work
  std::atomic<const PendingUpdate*> pending_{nullptr};
  std::atomic<std::uint64_t> applied_version_{0};
  std::atomic<std::int64_t> last_swap_started_ns_{0};  // steady_clock, since its epoch
  std::atomic<std::int64_t> last_swap_ns_{0};
  std::function<void(const AppliedUpdate&)> swap_callback_;
  // Engine thread: per group of the last swap, the slot (and its content version) it replaced;
  // after a rollback, the slots it made live again (read by the receiver thread once
  // rollbacks_done_ says the rollback finished). Capacity reserved up front: swaps never allocate.
  std::vector<GroupSwap> previous_;
  std::atomic<std::uint64_t> rollback_window_{0};
  std::atomic<std::uint64_t> rollbacks_done_{0};
  std::uint64_t rollbacks_adopted_ = 0;  // receiver thread
  std::atomic<std::uint64_t> failed_version_{0};
  // Wakes wait_applied() when the receiver offers an update; never touched by before_step().
  std::mutex publish_mutex_;
  std::condition_variable publish_cv_;
};

}  // namespace shadowsync
