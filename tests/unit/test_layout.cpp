#include <catch2/catch.hpp>

#include "error_message.h"
#include "shadowsync/error.h"
#include "shadowsync/layout.h"

using namespace shadowsync;
using shadowsync::testing::message_of;

namespace {

std::vector<TensorSpec> small_specs() {
  return {
      {"embed", DType::kBFloat16, {100, 64}, "base"},        // 12800 B
      {"norm", DType::kFloat32, {64}, "base"},               // 256 B
      {"lora_a.q", DType::kBFloat16, {8, 64}, "adapter_a"},  // 1024 B
      {"head", DType::kBFloat16, {3, 7}, "base"},            // 42 B
  };
}

}  // namespace

TEST_CASE("tensors are placed at 256-byte aligned offsets in spec order per group") {
  const Layout layout = Layout::build(small_specs(), {.bucket_bytes = 4096});
  REQUIRE(layout.groups().size() == 2);
  const GroupLayout& base = layout.groups()[0];
  REQUIRE(base.name() == "base");
  REQUIRE(base.tensors().size() == 3);
  CHECK(base.tensors()[0].offset == 0);
  CHECK(base.tensors()[0].bytes == 12800);
  CHECK(base.tensors()[1].offset == 12800);  // already aligned
  CHECK(base.tensors()[2].offset == 13056);
  CHECK(base.tensors()[2].bytes == 42);
  CHECK(base.arena_bytes() == 13056 + 42);
  for (const auto& t : base.tensors()) CHECK(t.offset % kTensorAlignment == 0);
  CHECK(layout.groups()[1].name() == "adapter_a");
  CHECK(layout.total_bytes() == 13098 + 1024);
  CHECK(layout.tensor_count() == 4);
}

TEST_CASE("base comes first whatever the spec order") {
  const Layout layout = Layout::build({{"a", DType::kInt8, {4}, "lora"}, {"b", DType::kInt8, {4}, "base"}});
  CHECK(layout.groups()[0].name() == "base");
  CHECK(layout.groups()[1].name() == "lora");
}

TEST_CASE("buckets cover the arena with fixed-size ranges and a short last one") {
  const Layout layout = Layout::build(small_specs(), {.bucket_bytes = 4096});
  const GroupLayout& base = layout.groups()[0];
  REQUIRE(base.bucket_count() == 4);  // 13098 B
  std::size_t covered = 0;
  for (std::size_t k = 0; k < base.bucket_count(); ++k) {
    const Bucket b = base.bucket(k);
    CHECK(b.offset == covered);
    covered += b.bytes;
  }
  CHECK(covered == base.arena_bytes());
  CHECK(base.bucket(3).bytes == 13098 - 3 * 4096);
  CHECK_THROWS_WITH(base.bucket(4), Catch::Contains("bucket 4 out of range") &&
                                        Catch::Contains("has 4 buckets"));
}

TEST_CASE("the fingerprint is stable and changes with every part of the canonical layout") {
  const auto fp = [](std::vector<TensorSpec> specs, std::size_t bucket = 4096) {
    return Layout::build(std::move(specs), {.bucket_bytes = bucket}).fingerprint();
  };
  const std::uint64_t reference = fp(small_specs());
  CHECK(reference == fp(small_specs()));

  auto renamed = small_specs();
  renamed[1].name = "norm2";
  CHECK(fp(renamed) != reference);

  auto retyped = small_specs();
  retyped[1].dtype = DType::kInt32;  // same byte size
  CHECK(fp(retyped) != reference);

  auto reshaped = small_specs();
  reshaped[0].shape = {64, 100};  // same element count
  CHECK(fp(reshaped) != reference);

  auto reordered = small_specs();
  std::swap(reordered[0], reordered[1]);
  CHECK(fp(reordered) != reference);

  auto regrouped = small_specs();
  regrouped[2].group = "adapter_b";
  CHECK(fp(regrouped) != reference);

  CHECK(fp(small_specs(), 8192) != reference);
}

TEST_CASE("bad specs are rejected with the tensor and both values named") {
  auto duplicate = small_specs();
  duplicate[3].name = "embed";
  CHECK(message_of([&] { Layout::build(duplicate); }) ==
        "tensor 'embed': duplicate name (specs #0 and #3)");

  auto empty_group = small_specs();
  empty_group[1].group = "";
  CHECK_THAT(message_of([&] { Layout::build(empty_group); }),
             Catch::Contains("tensor 'norm': empty group name"));

  auto zero_dim = small_specs();
  zero_dim[0].shape = {100, 0};
  CHECK(message_of([&] { Layout::build(zero_dim); }) ==
        "tensor 'embed': shape [100, 0] has a non-positive dimension 0");

  auto bad_dtype = small_specs();
  bad_dtype[1].dtype = static_cast<DType>(42);
  CHECK_THAT(message_of([&] { Layout::build(bad_dtype); }),
             Catch::Contains("unsupported dtype value 42"));

  CHECK_THAT(message_of([&] { Layout::build({}); }), Catch::Contains("no tensor specs"));
  CHECK_THAT(message_of([&] { Layout::build(small_specs(), {.bucket_bytes = 1000}); }),
             Catch::Contains("bucket size 1000 B") && Catch::Contains("multiple of 256"));
  CHECK_THAT(message_of([&] { Layout::build(small_specs(), {.bucket_bytes = 0}); }),
             Catch::Contains("bucket size 0 B"));
}

TEST_CASE("sizes that would wrap a size_t are refused with the tensor named") {
  // 2^62 fp32 elements are 2^64 bytes: the arena must not wrap to 0.
  CHECK_THAT(message_of([] { Layout::build({{"x", DType::kFloat32, {std::int64_t{1} << 62}}}); }),
             Catch::Contains("tensor 'x': shape [4611686018427387904] of fp32") &&
                 Catch::Contains("more than the 72057594037927936 bytes"));
  // Each below the limit, together past it: the offsets must not wrap either.
  const std::int64_t half = std::int64_t{1} << 53;  // fp32: 2^55 bytes each
  CHECK_THAT(message_of([&] {
               Layout::build({{"a", DType::kFloat32, {half}},
                              {"b", DType::kFloat32, {half}},
                              {"c", DType::kFloat32, {half}}});
             }),
             Catch::Contains("tensor 'c' (36028797018963968 bytes at offset 72057594037927936) "
                             "takes group 'base' past"));
}

TEST_CASE("group lookup names the unknown group and the known ones") {
  const Layout layout = Layout::build(small_specs());
  CHECK(layout.group_index("adapter_a") == 1);
  CHECK(message_of([&] { (void)layout.group_index("adapter_x"); }) ==
        "unknown group 'adapter_x' (the layout has: base, adapter_a)");
}

TEST_CASE("dtype names parse, including torch spellings, and unknown ones are refused") {
  CHECK(dtype_from_string("bf16") == DType::kBFloat16);
  CHECK(dtype_from_string("torch.bfloat16") == DType::kBFloat16);
  CHECK(dtype_from_string("float16") == DType::kFloat16);
  CHECK(dtype_from_string("torch.float8_e4m3fn") == DType::kFloat8E4M3);
  CHECK(dtype_size(DType::kFloat32) == 4);
  CHECK(dtype_name(DType::kInt64) == "int64");
  CHECK_THAT(message_of([] { dtype_from_string("complex64"); }),
             Catch::Contains("unsupported dtype 'complex64'") && Catch::Contains("bf16"));
}
