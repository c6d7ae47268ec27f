// FULL_SHARD engine (see fsdp_engine.hpp). Order of collectives per micro-batch, identical on
// every rank: gather(root), gather(h.0..h.L-1), gather(h.L-1..h.0) each followed by
// reduce_scatter(h.l), then reduce_scatter(root).
#include "shard/fsdp_engine.hpp"

#include <algorithm>
#include <cmath>

#include "backend/math.hpp"
#include "core/error.hpp"

namespace shardtrain {

FsdpEngine::FsdpEngine(const ParamTable& table, Comm& comm, MemoryTracker& memory)
    : table_(table), comm_(comm), memory_(memory) {
  const size_t ranks = static_cast<size_t>(comm.size());
  for (const UnitInfo& u : table.units()) {
    UnitShard s;
    s.padded_numel = (u.numel + ranks - 1) / ranks * ranks;
    s.shard_numel = s.padded_numel / ranks;
    s.begin = s.shard_numel * comm.rank();
    s.params.assign(s.shard_numel, 0.0f);
    s.grads.assign(s.shard_numel, 0.0f);
    memory_.add(MEM_SHARDED_PARAMS, s.shard_numel * sizeof(float));
    memory_.add(MEM_GRADIENTS, s.shard_numel * sizeof(float));
    if (&u != &table.units()[ROOT_UNIT]) max_block_padded_ = std::max(max_block_padded_, s.padded_numel);
    shards_.push_back(std::move(s));
  }
  root_full_.resize(shards_[ROOT_UNIT].padded_numel);
  root_grad_full_.resize(shards_[ROOT_UNIT].padded_numel);
  block_full_.resize(max_block_padded_);
  block_grad_full_.resize(max_block_padded_);
  size_t max_shard = 0;
  for (const UnitShard& s : shards_) max_shard = std::max(max_shard, s.shard_numel);
  shard_scratch_.resize(max_shard);
  memory_.add(MEM_GATHERED_UNITS, (root_full_.size() + block_full_.size()) * sizeof(float));
  memory_.add(MEM_GRADIENTS, (root_grad_full_.size() + block_grad_full_.size()) * sizeof(float));
  memory_.add(MEM_COMM_BUFFERS, shard_scratch_.size() * sizeof(float));
}

FsdpEngine::~FsdpEngine() {
  for (const UnitShard& s : shards_) {
    memory_.sub(MEM_SHARDED_PARAMS, s.shard_numel * sizeof(float));
    memory_.sub(MEM_GRADIENTS, s.shard_numel * sizeof(float));
  }
  memory_.sub(MEM_GATHERED_UNITS, (root_full_.size() + block_full_.size()) * sizeof(float));
  memory_.sub(MEM_GRADIENTS, (root_grad_full_.size() + block_grad_full_.size()) * sizeof(float));
  memory_.sub(MEM_COMM_BUFFERS, shard_scratch_.size() * sizeof(float));
}

size_t FsdpEngine::local_param_count() const {
  size_t n = 0;
  for (const UnitShard& s : shards_) n += s.shard_numel;
  return n;
}

static double init_value(const ParamInfo& p, size_t index, uint64_t key, int n_layer) {
  switch (p.init) {
    case INIT_NORMAL: return 0.02 * counter_normal(key, index);
    case INIT_NORMAL_RESIDUAL: return 0.02 / std::sqrt(2.0 * n_layer) * counter_normal(key, index);
    case INIT_ONES: return 1.0;
    case INIT_ZEROS: return 0.0;
  }
  return 0.0;
}

void FsdpEngine::init_parameters(uint64_t seed) {
  const int n_layer = table_.config().n_layer;
  for (size_t u = 0; u < shards_.size(); u++) {
    UnitShard& s = shards_[u];
    std::fill(s.params.begin(), s.params.end(), 0.0f);  // padding stays zero
    const size_t lo = s.begin, hi = s.begin + s.shard_numel;
    for (int id : table_.units()[u].params) {
      const ParamInfo& p = table_.params()[id];
      const size_t from = std::max(lo, p.offset), to = std::min(hi, p.offset + p.numel);
      const uint64_t key = mix64(seed ^ mix64(static_cast<uint64_t>(p.id) + 1));
#pragma omp parallel for schedule(static)
      for (size_t e = from; e < to; e++) s.params[e - lo] = static_cast<float>(init_value(p, e - p.offset, key, n_layer));
    }
  }
}

void FsdpEngine::zero_grads() {
  for (UnitShard& s : shards_) std::fill(s.grads.begin(), s.grads.end(), 0.0f);
}

void FsdpEngine::gather_params(int unit, std::vector<float>& full) {
  const UnitShard& s = shards_[unit];
  std::copy(s.params.begin(), s.params.end(), full.begin() + s.begin);
  comm_.all_gather(Span<const float>(full.data() + s.begin, s.shard_numel), Span<float>(full.data(), s.padded_numel),
                   "all_gather(params)");
}

void FsdpEngine::reduce_scatter_grads(int unit, const std::vector<float>& full_grad) {
  UnitShard& s = shards_[unit];
  comm_.reduce_scatter_sum(Span<const float>(full_grad.data(), s.padded_numel),
                           Span<float>(shard_scratch_.data(), s.shard_numel), "reduce_scatter(grads)");
  float* g = s.grads.data();
  const float* add = shard_scratch_.data();
#pragma omp parallel for simd schedule(static)
  for (size_t i = 0; i < s.shard_numel; i++) g[i] += add[i];
}

double FsdpEngine::train_micro_batch(GptModel<float>& model, const int* tokens, const int* targets, float dloss) {
  const int L = table_.config().n_layer;
  gather_params(ROOT_UNIT, root_full_);
  model.embed_forward(root_full_.data(), tokens);
  for (int l = 0; l < L; l++) {
    gather_params(block_unit(l), block_full_);
    model.block_forward(l, block_full_.data());
  }
  double loss = model.head_forward(root_full_.data(), targets);

  std::fill(root_grad_full_.begin(), root_grad_full_.end(), 0.0f);
  model.head_backward(root_grad_full_.data(), root_full_.data(), dloss);
  for (int l = L - 1; l >= 0; l--) {
    gather_params(block_unit(l), block_full_);
    std::fill(block_grad_full_.begin(), block_grad_full_.end(), 0.0f);
    model.block_backward(l, block_grad_full_.data(), block_full_.data());
    reduce_scatter_grads(block_unit(l), block_grad_full_);
  }
  model.embed_backward(root_grad_full_.data());
  reduce_scatter_grads(ROOT_UNIT, root_grad_full_);
  return loss;
}

double FsdpEngine::eval_micro_batch(GptModel<float>& model, const int* tokens, const int* targets) {
  const int L = table_.config().n_layer;
  gather_params(ROOT_UNIT, root_full_);
  model.embed_forward(root_full_.data(), tokens);
  for (int l = 0; l < L; l++) {
    gather_params(block_unit(l), block_full_);
    model.block_forward(l, block_full_.data());
  }
  return model.head_forward(root_full_.data(), targets);
}

std::vector<float> FsdpEngine::gather_unit(int unit, bool gradients) {
  const UnitShard& s = shards_[unit];
  std::vector<float> full(s.padded_numel);
  const std::vector<float>& local = gradients ? s.grads : s.params;
  std::copy(local.begin(), local.end(), full.begin() + s.begin);
  comm_.all_gather(Span<const float>(full.data() + s.begin, s.shard_numel), Span<float>(full), "all_gather(unit)");
  full.resize(table_.units()[unit].numel);
  return full;
}

}  // namespace shardtrain
