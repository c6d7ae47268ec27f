// The FSDP engine (see fsdp_engine.hpp). Collectives per micro-batch, identical on every rank:
// FULL_SHARD/HYBRID: gather(root), gather(h.0..h.L-1), then for h.L-1..h.0: gather(h.l) and
// reduce_scatter(h.l), then reduce_scatter(root); SHARD_GRAD_OP the same without the backward
// gathers; reduce-scatters move to finish_step() when they are deferred. finish_step() then
// all-reduces the gradient shards over the replica group.
#include "shard/fsdp_engine.hpp"

#include <algorithm>
#include <cmath>

#include "backend/math.hpp"
#include "core/error.hpp"

namespace shardtrain {

bool parse_sharding_strategy(const std::string& name, ShardingStrategy* out) {
  const ShardingStrategy all[] = {SHARDING_FULL_SHARD, SHARDING_SHARD_GRAD_OP, SHARDING_NO_SHARD,
                                  SHARDING_HYBRID_SHARD};
  for (ShardingStrategy s : all)
    if (name == sharding_strategy_name(s)) return *out = s, true;
  return false;
}

const char* sharding_strategy_name(ShardingStrategy s) {
  switch (s) {
    case SHARDING_FULL_SHARD: return "FULL_SHARD";
    case SHARDING_SHARD_GRAD_OP: return "SHARD_GRAD_OP";
    case SHARDING_NO_SHARD: return "NO_SHARD";
    case SHARDING_HYBRID_SHARD: return "HYBRID_SHARD";
  }
  return "?";
}

std::vector<UnitLayout> FsdpEngine::plan_layout(const ParamTable& table, const GroupShape& g) {
  std::vector<UnitLayout> layout;
  for (const UnitInfo& u : table.units()) {
    UnitLayout l;
    l.numel = u.numel;
    l.padded_numel = (u.numel + g.shard_size - 1) / g.shard_size * g.shard_size;
    l.shard_numel = l.padded_numel / g.shard_size;
    l.begin = l.shard_numel * g.shard_rank;
    const size_t chunk = (l.shard_numel + g.replica_size - 1) / g.replica_size;
    l.owned_begin = std::min(l.shard_numel, chunk * g.replica_rank);
    l.owned_count = std::min(l.shard_numel, l.owned_begin + chunk) - l.owned_begin;
    layout.push_back(l);
  }
  return layout;
}

std::array<size_t, MEM_CATEGORY_COUNT> FsdpEngine::plan_memory(const std::vector<UnitLayout>& layout,
                                                               const EngineOptions& options) {
  std::array<size_t, MEM_CATEGORY_COUNT> bytes{};
  size_t shards = 0, all_padded = 0, max_block = 0, max_shard = 0;
  for (size_t u = 0; u < layout.size(); u++) {
    shards += layout[u].shard_numel;
    all_padded += layout[u].padded_numel;
    max_shard = std::max(max_shard, layout[u].shard_numel);
    if (u != ROOT_UNIT) max_block = std::max(max_block, layout[u].padded_numel);
  }
  bytes[MEM_SHARDED_PARAMS] = shards * sizeof(float);
  bytes[MEM_GRADIENTS] = shards * sizeof(float);
  const bool sharded = layout[ROOT_UNIT].padded_numel != layout[ROOT_UNIT].shard_numel;
  const bool half_params = options.param_dtype != DTYPE_FP32;
  const size_t root_and_block = layout[ROOT_UNIT].padded_numel + max_block;
  if (sharded || half_params)
    bytes[MEM_GATHERED_UNITS] =
        (options.strategy == SHARDING_SHARD_GRAD_OP ? all_padded : root_and_block) * sizeof(float);
  if (half_params) bytes[MEM_COMM_BUFFERS] += std::max(layout[ROOT_UNIT].padded_numel, max_block) * sizeof(uint16_t);
  if (!sharded) return bytes;
  bytes[MEM_GRADIENTS] += (options.reduce_every_microbatch ? root_and_block : all_padded) * sizeof(float);
  bytes[MEM_COMM_BUFFERS] += 2 * max_shard * dtype_bytes(options.reduce_dtype);  // the ring's two chunk buffers
  return bytes;
}

FsdpEngine::FsdpEngine(const ParamTable& table, Comm& shard_comm, Comm& replica_comm, MemoryTracker& memory,
                       EngineOptions options)
    : table_(table), shard_comm_(shard_comm), replica_comm_(replica_comm), memory_(memory), options_(options) {
  GroupShape groups{shard_comm.size(), shard_comm.rank(), replica_comm.size(), replica_comm.rank()};
  std::vector<UnitLayout> layout = plan_layout(table, groups);
  for (const UnitLayout& l : layout) {
    UnitShard s;
    static_cast<UnitLayout&>(s) = l;
    s.params.assign(l.shard_numel, 0.0f);
    s.grads.assign(l.shard_numel, 0.0f);
    shards_.push_back(std::move(s));
  }
  engine_bytes_ = plan_memory(layout, options_);
  for (int c = 0; c < MEM_CATEGORY_COUNT; c++) memory_.add(static_cast<MemCategory>(c), engine_bytes_[c]);
  if (shard_comm.size() == 1 && options_.param_dtype == DTYPE_FP32) return;
  size_t max_block = 0;
  for (size_t u = 1; u < layout.size(); u++) max_block = std::max(max_block, layout[u].padded_numel);
  auto per_unit = [&] {
    std::vector<std::vector<float>> buffers;
    for (const UnitLayout& l : layout) buffers.emplace_back(l.padded_numel, 0.0f);
    return buffers;
  };
  auto root_and_block = [&] {
    return std::vector<std::vector<float>>{std::vector<float>(layout[ROOT_UNIT].padded_numel),
                                           std::vector<float>(max_block)};
  };
  param_buffers_ = options_.strategy == SHARDING_SHARD_GRAD_OP ? per_unit() : root_and_block();
  if (options_.param_dtype != DTYPE_FP32) wire_.resize(std::max(layout[ROOT_UNIT].padded_numel, max_block));
  if (shard_comm.size() > 1) grad_buffers_ = options_.reduce_every_microbatch ? root_and_block() : per_unit();
}

FsdpEngine::~FsdpEngine() {
  for (int c = 0; c < MEM_CATEGORY_COUNT; c++) memory_.sub(static_cast<MemCategory>(c), engine_bytes_[c]);
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
  if (!options_.reduce_every_microbatch)
    for (auto& buffer : grad_buffers_) std::fill(buffer.begin(), buffer.end(), 0.0f);
}

std::vector<float>& FsdpEngine::param_buffer(int unit) {
  if (options_.strategy == SHARDING_SHARD_GRAD_OP) return param_buffers_[unit];
  return param_buffers_[unit == ROOT_UNIT ? 0 : 1];
}

std::vector<float>& FsdpEngine::grad_buffer(int unit) {
  if (!options_.reduce_every_microbatch) return grad_buffers_[unit];
  return grad_buffers_[unit == ROOT_UNIT ? 0 : 1];
}

const float* FsdpEngine::gather_params(int unit, bool for_backward) {
  UnitShard& s = shards_[unit];
  if (param_buffers_.empty()) return s.params.data();  // fp32 on a shard group of one
  std::vector<float>& buffer = param_buffer(unit);
  // Units that stayed gathered since their forward need no second all-gather.
  if (for_backward && (unit == ROOT_UNIT || options_.strategy == SHARDING_SHARD_GRAD_OP)) return buffer.data();
  if (options_.param_dtype == DTYPE_FP32) {
    std::copy(s.params.begin(), s.params.end(), buffer.begin() + s.begin);
    shard_comm_.all_gather(Span<const float>(buffer.data() + s.begin, s.shard_numel),
                           Span<float>(buffer.data(), s.padded_numel), "all_gather(params)");
    return buffer.data();
  }
  const DType t = options_.param_dtype;
  uint16_t* wire = wire_.data();
  const float* own = s.params.data();
#pragma omp parallel for simd schedule(static)
  for (size_t i = 0; i < s.shard_numel; i++) wire[s.begin + i] = float_to_half(own[i], t);
  shard_comm_.all_gather(Span<const uint16_t>(wire + s.begin, s.shard_numel), Span<uint16_t>(wire, s.padded_numel),
                         "all_gather(params)");
  float* out = buffer.data();
#pragma omp parallel for simd schedule(static)
  for (size_t i = 0; i < s.padded_numel; i++) out[i] = half_to_float(wire[i], t);
  return out;
}

float* FsdpEngine::gradient_target(int unit) {
  if (shard_comm_.size() == 1) return shards_[unit].grads.data();
  std::vector<float>& buffer = grad_buffer(unit);
  if (options_.reduce_every_microbatch) std::fill(buffer.begin(), buffer.begin() + shards_[unit].padded_numel, 0.0f);
  return buffer.data();
}

void FsdpEngine::reduce_micro_batch_grads(int unit) {
  if (shard_comm_.size() == 1 || !options_.reduce_every_microbatch) return;
  UnitShard& s = shards_[unit];
  shard_comm_.reduce_scatter_add(Span<const float>(grad_buffer(unit).data(), s.padded_numel), Span<float>(s.grads),
                                 options_.reduce_dtype, "reduce_scatter(grads)");
}

double FsdpEngine::train_micro_batch(GptModel<float>& model, const int* tokens, const int* targets, float dloss) {
  const int L = table_.config().n_layer;
  const float* root = gather_params(ROOT_UNIT, false);
  model.embed_forward(root, tokens);
  for (int l = 0; l < L; l++) model.block_forward(l, gather_params(block_unit(l), false));
  double loss = model.head_forward(root, targets);

  float* root_grad = gradient_target(ROOT_UNIT);
  model.head_backward(root_grad, root, dloss);
  for (int l = L - 1; l >= 0; l--) {
    const float* block = gather_params(block_unit(l), true);
    model.block_backward(l, gradient_target(block_unit(l)), block);
    reduce_micro_batch_grads(block_unit(l));
  }
  model.embed_backward(root_grad);
  reduce_micro_batch_grads(ROOT_UNIT);
  return loss;
}

void FsdpEngine::finish_step() {
  if (shard_comm_.size() > 1 && !options_.reduce_every_microbatch) {
    for (int u = static_cast<int>(shards_.size()) - 1; u >= 0; u--)
      shard_comm_.reduce_scatter_add(Span<const float>(grad_buffers_[u].data(), shards_[u].padded_numel),
                                     Span<float>(shards_[u].grads), options_.reduce_dtype, "reduce_scatter(grads)");
  }
  // The replica all-reduce is linear, so once per step equals once per micro-batch.
  if (replica_comm_.size() > 1)
    for (UnitShard& s : shards_) replica_comm_.all_reduce_sum(Span<float>(s.grads), "all_reduce(grads)");
}

double FsdpEngine::eval_micro_batch(GptModel<float>& model, const int* tokens, const int* targets) {
  const int L = table_.config().n_layer;
  const float* root = gather_params(ROOT_UNIT, false);
  model.embed_forward(root, tokens);
  for (int l = 0; l < L; l++) model.block_forward(l, gather_params(block_unit(l), false));
  return model.head_forward(root, targets);
}

std::vector<float> FsdpEngine::gather_unit(int unit, bool gradients) {
  const UnitShard& s = shards_[unit];
  std::vector<float> full(s.padded_numel);
  const std::vector<float>& local = gradients ? s.grads : s.params;
  std::copy(local.begin(), local.end(), full.begin() + s.begin);
  if (shard_comm_.size() > 1)
    shard_comm_.all_gather(Span<const float>(full.data() + s.begin, s.shard_numel), Span<float>(full),
                           "all_gather(unit)");
  full.resize(table_.units()[unit].numel);
  return full;
}

}  // namespace shardtrain
