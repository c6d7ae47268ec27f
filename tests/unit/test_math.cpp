// The shared per-element math (backend/math.hpp) and the counter RNG (core/random.hpp) against
// independent formulas: exp_fast against libm over its range and at its clamped ends, GELU's
// sigmoid form against GPT-2's tanh form, its derivative against finite differences, SiLU against
// x (1 + tanh(x/2)) / 2 and its derivative against finite differences and in the tails, the counter
// RNG's moments, AdamW's element update, its clipping factor and fused step, and the LR schedule.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "backend/layer_ops.hpp"
#include "backend/math.hpp"
#include "core/random.hpp"
#include "optim/adamw.hpp"

using namespace shardtrain;

namespace {

// Relative error of exp_fast(x) against libm's exp in double; x is taken as the float it is.
double exp_fast_error(float x) {
  const double ref = std::exp(static_cast<double>(x));
  return std::fabs(exp_fast(x) - ref) / ref;
}

}  // namespace

TEST(Math, ExpFastIsWithinFourUlpOfLibmOverTheWholeClampedRange) {
  double worst = 0;
  float worst_x = 0;
  std::vector<float> xs = {-87.3f, 88.3f, 0.0f, -0.0f, 1e-30f, -1e-30f, 0.5f * 0.6931472f, -0.5f * 0.6931472f};
  for (double x = -87.3; x <= 88.3; x += 0.00731) xs.push_back(static_cast<float>(x));
  for (float x : xs) {
    const double error = exp_fast_error(x);
    if (error > worst) worst = error, worst_x = x;
  }
  EXPECT_LT(worst, 4 * 0x1p-24) << "max relative error " << worst << " at x = " << worst_x;
}

// Beyond [-87.3, 88.3] the input is clamped: the result is exp_fast of the end, which is a normal
// float at the bottom (no 0, no subnormal, as a later division may need) and finite at the top.
TEST(Math, ExpFastSaturatesAtTheClampedEnds) {
  const float bottom = exp_fast(-87.3f), top = exp_fast(88.3f);
  EXPECT_GE(bottom, std::numeric_limits<float>::min());
  EXPECT_LT(bottom, 2 * std::numeric_limits<float>::min());
  EXPECT_LT(exp_fast_error(-87.3f), 4 * 0x1p-24);
  EXPECT_TRUE(std::isfinite(top));
  EXPECT_GT(top, 0.5f * std::numeric_limits<float>::max());
  EXPECT_LT(exp_fast_error(88.3f), 4 * 0x1p-24);
  const float inf = std::numeric_limits<float>::infinity();
  for (float x : {-87.31f, -88.0f, -103.0f, -1000.0f, -1e30f, -inf}) EXPECT_EQ(exp_fast(x), bottom) << x;
  for (float x : {88.31f, 88.8f, 89.0f, 1000.0f, 1e30f, inf}) EXPECT_EQ(exp_fast(x), top) << x;
}

TEST(Math, GeluEqualsGpt2TanhForm) {
  for (double x = -8; x <= 8; x += 0.01) {
    double tanh_form = 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
    EXPECT_NEAR(gelu_value(x), tanh_form, 1e-14 * (1 + std::fabs(x)));
    EXPECT_NEAR(gelu_value(static_cast<float>(x)), tanh_form, 3e-7 * (1 + std::fabs(x)));
  }
}

TEST(Math, GeluDerivativeMatchesCentralDifferences) {
  const double h = 1e-5;
  for (double x = -6; x <= 6; x += 0.037) {
    double numeric = (gelu_value(x + h) - gelu_value(x - h)) / (2 * h);
    EXPECT_NEAR(gelu_derivative(x), numeric, 1e-9) << x;
  }
}

namespace {
// SiLU written another way: x sigmoid(x) with sigmoid(x) = (1 + tanh(x/2)) / 2 (no exp).
double silu_tanh_form(double x) { return x * 0.5 * (1 + std::tanh(0.5 * x)); }
double silu_derivative_tanh_form(double x) {
  const double s = 0.5 * (1 + std::tanh(0.5 * x));
  return s + x * s * (1 - s);
}
}  // namespace

// float: exp_fast errs by ~2 ulp, then 1 + e, the division: ~4 u relative; allow 8 u (+ a tiny
// atol for x = 0). The derivative s (1 + x (1 - s)): 1 - s keeps only s's absolute error (~u) once
// s -> 1, which x scales to ~|x| u absolute; and it crosses zero near x = -1.28, where 1 + x (1 - s)
// cancels: (4 + |x|) u absolute on top of 8 u relative. Double: the same with u = 2^-53.
TEST(Math, SiluEqualsXTimesTanhSigmoid) {
  const double u = 0x1p-24;
  for (double x = -20; x <= 20; x += 0.013) {
    const double ref = silu_tanh_form(x);
    EXPECT_NEAR(silu_value(x), ref, 1e-15 * (1 + std::fabs(x))) << x;
    const float xf = static_cast<float>(x);
    EXPECT_NEAR(silu_value(xf), silu_tanh_form(xf), 8 * u * std::fabs(silu_tanh_form(xf)) + 1e-30) << x;
    // 1 - s loses ~|x| u of s's relative accuracy, and x multiplies it back: ~|x| u absolute.
    EXPECT_NEAR(silu_derivative(x), silu_derivative_tanh_form(x), 1e-15 * (1 + std::fabs(x))) << x;
    EXPECT_NEAR(silu_derivative(xf), silu_derivative_tanh_form(xf),
                (4 + std::fabs(x)) * u + 8 * u * std::fabs(silu_derivative_tanh_form(xf)))
        << x;
  }
  EXPECT_EQ(silu_value(0.0), 0.0);
  EXPECT_EQ(silu_derivative(0.0), 0.5);
}

TEST(Math, SiluDerivativeMatchesCentralDifferences) {
  const double h = 1e-5;
  for (double x = -12; x <= 12; x += 0.037) {
    const double numeric = (silu_value(x + h) - silu_value(x - h)) / (2 * h);
    EXPECT_NEAR(silu_derivative(x), numeric, 1e-9) << x;
  }
}

// In float, exp_fast's clamp keeps both tails finite: silu -> x for large x (derivative 1) and -> 0
// from below for very negative x (derivative -> 0), never NaN or inf.
TEST(Math, SiluFloatTailsAreFiniteAndExact) {
  for (float x : {20.0f, 88.0f, 100.0f, 1e4f, 1e30f}) {
    EXPECT_EQ(silu_value(x), x) << x;
    EXPECT_EQ(silu_derivative(x), 1.0f) << x;
  }
  for (float x : {-60.0f, -88.0f, -100.0f, -1e4f}) {
    const float v = silu_value(x), d = silu_derivative(x);
    EXPECT_TRUE(std::isfinite(v) && std::isfinite(d)) << x;
    EXPECT_LE(v, 0.0f) << x;
    EXPECT_LT(std::fabs(v), 1e-20f) << x;
    EXPECT_LT(std::fabs(d), 1e-20f) << x;
  }
}

TEST(Math, CounterNormalHasUnitMomentsAndIsAPureFunction) {
  const int n = 200000;
  double sum = 0, sq = 0;
  for (int i = 0; i < n; i++) {
    double z = counter_normal(12345, i);
    sum += z, sq += z * z;
  }
  // Standard errors: mean 1/sqrt(n) = 0.0022, variance sqrt(2/n) = 0.0032; 5 sigma bounds.
  EXPECT_NEAR(sum / n, 0.0, 0.011);
  EXPECT_NEAR(sq / n, 1.0, 0.016);
  EXPECT_EQ(counter_normal(7, 99), counter_normal(7, 99));
  EXPECT_NE(counter_normal(7, 99), counter_normal(8, 99));
}

TEST(Math, AdamWUpdateMatchesTheTextbookFormula) {
  AdamWStep s{1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, 1 - 0.9f * 0.9f, 1 - 0.95f * 0.95f};  // step 2
  float p = 0.5f, m = 0.2f, v = 0.03f;
  const float g = -0.4f;
  adamw_update(&p, &m, &v, g, 1.0f, s);
  double m2 = 0.9 * 0.2 + 0.1 * -0.4, v2 = 0.95 * 0.03 + 0.05 * 0.16;
  double update = (m2 / (1 - 0.81)) / (std::sqrt(v2 / (1 - 0.9025)) + 1e-8) + 0.1 * 0.5;
  EXPECT_NEAR(m, m2, 1e-7);
  EXPECT_NEAR(v, v2, 1e-7);
  EXPECT_NEAR(p, 0.5 - 1e-2 * update, 1e-6);
  float q = 0.5f, mq = 0.2f, vq = 0.03f;
  adamw_update(&q, &mq, &vq, g, 0.0f, s);  // no decay: differs by exactly lr * wd * p
  EXPECT_NEAR(q - p, 1e-2 * 0.1 * 0.5, 1e-6);
}

// Clipping and the loss scale from the step's sums, against the formulas written out: the true
// norm is sqrt(sums[1]) / grad_scale; above max_norm the gradients are scaled to it.
TEST(Math, AdamWMultiplierUnscalesClipsAndRefusesNonFiniteSteps) {
  float multiplier = -1;
  const double sums[2] = {3.0, 64.0};  // true norm sqrt(64) / 4 = 2
  ASSERT_TRUE(adamw_grad_multiplier(sums, AdamWClip{0.5, 4.0}, &multiplier));
  EXPECT_EQ(multiplier, static_cast<float>(0.5 / (2 + 1e-6) / 4.0));
  ASSERT_TRUE(adamw_grad_multiplier(sums, AdamWClip{2.5, 4.0}, &multiplier));  // under the bound: unscale only
  EXPECT_EQ(multiplier, 0.25f);
  ASSERT_TRUE(adamw_grad_multiplier(sums, AdamWClip{0.0, 1.0}, &multiplier));  // clipping off
  EXPECT_EQ(multiplier, 1.0f);
  const double inf = std::numeric_limits<double>::infinity(), nan = std::nan("");
  const double bad[][2] = {{inf, 1.0}, {nan, 1.0}, {1.0, inf}, {1.0, nan}, {-inf, 1.0}};
  for (const auto& b : bad) EXPECT_FALSE(adamw_grad_multiplier(b, AdamWClip{1.0, 1.0}, &multiplier)) << b[0] << " " << b[1];
}

// The fused step (the CPU backend's adamw_multi) against a plain loop of adamw_update over the same
// elements with the multiplier worked out here: segments of any length, with and without decay,
// updated once each; a non-finite step leaves everything as it was.
TEST(Math, FusedAdamWStepEqualsThePerElementLoop) {
  const size_t n = 3 * 1000 + 7;
  std::vector<float> param(n), m(n, 0.01f), v(n, 0.02f), grad(n);
  for (size_t i = 0; i < n; i++) param[i] = 0.001f * static_cast<float>(i % 97), grad[i] = 0.5f - 0.01f * (i % 101);
  std::vector<float> p_ref = param, m_ref = m, v_ref = v;
  const size_t cuts[] = {0, 1, 1000, 2999, n};
  std::vector<AdamWSegment> segments;
  for (int k = 0; k + 1 < 5; k++)
    segments.push_back({param.data() + cuts[k], m.data() + cuts[k], v.data() + cuts[k], grad.data() + cuts[k],
                        cuts[k + 1] - cuts[k], k % 2 ? 0.0f : 1.0f});
  const AdamWStep step{1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.1f, 0.05f};
  const double sums[2] = {2.0, 9.0};  // norm sqrt(9) / 2 = 1.5 > 1: clipped
  cpu_shard_ops().adamw_multi(segments.data(), segments.size(), sums, AdamWClip{1.0, 2.0}, step);
  const float multiplier = static_cast<float>(1.0 / (1.5 + 1e-6) / 2.0);
  for (int k = 0; k + 1 < 5; k++)
    for (size_t i = cuts[k]; i < cuts[k + 1]; i++)
      adamw_update(&p_ref[i], &m_ref[i], &v_ref[i], grad[i] * multiplier, k % 2 ? 0.0f : 1.0f, step);
  EXPECT_EQ(param, p_ref);
  EXPECT_EQ(m, m_ref);
  EXPECT_EQ(v, v_ref);
  const double overflow[2] = {2.0, std::numeric_limits<double>::infinity()};
  cpu_shard_ops().adamw_multi(segments.data(), segments.size(), overflow, AdamWClip{1.0, 2.0}, step);
  EXPECT_EQ(param, p_ref) << "a non-finite step changed the parameters";
  EXPECT_EQ(m, m_ref);
}

TEST(LrSchedule, WarmupThenCosineToTheMinimum) {
  OptimConfig c;
  c.lr = 1.0, c.min_lr_ratio = 0.1, c.warmup_steps = 4, c.total_steps = 14;
  EXPECT_DOUBLE_EQ(lr_at_step(c, 0), 0.25);
  EXPECT_DOUBLE_EQ(lr_at_step(c, 3), 1.0);
  EXPECT_DOUBLE_EQ(lr_at_step(c, 4), 1.0);
  EXPECT_NEAR(lr_at_step(c, 13), 0.1, 1e-12);
  EXPECT_NEAR(lr_at_step(c, 8), 0.1 + 0.45 * (1 + std::cos(M_PI * 4 / 9)), 1e-12);
  for (int s = 4; s < 13; s++) EXPECT_GE(lr_at_step(c, s), lr_at_step(c, s + 1));
}

// The other schedules against their closed forms (warmup w of W at lr * (w + 1) / W, then the decay
// from lr at its first step to lr * min_lr_ratio at the run's last step).
TEST(LrSchedule, LinearConstantAndWarmupStableDecay) {
  OptimConfig c;
  c.lr = 2.0, c.min_lr_ratio = 0.25, c.warmup_steps = 2, c.total_steps = 12;
  c.schedule = LR_LINEAR;
  EXPECT_DOUBLE_EQ(lr_at_step(c, 0), 1.0);
  EXPECT_DOUBLE_EQ(lr_at_step(c, 2), 2.0);
  for (int s = 2; s < 12; s++) EXPECT_NEAR(lr_at_step(c, s), 2.0 + (0.5 - 2.0) * (s - 2) / 9.0, 1e-12) << s;
  c.schedule = LR_CONSTANT;
  for (int s = 2; s < 12; s++) EXPECT_EQ(lr_at_step(c, s), 2.0) << s;
  EXPECT_DOUBLE_EQ(lr_at_step(c, 1), 2.0);  // the warmup still applies
  c.schedule = LR_WSD, c.decay_steps = 4;   // steps 8..11 decay
  for (int s = 2; s < 8; s++) EXPECT_EQ(lr_at_step(c, s), 2.0) << s;
  for (int s = 8; s < 12; s++)
    EXPECT_NEAR(lr_at_step(c, s), 0.5 + 0.75 * (1 + std::cos(M_PI * (s - 8) / 3.0)), 1e-12) << s;
  c.decay_steps = 0;  // a fifth of the 10 steps after the warmup: 10, 11
  EXPECT_EQ(lr_at_step(c, 9), 2.0);
  EXPECT_NEAR(lr_at_step(c, 10), 2.0, 1e-12);
  EXPECT_NEAR(lr_at_step(c, 11), 0.5, 1e-12);
  c.decay_steps = 100;  // longer than the run: decays over every step after the warmup, as cosine does
  OptimConfig cosine = c;
  cosine.schedule = LR_COSINE;
  for (int s = 0; s < 12; s++) EXPECT_EQ(lr_at_step(c, s), lr_at_step(cosine, s)) << s;
}
