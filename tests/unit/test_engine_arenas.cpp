// Engine arenas (Receiver's EngineArenas): the remap arenas an engine made before it met the
// receiver. Refused, naming why, before anything is allocated: arenas with swap_strategy copy_in
// (remap and rebind take them; rebind: test_rebind_engine_arena.cpp), more entries than the layout has groups, an arena whose size is not its group's. Null
// entries (or none) change nothing; a well-formed arena becomes the group's live memory, shared
// with the engine.
//
// The host backend cannot remap, and check_receiver_config refuses remap on it before the arenas
// are looked at; the remap cases run on RemapHostBackend (remap_host_backend.h): a HostBackend
// that claims it can remap and makes HostArenas (plain host memory; remap_live copies the slot
// into the live range, which no refusal test reaches).
//
// Checked to fail without their behaviour (each broken by hand once, then restored): the strategy
// check, the entry count check and the size check in check_engine_arenas.
#include <catch2/catch.hpp>

#include <atomic>
#include <cstddef>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "remap_host_backend.h"
#include "shadowsync/error.h"
#include "shadowsync/host_backend.h"
#include "shadowsync/receiver.h"

using namespace shadowsync;
using namespace shadowsync::testing;

namespace {

// Two groups of different sizes, so that an arena of one group's size is wrong for the other.
Layout two_group_layout() {
  return Layout::build({{"embed", DType::kBFloat16, {97, 16}, "base"},
                        {"l0.w", DType::kFloat32, {300}, "base"},
                        {"a.A", DType::kBFloat16, {96}, "lora"},
                        {"a.B", DType::kBFloat16, {96}, "lora"}},
                       {.bucket_bytes = 1024});
}

ReceiverConfig remap_config() {
  ReceiverConfig config;
  config.swap_strategy = SwapStrategy::kRemap;
  config.engine_uses_cuda_graphs = true;  // what engine arenas are for; remap accepts it
  return config;
}

// The Error a receiver built from these arguments throws; FAILs when none is thrown.
template <typename B>
Error refusal(const Layout& layout, B& backend, const ReceiverConfig& config,
              const EngineArenas& arenas) {
  try {
    Receiver receiver(layout, backend, nullptr, config, arenas);
  } catch (const Error& e) {
    return e;
  }
  FAIL("the receiver was built");
  throw;  // unreachable: FAIL throws
}

// What the size refusal says of a group's arena: the group, the arena's bytes and the group's.
std::string size_refusal(const std::string& group, std::size_t held, std::size_t needed) {
  return "the engine arena of group '" + group + "' holds " + std::to_string(held) +
         " bytes, but the layout's group needs " + std::to_string(needed);
}

}  // namespace

TEST_CASE("engine arenas: refused with swap_strategy copy_in, before anything is allocated",
          "[engine_arenas]") {
  const Layout layout = two_group_layout();
  CountingBackend backend;  // the host backend: copy_in is fine on it
  const std::size_t base_bytes = layout.groups()[0].arena_bytes();
  const std::size_t lora_bytes = layout.groups()[1].arena_bytes();
  auto base = std::make_shared<HostArena>(base_bytes);
  auto lora = std::make_shared<HostArena>(lora_bytes);

  SECTION("copy_in, one arena") {
    ReceiverConfig config;
    config.swap_strategy = SwapStrategy::kCopyIn;
    const Error e = refusal(layout, backend, config, {base});
    CHECK(e.code() == ErrorCode::kInvalidArgument);
    CHECK_THAT(e.what(), Catch::Contains("engine arenas were given for 1 group(s)") &&
                             Catch::Contains("but swap_strategy is copy_in") &&
                             Catch::Contains("(swap_strategy remap)"));
  }
  SECTION("copy_in, two arenas: both counted") {
    ReceiverConfig config;
    config.swap_strategy = SwapStrategy::kCopyIn;
    const Error e = refusal(layout, backend, config, {base, lora});
    CHECK(e.code() == ErrorCode::kInvalidArgument);
    CHECK_THAT(e.what(), Catch::Contains("engine arenas were given for 2 group(s), but "
                                         "swap_strategy is copy_in"));
  }
  SECTION("copy_in, the arena in the second group only") {
    ReceiverConfig config;
    config.swap_strategy = SwapStrategy::kCopyIn;
    const Error e = refusal(layout, backend, config, {nullptr, lora});
    CHECK(e.code() == ErrorCode::kInvalidArgument);
    CHECK_THAT(e.what(), Catch::Contains("engine arenas were given for 1 group(s), but "
                                         "swap_strategy is copy_in") &&
                             Catch::Contains("(swap_strategy rebind)"));
  }
  CHECK(backend.calls == 0);  // refused before anything was allocated or created
  CHECK(backend.inner().bytes_allocated() == 0);
  // The receiver took no share of the arenas it refused.
  CHECK(base.use_count() == 1);
  CHECK(lora.use_count() == 1);
}

TEST_CASE("engine arenas: null entries with copy_in change nothing", "[engine_arenas]") {
  const Layout layout = two_group_layout();
  ReceiverConfig config;
  config.swap_strategy = SwapStrategy::kCopyIn;
  CountingBackend plain;
  CountingBackend with_nulls;
  std::size_t plain_bytes = 0;
  {
    Receiver receiver(layout, plain, nullptr, config);
    plain_bytes = plain.inner().bytes_allocated();
  }
  Receiver receiver(layout, with_nulls, nullptr, config, EngineArenas{nullptr, nullptr});
  // Both slots of both groups are the receiver's own, as without the (empty) arenas.
  const std::size_t slots =
      2 * (layout.groups()[0].arena_bytes() + layout.groups()[1].arena_bytes());
  CHECK(plain_bytes >= slots);
  CHECK(with_nulls.inner().bytes_allocated() == plain_bytes);
  for (std::size_t g = 0; g < 2; ++g) CHECK(receiver.step_hook().live_arena(g) != nullptr);
}

TEST_CASE("engine arenas: more entries than the layout has groups are refused",
          "[engine_arenas]") {
  const Layout layout = two_group_layout();
  RemapHostBackend backend;
  const std::size_t base_bytes = layout.groups()[0].arena_bytes();
  const std::size_t lora_bytes = layout.groups()[1].arena_bytes();
  auto base = std::make_shared<HostArena>(base_bytes);
  auto lora = std::make_shared<HostArena>(lora_bytes);
  auto extra = std::make_shared<HostArena>(lora_bytes);

  // A null entry past the last group counts as an entry too (checked first: without the count
  // check the arena loop skips it and the receiver is built, a clean failure).
  const Error trailing = refusal(layout, backend, remap_config(), {base, nullptr, nullptr});
  CHECK_THAT(trailing.what(), Catch::Contains("3 engine arena entries were given, but the layout "
                                              "has 2 groups"));
  const Error e = refusal(layout, backend, remap_config(), {base, lora, extra});
  CHECK(e.code() == ErrorCode::kInvalidArgument);
  CHECK_THAT(e.what(), Catch::Contains("3 engine arena entries were given, but the layout has 2 "
                                       "groups"));
  CHECK(backend.calls == 0);
  CHECK(backend.arenas_made == 0);
  CHECK(backend.bytes_allocated() == 0);
  CHECK(base.use_count() == 1);
}

TEST_CASE("engine arenas: an arena whose size is not its group's is refused, naming the group "
          "and both sizes",
          "[engine_arenas]") {
  const Layout layout = two_group_layout();
  RemapHostBackend backend;
  const std::size_t base_bytes = layout.groups()[0].arena_bytes();
  const std::size_t lora_bytes = layout.groups()[1].arena_bytes();
  REQUIRE(base_bytes != lora_bytes);

  SECTION("one byte too many for 'base'") {
    auto base = std::make_shared<HostArena>(base_bytes + 1);
    const Error e = refusal(layout, backend, remap_config(), {base});
    CHECK(e.code() == ErrorCode::kInvalidArgument);
    CHECK_THAT(e.what(), Catch::Contains(size_refusal("base", base_bytes + 1, base_bytes)) &&
                             Catch::Contains("laid out as the group is"));
  }
  SECTION("the groups' arenas swapped: 'base' is named first") {
    auto base = std::make_shared<HostArena>(lora_bytes);
    auto lora = std::make_shared<HostArena>(base_bytes);
    const Error e = refusal(layout, backend, remap_config(), {base, lora});
    CHECK_THAT(e.what(), Catch::Contains(size_refusal("base", lora_bytes, base_bytes)));
  }
  SECTION("'lora' too small behind a null 'base'") {
    auto lora = std::make_shared<HostArena>(lora_bytes - 2);
    const Error e = refusal(layout, backend, remap_config(), {nullptr, lora});
    CHECK_THAT(e.what(), Catch::Contains(size_refusal("lora", lora_bytes - 2, lora_bytes)));
  }
  CHECK(backend.calls == 0);  // not even the other group's own arena was made
  CHECK(backend.arenas_made == 0);
  CHECK(backend.bytes_allocated() == 0);
}

TEST_CASE("engine arenas: a well-formed arena becomes its group's live memory, shared with the "
          "engine",
          "[engine_arenas]") {
  const Layout layout = two_group_layout();
  RemapHostBackend backend;
  // An earlier receiver left slot 1 live.
  auto base = std::make_shared<HostArena>(layout.groups()[0].arena_bytes(), /*live_slot=*/1);
  {
    Receiver receiver(layout, backend, nullptr, remap_config(), {base});
    CHECK(receiver.step_hook().live_arena(0) == base->live_address());
    // The other group's arena is the receiver's own, made by the backend.
    CHECK(backend.arenas_made == 1);
    CHECK(receiver.step_hook().live_arena(1) != nullptr);
    CHECK(receiver.step_hook().live_arena(1) != base->live_address());
    CHECK(base.use_count() == 2);  // shared, not taken
    CHECK(base->live_slot() == 1);  // nothing was remapped
    CHECK(base->remaps == 0);
  }
  CHECK(base.use_count() == 1);  // the engine's again once the receiver is gone
  CHECK(base->live_slot() == 1);
}
