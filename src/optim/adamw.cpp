// AdamW over shards (see adamw.hpp). The element update is adamw_update in backend/math.hpp,
// shared with the CUDA kernel.
#include "optim/adamw.hpp"

#include <algorithm>
#include <cmath>

#include "backend/math.hpp"

namespace shardtrain {

double lr_at_step(const OptimConfig& c, int step) {
  if (c.warmup_steps > 0 && step < c.warmup_steps) return c.lr * (step + 1) / c.warmup_steps;
  const double min_lr = c.lr * c.min_lr_ratio;
  const int decay_steps = c.total_steps - c.warmup_steps;
  if (decay_steps <= 1) return c.lr;
  double progress = std::min(1.0, static_cast<double>(step - c.warmup_steps) / (decay_steps - 1));
  return min_lr + 0.5 * (c.lr - min_lr) * (1.0 + std::cos(M_PI * progress));
}

AdamW::AdamW(const OptimConfig& config, FsdpEngine& engine, MemoryTracker& memory)
    : config_(config), engine_(engine), memory_(memory) {
  const ParamTable& table = engine.table();
  for (size_t u = 0; u < engine.shards().size(); u++) {
    const UnitShard& s = engine.shards()[u];
    const SpaceLayout& trainable = s.layout.trainable;  // frozen parameters have no moments
    m_.emplace_back(engine.master_device(), trainable.shard_numel);
    v_.emplace_back(engine.master_device(), trainable.shard_numel);
    if (!engine.options().cpu_offload) bytes_ += 2 * trainable.shard_numel * sizeof(float);  // device memory only
    std::vector<Segment> segs;
    for (int id : table.units()[u].params) {
      const ParamInfo& p = table.params()[id];
      if (p.frozen) continue;
      const UnitLayout::Local part = s.layout.local_part(p.range());
      if (!part.range.empty())
        segs.push_back(Segment{part.index, part.index + part.range.size(), p.weight_decay ? 1.0f : 0.0f});
    }
    segments_.push_back(std::move(segs));
  }
  memory_.add(MEM_OPTIMIZER_STATE, bytes_);
}

AdamW::~AdamW() { memory_.sub(MEM_OPTIMIZER_STATE, bytes_); }

void AdamW::zero_state() {
  for (auto& m : m_) m.zero();
  for (auto& v : v_) v.zero();
}

double AdamW::local_grad_sq_norm() const {
  double total = 0;
  for (const UnitShard& s : engine_.shards()) {
    // Only the owned part: replicas hold the same gradient shard and must count it once.
    total += engine_.master_ops().sum_squares(s.grads.data() + s.layout.trainable.owned_begin,
                                              s.layout.trainable.owned_count);
  }
  return total;
}

double AdamW::step(int step, double global_grad_norm, double grad_scale) {
  const double lr = lr_at_step(config_, step);
  const double clip_factor =
      (config_.grad_clip > 0 && global_grad_norm > config_.grad_clip) ? config_.grad_clip / (global_grad_norm + 1e-6) : 1.0;
  const float clip = static_cast<float>(clip_factor / grad_scale);  // unscale and clip in one multiply
  AdamWStep s;
  s.lr = static_cast<float>(lr);
  s.beta1 = static_cast<float>(config_.beta1);
  s.beta2 = static_cast<float>(config_.beta2);
  s.eps = static_cast<float>(config_.eps);
  s.weight_decay = static_cast<float>(config_.weight_decay);
  s.bias_correction1 = static_cast<float>(1.0 - std::pow(config_.beta1, step + 1));
  s.bias_correction2 = static_cast<float>(1.0 - std::pow(config_.beta2, step + 1));
  for (size_t u = 0; u < engine_.shards().size(); u++) {
    UnitShard& sh = engine_.shards()[u];
    float *p = sh.params.data(), *m = m_[u].data(), *v = v_[u].data();
    const float* g = sh.grads.data();
    for (const Segment& seg : segments_[u])
      engine_.master_shard_ops().adamw(p + seg.begin, m + seg.begin, v + seg.begin, g + seg.begin, seg.end - seg.begin,
                                         clip, seg.decay, s);
  }
  return lr;
}

}  // namespace shardtrain
