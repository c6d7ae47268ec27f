// Which tokens make sequence j of optimizer step k: a pure function of (seed, epoch, k, j), so the
// data order does not depend on the rank count and a checkpoint only needs the step to resume.
//
// The file is cut into W = (num_tokens - 1) / seq_len non-overlapping windows; window w holds the
// seq_len + 1 tokens starting at w * seq_len (inputs, and targets shifted by one). Global
// sequence g = k * global_batch + j lies in epoch g / W at position g % W, and each epoch visits
// the windows in the order of a keyed pseudo-random permutation of [0, W) (WindowPermutation).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "data/token_file.hpp"

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
  // Throws DataError naming `path` when the file holds fewer windows than one global batch, and
  // UsageError for a non-positive seq_len or global_batch.
  SequenceSampler(uint64_t seed, size_t num_tokens, int seq_len, int global_batch, const std::string& path);

  uint64_t windows() const { return windows_; }
  int seq_len() const { return seq_len_; }
  int global_batch() const { return global_batch_; }

  // Epoch of the step's first sequence (a step may straddle two epochs).
  int epoch_of(uint64_t step) const;
  // Token offset of the window that sequence `seq_in_step` of `step` reads; a multiple of seq_len.
  size_t window_start(uint64_t step, uint64_t seq_in_step) const;
  // Copies seq_len inputs and the seq_len targets (shifted by one) of that window, as int.
  void fill(const TokenFile& file, uint64_t step, uint64_t seq_in_step, int* inputs, int* targets) const;
  // The window visited at `position` of `epoch`: a bijection of [0, windows()) for each epoch.
  uint64_t permute(uint64_t epoch, uint64_t position) const;

 private:
  uint64_t seed_;
  size_t num_tokens_;
  int seq_len_;
  int global_batch_;
  uint64_t windows_;
};

}  // namespace shardtrain
