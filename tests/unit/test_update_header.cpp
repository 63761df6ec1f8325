#include <catch2/catch.hpp>

#include <fmt/format.h>

#include "shadowsync/error.h"
#include "shadowsync/update_header.h"

using namespace shadowsync;

namespace {

Layout test_layout(std::size_t bucket = 1024) {
  return Layout::build({{"w1", DType::kFloat32, {1000}, "base"},
                        {"w2", DType::kFloat32, {10}, "base"},
                        {"a", DType::kBFloat16, {64}, "lora_a"},
                        {"b", DType::kBFloat16, {64}, "lora_b"}},
                       {.bucket_bytes = bucket});
}

ErrorCode code_of(const UpdateHeader& header, const Layout& layout, std::uint64_t last) {
  try {
    validate_update_header(header, layout, last);
  } catch (const Error& e) {
    return e.code();
  }
  FAIL("header was accepted");
  return ErrorCode::kInternal;
}

}  // namespace

TEST_CASE("a header lists groups in layout order with their bucket count") {
  const Layout layout = test_layout();
  const UpdateHeader header = make_update_header(layout, 7, {"lora_b", "base"});
  CHECK(header.version == 7);
  CHECK(header.groups == std::vector<std::uint32_t>{0, 2});
  CHECK(header.bucket_count == layout.groups()[0].bucket_count() + 1);
  CHECK(header.layout_fingerprint == layout.fingerprint());
  CHECK_NOTHROW(validate_update_header(header, layout, 6));
  CHECK(describe_groups(header, layout) == "base+lora_b");
}

TEST_CASE("making a header refuses empty, unknown and repeated groups") {
  const Layout layout = test_layout();
  CHECK_THROWS_WITH(make_update_header(layout, 1, {}), Catch::Contains("names no group"));
  CHECK_THROWS_WITH(make_update_header(layout, 1, {"lora_c"}),
                    Catch::Contains("unknown group 'lora_c'"));
  CHECK_THROWS_WITH(make_update_header(layout, 1, {"base", "base"}),
                    Catch::Contains("group 'base' named twice"));
}

TEST_CASE("every header field is checked and the error names both values") {
  const Layout layout = test_layout();
  const UpdateHeader good = make_update_header(layout, 5, {"base", "lora_a"});

  auto bad = good;
  bad.magic = 0x12345678;
  CHECK(code_of(bad, layout, 0) == ErrorCode::kBadHeader);
  CHECK_THROWS_WITH(validate_update_header(bad, layout, 0),
                    Catch::Contains("0x12345678") && Catch::Contains("0x59534853"));

  bad = good;
  bad.protocol_version = 99;
  CHECK(code_of(bad, layout, 0) == ErrorCode::kBadHeader);
  CHECK_THROWS_WITH(validate_update_header(bad, layout, 0),
                    Catch::Contains("protocol version 99") && Catch::Contains("receiver's 1"));

  const Layout other = test_layout(2048);  // the sender cut buckets differently
  CHECK(code_of(good, other, 0) == ErrorCode::kLayoutMismatch);
  CHECK_THROWS_WITH(validate_update_header(good, other, 0),
                    Catch::Contains(fmt::format("{:#018x}", layout.fingerprint())) &&
                        Catch::Contains(fmt::format("{:#018x}", other.fingerprint())));

  CHECK(code_of(good, layout, 5) == ErrorCode::kStaleVersion);
  CHECK_THROWS_WITH(validate_update_header(good, layout, 9),
                    Catch::Contains("update 5") && Catch::Contains("last one, 9"));

  bad = good;
  bad.groups.clear();
  CHECK(code_of(bad, layout, 0) == ErrorCode::kBadHeader);

  bad = good;
  bad.groups = {0, 7};
  CHECK_THROWS_WITH(validate_update_header(bad, layout, 0),
                    Catch::Contains("group index 7 out of range") && Catch::Contains("3 groups"));

  bad = good;
  bad.groups = {1, 0};
  CHECK_THROWS_WITH(validate_update_header(bad, layout, 0),
                    Catch::Contains("strictly increase, got 0 after 1"));

  bad = good;
  bad.bucket_count += 1;
  CHECK_THROWS_WITH(validate_update_header(bad, layout, 0),
                    Catch::Contains(fmt::format("bucket count {}", good.bucket_count + 1)) &&
                        Catch::Contains(fmt::format("layout's {}", good.bucket_count)));
}
