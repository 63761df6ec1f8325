// LoopbackTransport: collective broadcast semantics on HostBackend streams, and fault injection.
// Every wait has a deadline that fails the test; nothing sleeps to win a race.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <initializer_list>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "shadowsync/error.h"
#include "shadowsync/host_backend.h"
#include "shadowsync/loopback_transport.h"

namespace {

using namespace std::chrono_literals;
using shadowsync::Error;
using shadowsync::ErrorCode;
using shadowsync::HostBackend;
using shadowsync::HostBackendOptions;
using shadowsync::LoopbackCommunicator;
using shadowsync::StreamPriority;

constexpr auto kDeadline = 5s;  // generous: only a bug makes a wait take this long
// A bounded wait used to show that something has NOT happened; it cannot pass by luck because
// the awaited event is impossible until the test acts.
constexpr auto kShortWait = 30ms;

// One communicator with a stream, transport and event per rank. Buffers live here too, declared
// first so that they outlive the streams that write them.
struct Ranks {
  explicit Ranks(int world_size, HostBackendOptions options = {})
      : backend(options), comm(world_size) {
    for (int r = 0; r < world_size; ++r) {
      streams.push_back(backend.create_stream(StreamPriority::kLow));
      transports.push_back(comm.transport(r));
      events.push_back(backend.create_event());
    }
  }
  // A failed check must not leave a stream blocked in a collective (its destructor would hang).
  ~Ranks() {
    if (!transports.empty()) transports[0]->abort();
  }

  std::uint8_t* buffer(std::size_t bytes, std::uint8_t fill) {
    return storage.emplace_back(bytes, fill).data();
  }
  // Broadcast on `rank`'s stream, then record its event behind it.
  void broadcast(int rank, void* data, std::size_t bytes, int root) {
    transports[rank]->broadcast_async(data, bytes, root, *streams[rank]);
    backend.event_record(*events[rank], *streams[rank]);
  }
  bool done(int rank, std::chrono::nanoseconds timeout = kDeadline) {
    return backend.event_wait_for(*events[rank], timeout);
  }

  std::deque<std::vector<std::uint8_t>> storage;
  HostBackend backend;
  LoopbackCommunicator comm;
  std::vector<std::unique_ptr<shadowsync::Stream>> streams;
  std::vector<std::unique_ptr<shadowsync::Transport>> transports;
  std::vector<std::unique_ptr<shadowsync::Event>> events;
};

void fill_pattern(std::uint8_t* data, std::size_t bytes, std::uint32_t seed) {
  for (std::size_t i = 0; i < bytes; ++i) data[i] = static_cast<std::uint8_t>(i * 31 + seed * 17 + 1);
}

bool same(const std::uint8_t* a, const std::uint8_t* b, std::size_t bytes) {
  return std::equal(a, a + bytes, b);
}

struct ForeignStream final : shadowsync::Stream {};

}  // namespace

TEST_CASE("loopback: three ranks receive the root's bytes", "[loopback]") {
  constexpr std::size_t kBytes = 100'000;
  Ranks ranks(3);
  REQUIRE(ranks.transports[1]->name() == "loopback");
  REQUIRE(ranks.transports[1]->rank() == 1);
  REQUIRE(ranks.transports[1]->world_size() == 3);

  for (int root = 0; root < 3; ++root) {
    std::vector<std::uint8_t*> buffers;
    for (int r = 0; r < 3; ++r) buffers.push_back(ranks.buffer(kBytes, 0));
    fill_pattern(buffers[root], kBytes, root);
    for (int r = 0; r < 3; ++r) ranks.broadcast(r, buffers[r], kBytes, root);
    for (int r = 0; r < 3; ++r) REQUIRE(ranks.done(r));
    for (int r = 0; r < 3; ++r) REQUIRE(same(buffers[r], buffers[root], kBytes));
  }
  REQUIRE(ranks.comm.broadcasts_completed() == 3);
  for (int r = 0; r < 3; ++r) REQUIRE_FALSE(ranks.transports[r]->async_error());
}

TEST_CASE("loopback: each rank's stream blocks until every rank joined", "[loopback]") {
  constexpr std::size_t kBytes = 4096;
  Ranks ranks(3);
  auto* b0 = ranks.buffer(kBytes, 0);
  auto* b1 = ranks.buffer(kBytes, 0);
  auto* b2 = ranks.buffer(kBytes, 0);
  fill_pattern(b0, kBytes, 9);

  ranks.broadcast(0, b0, kBytes, 0);
  ranks.broadcast(1, b1, kBytes, 0);
  // Rank 2 has not called yet: neither the root nor rank 1 may leave the collective.
  REQUIRE_FALSE(ranks.done(0, kShortWait));
  REQUIRE_FALSE(ranks.done(1, kShortWait));
  REQUIRE(ranks.comm.broadcasts_completed() == 0);

  ranks.broadcast(2, b2, kBytes, 0);
  for (int r = 0; r < 3; ++r) REQUIRE(ranks.done(r));
  REQUIRE(same(b1, b0, kBytes));
  REQUIRE(same(b2, b0, kBytes));
  REQUIRE(ranks.comm.broadcasts_completed() == 1);
}

TEST_CASE("loopback: a delayed rank holds every rank's stream", "[loopback]") {
  constexpr std::size_t kBytes = 1024;
  constexpr auto kDelay = 100ms;
  Ranks ranks(3);
  ranks.comm.inject_delay(2, 1, kDelay);  // the second broadcast of rank 2
  std::vector<std::uint8_t*> first, second;
  for (int r = 0; r < 3; ++r) {
    first.push_back(ranks.buffer(kBytes, 0));
    second.push_back(ranks.buffer(kBytes, 0));
  }
  fill_pattern(first[1], kBytes, 1);
  fill_pattern(second[1], kBytes, 2);

  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < 3; ++r) {
    ranks.transports[r]->broadcast_async(first[r], kBytes, 1, *ranks.streams[r]);
    ranks.broadcast(r, second[r], kBytes, 1);
  }
  for (int r = 0; r < 3; ++r) REQUIRE(ranks.done(r));
  // A lower bound only: the root cannot finish before the delayed rank joined.
  REQUIRE(std::chrono::steady_clock::now() - start >= kDelay);
  for (int r = 0; r < 3; ++r) {
    REQUIRE(same(first[r], first[1], kBytes));
    REQUIRE(same(second[r], second[1], kBytes));
  }
  REQUIRE(ranks.comm.broadcasts_completed() == 2);
  for (int r = 0; r < 3; ++r) REQUIRE_FALSE(ranks.transports[r]->async_error());
}

TEST_CASE("loopback: a dropped rank blocks the others until an abort", "[loopback]") {
  constexpr std::size_t kBytes = 512;
  Ranks ranks(3);
  ranks.comm.inject_drop(2, 1);
  std::vector<std::uint8_t*> first, second, third;
  for (int r = 0; r < 3; ++r) {
    first.push_back(ranks.buffer(kBytes, 0));
    second.push_back(ranks.buffer(kBytes, 0));
    third.push_back(ranks.buffer(kBytes, 0));
  }
  fill_pattern(first[0], kBytes, 1);
  fill_pattern(second[0], kBytes, 2);
  fill_pattern(third[0], kBytes, 3);

  // Call 0 goes through on every rank.
  for (int r = 0; r < 3; ++r) ranks.broadcast(r, first[r], kBytes, 0);
  for (int r = 0; r < 3; ++r) REQUIRE(ranks.done(r));
  REQUIRE(same(first[2], first[0], kBytes));

  // Call 1: rank 2 is gone; its own stream moves on and it reports the drop.
  for (int r = 0; r < 3; ++r) ranks.broadcast(r, second[r], kBytes, 0);
  REQUIRE(ranks.done(2));
  const auto dropped = ranks.transports[2]->async_error();
  REQUIRE(dropped);
  REQUIRE(*dropped == "rank 2 dropped at broadcast 1 (fault injection)");
  REQUIRE_FALSE(ranks.done(0, kShortWait));
  REQUIRE_FALSE(ranks.done(1, kShortWait));
  REQUIRE_FALSE(ranks.transports[0]->async_error());
  REQUIRE_FALSE(ranks.transports[1]->async_error());

  // A deadline on rank 0 aborts: every blocked collective returns, every rank sees the error.
  ranks.transports[0]->abort();
  REQUIRE(ranks.done(0));
  REQUIRE(ranks.done(1));
  for (int r = 0; r < 2; ++r) {
    const auto error = ranks.transports[r]->async_error();
    REQUIRE(error);
    REQUIRE(*error == "loopback communicator aborted by rank 0");
  }
  REQUIRE(*ranks.transports[2]->async_error() == *dropped);  // its own failure comes first
  REQUIRE(std::all_of(second[2], second[2] + kBytes, [](std::uint8_t b) { return b == 0; }));
  ranks.transports[1]->abort();  // idempotent

  // A dead communicator delivers nothing, and does not block.
  for (int r = 0; r < 3; ++r) ranks.broadcast(r, third[r], kBytes, 0);
  for (int r = 0; r < 3; ++r) REQUIRE(ranks.done(r));
  REQUIRE(std::all_of(third[1], third[1] + kBytes, [](std::uint8_t b) { return b == 0; }));
  REQUIRE(ranks.comm.broadcasts_completed() == 1);
}

TEST_CASE("loopback: a flip corrupts exactly one byte on one rank", "[loopback]") {
  constexpr std::size_t kBytes = 256;
  Ranks ranks(3);
  ranks.comm.inject_flip(1, 0, 7);
  ranks.comm.inject_flip(2, 0, kBytes);  // past the end: ignored
  std::vector<std::uint8_t*> buffers;
  for (int r = 0; r < 3; ++r) buffers.push_back(ranks.buffer(kBytes, 0));
  fill_pattern(buffers[0], kBytes, 5);
  std::vector<std::uint8_t> sent(buffers[0], buffers[0] + kBytes);

  for (int r = 0; r < 3; ++r) ranks.broadcast(r, buffers[r], kBytes, 0);
  for (int r = 0; r < 3; ++r) REQUIRE(ranks.done(r));

  REQUIRE(same(buffers[0], sent.data(), kBytes));
  REQUIRE(same(buffers[2], sent.data(), kBytes));
  for (std::size_t i = 0; i < kBytes; ++i) {
    if (i == 7) {
      REQUIRE(buffers[1][i] == static_cast<std::uint8_t>(sent[i] ^ 0xFF));
    } else {
      REQUIRE(buffers[1][i] == sent[i]);
    }
  }
}

TEST_CASE("loopback: a flip on the root corrupts only its own copy", "[loopback]") {
  constexpr std::size_t kBytes = 64;
  Ranks ranks(2);
  ranks.comm.inject_flip(0, 0, 3);
  auto* b0 = ranks.buffer(kBytes, 0);
  auto* b1 = ranks.buffer(kBytes, 0);
  fill_pattern(b0, kBytes, 8);
  std::vector<std::uint8_t> sent(b0, b0 + kBytes);
  ranks.broadcast(0, b0, kBytes, 0);
  ranks.broadcast(1, b1, kBytes, 0);
  REQUIRE(ranks.done(0));
  REQUIRE(ranks.done(1));
  REQUIRE(same(b1, sent.data(), kBytes));
  REQUIRE(b0[3] == static_cast<std::uint8_t>(sent[3] ^ 0xFF));
}

TEST_CASE("loopback: mismatched byte counts fail the communicator on every rank",
          "[loopback]") {
  Ranks ranks(3);
  auto* b0 = ranks.buffer(64, 1);
  auto* b1 = ranks.buffer(64, 0);
  auto* b2 = ranks.buffer(64, 0);
  ranks.broadcast(0, b0, 64, 0);
  REQUIRE_FALSE(ranks.done(0, kShortWait));  // the root waits for the others
  ranks.broadcast(1, b1, 32, 0);
  ranks.broadcast(2, b2, 64, 0);
  for (int r = 0; r < 3; ++r) REQUIRE(ranks.done(r));
  for (int r = 0; r < 3; ++r) {
    const auto error = ranks.transports[r]->async_error();
    REQUIRE(error);
    REQUIRE_THAT(*error, Catch::Contains("32 bytes") && Catch::Contains("64 bytes"));
  }
  REQUIRE(ranks.comm.broadcasts_completed() == 0);
}

TEST_CASE("loopback: mismatched roots fail the communicator", "[loopback]") {
  Ranks ranks(2);
  auto* b0 = ranks.buffer(16, 1);
  auto* b1 = ranks.buffer(16, 2);
  ranks.broadcast(0, b0, 16, 0);
  ranks.broadcast(1, b1, 16, 1);
  REQUIRE(ranks.done(0));
  REQUIRE(ranks.done(1));
  const auto error = ranks.transports[0]->async_error();
  REQUIRE(error);
  REQUIRE_THAT(*error, Catch::Contains("root 0") && Catch::Contains("root 1"));
  REQUIRE(ranks.transports[1]->async_error() == error);
}

TEST_CASE("loopback: a world of one rank completes at once", "[loopback]") {
  Ranks ranks(1);
  auto* b = ranks.buffer(128, 0);
  fill_pattern(b, 128, 4);
  std::vector<std::uint8_t> sent(b, b + 128);
  ranks.broadcast(0, b, 128, 0);
  REQUIRE(ranks.done(0));
  REQUIRE(same(b, sent.data(), 128));
  ranks.broadcast(0, b, 0, 0);  // zero bytes is fine too
  REQUIRE(ranks.done(0));
  REQUIRE(ranks.comm.broadcasts_completed() == 2);
  REQUIRE_FALSE(ranks.transports[0]->async_error());
}

TEST_CASE("loopback: arguments are validated", "[loopback]") {
  auto expect_invalid = [](auto&& call, std::initializer_list<const char*> words) {
    try {
      call();
      FAIL("no error");
    } catch (const Error& e) {
      REQUIRE(e.code() == ErrorCode::kInvalidArgument);
      for (const char* word : words) REQUIRE_THAT(e.what(), Catch::Contains(word));
    }
  };
  expect_invalid([] { LoopbackCommunicator comm(0); }, {"0"});
  expect_invalid([] { LoopbackCommunicator comm(-2); }, {"-2"});

  Ranks ranks(3);
  expect_invalid([&] { ranks.comm.transport(3); }, {"rank 3", "3"});
  expect_invalid([&] { ranks.comm.transport(-1); }, {"rank -1"});
  expect_invalid([&] { ranks.comm.transport(1); }, {"rank 1", "already"});
  expect_invalid([&] { ranks.comm.inject_delay(5, 0, 1ms); }, {"rank 5"});
  expect_invalid([&] { ranks.comm.inject_drop(-1, 0); }, {"rank -1"});
  expect_invalid([&] { ranks.comm.inject_flip(3, 0, 0); }, {"rank 3"});

  int data = 0;
  expect_invalid([&] { ranks.transports[0]->broadcast_async(&data, 4, 3, *ranks.streams[0]); },
                 {"root 3", "world size 3"});
  expect_invalid([&] { ranks.transports[0]->broadcast_async(&data, 4, -1, *ranks.streams[0]); },
                 {"root -1"});
  expect_invalid([&] { ranks.transports[0]->broadcast_async(nullptr, 4, 0, *ranks.streams[0]); },
                 {"null"});
  ForeignStream foreign;
  expect_invalid([&] { ranks.transports[0]->broadcast_async(&data, 4, 0, foreign); },
                 {"loopback transport needs a stream from HostBackend", "ForeignStream"});

  // Rejected calls consumed no call number: the ranks still meet at broadcast 0.
  std::vector<std::uint8_t*> buffers;
  for (int r = 0; r < 3; ++r) buffers.push_back(ranks.buffer(8, static_cast<std::uint8_t>(r)));
  for (int r = 0; r < 3; ++r) ranks.broadcast(r, buffers[r], 8, 2);
  for (int r = 0; r < 3; ++r) REQUIRE(ranks.done(r));
  for (int r = 0; r < 3; ++r) REQUIRE(buffers[r][0] == 2);
  REQUIRE(ranks.comm.broadcasts_completed() == 1);
}

TEST_CASE("loopback: teardown after an abort with collectives still blocked", "[loopback]") {
  HostBackend backend;
  std::vector<std::uint8_t> b0(32, 1), b1(32, 0), b2(32, 0);  // outlive the streams
  auto s0 = backend.create_stream(StreamPriority::kLow);
  auto s1 = backend.create_stream(StreamPriority::kLow);
  auto e0 = backend.create_event();
  {
    auto comm = std::make_unique<LoopbackCommunicator>(3);
    auto t0 = comm->transport(0);
    auto t1 = comm->transport(1);
    auto t2 = comm->transport(2);
    t0->broadcast_async(b0.data(), 32, 0, *s0);
    t1->broadcast_async(b1.data(), 32, 0, *s1);
    backend.event_record(*e0, *s0);
    REQUIRE_FALSE(backend.event_wait_for(*e0, kShortWait));
    comm.reset();  // the communicator goes first; the transports keep the state alive
    t2->abort();
    // Transports die here while their tasks may still be unwinding on the streams.
  }
  REQUIRE(backend.event_wait_for(*e0, kDeadline));
  s0.reset();  // drain and join: must not hang
  s1.reset();
}

TEST_CASE("loopback: many broadcasts with random roots under jitter", "[loopback]") {
  HostBackendOptions options;
  options.max_task_jitter = 50us;
  options.jitter_seed = 99;
  constexpr int kWorld = 4, kCalls = 60;
  Ranks ranks(kWorld, options);
  std::mt19937 rng(2024);
  std::vector<std::vector<std::uint8_t*>> buffers(kCalls);
  std::vector<int> roots(kCalls);
  std::vector<std::size_t> sizes(kCalls);
  for (int c = 0; c < kCalls; ++c) {
    roots[c] = static_cast<int>(rng() % kWorld);
    sizes[c] = 1 + rng() % 5000;
    for (int r = 0; r < kWorld; ++r) buffers[c].push_back(ranks.buffer(sizes[c], 0));
    fill_pattern(buffers[c][roots[c]], sizes[c], c);
  }
  // All enqueued up front: the ranks' streams must pair call c with call c on every rank.
  for (int r = 0; r < kWorld; ++r) {
    for (int c = 0; c < kCalls; ++c) ranks.broadcast(r, buffers[c][r], sizes[c], roots[c]);
  }
  for (int r = 0; r < kWorld; ++r) REQUIRE(ranks.done(r, 30s));
  for (int c = 0; c < kCalls; ++c) {
    for (int r = 0; r < kWorld; ++r) {
      REQUIRE(same(buffers[c][r], buffers[c][roots[c]], sizes[c]));
    }
  }
  REQUIRE(ranks.comm.broadcasts_completed() == kCalls);
  for (int r = 0; r < kWorld; ++r) REQUIRE_FALSE(ranks.transports[r]->async_error());
}
