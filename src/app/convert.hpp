// `shardtrain convert`: a Hugging Face model folder to a ShardTrain checkpoint (either layout), or a
// checkpoint to a folder, on any number of ranks and without training. Each rank holds its shard
// of the parameters (FULL_SHARD over the world: 1/N of the model) and bounded I/O buffers, never
// gradients or optimizer moments, so a model far larger than one rank's memory converts on enough
// ranks. docs/huggingface.md.
#pragma once

#include <string>
#include <vector>

#include "comm/runtime.hpp"

namespace shardtrain {

// Collective. `args`: the words after `convert`. Throws InputError, agreed by every rank.
int run_convert(Runtime& rt, const std::vector<std::string>& args);

}  // namespace shardtrain
