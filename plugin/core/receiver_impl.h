// Internal to the receiver (core/receiver*.cpp): the state its public methods and its thread
// share. Receiver's methods run on the engine's and the trainer's threads and hand work to the
// receiver thread through `commands`; the receiver thread runs the updates (receiver_thread.cpp),
// waits on them (receiver_waits.cpp) and reports how each ended (receiver_outcomes.cpp).
#pragma once

#include <blockingconcurrentqueue.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/pacer.h"
#include "core/receive_checks.h"
#include "core/refusal.h"
#include "core/route_copies.h"
#include "core/route_mover.h"
#include "core/routing_plan.h"
#include "core/slot_planner.h"
#include "core/slot_table.h"
#include "shadowsync/receiver.h"

namespace shadowsync {

struct Receiver::Impl {
  using Clock = std::chrono::steady_clock;

  // Receiver::use_routing_plan: this engine rank of a routing plan, and its copies of every
  // bucket, composed once (compose_route_copies, with the receive plan if there is one).
  struct Routing {
    std::shared_ptr<const RoutingPlan> plan;
    int engine_rank = 0;
    std::vector<std::vector<std::vector<RouteCopy>>> copies;  // [group][bucket]
  };

  // What the other threads ask of the receiver thread, in order.
  struct Command {
    enum class Kind {
      kBegin,
      kReplaceTransport,
      kReleaseTransport,
      kUseRoutingPlan,
      kDrain,
      kShutdown
    };
    Kind kind = Kind::kBegin;
    UpdateHeader header;
    UpdateChecks checks;  // kBegin
    std::unique_ptr<Transport> transport;
    std::string why;  // kReleaseTransport
    std::shared_ptr<const Routing> routing;  // kUseRoutingPlan
    std::shared_ptr<std::promise<void>> drained;
  };

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
              config.offer_after_clean_step, owner.hook_->step_times()) {
    std::size_t max_buckets = 0;  // of an update that carries every group
    for (const auto& g : owner.wire_layout().groups()) max_buckets += g.bucket_count();
    if (owner.plan_) bucket_buffer = DeviceBuffer(backend, owner.plan_->max_bucket_bytes());
    if (owner.plan_ && owner.plan_->staging_bytes() > 0) {
      staging = DeviceBuffer(backend, owner.plan_->staging_bytes());
    }
    // One more event for a trailing checksum block.
    for (std::size_t i = 0; i <= max_buckets; ++i) bucket_events.push_back(backend.create_event());
  }

  void run();
  void receive(const UpdateHeader& header, const UpdateChecks& asked);
  // Routed: the transport's RouteMover, when it moves this rank's routes of `routing`'s plan;
  // otherwise why not (the update fails with it).
  std::optional<Refusal> check_route_mover(RouteMover*& mover) const;
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
  std::shared_ptr<const Routing> routing;  // receiver thread only; null: broadcasts
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
  DeviceBuffer staging;  // the plan's quantized tensors before their quantization
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
  // The routing plan's fingerprint the headers must carry (use_routing_plan); 0: none.
  std::uint64_t routing_fingerprint = 0;

  // kCoordinated: the update held ready until commit(). Set by the receiver thread, cleared by
  // commit() on the engine thread, both under commit_mutex; held_version is also read without it
  // (Receiver::ready_version, a step hook's lock-free question).
  std::mutex commit_mutex;
  std::condition_variable committed;
  const PendingUpdate* held_ready = nullptr;
  std::atomic<std::uint64_t> held_version{0};
  // discard(): the held update was dropped (the receiver thread frees its slots when it resolves
  // the offer), and the update to drop when its receive completes (0: none).
  bool held_discarded = false;
  std::uint64_t discard_when_ready = 0;
  // Waits until no update is held ready (committed), the receiver stops, or `deadline` passes.
  bool wait_for_commit(Clock::time_point deadline);

  mutable std::mutex stats_mutex;
  ReceiverStats stats;
  std::function<void(const UpdateReport&)> observer;
};

}  // namespace shadowsync
