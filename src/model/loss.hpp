// What a model's output is trained against. A model's head computes its output (a language model's
// logits, N x V; a diffusion transformer's predicted velocity) and hands it to its Loss, which
// writes each row's loss and, for the backward, the output's gradient. The loss of a step is a
// mean: over units_per_row units of each output row (one token for cross-entropy, every element
// for a mean squared error), so its normaliser is the step's rows times that -- the same on any
// rank count and micro-batch split.
#pragma once

#include <functional>

#include "backend/layer_ops.hpp"
#include "model/batch.hpp"

namespace shardtrain {

// The targets of a micro-batch in the device's memory, as the model copied them from its Batch:
// a class id per row (cross-entropy) or a value per output element (regression).
template <typename Real>
struct LossTargets {
  const int* classes = nullptr;
  const Real* values = nullptr;
};

template <typename Real>
class Loss {
 public:
  virtual ~Loss() = default;
  // The units each output row's loss averages over (rows of `width` values).
  virtual int units_per_row(int width) const = 0;
  // Called with each micro-batch before the model's forward, on every rank of the group: a loss
  // that needs more than the targets (a teacher's logits) computes it here.
  virtual void prepare(const Batch&) {}
  // losses[r]: row r's loss, summed over its units. `output` (rows x width) is replaced by what
  // backward turns into its gradient.
  virtual void forward(const LayerOps<Real>& ops, Real* losses, Real* output, const LossTargets<Real>& targets,
                       int rows, int width) const = 0;
  // output: what forward left, replaced by dloss x d(summed loss)/d(output).
  virtual void backward(const LayerOps<Real>& ops, Real* output, const LossTargets<Real>& targets, Real dloss,
                        int rows, int width) const = 0;
};

// Cross-entropy of each row's logits against its class: softmax, -log p(target).
template <typename Real>
class CrossEntropyLoss final : public Loss<Real> {
 public:
  int units_per_row(int) const override { return 1; }
  void forward(const LayerOps<Real>& ops, Real* losses, Real* output, const LossTargets<Real>& t, int rows,
               int width) const override {
    ops.softmax_crossentropy_forward(losses, output, t.classes, rows, width);
  }
  void backward(const LayerOps<Real>& ops, Real* output, const LossTargets<Real>& t, Real dloss, int rows,
                int width) const override {
    ops.softmax_crossentropy_backward(output, t.classes, dloss, rows, width);
  }
};

// Mean squared error of each output element against its target value (a diffusion model's
// flow-matching regression): the loss averages over every element of every row.
template <typename Real>
class SquaredErrorLoss final : public Loss<Real> {
 public:
  int units_per_row(int width) const override { return width; }
  void forward(const LayerOps<Real>& ops, Real* losses, Real* output, const LossTargets<Real>& t, int rows,
               int width) const override {
    ops.squared_error_forward(losses, output, t.values, rows, width);
  }
  // forward left the gradient of the summed loss itself.
  void backward(const LayerOps<Real>& ops, Real* output, const LossTargets<Real>&, Real dloss, int rows,
                int width) const override {
    ops.scale(output, static_cast<size_t>(rows) * width, dloss);
  }
};

// Knowledge distillation (docs/distillation.md): alpha CE + (1 - alpha) T^2 KL(teacher_T ||
// student_T) per row (LayerOps::distill_loss_forward), against the logits a teacher gives for the
// same micro-batch (rows x width in the device's memory, kept until the next prepare).
template <typename Real>
class DistillationLoss final : public Loss<Real> {
 public:
  using TeacherLogits = std::function<const Real*(const Batch&)>;
  DistillationLoss(TeacherLogits teacher, Real alpha, Real temperature)
      : teacher_(std::move(teacher)), alpha_(alpha), temperature_(temperature) {}
  int units_per_row(int) const override { return 1; }
  void prepare(const Batch& batch) override { logits_ = teacher_(batch); }
  void forward(const LayerOps<Real>& ops, Real* losses, Real* output, const LossTargets<Real>& t, int rows,
               int width) const override {
    SHARD_CHECK(logits_, "DistillationLoss::forward before prepare");
    ops.distill_loss_forward(losses, output, logits_, t.classes, rows, width, alpha_, temperature_);
  }
  // forward left the gradient of the summed loss itself.
  void backward(const LayerOps<Real>& ops, Real* output, const LossTargets<Real>&, Real dloss, int rows,
                int width) const override {
    ops.scale(output, static_cast<size_t>(rows) * width, dloss);
  }

 private:
  TeacherLogits teacher_;
  Real alpha_, temperature_;
  const Real* logits_ = nullptr;
};

}  // namespace shardtrain
