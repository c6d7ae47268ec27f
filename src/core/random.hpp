// The counter-based RNG: random numbers as pure functions of (key, counter), with no state, so that
// initialization, the data sampler and the synthetic corpus give the same values for any rank
// count, thread count or rerun. Host code only (nothing random runs on the GPU).
#pragma once

#include <cmath>
#include <cstdint>

namespace shardtrain {

// SplitMix64 finaliser: a bijective 64-bit mix with good avalanche, the core of the counter RNG.
inline uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Uniform in (0, 1), a pure function of (key, counter).
inline double counter_uniform(uint64_t key, uint64_t counter) {
  uint64_t bits = mix64(key ^ mix64(counter));
  return (static_cast<double>(bits >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

// Standard normal from two counter uniforms (Box–Muller); element i uses counters 2i and 2i+1.
inline double counter_normal(uint64_t key, uint64_t index) {
  double u1 = counter_uniform(key, 2 * index);
  double u2 = counter_uniform(key, 2 * index + 1);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

}  // namespace shardtrain
