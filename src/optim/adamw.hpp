// AdamW on the local gradient shards, global-norm gradient clipping, and the warmup + cosine
// learning-rate schedule. Moments live beside the fp32 master shard; nothing here is unsharded.
// The only collective is one all-reduce of the shards' squared norms (grad_norm), which callers
// may fold into a larger all-reduce (see global_grad_norm_parts).
#pragma once

#include <vector>

#include "shard/fsdp_engine.hpp"

namespace shardtrain {

struct OptimConfig {
  double lr = 3e-4;
  double min_lr_ratio = 0.1;  // the cosine decays to lr * min_lr_ratio at the last step
  int warmup_steps = 0;
  int total_steps = 1;
  double weight_decay = 0.1;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double grad_clip = 1.0;  // <= 0 disables clipping
};

// Learning rate for optimizer step `step` (0-based): linear warmup to lr, then cosine to the minimum.
double lr_at_step(const OptimConfig& c, int step);

class AdamW {
 public:
  AdamW(const OptimConfig& config, FsdpEngine& engine, MemoryTracker& memory);
  ~AdamW();

  // Sum of squared gradient elements of the parts of this rank's shards it owns among its
  // replicas (summed over all ranks, every element counts once; padding is zero).
  double local_grad_sq_norm() const;
  // Updates this rank's shards. The gradients hold grad_scale times the true gradient (the loss
  // scale of fp16 training; 1 otherwise); global_grad_norm is the true (unscaled) norm.
  // Returns the lr used.
  double step(int step, double global_grad_norm, double grad_scale = 1.0);

  // Back to the state before the first step (moments zero).
  void zero_state();
  // The moments, per unit, beside the engine's shards (same device), for checkpoints.
  std::vector<DeviceArray<float>>& m() { return m_; }
  std::vector<DeviceArray<float>>& v() { return v_; }

 private:
  struct Segment {  // a run of this rank's shard with one weight-decay setting
    size_t begin, end;
    float decay;
  };
  OptimConfig config_;
  FsdpEngine& engine_;
  MemoryTracker& memory_;
  std::vector<DeviceArray<float>> m_, v_;
  std::vector<std::vector<Segment>> segments_;
  size_t bytes_ = 0;
};

}  // namespace shardtrain
