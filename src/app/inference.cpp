// See inference.hpp.
#include "app/inference.hpp"

#include <filesystem>

#include "ckpt/checkpoint_manager.hpp"

namespace shardtrain {
namespace {

EngineOptions inference_options(const Runtime& rt, const ComputeBackend& compute) {
  EngineOptions options;
  options.forward_prefetch = rt.world() > 1;
  options.nccl = compute.on_gpu();
  options.inference = true;  // no gradients
  return options;
}

}  // namespace

InferenceWeights::InferenceWeights(const Runtime& rt, const ComputeBackend& compute, Comm& comm, Watchdog& watchdog,
                                   const ParamTable& table, const std::string& checkpoint)
    : shard_comm(compute.make_comm(rt.split_world(0, rt.rank()), &watchdog)),
      replica_comm(compute.make_comm(rt.split_world(rt.rank(), 0), &watchdog)),
      engine(table, *shard_comm, *replica_comm, memory, inference_options(rt, compute), compute.backend()) {
  CheckpointManager manager(rt, comm, std::filesystem::path(checkpoint).parent_path().string(), 1, &watchdog);
  rt.agree_on([&] { manager.load_weights(checkpoint, engine); });
}

}  // namespace shardtrain
