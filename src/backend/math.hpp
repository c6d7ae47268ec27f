// Per-element math written once, for the CPU loops and (as HOST_DEVICE) for the CUDA kernels, so
// that the CPU tests cover the GPU's arithmetic too: exp_fast, GELU, SiLU, the AdamW element update and
// its clipping factor.
// (The counter RNG, which serves data/ and ckpt/ too, is core/random.hpp.)
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define HOST_DEVICE __host__ __device__
#else
#define HOST_DEVICE
#endif

namespace shardtrain {

// exp(x) for float in a form compilers vectorise (no libm call): x = n ln2 + r with |r| <= ln2/2,
// exp(r) by its degree-7 Taylor polynomial (truncation < 7e-9 relative on that interval), and 2^n
// built in the exponent bits. Accurate to ~2 ulp; inputs are clamped to [-87.3, 88.3], the range
// of normal floats, so it never overflows to inf and flushes to ~1e-38 instead of 0.
HOST_DEVICE inline float exp_fast(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;  // Cody-Waite split of ln2
  float p = 1.0f / 5040;
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // 2^n from its bits: memcpy, not a union (reading the inactive member is undefined in C++);
  // compilers turn it into a register move, on the host and in device code.
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}
HOST_DEVICE inline double exp_fast(double x) { return std::exp(x); }

// GPT-2's tanh approximation of GELU, 0.5 x (1 + tanh(u)) with u = sqrt(2/pi) (x + 0.044715 x^3),
// computed as x * sigmoid(2u) -- the same function, without tanh's cancellation near 1 + tanh = 0
// and with one exp. Its derivative: s + x * s (1 - s) * 2 u'(x), s = sigmoid(2u).
constexpr double GELU_SCALE = 0.7978845608028654;  // sqrt(2/pi)
constexpr double GELU_CUBIC = 0.044715;

template <typename Real>
HOST_DEVICE inline Real gelu_sigmoid(Real x) {
  Real u = Real(GELU_SCALE) * (x + Real(GELU_CUBIC) * x * x * x);
  return Real(1) / (Real(1) + exp_fast(Real(-2) * u));
}

template <typename Real>
HOST_DEVICE inline Real gelu_value(Real x) {
  return x * gelu_sigmoid(x);
}

template <typename Real>
HOST_DEVICE inline Real gelu_derivative(Real x) {
  Real s = gelu_sigmoid(x);
  Real du = Real(GELU_SCALE) * (Real(1) + Real(3 * GELU_CUBIC) * x * x);
  return s + x * s * (Real(1) - s) * Real(2) * du;
}

// SiLU (Llama's MLP gate): x * sigmoid(x), and its derivative s (1 + x (1 - s)).
template <typename Real>
HOST_DEVICE inline Real silu_value(Real x) {
  return x / (Real(1) + exp_fast(-x));
}

template <typename Real>
HOST_DEVICE inline Real silu_derivative(Real x) {
  Real s = Real(1) / (Real(1) + exp_fast(-x));
  return s * (Real(1) + x * (Real(1) - s));
}

// One AdamW element (decoupled weight decay, bias-corrected moments). `decay` is 0 for
// parameters that take no weight decay (norms, biases).
struct AdamWStep {
  float lr, beta1, beta2, eps, weight_decay;
  float bias_correction1, bias_correction2;  // 1 - beta^t
};

HOST_DEVICE inline void adamw_update(float* param, float* m, float* v, float grad, float decay_mask,
                                     const AdamWStep& s) {
  float m_new = s.beta1 * *m + (1.0f - s.beta1) * grad;
  float v_new = s.beta2 * *v + (1.0f - s.beta2) * grad * grad;
  *m = m_new;
  *v = v_new;
  float m_hat = m_new / s.bias_correction1;
  float v_hat = v_new / s.bias_correction2;
  *param -= s.lr * (m_hat / (std::sqrt(v_hat) + s.eps) + decay_mask * s.weight_decay * *param);
}

// The fused step's list entry (ShardOps::adamw_multi): a run of a shard with one weight-decay
// setting, at most kAdamWSegmentElements long so that one GPU block takes one entry.
struct AdamWSegment {
  float* param;
  float* m;
  float* v;
  const float* grad;
  size_t n;
  float decay;  // 1 with weight decay, 0 without
};
constexpr size_t kAdamWSegmentElements = size_t{1} << 16;

// Global-norm clipping and the loss scale, applied where the step's sums are (on the device):
// `sums` = {the step's summed loss, the squared norm of the gradients as they are}, the gradients
// being grad_scale times the true ones. The true norm is sqrt(sums[1]) / grad_scale; the update
// is skipped (false) when it or the loss is not inf/NaN-free; else *multiplier unscales and clips
// in one factor (max_norm <= 0: no clipping).
struct AdamWClip {
  double max_norm;
  double grad_scale;
};
HOST_DEVICE inline bool adamw_grad_multiplier(const double* sums, const AdamWClip& c, float* multiplier) {
  const double norm = std::sqrt(sums[1]) / c.grad_scale;
  if (!std::isfinite(sums[0]) || !std::isfinite(norm)) return false;
  const double clip = (c.max_norm > 0 && norm > c.max_norm) ? c.max_norm / (norm + 1e-6) : 1.0;
  *multiplier = static_cast<float>(clip / c.grad_scale);
  return true;
}

}  // namespace shardtrain
