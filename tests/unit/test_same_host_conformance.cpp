// The transport conformance suite (tests/support/transport_conformance.h) on the same-host
// transport's host flavour: rank 0 serves, the other ranks connect from threads of this process,
// each rank with its own HostBackend (tests/support/same_host_fixture.h). Slots of 4 KiB, so that
// the suite's broadcasts (up to 1 MiB) cross hundreds of chunks and both slots many times.
// tests/gpu/test_same_host_gpu.cu runs the same on the device flavour.
//
// The same-host sender is always rank 0: the cases that broadcast from other roots are skipped
// through the fixture's capabilities, and the test checks that exactly those are, and says so.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "same_host_fixture.h"
#include "shadowsync/host_backend.h"
#include "transport_conformance.h"

namespace {

using shadowsync::testing::kSkippedOnSameHost;
using shadowsync::Backend;
using shadowsync::HostBackend;
using shadowsync::SameHostMemory;
using shadowsync::testing::ConformanceResult;
using shadowsync::testing::SameHostFixture;

constexpr std::size_t kSlotBytes = 4096;

std::unique_ptr<SameHostFixture> make_fixture(int world_size) {
  return std::make_unique<SameHostFixture>(
      world_size, SameHostMemory::kHost, kSlotBytes,
      [](int) -> std::unique_ptr<Backend> { return std::make_unique<HostBackend>(); });
}


}  // namespace

TEST_CASE(
    "same-host conformance: the fixture's capabilities rule out exactly the cases whose "
    "root is not rank 0",
    "[conformance][same_host]") {
  const auto fixture = make_fixture(2);
  CHECK_FALSE(fixture->capabilities().any_rank_as_root);
  CHECK(shadowsync::testing::conformance_cases_skipped_on(*fixture) == kSkippedOnSameHost);
  for (const std::string& name : kSkippedOnSameHost) {
    const ConformanceResult result = shadowsync::testing::run_conformance_case(*fixture, name);
    REQUIRE(result.skipped.has_value());
    CHECK_THAT(*result.skipped, Catch::Contains("root other than rank 0") &&
                                    Catch::Contains("same-host (host memory, 4 KiB slots)"));
    CHECK(result.failures.empty());
  }
}

// Each case on a fresh fixture: a failure names its case and does not spill into the next one.
TEST_CASE("same-host conformance: host memory, each case alone", "[conformance][same_host]") {
  const int world_size = GENERATE(2, 4);
  const std::string name =
      GENERATE(Catch::Generators::from_range(shadowsync::testing::conformance_case_names()));
  CAPTURE(world_size, name);
  const auto fixture = make_fixture(world_size);
  const ConformanceResult result = shadowsync::testing::run_conformance_case(*fixture, name);
  report_same_host_case(result);
  CHECK(result.passed());
}

// Every case in a row on one fixture: the transports stay usable from one case to the next, and
// reconnect() (a new sender on the same path) brings them back after an abort.
TEST_CASE("same-host conformance: host memory, the whole suite on one fixture",
          "[conformance][same_host]") {
  const int world_size = GENERATE(2, 4);
  CAPTURE(world_size);
  const auto fixture = make_fixture(world_size);
  const auto results = shadowsync::testing::run_transport_conformance(*fixture);
  REQUIRE(results.size() == shadowsync::testing::conformance_case_names().size());
  for (const ConformanceResult& result : results) report_same_host_case(result);
  CHECK(shadowsync::testing::conformance_failures(results).empty());
  const ConformanceResult again = shadowsync::testing::run_conformance_case(
      *fixture, "broadcast from root 0 of 1 B, 4097 B and 1 MiB");
  report_same_host_case(again);
  CHECK(again.passed());
}
