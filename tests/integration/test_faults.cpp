// Faults from the trainer's side: a sender that dies or stalls mid-update, bytes corrupted in
// transit, weights with a NaN in them. Each time the engine keeps stepping on what it has, its live
// bytes stay bit-for-bit what they were, the failure is reported with where it happened, and the
// next good update applies. (Shutdown and leaks: test_shutdown.cpp; rollback:
// test_rollback.cpp.)
//
// How each test was checked to fail without its behaviour: the mutations named above each test
// (patches under tests/mutations/, applied by scripts/mutation_check.sh) take the behaviour out;
// each was built and the test failed. The drop and delay cases are invariant 6's (mutation 6 offers
// the failed update: the engine swaps and the hash changes).
#include <catch2/catch.hpp>

#include <cstring>
#include <functional>
#include <optional>

#include <fmt/format.h>

#include "deadline.h"
#include "live_hash.h"
#include "loopback_rig.h"
#include "pattern.h"
#include "shadowsync/error.h"
#include "shadowsync/loopback_transport.h"
#include "watchdog.h"

using namespace shadowsync;
using namespace shadowsync::testing;

namespace {

using namespace std::chrono_literals;

// Every floating dtype the non-finite guard checks, odd sizes, several buckets, an adapter.
Layout fault_layout() {
  return Layout::build({{"w0", DType::kFloat32, {700}, "base"},
                        {"w1", DType::kBFloat16, {33, 17}, "base"},
                        {"w2", DType::kInt8, {999}, "base"},
                        {"w3", DType::kFloat16, {301}, "base"},
                        {"a.A", DType::kBFloat16, {64}, "lora_a"},
                        {"a.B", DType::kFloat32, {64}, "lora_a"}},
                       {.bucket_bytes = 1024});
}

const std::vector<std::string> kAllGroups = {"base", "lora_a"};

// Version 1 applied and read by the engine; then `fault` sends (or begins) update 2, which must be
// refused while the engine keeps stepping on version 1; then update 3 must apply. Returns the
// failure report of update 2.
struct FaultRun {
  LoopbackRig rig;
  HostFakeEngine engine;
  std::uint64_t hash_v1 = 0;

  FaultRun(const Layout& layout, const RigOptions& options)
      : rig(layout, options), engine(rig.backend(), rig.receiver(), {.full_check_every = 1}) {
    rig.publish(1, kAllGroups).wait();
    REQUIRE(rig.receiver().step_hook().wait_applied(1, deadline_from_now(), engine.stream()));
    engine.step();
    engine.synchronize();
    hash_v1 = live_hash(rig.receiver());
  }

  std::optional<UpdateReport> failure_report() const {
    for (const UpdateReport& report : rig.reports()) {
      if (report.outcome == UpdateOutcome::kFailed) return report;
    }
    return std::nullopt;
  }

  UpdateReport refused(const std::function<void()>& fault) {
    fault();
    const auto deadline = deadline_from_now();
    // The report itself, not the stats: the receiver counts a failure before it tells observers.
    while (!failure_report()) {
      REQUIRE(std::chrono::steady_clock::now() < deadline);
      const auto swapped = engine.step();  // generation goes on, on version 1
      INFO("swapped to " << swapped.value_or(0) << "; " << rig.receiver().stats().last_error);
      REQUIRE_FALSE(swapped.has_value());
      engine.synchronize();
    }
    for (int i = 0; i < 3; ++i) CHECK_FALSE(engine.step().has_value());
    engine.synchronize();
    CHECK(live_hash(rig.receiver()) == hash_v1);  // bit for bit
    CHECK(rig.receiver().step_hook().applied_version() == 1);
    CHECK(rig.receiver().stats().updates_failed == 1);
    return *failure_report();
  }

  // The next good update applies (after a new rendezvous if the failure aborted the transport).
  void next_update_applies() {
    if (rig.receiver().stats().needs_transport) rig.reconnect();
    rig.publish(3, kAllGroups).wait();
    REQUIRE(rig.receiver().step_hook().wait_applied(3, deadline_from_now(), engine.stream()));
    engine.step();
    engine.synchronize();
    INFO(engine.first_torn());
    CHECK(engine.torn_steps() == 0);
    CHECK(rig.history().check(engine.records()) == "");
    CHECK(rig.receiver().step_hook().live_content_version(0) == 3);
  }
};

}  // namespace

TEST_CASE("faults: the sender dies after k of n buckets; nothing changes, the next update applies") {
  const Layout layout = fault_layout();
  // Broadcasts per update: the buckets and the checksum block (checksums are on by default).
  const std::uint64_t n = make_update_header(layout, 1, kAllGroups, true).bucket_count;
  const std::uint64_t k = GENERATE_COPY(std::uint64_t{0}, std::uint64_t{1}, n - 1);
  CAPTURE(k, n);
  RigOptions options;
  options.receiver.bucket_deadline = 200ms;
  options.sender.update_deadline = 2000ms;
  FaultRun run(layout, options);
  REQUIRE(run.rig.broadcasts_per_update(kAllGroups) == n);
  std::optional<PublishHandle> second;
  const UpdateReport report = run.refused([&] {
    // The sender's broadcast calls count from its first update, which made n of them.
    run.rig.communicator().inject_drop(0, n + k);
    second = run.rig.publish(2, kAllGroups);
  });
  CHECK(report.version == 2);
  // Whichever notices first: the receiver's bucket deadline, or the sender seeing its own rank
  // fail and aborting the communicator.
  INFO(report.error);
  CHECK((report.code == ErrorCode::kTimeout || report.code == ErrorCode::kTransport));
  if (report.code == ErrorCode::kTimeout) {
    CHECK_THAT(report.error, Catch::Contains(fmt::format("bucket {} of {} did not complete", k, n)));
  }
  CHECK(run.rig.receiver().stats().needs_transport);
  CHECK_THROWS_AS(second->wait(), Error);
  run.next_update_applies();
}

TEST_CASE("faults: a bucket delayed past its deadline aborts the update; the next one applies") {
  const Layout layout = fault_layout();
  RigOptions options;
  options.receiver.bucket_deadline = 100ms;
  options.sender.update_deadline = 5000ms;
  FaultRun run(layout, options);
  const std::uint64_t n = run.rig.broadcasts_per_update(kAllGroups);
  const UpdateReport report = run.refused([&] {
    // Bucket 2 of update 2 leaves the sender 10 s late (the abort cuts the delay short).
    run.rig.communicator().inject_delay(0, n + 2, 10s);
    run.rig.publish(2, kAllGroups);
  });
  CHECK(report.code == ErrorCode::kTimeout);
  CHECK_THAT(report.error, Catch::Contains(fmt::format("bucket 2 of {} did not complete within its "
                                                       "deadline of 100 ms",
                                                       n)));
  run.next_update_applies();
}

// Mutation 8 (08-skip-checksum-verify.patch) makes this fail: the corrupted update is offered and
// applied.
TEST_CASE("faults: flipped bytes with checksums on are refused, naming the bucket") {
  const Layout layout = fault_layout();
  const UpdateHeader header = make_update_header(layout, 1, kAllGroups, /*checksums=*/true);
  const std::uint64_t calls = header.bucket_count;  // data buckets + the checksum block
  const std::uint64_t base_buckets = layout.groups()[0].bucket_count();
  // Which broadcast of update 2 is corrupted on the receiver's rank: a base bucket, the adapter's
  // bucket, or the checksum block itself.
  const std::uint64_t call = GENERATE_COPY(std::uint64_t{0}, base_buckets - 1, base_buckets,
                                           calls - 1);
  CAPTURE(call, calls);
  RigOptions options;
  options.sender.checksums = true;
  options.receiver.require_checksums = true;
  FaultRun run(layout, options);
  std::optional<PublishHandle> second;
  const UpdateReport report = run.refused([&] {
    // Byte 100 of a bucket; byte 3 of the block (it holds 8 bytes per bucket).
    run.rig.communicator().inject_flip(1, calls + call, call == calls - 1 ? 3 : 100);
    second = run.rig.publish(2, kAllGroups);
  });
  CHECK(report.code == ErrorCode::kTransport);
  CHECK_THAT(report.error, Catch::Contains("corrupted in transit"));
  // A flip in the block corrupts the sender's checksum of data bucket 0.
  const std::uint64_t bucket = call == calls - 1 ? 0 : call;
  const bool in_base = bucket < base_buckets;
  CHECK(report.failed_group == (in_base ? "base" : "lora_a"));
  REQUIRE(report.failed_bucket.has_value());
  CHECK(*report.failed_bucket == (in_base ? bucket : bucket - base_buckets));
  CHECK(report.failed_tensor.empty());
  // The collectives all completed: the sender succeeded and the transport needs no rendezvous.
  CHECK_NOTHROW(second->wait());
  CHECK_FALSE(run.rig.receiver().stats().needs_transport);
  run.next_update_applies();
}

// Mutation 9 (09-skip-nonfinite-guard.patch) makes this fail: the update with the NaN is applied.
TEST_CASE("faults: a NaN or infinity in one tensor with the guard on is refused, naming it") {
  const Layout layout = fault_layout();
  struct Poison {
    const char* tensor;
    std::size_t index;       // in the update's SourceTensor list
    std::size_t element;
    std::uint32_t bits;      // fp32: 4 bytes; fp16/bf16: the low 2
  };
  const Poison poison = GENERATE(Poison{"w0", 0, 699, 0x7fc00000u},  // fp32 NaN, last element
                                 Poison{"w1", 1, 17, 0x7f80u},       // bf16 +inf
                                 Poison{"w3", 3, 0, 0xfc00u},        // fp16 -inf
                                 Poison{"a.A", 4, 63, 0xffc1u});     // bf16 NaN (negative)
  CAPTURE(poison.tensor, poison.element);
  RigOptions options;
  options.receiver.reject_nonfinite = true;
  FaultRun run(layout, options);

  HostTensors tensors(layout, kAllGroups, 2);
  std::vector<SourceTensor> sources = tensors.sources();
  REQUIRE(sources[poison.index].name == poison.tensor);
  const std::size_t element_bytes = dtype_size(sources[poison.index].dtype);
  std::size_t bytes = element_bytes;
  for (const std::int64_t extent : sources[poison.index].shape) bytes *= extent;
  std::vector<std::byte> poisoned(bytes);
  std::memcpy(poisoned.data(), sources[poison.index].data, bytes);
  std::memcpy(poisoned.data() + poison.element * element_bytes, &poison.bits, element_bytes);
  sources[poison.index].data = poisoned.data();

  std::optional<PublishHandle> second;
  const UpdateReport report = run.refused([&] {
    second = run.rig.sender().publish(2, kAllGroups, sources);
    run.rig.receiver().begin_update(second->header());
  });
  CHECK(report.code == ErrorCode::kInvalidArgument);
  CHECK(report.failed_tensor == poison.tensor);
  CHECK(report.failed_group == (std::string(poison.tensor) == "a.A" ? "lora_a" : "base"));
  CHECK_THAT(report.error, Catch::Contains(fmt::format("tensor '{}'", poison.tensor)) &&
                               Catch::Contains("holds 1 NaN or infinite values"));
  CHECK_NOTHROW(second->wait());
  CHECK_FALSE(run.rig.receiver().stats().needs_transport);
  run.next_update_applies();
}

TEST_CASE("faults: with checksums and the guard on, good updates of every kind apply") {
  const Layout layout = fault_layout();
  RigOptions options;
  options.sender.checksums = true;
  options.receiver.require_checksums = true;
  options.receiver.reject_nonfinite = true;
  LoopbackRig rig(layout, options);
  HostFakeEngine engine(rig.backend(), rig.receiver(), {.full_check_every = 1});
  for (std::uint64_t v = 1; v <= 6; ++v) {
    rig.publish(v, v % 3 == 0 ? std::vector<std::string>{"lora_a"} : kAllGroups).wait();
    REQUIRE(rig.receiver().step_hook().wait_applied(v, deadline_from_now(), engine.stream()));
    engine.step();
  }
  // Straight from an arena too (the checksums are computed from it, not from staging).
  DeviceBuffer arena(rig.backend(), layout.groups()[0].arena_bytes());
  fill_arena(layout, 0, 7, arena.data());
  PublishHandle handle = rig.sender().publish_arenas(7, {"base"}, {arena.data()});
  rig.receiver().begin_update(handle.header());
  handle.wait();
  REQUIRE(rig.receiver().step_hook().wait_applied(7, deadline_from_now(), engine.stream()));
  engine.step();
  engine.synchronize();
  CHECK(rig.receiver().stats().updates_failed == 0);
  CHECK(engine.torn_steps() == 0);
  CHECK(std::memcmp(rig.receiver().step_hook().live_arena(0), arena.data(),
                    layout.groups()[0].arena_bytes()) == 0);
}

TEST_CASE("faults: checksum settings that cannot work are refused with both sides named") {
  const Layout layout = fault_layout();
  RigOptions options;
  options.receiver.require_checksums = true;  // the sender sends none
  LoopbackRig rig(layout, options);
  const UpdateHeader plain = make_update_header(layout, 1, kAllGroups);
  CHECK_THROWS_WITH(rig.receiver().begin_update(plain),
                    Catch::Contains("update 1: carries no checksums") &&
                        Catch::Contains("ReceiverConfig::require_checksums"));
  CHECK(rig.receiver().stats().last_accepted_version == 0);  // nothing changed
  // A receiver that does not require checksums still verifies those it is sent.
  RigOptions sending;
  sending.sender.checksums = true;
  LoopbackRig relaxed(layout, sending);
  HostFakeEngine engine(relaxed.backend(), relaxed.receiver());
  relaxed.publish(1, kAllGroups).wait();
  CHECK(relaxed.receiver().step_hook().wait_applied(1, deadline_from_now(), engine.stream()));
}

namespace {

// A transport whose `throw_at`-th broadcast call (from 0) throws, as NcclTransport's does when
// NCCL refuses to enqueue; every other call goes to `inner`.
class ThrowingTransport final : public Transport {
 public:
  ThrowingTransport(std::unique_ptr<Transport> inner, std::uint64_t throw_at)
      : inner_(std::move(inner)), throw_at_(throw_at) {}
  std::string_view name() const override { return "throwing"; }
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  void broadcast_async(void* buffer, std::size_t bytes, int root, Stream& stream) override {
    if (calls_++ == throw_at_) throw Error(ErrorCode::kTransport, "enqueue refused (injected)");
    inner_->broadcast_async(buffer, bytes, root, stream);
  }
  std::optional<std::string> async_error() override { return inner_->async_error(); }
  void abort() noexcept override { inner_->abort(); }

 private:
  std::unique_ptr<Transport> inner_;
  std::uint64_t throw_at_;
  std::uint64_t calls_ = 0;
};

}  // namespace

// Without the sender's abort after any failed send, the transport stays with bucket 0 posted and
// the next update waits out its deadline on it instead of failing at once.
TEST_CASE("faults: a broadcast that throws mid-update drops the sender's transport") {
  // Without the abort the sender's destructor waits forever for rank 1: fail instead of hanging.
  Watchdog watchdog(60s);
  const Layout layout = fault_layout();
  HostBackend backend;
  LoopbackCommunicator communicator(2);  // rank 1 never joins: nothing may wait for it
  SenderConfig config;
  config.update_deadline = 2000ms;
  Sender sender(layout, backend,
                std::make_unique<ThrowingTransport>(communicator.transport(0), /*throw_at=*/1),
                config);
  HostTensors v1(layout, kAllGroups, 1);
  PublishHandle first = sender.publish(1, kAllGroups, v1.sources());
  CHECK_THROWS_WITH(first.wait(), Catch::Contains("enqueue refused (injected)"));
  HostTensors v2(layout, kAllGroups, 2);
  PublishHandle second = sender.publish(2, kAllGroups, v2.sources());
  CHECK_THROWS_WITH(second.wait(), Catch::Contains("no transport"));
  watchdog.stop();
}
