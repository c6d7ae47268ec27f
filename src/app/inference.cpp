// See inference.hpp.
#include "app/inference.hpp"

#include <cstdio>
#include <filesystem>

#include "app/options.hpp"
#include "ckpt/checkpoint_io.hpp"
#include "ckpt/checkpoint_manager.hpp"
#include "ckpt/hf_model.hpp"
#include "ckpt/llmc.hpp"

namespace shardtrain {

EngineOptions inference_options(const Runtime& rt, const ComputeBackend& compute) {
  EngineOptions options;
  options.forward_prefetch = rt.world() > 1;
  options.nccl = compute.on_gpu();
  options.inference = true;  // no gradients
  return options;
}

InferenceWeights::InferenceWeights(const Runtime& rt, const ComputeBackend& compute, Comm& comm, Watchdog& watchdog,
                                   const ParamTable& table, const std::string& checkpoint, const std::string& base)
    : shard_comm(compute.make_comm(rt.split_world(0, rt.rank()), &watchdog)),
      replica_comm(compute.make_comm(rt.split_world(rt.rank(), 0), &watchdog)),
      engine(table, *shard_comm, *replica_comm, memory, inference_options(rt, compute), compute.backend()) {
  CheckpointManager manager(rt, comm, std::filesystem::path(checkpoint).parent_path().string(), 1, &watchdog);
  std::string from;  // --base serves adapter-only checkpoints only; a full one holds its base
  rt.agree_on([&] {
    const CheckpointState state = read_checkpoint_state(checkpoint);
    if (!state.adapters_only) return;
    from = base;
    if (from.empty()) {
      const auto run = ini_option_values(state.config_ini);
      const auto recorded = run.find("checkpoint.init_from");
      if (recorded != run.end()) from = recorded->second;
    }
    if (from.empty())
      throw UsageError("checkpoint '" + checkpoint + "' holds adapters alone (checkpoint.adapters_only) and its run "
                       "recorded no base model: give the base they were trained on with --base");
  });
  if (!from.empty()) {
    const std::string loaded = load_base_weights(rt, manager, from, engine, base.empty() ? "the run's checkpoint.init_from" : "--base");
    // On stderr: generate's standard output is the text.
    if (rt.is_root()) std::fprintf(stderr, "the adapters of %s go onto the base model %s\n", checkpoint.c_str(), loaded.c_str());
  }
  rt.agree_on([&] { manager.load_weights(checkpoint, engine); });  // an adapter-only file checks the base's checksum
}

std::string load_base_weights(const Runtime& rt, CheckpointManager& manager, const std::string& from,
                              FsdpEngine& engine, const std::string& option) {
  std::string loaded;
  rt.agree_on([&] {
    std::error_code error;
    if (!std::filesystem::exists(from, error))
      throw UsageError(option + "='" + from + "' does not exist: give the base model (a ShardTrain checkpoint, a "
                       "Hugging Face folder or an llm.c file)");
    if (is_hdf5_file(from)) {
      if (read_checkpoint_state(from).adapters_only)
        throw UsageError(option + "='" + from + "' holds adapters alone (checkpoint.adapters_only), no base model");
      manager.load_weights(from, engine, /*base_model_ok=*/true);
      loaded = "ShardTrain checkpoint " + from;
    } else if (is_hf_model(from)) {
      load_hf_shards(from, engine);
      loaded = (std::filesystem::is_directory(from) ? "Hugging Face folder " : "model file ") + from;
    } else {
      load_llmc_shards(from, engine);
      loaded = "llm.c checkpoint " + from;
    }
  });
  return loaded;
}

}  // namespace shardtrain
