// See teacher.hpp.
#include "app/teacher.hpp"

#include "app/frozen_model.hpp"
#include "app/memory_plan.hpp"
#include "ckpt/checkpoint_io.hpp"
#include "core/error.hpp"
#include "model/family.hpp"

namespace shardtrain {

ParamTable teacher_param_table(const std::string& source, QuantConfig quant) {
  return frozen_model_table(source, "distill.teacher", quant);
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
  engine_ = std::make_unique<FsdpEngine>(*table_, shard, replica, memory_, forward_only_options(student_options),
                                         compute.backend());
  load_frozen_weights(rt, world, source, *engine_, watchdog);
  checksum_ = base_model_checksum(*engine_, world);
  model_ = make_model<float>(*table_, B, T, true, *compute.backend().ops);
  memory_.add(MEM_ACTIVATIONS, model_->activation_bytes());
  // What it allocates is checked with the student's: the trainer's plan holds plan_forward_only_memory's,
  // and the device's count after the first step must equal the whole (Trainer::check_plan_is_allocated).
}

}  // namespace shardtrain
