// AdamW over shards (see adamw.hpp). The element update is adamw_update in backend/math.hpp,
// shared with the CUDA kernel.
#include "optim/adamw.hpp"

#include <algorithm>
#include <cmath>

#include "backend/math.hpp"

namespace shardtrain {

const char* lr_schedule_name(LrSchedule s) {
  switch (s) {
    case LR_COSINE: return "cosine";
    case LR_LINEAR: return "linear";
    case LR_CONSTANT: return "constant";
    case LR_WSD: return "wsd";
  }
  return "?";
}

double lr_at_step(const OptimConfig& c, int step) {
  if (c.warmup_steps > 0 && step < c.warmup_steps) return c.lr * (step + 1) / c.warmup_steps;
  if (c.schedule == LR_CONSTANT) return c.lr;
  const double min_lr = c.lr * c.min_lr_ratio;
  const int after_warmup = c.total_steps - c.warmup_steps;
  // The decay's first step runs at lr, its last at min_lr.
  const int decay_steps = c.schedule != LR_WSD ? after_warmup
                          : std::min(after_warmup, c.decay_steps > 0 ? c.decay_steps : std::max(1, after_warmup / 5));
  const int decay_start = c.total_steps - decay_steps;
  if (decay_steps <= 1 || step < decay_start) return c.lr;
  const double progress = std::min(1.0, static_cast<double>(step - decay_start) / (decay_steps - 1));
  if (c.schedule == LR_LINEAR) return c.lr + (min_lr - c.lr) * progress;
  return min_lr + 0.5 * (c.lr - min_lr) * (1.0 + std::cos(M_PI * progress));
}

namespace {

// The fused step's table, entry by entry: each trainable parameter's part of this rank's shard of
// each unit, with its weight-decay setting, cut into pieces of at most kAdamWSegmentElements.
// fn(unit, index in the unit's shard, elements, decay).
template <typename Fn>
void for_each_segment(const ParamTable& table, const std::vector<UnitLayout>& layout, Fn fn) {
  for (size_t u = 0; u < layout.size(); u++)
    for (int id : table.units()[u].params) {
      const ParamInfo& p = table.params()[id];
      if (p.frozen) continue;
      const UnitLayout::Local part = layout[u].local_part(p.range());
      for (size_t at = 0; at < part.range.size(); at += kAdamWSegmentElements)
        fn(u, part.index + at, std::min(kAdamWSegmentElements, part.range.size() - at), p.weight_decay ? 1.0f : 0.0f);
    }
}

}  // namespace

size_t AdamW::plan_table_bytes(const ParamTable& table, int shard_size) {
  size_t most = 0;
  for (int g = 0; g < shard_size; g++) {  // the layout's shard ranges depend on the shard rank alone
    size_t count = 0;
    for_each_segment(table, FsdpEngine::plan_layout(table, GroupShape{shard_size, g, 1, 0}),
                     [&](size_t, size_t, size_t, float) { count++; });
    most = std::max(most, count);
  }
  return most * sizeof(AdamWSegment);
}

AdamW::AdamW(const OptimConfig& config, FsdpEngine& engine, MemoryTracker& memory)
    : config_(config), engine_(engine), memory_(memory) {
  const ParamTable& table = engine.table();
  for (const UnitShard& s : engine.shards()) {
    const SpaceLayout& trainable = s.layout.trainable;  // frozen parameters have no moments
    m_.emplace_back(engine.master_device(), trainable.shard_numel);
    v_.emplace_back(engine.master_device(), trainable.shard_numel);
  }
  std::vector<UnitLayout> layout;
  for (const UnitShard& s : engine.shards()) layout.push_back(s.layout);
  std::vector<AdamWSegment> segments;
  for_each_segment(table, layout, [&](size_t u, size_t i, size_t n, float decay) {
    UnitShard& s = engine.shards()[u];
    segments.push_back(AdamWSegment{s.params.data() + i, m_[u].data() + i, v_[u].data() + i, s.grads.data() + i, n, decay});
  });
  segments_ = DeviceArray<AdamWSegment>(engine.master_device(),
                                        plan_table_bytes(table, engine.shard_group_size()) / sizeof(AdamWSegment));
  segment_count_ = segments.size();
  engine.master_device().copy_to_device(segments_.data(), segments.data(), segment_count_ * sizeof(AdamWSegment));
  if (!engine.options().cpu_offload) {  // device memory only
    for (size_t u = 0; u < m_.size(); u++) bytes_ += m_[u].bytes() + v_[u].bytes();
    bytes_ += segments_.bytes();
  }
  memory_.add(MEM_OPTIMIZER_STATE, bytes_);
}

AdamW::~AdamW() { memory_.sub(MEM_OPTIMIZER_STATE, bytes_); }

void AdamW::zero_state() {
  for (auto& m : m_) m.zero();
  for (auto& v : v_) v.zero();
}

void AdamW::accumulate_grad_sq_norm(double* total) const {
  for (const UnitShard& s : engine_.shards())
    // Only the owned part: replicas hold the same gradient shard and must count it once.
    engine_.master_ops().accumulate_sum_squares(total, s.grads.data() + s.layout.trainable.owned_begin,
                                                s.layout.trainable.owned_count);
}

double AdamW::step(int step, const double* sums, double grad_scale) {
  const double lr = lr_at_step(config_, step);
  AdamWStep s;
  s.lr = static_cast<float>(lr);
  s.beta1 = static_cast<float>(config_.beta1);
  s.beta2 = static_cast<float>(config_.beta2);
  s.eps = static_cast<float>(config_.eps);
  s.weight_decay = static_cast<float>(config_.weight_decay);
  s.bias_correction1 = static_cast<float>(1.0 - std::pow(config_.beta1, step + 1));
  s.bias_correction2 = static_cast<float>(1.0 - std::pow(config_.beta2, step + 1));
  engine_.master_shard_ops().adamw_multi(segments_.data(), segment_count_, sums,
                                         AdamWClip{config_.grad_clip, grad_scale}, s);
  engine_.params_changed();
  return lr;
}

}  // namespace shardtrain
