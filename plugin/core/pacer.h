// The receiver's pacing (ReceiverConfig::decode_slowdown_budget, max_receive_bytes_per_second):
// how long to hold the next bucket back so that decoding stays within the budget.
//
// The model: while a bucket is in flight the engine's steps run slower (they share memory
// bandwidth with the copy, and on one GPU the trainer's packing shares the GPU); the steps'
// excess time is about proportional to the time with a bucket in flight. The Pacer measures that
// cost (the steps' excess over the idle step, summed, per second of bucket in flight: every step
// counted once, when it ended, so that the step a bucket slowed counts even when it outlasts
// the bucket) over the update so far and, halved per update, the ones before; after each bucket
// it sets the share of time with a bucket in flight (`duty`) that this cost says gives the
// aimed step ratio (a little below the budget), moving at most x0.25 .. x2 at a time, and holds
// the next bucket back busy x (1 - duty) / duty. Sums over many steps, not a ratio of the newest
// few: a step or two per bucket is too noisy to steer by. Before any evidence, duty starts as
// if a step ran at half speed beside a copy. Steps are the StepHook's stamps; the idle step time
// is their mean while no update streamed in (since the end of the last swap; the earlier gaps
// between updates count too, halved per update). Means, because decode tokens/s is the inverse of
// the mean step; each step counts at most 4 median idle steps, so that a pause of the engine
// does not stand for many steps. The report's step_during is that mean over every step of the
// update, collected after each bucket and while the receiver waits (the hook's ring holds only
// the newest few dozen).
//
// Threads: the receiver thread only. Ownership: reads the hook's StepTimes, which outlive it.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>

#include "shadowsync/receiver.h"
#include "shadowsync/step_times.h"

namespace shadowsync {

class Pacer {
 public:
  using Clock = std::chrono::steady_clock;

  // `steps` must be non-null when `budget` is set or `offer_after_clean_step` (with only a rate
  // cap it may be: the report then has no step times).
  Pacer(std::optional<double> budget, std::uint64_t max_bytes_per_second,
        bool offer_after_clean_step, const StepTimes* steps);

  // Holds buckets back (a budget or a rate cap) and reports what it did.
  bool active() const { return budget_.has_value() || max_bytes_per_second_ != 0; }
  // Learns the idle step at each begin(): to pace, or to wait for a clean step without pacing.
  bool learns_steps() const { return active() || offer_after_clean_step_; }

  // A receive starts now: learns the idle step time from the steps since the last update ended
  // that started at or after `quiet_since_ns` (StepTimes' clock; the end of the engine's last
  // swap: the swap's step, longer by the swap, is not an idle step; 0: no swap yet).
  void begin(std::int64_t quiet_since_ns);
  // Bucket `bytes` was in flight for `busy`. Returns how long to wait before posting the next
  // one: `remaining` buckets are left and `time_left` until the update's deadline, which the
  // holds never make it miss.
  std::chrono::nanoseconds hold_after(std::size_t bytes, std::chrono::nanoseconds busy,
                                      std::size_t remaining, std::chrono::nanoseconds time_left);
  // The receiver waits (a hold, a bucket in flight): takes in the steps completed meanwhile
  // before the hook's ring drops them. One atomic load unless half the ring's window is new.
  void poll() {
    if (steps_ != nullptr && steps_->count() - collected_count_ >= StepTimes::kMaxIntervals / 2) {
      collect_steps();
    }
  }
  // The hold that was actually waited (the receiver may stop early, or sleep a little longer).
  void held(std::chrono::nanoseconds waited) { report_.held_back += waited; }
  // The receive ended (completed or not): what pacing did.
  PacingReport finish();

  double duty() const { return duty_; }

  // The update is complete: how long the receiver may hold it back for a step that starts after
  // its last bucket (Receiver: wait_for_clean_step), so that the step the swap delays is not also
  // the one the last bucket slowed: kCleanStepLimitInIdleSteps idle steps. Nothing: neither a
  // budget nor offer_after_clean_step, or the idle step is not known yet; then it is offered at
  // once.
  std::optional<std::chrono::nanoseconds> clean_step_limit() const {
    if (!(budget_ || offer_after_clean_step_) || steps_ == nullptr || idle_step_ns_ == 0) {
      return std::nullopt;
    }
    return std::chrono::nanoseconds(kCleanStepLimitInIdleSteps * idle_step_ns_);
  }
  // Engine steps started so far (0 without step times).
  std::uint64_t steps_started() const { return steps_ == nullptr ? 0 : steps_->count(); }

 private:
  // The smallest share of the time a bucket may be in flight: an update never takes more than
  // 1 / kMinDuty times its unpaced time on account of a budget (and never misses its deadline:
  // hold_after). Low, because on one GPU a bucket's copies slow the steps beside them by several
  // times their own time in flight: budget 1.03 needed about 0.4 % on an H100 in real vLLM.
  static constexpr double kMinDuty = 0.002;
  // The step in progress when the last bucket completes ends within about one (slowed) step and
  // the next one starts right after; a longer wait means the engine is idle or paused.
  static constexpr std::int64_t kCleanStepLimitInIdleSteps = 4;

  // Durations of steps, summed: their mean without keeping them.
  struct StepSum {
    std::int64_t total_ns = 0;
    std::uint64_t count = 0;
    void add(std::int64_t ns) {
      total_ns += ns;
      ++count;
    }
    double mean() const { return static_cast<double>(total_ns) / static_cast<double>(count); }
  };

  void adjust_duty();
  // Counts the steps that ended since the last call (the ring gives only the newest
  // kMaxIntervals, so this runs after every bucket, while the receiver waits, and at the end).
  void collect_steps();

  const std::optional<double> budget_;
  const std::uint64_t max_bytes_per_second_;
  const bool offer_after_clean_step_;
  const StepTimes* const steps_;
  double duty_ = 1.0;              // learned; kept across updates
  bool duty_learned_ = false;      // duty_ came from evidence, not from the starting guess
  std::int64_t idle_step_ns_ = 0;  // learned; kept until a newer baseline is measured
  double idle_total_ns_ = 0.0;     // idle steps' time and count behind it (earlier gaps halved)
  double idle_count_ = 0.0;
  std::int64_t step_cap_ns_ = 0;   // the longest a step counts in a mean; learned with it
  std::int64_t last_end_ns_ = 0;      // when the previous receive ended
  std::uint64_t steps_at_start_ = 0;
  StepSum during_;  // this update's steps, for the report
  // The evidence: steps' time over the idle step, and time with a bucket in flight (ns; this
  // update's, plus the earlier ones' at kEvidenceKeptPerUpdate per update).
  double excess_ns_ = 0.0;
  double busy_ns_ = 0.0;
  std::int64_t collect_from_ns_ = 0;  // steps that started from here on are not counted yet
  std::uint64_t collected_count_ = 0;  // steps_->count() at the last collection
  std::size_t buckets_ = 0;  // of this update, so far
  PacingReport report_;
};

}  // namespace shadowsync
