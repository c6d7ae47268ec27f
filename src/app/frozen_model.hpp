// What a distillation teacher and a text encoder share: a frozen model read from a ShardTrain
// checkpoint or a Hugging Face folder into an inference FsdpEngine of its own (no gradients, no
// optimizer moments ever allocated), sharded over the groups it is given, and a forward-only model.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "app/compute_backend.hpp"
#include "backend/quant.hpp"
#include "comm/runtime.hpp"
#include "model/model.hpp"
#include "model/param_table.hpp"
#include "shard/fsdp_engine.hpp"
#include "shard/memory.hpp"

namespace shardtrain {

class Comm;
class Watchdog;

// The model of `table` (checked by the caller) with `source`'s weights in an inference engine over
// `shard` x `replica` (forward_only_options of the trained model's options), and a forward-only
// model for micro-batches of `batch` rows of `seq_len` tokens. Collective over `world` and the groups.
class FrozenModel {
 public:
  FrozenModel(const Runtime& rt, Comm& world, Comm& shard, Comm& replica, const ComputeBackend& compute,
              const EngineOptions& trained_options, ParamTable table, const std::string& source, int batch,
              int seq_len, Watchdog* watchdog);
  const ParamTable& table() const { return table_; }
  const ModelConfig& config() const { return table_.config(); }
  FsdpEngine& engine() { return *engine_; }
  TransformerModel<float>& model() { return *model_; }
  // Its weights' identity (base_model_checksum), recorded in the trained model's checkpoints.
  uint64_t checksum() const { return checksum_; }
  // Its bytes on this rank by category (what was allocated: equal to the plan's, memory_plan.hpp's
  // plan_forward_only_memory).
  const MemoryTracker& memory() const { return memory_; }

 private:
  ParamTable table_;  // before the engine, which holds a reference to it
  MemoryTracker memory_;
  std::unique_ptr<FsdpEngine> engine_;
  std::unique_ptr<TransformerModel<float>> model_;
  uint64_t checksum_ = 0;
};

// The model of `source` (named by `option` in messages), its linear weights held as `quant` says.
// Read on every rank (call under agree_on). Throws UsageError when it is neither a checkpoint nor a
// folder, or holds adapters alone; CheckpointError when damaged.
ParamTable frozen_model_table(const std::string& source, const std::string& option, QuantConfig quant);

}  // namespace shardtrain
