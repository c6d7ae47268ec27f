// See frozen_model.hpp.
#include "app/frozen_model.hpp"

#include <filesystem>

#include "app/memory_plan.hpp"
#include "ckpt/checkpoint_io.hpp"
#include "ckpt/checkpoint_manager.hpp"
#include "ckpt/hf_model.hpp"
#include "core/error.hpp"

namespace shardtrain {

ParamTable frozen_model_table(const std::string& source, const std::string& option, QuantConfig quant) {
  quant.inference = true;
  const std::string named = option + "='" + source + "'";
  if (is_hdf5_file(source)) {
    const CheckpointState state = read_checkpoint_state(source);
    if (state.adapters_only)
      throw UsageError(named + " holds adapters alone (checkpoint.adapters_only), no model: give a full checkpoint "
                               "(resume it with checkpoint.adapters_only=false) or a merged export");
    return ParamTable(state.model, {}, state.adapter, quant);  // a model trained with adapters: with them
  }
  if (is_hf_model(source)) return ParamTable(read_hf_model_config(source), {}, {}, quant);
  throw UsageError(named + " is neither a ShardTrain checkpoint (.h5) nor a Hugging Face model (a folder with "
                           "config.json and model.safetensors): give one of those");
}

FrozenModel::FrozenModel(const Runtime& rt, Comm& world, Comm& shard, Comm& replica, const ComputeBackend& compute,
                         const EngineOptions& trained_options, ParamTable table, const std::string& source, int batch,
                         int seq_len, Watchdog* watchdog)
    : table_(std::move(table)) {
  engine_ = std::make_unique<FsdpEngine>(table_, shard, replica, memory_, forward_only_options(trained_options),
                                         compute.backend());
  if (is_hdf5_file(source)) {
    CheckpointManager manager(rt, world, std::filesystem::path(source).parent_path().string(), 1, watchdog);
    rt.agree_on([&] { manager.load_weights(source, *engine_); });  // no optimizer moments are ever held
  } else {
    rt.agree_on([&] { load_hf_shards(source, *engine_); });
  }
  checksum_ = base_model_checksum(*engine_, world);
  model_ = make_model<float>(table_, batch, seq_len, true, *compute.backend().ops);
  memory_.add(MEM_ACTIVATIONS, model_->activation_bytes());
  // What it allocates is checked with the trained model's: the trainer's plan holds
  // plan_forward_only_memory's, and the device's count after the first step must equal the whole.
}

}  // namespace shardtrain
