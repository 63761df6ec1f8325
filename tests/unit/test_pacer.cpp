// Pacer's report: the step time while an update streams in is the median of every step of the
// update, not only of the newest few dozen the step hook's ring still holds (an update's steps
// change as the pacing learns: the report must not describe only its end).
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdint>

#include "core/pacer.h"
#include "shadowsync/step_times.h"

using namespace shadowsync;
using namespace std::chrono_literals;

namespace {

// One engine step of about `duration`: the step's work, simulated by spinning on the clock.
void step(StepTimes& times, std::chrono::nanoseconds duration) {
  times.record();
  const std::int64_t until = StepTimes::now_ns() + duration.count();
  while (StepTimes::now_ns() < until) {
  }
}

}  // namespace

TEST_CASE("the report's step time is the median of all the update's steps", "[pacer]") {
  StepTimes times;
  Pacer pacer(1.10, 0, &times);
  for (int i = 0; i < 8; ++i) step(times, 200us);  // idle steps: the baseline
  pacer.begin();
  // 10 buckets: during the first 7, 20 short steps each (140); during the last 3, 20 long ones
  // (60). The newest 32 steps are all long; the median of the update is short. (Long is 50x
  // short: a loaded machine that stretches a few short steps does not move the median there.)
  for (int bucket = 0; bucket < 10; ++bucket) {
    for (int i = 0; i < 20; ++i) step(times, bucket < 7 ? 200us : 10ms);
    pacer.hold_after(4096, 1ms, static_cast<std::size_t>(9 - bucket), 60s);
  }
  times.record();  // the last step ends
  const PacingReport report = pacer.finish();
  INFO("idle " << report.idle_step.count() << " ns, during " << report.step_during.count()
               << " ns, ratio " << report.step_ratio << ", steps " << report.steps);
  CHECK(report.steps == 201);
  CHECK(report.idle_step >= 200us);
  CHECK(report.step_during >= 200us);
  CHECK(report.step_during < 5ms);  // the newest 32 alone would say 10 ms
}

TEST_CASE("a step is counted once however often the steps are collected", "[pacer]") {
  StepTimes times;
  Pacer pacer(1.10, 0, &times);
  for (int i = 0; i < 8; ++i) step(times, 100us);
  pacer.begin();
  // 20 short steps, collected six times over; then 30 long ones. Counted once each, the long
  // steps are the majority; counted again at every collection, the short ones would be.
  for (int i = 0; i < 20; ++i) step(times, 100us);
  for (int i = 0; i < 6; ++i) pacer.hold_after(4096, 1ms, 3, 60s);
  for (int i = 0; i < 15; ++i) step(times, 1ms);
  pacer.hold_after(4096, 1ms, 1, 60s);
  for (int i = 0; i < 15; ++i) step(times, 1ms);
  times.record();
  const PacingReport report = pacer.finish();
  INFO("during " << report.step_during.count() << " ns");
  CHECK(report.steps == 51);
  CHECK(report.step_during >= 1ms);
}

TEST_CASE("steps are taken in while the receiver waits, before the ring drops them", "[pacer]") {
  StepTimes times;
  Pacer pacer(1.10, 0, &times);
  for (int i = 0; i < 8; ++i) step(times, 100us);
  pacer.begin();
  // One long wait (a hold, a bucket in flight) with 100 short steps and then 30 long ones: the
  // receiver polls as it waits. Taken in as they come, the short steps are the majority; only
  // after the wait, the ring would give the newest 32 (30 long).
  for (int i = 0; i < 100; ++i) {
    step(times, 100us);
    pacer.poll();
  }
  for (int i = 0; i < 30; ++i) {
    step(times, 5ms);
    pacer.poll();
  }
  pacer.hold_after(4096, 1ms, 0, 60s);
  times.record();
  const PacingReport report = pacer.finish();
  INFO("during " << report.step_during.count() << " ns");
  CHECK(report.steps == 131);
  CHECK(report.step_during < 2500us);
}
