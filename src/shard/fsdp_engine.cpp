// The FSDP engine (see fsdp_engine.hpp). Collectives per micro-batch, identical on every rank:
// FULL_SHARD/HYBRID: gather(root), gather(h.0..h.L-1), then for h.L-1..h.0: gather(h.l) and
// reduce_scatter(h.l), then reduce_scatter(root) -- a unit with frozen parameters gathers each of
// its two spaces, reduces only the trainable one, and the backward stops above the blocks that
// neither train nor lead to a trainable embedding (ParamTable::backward_floor); SHARD_GRAD_OP the same without the
// backward gathers; reduce-scatters move to finish_step() when they are deferred. finish_step() then all-reduces the
// gradient shards over the replica group.
#include "shard/fsdp_engine.hpp"

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>

#include "core/error.hpp"
#include "core/random.hpp"

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

bool parse_backward_prefetch(const std::string& name, BackwardPrefetch* out) {
  for (BackwardPrefetch p : {BACKWARD_PREFETCH_NONE, BACKWARD_PREFETCH_PRE, BACKWARD_PREFETCH_POST})
    if (name == backward_prefetch_name(p)) return *out = p, true;
  return false;
}

const char* backward_prefetch_name(BackwardPrefetch p) {
  return p == BACKWARD_PREFETCH_PRE ? "BACKWARD_PRE" : (p == BACKWARD_PREFETCH_POST ? "BACKWARD_POST" : "NONE");
}

// granule: the shard boundaries fall on multiples of it (a quantized space's block).
static SpaceLayout plan_space(size_t base, size_t numel, bool lead_padding, size_t local, const GroupShape& g,
                              size_t granule = 1) {
  const size_t group = static_cast<size_t>(g.shard_size), tile = group * granule;
  SpaceLayout s;
  s.base = base;
  s.numel = numel;
  s.padded_numel = (numel + tile - 1) / tile * tile;
  s.lead = lead_padding ? s.padded_numel - numel : 0;
  s.shard_numel = s.padded_numel / group;
  s.begin = s.shard_numel * g.shard_rank;
  const size_t chunk = (s.shard_numel + g.replica_size - 1) / g.replica_size;
  s.owned_begin = std::min(s.shard_numel, chunk * g.replica_rank);
  s.owned_count = std::min(s.shard_numel, s.owned_begin + chunk) - s.owned_begin;
  s.local = local;
  return s;
}

std::vector<UnitLayout> FsdpEngine::plan_layout(const ParamTable& table, const GroupShape& g) {
  std::vector<UnitLayout> layout;
  for (const UnitInfo& u : table.units()) {
    UnitLayout l;
    l.numel = u.extent();
    const size_t frozen = u.plain_numel - u.trainable_numel;
    l.trainable = plan_space(0, u.trainable_numel, frozen + u.quantized_numel > 0, 0, g);
    l.frozen = plan_space(u.trainable_numel, frozen, false, l.trainable.shard_numel, g);
    if (u.quantized_numel > 0) {
      l.quant = table.quant().type;
      l.block = table.quant().block;
      l.nested = table.quant().nested;
      for (int id : u.params)
        if (const ParamInfo& p = table.params()[id]; p.quantized && l.nested)
          l.nested_weights++, l.nested_groups += nested_groups((p.numel + l.block - 1) / l.block);
    }
    l.quantized = plan_space(u.plain_numel, u.quantized_numel, false, l.held_numel(), g, std::max<size_t>(l.block, 1));
    layout.push_back(l);
  }
  return layout;
}

bool FsdpEngine::keeps_half_shard(const EngineOptions& options) {
  return options.keep_half_shard && options.param_dtype != DTYPE_FP32;
}

std::vector<PlannedAllocation> FsdpEngine::plan_allocations(const std::vector<UnitLayout>& layout,
                                                           const EngineOptions& options) {
  std::vector<PlannedAllocation> list;
  auto add = [&](MemCategory category, size_t bytes, bool mapped = false) {
    if (bytes) list.push_back({category, bytes, mapped});
  };
  // Each unit's master shard and its gradient shard, then its quantized records (UnitShard); with
  // cpu_offload the master shards and gradients are host memory and the device keeps a gradient
  // shard per unit for the reductions (device_grads_).
  size_t max_grad_shard = 0, max_block_trainable = 0;
  for (const UnitLayout& l : layout) {
    if (!options.cpu_offload) add(MEM_SHARDED_PARAMS, l.held_numel() * sizeof(float));
    if (!options.inference) add(MEM_GRADIENTS, l.trainable.shard_numel * sizeof(float));
    if (!options.cpu_offload) add(MEM_SHARDED_PARAMS, l.packed_bytes());
    if (keeps_half_shard(options)) add(MEM_SHARDED_PARAMS, l.held_numel() * sizeof(uint16_t));  // on the device
    max_grad_shard = std::max(max_grad_shard, l.trainable.shard_numel);
    if (&l != &layout[ROOT_UNIT]) max_block_trainable = std::max(max_block_trainable, l.trainable.padded_numel);
  }
  // The gather slots: each its fp32 values (those with memory behind them), with a 16-bit
  // param_dtype the gathered 16-bit copy the GEMMs multiply (unless the units' kept copies are it),
  // and a quantized unit's gathered records.
  for (const GatherSlot& slot : plan_gather_slots(layout, options)) {
    add(MEM_GATHERED_UNITS, slot.backed * sizeof(float), slot.backed < slot.numel);
    add(MEM_COMM_BUFFERS, slot.wire * sizeof(uint16_t));
    add(MEM_COMM_BUFFERS, slot.record_bytes);
  }
  const bool sharded = layout[ROOT_UNIT].padded_numel() != layout[ROOT_UNIT].shard_numel();
  if (!sharded || options.inference) return list;
  // The gradient buffers the reduce-scatters read: per unit, or (reducing every micro-batch) the
  // root's and one block's, a second with overlap.
  const size_t root_trainable = layout[ROOT_UNIT].trainable.padded_numel;
  if (options.reduce_every_microbatch) {
    add(MEM_GRADIENTS, root_trainable * sizeof(float));
    add(MEM_GRADIENTS, max_block_trainable * sizeof(float));
    if (options.overlap_reduce_scatter) add(MEM_GRADIENTS, max_block_trainable * sizeof(float));
  } else {
    for (const UnitLayout& l : layout) add(MEM_GRADIENTS, l.trainable.padded_numel * sizeof(float));
  }
  // The communicators' reduce-scatter buffers (src/comm/mpi_comm.cpp: the ring's two chunks;
  // src/comm/cuda/nccl_comm.cpp: the received chunk, and in 16 bits the whole unit rounded).
  if (!options.nccl) {
    add(MEM_COMM_BUFFERS, max_grad_shard * dtype_bytes(options.reduce_dtype));
    add(MEM_COMM_BUFFERS, max_grad_shard * dtype_bytes(options.reduce_dtype));
  } else if (options.reduce_dtype == DTYPE_FP32) {
    add(MEM_COMM_BUFFERS, max_grad_shard * sizeof(float));
  } else {
    add(MEM_COMM_BUFFERS, std::max(root_trainable, max_block_trainable) * sizeof(uint16_t));
    add(MEM_COMM_BUFFERS, max_grad_shard * sizeof(uint16_t));
  }
  return list;
}

std::vector<FsdpEngine::GatherSlot> FsdpEngine::plan_gather_slots(const std::vector<UnitLayout>& layout,
                                                                 const EngineOptions& options) {
  const bool sharded = layout[ROOT_UNIT].padded_numel() != layout[ROOT_UNIT].shard_numel();
  const bool half = options.param_dtype != DTYPE_FP32;
  const bool half_only = half && options.linear_weights_in_half_only;
  GatherSlot block;
  for (size_t u = 1; u < layout.size(); u++) {
    block.numel = std::max(block.numel, layout[u].padded_numel());
    block.backed = std::max(block.backed, layout[u].backed_numel(half_only));
    block.record_bytes = std::max(block.record_bytes, layout[u].gathered_record_bytes());
  }
  // fp32 on a shard group of one with nothing quantized: the model reads the shards themselves.
  if (!sharded && !half && !options.cpu_offload && block.record_bytes == 0) return {};
  // A 16-bit buffer of its own unless every unit the slot takes is gathered as its kept copy.
  auto as_kept_copy = [&options](const UnitLayout& l) {
    return keeps_half_shard(options) && l.shard_is_gathered_layout();
  };
  const bool blocks_as_kept = std::all_of(layout.begin() + 1, layout.end(), as_kept_copy);
  block.wire = half && !blocks_as_kept ? block.numel : 0;
  auto slot_of = [&](const UnitLayout& l) {
    return GatherSlot{l.padded_numel(), l.backed_numel(half_only), l.gathered_record_bytes(),
                      half && !as_kept_copy(l) ? l.padded_numel() : 0};
  };
  std::vector<GatherSlot> slots;
  if (options.strategy == SHARDING_SHARD_GRAD_OP) {
    for (const UnitLayout& l : layout) slots.push_back(slot_of(l));
  } else {
    slots.push_back(slot_of(layout[ROOT_UNIT]));
    slots.insert(slots.end(), static_cast<size_t>(options.limit_all_gathers), block);
  }
  return slots;
}

std::array<size_t, MEM_CATEGORY_COUNT> FsdpEngine::plan_memory(const std::vector<UnitLayout>& layout,
                                                               const EngineOptions& options) {
  std::array<size_t, MEM_CATEGORY_COUNT> bytes{};
  for (const PlannedAllocation& a : plan_allocations(layout, options)) bytes[a.category] += a.bytes;
  return bytes;
}

FsdpEngine::FsdpEngine(const ParamTable& table, Comm& shard_comm, Comm& replica_comm, MemoryTracker& memory,
                       const EngineOptions& options, const Backend& backend)
    : table_(table),
      shard_comm_(shard_comm),
      replica_comm_(replica_comm),
      memory_(memory),
      options_(options),
      backend_(backend) {
  SHARD_CHECK(backend_.device && backend_.ops && backend_.shard_ops, "a backend without its device operations");
  SHARD_CHECK(!options_.cpu_offload || (backend_.host && backend_.host_ops && backend_.host_shard_ops),
              "cpu_offload with a backend that has no host operations");
  Device& dev = *backend_.device;
  Device& master = master_device();
  GroupShape groups{shard_comm.size(), shard_comm.rank(), replica_comm.size(), replica_comm.rank()};
  std::vector<UnitLayout> layout = plan_layout(table, groups);
  for (const UnitLayout& l : layout) {
    shards_.emplace_back(l, master, !options_.inference, keeps_half_shard(options_) ? &dev : nullptr);
    if (options_.cpu_offload && !options_.inference) device_grads_.emplace_back(dev, l.trainable.shard_numel);
  }
  engine_bytes_ = plan_memory(layout, options_);
  for (int c = 0; c < MEM_CATEGORY_COUNT; c++) memory_.add(static_cast<MemCategory>(c), engine_bytes_[c]);
  const bool half = options_.param_dtype != DTYPE_FP32;
  const bool half_only = half && options_.linear_weights_in_half_only;
  SHARD_CHECK(!half_only || backend_.ops->multiplies_half_copies(options_.param_dtype),
              "linear_weights_in_half_only where the GEMMs read fp32 operands");
  if (half_only)
    for (size_t u = 0; u < layout.size(); u++) {
      std::vector<FlatRange> read;  // in the gathered buffer, in order
      for (int id : table.units()[u].params)
        if (const ParamInfo& p = table.params()[id]; !p.linear_weight)
          read.push_back({layout[u].lead() + p.offset, layout[u].lead() + p.offset + p.numel});
      std::sort(read.begin(), read.end(), [](const FlatRange& a, const FlatRange& b) { return a.begin < b.begin; });
      std::vector<FlatRange>& ranges = widened_.emplace_back();
      for (const FlatRange& r : read) {
        if (!ranges.empty() && ranges.back().end == r.begin)
          ranges.back().end = r.end;
        else
          ranges.push_back(r);
      }
    }
  for (const GatherSlot& planned : plan_gather_slots(layout, options_)) {
    ParamSlot slot;
    slot.values = DeviceArray<float>(dev, planned.numel, planned.backed);
    // Until a gather writes there it reads as NaN, so a read that should have taken the 16-bit
    // copy shows (later it may be another unit's values, in a block buffer shared by layouts).
    if (half_only) backend_.ops->scale(slot.values.data(), planned.backed, std::numeric_limits<float>::quiet_NaN());
    if (planned.wire) {  // the GEMMs multiply the gathered 16-bit copy: the weights are rounded once, by the gather
      slot.wire = DeviceArray<uint16_t>(dev, planned.wire);
      slot.half = slot.wire.data();
      backend_.ops->bind_half_copy(slot.values.data(), slot.half, planned.wire, options_.param_dtype);
    }
    slot.records = DeviceArray<uint8_t>(dev, planned.record_bytes);
    slots_.push_back(std::move(slot));
  }
  size_t max_block_trainable = 0;
  for (size_t u = 1; u < layout.size(); u++)
    max_block_trainable = std::max(max_block_trainable, layout[u].trainable.padded_numel);
  if (shard_comm.size() == 1 || options_.inference) return;
  if (options_.reduce_every_microbatch) {
    grad_buffers_.emplace_back(dev, layout[ROOT_UNIT].trainable.padded_numel);
    grad_buffers_.emplace_back(dev, max_block_trainable);
    if (options_.overlap_reduce_scatter) grad_buffers_.emplace_back(dev, max_block_trainable);
  } else {
    for (const UnitLayout& l : layout) grad_buffers_.emplace_back(dev, l.trainable.padded_numel);
  }
  reduce_handles_.assign(grad_buffers_.size(), -1);
}

namespace {

// The valid elements of each block of this rank's quantized shard: those of the weight it lies
// in (a partial last block has fewer), 0 for the padding between weights and after the space.
std::vector<size_t> block_valid_counts(const UnitLayout& l, const ParamTable& table, int unit) {
  std::vector<size_t> valid(l.quantized.shard_numel / l.block, 0);
  for (int id : table.units()[unit].params) {
    const ParamInfo& p = table.params()[id];
    if (!p.quantized) continue;
    const FlatRange mine = intersect(l.quantized.shard_range(), p.range());
    for (size_t x = mine.begin; x < mine.end; x += l.block)
      valid[(l.quantized.local_index(x) - l.quantized.local) / l.block] = std::min(l.block, p.offset + p.numel - x);
  }
  return valid;
}

}  // namespace

HostShard::HostShard(UnitShard& shard, const ParamTable& table, int unit, bool with_quantized, Comm& comm,
                     Device& device)
    : shard_(shard),
      table_(table),
      unit_(unit),
      comm_(comm),
      device_(device),
      direct_(shard.params.on_host() && shard.layout.quantized.numel == 0) {
  if (direct_) return;
  const UnitLayout& l = shard.layout;
  copy_.assign(l.shard_numel(), 0.0f);
  if (shard.params.size()) shard.params.device()->copy_to_host(copy_.data(), shard.params.data(), shard.params.bytes());
  if (l.quantized.numel == 0 || !with_quantized) return;
  std::vector<uint8_t> records(shard.packed.size());
  shard.packed.device()->copy_to_host(records.data(), shard.packed.data(), shard.packed.bytes());
  cpu_shard_ops().dequantize_blocks(copy_.data() + l.held_numel(), nullptr, DTYPE_FP32, records.data(),
                                    l.shard_records(), l.quant, l.block,
                                    l.nested_view(records.data(), l.shard_records(), l.quantized.begin / l.block));
}

void HostShard::upload(bool with_quantized, const std::vector<std::vector<float>>* nested_given) {
  shard_.half_current[0] = shard_.half_current[1] = false;  // direct_: written in place, stale all the same
  if (direct_) return;
  const UnitLayout& l = shard_.layout;
  if (shard_.params.size()) shard_.params.device()->copy_to_device(shard_.params.data(), copy_.data(), shard_.params.bytes());
  if (l.quantized.numel == 0 || !with_quantized) return;
  const std::vector<size_t> valid = block_valid_counts(l, table_, unit_);
  std::vector<uint8_t> records(shard_.packed.size());
  const float* values = copy_.data() + l.held_numel();
  if (!l.nested) {
    const size_t record = l.record_bytes();
#pragma omp parallel for schedule(static)
    for (size_t b = 0; b < valid.size(); b++)
      quantize_block(l.quant, values + b * l.block, valid[b], l.block, records.data() + b * record);
    shard_.packed.device()->copy_to_device(shard_.packed.data(), records.data(), shard_.packed.bytes());
    return;
  }
  // Each block as bitsandbytes quantizes it, its fp32 absmax kept apart; then the absmax coded
  // under the weight's offset and its group's scale.
  const size_t plain = quant_record_bytes(l.quant, l.block), code_bytes = quant_code_bytes(l.quant, l.block);
  const size_t record = l.record_bytes();
  std::vector<float> absmax(valid.size());
#pragma omp parallel for schedule(static)
  for (size_t b = 0; b < valid.size(); b++) {
    std::vector<uint8_t> block_record(plain);
    quantize_block(l.quant, values + b * l.block, valid[b], l.block, block_record.data());
    std::memcpy(records.data() + b * record, block_record.data(), code_bytes);
    absmax[b] = quant_scale(l.quant, block_record.data(), l.block);
  }
  fill_nested_table(absmax, nested_given, records.data() + l.table_offset(valid.size()));
  const NestedScales nested = l.nested_view(records.data(), valid.size(), l.quantized.begin / l.block);
  for (size_t b = 0; b < valid.size(); b++) {
    uint8_t& code = records[b * record + code_bytes];
    const NestedWeight* x = nested_weight(nested, b);
    if (!x) {
      code = 0;  // padding after the weights
      continue;
    }
    const float scale = nested_group_scale(nested, *x, b);
    code = nested_code_of_decoded(absmax[b], x->offset, scale);
    // bitsandbytes decodes a block's absmax below zero where it is small beside its group's: the
    // block's values are its codes times that negative number. Found exactly, such a block is
    // coded from its negated values under it, which gives its codes back.
    const int negative = absmax[b] > 0 && nested_absmax(nested, b, code) != absmax[b]
                             ? nested_code_decoding_to(-absmax[b], x->offset, scale)
                             : -1;
    if (negative < 0) continue;
    std::vector<float> negated(values + b * l.block, values + b * l.block + valid[b]);
    for (float& v : negated) v = -v;
    std::vector<uint8_t> block_record(plain);
    quantize_block(l.quant, negated.data(), valid[b], l.block, block_record.data());
    std::memcpy(records.data() + b * record, block_record.data(), code_bytes);
    code = static_cast<uint8_t>(negative);
  }
  shard_.packed.device()->copy_to_device(shard_.packed.data(), records.data(), shard_.packed.bytes());
}

void HostShard::fill_nested_table(const std::vector<float>& absmax, const std::vector<std::vector<float>>* given,
                                  uint8_t* table) {
  const UnitLayout& l = shard_.layout;
  SHARD_CHECK(!given || given->size() == l.nested_weights, "%zu nested tables given for %zu weights",
              given ? given->size() : 0, l.nested_weights);
  // Gathered whether or not every weight's table is given: which collectives run must not depend
  // on what one rank read.
  std::vector<float> all;
  {
    // Every rank's absmax, in the order of the unit's records: gathered in host memory, or on a GPU
    // in the device memory its communicator takes. A loader's transient, like the host shard.
    const size_t mine = absmax.size() * sizeof(float), total = mine * static_cast<size_t>(comm_.size());
    all.resize(l.all_records());
    uint8_t* host = reinterpret_cast<uint8_t*>(all.data());
    DeviceArray<uint8_t> on_device(device_, device_.is_host() ? 0 : total);
    uint8_t* wire = device_.is_host() ? host : on_device.data();
    uint8_t* own = wire + mine * static_cast<size_t>(comm_.rank());
    device_.copy_to_device(own, absmax.data(), mine);
    comm_.all_gather(Span<const uint8_t>(own, mine), Span<uint8_t>(wire, total),
                     "all_gather(absmax for double quantization)");
    if (!device_.is_host()) device_.copy_to_host(host, wire, total);
  }
  // Per quantized weight its records, offset and group scales.
  std::vector<NestedWeight> weights;
  std::vector<float> scales(l.nested_groups);
  size_t group = 0;
  for (int id : table_.units()[unit_].params) {
    const ParamInfo& p = table_.params()[id];
    if (!p.quantized) continue;
    NestedWeight& x = weights.emplace_back();
    x.first_record = (p.offset - table_.units()[unit_].plain_numel) / l.block;
    x.records = (p.numel + l.block - 1) / l.block;
    x.first_group = group;
    const size_t groups = nested_groups(x.records);
    SHARD_CHECK(group + groups <= scales.size(), "a nested table of %zu groups", scales.size());
    float* own = scales.data() + group;
    group += groups;
    if (const std::vector<float>* t = given ? &(*given)[weights.size() - 1] : nullptr; t && !t->empty()) {
      SHARD_CHECK(t->size() == 1 + groups, "%s: a nested table of %zu values for %zu groups", p.name.c_str(),
                  t->size(), groups);
      x.offset = (*t)[0];
      std::copy(t->begin() + 1, t->end(), own);
    } else {
      x.offset = nested_scales_of(all.data() + x.first_record, x.records, own);
    }
  }
  SHARD_CHECK(weights.size() == l.nested_weights, "a nested table of %zu weights", weights.size());
  write_nested_table(table, weights, scales);
}

void FsdpEngine::fill_base_shards(const std::function<void(const ParamInfo&, float*, const FlatRange&)>& read,
                                  const std::vector<std::vector<std::vector<float>>>* nested_given) {
  filling_ = true;
  std::exception_ptr failed;
  for (size_t u = 0; u < shards_.size(); u++) {
    HostShard values = host_shard(static_cast<int>(u));
    if (!failed) try {
      for (int id : table_.units()[u].params) {
        const ParamInfo& p = table_.params()[id];
        const UnitLayout::Local local = shards_[u].layout.local_part(p.range());
        if (!local.range.empty() && !p.adapter) read(p, values.data() + local.index, local.range);
      }
    } catch (...) {
      failed = std::current_exception();
    }
    values.upload(true, nested_given ? &(*nested_given)[u] : nullptr);
  }
  if (failed) std::rethrow_exception(failed);
}

void FsdpEngine::load_base(const std::function<void()>& loader) {
  filling_ = false;
  try {
    loader();
  } catch (...) {
    if (!filling_ && table_.quant().nested) fill_base_shards([](const ParamInfo&, float*, const FlatRange&) {});
    throw;
  }
}

FsdpEngine::~FsdpEngine() {
  for (const ParamSlot& slot : slots_)
    if (slot.half) backend_.ops->unbind_half_copy(slot.values.data());
  for (int c = 0; c < MEM_CATEGORY_COUNT; c++) memory_.sub(static_cast<MemCategory>(c), engine_bytes_[c]);
}

size_t FsdpEngine::local_param_count() const {
  size_t n = 0;
  for (const UnitShard& s : shards_) n += s.layout.shard_numel();
  return n;
}

static double init_value(const ParamInfo& p, size_t index, uint64_t key, int n_layer) {
  switch (p.init) {
    case INIT_NORMAL: return 0.02 * counter_normal(key, index);
    case INIT_NORMAL_RESIDUAL: return 0.02 / std::sqrt(2.0 * n_layer) * counter_normal(key, index);
    case INIT_ONES: return 1.0;
    case INIT_ZEROS: return 0.0;
    case INIT_KAIMING_UNIFORM: return (2.0 * counter_uniform(key, index) - 1.0) / std::sqrt(p.shape[1]);
    case INIT_WEIGHT_NORMS: return 1.0;  // until init_dora_magnitudes sees the base
  }
  return 0.0;
}

void FsdpEngine::init_parameters(uint64_t seed) {
  const int n_layer = table_.config().n_layer;
  for (size_t u = 0; u < shards_.size(); u++) {
    HostShard values = host_shard(static_cast<int>(u));
    std::fill(values.data(), values.data() + values.size(), 0.0f);  // padding stays zero
    for (int id : table_.units()[u].params) {
      const ParamInfo& p = table_.params()[id];
      const UnitLayout::Local part = shards_[u].layout.local_part(p.range());
      const uint64_t key = mix64(seed ^ mix64(static_cast<uint64_t>(p.id) + 1));
      float* out = values.data() + part.index - part.range.begin;
#pragma omp parallel for schedule(static)
      for (size_t e = part.range.begin; e < part.range.end; e++)
        out[e] = static_cast<float>(init_value(p, e - p.offset, key, n_layer));
    }
    values.upload();
  }
}

void FsdpEngine::zero_grads() {
  if (!options_.cpu_offload)  // offloaded: finish_step overwrites them from the device
    for (UnitShard& s : shards_) s.grads.zero();
  for (auto& grads : device_grads_) grads.zero();
  if (!options_.reduce_every_microbatch)
    for (auto& buffer : grad_buffers_) buffer.zero();
}

DeviceArray<float>& FsdpEngine::grad_shard(int unit) {
  return options_.cpu_offload ? device_grads_[unit] : shards_[unit].grads;
}

DeviceArray<float>& FsdpEngine::grad_buffer(int unit) {
  if (!options_.reduce_every_microbatch) return grad_buffers_[unit];
  if (unit == ROOT_UNIT) return grad_buffers_[0];
  return grad_buffers_[options_.overlap_reduce_scatter ? 1 + unit % 2 : 1];  // neighbours alternate
}

// Each space is gathered on its own: the trainable one into the slot's first
// trainable.padded_numel elements, the frozen one after it.
void FsdpEngine::start_gather(ParamSlot& slot, int unit, bool async) {
  UnitShard& s = shards_[unit];
  slot.unit = unit;
  const bool half = options_.param_dtype != DTYPE_FP32;
  // The shard's kept 16-bit copy (keep_half_shard): rounded here only if the masters changed since.
  const bool kept = s.half.size() > 0;
  if (half) {
    // A shard that is the whole unit as gathered: its kept copy is the gathered copy.
    uint16_t* copy = kept && s.layout.shard_is_gathered_layout() ? s.half.data() : slot.wire.data();
    SHARD_CHECK(copy, "unit %d has no gathered 16-bit buffer", unit);
    if (copy != slot.half) {
      slot.half = copy;
      backend_.ops->bind_half_copy(slot.values.data(), copy, copy == s.half.data() ? s.half.size() : slot.wire.size(),
                                   options_.param_dtype);
    }
  }
  const SpaceLayout* spaces[2] = {&s.layout.trainable, &s.layout.frozen};
  size_t at = 0;  // the space's first element in the slot
  for (int k = 0; k < 2; k++) {
    const SpaceLayout& sp = *spaces[k];
    const size_t slot_begin = at;
    at += sp.padded_numel;
    if (sp.numel == 0) continue;
    float* own_values = slot.values.data() + slot_begin + sp.begin;
    const float* master = s.params.data() + sp.local;
    const bool fresh = kept && s.half_current[k];
    if (!half || (options_.cpu_offload && !fresh)) {  // up to the device first, into the part of the slot the gather overwrites
      SHARD_CHECK((slot_begin + sp.begin + sp.shard_numel) * sizeof(float) <= slot.values.bytes(),
                  "unit %d's shard staged past its gathered buffer's memory", unit);
      copy_from_master(own_values, master, sp.shard_numel * sizeof(float));
      master = own_values;
    }
    const char* what = async ? "all_gather(params, prefetched)" : "all_gather(params)";
    if (!half) {
      Span<const float> own(own_values, sp.shard_numel);
      Span<float> full(slot.values.data() + slot_begin, sp.padded_numel);
      if (async)
        slot.handles[k] = shard_comm_.start_all_gather(own, full, what);
      else
        shard_comm_.all_gather(own, full, what);
      continue;
    }
    uint16_t* wire = slot.wire.data() + slot_begin;
    if (kept) {
      uint16_t* own_half = s.half.data() + sp.local;
      if (!fresh) backend_.shard_ops->to_half(own_half, master, sp.shard_numel, options_.param_dtype);
      s.half_current[k] = true;
      if (slot.half == s.half.data()) {  // the gathered copy itself
        SHARD_CHECK(sp.local == slot_begin + sp.begin, "unit %d's kept copy is not laid out as gathered", unit);
        continue;
      }
      backend_.device->copy_on_device(wire + sp.begin, own_half, sp.shard_numel * sizeof(uint16_t));
    } else {
      backend_.shard_ops->to_half(wire + sp.begin, master, sp.shard_numel, options_.param_dtype);
    }
    Span<const uint16_t> own(wire + sp.begin, sp.shard_numel);
    Span<uint16_t> full(wire, sp.padded_numel);
    if (async)
      slot.handles[k] = shard_comm_.start_all_gather(own, full, what);
    else
      shard_comm_.all_gather(own, full, what);
  }
  const UnitLayout& l = s.layout;
  if (l.quantized.numel > 0) {  // the records themselves travel
    uint8_t* own = slot.records.data() + l.quantized.begin / l.block * l.record_bytes();
    const size_t mine = l.shard_records() * l.record_bytes();
    copy_from_master(own, s.packed.data(), mine);
    if (l.nested)  // the replicated table beside the records, not gathered
      copy_from_master(slot.records.data() + l.table_offset(l.all_records()),
                       s.packed.data() + l.table_offset(l.shard_records()), l.table_bytes());
    Span<const uint8_t> shard(own, mine);
    Span<uint8_t> full(slot.records.data(), l.all_records() * l.record_bytes());
    const char* what = async ? "all_gather(quantized params, prefetched)" : "all_gather(quantized params)";
    if (async)
      slot.handles[2] = shard_comm_.start_all_gather(shard, full, what);
    else
      shard_comm_.all_gather(shard, full, what);
  }
  // Nothing started (the kept copy is the gathered one): nothing for a prefetch to wait for, and
  // gather_params finishes only pending slots.
  if (!async || !slot.pending()) finish_gather(slot);
}

void FsdpEngine::finish_gather(ParamSlot& slot) {
  for (int& handle : slot.handles)
    if (handle >= 0) shard_comm_.wait(handle), handle = -1;
  const UnitLayout& l = shards_[slot.unit].layout;
  const bool half = options_.param_dtype != DTYPE_FP32;
  const bool half_only = half && options_.linear_weights_in_half_only;
  if (half_only) {
    for (const FlatRange& r : widened_[slot.unit])
      backend_.shard_ops->from_half(slot.values.data() + r.begin, slot.half + r.begin, r.size(),
                                    options_.param_dtype);
  } else if (half) {
    backend_.shard_ops->from_half(slot.values.data(), slot.half, l.padded_numel(), options_.param_dtype);
  }
  if (l.quantized.numel == 0) return;
  // After the frozen space's gather, whose trailing padding this overwrites; in the 16-bit copy
  // alone where the fp32 buffer has no memory there.
  const size_t at = l.quantized_slot_begin();
  backend_.shard_ops->dequantize_blocks(half_only ? nullptr : slot.values.data() + at,
                                        half ? slot.half + at : nullptr, options_.param_dtype,
                                        slot.records.data(), l.all_records(), l.quant, l.block,
                                        l.nested_view(slot.records.data(), l.all_records(), 0));
}

const float* FsdpEngine::gather_params(int unit, bool for_backward) {
  if (slots_.empty()) return shards_[unit].params.data();  // fp32 on a shard group of one: no padding
  const size_t lead = shards_[unit].layout.lead();
  if (options_.strategy == SHARDING_SHARD_GRAD_OP || unit == ROOT_UNIT) {
    ParamSlot& slot = slots_[options_.strategy == SHARDING_SHARD_GRAD_OP ? unit : 0];
    // These stay gathered from their forward through their backward.
    if (!for_backward || slot.unit != unit) start_gather(slot, unit, false);
    return slot.values.data() + lead;
  }
  for (size_t i = 1; i < slots_.size(); i++) {
    if (slots_[i].unit != unit) continue;  // a block still held (the last one of the forward) or prefetched
    if (slots_[i].pending()) finish_gather(slots_[i]);
    current_slot_ = static_cast<int>(i);
    return slots_[i].values.data() + lead;
  }
  // The previous block is done: any slot without a pending prefetch will do, the current one too.
  int pick = -1;
  for (size_t i = 1; i < slots_.size(); i++)
    if (!slots_[i].pending() && (pick < 0 || static_cast<int>(i) != current_slot_)) pick = static_cast<int>(i);
  SHARD_CHECK(pick > 0, "no free block buffer for unit %d", unit);
  start_gather(slots_[pick], unit, false);
  current_slot_ = pick;
  return slots_[pick].values.data() + lead;
}

void FsdpEngine::prefetch_params(int unit) {
  if (slots_.empty() || options_.strategy == SHARDING_SHARD_GRAD_OP || unit <= ROOT_UNIT ||
      unit >= static_cast<int>(shards_.size()))
    return;
  for (size_t i = 1; i < slots_.size(); i++)
    if (slots_[i].unit == unit) return;
  for (size_t i = 1; i < slots_.size(); i++) {
    if (static_cast<int>(i) == current_slot_ || slots_[i].pending()) continue;
    start_gather(slots_[i], unit, true);
    return;
  }
}

// Where the model accumulates a unit's gradient: the unit's coordinates (its trainable
// parameters, [0, trainable numel)); null when the whole unit is frozen.
float* FsdpEngine::gradient_target(int unit) {
  const SpaceLayout& trainable = shards_[unit].layout.trainable;
  if (trainable.numel == 0) return nullptr;
  if (shard_comm_.size() == 1) return grad_shard(unit).data();
  DeviceArray<float>& buffer = grad_buffer(unit);
  join_reduction(&buffer - grad_buffers_.data());  // its last reduction must have read it
  if (options_.reduce_every_microbatch) backend_.device->zero(buffer.data(), trainable.padded_numel * sizeof(float));
  return buffer.data() + trainable.lead;
}

void FsdpEngine::reduce_micro_batch_grads(int unit) {
  if (shard_comm_.size() == 1 || !options_.reduce_every_microbatch) return;
  const SpaceLayout& trainable = shards_[unit].layout.trainable;
  if (trainable.numel == 0) return;
  DeviceArray<float>& buffer = grad_buffer(unit);
  Span<const float> full(buffer.data(), trainable.padded_numel);
  Span<float> shard(grad_shard(unit).data(), trainable.shard_numel);
  if (options_.overlap_reduce_scatter)
    reduce_handles_[&buffer - grad_buffers_.data()] =
        shard_comm_.start_reduce_scatter_add(full, shard, options_.reduce_dtype, "reduce_scatter(grads, started)");
  else
    shard_comm_.reduce_scatter_add(full, shard, options_.reduce_dtype, "reduce_scatter(grads)");
}

void FsdpEngine::join_reduction(size_t buffer) {
  if (buffer >= reduce_handles_.size() || reduce_handles_[buffer] < 0) return;
  shard_comm_.wait(reduce_handles_[buffer]);
  reduce_handles_[buffer] = -1;
}

// Parameters change after every step: nothing gathered survives into the next micro-batch's
// first use except through a new gather. (Within a micro-batch, a slot is reused while it holds
// its unit: the forward's last block serves the first backward block without a second gather.)
void FsdpEngine::forget_gathered() {
  for (ParamSlot& slot : slots_) {
    SHARD_CHECK(!slot.pending(), "a prefetch is still pending at the end of a micro-batch");
    slot.unit = -1;
  }
  current_slot_ = -1;
}

void FsdpEngine::forward_blocks(TransformerModel<float>& model, int blocks) {
  const int L = blocks < 0 ? table_.block_count() : blocks;
  for (int l = 0; l < L; l++) {
    const float* block = gather_params(block_unit(l), false);
    if (options_.forward_prefetch && l + 1 < L) prefetch_params(block_unit(l + 1));
    model.block_forward(l, block);
  }
}

void FsdpEngine::train_micro_batch(TransformerModel<float>& model, const Batch& batch, float dloss,
                                   double* loss_total) {
  SHARD_CHECK(!options_.inference, "train_micro_batch on an inference engine (no gradients)");
  const int L = table_.block_count();
  model.loss().prepare(batch);
  forget_gathered();
  const float* root = gather_params(ROOT_UNIT, false);
  model.embed_forward(root, batch);
  forward_blocks(model);
  model.head_forward(root, batch, loss_total);
  if (phase_timer_) phase_timer_->end(PHASE_FORWARD);

  float* root_grad = gradient_target(ROOT_UNIT);
  model.head_backward(root_grad, root, dloss);
  // Frozen blocks below every trainable parameter need no backward (nor gathers for it).
  const int floor = table_.backward_floor();
  for (int l = L - 1; l >= floor; l--) {
    const float* block = gather_params(block_unit(l), true);
    if (options_.backward_prefetch == BACKWARD_PREFETCH_PRE && l > floor) prefetch_params(block_unit(l - 1));
    model.block_backward(l, gradient_target(block_unit(l)), block);
    if (options_.backward_prefetch == BACKWARD_PREFETCH_POST && l > floor) prefetch_params(block_unit(l - 1));
    reduce_micro_batch_grads(block_unit(l));
  }
  if (floor == 0) model.embed_backward(root_grad);
  reduce_micro_batch_grads(ROOT_UNIT);
  for (size_t b = 0; b < reduce_handles_.size(); b++) join_reduction(b);  // the shards are complete
  if (phase_timer_) phase_timer_->end(PHASE_BACKWARD);
}

void FsdpEngine::finish_step() {
  if (shard_comm_.size() > 1 && !options_.reduce_every_microbatch) {
    for (int u = static_cast<int>(shards_.size()) - 1; u >= 0; u--) {
      const SpaceLayout& trainable = shards_[u].layout.trainable;
      if (trainable.numel == 0) continue;
      shard_comm_.reduce_scatter_add(Span<const float>(grad_buffers_[u].data(), trainable.padded_numel),
                                     Span<float>(grad_shard(u).data(), trainable.shard_numel), options_.reduce_dtype,
                                     "reduce_scatter(grads)");
    }
  }
  // The replica all-reduce is linear, so once per step equals once per micro-batch.
  if (replica_comm_.size() > 1)
    for (size_t u = 0; u < shards_.size(); u++)
      if (shards_[u].layout.trainable.numel > 0)
        replica_comm_.all_reduce_sum(Span<float>(grad_shard(u).data(), shards_[u].layout.trainable.shard_numel),
                                     "all_reduce(grads)");
  if (options_.cpu_offload) {  // down to the host, where the optimizer steps: queued, then one wait
    for (size_t u = 0; u < shards_.size(); u++)
      backend_.device->start_copy_to_host(shards_[u].grads.data(), device_grads_[u].data(), shards_[u].grads.bytes());
    backend_.device->synchronize();
  }
}

void FsdpEngine::eval_micro_batch(TransformerModel<float>& model, const Batch& batch, double* loss_total) {
  model.loss().prepare(batch);
  forget_gathered();
  const float* root = gather_params(ROOT_UNIT, false);
  model.embed_forward(root, batch);
  forward_blocks(model);
  model.head_forward(root, batch, loss_total);
}

const float* FsdpEngine::forward_to_head(TransformerModel<float>& model, const Batch& batch, int blocks) {
  forget_gathered();
  const float* root = gather_params(ROOT_UNIT, false);
  model.embed_forward(root, batch);
  forward_blocks(model, blocks);
  return root;
}

const float* FsdpEngine::forward_hidden(TransformerModel<float>& model, const Batch& batch, int blocks) {
  SHARD_CHECK(model.hidden_states(), "forward_hidden of a model without hidden states");
  SHARD_CHECK(blocks >= 0 && blocks <= table_.block_count(), "%d of %d blocks", blocks, table_.block_count());
  return forward_to_head(model, batch, blocks);
}

const float* FsdpEngine::forward_logits(TransformerModel<float>& model, const Batch& batch) {
  TokenLogits<float>* head = model.token_logits();
  SHARD_CHECK(head, "forward_logits of a model without a vocabulary head");
  return head->head_logits(forward_to_head(model, batch));
}

const float* FsdpEngine::forward_prediction(TransformerModel<float>& model, const Batch& batch) {
  Predictor<float>* head = model.predictor();
  SHARD_CHECK(head, "forward_prediction of a model without a regression head");
  return head->predict(forward_to_head(model, batch));
}

void FsdpEngine::decode_step(TransformerModel<float>& model, const int* tokens, int n, float* logits, bool first) {
  KvDecoder<float>* decoder = model.kv_decoder();
  SHARD_CHECK(decoder, "decode_step of a model without key/value-cache decoding");
  const int L = table_.block_count();
  if (first) forget_gathered();
  // Not the first step: the root's slot still holds it (gather_params gathers again only if not).
  const float* root = gather_params(ROOT_UNIT, !first);
  decoder->decode_embed(root, tokens, n);
  for (int l = 0; l < L; l++) {
    const float* block = gather_params(block_unit(l), false);
    if (options_.forward_prefetch && l + 1 < L) prefetch_params(block_unit(l + 1));
    decoder->decode_block(l, block);
  }
  if (logits) decoder->decode_head(root, logits);
}

void FsdpEngine::copy_from_master(void* dst, const void* src, size_t bytes) {
  if (options_.cpu_offload)  // the master shards are host memory
    backend_.device->copy_to_device(dst, src, bytes);
  else
    backend_.device->copy_on_device(dst, src, bytes);
}

std::vector<float> FsdpEngine::gather_unit(int unit, bool gradients) {
  UnitShard& s = shards_[unit];
  Device& dev = *backend_.device;
  std::vector<float> values(s.layout.numel, 0.0f);  // frozen parameters: zero gradients
  std::vector<float> own;                            // this rank's shard on the host
  if (gradients) {
    own.resize(s.grads.size());
    if (!own.empty()) s.grads.device()->copy_to_host(own.data(), s.grads.data(), s.grads.bytes());
  } else {
    HostShard view = host_shard(unit);
    own.assign(view.data(), view.data() + view.size());
  }
  for (const SpaceLayout* sp : {&s.layout.trainable, &s.layout.frozen, &s.layout.quantized}) {
    if (sp->numel == 0 || (gradients && sp != &s.layout.trainable)) continue;
    DeviceArray<float> full(dev, sp->padded_numel);  // the communicators work on device memory
    dev.copy_to_device(full.data() + sp->begin, own.data() + sp->local, sp->shard_numel * sizeof(float));
    if (shard_comm_.size() > 1)
      shard_comm_.all_gather(Span<const float>(full.data() + sp->begin, sp->shard_numel),
                             Span<float>(full.data(), full.size()), "all_gather(unit)");
    dev.copy_to_host(values.data() + sp->base, full.data() + sp->lead, sp->numel * sizeof(float));
  }
  return values;
}

}  // namespace shardtrain
