// The counter-based RNG: random numbers as pure functions of (key, counter), with no state, so that
// initialization, the data sampler, the synthetic corpus and dropout give the same values for any
// rank count, thread count or rerun. Host code; the pieces dropout needs on the GPU (mix64 and the
// keep decision) have device-callable mirrors in kernels/common.cuh, checked against these at
// compile time (constexpr) and by the GPU tests.
#pragma once

#include <cmath>
#include <cstdint>

namespace shardtrain {

// SplitMix64 finaliser: a bijective 64-bit mix with good avalanche, the core of the counter RNG.
constexpr uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The 64 random bits of (key, counter): what every counter draw below is made from.
constexpr uint64_t counter_bits(uint64_t key, uint64_t counter) { return mix64(key ^ mix64(counter)); }

// Uniform in (0, 1), a pure function of (key, counter).
inline double counter_uniform(uint64_t key, uint64_t counter) {
  return (static_cast<double>(counter_bits(key, counter) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

// Standard normal from two counter uniforms (Box–Muller); element i uses counters 2i and 2i+1.
inline double counter_normal(uint64_t key, uint64_t index) {
  double u1 = counter_uniform(key, 2 * index);
  double u2 = counter_uniform(key, 2 * index + 1);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

// ---- dropout ------------------------------------------------------------------------------------
// A Bernoulli draw as an integer comparison, so that every backend (the CPU's loops, the CUDA
// kernels) makes the identical decision: the top 24 bits of counter_bits, an integer in
// [0, 2^24), against a 24-bit threshold. P(drop) = threshold24 / 2^24.

// round(p * 2^24), p clamped to [0, 1] (NaN counts as 0): 0 drops nothing, 2^24 drops everything.
// Within 2^-25 of p; exact arithmetic (p * 2^24 + 0.5 is exact in double), so the same on any host.
constexpr uint32_t dropout_threshold24(float p) {
  if (!(p > 0.0f)) return 0;
  if (p >= 1.0f) return uint32_t{1} << 24;
  return static_cast<uint32_t>(static_cast<double>(p) * 16777216.0 + 0.5);
}

// True (keep) with probability 1 - threshold24 / 2^24, a pure function of (key, counter).
constexpr bool counter_keep(uint64_t key, uint64_t counter, uint32_t threshold24) {
  return static_cast<uint32_t>(counter_bits(key, counter) >> 40) >= threshold24;
}

// The key of one row of a dropout site: the caller's row key and the site id mixed into a fresh
// key (the site through a salted mix64, then the pair through another), so that masks of different
// rows or sites share no XOR relation, even for row keys as simple as mix64(row). Element (r, c)
// of a dropout call is kept iff counter_keep(dropout_row_key(row_keys[r], site), c, threshold24).
// The dropout stream's key of one token of training (adapter.dropout): position t of global
// sequence `sequence` of optimizer step `step` -- the same whatever the rank count, in a resumed
// run and in a recomputed forward (activation checkpointing). Each dropout site (dropout_row_key)
// and element (the counter) then draws its own number.
constexpr uint64_t dropout_token_key(uint64_t seed, uint64_t step, uint64_t sequence, uint64_t t) {
  return mix64(mix64(seed ^ 0x6A09E667F3BCC909ull) ^ mix64(step) ^ mix64(mix64(sequence) ^ t));
}

constexpr uint64_t dropout_row_key(uint64_t row_key, uint64_t site) {
  return mix64(row_key ^ mix64(site ^ 0xD1B54A32D192ED03ull));
}

}  // namespace shardtrain
