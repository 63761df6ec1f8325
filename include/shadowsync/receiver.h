// The receiver: owns both slots of every group, a background thread on its own low-priority
// stream that receives updates into the shadow slots, and the engine's step hook.
//
// Threads: the receives, their checks and the observer run on the receiver's own thread; the
// public calls below say which threads may make them; the step hook is the engine thread's
// (step_hook.h). Streams: the receiver creates its own (one for the receives, one for the checks
// of the received bytes when the backend has them); it meets the engine's stream only through
// the step hook. Ownership: the receiver owns its slots, streams, events, thread and transport;
// the backend must outlive it.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shadowsync/backend.h"
#include "shadowsync/error.h"
#include "shadowsync/layout.h"
#include "shadowsync/receive_plan.h"
#include "shadowsync/step_hook.h"
#include "shadowsync/transport.h"
#include "shadowsync/update_header.h"

namespace shadowsync {

// The exit status of a process ended by ReceiverConfig::exit_on_stuck_abort (EX_SOFTWARE).
inline constexpr int kStuckAbortExitStatus = 70;

// When a received update goes live (DESIGN §10).
enum class CommitMode {
  // The step hook flips at the first step after the receive completed: one engine rank.
  kAuto,
  // The update is held ready (received and checked) and goes live only on commit(version), which
  // the engine makes between two steps on every tensor-parallel rank at once: no step runs with
  // two ranks on different versions. A ready update is never taken back: the next update's
  // receive waits until it was committed.
  kCoordinated,
};

struct ReceiverConfig {
  int root_rank = 0;  // the sender's rank in the transport
  // A whole update must land within this (a 14 GiB update takes ~40 ms at NVLink speed; a
  // minute leaves room for a sender that gathers ZeRO-3 shards between buckets).
  std::chrono::milliseconds update_deadline{60'000};
  // No bucket may take longer than this from the previous bucket's completion.
  std::chrono::milliseconds bucket_deadline{10'000};
  // How often the receiver thread checks progress, errors and aborts while a receive is in
  // flight. 200 us keeps the reaction to a fault well under a millisecond at negligible CPU.
  std::chrono::microseconds poll_interval{200};
  // Refuse (in begin_update) a header that carries no checksum block. Whether or not this is set,
  // a header that carries one is verified: every bucket's checksum is computed on a second
  // low-priority stream of the receiver as soon as that bucket has landed (overlapping the later
  // buckets' transfer) and compared before the update is offered. Off by default, so that a
  // sender with SenderConfig::checksums turned off (it is on by default) is still served.
  bool require_checksums = false;
  // Refuse an update in which an fp32, fp16 or bf16 tensor holds a NaN or an infinity: counted per
  // tensor, on the same second stream once the bucket holding the tensor's last byte has landed,
  // before the update is offered. One small kernel per floating tensor per update; off by
  // default.
  bool reject_nonfinite = false;
  // Second-level watchdog. A failed update aborts the transport (ncclCommAbort) on the receiver
  // thread; an abort that has not returned after this long is reported (one line on stderr,
  // ReceiverStats::stuck_aborts, last_error): the receiver thread is stuck in the driver and takes
  // no update until it returns. ncclCommAbort normally returns within a second; 10 s is far
  // beyond that and still well below what an operator would notice as a hung engine.
  std::chrono::milliseconds abort_deadline{10'000};
  // With it, a stuck abort also ends the process (std::_Exit(kStuckAbortExitStatus), after the
  // line on stderr): the engine's supervisor restarts it, instead of an engine that serves its
  // last version forever and can never be updated again. Off by default: a library does not end
  // its host process unless asked.
  bool exit_on_stuck_abort = false;
  // How a swap makes an update visible to the engine (SwapStrategy in step_hook.h;
  // docs/guides/swap-strategies.md says when to pick which). rebind is the cheapest swap; copy_in and remap
  // keep the live addresses.
  SwapStrategy swap_strategy = SwapStrategy::kRebind;
  // The engine replays CUDA graphs captured over the weights. A graph keeps the addresses it was
  // captured with, so rebind would leave it reading the old slot: the constructor refuses rebind
  // when this is set (use copy_in or remap).
  bool engine_uses_cuda_graphs = false;
  // remap only: the engine calls StepHook::after_launch once it has enqueued each step, before it
  // waits for its stream. A swap then closes a gate on the engine stream in before_step and
  // remaps in after_launch, once the step before the gate has ended: the engine thread prepares
  // and launches its step meanwhile, and the GPU stands still for the remap alone
  // (plugin/core/gated_swap.h). If the engine has not called after_launch `gate_deadline` after
  // the step before the gate ended, a watchdog opens the gate (that step runs on the old weights,
  // the update goes live at the next step) and the receiver swaps without a gate from then on.
  // Updates with a group copied in (Receiver::use_engine_storage) always swap without one.
  bool gated_swaps = false;
  std::chrono::milliseconds gate_deadline{50};
  CommitMode commit_mode = CommitMode::kAuto;
  // Pacing (docs/guides/pacing.md): a receive shares memory bandwidth with decoding.
  // With a budget (for example 1.05), the step hook records when each engine step starts, the
  // receiver learns the engine's step time while no update streams in, and holds its buckets
  // back between receives so that the mean step while an update streams in (what decode
  // tokens/s sees) stays within budget x that time; the update takes longer instead. At least
  // 1.0, finite; unset (the default): no pacing, and the step hook records nothing.
  std::optional<double> decode_slowdown_budget;
  // A cap on the receive rate in bytes per second: after each bucket the receiver waits until
  // the bucket's bytes at this rate would have taken their time. 0 (the default): none. With a
  // budget too, the longer of the two holds. Neither makes an update miss update_deadline: the
  // holds shrink to what the deadline leaves (PacingReport::deadline_limited).
  std::uint64_t max_receive_bytes_per_second = 0;
  // A complete update is offered only once an engine step has started after its last bucket
  // completed (at most 4 idle steps later; an idle engine gets it then), so that the step the
  // swap delays is not also one a bucket slowed. A budget implies it. With checksums the wait
  // comes before the checksum block (the update's last broadcast), so the sender's publish
  // returns only after the clean step: a commit made right after it, while the engine waits
  // (vLLM's finish_weight_update), swaps at a clean step too. The step hook stamps when each step
  // starts (one clock read per step), which is how the receiver learns the idle step.
  bool offer_after_clean_step = false;
};

// Checks asked of one update (Receiver::begin_update), beyond those of ReceiverConfig.
struct UpdateChecks {
  // The self-check: the update must reproduce the engine's live weights byte for byte (the
  // trainer sends the checkpoint the engine holds). Once the update landed, every tensor it
  // wrote in its slot (after the receive plan's copies, in the engine's layout) is compared with
  // the live copy of that tensor, on the receiver's check stream: one checksum of each, read
  // once; the first tensor that differs fails the update, naming it and its first differing
  // element (nothing goes live). Proves that the receive plan puts every byte where the engine
  // reads it. The backend must support the integrity checks (Backend::supports_integrity).
  bool verify_matches_live = false;
};

enum class UpdateOutcome {
  kReady,       // received completely and offered to the engine
  kFailed,      // discarded; the live weights are untouched
  kSuperseded,  // a newer update took it back before the engine applied it
};

// What pacing did to one update (ReceiverConfig::decode_slowdown_budget,
// max_receive_bytes_per_second). Durations are host wall time.
struct PacingReport {
  // A budget or a rate cap was set; the fields below are filled only then, except clean_step_wait
  // and clean_step_missed (filled with offer_after_clean_step too).
  bool paced = false;
  std::optional<double> budget;
  // The engine's mean step time while no update streamed in, the baseline the budget
  // multiplies; 0: not measured (fewer than kMinBaselineSteps steps seen outside an update yet).
  // In both means a step counts at most 4 median idle steps (a pause of the engine is not a step).
  std::chrono::nanoseconds idle_step{0};
  // The mean duration of the steps that started while this update streamed in; 0: none
  // completed.
  std::chrono::nanoseconds step_during{0};
  double step_ratio = 0.0;  // step_during / idle_step; 0 when either is unknown
  std::uint64_t steps = 0;  // engine steps that started while this update streamed in
  std::chrono::nanoseconds busy{0};       // sum over buckets: posted -> completion observed
  std::chrono::nanoseconds held_back{0};  // sum of the holds between buckets
  double duty = 1.0;  // busy / (busy + held_back): the share of the window with a bucket in flight
  bool deadline_limited = false;  // a hold was shortened so that update_deadline is met
  // With a budget or offer_after_clean_step, a complete update is offered only once an engine
  // step has started after its last bucket completed, so that the step a swap delays is not also
  // the one that bucket slowed:
  // how long it was held for that (0: the idle step was not known yet; about 0: a step had
  // already started), and whether none started within 4 idle steps (an idle engine: offered
  // anyway).
  std::chrono::nanoseconds clean_step_wait{0};
  bool clean_step_missed = false;
  static constexpr std::size_t kMinBaselineSteps = 4;
};

// One line per update, delivered on the receiver thread.
struct UpdateReport {
  std::uint64_t version = 0;
  UpdateOutcome outcome = UpdateOutcome::kReady;
  std::vector<std::size_t> groups;      // groups the update carried
  std::size_t bytes = 0;                // bytes received
  std::chrono::nanoseconds transfer{0}; // first receive posted -> completion observed
  std::string error;                    // kFailed: why
  // kFailed: the kind of failure, for the trainer (EngineChannel::report_failed): kTimeout (a
  // deadline), kTransport (peer lost, aborted, or a bucket's checksum differs: corrupted in
  // transit), kInvalidArgument (the non-finite guard refused the content), kShutdown.
  ErrorCode code = ErrorCode::kInternal;
  // kFailed by a check of the received bytes: where. The group, the bucket within it (checksum)
  // or the tensor (non-finite guard); empty otherwise.
  std::string failed_group;
  std::optional<std::size_t> failed_bucket;
  std::string failed_tensor;
  PacingReport pacing;  // kReady: what pacing did
};

struct ReceiverStats {
  std::uint64_t updates_ready = 0;
  std::uint64_t updates_failed = 0;
  std::uint64_t updates_superseded = 0;
  std::uint64_t bytes_received = 0;
  std::uint64_t last_accepted_version = 0;
  // kCoordinated: the update received, checked and waiting for commit(); 0: none.
  std::uint64_t ready_version = 0;
  // No transport now: a failure aborted it, or release_transport released it; call
  // replace_transport.
  bool needs_transport = false;
  // Aborts of the transport that overran ReceiverConfig::abort_deadline (counted when they overran,
  // whether or not they returned later).
  std::uint64_t stuck_aborts = 0;
  // The last kFailed report (version 0: none yet): its code and where a check refused it, for
  // callers that poll rather than observe (the C ABI, Python).
  UpdateReport last_failure;
  std::string last_error;
  // The last kReady update's transfer time (UpdateReport::transfer; 0: none yet) and pacing
  // (PacingReport::paced is false without a budget or a cap), for callers that poll.
  std::chrono::nanoseconds last_transfer{0};
  PacingReport last_pacing;
  // With a routing plan (Receiver::use_routing_plan): the bytes the last ready update's routes
  // carried into this engine rank (the RouteMover's count over that update: the plan's
  // bytes_to(engine rank)), the plan's trainer ranks and its fingerprint; 0 without one.
  std::uint64_t routed_bytes = 0;
  // Of routed_bytes, those read where the trainer ranks' shards lie (the same-host pull
  // transport on GPUs: nothing packed on the trainer side), not from their staging.
  std::uint64_t routed_in_place_bytes = 0;
  int trainer_count = 0;
  std::uint64_t routing_fingerprint = 0;
};

// Remap arenas an engine made before it met the receiver, by group index (a null entry, or
// none: the receiver makes its own). Shared: the engine keeps reading the live range after the
// receiver is gone, and a later receiver can take the same arena again.
using EngineArenas = std::vector<std::shared_ptr<RemappableArena>>;

class RoutingPlan;  // plugin/core/routing_plan.h: which trainer rank sends which bytes (§14)

class Receiver {
 public:
  // Allocates two zero-filled slots per group and starts the receiver thread. The engine reads
  // the live slots through step_hook(). `transport` may be null until the rendezvous is done.
  // Throws Error(kInvalidArgument), before allocating anything, for a bad config: among others
  // rebind with engine_uses_cuda_graphs, and remap on a backend that cannot remap (the message
  // names the reason and suggests copy_in).
  //
  // `engine_arenas` (remap or rebind): the live memory of group g is engine_arenas[g], made with
  // backend.create_remappable_arena(<the group's arena bytes>) and holding the engine's current
  // weights in its live slot, laid out as the layout's group; its other slot becomes the shadow.
  // Under remap, for an engine that captures CUDA graphs after it moved its weights into such an
  // arena's live range and before it meets the receiver (vLLM: shadowsync.vllm's live arena):
  // swaps are zero-copy remaps that the graphs see. Under rebind the arena's two slot mappings
  // are the two slots and a swap only flips which is live (live_arena(g) moves between them; the
  // live range is neither read nor remapped): for an engine that captured one set of CUDA graphs
  // over each slot and switches sets in the swap callback (vLLM's graph pairs). Under rebind the
  // arena's live_slot() does not follow the swaps: before a later receiver takes the arena, the
  // engine must read (and hold its bytes in) the slot the arena shows. The arena must not serve two receivers at once. Throws
  // Error(kInvalidArgument) naming the group and both sizes, or the strategy, before allocating.
  Receiver(Layout layout, Backend& backend, std::unique_ptr<Transport> transport,
           ReceiverConfig config = {}, EngineArenas engine_arenas = {});
  // The same for an engine whose layout is not the trainer's: the slots have `layout` (the
  // engine's), updates come in `plan.wire()` (the trainer's; headers are checked against it) and
  // each received wire bucket lands in a bucket buffer of the receiver (plan.max_bucket_bytes(),
  // on the backend) from which the plan's pieces are copied into the shadow on the receive
  // stream, before the bucket's event: the receive's completion covers them. Throws
  // Error(kLayoutMismatch) when the plan was built for another engine layout, and
  // Error(kInvalidArgument) for ReceiverConfig::reject_nonfinite (its per-tensor counts need the
  // trainer's tensors whole in one place; checksums work).
  Receiver(Layout layout, ReceivePlan plan, Backend& backend, std::unique_ptr<Transport> transport,
           ReceiverConfig config = {}, EngineArenas engine_arenas = {});
  // shutdown(), then frees every slot, event and stream and joins every thread it started. The
  // engine must have stopped calling the step hook and its stream must be done reading the slots.
  ~Receiver();
  Receiver(const Receiver&) = delete;
  Receiver& operator=(const Receiver&) = delete;

  // Announces an update: validates the header against the layout and the last accepted version
  // (throws Error naming the field and both values; nothing changes), and against the config
  // (ReceiverConfig::require_checksums), then queues it and returns.
  // The receives are posted only now, when the sender is known to be sending. Thread-safe.
  void begin_update(const UpdateHeader& header, const UpdateChecks& checks = {});

  // Aborts the update in flight, if any (the transport is aborted with it). Thread-safe.
  void abort_update();

  // Installs a new transport after a failure aborted the old one (or the first one). Queued
  // behind earlier commands. Thread-safe.
  void replace_transport(std::unique_ptr<Transport> transport);

  // Makes this receiver engine rank `engine_rank` of `routing`, a sharded trainer's routing
  // plan built on wire_layout() (DESIGN §14): from then on an update is not one broadcast per
  // bucket but every trainer rank's routes into this rank, which the transport's RouteMover
  // moves, copied straight to where the receive plan (or, without one, the wire layout) puts
  // them: no bucket buffer. Headers must carry the plan's fingerprint (its trainer ranks'
  // Sender::publish_shards make them). An update fails, named, when the transport then moves no
  // routes or was set up for another plan, rank or rank count. Routed updates carry no
  // checksums yet (a follow-up). Throws Error(kInvalidArgument) naming both values, before
  // anything changes, for a null plan, an engine rank outside 0..N-1, an update already accepted,
  // ReceiverConfig::require_checksums; Error(kLayoutMismatch) for a plan of another wire layout
  // (both fingerprints). Queued behind earlier commands, like replace_transport. Thread-safe.
  void use_routing_plan(std::shared_ptr<const RoutingPlan> routing, int engine_rank);

  // Destroys the transport, queued behind earlier commands (an update in flight finishes or fails
  // first): its trainer left (`why` says how). NCCL's teardown within a node waits for every
  // rank's, so an engine that kept its end would hold the departed trainer's Sender destructor
  // until the engine exits. The receiver thread waits in that teardown (the step hook does not):
  // until the trainer tears its end down too, as a departed trainer does when its process or its
  // Sender goes. One that overruns ReceiverConfig::abort_deadline is reported as a stuck abort
  // is (stuck_aborts, last_error, stderr; exit_on_stuck_abort ends the process). Afterwards
  // needs_transport is true, and updates fail with "no transport (released: why ...)" until
  // replace_transport installs a new one. Without a transport, nothing happens. Thread-safe.
  void release_transport(std::string why);

  // copy_in, or remap for a group without an engine arena (vLLM's LoRA buffers beside its live
  // arena: the base group remaps, this one is copied at the same swap); before the first update:
  // the live storage of group `group` becomes the engine's own tensors (`tensors[t]`: where
  // tensor t of the group, in layout order, lives; each at least its bytes long, on the backend's
  // device) instead of the receiver's live arena, which is freed.
  // For an engine that captured CUDA graphs over its own parameters before it met the library
  // (vLLM): they keep reading where they were captured. A swap copies every tensor of the shadow
  // to its place, one batched copy on the engine stream (Backend::memcpy_batch_async). A swap
  // writes only the groups its update carries. live_arena() of the group is null
  // afterwards; live_tensor() gives the engine's addresses. rollback is refused while any group
  // is copied into. Throws Error(kInvalidArgument) naming the strategy (rebind), the group with
  // an engine arena, the counts, or the update already accepted; nothing changes then. Engine
  // thread.
  void use_engine_storage(std::size_t group, const std::vector<void*>& tensors);

  // kCoordinated only: makes the ready update `version` live now, on `engine_stream`, and returns
  // it; the next engine step runs on it. Call it between two steps, on every rank with the same
  // version (vLLM's collective_rpc reaches every worker between the same two steps). Throws
  // Error(kInvalidArgument) in kAuto mode, or when `version` is not the update this receiver holds
  // ready (naming the ready one, or none, and the applied version); nothing changes then.
  // Engine thread.
  std::uint64_t commit(std::uint64_t version, Stream& engine_stream);

  // kCoordinated: the update held ready for commit() (0: none). One atomic load, no lock: a step
  // hook may ask at every step. Thread-safe.
  std::uint64_t ready_version() const;

  // kCoordinated only: drops update `version` on this rank without making it live: now, if it is
  // the update held ready, or else as soon as its receive completes (a newer update's header
  // cancels that). What tensor-parallel ranks do, each between the same two steps, when an update
  // is ready on some of them only (it failed, or never arrived, on the others): otherwise those
  // that hold it keep it for a commit that cannot come, and take no newer update. The groups it
  // wrote hold nothing worth keeping afterwards: the next update lands on the live weights, as on
  // the ranks it never reached. Returns whether it was held ready. Throws Error(kInvalidArgument)
  // in kAuto mode. Thread-safe.
  bool discard(std::uint64_t version);

  // Called on the receiver thread once per update outcome. Set before the first update.
  void set_observer(std::function<void(const UpdateReport&)> observer);

  StepHook& step_hook() { return *hook_; }
  const Layout& layout() const { return layout_; }  // the slots' (the engine's)
  // The layout updates arrive in: the plan's wire layout, or layout() without a plan.
  const Layout& wire_layout() const { return plan_ ? plan_->wire() : layout_; }
  const ReceivePlan* plan() const { return plan_.get(); }  // null without one
  ReceiverStats stats() const;  // Thread-safe.

  // Blocks until every queued command has been processed (tests, orderly shutdown).
  void drain();

  // Stops the thread; aborts an update in flight (its transport is aborted). Returns within
  // poll_interval plus the time the aborted receive takes to drain (an aborted collective returns
  // at once; a receive still waiting for the engine stream to release a slot waits for the
  // engine's step). The live slots stay readable until the receiver is destroyed; the engine may
  // keep stepping meanwhile. Idempotent. Thread-safe.
  void shutdown();

 private:
  struct Impl;
  Receiver(Layout layout, std::unique_ptr<const ReceivePlan> plan, Backend& backend,
           std::unique_ptr<Transport> transport, ReceiverConfig config,
           EngineArenas engine_arenas);

  Layout layout_;
  std::unique_ptr<const ReceivePlan> plan_;
  std::unique_ptr<SlotTable> slots_;
  std::unique_ptr<StepHook> hook_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shadowsync
