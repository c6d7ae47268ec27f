// See teacher.hpp.
#include "app/teacher.hpp"

#include <filesystem>

#include "ckpt/checkpoint_io.hpp"
#include "ckpt/checkpoint_manager.hpp"
#include "ckpt/hf_model.hpp"
#include "core/error.hpp"
#include "model/family.hpp"

namespace shardtrain {

namespace {

EngineOptions teacher_engine_options(const EngineOptions& student) {
  EngineOptions options = student;
  options.inference = true;  // no gradients, no reductions
  return options;
}

}  // namespace

ParamTable teacher_param_table(const std::string& source, QuantConfig quant) {
  quant.inference = true;
  if (is_hdf5_file(source)) {
    const CheckpointState state = read_checkpoint_state(source);
    if (state.adapters_only)
      throw UsageError("distill.teacher='" + source + "' holds adapters alone (checkpoint.adapters_only), no model: "
                       "give a full checkpoint (resume it with checkpoint.adapters_only=false) or a merged export");
    return ParamTable(state.model, {}, state.adapter, quant);  // a teacher trained with adapters: with them
  }
  if (is_hf_model(source)) return ParamTable(read_hf_model_config(source), {}, {}, quant);
  throw UsageError("distill.teacher='" + source + "' is neither a ShardTrain checkpoint (.h5) nor a Hugging Face "
                   "model (a folder with config.json and model.safetensors): give one of those");
}

std::array<size_t, MEM_CATEGORY_COUNT> plan_teacher_memory(const ParamTable& table, const GroupShape& groups,
                                                           const EngineOptions& student_options, int B, int T) {
  std::array<size_t, MEM_CATEGORY_COUNT> bytes =
      FsdpEngine::plan_memory(FsdpEngine::plan_layout(table, groups), teacher_engine_options(student_options));
  bytes[MEM_ACTIVATIONS] += plan_activation_bytes(table, B, T, true);  // forward only: block inputs kept
  return bytes;
}

Teacher::Teacher(const Runtime& rt, Comm& world, Comm& shard, Comm& replica, const ComputeBackend& compute,
                 const EngineOptions& student_options, const std::string& source, const QuantConfig& quant,
                 const ModelConfig& student, int B, int T, Watchdog* watchdog)
    : source_(source) {
  rt.agree_on([&] { table_ = std::make_unique<ParamTable>(teacher_param_table(source, quant)); });
  const ModelConfig& c = config();
  require_capability(c, "distillation", "distill.teacher='" + source + "'");
  if (c.vocab_size != student.vocab_size)
    throw UsageError(strprintf("distill.teacher='%s' has a vocabulary of %d tokens, the student (model.*) %d: "
                               "distillation compares their distributions token by token; use a teacher with the "
                               "student's tokenizer",
                               source.c_str(), c.vocab_size, student.vocab_size));
  if (c.max_seq_len < T)
    throw UsageError(strprintf("distill.teacher='%s' takes sequences of at most %d tokens, train.seq_len=%d: lower "
                               "train.seq_len",
                               source.c_str(), c.max_seq_len, T));
  engine_ = std::make_unique<FsdpEngine>(*table_, shard, replica, memory_, teacher_engine_options(student_options),
                                         compute.backend());
  if (is_hdf5_file(source)) {
    CheckpointManager manager(rt, world, std::filesystem::path(source).parent_path().string(), 1, watchdog);
    rt.agree_on([&] { manager.load_weights(source, *engine_); });  // no optimizer moments are ever held
  } else {
    rt.agree_on([&] { load_hf_shards(source, *engine_); });
  }
  checksum_ = base_model_checksum(*engine_, world);
  model_ = make_model<float>(*table_, B, T, true, *compute.backend().ops);
  memory_.add(MEM_ACTIVATIONS, model_->activation_bytes());
  // What it allocates is checked with the student's: the trainer's plan holds plan_teacher_memory,
  // and the device's count after the first step must equal the whole (Trainer::check_plan_is_allocated).
}

}  // namespace shardtrain
