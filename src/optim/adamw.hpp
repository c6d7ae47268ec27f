// AdamW on the local gradient shards, global-norm gradient clipping, and the warmup + cosine
// learning-rate schedule. Moments live beside the fp32 master shard; nothing here is unsharded.
// Nothing here waits for the device either: the squared norm is added to a double in the master
// device's memory, the caller all-reduces it there (with the step's loss), and the step reads it
// there -- clipping, the loss scale and the inf/NaN skip decided on the device, all shards
// updated in one launch (ShardOps::adamw_multi).
#pragma once

#include <vector>

#include "shard/fsdp_engine.hpp"

namespace shardtrain {

// After the linear warmup: cosine or linear from lr to lr * min_lr_ratio at the last step; constant
// lr; or warmup-stable-decay (WSD): lr until the last decay_steps steps, which follow a cosine down
// to lr * min_lr_ratio at the last step.
enum LrSchedule { LR_COSINE, LR_LINEAR, LR_CONSTANT, LR_WSD };
const char* lr_schedule_name(LrSchedule s);

struct OptimConfig {
  double lr = 3e-4;
  LrSchedule schedule = LR_COSINE;
  double min_lr_ratio = 0.1;  // the decay ends at lr * min_lr_ratio at the last step
  int warmup_steps = 0;
  int decay_steps = 0;  // LR_WSD: the steps of the final decay (0: a fifth of those after the warmup)
  int total_steps = 1;
  double weight_decay = 0.1;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double grad_clip = 1.0;  // <= 0 disables clipping
};

// Learning rate for optimizer step `step` (0-based): linear warmup to lr (step w of the warmup at
// lr * (w + 1) / warmup_steps), then the schedule.
double lr_at_step(const OptimConfig& c, int step);

class AdamW {
 public:
  AdamW(const OptimConfig& config, FsdpEngine& engine, MemoryTracker& memory);
  ~AdamW();
  // The run's length, once known (train.epochs counts it from the data): the schedule's last step.
  void set_total_steps(int steps) { config_.total_steps = steps; }

  // Adds to *total (a double in the master device's memory) the sum of squared gradient elements
  // of the parts of this rank's shards it owns among its replicas (summed over all ranks, every
  // element counts once; padding is zero).
  void accumulate_grad_sq_norm(double* total) const;
  // Updates this rank's shards, all in one launch. `sums` (two doubles in the master device's
  // memory, summed over the ranks): the step's loss and the squared norm of the gradients as they
  // are -- grad_scale times the true gradients (the loss scale of fp16 training; 1 otherwise).
  // Clips by the true norm; updates nothing when the loss or the norm is inf/NaN
  // (adamw_grad_multiplier, backend/math.hpp). Returns the lr of the step.
  double step(int step, const double* sums, double grad_scale = 1.0);

  // The bytes of the fused step's segment table (beside the moments, in the optimizer state) on
  // every rank of a shard group of `shard_size`: the most any of them needs, so that every rank
  // holds the same bytes, as with its padded shards. The memory plan's share of the constructor's.
  static size_t plan_table_bytes(const ParamTable& table, int shard_size);

  // Back to the state before the first step (moments zero).
  void zero_state();
  // The moments, per unit, beside the engine's shards (same device), for checkpoints.
  std::vector<DeviceArray<float>>& m() { return m_; }
  std::vector<DeviceArray<float>>& v() { return v_; }

 private:
  OptimConfig config_;
  FsdpEngine& engine_;
  MemoryTracker& memory_;
  std::vector<DeviceArray<float>> m_, v_;
  DeviceArray<AdamWSegment> segments_;  // every trainable run of the shards, in the master device's memory
  size_t segment_count_ = 0;             // used of segments_ (sized for the shard group's neediest rank)
  size_t bytes_ = 0;
};

}  // namespace shardtrain
