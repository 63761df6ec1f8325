// ChunkGate: the host-side wait of a device-flavour same-host receiver (same_host_gate.h). Each
// way a wait ends - the chunk's doorbell opened it, the link was released, the deadline passed -
// from another thread, with deadlines that fail loudly; and SameHostConfig::doorbell_timeout's
// check. The device flavour itself runs in tests/gpu/test_same_host_gpu.cu.
#include <catch2/catch.hpp>

#include <chrono>
#include <future>
#include <string>

#include "shadowsync/error.h"
#include "shadowsync/host_backend.h"
#include "shadowsync/same_host_transport.h"
#include "transports/same_host/same_host_gate.h"

using namespace shadowsync;
using shadowsync::same_host::ChunkGate;
using namespace std::chrono_literals;

namespace {

using Outcome = ChunkGate::Outcome;

const char* name(Outcome outcome) {
  switch (outcome) {
    case Outcome::kOpen: return "open";
    case Outcome::kReleased: return "released";
    case Outcome::kDeadline: return "deadline";
  }
  return "?";
}

// Far beyond anything a passing test needs: a wait that uses it up is the bug.
constexpr auto kLong = 30s;

// A wait for `chunk` on another thread, with a deadline of `timeout`.
std::future<Outcome> wait_async(ChunkGate& gate, std::uint64_t chunk,
                                std::chrono::milliseconds timeout = kLong) {
  return std::async(std::launch::async, [&gate, chunk, timeout] {
    return gate.wait(chunk, ChunkGate::Clock::now() + timeout);
  });
}

// The wait has not returned within 100 ms (it is blocked, as it must be).
void require_blocked(std::future<Outcome>& wait, const char* why) {
  INFO(why);
  REQUIRE(wait.wait_for(100ms) == std::future_status::timeout);
}

// The wait returns within 5 s (it must return promptly, not at its 30 s deadline).
Outcome require_returns(std::future<Outcome>& wait, const char* what) {
  INFO(what);
  REQUIRE(wait.wait_for(5s) == std::future_status::ready);
  return wait.get();
}

}  // namespace

TEST_CASE("same-host gate: a wait returns once the progress thread opens its chunk",
          "[same_host][gate]") {
  ChunkGate gate;
  auto chunk0 = wait_async(gate, 0);
  require_blocked(chunk0, "chunk 0 waited for nothing: no doorbell was opened");
  gate.open(1);
  const Outcome got = require_returns(chunk0, "chunk 0 after open(1)");
  CHECK(std::string(name(got)) == "open");

  // Opening chunk 2 opens chunk 1 too (the counter only grows), and not chunk 3.
  auto chunk3 = wait_async(gate, 3);
  gate.open(3);
  CHECK(gate.wait(1, ChunkGate::Clock::now()) == Outcome::kOpen);
  CHECK(gate.wait(2, ChunkGate::Clock::now()) == Outcome::kOpen);
  require_blocked(chunk3, "chunk 3 went after open(3), which opens chunks 0..2 only");
  gate.open(2);  // never moves back
  require_blocked(chunk3, "open(2) after open(3) moved the gate");
  gate.open(4);
  CHECK(std::string(name(require_returns(chunk3, "chunk 3 after open(4)"))) == "open");
}

TEST_CASE("same-host gate: release from another thread ends a wait at once, and every later one",
          "[same_host][gate]") {
  ChunkGate gate;
  gate.open(2);
  auto waiting = wait_async(gate, 5);
  require_blocked(waiting, "chunk 5 went before its doorbell or a release");
  const auto released_at = ChunkGate::Clock::now();
  gate.release();
  CHECK(std::string(name(require_returns(waiting, "chunk 5 after release()"))) == "released");
  CHECK(ChunkGate::Clock::now() - released_at < 5s);
  CHECK(gate.released());
  // Released wins over open: nothing more may be enqueued once the transport died, even a chunk
  // whose doorbell came.
  CHECK(std::string(name(gate.wait(0, ChunkGate::Clock::now() + kLong))) == "released");
  gate.open(10);
  CHECK(std::string(name(gate.wait(7, ChunkGate::Clock::now() + kLong))) == "released");
  gate.release();  // idempotent
  CHECK(gate.released());
}

TEST_CASE("same-host gate: a wait with no doorbell and no release ends at its deadline, not before",
          "[same_host][gate]") {
  ChunkGate gate;
  gate.open(1);
  const auto start = ChunkGate::Clock::now();
  auto waiting = wait_async(gate, 1, 300ms);
  const Outcome got = require_returns(waiting, "chunk 1 with a 300 ms deadline");
  const auto took = ChunkGate::Clock::now() - start;
  CHECK(std::string(name(got)) == "deadline");
  CHECK(took >= 300ms);
  CHECK(!gate.released());  // the transport, not the gate, decides what a late doorbell means
  // A deadline already passed still sees an open chunk.
  CHECK(gate.wait(0, ChunkGate::Clock::now() - 1s) == Outcome::kOpen);
}

TEST_CASE("same-host gate: a spinning wait ends on open, release or deadline as a sleeping one",
          "[same_host][gate]") {
  // Spinning longer than any of these takes: each outcome comes from the spinning phase.
  constexpr auto kSpin = std::chrono::microseconds(std::chrono::seconds(20));
  ChunkGate gate;
  auto opened = std::async(std::launch::async,
                           [&] { return gate.wait(0, ChunkGate::Clock::now() + kLong, kSpin); });
  require_blocked(opened, "a spinning wait for chunk 0 went before its doorbell");
  gate.open(1);
  CHECK(std::string(name(require_returns(opened, "spinning chunk 0 after open(1)"))) == "open");

  // The spin never outlasts the deadline.
  const auto start = ChunkGate::Clock::now();
  CHECK(std::string(name(gate.wait(1, start + 200ms, kSpin))) == "deadline");
  const auto took = ChunkGate::Clock::now() - start;
  CHECK(took >= 200ms);
  CHECK(took < 5s);

  auto released = std::async(std::launch::async,
                             [&] { return gate.wait(1, ChunkGate::Clock::now() + kLong, kSpin); });
  require_blocked(released, "a spinning wait for chunk 1 went before a doorbell or a release");
  gate.release();
  CHECK(std::string(name(require_returns(released, "spinning chunk 1 after release()"))) ==
        "released");
  // Released wins over open while spinning too.
  CHECK(std::string(name(gate.wait(0, ChunkGate::Clock::now() + kLong, kSpin))) == "released");
}

TEST_CASE("same-host gate: SameHostConfig::doorbell_timeout must be positive",
          "[same_host][gate]") {
  HostBackend backend;
  SameHostConfig config;
  CHECK(config.doorbell_timeout == std::chrono::milliseconds(10'000));
  config.doorbell_timeout = 0ms;
  try {
    (void)SameHostTransport::connect(
        "/tmp/shadowsync_gate_unused/sock",
        "ssk1-63797165b3dfe0a594bfd143e51ff27ac4b85e06f81699463bcc565a25d9897c", 1, backend,
        config);
    FAIL("connect accepted a doorbell_timeout of 0 ms");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kInvalidArgument);
    const std::string what = e.what();
    CHECK_THAT(what, Catch::Contains("doorbell_timeout is 0 ms"));
    CHECK_THAT(what, Catch::Contains("default 10000 ms"));
  }
}
