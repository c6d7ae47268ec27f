// Distillation through a whole model (model/model.hpp's HeadLoss), in double, against independent
// oracles: a teacher whose logits are the student's own adds no KL and no KL gradient (the loss and
// every gradient are alpha times the cross-entropy run's); with another teacher (another
// architecture, random weights) every student gradient matches central finite differences of the
// distillation loss.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "backend/layer_ops.hpp"
#include "model/model.hpp"
#include "support/model_fixtures.hpp"

using namespace shardtrain;
using namespace shardtrain::testing;

namespace {

using Units = std::vector<std::vector<double>>;
constexpr int B = 2, T = 5;

// The logits (B*T x V) of `table`'s model with `units` on the batch's tokens, copied to the host.
std::vector<double> logits_of(const ParamTable& table, const Units& units, const Batch& batch) {
  auto model = make_model<double>(table, B, T, false, cpu_layer_ops<double>());
  model->embed_forward(units[ROOT_UNIT].data(), batch);
  for (int l = 0; l < table.config().n_layer; l++) model->block_forward(l, units[block_unit(l)].data());
  const double* logits = model->token_logits()->head_logits(units[ROOT_UNIT].data());
  return std::vector<double>(logits, logits + static_cast<size_t>(B) * T * table.config().vocab_size);
}

// The summed loss (and gradients) of the student with the teacher's logits, or without (null).
double loss_of(const ParamTable& table, Units& units, Units* grads, const Batch& batch, const double* teacher,
               double alpha, double temperature) {
  auto model = make_model<double>(table, B, T, false, cpu_layer_ops<double>());
  DistillationLoss<double> distillation([&](const Batch&) { return teacher; }, alpha, temperature);
  if (teacher) model->set_loss(&distillation);
  std::vector<const double*> u;
  std::vector<double*> g;
  Units scratch, &out = grads ? *grads : scratch;
  out.clear();
  for (auto& unit : units) out.emplace_back(unit.size(), 0.0), u.push_back(unit.data()), g.push_back(out.back().data());
  return forward_backward_unsharded(*model, table, u, g, batch, 1.0);
}

}  // namespace

TEST(Distillation, ATeacherThatIsTheStudentAddsNoKlAndNoGradient) {
  for (const ModelConfig& config :
       {tiny_gpt2_config(), tiny_llama_config(), tiny_qwen2_config(), tiny_qwen3_config()}) {
    const ParamTable table(config);
    Units units = random_units<double>(table, 0.3, 5), plain_grads, grads;
    const Batch batch = make_batch(B, T, config.vocab_size);
    const std::vector<double> own = logits_of(table, units, batch);
    const double alpha = 0.3;
    const double plain = loss_of(table, units, &plain_grads, batch, nullptr, 1, 1);
    const double distilled = loss_of(table, units, &grads, batch, own.data(), alpha, 2.0);
    EXPECT_NEAR(distilled, alpha * plain, 1e-12 * plain) << config.arch;
    for (size_t u = 0; u < grads.size(); u++)
      for (size_t i = 0; i < grads[u].size(); i++)
        ASSERT_NEAR(grads[u][i], alpha * plain_grads[u][i], 1e-12) << config.arch << " " << u;
  }
}

// Central differences (h = 1e-5, double) of the summed distillation loss.
TEST(Distillation, StudentGradientsMatchFiniteDifferencesWithAnotherTeacher) {
  ModelConfig teacher_config = tiny_llama_config();
  teacher_config.n_layer = 3;
  const ParamTable student(tiny_gpt2_config()), teacher(teacher_config);
  ASSERT_EQ(student.config().vocab_size, teacher.config().vocab_size);
  const Batch batch = make_batch(B, T, student.config().vocab_size);
  Units teacher_units = random_units<double>(teacher, 0.5, 9), units = random_units<double>(student, 0.3, 5), grads;
  const std::vector<double> t = logits_of(teacher, teacher_units, batch);
  for (const auto& [alpha, temperature] : {std::pair{0.4, 1.7}, std::pair{0.0, 0.6}}) {
    loss_of(student, units, &grads, batch, t.data(), alpha, temperature);
    for (const ParamInfo& p : student.params())
      for (size_t i : {size_t(0), p.numel / 2, p.numel - 1}) {
        const double numeric = central_difference(units[p.unit][p.offset + i], [&] {
          return loss_of(student, units, nullptr, batch, t.data(), alpha, temperature);
        });
        EXPECT_NEAR(grads[p.unit][p.offset + i], numeric, 1e-7 + 1e-6 * std::fabs(numeric))
            << "alpha " << alpha << " T " << temperature << " " << p.name << "[" << i << "]";
      }
  }
}
