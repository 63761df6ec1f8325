// Per-tensor FP8 quantization as vLLM 0.25 computes it after loading (quantization="fp8" on an
// unquantized checkpoint: its dynamic per-tensor scaled_fp8_quant): scale = max|x| / 448 in
// float32 (no lower bound), the reciprocal 1 / scale once, each element x * reciprocal clamped
// to [-448, 448] with fminf/fmaxf (a NaN product, 0 * inf of an all-zero part, becomes 448) and
// rounded to the nearest float8_e4m3fn, ties to even. Plain inline functions that compile as
// host code and, under nvcc, as device code too, so HostBackend and CudaBackend produce the same
// bytes. Not installed.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/host_device.h"

namespace shadowsync::fp8 {

inline constexpr float kE4M3Max = 448.0f;

SHADOWSYNC_HOST_DEVICE inline float bits_to_float(std::uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

SHADOWSYNC_HOST_DEVICE inline float bf16_to_float(std::uint16_t bits) {
  return bits_to_float(static_cast<std::uint32_t>(bits) << 16);
}

SHADOWSYNC_HOST_DEVICE inline float fp16_to_float(std::uint16_t bits) {
  const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
  const std::uint32_t exponent = (bits >> 10) & 0x1fu;
  const std::uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0x1fu) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  // Subnormal half: mantissa * 2^-24, exact in float.
  const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-08f;
  return sign ? -magnitude : magnitude;
}

// The scale of a part whose largest magnitude is `amax`.
SHADOWSYNC_HOST_DEVICE inline float scale_of(float amax) { return amax / kE4M3Max; }

// float8_e4m3fn of `x`, rounded to nearest, ties to even, saturated to +-448 (no infinities in
// the format); NaN stays NaN (0x7f with its sign).
SHADOWSYNC_HOST_DEVICE inline std::uint8_t e4m3_from_float(float x) {
  std::uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const std::uint8_t sign = static_cast<std::uint8_t>((bits >> 24) & 0x80u);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x7fffffu) != 0) return sign | 0x7fu;
  float a = std::fabs(x);
  if (!(a < kE4M3Max)) return sign | 0x7eu;  // 448 and above (infinity included)
  int exponent = 0;
  std::frexp(a, &exponent);  // a = f * 2^exponent, f in [0.5, 1)
  int e = exponent - 1;      // a in [2^e, 2^(e+1))
  if (e < -6) e = -6;        // below the smallest normal: subnormal steps of 2^-9
  // Steps of 2^(e-3) (3 mantissa bits); a / step is exact (a power of two), rounding is RNE.
  float steps = std::nearbyint(std::ldexp(a, 3 - e));
  if (steps >= 16.0f) {  // rounded up into the next binade
    ++e;
    steps = 8.0f;
  }
  const int q = static_cast<int>(steps);
  if (q < 8) return sign | static_cast<std::uint8_t>(q);  // subnormal (e == -6) or zero
  const int code = ((e + 7) << 3) | (q - 8);
  return sign | static_cast<std::uint8_t>(code > 0x7e ? 0x7e : code);
}

// One element of a part with scale `scale` (its reciprocal computed once per part, as vLLM's
// kernel does).
SHADOWSYNC_HOST_DEVICE inline std::uint8_t quantize(float x, float inverse_scale) {
  return e4m3_from_float(fmaxf(-kE4M3Max, fminf(x * inverse_scale, kE4M3Max)));
}

}  // namespace shadowsync::fp8
