// StepTimes: the ring of step start stamps the step hook keeps for pacing.
#include <catch2/catch.hpp>

#include "shadowsync/step_times.h"

using shadowsync::StepTimes;

TEST_CASE("intervals are the gaps between consecutive stamps, newest last", "[step_times]") {
  StepTimes times;
  CHECK(times.intervals_since(0, 10).empty());
  times.record();
  CHECK(times.count() == 1);
  CHECK(times.intervals_since(0, 10).empty());  // one start, no end yet
  for (int i = 0; i < 3; ++i) times.record();
  const auto all = times.intervals_since(0, 10);
  REQUIRE(all.size() == 3);
  for (const auto gap : all) CHECK(gap >= 0);
  CHECK(times.intervals_since(0, 2).size() == 2);
  // Steps that started before `since` are left out.
  CHECK(times.intervals_since(StepTimes::now_ns() + 1'000'000'000, 10).empty());
}

TEST_CASE("past the ring's capacity only the newest intervals are kept", "[step_times]") {
  StepTimes times;
  for (std::size_t i = 0; i < 3 * StepTimes::kCapacity + 5; ++i) times.record();
  const auto newest = times.intervals_since(0, 1000);
  CHECK(newest.size() == StepTimes::kMaxIntervals);
  for (const auto gap : newest) CHECK(gap >= 0);  // no torn or stale entry reads negative
}

TEST_CASE("steps carry their start stamps: a reader can take each step exactly once",
          "[step_times]") {
  StepTimes times;
  for (int i = 0; i < 5; ++i) times.record();
  const auto first = times.steps_since(0, 10);
  REQUIRE(first.size() == 4);
  for (std::size_t i = 0; i + 1 < first.size(); ++i) {
    // Each step ends where the next starts.
    CHECK(first[i].start_ns + first[i].duration_ns == first[i + 1].start_ns);
  }
  CHECK(times.intervals_since(0, 10).size() == first.size());
  // Continuing after the newest step taken: only steps completed since.
  const std::int64_t next_from = first.back().start_ns + 1;
  CHECK(times.steps_since(next_from, 10).empty());
  times.record();
  times.record();
  const auto later = times.steps_since(next_from, 10);
  REQUIRE(later.size() == 2);
  CHECK(later.front().start_ns == first.back().start_ns + first.back().duration_ns);
}
