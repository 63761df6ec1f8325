// The transport conformance suite (tests/support/transport_conformance.h) on the loopback
// transport: one HostBackend per rank, as one device per rank, and one LoopbackCommunicator.
// tests/gpu/test_nccl_conformance.cpp runs the same cases on NCCL.
#include <memory>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "shadowsync/host_backend.h"
#include "shadowsync/loopback_transport.h"
#include "transport_conformance.h"

namespace {

using shadowsync::Backend;
using shadowsync::HostBackend;
using shadowsync::LoopbackCommunicator;
using shadowsync::Transport;
using shadowsync::testing::ConformanceResult;
using shadowsync::testing::TransportFixture;

class LoopbackFixture final : public TransportFixture {
 public:
  explicit LoopbackFixture(int world_size) : world_size_(world_size) {
    for (int r = 0; r < world_size; ++r) backends_.push_back(std::make_unique<HostBackend>());
    reconnect();
  }

  std::string name() const override {
    return "loopback, " + std::to_string(world_size_) + " ranks";
  }
  int world_size() const override { return world_size_; }
  Backend& backend(int rank) override { return *backends_[static_cast<std::size_t>(rank)]; }
  Transport& transport(int rank) override { return *transports_[static_cast<std::size_t>(rank)]; }

  void reconnect() override {
    transports_.clear();
    communicator_ = std::make_unique<LoopbackCommunicator>(world_size_);
    for (int r = 0; r < world_size_; ++r) transports_.push_back(communicator_->transport(r));
  }

 private:
  const int world_size_;
  std::vector<std::unique_ptr<HostBackend>> backends_;
  std::unique_ptr<LoopbackCommunicator> communicator_;
  std::vector<std::unique_ptr<Transport>> transports_;
};

// The loopback transport can do everything a case asks: none may be skipped on it.
void report(const ConformanceResult& result) {
  for (const std::string& note : result.notes) UNSCOPED_INFO(result.name << ": " << note);
  for (const std::string& failure : result.failures) FAIL_CHECK(result.name << ": " << failure);
  if (result.skipped) FAIL_CHECK(result.name << ": skipped on loopback: " << *result.skipped);
}

}  // namespace

// Each case on a fresh fixture: a failure names its case and does not spill into the next one.
TEST_CASE("transport conformance: loopback, each case alone", "[conformance][loopback]") {
  const int world_size = GENERATE(2, 4);
  const std::string name =
      GENERATE(Catch::Generators::from_range(shadowsync::testing::conformance_case_names()));
  CAPTURE(world_size, name);
  LoopbackFixture fixture(world_size);
  const ConformanceResult result = shadowsync::testing::run_conformance_case(fixture, name);
  report(result);
  CHECK(result.passed());
}

// Every case in a row on one fixture, as the NCCL program runs them: the transports must stay
// usable from one case to the next, and reconnect() must bring them back after an abort.
TEST_CASE("transport conformance: loopback, the whole suite on one fixture",
          "[conformance][loopback]") {
  const int world_size = GENERATE(2, 4);
  CAPTURE(world_size);
  LoopbackFixture fixture(world_size);
  const auto results = shadowsync::testing::run_transport_conformance(fixture);
  REQUIRE(results.size() == shadowsync::testing::conformance_case_names().size());
  for (const ConformanceResult& result : results) report(result);
  CHECK(shadowsync::testing::conformance_failures(results).empty());
  // After the suite, including its aborts, the fixture still serves a healthy communicator.
  const ConformanceResult again =
      shadowsync::testing::run_conformance_case(fixture, "reports rank and world size");
  report(again);
  CHECK(again.passed());
}
