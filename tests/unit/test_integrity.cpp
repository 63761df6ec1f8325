// The integrity functions (plugin/core/integrity.h) as the HostBackend runs them: the per-bucket
// checksum (tail bytes, single bit flips, swapped words) and the non-finite test of fp32, fp16 and
// bf16 (every NaN and infinity encoding flagged; finite extremes, subnormals and -0 not).
//
// How each test was checked to fail: dropping the tail word in HostBackend::checksum_async (bytes
// rounded down to a multiple of 8) failed the tail and bit-flip tests; dropping the index from
// checksum_term failed the swapped-words test; testing only the exponent's top bit in
// bf16_nonfinite failed the exhaustive bf16 test and the finite-extremes list.
#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>
#include <vector>

#include <fmt/format.h>

#include "core/integrity.h"
#include "shadowsync/host_backend.h"

using namespace shadowsync;

namespace {

// Distinct, irregular bytes: no two 8-byte words alike.
std::vector<std::byte> sample_bytes(std::size_t n) {
  std::vector<std::byte> bytes(n);
  std::uint64_t x = 0x243f6a8885a308d3ull;
  for (auto& b : bytes) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    b = static_cast<std::byte>(x >> 56);
  }
  return bytes;
}

class Checker {
 public:
  Checker() : stream_(backend_.create_stream(StreamPriority::kNormal)) {}

  std::uint64_t checksum(const std::vector<std::byte>& bytes) {
    std::uint64_t result = 0;
    backend_.checksum_async(bytes.data(), bytes.size(), &result, *stream_);
    backend_.stream_synchronize(*stream_);
    return result;
  }
  template <typename Bits>
  std::uint64_t count_nonfinite(const std::vector<Bits>& elements, DType dtype) {
    std::uint64_t result = ~std::uint64_t{0};
    backend_.count_nonfinite_async(elements.data(), elements.size(), dtype, &result, *stream_);
    backend_.stream_synchronize(*stream_);
    return result;
  }

 private:
  HostBackend backend_;
  std::unique_ptr<Stream> stream_;
};

// integrity.h's definition, written out: 8-byte little-endian words, the last one zero-padded.
std::uint64_t reference_checksum(const std::vector<std::byte>& bytes) {
  std::uint64_t sum = 0;
  for (std::size_t index = 0; index * 8 < bytes.size(); ++index) {
    std::uint64_t word = 0;
    for (std::size_t i = 0; i < 8 && index * 8 + i < bytes.size(); ++i) {
      word |= std::uint64_t(std::to_integer<std::uint8_t>(bytes[index * 8 + i])) << (8 * i);
    }
    sum += integrity::checksum_term(word, index);
  }
  return sum;
}

}  // namespace

TEST_CASE("checksum: lengths that are not a multiple of 8 include every tail byte") {
  Checker checker;
  CHECK(checker.checksum({}) == 0);
  for (std::size_t n = 1; n <= 40; ++n) {
    CAPTURE(n);
    std::vector<std::byte> bytes = sample_bytes(n);
    const std::uint64_t sum = checker.checksum(bytes);
    CHECK(sum == reference_checksum(bytes));
    // The last byte, whichever lane of the padded word it sits in, counts.
    bytes.back() ^= std::byte{0x01};
    CHECK(checker.checksum(bytes) != sum);
  }
}

TEST_CASE("checksum: a single flipped bit anywhere changes it") {
  Checker checker;
  for (const std::size_t n : {std::size_t{8}, std::size_t{37}, std::size_t{64}}) {
    const std::vector<std::byte> original = sample_bytes(n);
    const std::uint64_t sum = checker.checksum(original);
    std::set<std::uint64_t> seen{sum};
    for (std::size_t bit = 0; bit < 8 * n; ++bit) {
      std::vector<std::byte> flipped = original;
      flipped[bit / 8] ^= static_cast<std::byte>(1u << (bit % 8));
      INFO(fmt::format("{} bytes, bit {} flipped", n, bit));
      CHECK(checker.checksum(flipped) != sum);
      seen.insert(checker.checksum(flipped));
    }
    CHECK(seen.size() == 8 * n + 1);  // and no two flips collide
  }
}

TEST_CASE("checksum: swapped or shifted words change it") {
  Checker checker;
  const std::vector<std::byte> original = sample_bytes(8 * 6);
  const std::uint64_t sum = checker.checksum(original);
  for (std::size_t i = 0; i < 6; ++i) {
    for (std::size_t j = i + 1; j < 6; ++j) {
      std::vector<std::byte> swapped = original;
      std::swap_ranges(swapped.begin() + 8 * i, swapped.begin() + 8 * i + 8,
                       swapped.begin() + 8 * j);
      INFO(fmt::format("words {} and {} swapped", i, j));
      CHECK(checker.checksum(swapped) != sum);
    }
  }
  // The same words one position later (a bucket received at the wrong offset).
  std::vector<std::byte> shifted(8, std::byte{0});
  shifted.insert(shifted.end(), original.begin(), original.end() - 8);
  CHECK(checker.checksum(shifted) != sum);
}

namespace {

struct Encoding {
  std::uint32_t bits;
  const char* what;
};

// Every class of non-finite encoding: ±infinity, quiet and signalling NaNs of both signs, the
// NaN with every mantissa bit set.
constexpr std::array kFp32NonFinite = {
    Encoding{0x7f800000u, "+inf"},      Encoding{0xff800000u, "-inf"},
    Encoding{0x7fc00000u, "quiet NaN"}, Encoding{0xffc00000u, "-quiet NaN"},
    Encoding{0x7f800001u, "signalling NaN"}, Encoding{0xff800001u, "-signalling NaN"},
    Encoding{0x7fffffffu, "NaN, all mantissa bits"}, Encoding{0xffffffffu, "-NaN, all bits"}};
constexpr std::array kFp32Finite = {
    Encoding{0x00000000u, "+0"},           Encoding{0x80000000u, "-0"},
    Encoding{0x7f7fffffu, "max"},          Encoding{0xff7fffffu, "-max"},
    Encoding{0x00800000u, "min normal"},   Encoding{0x00000001u, "min subnormal"},
    Encoding{0x007fffffu, "max subnormal"}, Encoding{0x807fffffu, "-max subnormal"},
    Encoding{0x3f800000u, "1"},            Encoding{0x7f000000u, "2^127"}};
constexpr std::array kFp16NonFinite = {
    Encoding{0x7c00u, "+inf"},           Encoding{0xfc00u, "-inf"},
    Encoding{0x7e00u, "quiet NaN"},      Encoding{0xfe00u, "-quiet NaN"},
    Encoding{0x7c01u, "signalling NaN"}, Encoding{0xfc01u, "-signalling NaN"},
    Encoding{0x7fffu, "NaN, all bits"},  Encoding{0xffffu, "-NaN, all bits"}};
constexpr std::array kFp16Finite = {
    Encoding{0x0000u, "+0"},         Encoding{0x8000u, "-0"},
    Encoding{0x7bffu, "max (65504)"}, Encoding{0xfbffu, "-max"},
    Encoding{0x0400u, "min normal"}, Encoding{0x0001u, "min subnormal"},
    Encoding{0x03ffu, "max subnormal"}, Encoding{0x83ffu, "-max subnormal"},
    Encoding{0x3c00u, "1"},          Encoding{0x7800u, "2^15"}};
constexpr std::array kBf16NonFinite = {
    Encoding{0x7f80u, "+inf"},           Encoding{0xff80u, "-inf"},
    Encoding{0x7fc0u, "quiet NaN"},      Encoding{0xffc0u, "-quiet NaN"},
    Encoding{0x7f81u, "signalling NaN"}, Encoding{0xff81u, "-signalling NaN"},
    Encoding{0x7fffu, "NaN, all bits"},  Encoding{0xffffu, "-NaN, all bits"}};
constexpr std::array kBf16Finite = {
    Encoding{0x0000u, "+0"},         Encoding{0x8000u, "-0"},
    Encoding{0x7f7fu, "max"},        Encoding{0xff7fu, "-max"},
    Encoding{0x0080u, "min normal"}, Encoding{0x0001u, "min subnormal"},
    Encoding{0x007fu, "max subnormal"}, Encoding{0x807fu, "-max subnormal"},
    Encoding{0x3f80u, "1"},          Encoding{0x7f00u, "2^127"}};

template <typename Bits, std::size_t N, std::size_t M>
void check_encodings(DType dtype, bool (*nonfinite)(Bits), const std::array<Encoding, N>& bad,
                     const std::array<Encoding, M>& good) {
  Checker checker;
  std::vector<Bits> all;
  for (const Encoding& e : bad) {
    INFO(fmt::format("{} {} ({:#x})", dtype_name(dtype), e.what, e.bits));
    CHECK(nonfinite(static_cast<Bits>(e.bits)));
    CHECK(checker.count_nonfinite(std::vector<Bits>{static_cast<Bits>(e.bits)}, dtype) == 1);
    all.push_back(static_cast<Bits>(e.bits));
  }
  for (const Encoding& e : good) {
    INFO(fmt::format("{} {} ({:#x})", dtype_name(dtype), e.what, e.bits));
    CHECK_FALSE(nonfinite(static_cast<Bits>(e.bits)));
    CHECK(checker.count_nonfinite(std::vector<Bits>{static_cast<Bits>(e.bits)}, dtype) == 0);
    all.push_back(static_cast<Bits>(e.bits));
  }
  // Mixed in one tensor, the count is exact.
  CHECK(checker.count_nonfinite(all, dtype) == N);
}

}  // namespace

TEST_CASE("non-finite: every NaN and infinity encoding is flagged, finite values are not") {
  SECTION("fp32") {
    check_encodings<std::uint32_t>(DType::kFloat32, integrity::fp32_nonfinite, kFp32NonFinite,
                                   kFp32Finite);
  }
  SECTION("fp16") {
    check_encodings<std::uint16_t>(DType::kFloat16, integrity::fp16_nonfinite, kFp16NonFinite,
                                   kFp16Finite);
  }
  SECTION("bf16") {
    check_encodings<std::uint16_t>(DType::kBFloat16, integrity::bf16_nonfinite, kBf16NonFinite,
                                   kBf16Finite);
  }
}

TEST_CASE("non-finite: bf16 and fp16 agree with the C library on all 65,536 encodings") {
  std::uint32_t bf16_bad = 0;
  std::uint32_t fp16_bad = 0;
  for (std::uint32_t bits = 0; bits <= 0xffff; ++bits) {
    // bf16 is the top half of an fp32: the C library's classification is the reference.
    const std::uint32_t widened = bits << 16;
    float value = 0;
    std::memcpy(&value, &widened, sizeof value);
    if (integrity::bf16_nonfinite(static_cast<std::uint16_t>(bits)) != !std::isfinite(value)) {
      FAIL(fmt::format("bf16 {:#06x}: bf16_nonfinite says {}, std::isfinite says {}", bits,
                       integrity::bf16_nonfinite(static_cast<std::uint16_t>(bits)),
                       std::isfinite(value)));
    }
    bf16_bad += integrity::bf16_nonfinite(static_cast<std::uint16_t>(bits)) ? 1 : 0;
    fp16_bad += integrity::fp16_nonfinite(static_cast<std::uint16_t>(bits)) ? 1 : 0;
  }
  // An all-ones exponent with any sign and mantissa: 2 × 2^7 for bf16, 2 × 2^10 for fp16.
  CHECK(bf16_bad == 2 * 128);
  CHECK(fp16_bad == 2 * 1024);
}

TEST_CASE("integrity calls refuse unusable arguments, naming the call, before enqueueing") {
  HostBackend backend;
  auto stream = backend.create_stream(StreamPriority::kNormal);
  std::vector<std::byte> bytes(64);
  std::uint64_t result = 12345;  // untouched by every refused call
  CHECK_THROWS_WITH(backend.checksum_async(bytes.data(), bytes.size(), nullptr, *stream),
                    Catch::Contains("HostBackend::checksum_async") &&
                        Catch::Contains("must be non-null") && Catch::Contains("(64 bytes)"));
  CHECK_THROWS_WITH(backend.checksum_async(nullptr, 8, &result, *stream),
                    Catch::Contains("HostBackend::checksum_async") && Catch::Contains("(8 bytes)"));
  CHECK_THROWS_WITH(
      backend.count_nonfinite_async(bytes.data(), 8, DType::kInt8, &result, *stream),
      "HostBackend::count_nonfinite_async: dtype int8 has no non-finite check (fp32, fp16 and "
      "bf16 have)");
  CHECK_THROWS_WITH(
      backend.count_nonfinite_async(nullptr, 3, DType::kBFloat16, &result, *stream),
      Catch::Contains("HostBackend::count_nonfinite_async") && Catch::Contains("(3 bf16 elements)"));
  backend.stream_synchronize(*stream);
  CHECK(result == 12345);
  // Null data is fine for zero bytes or elements: the result is then 0.
  backend.checksum_async(nullptr, 0, &result, *stream);
  backend.stream_synchronize(*stream);
  CHECK(result == 0);
}
