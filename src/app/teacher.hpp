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
#include "app/frozen_model.hpp"
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
  const float* logits(const Batch& batch) { return frozen_->engine().forward_logits(frozen_->model(), batch); }

  const ModelConfig& config() const { return frozen_->config(); }
  const ParamTable& table() const { return frozen_->table(); }
  // Its weights' identity (base_model_checksum), recorded in the student's checkpoints.
  uint64_t checksum() const { return frozen_->checksum(); }
  const std::string& source() const { return source_; }
  // Its bytes on this rank by category (FrozenModel::memory).
  const MemoryTracker& memory() const { return frozen_->memory(); }

 private:
  std::string source_;
  std::unique_ptr<FrozenModel> frozen_;
};

// The teacher's model configuration from its source, read on every rank (call under agree_on).
// Throws UsageError naming the source when it is neither kind, CheckpointError when damaged.
// quant: the format of its linear weights (QuantConfig::inference is set here).
ParamTable teacher_param_table(const std::string& source, QuantConfig quant = {});
}  // namespace shardtrain
