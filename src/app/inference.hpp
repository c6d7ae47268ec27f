// A checkpoint's weights held for inference -- generate, sample and eval: every rank holds its
// shards of the parameters, FULL_SHARD over the world (one rank: all of it), gathered block by
// block as in training; no gradients and no optimizer moments are ever held.
#pragma once

#include <memory>
#include <string>

#include "app/compute_backend.hpp"
#include "comm/comm.hpp"
#include "comm/runtime.hpp"
#include "shard/fsdp_engine.hpp"

namespace shardtrain {

class Watchdog;

// An inference engine's options: no gradients, the next block's gather prefetched on several
// ranks, NCCL's collectives on a GPU.
EngineOptions inference_options(const Runtime& rt, const ComputeBackend& compute);

struct InferenceWeights {
  // Collective. Loads `checkpoint`'s parameters (a file) into an engine for `table` (the checkpoint's
  // model, with its adapters); `comm` is the world on host memory for the loader's agreements. An
  // adapter-only checkpoint goes onto its base model: `base` (a ShardTrain checkpoint, a Hugging Face
  // folder or an llm.c file), or else the checkpoint.init_from its run recorded; the base checksum
  // must match (exit 2 otherwise, naming --base).
  InferenceWeights(const Runtime& rt, const ComputeBackend& compute, Comm& comm, Watchdog& watchdog,
                   const ParamTable& table, const std::string& checkpoint, const std::string& base = "");

  std::unique_ptr<Comm> shard_comm, replica_comm;
  MemoryTracker memory;  // the engine's arrays; the caller adds its model's
  FsdpEngine engine;
};

// Collective. The weights of a model file or folder into `engine`'s base parameters (its adapters
// keep theirs): a ShardTrain checkpoint (its parameters, no optimizer state; an adapter-only one
// is refused), a Hugging Face folder or an llm.c file. Returns what was loaded, for a message.
class CheckpointManager;
// --base's help, for generate, eval and sample.
inline constexpr const char* BASE_HELP =
    "with an adapter-only checkpoint (checkpoint.adapters_only): the base model it was trained on (a ShardTrain "
    "checkpoint, a Hugging Face folder or an llm.c file); default: the run's checkpoint.init_from";
std::string load_base_weights(const Runtime& rt, CheckpointManager& manager, const std::string& from,
                              FsdpEngine& engine, const std::string& option);

}  // namespace shardtrain
