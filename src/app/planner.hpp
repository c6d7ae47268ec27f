// `shardtrain plan`: each rank's peak memory by category for every sharding strategy, gradient
// reduction mode and activation checkpointing setting on a given rank count, computed without
// allocating the model (memory_plan.hpp), the communication each moves per step, and the
// recommendation: the fastest combination that fits the memory limit, with the reasons.
#pragma once

#include <string>
#include <vector>

#include "comm/runtime.hpp"

namespace shardtrain {

// args: the words after `plan`. Prints on rank 0. Throws UsageError.
void run_planner(const Runtime& rt, const std::vector<std::string>& args);

}  // namespace shardtrain
