// Which blocks recompute their forward in their backward (activation checkpointing): none, every
// block, or only the first N in forward order (fsdp.checkpoint_blocks) -- as many as the memory
// needs, so a model that almost fits does not pay the recompute on every block (Megatron's
// --recompute-num-layers). A recomputing block keeps only its input; the recomputing blocks share
// one set of saved tensors, which each refills in its backward, and every other block keeps its
// own set. A decoder recomputing N blocks therefore saves N - 1 blocks' sets; FLUX, whose shared
// set is the working set every block computes in, saves about N blocks' with 16-bit activations.
#pragma once

#include <algorithm>
#include <climits>

namespace shardtrain {

// Of a run of consecutive blocks of one kind (a decoder's layers; FLUX's double blocks, then its
// single blocks): the first `recomputed` recompute, and each block's set of saved tensors.
struct CheckpointedRun {
  int recomputed = 0, blocks = 0;
  bool recomputes(int i) const { return i < recomputed; }
  // The sets allocated: one shared by the recomputing blocks, one per other block.
  int sets() const { return blocks - recomputed + (recomputed > 0 ? 1 : 0); }
  int set(int i) const { return recomputes(i) ? 0 : i - recomputed + (recomputed > 0 ? 1 : 0); }
};

class Checkpointing {
 public:
  // true: every block; false: none (what fsdp.activation_checkpointing alone says).
  Checkpointing(bool every_block = false) : count_(every_block ? EVERY : 0) {}  // NOLINT: a bool reads as one
  template <typename T>
  Checkpointing(T) = delete;  // a count must say so: Checkpointing::first(n)
  static Checkpointing first(int blocks) {
    Checkpointing c;
    c.count_ = std::max(0, blocks);
    return c;
  }

  bool any() const { return count_ > 0; }
  bool every() const { return count_ == EVERY; }
  // Blocks recomputed of a model with `blocks` blocks.
  int count(int blocks) const { return std::min(count_, blocks); }
  // The run of `blocks` blocks that starts at the model's block `first`.
  CheckpointedRun run(int first, int blocks) const {
    return {std::clamp(count_ == EVERY ? blocks : count_ - first, 0, blocks), blocks};
  }
  bool operator==(const Checkpointing& o) const { return count_ == o.count_; }
  bool operator!=(const Checkpointing& o) const { return count_ != o.count_; }

 private:
  static constexpr int EVERY = INT_MAX;
  int count_;
};

}  // namespace shardtrain
