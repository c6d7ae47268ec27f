// bf16 and fp16 conversions against their definition: every 16-bit pattern survives a round trip
// through float, and float -> 16 bit picks the nearest representable value (ties to even) --
// checked against both neighbours for a million pseudo-random floats of every magnitude.
#include <gtest/gtest.h>

#include <cmath>

#include "backend/dtype.hpp"
#include "core/random.hpp"

using namespace shardtrain;

namespace {

void expect_nearest(DType t) {
  uint64_t state = 12345;
  int checked = 0;
  for (int i = 0; i < 1000000; i++) {
    state = mix64(state);
    const float f = bits_float(static_cast<uint32_t>(state));
    const float limit = t == DTYPE_FP16 ? 65504.0f : 3.0e38f;
    if (std::isnan(f) || std::fabs(f) > limit) continue;
    const uint16_t h = float_to_half(f, t);
    const double got = half_to_float(h, t);
    ASSERT_EQ(std::signbit(got), std::signbit(f)) << f;
    const double err = std::fabs(got - f);
    for (int step : {-1, 1}) {  // the neighbours in magnitude, same sign
      const uint16_t n = static_cast<uint16_t>(h + step);
      if ((n & 0x7FFF) == 0x7FFF || ((h & 0x7FFF) == 0 && step < 0)) continue;
      const double other = half_to_float(n, t);
      if (std::isinf(other) || std::signbit(other) != std::signbit(got)) continue;
      ASSERT_LE(err, std::fabs(other - f)) << dtype_name(t) << " " << f << " -> " << got << " but " << other;
      if (err == std::fabs(other - f)) {  // a tie: to even
        ASSERT_EQ(h & 1, 0) << "tie not to even: " << f;
      }
    }
    checked++;
  }
  EXPECT_GT(checked, 400000);  // random bit patterns: about half exceed fp16's range
}

}  // namespace

TEST(DType, EveryHalfPatternRoundTrips) {
  for (DType t : {DTYPE_BF16, DTYPE_FP16}) {
    for (uint32_t h = 0; h < 65536; h++) {
      const float f = half_to_float(static_cast<uint16_t>(h), t);
      if (std::isnan(f)) {
        EXPECT_TRUE(std::isnan(half_to_float(float_to_half(f, t), t)));
        continue;
      }
      ASSERT_EQ(float_to_half(f, t), h) << dtype_name(t) << " pattern " << h;
    }
  }
}

TEST(DType, Bf16RoundsToNearestEven) { expect_nearest(DTYPE_BF16); }
TEST(DType, Fp16RoundsToNearestEven) { expect_nearest(DTYPE_FP16); }

TEST(DType, Fp16OverflowAndUnderflow) {
  EXPECT_EQ(fp16_to_float(float_to_fp16(65504.0f)), 65504.0f);
  EXPECT_TRUE(std::isinf(fp16_to_float(float_to_fp16(65520.0f))));  // halfway to 2^16 rounds up
  EXPECT_EQ(fp16_to_float(float_to_fp16(65519.0f)), 65504.0f);
  EXPECT_EQ(fp16_to_float(float_to_fp16(5.9604644775390625e-8f)), 5.9604644775390625e-8f);  // 2^-24
  EXPECT_EQ(fp16_to_float(float_to_fp16(2.98e-8f)), 0.0f);
  EXPECT_TRUE(std::isinf(bf16_to_float(float_to_bf16(INFINITY))));
}
