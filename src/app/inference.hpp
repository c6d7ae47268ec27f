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

struct InferenceWeights {
  // Collective. Loads `checkpoint`'s parameters (a file) into an engine for `table` (the checkpoint's
  // model, with its adapters); `comm` is the world on host memory for the loader's agreements.
  InferenceWeights(const Runtime& rt, const ComputeBackend& compute, Comm& comm, Watchdog& watchdog,
                   const ParamTable& table, const std::string& checkpoint);

  std::unique_ptr<Comm> shard_comm, replica_comm;
  MemoryTracker memory;  // the engine's arrays; the caller adds its model's
  FsdpEngine engine;
};

}  // namespace shardtrain
