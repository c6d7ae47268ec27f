// The sampler's arithmetic. Everything here is integer math on (seed, epoch, step, seq) through
// mix64, so every rank, thread count and run computes the same windows: nothing is stateful.
#include "data/sampler.hpp"

#include "core/error.hpp"
#include "core/random.hpp"

namespace shardtrain {

namespace {

// Keeps the sampler's random stream apart from other users of mix64 keyed by the same train.seed.
constexpr uint64_t SAMPLER_DOMAIN = 0x73616d706c657273ull;  // "samplers"

uint64_t epoch_key(uint64_t seed, uint64_t epoch) { return mix64(mix64(seed ^ SAMPLER_DOMAIN) ^ mix64(epoch)); }

}  // namespace

WindowPermutation::WindowPermutation(uint64_t n, uint64_t key) : n_(n) {
  SHARD_CHECK(n > 0 && n <= (uint64_t(1) << 62), "permutation size %llu outside [1, 2^62]",
              static_cast<unsigned long long>(n));
  int bits = 2;  // at least one bit per Feistel half
  while ((uint64_t(1) << bits) < n) bits++;
  half_bits_ = (bits + 1) / 2;  // an even number of bits keeps the network balanced
  for (uint64_t round = 0; round < 4; round++) round_keys_[round] = mix64(key ^ mix64(round + 1));
}

uint64_t WindowPermutation::operator()(uint64_t position) const {
  SHARD_CHECK(position < n_, "position %llu outside [0, %llu)", static_cast<unsigned long long>(position),
              static_cast<unsigned long long>(n_));
  const uint64_t mask = (uint64_t(1) << half_bits_) - 1;
  uint64_t x = position;
  // Cycle-walking: the network is a bijection of the power-of-two domain, so following x's cycle
  // until it re-enters [0, n) restricts it to a bijection of [0, n); x itself ends every cycle.
  do {
    uint64_t left = x >> half_bits_, right = x & mask;
    for (uint64_t round_key : round_keys_) {
      const uint64_t next = left ^ (mix64(right ^ round_key) & mask);
      left = right;
      right = next;
    }
    x = (left << half_bits_) | right;
  } while (x >= n_);
  return x;
}

SequenceSampler::SequenceSampler(uint64_t seed, uint64_t windows, int global_batch)
    : seed_(seed), global_batch_(global_batch), windows_(windows) {
  if (global_batch <= 0) throw UsageError(strprintf("train.global_batch=%d must be positive", global_batch));
  SHARD_CHECK(windows >= 1, "a sampler over no windows");
}

int SequenceSampler::epoch_of(uint64_t step) const {
  return static_cast<int>(step * static_cast<uint64_t>(global_batch_) / windows_);
}

uint64_t SequenceSampler::permute(uint64_t epoch, uint64_t position) const {
  return WindowPermutation(windows_, epoch_key(seed_, epoch))(position);
}

uint64_t SequenceSampler::window(uint64_t step, uint64_t seq_in_step) const {
  SHARD_CHECK(seq_in_step < static_cast<uint64_t>(global_batch_), "sequence %llu of a %d-sequence batch",
              static_cast<unsigned long long>(seq_in_step), global_batch_);
  const uint64_t g = step * static_cast<uint64_t>(global_batch_) + seq_in_step;
  return permute(g / windows_, g % windows_);
}

}  // namespace shardtrain
