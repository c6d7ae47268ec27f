// fp16 dynamic loss scaling, as PyTorch's GradScaler does it: the loss (and so every gradient) is
// multiplied by a power of two so that small fp16 gradients do not flush to zero; a step whose
// gradients overflow (inf/NaN) is skipped and the scale halved; after GROWTH_INTERVAL good steps in
// a row the scale doubles. Without fp16 anywhere the scale is 1 and nothing is skipped.
#pragma once

#include <cmath>
#include <cstdint>

namespace shardtrain {

class LossScaler {
 public:
  static constexpr double INITIAL_SCALE = 65536;  // 2^16
  static constexpr int GROWTH_INTERVAL = 200;

  explicit LossScaler(bool enabled) : enabled_(enabled), scale_(enabled ? INITIAL_SCALE : 1.0) {}

  bool enabled() const { return enabled_; }
  double scale() const { return scale_; }
  // What a checkpoint stores: log2 of the scale and the good steps since it last changed.
  int64_t scale_log2() const { return std::lround(std::log2(scale_)); }
  int64_t good_steps() const { return good_steps_; }
  void restore(int64_t scale_log2, int64_t good_steps) {
    if (!enabled_) return;
    scale_ = std::ldexp(1.0, static_cast<int>(scale_log2));
    good_steps_ = good_steps;
  }

  // After a step whose loss and gradient norm were (not) finite: whether the step was skipped as an
  // fp16 overflow (the scale is halved). A non-finite step without scaling is not skipped here: it
  // is the caller's divergence.
  bool update(bool finite) {
    if (!enabled_) return false;
    if (!finite) {
      scale_ /= 2, good_steps_ = 0;
      return true;
    }
    if (++good_steps_ % GROWTH_INTERVAL == 0) scale_ *= 2;
    return false;
  }

 private:
  bool enabled_;
  double scale_;
  int64_t good_steps_ = 0;
};

}  // namespace shardtrain
