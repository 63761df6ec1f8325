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

TEST_CASE("a version that leaves no room to count up is refused on both sides") {
  const Layout layout = test_layout();
  CHECK_NOTHROW(make_update_header(layout, kMaxUpdateVersion, {"base"}));
  CHECK_THROWS_WITH(make_update_header(layout, kMaxUpdateVersion + 1, {"base"}),
                    Catch::Contains("update 9223372036854775808: above the highest version "
                                    "9223372036854775807"));
  UpdateHeader header = make_update_header(layout, 5, {"base"});
  header.version = ~std::uint64_t{0};  // a sender that does not check
  CHECK(code_of(header, layout, 0) == ErrorCode::kBadHeader);
  CHECK_THROWS_WITH(validate_update_header(header, layout, 0),
                    Catch::Contains("update 18446744073709551615: above the highest version"));
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
  bad.bucket_count += 2;  // one more is a checksum block (below); two more is wrong
  CHECK_THROWS_WITH(validate_update_header(bad, layout, 0),
                    Catch::Contains(fmt::format("bucket count {}", good.bucket_count + 2)) &&
                        Catch::Contains(fmt::format("layout's {}", good.bucket_count)));
  bad.bucket_count = good.bucket_count - 1;
  CHECK_THROWS_WITH(validate_update_header(bad, layout, 0),
                    Catch::Contains(fmt::format("bucket count {}", good.bucket_count - 1)));
}

TEST_CASE("a checksum block is counted as one more broadcast in the header") {
  const Layout layout = test_layout();
  const UpdateHeader plain = make_update_header(layout, 1, {"base"});
  const UpdateHeader summed = make_update_header(layout, 1, {"base"}, /*checksums=*/true);
  CHECK(summed.bucket_count == plain.bucket_count + 1);
  CHECK_NOTHROW(validate_update_header(summed, layout, 0));
  CHECK_FALSE(carries_checksums(plain, layout));
  CHECK(carries_checksums(summed, layout));
  CHECK(data_bucket_count(summed, layout) == plain.bucket_count);
  // It survives the byte form unchanged: no new field.
  CHECK(parse_update_header(serialize_update_header(summed)).bucket_count == summed.bucket_count);
}

TEST_CASE("a header survives serialization to bytes, and bad bytes are refused by field") {
  const Layout layout = test_layout();
  const UpdateHeader header = make_update_header(layout, 0x0102030405060708ull, {"base", "lora_b"});
  const std::vector<std::byte> bytes = serialize_update_header(header);
  REQUIRE(bytes.size() == 36 + 4 * 2);
  CHECK(bytes[0] == std::byte{0x53});  // magic, little-endian: "SHSY"
  CHECK(bytes[8] == std::byte{0x08});  // version, little-endian
  const UpdateHeader back = parse_update_header(bytes);
  CHECK(back.magic == header.magic);
  CHECK(back.protocol_version == header.protocol_version);
  CHECK(back.version == header.version);
  CHECK(back.layout_fingerprint == header.layout_fingerprint);
  CHECK(back.groups == header.groups);
  CHECK(back.bucket_count == header.bucket_count);

  const auto code = [](std::span<const std::byte> b) {
    try {
      parse_update_header(b);
    } catch (const Error& e) {
      return e.code();
    }
    return ErrorCode::kInternal;
  };
  CHECK(code(std::span(bytes).first(bytes.size() - 1)) == ErrorCode::kBadHeader);
  CHECK(code({}) == ErrorCode::kBadHeader);
  auto longer = bytes;
  longer.push_back(std::byte{0});
  CHECK_THROWS_WITH(parse_update_header(longer), "update header: group count 2 makes 44 bytes, which does not match the 45 given");
  auto bad_magic = bytes;
  bad_magic[0] = std::byte{0};
  CHECK_THROWS_WITH(parse_update_header(bad_magic), Catch::Contains("magic 0x59534800"));
  auto bad_count = bytes;
  bad_count[24] = std::byte{0};  // group count (offset 24) 0
  CHECK_THROWS_WITH(parse_update_header(bad_count),
                    "update header: group count 0 outside 1..256");

  UpdateHeader none = header;
  none.groups.clear();
  CHECK_THROWS_AS(serialize_update_header(none), Error);
}
