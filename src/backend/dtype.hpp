// Element types of the mixed-precision options and their conversions. On the CPU, bf16 and fp16
// are storage and wire formats only: parameters are gathered and gradients reduced in them, and
// every computation widens to fp32. Conversions round to nearest even, as the CUDA intrinsics do
// (__float2bfloat16_rn, __float2half_rn), and are HOST_DEVICE so both backends share them.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "backend/math.hpp"

namespace shardtrain {

enum DType { DTYPE_FP32, DTYPE_BF16, DTYPE_FP16 };

inline const char* dtype_name(DType t) { return t == DTYPE_FP32 ? "fp32" : (t == DTYPE_BF16 ? "bf16" : "fp16"); }
inline size_t dtype_bytes(DType t) { return t == DTYPE_FP32 ? 4 : 2; }
// As torch names it (config.json's torch_dtype, bitsandbytes' quant_state).
inline const char* torch_dtype_name(DType t) {
  return t == DTYPE_FP32 ? "float32" : (t == DTYPE_BF16 ? "bfloat16" : "float16");
}

HOST_DEVICE inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
HOST_DEVICE inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

HOST_DEVICE inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays a quiet NaN
  u += 0x7FFFu + ((u >> 16) & 1u);                                                     // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}
HOST_DEVICE inline float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// IEEE binary16: 1 sign, 5 exponent (bias 15), 10 mantissa bits; overflow goes to inf.
HOST_DEVICE inline uint16_t float_to_fp16(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return sign | 0x7E00u;                 // NaN
  if (abs >= 0x477FF000u) return sign | 0x7C00u;                // >= 65520 rounds to inf
  if (abs < 0x38800000u) {                                      // below 2^-14: subnormal or zero
    // |f| = m * 2^(e-150) with the 24-bit significand m; in units of the smallest subnormal
    // (2^-24) that is m >> (126 - e), rounded to nearest even.
    const uint32_t mantissa = (abs & 0x7FFFFFu) | 0x800000u;
    const int shift = 126 - static_cast<int>(abs >> 23);
    if (shift > 24) return sign;                                // < 2^-25: rounds to zero
    const uint32_t kept = mantissa >> shift, rest = mantissa & ((1u << shift) - 1u), half = 1u << (shift - 1);
    return sign | static_cast<uint16_t>(kept + (rest > half || (rest == half && (kept & 1u))));
  }
  const uint32_t rounded = abs + 0xFFFu + ((abs >> 13) & 1u);   // round mantissa to 10 bits, nearest even
  return sign | static_cast<uint16_t>((rounded - 0x38000000u) >> 13);  // rebias exponent 127 -> 15
}
HOST_DEVICE inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
  if (exponent == 0x1F) return bits_float(sign | 0x7F800000u | (mantissa << 13));   // inf / NaN
  if (exponent != 0) return bits_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
  return (h & 0x8000u ? -1.0f : 1.0f) * static_cast<float>(mantissa) * 5.9604644775390625e-8f;  // subnormal: m * 2^-24
}

HOST_DEVICE inline uint16_t float_to_half(float f, DType t) { return t == DTYPE_BF16 ? float_to_bf16(f) : float_to_fp16(f); }
HOST_DEVICE inline float half_to_float(uint16_t h, DType t) { return t == DTYPE_BF16 ? bf16_to_float(h) : fp16_to_float(h); }

}  // namespace shardtrain
