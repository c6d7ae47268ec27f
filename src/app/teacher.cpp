// See teacher.hpp.
#include "app/teacher.hpp"

#include "app/frozen_model.hpp"
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
  std::unique_ptr<ParamTable> table;
  rt.agree_on([&] {
    table = std::make_unique<ParamTable>(teacher_param_table(source, quant));
    const ModelConfig& c = table->config();
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
  });
  frozen_ = std::make_unique<FrozenModel>(rt, world, shard, replica, compute, student_options, std::move(*table),
                                          source, B, T, watchdog);
}

}  // namespace shardtrain
