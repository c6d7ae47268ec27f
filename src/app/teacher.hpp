// Knowledge distillation's teacher (docs/distillation.md): a second, frozen model sharded beside
// the student over the same shard and replica groups, as its own units, with no gradients and no
// optimizer state (an inference FsdpEngine), gathered block by block for its forward only. Per
// micro-batch it gives its logits for the student's tokens, which the student's loss takes
// (DistillationLoss, model/loss.hpp).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "app/compute_backend.hpp"
#include "comm/runtime.hpp"
#include "model/model.hpp"
#include "shard/fsdp_engine.hpp"
#include "shard/memory.hpp"

namespace shardtrain {

class Teacher {
 public:
  // Loads `source` -- a ShardTrain checkpoint (its own config inside; not adapter-only) or a Hugging
  // Face model folder -- for micro-batches of B sequences of T tokens. Collective over `world` and
  // the groups. Throws UsageError (agreed) for a source it cannot use or a vocabulary other than
  // the student's.
  // quant: the format its linear weights are held in (distill.teacher_dtype).
  Teacher(const Runtime& rt, Comm& world, Comm& shard, Comm& replica, const ComputeBackend& compute,
          const EngineOptions& student_options, const std::string& source, const QuantConfig& quant,
          const ModelConfig& student, int B, int T, Watchdog* watchdog);

  // Its logits for a micro-batch's tokens (host memory): B*T x V in the device's memory, valid until
  // the next call. Collective over the groups.
  const float* logits(const Batch& batch) { return engine_->forward_logits(*model_, batch); }

  const ModelConfig& config() const { return table_->config(); }
  const ParamTable& table() const { return *table_; }
  // Its weights' identity (base_model_checksum), recorded in the student's checkpoints.
  uint64_t checksum() const { return checksum_; }
  const std::string& source() const { return source_; }
  // Its bytes on this rank by category (what was allocated: equal to the plan's: memory_plan.hpp's plan_forward_only_memory).
  const MemoryTracker& memory() const { return memory_; }

 private:
  std::string source_;
  std::unique_ptr<ParamTable> table_;
  MemoryTracker memory_;
  std::unique_ptr<FsdpEngine> engine_;
  std::unique_ptr<TransformerModel<float>> model_;
  uint64_t checksum_ = 0;
};

// The teacher's model configuration from its source, read on every rank (call under agree_on).
// Throws UsageError naming the source when it is neither kind, CheckpointError when damaged.
// quant: the format of its linear weights (QuantConfig::inference is set here).
ParamTable teacher_param_table(const std::string& source, QuantConfig quant = {});
}  // namespace shardtrain
