// Transport conformance suite. See transport_conformance.h.
#include "transport_conformance.h"

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "shadowsync/error.h"

namespace shadowsync::testing {

namespace {

using std::chrono::duration_cast;
using std::chrono::milliseconds;

long long to_ms(std::chrono::nanoseconds duration) {
  return static_cast<long long>(duration_cast<milliseconds>(duration).count());
}

void copy_and_wait(Backend& backend, int rank, void* dst, const void* src, std::size_t bytes,
                   Stream& stream, std::chrono::nanoseconds timeout, const char* what) {
  if (bytes == 0) return;
  auto done = backend.create_event();
  backend.memcpy_async(dst, src, bytes, stream);
  backend.event_record(*done, stream);
  if (!backend.event_wait_for(*done, timeout)) {
    throw std::runtime_error(fmt::format("rank {}: {} of {} bytes did not complete within {} ms",
                                         rank, what, bytes, to_ms(timeout)));
  }
}

// ---------------------------------------------------------------------------------------------
// Byte images. What the root sends, what every other rank holds before the broadcast, and the
// guard after each region are different functions, so that a broadcast that does nothing, lands
// at the wrong offset, pairs the wrong calls or writes past its end changes bytes we check.
// ---------------------------------------------------------------------------------------------

std::uint64_t mix64(std::uint64_t x) {  // splitmix64's finalizer
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

std::uint8_t sent_byte(std::uint64_t seed, std::size_t index) {
  return static_cast<std::uint8_t>(mix64(seed ^ mix64(index)) >> 56);
}

// XORed into what the root sends to make a receiver's stale contents: nonzero, so every stale
// byte differs from the byte that must replace it.
std::uint8_t stale_mask(int rank) { return static_cast<std::uint8_t>(0x80 | (rank * 37 & 0x7F)); }

// Differs per rank, so that a transport that copies the root's guard along is caught too.
std::uint8_t guard_byte(std::uint64_t seed, int rank, std::size_t index) {
  return sent_byte(mix64(seed ^ 0x6a09e667f3bcc909ull) + static_cast<std::uint64_t>(rank), index);
}

// Bytes after each region that no broadcast may touch.
constexpr std::size_t kGuardBytes = 256;

struct Region {
  std::size_t offset = 0;
  std::size_t bytes = 0;
  int root = 0;
  std::uint64_t seed = 0;
};

// Broadcast regions laid out back to back in one device buffer, each followed by its guard.
class Regions {
 public:
  Regions(const std::vector<std::size_t>& sizes, const std::vector<int>& roots,
          std::uint64_t seed) {
    std::size_t offset = 0;
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      regions_.push_back(Region{offset, sizes[k], roots[k], mix64(seed + k)});
      offset += sizes[k] + kGuardBytes;
    }
    total_ = offset;
  }

  const std::vector<Region>& all() const { return regions_; }
  std::size_t total() const { return total_; }

  // Rank `rank`'s buffer before the broadcasts (`landed` false) or after them (true).
  std::vector<std::uint8_t> image(int rank, bool landed) const {
    std::vector<std::uint8_t> bytes(total_);
    for (const Region& r : regions_) {
      const std::uint8_t mask = landed || rank == r.root ? 0 : stale_mask(rank);
      for (std::size_t i = 0; i < r.bytes; ++i) {
        bytes[r.offset + i] = static_cast<std::uint8_t>(sent_byte(r.seed, i) ^ mask);
      }
      for (std::size_t i = 0; i < kGuardBytes; ++i) {
        bytes[r.offset + r.bytes + i] = guard_byte(r.seed, rank, i);
      }
    }
    return bytes;
  }

 private:
  std::vector<Region> regions_;
  std::size_t total_ = 0;
};

std::string hex(std::uint8_t byte) { return fmt::format("0x{:02x}", byte); }

// "" when got[from, from + n) == want[from, from + n), else where and how they differ.
std::string compare(const std::vector<std::uint8_t>& got, const std::vector<std::uint8_t>& want,
                    std::size_t from, std::size_t n) {
  std::size_t differing = 0;
  std::size_t first = 0;
  for (std::size_t i = from; i < from + n; ++i) {
    if (got[i] != want[i] && differing++ == 0) first = i;
  }
  if (differing == 0) return {};
  return fmt::format("{} of {} bytes differ, the first at +{}: {}, want {}", differing, n,
                     first - from, hex(got[first]), hex(want[first]));
}

// ---------------------------------------------------------------------------------------------
// Running a case: shared state, per-rank resources and the rank threads' view of them.
// ---------------------------------------------------------------------------------------------

// Thrown out of a wait on a signal once another rank failed: that rank reports the failure, and
// this one stops without adding noise.
struct Cancelled {};

// Owned by the case, not by the rank threads, so that a rank thread that fails cannot free memory
// a stream may still write: the runner aborts the transports and drains the streams first.
struct RankResources {
  std::deque<std::vector<std::uint8_t>> host;  // copy staging, read or written by the stream
  std::deque<DeviceBuffer> buffers;
  std::deque<std::unique_ptr<Event>> events;
  std::unique_ptr<Stream> stream;  // declared last: destroyed (and drained) first
};

class CaseState {
 public:
  CaseState(TransportFixture& fixture, const ConformanceOptions& options, std::string name)
      : fixture(fixture), options(options), ranks(static_cast<std::size_t>(fixture.world_size())) {
    result_.name = std::move(name);
  }

  TransportFixture& fixture;
  const ConformanceOptions& options;
  std::vector<RankResources> ranks;

  // Records a failure of `rank` (-1: the runner). The first failure aborts every transport, so
  // that no stream stays blocked in a collective that will not complete, and cancels the waits.
  // Thread-safe.
  void fail(int rank, const std::string& message) {
    bool first = false;
    {
      std::lock_guard lock(mutex_);
      const std::string who = rank >= 0 ? fmt::format("rank {}: ", rank) : std::string();
      result_.failures.push_back(
          failed_ ? fmt::format("{}(after the first failure) {}", who, message) : who + message);
      first = !failed_;
      failed_ = true;
    }
    changed_.notify_all();
    if (first) abort_all();
  }

  void note(int rank, const std::string& message) {
    std::lock_guard lock(mutex_);
    result_.notes.push_back(fmt::format("rank {}: {}", rank, message));
  }

  bool failed() const {
    std::lock_guard lock(mutex_);
    return failed_;
  }

  void abort_all() noexcept {
    for (int r = 0; r < fixture.world_size(); ++r) fixture.transport(r).abort();
  }

  // Signals: named counters that rank threads bump and wait on (a latch with a deadline and a
  // way out when another rank failed).
  void arrive(const std::string& signal) {
    {
      std::lock_guard lock(mutex_);
      ++signals_[signal];
    }
    changed_.notify_all();
  }

  void wait_for(const std::string& signal, int count, const std::string& what) {
    std::unique_lock lock(mutex_);
    const bool reached = changed_.wait_for(lock, options.deadline,
                                           [&] { return failed_ || signals_[signal] >= count; });
    if (failed_) throw Cancelled{};
    if (!reached) {
      throw std::runtime_error(fmt::format("timed out after {} ms waiting for {} ({} of {})",
                                           options.deadline.count(), what, signals_[signal],
                                           count));
    }
  }

  // How often `signal` arrived so far; does not wait.
  int arrivals(const std::string& signal) {
    std::lock_guard lock(mutex_);
    return signals_[signal];
  }

  ConformanceResult result() const {
    std::lock_guard lock(mutex_);
    return result_;
  }

 private:
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::string, int> signals_;
  bool failed_ = false;
  ConformanceResult result_;
};

// A rank thread's view of the case. Everything but transport_of() is for that rank's own thread.
class RankContext {
 public:
  RankContext(CaseState& state, int rank)
      : state_(state), rank_(rank), resources_(state.ranks[static_cast<std::size_t>(rank)]) {}

  int rank() const { return rank_; }
  int world_size() const { return state_.fixture.world_size(); }
  Backend& backend() { return state_.fixture.backend(rank_); }
  Transport& transport() { return state_.fixture.transport(rank_); }
  Transport& transport_of(int rank) { return state_.fixture.transport(rank); }
  Stream& stream() { return *resources_.stream; }
  const ConformanceOptions& options() const { return state_.options; }

  void check(bool condition, const std::string& message) {
    if (!condition) throw std::runtime_error(message);
  }
  void note(const std::string& message) { state_.note(rank_, message); }
  void arrive(const std::string& signal) { state_.arrive(signal); }
  void wait_for(const std::string& signal, int count, const std::string& what) {
    state_.wait_for(signal, count, what);
  }
  int arrivals(const std::string& signal) { return state_.arrivals(signal); }
  bool receive_blocks_caller() const {
    return state_.fixture.capabilities().receive_blocks_caller;
  }

  std::byte* allocate(std::size_t bytes) {
    return resources_.buffers.emplace_back(backend(), bytes).data();
  }
  Event& new_event() { return *resources_.events.emplace_back(backend().create_event()); }

  void upload(std::byte* device, std::vector<std::uint8_t> image) {
    const auto& host = resources_.host.emplace_back(std::move(image));
    state_.fixture.upload(rank_, device, host.data(), host.size(), stream(),
                          state_.options.deadline);
  }
  const std::vector<std::uint8_t>& download(const std::byte* device, std::size_t bytes) {
    auto& host = resources_.host.emplace_back(bytes);
    state_.fixture.download(rank_, host.data(), device, bytes, stream(), state_.options.deadline);
    return host;
  }

  // A device buffer holding this rank's image of `regions` before the broadcasts.
  std::byte* prepare(const Regions& regions) {
    std::byte* buffer = allocate(regions.total());
    upload(buffer, regions.image(rank_, /*landed=*/false));
    return buffer;
  }

  void broadcast(std::byte* buffer, const Region& region) {
    transport().broadcast_async(buffer + region.offset, region.bytes, region.root, stream());
  }

  // Records an event behind everything enqueued on this rank's stream so far.
  Event& record() {
    Event& event = new_event();
    backend().event_record(event, stream());
    return event;
  }

  void expect_complete(Event& event, const std::string& what) {
    check(backend().event_wait_for(event, state_.options.deadline),
          fmt::format("{} did not complete within {} ms", what, state_.options.deadline.count()));
  }

  void expect_healthy(const std::string& when) {
    const std::optional<std::string> error = transport().async_error();
    check(!error, fmt::format("async_error() {} is \"{}\", want none", when, error.value_or("")));
  }

  // Reads the buffer back and checks every region and guard.
  void verify(const std::byte* buffer, const Regions& regions, const std::string& what) {
    const std::vector<std::uint8_t>& got = download(buffer, regions.total());
    const std::vector<std::uint8_t> want = regions.image(rank_, /*landed=*/true);
    const auto& all = regions.all();
    for (std::size_t k = 0; k < all.size(); ++k) {
      const Region& r = all[k];
      const std::string where =
          all.size() == 1 ? std::string()
                          : fmt::format(" (broadcast {} of {}: {} bytes at offset {}, root {})", k,
                                        all.size(), r.bytes, r.offset, r.root);
      const std::string body = compare(got, want, r.offset, r.bytes);
      check(body.empty(),
            fmt::format(
                "{}{}: {} {}", what, where,
                rank_ == r.root ? "the root's own buffer changed:" : "wrong bytes landed:", body));
      const std::string guard = compare(got, want, r.offset + r.bytes, kGuardBytes);
      check(guard.empty(), fmt::format("{}{}: wrote past its {} bytes into the guard after it: {}",
                                       what, where, r.bytes, guard));
    }
  }

 private:
  CaseState& state_;
  const int rank_;
  RankResources& resources_;
};

// ---------------------------------------------------------------------------------------------
// The cases. Each runs on every rank's thread; ranks differ only through rank().
// ---------------------------------------------------------------------------------------------

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kWarmUpBytes = 4097;

std::string describe_broadcast(std::size_t bytes, int root) {
  return fmt::format("broadcast of {} bytes from root {}", bytes, root);
}

// A healthy transport knows who it is.
void case_rank_and_world_size(RankContext& c) {
  Transport& t = c.transport();
  c.check(t.rank() == c.rank(), fmt::format("rank() is {}, want {}", t.rank(), c.rank()));
  c.check(t.world_size() == c.world_size(),
          fmt::format("world_size() is {}, want {}", t.world_size(), c.world_size()));
  c.check(!t.name().empty(), "name() is empty");
  c.expect_healthy("of a healthy transport");
}

// One broadcast at a time from root 0: a single byte, a size that is no multiple of anything,
// and a large one.
void case_root0_sizes(RankContext& c) {
  const std::size_t sizes[] = {1, 4097, kMiB};
  std::uint64_t seed = 100;
  for (const std::size_t bytes : sizes) {
    const Regions regions({bytes}, {0}, seed++);
    std::byte* buffer = c.prepare(regions);
    c.broadcast(buffer, regions.all()[0]);
    c.expect_complete(c.record(), describe_broadcast(bytes, 0));
    c.verify(buffer, regions, describe_broadcast(bytes, 0));
  }
  c.expect_healthy("after the broadcasts");
}

// Eight broadcasts of different sizes into one buffer, enqueued back to back and waited for
// once: the n-th call of every rank must meet the n-th call of the others.
const std::vector<std::size_t> kBatchSizes = {4097, 1, 65536, 3, kMiB, 255, 12345, 2};

void run_batch(RankContext& c, const std::vector<int>& roots, std::uint64_t seed, bool grouped) {
  const Regions regions(kBatchSizes, roots, seed);
  std::byte* buffer = c.prepare(regions);
  if (grouped) {
    c.transport().group_begin();
    try {
      for (const Region& r : regions.all()) c.broadcast(buffer, r);
    } catch (...) {
      // Owed even after a failed broadcast (NCCL's group state is per thread).
      try {
        c.transport().group_end();
      } catch (...) {
      }
      throw;
    }
    c.transport().group_end();
  } else {
    for (const Region& r : regions.all()) c.broadcast(buffer, r);
  }
  const std::string what =
      fmt::format("a {}batch of {} broadcasts", grouped ? "grouped " : "", kBatchSizes.size());
  c.expect_complete(c.record(), what);
  c.verify(buffer, regions, what);
  c.expect_healthy(fmt::format("after {}", what));
}

void case_batch(RankContext& c) {
  run_batch(c, std::vector<int>(kBatchSizes.size(), 0), 200, /*grouped=*/false);
}

// The same between group_begin() and group_end(), every broadcast from root 0: what a
// transport with one fixed sender must do when the sender brackets its buckets as one launch.
void case_grouped_batch_root0(RankContext& c) {
  run_batch(c, std::vector<int>(kBatchSizes.size(), 0), 250, /*grouped=*/true);
}

// The same between group_begin() and group_end(), with the root changing from call to call.
void case_grouped_batch(RankContext& c) {
  std::vector<int> roots;
  for (std::size_t k = 0; k < kBatchSizes.size(); ++k) {
    roots.push_back(static_cast<int>(k % static_cast<std::size_t>(c.world_size())));
  }
  run_batch(c, roots, 300, /*grouped=*/true);
}

// The last rank as the root.
void case_last_rank_root(RankContext& c) {
  const int root = c.world_size() - 1;
  const Regions regions({4097, kMiB + 3}, {root, root}, 400);
  std::byte* buffer = c.prepare(regions);
  for (const Region& r : regions.all()) c.broadcast(buffer, r);
  c.expect_complete(c.record(), fmt::format("two broadcasts from root {}", root));
  c.verify(buffer, regions, fmt::format("two broadcasts from root {}", root));
  c.expect_healthy("after the broadcasts");
}

// One broadcast from root 0 on every rank, waited for and checked. NCCL connects a
// communicator's peers during its first collective, inside the enqueueing call of every rank, so
// a case that holds one rank back first lets this one connect them.
void warm_up(RankContext& c, std::uint64_t seed) {
  const Regions regions({kWarmUpBytes}, {0}, seed);
  std::byte* buffer = c.prepare(regions);
  c.broadcast(buffer, regions.all()[0]);
  c.expect_complete(c.record(), "the warm-up broadcast");
  c.verify(buffer, regions, "the warm-up broadcast");
}

// Collective semantics: a receiver's stream cannot get past the broadcast before the root has
// joined. The root is held back until every other rank has enqueued its broadcast and seen the
// event behind it incomplete; only then does it call broadcast_async.
void case_waits_for_root(RankContext& c) {
  warm_up(c, 500);
  constexpr int kRoot = 0;
  const Regions regions({kWarmUpBytes}, {kRoot}, 501);
  std::byte* buffer = c.prepare(regions);
  const std::string what = describe_broadcast(kWarmUpBytes, kRoot);
  if (c.receive_blocks_caller()) {
    // The receiver's call itself waits for the root: it must not return before the root called.
    if (c.rank() != kRoot) {
      c.arrive("receivers calling");
      c.broadcast(buffer, regions.all()[0]);
      c.check(c.arrivals("root calling") == 1,
              fmt::format("a receiver's broadcast_async of the {} returned before the root "
                          "called broadcast_async (TransportCapabilities::receive_blocks_caller "
                          "says it waits for the root's data)",
                          what));
      c.expect_complete(c.record(), fmt::format("the {} after the root joined", what));
    } else {
      c.wait_for("receivers calling", c.world_size() - 1,
                 "every other rank to be about to call broadcast_async");
      c.arrive("root calling");
      c.broadcast(buffer, regions.all()[0]);
      c.expect_complete(c.record(), what);
    }
    c.verify(buffer, regions, what);
    c.expect_healthy("after the broadcast");
    return;
  }
  if (c.rank() != kRoot) {
    c.broadcast(buffer, regions.all()[0]);
    Event& behind = c.record();
    c.check(!c.backend().event_query(behind),
            fmt::format("an event recorded after the {} completed at once, before the root "
                        "called broadcast_async",
                        what));
    c.check(!c.backend().event_wait_for(behind, c.options().not_complete_wait),
            fmt::format("an event recorded after the {} completed within {} ms, before the root "
                        "called broadcast_async",
                        what, c.options().not_complete_wait.count()));
    c.arrive("receivers enqueued");
    c.expect_complete(behind, fmt::format("the {} after the root joined", what));
  } else {
    // Times out (loudly) if a receiver's broadcast_async itself waits for the root.
    c.wait_for("receivers enqueued", c.world_size() - 1,
               "every other rank to return from broadcast_async and find it incomplete");
    c.broadcast(buffer, regions.all()[0]);
    c.expect_complete(c.record(), what);
  }
  c.verify(buffer, regions, what);
  c.expect_healthy("after the broadcast");
}

// async_error() is empty until abort(); afterwards it says so, and a broadcast enqueued on the
// aborted rank does not hang its stream: either broadcast_async throws Error (NCCL) or the
// stream completes the broadcast with the error reported (loopback).
void case_abort_then_broadcast(RankContext& c) {
  c.expect_healthy("before any abort");
  const int victim = c.world_size() - 1;
  const Regions regions({kWarmUpBytes}, {0}, 600);
  std::byte* buffer = c.prepare(regions);
  // The loopback transport's abort reaches every rank: check all of them before it happens.
  c.arrive("checked healthy");
  c.wait_for("checked healthy", c.world_size(), "every rank to check async_error()");
  if (c.rank() != victim) return;

  Transport& t = c.transport();
  t.abort();
  t.abort();  // idempotent
  const std::optional<std::string> error = t.async_error();
  c.check(error.has_value() && !error->empty(),
          "async_error() is empty after abort(), want a message saying the transport aborted");

  const std::string what = describe_broadcast(kWarmUpBytes, 0) + " enqueued after abort()";
  try {
    c.broadcast(buffer, regions.all()[0]);
  } catch (const Error& e) {
    c.note(fmt::format("{}: broadcast_async threw Error({}): {}", what, to_string(e.code()),
                       e.what()));
    c.check(t.async_error().has_value(), "async_error() was cleared by a refused broadcast");
    return;
  }
  c.expect_complete(c.record(), what);
  c.check(t.async_error().has_value(), fmt::format("async_error() is empty after the {}", what));
  c.note(fmt::format("{}: accepted; the stream completed it and async_error() reports \"{}\"", what,
                     t.async_error().value_or("")));
}

// abort() from another thread releases a broadcast blocked on a root that never comes (the
// receiver's deadline path): the stream moves on and the aborted rank reports it.
void case_abort_releases_blocked(RankContext& c) {
  warm_up(c, 700);
  constexpr int kAbsentRoot = 0;
  const int victim = c.world_size() - 1;
  if (c.rank() == victim && c.receive_blocks_caller()) {
    // The call itself blocks on the absent root: the abort ends it (or, when it comes first,
    // the call enqueues nothing), and what the stream holds then completes.
    const Regions regions({kWarmUpBytes}, {kAbsentRoot}, 701);
    std::byte* buffer = c.prepare(regions);
    c.arrive("victim blocked");
    c.broadcast(buffer, regions.all()[0]);
    c.expect_complete(c.record(), fmt::format("a broadcast blocked on absent root {}, after "
                                              "rank {} aborted this rank's transport",
                                              kAbsentRoot, kAbsentRoot));
    c.check(c.transport().async_error().has_value(),
            "async_error() is empty after another thread aborted the transport");
  } else if (c.rank() == victim) {
    const Regions regions({kWarmUpBytes}, {kAbsentRoot}, 701);
    std::byte* buffer = c.prepare(regions);
    c.broadcast(buffer, regions.all()[0]);
    Event& behind = c.record();
    c.check(!c.backend().event_query(behind),
            "a broadcast from a root that never calls completed at once");
    c.arrive("victim blocked");
    c.expect_complete(behind, fmt::format("a broadcast blocked on absent root {}, after rank {} "
                                          "aborted this rank's transport",
                                          kAbsentRoot, kAbsentRoot));
    c.check(c.transport().async_error().has_value(),
            "async_error() is empty after another thread aborted the transport");
  } else if (c.rank() == kAbsentRoot) {
    c.wait_for("victim blocked", 1, fmt::format("rank {} to enqueue its broadcast", victim));
    c.transport_of(victim).abort();  // Thread-safe by contract.
  }
}

struct CaseDef {
  const char* name;
  void (*body)(RankContext&);
  bool aborts;          // leaves a transport aborted: the fixture is reconnected afterwards
  bool needs_any_root;  // broadcasts from a root other than 0 (TransportCapabilities)
};

const CaseDef kCases[] = {
    {"reports rank and world size", case_rank_and_world_size, false, false},
    {"broadcast from root 0 of 1 B, 4097 B and 1 MiB", case_root0_sizes, false, false},
    {"batch of 8 broadcasts lands in order", case_batch, false, false},
    {"grouped batch of 8 broadcasts from root 0", case_grouped_batch_root0, false, false},
    {"grouped batch of 8 broadcasts with changing roots", case_grouped_batch, false, true},
    {"broadcast from the last rank", case_last_rank_root, false, true},
    {"receivers wait for the root", case_waits_for_root, false, false},
    {"abort sets async_error and never hangs a later broadcast", case_abort_then_broadcast, true,
     false},
    {"abort from another thread releases a blocked broadcast", case_abort_releases_blocked, true,
     false},
};

// Why `fixture` cannot run `def`, or nullopt when it can.
std::optional<std::string> skip_reason(const TransportFixture& fixture, const CaseDef& def) {
  const TransportCapabilities capabilities = fixture.capabilities();
  if (def.needs_any_root && !capabilities.any_rank_as_root) {
    return fmt::format(
        "needs a root other than rank 0; {} sends only from rank 0 "
        "(TransportCapabilities::any_rank_as_root is false)",
        fixture.name());
  }
  return std::nullopt;
}

// Every stream idle: an event behind its work completes. False when one is still busy.
bool drain(CaseState& state, bool aborted) {
  bool idle = true;
  for (int r = 0; r < state.fixture.world_size(); ++r) {
    RankResources& res = state.ranks[static_cast<std::size_t>(r)];
    if (!res.stream) continue;
    try {
      Backend& backend = state.fixture.backend(r);
      auto done = backend.create_event();
      backend.event_record(*done, *res.stream);
      if (!backend.event_wait_for(*done, state.options.deadline)) {
        state.fail(-1, fmt::format("rank {}'s stream was still busy {} ms after the case ended "
                                   "(transports aborted: {}); leaking its memory",
                                   r, state.options.deadline.count(), aborted ? "yes" : "no"));
        idle = false;
      }
    } catch (const std::exception& e) {
      state.fail(-1, fmt::format("rank {}: draining its stream threw: {}", r, e.what()));
      idle = false;
    }
  }
  return idle;
}

}  // namespace

// ---------------------------------------------------------------------------------------------

void TransportFixture::upload(int rank, void* device_dst, const void* host_src, std::size_t bytes,
                              Stream& stream, std::chrono::nanoseconds timeout) {
  copy_and_wait(backend(rank), rank, device_dst, host_src, bytes, stream, timeout,
                "the host-to-device copy");
}

void TransportFixture::download(int rank, void* host_dst, const void* device_src, std::size_t bytes,
                                Stream& stream, std::chrono::nanoseconds timeout) {
  copy_and_wait(backend(rank), rank, host_dst, device_src, bytes, stream, timeout,
                "the device-to-host copy");
}

std::vector<std::string> conformance_case_names() {
  std::vector<std::string> names;
  for (const CaseDef& def : kCases) names.emplace_back(def.name);
  return names;
}

ConformanceResult run_conformance_case(TransportFixture& fixture, const std::string& name,
                                       const ConformanceOptions& options) {
  const auto* def = std::find_if(std::begin(kCases), std::end(kCases),
                                 [&](const CaseDef& d) { return name == d.name; });
  if (def == std::end(kCases)) {
    throw std::invalid_argument(fmt::format("no transport conformance case named \"{}\"", name));
  }
  if (std::optional<std::string> reason = skip_reason(fixture, *def)) {
    ConformanceResult skipped;
    skipped.name = name;
    skipped.skipped = std::move(reason);
    return skipped;
  }
  const int world_size = fixture.world_size();
  auto state = std::make_unique<CaseState>(fixture, options, name);

  // Streams are made here, not by the rank threads, for the reason RankResources gives.
  try {
    for (int r = 0; r < world_size; ++r) {
      state->ranks[static_cast<std::size_t>(r)].stream =
          fixture.backend(r).create_stream(StreamPriority::kLow);  // as the receiver's stream
    }
  } catch (const std::exception& e) {
    state->fail(-1, fmt::format("creating the ranks' streams threw: {}", e.what()));
  }

  if (!state->failed()) {
    std::vector<std::thread> threads;
    threads.reserve(static_cast<std::size_t>(world_size));
    for (int r = 0; r < world_size; ++r) {
      threads.emplace_back([&state, def, r] {
        RankContext context(*state, r);
        try {
          def->body(context);
        } catch (const Cancelled&) {
        } catch (const std::exception& e) {
          state->fail(r, e.what());
        } catch (...) {
          state->fail(r, "threw something that is not a std::exception");
        }
      });
    }
    for (std::thread& t : threads) t.join();
  }

  const bool reconnect = def->aborts || state->failed();
  if (reconnect) state->abort_all();
  const bool idle = drain(*state, reconnect);
  ConformanceResult result = state->result();
  if (idle) {
    state.reset();  // streams first (see RankResources), then buffers and staging
  } else {
    // A stream may still write into these buffers: leak them rather than free memory in use.
    (void)state.release();
  }
  if (reconnect) {
    try {
      fixture.reconnect();
    } catch (const std::exception& e) {
      result.failures.push_back(fmt::format("reconnect() after the case threw: {}", e.what()));
    }
  }
  return result;
}

std::vector<ConformanceResult> run_transport_conformance(TransportFixture& fixture,
                                                         const ConformanceOptions& options) {
  std::vector<ConformanceResult> results;
  for (const CaseDef& def : kCases)
    results.push_back(run_conformance_case(fixture, def.name, options));
  return results;
}

std::vector<std::string> conformance_cases_skipped_on(const TransportFixture& fixture) {
  std::vector<std::string> names;
  for (const CaseDef& def : kCases) {
    if (skip_reason(fixture, def)) names.emplace_back(def.name);
  }
  return names;
}

std::vector<std::string> conformance_failures(const std::vector<ConformanceResult>& results) {
  std::vector<std::string> failures;
  for (const ConformanceResult& result : results) {
    for (const std::string& failure : result.failures) {
      failures.push_back(fmt::format("{}: {}", result.name, failure));
    }
  }
  return failures;
}

}  // namespace shadowsync::testing
