// The slot state machine on its own: which slot is written, what is offered, what survives.
#include <catch2/catch.hpp>

#include "core/slot_planner.h"
#include "shadowsync/error.h"
#include "shadowsync/step_hook.h"

using namespace shadowsync;

namespace {

constexpr std::size_t kBase = 0;
constexpr std::size_t kLora = 1;

std::vector<std::pair<std::size_t, std::uint64_t>> swaps_of(const PendingUpdate& update) {
  std::vector<std::pair<std::size_t, std::uint64_t>> out;
  for (const auto& s : update.swaps) out.emplace_back(s.group, s.content_version);
  return out;
}

}  // namespace

TEST_CASE("a receive writes the shadow slot and an applied update flips live") {
  SlotPlanner planner(2);
  CHECK(planner.live_slot(kBase) == 0);
  const auto targets = planner.begin(1, {0});
  REQUIRE(targets.size() == 1);
  CHECK(targets[0].group == kBase);
  CHECK(targets[0].slot == 1);  // never the live slot
  const PendingUpdate& offer = planner.complete();
  CHECK(offer.version == 1);
  CHECK(swaps_of(offer) == std::vector<std::pair<std::size_t, std::uint64_t>>{{kBase, 1}});
  CHECK(planner.offer() == &offer);
  planner.on_applied();
  CHECK(planner.live_slot(kBase) == 1);
  CHECK(planner.live_slot(kLora) == 0);
  CHECK(planner.offer() == nullptr);
  CHECK(planner.begin(2, {0})[0].slot == 0);  // the old live slot is the new shadow
}

TEST_CASE("latest wins: a retracted update's groups join the next offer") {
  SlotPlanner planner(2);
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
  SlotPlanner planner(2);
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
  SlotPlanner planner(2);
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
  SlotPlanner planner(2);
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
  SlotPlanner planner(1);
  planner.begin(1, {0});
  planner.complete();
  planner.on_applied();
  planner.begin(2, {0});
  CHECK(planner.fail() == nullptr);
  CHECK(planner.live_slot(0) == 1);
  CHECK(planner.begin(3, {0})[0].slot == 0);
}

TEST_CASE("misuse of the state machine is an internal error, not silent corruption") {
  SlotPlanner planner(1);
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
  SlotPlanner planner(2, /*live_moves=*/false);
  for (std::uint64_t v = 1; v <= 3; ++v) {
    const auto targets = planner.begin(v, {0, 1});
    REQUIRE(targets.size() == 2);
    CHECK(targets[0].slot == 1);
    CHECK(targets[1].slot == 1);
    CHECK(swaps_of(planner.complete()) ==
          std::vector<std::pair<std::size_t, std::uint64_t>>{{kBase, v}, {kLora, v}});
    planner.on_applied();
    CHECK(planner.live_slot(kBase) == 0);  // the copy went into the live storage
    CHECK(planner.live_slot(kLora) == 0);
  }
}

TEST_CASE("after a rollback the slot made live again is not written; the one it left is") {
  SlotPlanner planner(1);
  planner.begin(1, {0});
  planner.complete();
  planner.on_applied();  // version 1 live in slot 1, slot 0 holds the initial weights
  planner.on_rolled_back({GroupSwap{0, 0, 0}});
  CHECK(planner.live_slot(0) == 0);
  CHECK(planner.begin(2, {0})[0].slot == 1);
}
