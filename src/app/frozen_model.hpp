// What a distillation teacher and a text encoder share: a frozen model read from a ShardTrain
// checkpoint or a Hugging Face folder into an inference FsdpEngine of its own (no gradients, no
// optimizer moments ever allocated), sharded over the trained model's groups.
#pragma once

#include <string>

#include "backend/quant.hpp"
#include "comm/runtime.hpp"
#include "model/param_table.hpp"

namespace shardtrain {

class Comm;
class FsdpEngine;
class Watchdog;

// The model of `source` (named by `option` in messages), its linear weights held as `quant` says.
// Read on every rank (call under agree_on). Throws UsageError when it is neither a checkpoint nor a
// folder, or holds adapters alone; CheckpointError when damaged.
ParamTable frozen_model_table(const std::string& source, const std::string& option, QuantConfig quant);
// Loads `source`'s weights into `engine` (built on frozen_model_table's table). Collective over
// `world`; errors agreed.
void load_frozen_weights(const Runtime& rt, Comm& world, const std::string& source, FsdpEngine& engine,
                         Watchdog* watchdog);

}  // namespace shardtrain
