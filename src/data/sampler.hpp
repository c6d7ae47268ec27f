// Which window makes sequence j of optimizer step k: a pure function of (seed, epoch, k, j), so the
// data order does not depend on the rank count and a checkpoint only needs the step to resume.
//
// The data (TokenDataset, dataset.hpp) is a stream of W windows: one file, or several files read
// one after another. Global sequence g = k * global_batch + j lies in epoch g / W at position
// g % W, and each epoch visits the windows in the order of a keyed pseudo-random permutation of
// [0, W) (WindowPermutation) keyed by (seed, epoch). docs/data.md states the order in full.
#pragma once

#include <cstddef>
#include <cstdint>

namespace shardtrain {

// A random-access pseudo-random bijection of [0, n) keyed by a 64-bit key: a balanced 4-round
// Feistel network on the smallest even-bit power of two >= n (< 4n), with cycle-walking to stay
// inside [0, n). O(1) memory; expected < 4 network passes per call.
class WindowPermutation {
 public:
  WindowPermutation(uint64_t n, uint64_t key);
  uint64_t size() const { return n_; }
  uint64_t operator()(uint64_t position) const;

 private:
  uint64_t n_;
  uint64_t round_keys_[4];
  int half_bits_;  // the Feistel domain is 2^(2 * half_bits_)
};

class SequenceSampler {
 public:
  // `windows` >= 1 (the dataset has checked that there is a batch's worth); UsageError for a
  // non-positive global_batch.
  SequenceSampler(uint64_t seed, uint64_t windows, int global_batch);

  uint64_t windows() const { return windows_; }
  int global_batch() const { return global_batch_; }

  // Epoch of the step's first sequence (a step may straddle two epochs).
  int epoch_of(uint64_t step) const;
  // The window (an index into the dataset's stream) that sequence `seq_in_step` of `step` reads.
  uint64_t window(uint64_t step, uint64_t seq_in_step) const;
  // The window visited at `position` of `epoch`: a bijection of [0, windows()) for each epoch.
  uint64_t permute(uint64_t epoch, uint64_t position) const;

 private:
  uint64_t seed_;
  int global_batch_;
  uint64_t windows_;
};

}  // namespace shardtrain
