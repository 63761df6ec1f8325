#include "core/pacer.h"

#include <algorithm>
#include <vector>

namespace shadowsync {
namespace {

// What the controller aims at, as a share of the budget's allowed excess: a little below the
// budget, so that the noise of single steps does not keep it above.
constexpr double kAimedShareOfExcess = 0.8;
// The most duty changes by at a time: an estimate from the first few steps moves it at most
// this much.
constexpr double kMaxDecrease = 0.25;
constexpr double kMaxIncrease = 2.0;
// What each update keeps of the evidence before it: the cost of a busy second changes with the
// engine's load, so older updates count less.
constexpr double kEvidenceKeptPerUpdate = 0.5;
// A share of the deadline kept free of holds, for the transfer itself to vary.
constexpr double kDeadlineShareForHolds = 0.8;

// A step counts at most this many idle steps in a mean: a pause of the engine (no requests) or
// a rare long step (a prefill) must not stand for many steps, while a step slowed by a copy
// (about 2.5x at worst, measured on an 8B decode) counts in full.
constexpr std::int64_t kStepCapInIdleSteps = 4;

std::int64_t median(std::vector<std::int64_t> values) {
  const auto middle = values.begin() + static_cast<std::ptrdiff_t>(values.size() / 2);
  std::nth_element(values.begin(), middle, values.end());
  return *middle;
}

// The sum of `values`, each counted at most `cap`, for means: decode tokens/s is the inverse of
// the mean step, and the steps a copy slows are few and long, which a median does not see
// (measured: median step ratio 1.03 while tokens/s fell 1.11x, H100, Llama-3-8B).
std::int64_t capped_sum(const std::vector<std::int64_t>& values, std::int64_t cap) {
  std::int64_t sum = 0;
  for (const std::int64_t v : values) sum += std::min(v, cap);
  return sum;
}

}  // namespace

Pacer::Pacer(std::optional<double> budget, std::uint64_t max_bytes_per_second,
             bool offer_after_clean_step, const StepTimes* steps)
    : budget_(budget),
      max_bytes_per_second_(max_bytes_per_second),
      offer_after_clean_step_(offer_after_clean_step),
      steps_(steps) {}

void Pacer::begin(std::int64_t quiet_since_ns) {
  report_ = PacingReport{};
  report_.paced = active();
  report_.budget = budget_;
  if (steps_ == nullptr) return;
  const std::int64_t now = StepTimes::now_ns();
  const std::vector<std::int64_t> idle =
      steps_->intervals_since(std::max(last_end_ns_, quiet_since_ns), StepTimes::kMaxIntervals);
  if (idle.size() >= PacingReport::kMinBaselineSteps) {
    step_cap_ns_ = kStepCapInIdleSteps * median(idle);
    // This gap's steps and, halved per update, the earlier gaps': a gap gives a few dozen steps,
    // too few for a mean when one in a dozen admits requests and takes three steps' time (on
    // the H100 the baseline of one gap ranged 6.9-8.3 ms around a 6.98 ms mean).
    idle_total_ns_ = idle_total_ns_ * kEvidenceKeptPerUpdate +
                     static_cast<double>(capped_sum(idle, step_cap_ns_));
    idle_count_ = idle_count_ * kEvidenceKeptPerUpdate + static_cast<double>(idle.size());
    idle_step_ns_ = static_cast<std::int64_t>(idle_total_ns_ / idle_count_);
  }
  steps_at_start_ = steps_->count();
  during_ = {};
  excess_ns_ *= kEvidenceKeptPerUpdate;
  busy_ns_ *= kEvidenceKeptPerUpdate;
  if (!duty_learned_ && budget_) {
    // Before any evidence: as if a step ran at half speed while a bucket is in flight (the
    // excess then equals duty), rather than the first buckets back to back.
    duty_ = std::clamp(kAimedShareOfExcess * (*budget_ - 1.0), kMinDuty, 1.0);
  }
  collect_from_ns_ = now;
  collected_count_ = steps_at_start_;
}

void Pacer::collect_steps() {
  collected_count_ = steps_->count();
  for (const StepTimes::Step& step :
       steps_->steps_since(collect_from_ns_, StepTimes::kMaxIntervals)) {
    // Each step counts once, when it ended: the step a bucket slowed is often still running
    // when the bucket completes, and it is the one that matters.
    const std::int64_t counted = step_cap_ns_ > 0 ? std::min(step.duration_ns, step_cap_ns_)
                                                  : step.duration_ns;
    during_.add(counted);
    if (idle_step_ns_ > 0) excess_ns_ += static_cast<double>(counted - idle_step_ns_);
    collect_from_ns_ = step.start_ns + 1;
  }
}

void Pacer::adjust_duty() {
  if (during_.count == 0 || busy_ns_ <= 0.0) return;  // no step ended in this update yet
  const double aimed = 1.0 + kAimedShareOfExcess * (*budget_ - 1.0);
  double wanted = duty_ * kMaxIncrease;  // no excess seen: the copies cost nothing measurable
  if (excess_ns_ > 0.0) {
    // cost: step time in excess per second with a bucket in flight. Over a window W with busy
    // time B (duty = B / W) the steps' excess E = cost x B, and the step ratio r satisfies
    // E = W (r - 1) / r; so the duty that gives r = aimed is (aimed - 1) / (aimed x cost).
    const double cost = excess_ns_ / busy_ns_;
    wanted = (aimed - 1.0) / (aimed * cost);
  }
  duty_ = std::clamp(std::clamp(wanted, duty_ * kMaxDecrease, duty_ * kMaxIncrease), kMinDuty,
                     1.0);
  duty_learned_ = true;
}

std::chrono::nanoseconds Pacer::hold_after(std::size_t bytes, std::chrono::nanoseconds busy,
                                           std::size_t remaining,
                                           std::chrono::nanoseconds time_left) {
  using std::chrono::nanoseconds;
  ++buckets_;
  report_.busy += busy;
  // Evidence only with a baseline: a busy second whose steps' excess cannot be measured would
  // make a copy look free.
  if (idle_step_ns_ > 0) busy_ns_ += static_cast<double>(busy.count());
  if (steps_ != nullptr) collect_steps();
  nanoseconds hold{0};
  if (budget_ && idle_step_ns_ > 0) {
    adjust_duty();
    hold = nanoseconds(static_cast<std::int64_t>(static_cast<double>(busy.count()) *
                                                 (1.0 - duty_) / duty_));
  }
  if (max_bytes_per_second_ != 0) {
    const auto at_cap = nanoseconds(static_cast<std::int64_t>(
        static_cast<double>(bytes) * 1e9 / static_cast<double>(max_bytes_per_second_)));
    hold = std::max(hold, at_cap - busy);
  }
  if (remaining > 0 && hold.count() > 0) {
    // Holds for every remaining bucket, each after a bucket as long as the average so far, must
    // fit in the share of the time left that holds may take.
    const nanoseconds average_busy = report_.busy / static_cast<std::int64_t>(buckets_);
    const nanoseconds allowed =
        nanoseconds(static_cast<std::int64_t>(static_cast<double>(time_left.count()) *
                                              kDeadlineShareForHolds)) /
            static_cast<std::int64_t>(remaining) -
        average_busy;
    if (hold > allowed) {
      hold = std::max(allowed, nanoseconds(0));
      report_.deadline_limited = true;
    }
  }
  return std::max(hold, nanoseconds(0));
}

PacingReport Pacer::finish() {
  if (steps_ != nullptr) {
    const std::int64_t now = StepTimes::now_ns();
    report_.steps = steps_->count() - steps_at_start_;
    collect_steps();
    report_.idle_step = std::chrono::nanoseconds(idle_step_ns_);
    if (during_.count > 0) {
      report_.step_during = std::chrono::nanoseconds(static_cast<std::int64_t>(during_.mean()));
    }
    if (idle_step_ns_ > 0 && report_.step_during.count() > 0) {
      report_.step_ratio = static_cast<double>(report_.step_during.count()) /
                           static_cast<double>(idle_step_ns_);
    }
    last_end_ns_ = now;
  }
  const auto window = report_.busy + report_.held_back;
  report_.duty = window.count() > 0 ? static_cast<double>(report_.busy.count()) /
                                          static_cast<double>(window.count())
                                    : 1.0;
  buckets_ = 0;
  return report_;
}

}  // namespace shadowsync
