// Per-element math written once, for the CPU loops and (as HOST_DEVICE) for the CUDA kernels, so
// that the CPU tests cover the GPU's arithmetic too: GELU, the counter-based RNG that makes
// initialization a pure function of (seed, parameter, element), and the AdamW element update.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define HOST_DEVICE __host__ __device__
#else
#define HOST_DEVICE
#endif

namespace shardtrain {

// GPT-2's tanh approximation of GELU and its exact derivative.
constexpr double GELU_SCALE = 0.7978845608028654;  // sqrt(2/pi)
constexpr double GELU_CUBIC = 0.044715;

template <typename Real>
HOST_DEVICE inline Real gelu_value(Real x) {
  Real cube = Real(GELU_CUBIC) * x * x * x;
  return Real(0.5) * x * (Real(1) + std::tanh(Real(GELU_SCALE) * (x + cube)));
}

template <typename Real>
HOST_DEVICE inline Real gelu_derivative(Real x) {
  Real cube = Real(GELU_CUBIC) * x * x * x;
  Real tanh_arg = Real(GELU_SCALE) * (x + cube);
  Real tanh_out = std::tanh(tanh_arg);
  Real sech2 = Real(1) - tanh_out * tanh_out;
  return Real(0.5) * (Real(1) + tanh_out) +
         Real(0.5) * x * sech2 * Real(GELU_SCALE) * (Real(1) + Real(3 * GELU_CUBIC) * x * x);
}

// SplitMix64 finaliser: a bijective 64-bit mix with good avalanche, the core of the counter RNG.
HOST_DEVICE inline uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Uniform in (0, 1), a pure function of (key, counter).
HOST_DEVICE inline double counter_uniform(uint64_t key, uint64_t counter) {
  uint64_t bits = mix64(key ^ mix64(counter));
  return (static_cast<double>(bits >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

// Standard normal from two counter uniforms (Box–Muller); element i uses counters 2i and 2i+1.
HOST_DEVICE inline double counter_normal(uint64_t key, uint64_t index) {
  double u1 = counter_uniform(key, 2 * index);
  double u2 = counter_uniform(key, 2 * index + 1);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
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

}  // namespace shardtrain
