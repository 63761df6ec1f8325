// The CUDA backend's integrity kernels (plugin/backends/cuda/integrity_kernels.cu) against the host
// backend's implementation of the same definitions (plugin/core/integrity.h): a checksum computed
// by the receiver's GPU must equal the one the sender's host or GPU computed, bit for bit, for any
// length (tail bytes included) at any 8-byte-aligned start (buckets start 256-aligned; an unaligned
// start is refused with a clear error), and the non-finite count must be exact for each dtype.
// The FP8 quantization kernels (fp8_kernels.cu) likewise against the host's (fp8_quantize.h).
// One GPU; skips (77) without one.
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "shadowsync/cuda_backend.h"
#include "shadowsync/dtype.h"
#include "shadowsync/host_backend.h"

namespace {

using namespace shadowsync;

std::uint64_t host_checksum(HostBackend& host, const std::vector<std::byte>& bytes,
                            std::size_t offset, std::size_t length) {
  std::uint64_t result = 0;
  auto stream = host.create_stream(StreamPriority::kNormal);
  host.checksum_async(bytes.data() + offset, length, &result, *stream);
  host.stream_synchronize(*stream);
  return result;
}

std::uint64_t host_nonfinite(HostBackend& host, const std::vector<std::byte>& bytes,
                             std::size_t elements, DType dtype, std::size_t first = 0) {
  std::uint64_t result = 0;
  auto stream = host.create_stream(StreamPriority::kNormal);
  host.count_nonfinite_async(bytes.data() + first * dtype_size(dtype), elements, dtype, &result,
                             *stream);
  host.stream_synchronize(*stream);
  return result;
}

// Runs `enqueue(device_data, device_result, stream)` on the GPU over a copy of `bytes`.
template <typename Enqueue>
std::uint64_t on_gpu(CudaBackend& gpu, const std::vector<std::byte>& bytes, Enqueue&& enqueue) {
  DeviceBuffer data(gpu, bytes.size() + 1);
  DeviceBuffer result(gpu, sizeof(std::uint64_t));
  REQUIRE(cudaMemcpy(data.data(), bytes.data(), bytes.size(), cudaMemcpyHostToDevice) ==
          cudaSuccess);
  auto stream = gpu.create_stream(StreamPriority::kLow);
  enqueue(data.data(), reinterpret_cast<std::uint64_t*>(result.data()), *stream);
  gpu.stream_synchronize(*stream);
  std::uint64_t value = 0;
  REQUIRE(cudaMemcpy(&value, result.data(), sizeof value, cudaMemcpyDeviceToHost) == cudaSuccess);
  return value;
}

}  // namespace

TEST_CASE("integrity kernels: the GPU checksum equals the host's for every length and offset") {
  CudaBackend gpu(0);
  HostBackend host;
  REQUIRE(gpu.supports_integrity());
  std::mt19937_64 random(42);
  std::vector<std::byte> bytes((std::size_t{8} << 20) + 13);
  for (auto& b : bytes) b = static_cast<std::byte>(random());
  // Lengths around word and block boundaries, a large one, and offsets that break alignment.
  const std::size_t lengths[] = {0, 1, 7, 8, 9, 63, 64, 65, 4095, 4096, 4097, 1'000'003,
                                 (std::size_t{8} << 20)};
  for (const std::size_t offset : {std::size_t{0}, std::size_t{8}, std::size_t{256}}) {
    for (const std::size_t length : lengths) {
      if (offset + length > bytes.size()) continue;
      INFO("offset " << offset << " length " << length);
      const std::uint64_t expected = host_checksum(host, bytes, offset, length);
      const std::uint64_t seen = on_gpu(gpu, bytes, [&](std::byte* d, std::uint64_t* r, Stream& s) {
        gpu.checksum_async(d + offset, length, r, s);
      });
      CHECK(seen == expected);
    }
  }
  // The kernel reads whole words: an unaligned start is refused, naming the pointer.
  CHECK_THROWS_WITH(on_gpu(gpu, bytes,
                           [&](std::byte* d, std::uint64_t* r, Stream& s) {
                             gpu.checksum_async(d + 3, 64, r, s);
                           }),
                    Catch::Contains("8-byte aligned"));
  // A single flipped bit changes the GPU's checksum too.
  const std::uint64_t before = on_gpu(gpu, bytes, [&](std::byte* d, std::uint64_t* r, Stream& s) {
    gpu.checksum_async(d, bytes.size(), r, s);
  });
  bytes[bytes.size() / 3] ^= std::byte{0x10};
  const std::uint64_t after = on_gpu(gpu, bytes, [&](std::byte* d, std::uint64_t* r, Stream& s) {
    gpu.checksum_async(d, bytes.size(), r, s);
  });
  CHECK(before != after);
}

TEST_CASE("integrity kernels: the GPU counts exactly the NaN and Inf elements of each dtype") {
  CudaBackend gpu(0);
  HostBackend host;
  std::mt19937_64 random(7);
  struct Case {
    DType dtype;
    std::size_t element_bytes;
    std::vector<std::uint32_t> nonfinite;  // bit patterns: NaNs and infinities
  };
  const Case cases[] = {
      {DType::kFloat32, 4, {0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u, 0xffffffffu}},
      {DType::kFloat16, 2, {0x7c00u, 0xfc00u, 0x7e00u, 0x7c01u, 0xffffu}},
      {DType::kBFloat16, 2, {0x7f80u, 0xff80u, 0x7fc0u, 0x7f81u, 0xffffu}},
  };
  for (const Case& c : cases) {
    INFO("dtype " << dtype_name(c.dtype));
    const std::size_t elements = 1'000'001;
    std::vector<std::byte> bytes(elements * c.element_bytes);
    // Finite values everywhere (a small exponent), then non-finite ones at random places.
    for (std::size_t i = 0; i < elements; ++i) {
      const std::uint32_t finite =
          c.element_bytes == 4 ? 0x3f800000u | (random() & 0x7fffffu) : 0x3c00u | (random() & 0x3ffu);
      std::memcpy(bytes.data() + i * c.element_bytes, &finite, c.element_bytes);
    }
    std::size_t planted = 0;
    for (std::size_t k = 0; k < 100; ++k) {
      const std::size_t at = (random() % (elements / 100)) + k * (elements / 100);
      const std::uint32_t bits = c.nonfinite[k % c.nonfinite.size()];
      std::memcpy(bytes.data() + at * c.element_bytes, &bits, c.element_bytes);
      ++planted;
    }
    const std::uint64_t expected = host_nonfinite(host, bytes, elements, c.dtype);
    CHECK(expected == planted);
    const std::uint64_t seen = on_gpu(gpu, bytes, [&](std::byte* d, std::uint64_t* r, Stream& s) {
      gpu.count_nonfinite_async(d, elements, c.dtype, r, s);
    });
    CHECK(seen == expected);
    // Element-aligned starts that are not 16-byte aligned, and lengths around the kernel's
    // 16-byte vectors: the elements before the first vector and after the last count too. A
    // non-finite element at either end of each range.
    for (const std::size_t first : {std::size_t{1}, std::size_t{3}, std::size_t{5}}) {
      for (const std::size_t length : {std::size_t{1}, std::size_t{2}, std::size_t{7},
                                       std::size_t{9}, std::size_t{17}, std::size_t{1001},
                                       elements - first - 1}) {
        INFO("first element " << first << ", " << length << " elements");
        std::vector<std::byte> ends = bytes;
        for (const std::size_t at : {first, first + length - 1}) {
          std::memcpy(ends.data() + at * c.element_bytes, &c.nonfinite[0], c.element_bytes);
        }
        const std::uint64_t want = host_nonfinite(host, ends, length, c.dtype, first);
        CHECK(want >= 1);
        const std::uint64_t got = on_gpu(gpu, ends, [&](std::byte* d, std::uint64_t* r, Stream& s) {
          gpu.count_nonfinite_async(d + first * c.element_bytes, length, c.dtype, r, s);
        });
        CHECK(got == want);
      }
    }
  }
}

// Quantizes `src` (`elements` of `dtype` in `parts` parts) on the host and on the GPU, the GPU's
// copy placed `device_offset` bytes into its buffer (an offset that is not 16-byte aligned takes
// the kernels' element-by-element path); checks that bytes and scales are the host's.
void check_quantized_as_host(CudaBackend& gpu, HostBackend& host, const std::vector<std::byte>& src,
                             DType dtype, std::size_t elements, std::size_t parts,
                             std::size_t device_offset = 0) {
  std::vector<std::uint8_t> want(elements);
  std::vector<float> want_scales(parts);
  auto stream = host.create_stream(StreamPriority::kNormal);
  host.quantize_fp8_async(src.data(), dtype, elements, parts, want.data(), want_scales.data(),
                          *stream);
  host.stream_synchronize(*stream);

  DeviceBuffer d_src(gpu, src.size() + device_offset);
  DeviceBuffer d_dst(gpu, elements + device_offset);
  DeviceBuffer d_scales(gpu, parts * sizeof(float));
  auto* source = static_cast<std::byte*>(d_src.data()) + device_offset;
  auto* dst = static_cast<std::byte*>(d_dst.data()) + device_offset;
  REQUIRE(cudaMemcpy(source, src.data(), src.size(), cudaMemcpyHostToDevice) == cudaSuccess);
  auto gpu_stream = gpu.create_stream(StreamPriority::kLow);
  gpu.quantize_fp8_async(source, dtype, elements, parts, dst,
                         reinterpret_cast<float*>(d_scales.data()), *gpu_stream);
  gpu.stream_synchronize(*gpu_stream);
  std::vector<std::uint8_t> got(elements);
  std::vector<float> got_scales(parts);
  REQUIRE(cudaMemcpy(got.data(), dst, elements, cudaMemcpyDeviceToHost) == cudaSuccess);
  REQUIRE(cudaMemcpy(got_scales.data(), d_scales.data(), parts * sizeof(float),
                     cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(std::memcmp(got_scales.data(), want_scales.data(), parts * sizeof(float)) == 0);
  std::size_t differ = 0;
  std::size_t first = elements;
  for (std::size_t i = 0; i < elements; ++i) {
    if (got[i] != want[i]) {
      ++differ;
      first = std::min(first, i);
    }
  }
  INFO("first difference at element " << first);
  CHECK(differ == 0);
}

TEST_CASE("fp8 kernels: the GPU quantizes bit for bit as the host, per part") {
  // What the receiver runs in the shadow for an engine with quantization="fp8": random weights of
  // several magnitudes per part (so each part has its own scale), one all-zero part, lengths that
  // are not multiples of a warp or a block (element by element) and one that is a multiple of a
  // 16-byte vector (the vector kernels); bf16, fp16 and fp32 sources.
  CudaBackend gpu(0);
  HostBackend host;
  std::mt19937 random(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const DType dtype : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    for (const std::size_t parts : {std::size_t{1}, std::size_t{8}}) {
      for (const std::size_t per_part :
           {std::size_t{1}, std::size_t{33}, std::size_t{70'001}, std::size_t{65'536}}) {
        INFO(dtype_name(dtype) << ", " << parts << " parts of " << per_part << " elements");
        const std::size_t elements = parts * per_part;
        std::vector<std::byte> src(elements * dtype_size(dtype));
        for (std::size_t i = 0; i < elements; ++i) {
          const std::size_t part = i / per_part;
          const float value = part == parts - 1 && parts > 1
                                  ? 0.0f  // the last of several parts: all zeros
                                  : normal(random) * std::ldexp(1.0f, static_cast<int>(part) - 4);
          if (dtype == DType::kFloat32) {
            std::memcpy(src.data() + i * 4, &value, 4);
          } else {
            // bf16: the top half of the float; fp16: the host's conversion through the GPU's.
            std::uint32_t bits = 0;
            std::memcpy(&bits, &value, 4);
            std::uint16_t half = 0;
            if (dtype == DType::kBFloat16) {
              half = static_cast<std::uint16_t>(bits >> 16);
            } else {
              const __half h = __float2half(value);
              std::memcpy(&half, &h, 2);
            }
            std::memcpy(src.data() + i * 2, &half, 2);
          }
        }
        check_quantized_as_host(gpu, host, src, dtype, elements, parts);
      }
    }
  }
}

TEST_CASE("fp8 kernels: every bf16 value the clamp lets through converts as the host's") {
  // One part holding every bf16 value of magnitude at most 448, 448 itself among them, and two
  // NaNs: its scale is 1, so each value reaches the conversion as it is (subnormal e4m3 results,
  // ties between two codes, both signs, both zeros). Through the vector kernels, then element by element (the
  // device copy two bytes off a 16-byte boundary).
  CudaBackend gpu(0);
  HostBackend host;
  std::vector<std::uint16_t> values;
  for (std::uint32_t bits = 0; bits <= 0xffffu; ++bits) {
    std::uint32_t word = bits << 16;
    float value = 0.0f;
    std::memcpy(&value, &word, 4);
    if (std::isfinite(value) && std::fabs(value) <= 448.0f) {
      values.push_back(static_cast<std::uint16_t>(bits));
    }
  }
  // NaNs of both signs: the clamp makes them 448 (the reduction's fmaxf skips them).
  values.push_back(0x7fc0u);
  values.push_back(0xffc1u);
  while (values.size() % 8 != 0) values.push_back(0);
  std::vector<std::byte> src(values.size() * 2);
  std::memcpy(src.data(), values.data(), src.size());
  INFO(values.size() << " bf16 values");
  check_quantized_as_host(gpu, host, src, DType::kBFloat16, values.size(), 1);
  check_quantized_as_host(gpu, host, src, DType::kBFloat16, values.size(), 1, 2);
}
