// `shardtrain eval`: a language model's loss and perplexity on a data set, from a checkpoint, on any
// rank count, without training (docs/generate.md, "Evaluation"). The checkpoint's weights are loaded
// into an inference engine (FULL_SHARD over the ranks, no gradients, no optimizer moments) and the
// data is read exactly as the trainer's validation reads it: global batch k of G sequences takes
// windows k*G .. k*G+G-1 (modulo the windows), split over ranks and micro-batches the same way, so
// with the run's own settings the loss is the number its `eval` lines printed.
#pragma once

#include <string>
#include <vector>

#include "comm/runtime.hpp"

namespace shardtrain {

// Parses `args` (after the word "eval"), evaluates, prints one line. Collective; returns the exit
// code. Throws InputError (agreed by every rank) on bad input.
int run_eval(Runtime& rt, const std::vector<std::string>& args);

}  // namespace shardtrain
