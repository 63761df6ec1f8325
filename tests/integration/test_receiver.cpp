// The receiver, sender and step hook together on the host backend and loopback transport.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstring>
#include <vector>

#include "deadline.h"
#include "live_hash.h"
#include "loopback_rig.h"
#include "pattern.h"
#include <fmt/format.h>

#include "shadowsync/error.h"

using namespace shadowsync;
using namespace shadowsync::testing;

namespace {

Layout model_layout() {
  // A tiny model: a base of odd-sized tensors spanning several buckets, two LoRA adapters.
  return Layout::build({{"embed", DType::kBFloat16, {300, 16}, "base"},
                        {"layer0.w", DType::kFloat32, {513}, "base"},
                        {"layer0.norm", DType::kFloat16, {7}, "base"},
                        {"head", DType::kInt8, {1001}, "base"},
                        {"lora_a.A", DType::kBFloat16, {8, 16}, "lora_a"},
                        {"lora_a.B", DType::kBFloat16, {16, 8}, "lora_a"},
                        {"lora_b.A", DType::kFloat32, {33}, "lora_b"}},
                       {.bucket_bytes = 2048});
}

}  // namespace

TEST_CASE("an update lands in the shadow and becomes live at the next step, all groups at once") {
  const Layout layout = model_layout();
  LoopbackRig rig(layout);
  HostFakeEngine engine(rig.backend(), rig.receiver());
  StepHook& hook = rig.receiver().step_hook();
  std::byte* before = hook.live_arena(0);

  rig.publish(1, {"base", "lora_a", "lora_b"}).wait();
  CHECK(hook.applied_version() == 0);  // nothing swaps behind the engine's back
  rig.wait_offered(1);
  REQUIRE(engine.step() == std::optional<std::uint64_t>{1});
  CHECK(hook.live_arena(0) != before);  // rebind: the pointer table flipped
  for (std::size_t g = 0; g < 3; ++g) CHECK(hook.live_content_version(g) == 1);
  CHECK_FALSE(engine.step().has_value());  // fast path afterwards
  engine.synchronize();
  CHECK(engine.torn_steps() == 0);
  CHECK(rig.history().check(engine.records()).empty());
}

TEST_CASE("a LoRA-only update moves only adapter bytes and keeps the base") {
  const Layout layout = model_layout();
  LoopbackRig rig(layout);
  HostFakeEngine engine(rig.backend(), rig.receiver());
  rig.publish(1, {"base", "lora_a", "lora_b"}).wait();
  REQUIRE(rig.receiver().step_hook().wait_applied(1, deadline_from_now(), engine.stream()));
  const std::byte* base = rig.receiver().step_hook().live_arena(0);

  rig.publish(2, {"lora_a"}).wait();
  rig.wait_offered(2);
  // Observers hear of an update just after it is offered: wait for the report itself.
  wait_until([&] { return !rig.reports().empty() && rig.reports().back().version == 2; },
             "update 2 reported");
  const auto reports = rig.reports();
  REQUIRE(reports.back().version == 2);
  CHECK(reports.back().bytes == layout.groups()[1].arena_bytes());
  REQUIRE(engine.step() == std::optional<std::uint64_t>{2});
  CHECK(rig.receiver().step_hook().live_arena(0) == base);
  CHECK(rig.receiver().step_hook().live_content_version(0) == 1);
  CHECK(rig.receiver().step_hook().live_content_version(1) == 2);
  CHECK(rig.receiver().step_hook().live_content_version(2) == 1);
  engine.synchronize();
  CHECK(engine.torn_steps() == 0);
  CHECK(rig.history().check(engine.records()).empty());
}

TEST_CASE("publishing straight from an arena gives the same bytes as packing tensors") {
  const Layout layout = model_layout();
  LoopbackRig rig(layout);
  HostFakeEngine engine(rig.backend(), rig.receiver());
  DeviceBuffer arena(rig.backend(), layout.groups()[0].arena_bytes());
  fill_arena(layout, 0, 3, arena.data());
  PublishHandle handle = rig.sender().publish_arenas(3, {"base"}, {arena.data()});
  rig.receiver().begin_update(handle.header());
  handle.wait();
  REQUIRE(rig.receiver().step_hook().wait_applied(3, deadline_from_now(), engine.stream()));
  engine.step();
  engine.step();
  engine.synchronize();
  CHECK(engine.torn_steps() == 0);
  CHECK(std::memcmp(rig.receiver().step_hook().live_arena(0), arena.data(),
                    layout.groups()[0].arena_bytes()) == 0);
}

TEST_CASE("bad input is refused before a byte moves, and the engine keeps stepping") {
  const Layout layout = model_layout();
  LoopbackRig rig(layout);
  HostFakeEngine engine(rig.backend(), rig.receiver());
  rig.publish(1, {"base", "lora_a", "lora_b"}).wait();
  REQUIRE(rig.receiver().step_hook().wait_applied(1, deadline_from_now(), engine.stream()));
  engine.step();
  engine.synchronize();
  const std::uint64_t hash = live_hash(rig.receiver());
  Sender& sender = rig.sender();
  Receiver& receiver = rig.receiver();

  SECTION("layout fingerprint mismatch between sender and receiver") {
    const Layout other = Layout::build({{"embed", DType::kBFloat16, {300, 16}, "base"}});
    UpdateHeader header = make_update_header(other, 2, {"base"});
    CHECK_THROWS_WITH(receiver.begin_update(header),
                      Catch::Contains("layout fingerprint") &&
                          Catch::Contains(fmt::format("{:#018x}", other.fingerprint())) &&
                          Catch::Contains(fmt::format("{:#018x}", layout.fingerprint())));
  }
  SECTION("a header with a wrong magic or protocol version") {
    UpdateHeader header = make_update_header(layout, 2, {"base"});
    header.magic = 0xdeadbeef;
    CHECK_THROWS_WITH(receiver.begin_update(header), Catch::Contains("magic 0xdeadbeef"));
    header.magic = kHeaderMagic;
    header.protocol_version = 2;
    CHECK_THROWS_WITH(receiver.begin_update(header), Catch::Contains("protocol version 2"));
  }
  SECTION("a version not greater than the last one") {
    CHECK_THROWS_WITH(receiver.begin_update(make_update_header(layout, 1, {"base"})),
                      Catch::Contains("update 1: version must be greater than the last one, 1"));
    HostTensors tensors(layout, {"base"}, 1);
    CHECK_THROWS_WITH(sender.publish(1, {"base"}, tensors.sources()),
                      Catch::Contains("update 1: version must be greater than the last one, 1"));
  }
  SECTION("a tensor whose size differs from its spec") {
    HostTensors tensors(layout, {"base"}, 2);
    auto sources = tensors.sources();
    sources[1].shape = {512};
    CHECK_THROWS_WITH(sender.publish(2, {"base"}, sources),
                      "tensor 'layer0.w': shape [512] does not match layout [513]");
    sources = tensors.sources();
    sources[2].dtype = DType::kBFloat16;
    CHECK_THROWS_WITH(sender.publish(2, {"base"}, sources),
                      "tensor 'layer0.norm': dtype bf16 does not match layout fp16");
  }
  SECTION("duplicate, unknown and missing tensor names") {
    HostTensors tensors(layout, {"base"}, 2);
    auto sources = tensors.sources();
    sources.push_back(sources[0]);
    CHECK_THROWS_WITH(sender.publish(2, {"base"}, sources),
                      "update 2: tensor 'embed' given twice");
    sources = tensors.sources();
    sources.push_back(SourceTensor{"ghost", sources[0].data, DType::kInt8, {1}});
    CHECK_THROWS_WITH(sender.publish(2, {"base"}, sources),
                      "update 2: tensor 'ghost' is not in the layout");
    sources = tensors.sources();
    sources.pop_back();
    CHECK_THROWS_WITH(sender.publish(2, {"base"}, sources),
                      "update 2: tensor 'head' of group 'base' is missing");
  }
  SECTION("unknown group and empty group list") {
    HostTensors tensors(layout, {"base"}, 2);
    CHECK_THROWS_WITH(sender.publish(2, {"lora_z"}, tensors.sources()),
                      Catch::Contains("unknown group 'lora_z'"));
    CHECK_THROWS_WITH(sender.publish(2, {}, tensors.sources()),
                      Catch::Contains("update 2: names no group"));
    UpdateHeader header = make_update_header(layout, 2, {"base"});
    header.groups.clear();
    header.bucket_count = 0;
    CHECK_THROWS_WITH(receiver.begin_update(header), Catch::Contains("names no group"));
  }

  // Nothing changed and the engine keeps stepping on version 1.
  for (int i = 0; i < 5; ++i) CHECK_FALSE(engine.step().has_value());
  engine.synchronize();
  CHECK(engine.torn_steps() == 0);
  CHECK(receiver.step_hook().applied_version() == 1);
  CHECK(live_hash(receiver) == hash);
  CHECK(receiver.stats().updates_ready == 1);
  CHECK(receiver.stats().last_accepted_version == 1);
  // A good update still applies after all that.
  rig.publish(2, {"lora_b"}).wait();
  CHECK(receiver.step_hook().wait_applied(2, deadline_from_now(), engine.stream()));
}

TEST_CASE("several receivers take the same update from one sender") {
  const Layout layout = model_layout();
  RigOptions options;
  options.receivers = 3;
  LoopbackRig rig(layout, options);
  std::vector<std::unique_ptr<HostFakeEngine>> engines;
  for (int r = 0; r < 3; ++r) {
    engines.push_back(std::make_unique<HostFakeEngine>(rig.backend(), rig.receiver(r)));
  }
  for (std::uint64_t v = 1; v <= 5; ++v) rig.publish(v, {v % 2 ? "base" : "lora_a"});
  for (int r = 0; r < 3; ++r) {
    REQUIRE(rig.receiver(r).step_hook().wait_applied(5, deadline_from_now(), engines[r]->stream()));
    engines[r]->step();
    engines[r]->synchronize();
    CHECK(engines[r]->torn_steps() == 0);
    CHECK(rig.history().check(engines[r]->records()).empty());
  }
}

TEST_CASE("the oracle notices a corrupted byte: a torn-step count of zero means something") {
  const Layout layout = model_layout();
  RigOptions options;
  options.sender.checksums = false;  // with them the receiver would refuse it first
  LoopbackRig rig(layout, options);
  HostFakeEngine engine(rig.backend(), rig.receiver(), {.full_check_every = 1});
  // Flip one byte of the first bucket of update 1 on the receiver's rank (rank 1). Without
  // per-bucket checksums the receiver cannot tell; the oracle must.
  rig.communicator().inject_flip(1, 0, 100);
  rig.publish(1, {"base"}).wait();
  REQUIRE(rig.receiver().step_hook().wait_applied(1, deadline_from_now(), engine.stream()));
  engine.step();
  engine.synchronize();
  CHECK(engine.torn_steps() == 1);
  CHECK_THAT(engine.first_torn(), Catch::Contains("group base expected version 1"));
  CHECK(rig.history().check(engine.records()) != "");
}

TEST_CASE("bad configs are refused with the field and its value named") {
  const Layout layout = model_layout();
  HostBackend backend;
  LoopbackCommunicator communicator(2);
  ReceiverConfig config;
  config.poll_interval = std::chrono::microseconds(0);
  CHECK_THROWS_WITH(Receiver(layout, backend, communicator.transport(1), config),
                    "ReceiverConfig::poll_interval (us) must be positive, got 0");
  config = ReceiverConfig{};
  config.root_rank = 2;
  LoopbackCommunicator second(2);
  CHECK_THROWS_WITH(Receiver(layout, backend, second.transport(1), config),
                    "ReceiverConfig::root_rank is 2, outside the transport's ranks 0..1");
  CHECK(backend.bytes_allocated() == 0);  // refused before any slot was allocated
  SenderConfig sender_config;
  sender_config.root_rank = 1;
  LoopbackCommunicator other(2);
  CHECK_THROWS_WITH(Sender(layout, backend, other.transport(0), sender_config),
                    Catch::Contains("transport is rank 0 and SenderConfig::root_rank is 1"));
}

namespace {

// The update's tensors in the order a streamed publish takes them.
std::vector<SourceTensor> in_order(const StreamedPublish& publish, const Layout& layout,
                                   const std::vector<SourceTensor>& sources) {
  std::vector<SourceTensor> ordered;
  for (const auto& [g, t] : publish.order()) {
    const std::string& name = layout.groups()[g].tensors()[t].spec.name;
    for (const SourceTensor& s : sources) {
      if (s.name == name) ordered.push_back(s);
    }
  }
  return ordered;
}

}  // namespace

TEST_CASE("a streamed publish takes tensors while buckets go out; the receiver gets the same bytes") {
  const Layout layout = model_layout();
  LoopbackRig rig(layout);
  HostFakeEngine engine(rig.backend(), rig.receiver());
  const std::vector<std::string> groups = {"base", "lora_b"};
  StreamedPublish publish = rig.sender().publish_streamed(1, groups);
  rig.receiver().begin_update(publish.header());
  CHECK(publish.order().size() == 5);  // base's four tensors, then lora_b's one

  // Supply one tensor at a time from a buffer that is overwritten right after: what a ZeRO-3
  // trainer does when it frees a gathered parameter. The receiver must still get version 1.
  HostTensors tensors(layout, groups, 1);
  const auto ordered = in_order(publish, layout, tensors.sources());
  std::vector<std::uint64_t> scratch;
  for (const SourceTensor& tensor : ordered) {
    std::size_t bytes = 0;
    for (const auto& g : layout.groups()) {
      if (auto t = g.find_tensor(tensor.name)) bytes = g.tensors()[*t].bytes;
    }
    scratch.assign((bytes + 7) / 8, 0);
    std::memcpy(scratch.data(), tensor.data, bytes);
    SourceTensor copy = tensor;
    copy.data = scratch.data();
    publish.supply({copy});
    std::fill(scratch.begin(), scratch.end(), 0xdeadbeefdeadbeefull);  // "freed"
  }
  CHECK(publish.supplied() == 5);
  publish.handle().wait();
  REQUIRE(rig.receiver().step_hook().wait_applied(1, deadline_from_now(), engine.stream()));
  engine.step();
  engine.synchronize();
  CHECK(engine.torn_steps() == 0);
  UpdateHistory history;
  history.add(1, {0, 2});
  CHECK(history.check(engine.records()).empty());
}

TEST_CASE("a streamed publish refuses out-of-order or mismatched tensors and fails when dropped") {
  const Layout layout = model_layout();
  RigOptions options;
  options.sender.update_deadline = std::chrono::milliseconds(5000);
  LoopbackRig rig(layout, options);
  HostFakeEngine engine(rig.backend(), rig.receiver());
  HostTensors tensors(layout, {"base"}, 1);
  {
    StreamedPublish publish = rig.sender().publish_streamed(1, {"base"});
    rig.receiver().begin_update(publish.header());
    const auto ordered = in_order(publish, layout, tensors.sources());
    CHECK_THROWS_WITH(publish.supply({ordered[1]}),
                      "update 1: tensor 'layer0.w' supplied where 'embed' (tensor 1 of 4 of "
                      "group 'base') comes next");
    SourceTensor wrong = ordered[0];
    wrong.shape = {16, 300};
    CHECK_THROWS_WITH(publish.supply({wrong}),
                      "tensor 'embed': shape [16, 300] does not match layout [300, 16]");
    CHECK(publish.supplied() == 0);
    publish.supply({ordered[0], ordered[1]});
    CHECK(publish.supplied() == 2);
    // Dropped here with two tensors missing: the update fails, the receiver discards it.
  }
  wait_until([&] { return rig.receiver().stats().updates_failed == 1; }, "update 1 failed");
  CHECK_THAT(rig.receiver().stats().last_error, Catch::Contains("update 1"));
  CHECK(rig.receiver().step_hook().applied_version() == 0);

  // A new communicator, and the next streamed update goes through.
  rig.reconnect();
  StreamedPublish publish = rig.sender().publish_streamed(2, {"base"});
  rig.receiver().begin_update(publish.header());
  HostTensors second(layout, {"base"}, 2);
  publish.supply(in_order(publish, layout, second.sources()));
  publish.handle().wait();
  REQUIRE(rig.receiver().step_hook().wait_applied(2, deadline_from_now(), engine.stream()));
  engine.step();
  engine.synchronize();
  CHECK(engine.torn_steps() == 0);
}

TEST_CASE("the self-check: the same bytes as the live weights apply; one element off is refused, "
          "named, and wait_applied says so at once") {
  const Layout layout = model_layout();
  LoopbackRig rig(layout);
  HostFakeEngine engine(rig.backend(), rig.receiver());
  Receiver& receiver = rig.receiver();
  StepHook& hook = receiver.step_hook();
  const GroupLayout& base = layout.groups()[0];
  std::vector<std::byte> arena(base.arena_bytes());
  fill_arena(layout, 0, 1, arena.data());
  const auto publish = [&](std::uint64_t version, bool verify) {
    PublishHandle handle = rig.sender().publish_arenas(version, {"base"}, {arena.data()});
    UpdateChecks checks;
    checks.verify_matches_live = verify;
    receiver.begin_update(handle.header(), checks);
    return handle;
  };

  publish(1, false).wait();  // the live weights: version 1's bytes
  REQUIRE(hook.wait_applied(1, deadline_from_now(), engine.stream()));
  publish(2, true).wait();  // the same bytes again, checked against them
  REQUIRE(hook.wait_applied(2, deadline_from_now(), engine.stream()));

  // One element of 'layer0.w' (fp32, tensor 1) differs from what is live.
  const TensorPlacement& w = base.tensors()[1];
  const std::size_t element = 5;
  arena[w.offset + element * 4 + 1] ^= std::byte{0x40};
  publish(3, true).wait();
  const auto started = std::chrono::steady_clock::now();
  const auto deadline = started + std::chrono::seconds(60);
  CHECK_FALSE(hook.wait_applied(3, deadline, engine.stream()));
  // Not the deadline: the failure woke it.
  CHECK(std::chrono::steady_clock::now() - started < std::chrono::seconds(30));
  CHECK(hook.failed_version() == 3);
  CHECK(hook.applied_version() == 2);
  const auto reports = rig.reports();
  REQUIRE_FALSE(reports.empty());
  const UpdateReport& failed = reports.back();
  CHECK(failed.version == 3);
  CHECK(failed.outcome == UpdateOutcome::kFailed);
  CHECK(failed.code == ErrorCode::kLayoutMismatch);
  CHECK(failed.failed_tensor == "layer0.w");
  CHECK_THAT(failed.error, Catch::Contains("first at element 5 (byte 21)"));
  // Nothing of it went live: the live 'layer0.w' still holds version 1's bytes.
  std::vector<std::byte> expected(base.arena_bytes());
  fill_arena(layout, 0, 1, expected.data());
  engine.synchronize();
  CHECK(std::memcmp(hook.live_tensor(0, 1), expected.data() + w.offset, w.bytes) == 0);

  // Without the self-check the same bytes are an ordinary update: it applies.
  publish(4, false).wait();
  REQUIRE(hook.wait_applied(4, deadline_from_now(), engine.stream()));
  CHECK(std::memcmp(hook.live_tensor(0, 1), arena.data() + w.offset, w.bytes) == 0);
}

TEST_CASE("coordinated: a discarded update never goes live, and the next lands on the live weights") {
  const Layout layout = model_layout();
  RigOptions options;
  options.receiver.commit_mode = CommitMode::kCoordinated;
  LoopbackRig rig(layout, options);
  HostFakeEngine engine(rig.backend(), rig.receiver());
  Receiver& receiver = rig.receiver();
  const StepHook& hook = receiver.step_hook();
  const auto ready = [&](std::uint64_t version) {
    wait_until([&] { return receiver.ready_version() == version; },
               fmt::format("update {} ready", version));
  };
  rig.publish(1, {"base", "lora_a", "lora_b"}).wait();
  ready(1);
  REQUIRE(receiver.commit(1, engine.stream()) == 1);

  // Held ready (as on some tensor-parallel ranks only), then dropped: its bytes never go live.
  rig.publish(2, {"base", "lora_a", "lora_b"}).wait();
  ready(2);
  CHECK(receiver.discard(2));
  CHECK(receiver.ready_version() == 0);
  CHECK_THROWS_WITH(receiver.commit(2, engine.stream()),
                    Catch::Contains("commit(2): none is ready on this rank (applied version 1)"));
  rig.publish(3, {"lora_a"}).wait();
  ready(3);
  REQUIRE(receiver.commit(3, engine.stream()) == 3);
  CHECK(hook.live_content_version(0) == 1);  // update 2's base stays out
  CHECK(hook.live_content_version(1) == 3);
  CHECK(hook.live_content_version(2) == 1);

  // Dropped before its receive began: received, and dropped on completion.
  CHECK_FALSE(receiver.discard(4));
  rig.publish(4, {"base"}).wait();
  wait_until([&] { return receiver.stats().updates_ready == 4; }, "update 4 received");
  CHECK(receiver.ready_version() == 0);

  // A receive waiting for the held update's commit goes on once it is dropped (the engine
  // thread's discard against the receiver thread's wait).
  rig.publish(5, {"base"}).wait();
  ready(5);
  PublishHandle sixth = rig.publish(6, {"lora_b"});
  CHECK(receiver.discard(5));
  sixth.wait();
  ready(6);
  REQUIRE(receiver.commit(6, engine.stream()) == 6);
  CHECK(hook.live_content_version(0) == 1);
  CHECK(hook.live_content_version(1) == 3);
  CHECK(hook.live_content_version(2) == 6);
  engine.synchronize();
  CHECK(engine.torn_steps() == 0);

  LoopbackRig auto_rig(layout);  // commit_mode auto
  CHECK_THROWS_WITH(auto_rig.receiver().discard(1),
                    Catch::Contains("discard(1): the receiver's commit_mode is auto"));
}
