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
  if (ranks == 1) return;
  root_full_.resize(shards_[ROOT_UNIT].padded_numel);
  root_grad_full_.resize(shards_[ROOT_UNIT].padded_numel);
  block_full_.resize(max_block_padded_);
  block_grad_full_.resize(max_block_padded_);
  size_t max_shard = 0;
  for (const UnitShard& s : shards_) max_shard = std::max(max_shard, s.shard_numel);
  unsharded_bytes_ = (root_full_.size() + block_full_.size()) * sizeof(float);
  comm_bytes_ = 2 * max_shard * sizeof(float);  // the ring reduce-scatter's two chunk buffers
  memory_.add(MEM_GATHERED_UNITS, unsharded_bytes_);
  memory_.add(MEM_GRADIENTS, unsharded_bytes_);
  memory_.add(MEM_COMM_BUFFERS, comm_bytes_);
}

FsdpEngine::~FsdpEngine() {
  for (const UnitShard& s : shards_) {
    memory_.sub(MEM_SHARDED_PARAMS, s.shard_numel * sizeof(float));
    memory_.sub(MEM_GRADIENTS, s.shard_numel * sizeof(float));
  }
  memory_.sub(MEM_GATHERED_UNITS, unsharded_bytes_);
  memory_.sub(MEM_GRADIENTS, unsharded_bytes_);
  memory_.sub(MEM_COMM_BUFFERS, comm_bytes_);
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

const float* FsdpEngine::gather_params(int unit, std::vector<float>& buffer) {
  const UnitShard& s = shards_[unit];
  if (comm_.size() == 1) return s.params.data();
  std::copy(s.params.begin(), s.params.end(), buffer.begin() + s.begin);
  comm_.all_gather(Span<const float>(buffer.data() + s.begin, s.shard_numel),
                   Span<float>(buffer.data(), s.padded_numel), "all_gather(params)");
  return buffer.data();
}

float* FsdpEngine::gradient_target(int unit, std::vector<float>& buffer) {
  if (comm_.size() == 1) return shards_[unit].grads.data();
  std::fill(buffer.begin(), buffer.begin() + shards_[unit].padded_numel, 0.0f);
  return buffer.data();
}

void FsdpEngine::reduce_scatter_grads(int unit, const std::vector<float>& buffer) {
  if (comm_.size() == 1) return;
  UnitShard& s = shards_[unit];
  comm_.reduce_scatter_add(Span<const float>(buffer.data(), s.padded_numel), Span<float>(s.grads),
                           "reduce_scatter(grads)");
}

double FsdpEngine::train_micro_batch(GptModel<float>& model, const int* tokens, const int* targets, float dloss) {
  const int L = table_.config().n_layer;
  const float* root = gather_params(ROOT_UNIT, root_full_);
  model.embed_forward(root, tokens);
  for (int l = 0; l < L; l++) model.block_forward(l, gather_params(block_unit(l), block_full_));
  double loss = model.head_forward(root, targets);

  float* root_grad = gradient_target(ROOT_UNIT, root_grad_full_);
  model.head_backward(root_grad, root, dloss);
  for (int l = L - 1; l >= 0; l--) {
    const float* block = gather_params(block_unit(l), block_full_);
    model.block_backward(l, gradient_target(block_unit(l), block_grad_full_), block);
    reduce_scatter_grads(block_unit(l), block_grad_full_);
  }
  model.embed_backward(root_grad);
  reduce_scatter_grads(ROOT_UNIT, root_grad_full_);
  return loss;
}

double FsdpEngine::eval_micro_batch(GptModel<float>& model, const int* tokens, const int* targets) {
  const int L = table_.config().n_layer;
  const float* root = gather_params(ROOT_UNIT, root_full_);
  model.embed_forward(root, tokens);
  for (int l = 0; l < L; l++) model.block_forward(l, gather_params(block_unit(l), block_full_));
  return model.head_forward(root, targets);
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
