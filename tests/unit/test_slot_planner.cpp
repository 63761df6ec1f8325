// The slot state machine on its own: which slot is written, what is offered, what survives. The
// planner asks its SlotTable which slot is live; the tests play the engine by swapping the table
// (Slots::apply, Slots::roll_back) before telling the planner, as the step hook does.
#include <catch2/catch.hpp>

#include "core/slot_planner.h"
#include "shadowsync/error.h"
#include "shadowsync/host_backend.h"
#include "shadowsync/step_hook.h"

using namespace shadowsync;

namespace {

constexpr std::size_t kBase = 0;
constexpr std::size_t kLora = 1;

// A table of `groups` one-tensor groups ("base", then adapters) on the host backend, an engine
// stream, and the planner over them.
struct Slots {
  explicit Slots(std::size_t groups, SwapStrategy strategy = SwapStrategy::kRebind)
      : layout(make_layout(groups)),
        table(layout, backend, strategy),
        engine_stream(backend.create_stream(StreamPriority::kNormal)),
        planner(table) {}
  ~Slots() { backend.stream_synchronize(*engine_stream); }

  static Layout make_layout(std::size_t groups) {
    std::vector<TensorSpec> specs;
    for (std::size_t g = 0; g < groups; ++g) {
      const std::string group = g == 0 ? "base" : "lora_" + std::to_string(g);
      specs.push_back({"t" + std::to_string(g), DType::kFloat32, {4}, group});
    }
    return Layout::build(specs);
  }

  int live_slot(std::size_t g) const { return table.live_slot(g); }
  // The engine applies the offer (the step hook's swap), then the receiver learns of it.
  void apply() {
    for (const GroupSwap& swap : planner.offer()->swaps) {
      table.make_live(swap.group, swap.slot, *engine_stream);
    }
    planner.on_applied();
  }
  // The engine makes `live_now` live again (the step hook's rollback), then the receiver adopts it.
  void roll_back(const std::vector<GroupSwap>& live_now) {
    for (const GroupSwap& swap : live_now) table.make_live(swap.group, swap.slot, *engine_stream);
    planner.on_rolled_back(live_now);
  }

  HostBackend backend;
  Layout layout;
  SlotTable table;
  std::unique_ptr<Stream> engine_stream;
  SlotPlanner planner;
};

std::vector<std::pair<std::size_t, std::uint64_t>> swaps_of(const PendingUpdate& update) {
  std::vector<std::pair<std::size_t, std::uint64_t>> out;
  for (const auto& s : update.swaps) out.emplace_back(s.group, s.content_version);
  return out;
}

}  // namespace

TEST_CASE("a receive writes the shadow slot and an applied update flips live") {
  Slots slots(2);
  SlotPlanner& planner = slots.planner;
  CHECK(slots.live_slot(kBase) == 0);
  const auto targets = planner.begin(1, {0});
  REQUIRE(targets.size() == 1);
  CHECK(targets[0].group == kBase);
  CHECK(targets[0].slot == 1);  // never the live slot
  const PendingUpdate& offer = planner.complete();
  CHECK(offer.version == 1);
  CHECK(swaps_of(offer) == std::vector<std::pair<std::size_t, std::uint64_t>>{{kBase, 1}});
  CHECK(planner.offer() == &offer);
  slots.apply();
  CHECK(slots.live_slot(kBase) == 1);
  CHECK(slots.live_slot(kLora) == 0);
  CHECK(planner.offer() == nullptr);
  CHECK(planner.begin(2, {0})[0].slot == 0);  // the old live slot is the new shadow
}

TEST_CASE("latest wins: a retracted update's groups join the next offer") {
  Slots slots(2);
  SlotPlanner& planner = slots.planner;
  planner.begin(1, {0});
  planner.complete();
  planner.on_retracted();  // the engine never saw version 1
  CHECK(planner.retracted_version() == 1);
  const auto targets = planner.begin(2, {1});  // LoRA only
  CHECK(targets.size() == 1);
  const PendingUpdate& offer = planner.complete();
  CHECK(offer.version == 2);
  // The base of version 1 comes along: a LoRA-only update never lands on a stale base.
  CHECK(swaps_of(offer) ==
        std::vector<std::pair<std::size_t, std::uint64_t>>{{kBase, 1}, {kLora, 2}});
  CHECK(planner.retracted_version() == 0);
}

TEST_CASE("a retracted update overwritten by the next one is replaced, not merged") {
  Slots slots(2);
  SlotPlanner& planner = slots.planner;
  planner.begin(1, {0, 1});
  planner.complete();
  planner.on_retracted();
  const auto targets = planner.begin(2, {0});
  CHECK(targets[0].slot == 1);  // the same shadow, rewritten
  const PendingUpdate& offer = planner.complete();
  CHECK(swaps_of(offer) ==
        std::vector<std::pair<std::size_t, std::uint64_t>>{{kBase, 2}, {kLora, 1}});
}

TEST_CASE("a failed receive offers nothing new and restores an intact retracted update") {
  Slots slots(2);
  SlotPlanner& planner = slots.planner;
  planner.begin(1, {0});
  const PendingUpdate& first = planner.complete();
  planner.on_retracted();
  planner.begin(2, {1});  // does not touch the base shadow
  const PendingUpdate* restored = planner.fail();
  REQUIRE(restored == &first);
  CHECK(restored->version == 1);
  CHECK(planner.offer() == restored);
}

TEST_CASE("a failed receive that overwrote part of a retracted update loses it") {
  Slots slots(2);
  SlotPlanner& planner = slots.planner;
  planner.begin(1, {0, 1});
  planner.complete();
  planner.on_retracted();
  planner.begin(2, {1});  // overwrites the LoRA half of version 1
  CHECK(planner.fail() == nullptr);
  CHECK(planner.offer() == nullptr);
  // Nothing pending survives: the next update carries only its own groups.
  planner.begin(3, {1});
  CHECK(swaps_of(planner.complete()) ==
        std::vector<std::pair<std::size_t, std::uint64_t>>{{kLora, 3}});
}

TEST_CASE("a failed receive with nothing retracted leaves the live slots alone") {
  Slots slots(1);
  SlotPlanner& planner = slots.planner;
  planner.begin(1, {0});
  planner.complete();
  slots.apply();
  planner.begin(2, {0});
  CHECK(planner.fail() == nullptr);
  CHECK(slots.live_slot(0) == 1);
  CHECK(planner.begin(3, {0})[0].slot == 0);
}

TEST_CASE("misuse of the state machine is an internal error, not silent corruption") {
  Slots slots(1);
  SlotPlanner& planner = slots.planner;
  const auto internal = [](const Error& e) { return e.code() == ErrorCode::kInternal; };
  CHECK_THROWS_MATCHES(planner.complete(), Error, Catch::Predicate<Error>(internal));
  CHECK_THROWS_MATCHES(planner.fail(), Error, Catch::Predicate<Error>(internal));
  CHECK_THROWS_MATCHES(planner.on_applied(), Error, Catch::Predicate<Error>(internal));
  planner.begin(1, {0});
  // A receive is already in flight.
  CHECK_THROWS_WITH(planner.begin(2, {0}), Catch::Contains("begin(2) while an offer or a receive"));
  CHECK_THROWS_WITH(planner.on_rolled_back({}), Catch::Contains("on_rolled_back while"));
}

TEST_CASE("copy_in: slot 0 stays live, every receive writes slot 1") {
  Slots slots(2, SwapStrategy::kCopyIn);
  SlotPlanner& planner = slots.planner;
  for (std::uint64_t v = 1; v <= 3; ++v) {
    const auto targets = planner.begin(v, {0, 1});
    REQUIRE(targets.size() == 2);
    CHECK(targets[0].slot == 1);
    CHECK(targets[1].slot == 1);
    CHECK(swaps_of(planner.complete()) ==
          std::vector<std::pair<std::size_t, std::uint64_t>>{{kBase, v}, {kLora, v}});
    slots.apply();
    CHECK(slots.live_slot(kBase) == 0);  // the copy went into the live storage
    CHECK(slots.live_slot(kLora) == 0);
  }
}

TEST_CASE("after a rollback the slot made live again is not written; the one it left is") {
  Slots slots(1);
  SlotPlanner& planner = slots.planner;
  planner.begin(1, {0});
  planner.complete();
  slots.apply();  // version 1 live in slot 1, slot 0 holds the initial weights
  slots.roll_back({GroupSwap{0, 0, 0}});
  CHECK(slots.live_slot(0) == 0);
  CHECK(planner.begin(2, {0})[0].slot == 1);
}
