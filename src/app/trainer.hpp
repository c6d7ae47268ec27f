// `shardtrain train`: sets up data, model, engine and optimizer from a validated Config and runs
// the training loop, printing one progress line per step on rank 0.
#pragma once

#include "app/options.hpp"
#include "comm/runtime.hpp"

namespace shardtrain {

// Returns the process exit code. Throws InputError (already agreed by all ranks) on bad input.
int run_training(const Runtime& rt, const Config& config);

}  // namespace shardtrain
