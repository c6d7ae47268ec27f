// The FSDP engine: flat units, the sharding strategy, the gather -> compute -> free life cycle of
// each unit's parameters, and the reduction of gradients.
//
// Each unit of the ParamTable is one flat buffer. It is sharded over the shard group: padded to a
// multiple of the group size, rank g of the group keeps elements [g*S, (g+1)*S) as fp32 master
// parameters, gradients (and, in the optimizer, moments). A unit with frozen parameters is two
// flat spaces, sharded each on its own (SpaceLayout below): gradients, their reductions and the
// optimizer cover the trainable one alone. Replica groups hold identical shards
// and sum their gradients once per step. The strategies are the four of PyTorch FSDP:
//   FULL_SHARD     shard group = world. Root unit (embeddings, final norm, tied head) gathered
//                  once per micro-batch and kept until the end of backward; each block gathered
//                  before its forward into one of limit_all_gathers block buffers, released when
//                  the buffer is needed for another block, gathered again for its backward unless
//                  its buffer still holds it (the last blocks of the forward).
//   SHARD_GRAD_OP  shard group = world; every unit stays gathered from its forward through its
//                  backward (ZeRO-2: more memory, half the all-gathers).
//   NO_SHARD       shard group = the rank itself (DDP): replicated parameters and optimizer state,
//                  gradients all-reduced over the world once per step.
//   HYBRID_SHARD   FULL_SHARD inside groups of shard_group_size ranks, replicated across groups.
// Gradients of one micro-batch are reduce-scattered over the shard group into the gradient shard
// (reduce_every_microbatch), or accumulated unsharded and reduce-scattered once per step. With a
// shard group of one the shard is the whole unit: compute reads and accumulates into the shard
// buffers directly (unless parameters must be rounded to a 16-bit param_dtype first). All ranks
// issue the same collectives in the same order.
// A quantized frozen base (fsdp.frozen_dtype, backend/quant.hpp): a unit's quantized frozen weights
// are a third space, sharded on block boundaries and held as the format's records alone -- no fp32
// copy -- gathered as those bytes and dequantized by every rank into the gathered unit.
// CPU offload: the fp32 master shards, their gradients and (in the optimizer) the moments live in
// the backend's host memory and the optimizer steps there; the device keeps only the gathered
// units and a device gradient shard per unit, which the reductions fill and finish_step copies
// to the host. Each gather copies the master shard up first.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "backend/device.hpp"
#include "backend/dtype.hpp"
#include "backend/layer_ops.hpp"
#include "backend/phase_timer.hpp"
#include "comm/comm.hpp"
#include "model/model.hpp"
#include "model/param_table.hpp"
#include "shard/memory.hpp"

namespace shardtrain {

enum ShardingStrategy { SHARDING_FULL_SHARD, SHARDING_SHARD_GRAD_OP, SHARDING_NO_SHARD, SHARDING_HYBRID_SHARD };

// Returns false for an unknown name.
bool parse_sharding_strategy(const std::string& name, ShardingStrategy* out);
const char* sharding_strategy_name(ShardingStrategy s);

enum BackwardPrefetch { BACKWARD_PREFETCH_NONE, BACKWARD_PREFETCH_PRE, BACKWARD_PREFETCH_POST };
bool parse_backward_prefetch(const std::string& name, BackwardPrefetch* out);
const char* backward_prefetch_name(BackwardPrefetch p);

// param_dtype: the type parameters are gathered in and computed from (widened to fp32 for every op
// but the GEMMs, which multiply the gathered 16-bit copy itself: LayerOps::bind_half_copy);
// reduce_dtype: the wire type of the gradient reduce-scatter. Masters and moments stay fp32.
// Prefetch (FULL_SHARD, HYBRID_SHARD): the next block's all-gather is started before the current
// block computes -- in forward when forward_prefetch, in backward before (PRE) or after (POST)
// the current block's gradient computation -- into one of limit_all_gathers block buffers; with
// one buffer there is nowhere to prefetch into.
struct EngineOptions {
  ShardingStrategy strategy = SHARDING_FULL_SHARD;
  bool reduce_every_microbatch = true;
  DType param_dtype = DTYPE_FP32;
  DType reduce_dtype = DTYPE_FP32;
  bool forward_prefetch = false;
  BackwardPrefetch backward_prefetch = BACKWARD_PREFETCH_PRE;
  int limit_all_gathers = 2;
  bool cpu_offload = false;
  // Each block's gradient reduce-scatter is started, not waited for, and the next block's backward
  // writes into a second block gradient buffer meanwhile (one block more memory); the reduction
  // is joined before its buffer is reused. Worth it where communication progresses on its own
  // (NCCL: the trainer sets it for train.device=cuda); MPI completes it at the start anyway.
  bool overlap_reduce_scatter = false;
  // The communicators are NCCL's (train.device=cuda): their reduce-scatter scratch differs from the
  // MPI ring's, and the plan counts what they allocate.
  bool nccl = false;
  // With a 16-bit param_dtype, where the GEMMs multiply the gathered 16-bit copy themselves
  // (LayerOps::multiplies_half_copies), the blocks' linear weights (ParamInfo::linear_weight) are
  // gathered into that copy alone: a quantized space is dequantized into it, its place in the fp32
  // gathered buffer addresses with no memory behind them (Device::allocate_backed_prefix), so no
  // fp32 copy of a frozen unit exists; the other linear weights are not widened to fp32. The
  // trainer sets it from the backend (gemms_multiply_half_copies): CUDA's 16-bit GEMMs and oneDNN's
  // bf16 kernels, not the CPU's emulated bf16, which multiplies fp32 values.
  bool linear_weights_in_half_only = false;
  // With a 16-bit param_dtype: each unit's shard is also kept in param_dtype on the compute device
  // (UnitShard::half), rounded from the master once after each change of it (an optimizer step, a
  // load) instead of at every gather -- with gradient accumulation a unit is gathered twice per
  // micro-batch. On a shard group of one, an unquantized unit's copy is the gathered copy itself:
  // nothing is rounded or copied per gather. Costs 2 bytes per held element (sharded_params).
  bool keep_half_shard = false;
  // Generation only (decode_step): no gradients -- the shards carry none, no gradient or reduction
  // buffers are made and the plan counts none; training with it is a bug.
  bool inference = false;
};

// One of a unit's two flat spaces -- its trainable parameters [0, T) and its frozen ones [T, numel)
// in unit coordinates (model/param_table.hpp) -- sharded on its own over the shard group: padded
// to a multiple of the group size, rank g keeps padded elements [g*S, (g+1)*S). Only the
// trainable space has gradients, reduce-scatters and optimizer state, so a frozen parameter costs
// its shard and its gathers alone. Gathered, the trainable space's padding comes first (`lead`)
// and the frozen space's last, so that the two spaces' all-gathers fill disjoint buffers while the
// unit's elements lie contiguous between them. "Owned" is the part of the shard this rank alone
// answers for among its replicas: it is counted in the gradient norm and written to checkpoints,
// so every element is counted and written exactly once.
struct SpaceLayout {
  size_t base = 0;          // unit coordinate of the space's first element
  size_t numel = 0;         // its elements, unpadded
  size_t lead = 0;          // padding before them (the trainable space of a unit with frozen parameters)
  size_t padded_numel = 0;  // lead + numel + padding after, a multiple of the shard group size
  size_t shard_numel = 0;   // padded_numel / shard group size
  size_t begin = 0;         // this rank's first padded element
  size_t owned_begin = 0, owned_count = 0;  // within the shard (shard indices)
  size_t local = 0;                         // where the shard starts in the rank's shard buffer of the unit
  // The unit coordinates of this rank's shard, and of the part it owns (padding left out).
  FlatRange shard_range() const { return to_unit({begin, begin + shard_numel}); }
  FlatRange owned_range() const { return to_unit({begin + owned_begin, begin + owned_begin + owned_count}); }
  // The index in the rank's shard buffer of unit coordinate x (inside shard_range()).
  size_t local_index(size_t x) const { return local + (x - base + lead - begin); }
  bool contains(size_t x) const { return x >= base && x < base + numel; }

 private:
  FlatRange to_unit(FlatRange padded) const {
    const FlatRange real = intersect(padded, {lead, lead + numel});
    return real.empty() ? FlatRange{base, base} : FlatRange{real.begin - lead + base, real.end - lead + base};
  }
};

// Where this rank's data sits in one unit: its spaces. The rank's shard buffer holds the
// trainable space's shard, then the frozen space's; its gradient buffer the trainable shard only;
// the quantized space's shard is records (UnitShard::packed). Indices into "the shard" (local_part,
// HostShard) run over all three, the quantized one in fp32 after the others.
struct UnitLayout {
  size_t numel = 0;  // the unit's coordinates (UnitInfo::extent), unpadded
  SpaceLayout trainable, frozen, quantized;
  QuantType quant = QUANT_NONE;
  size_t block = 0;  // the quantized space's block (elements)
  // Double quantization (QuantConfig::nested): the records' absmax are codes and the unit's nested
  // table (backend/quant.hpp), replicated, follows the records in UnitShard::packed and in a
  // gather slot's records, 16-byte aligned: its weights (the quantized parameters) and groups.
  bool nested = false;
  size_t nested_weights = 0, nested_groups = 0;
  // The gathered buffer: the trainable and frozen spaces gathered, then the quantized space
  // dequantized right after the frozen elements (over the frozen space's trailing padding).
  size_t quantized_slot_begin() const { return trainable.padded_numel + frozen.numel; }
  size_t padded_numel() const {
    return std::max(trainable.padded_numel + frozen.padded_numel, quantized_slot_begin() + quantized.padded_numel);
  }
  // The gathered buffer's elements with fp32 memory behind them: the trainable and frozen spaces
  // with their padding (cpu_offload stages a frozen shard there, padding and all) where the
  // quantized space lives in the 16-bit copy alone (EngineOptions::linear_weights_in_half_only), else all.
  size_t backed_numel(bool linear_weights_in_half_only) const {
    return linear_weights_in_half_only && quant != QUANT_NONE ? trainable.padded_numel + frozen.padded_numel
                                                              : padded_numel();
  }
  size_t shard_numel() const { return trainable.shard_numel + frozen.shard_numel + quantized.shard_numel; }
  // Whether the rank's shard is the whole unit laid out as gathered: on a shard group of one, no
  // quantized space (no padding between the spaces). A kept 16-bit copy of it is then the
  // gathered 16-bit copy (start_gather; plan_gather_slots plans no buffer for it).
  bool shard_is_gathered_layout() const { return quantized.numel == 0 && shard_numel() == padded_numel(); }
  // The fp32 elements the rank holds: all but the quantized space's.
  size_t held_numel() const { return trainable.shard_numel + frozen.shard_numel; }
  // The quantized space's records: this rank's, and the whole space's once gathered.
  size_t record_bytes() const { return quant == QUANT_NONE ? 0 : quant_record_bytes(quant, block, nested); }
  size_t shard_records() const { return quant == QUANT_NONE ? 0 : quantized.shard_numel / block; }
  size_t all_records() const { return quant == QUANT_NONE ? 0 : quantized.padded_numel / block; }
  size_t table_bytes() const { return nested ? nested_table_bytes(nested_weights, nested_groups) : 0; }
  // Where the nested table follows `records` records.
  size_t table_offset(size_t records) const { return nested ? (records * record_bytes() + 15) / 16 * 16 : 0; }
  size_t packed_bytes() const {
    return nested ? table_offset(shard_records()) + table_bytes() : shard_records() * record_bytes();
  }
  size_t gathered_record_bytes() const {
    return nested ? table_offset(all_records()) + table_bytes() : all_records() * record_bytes();
  }
  // The nested table (on the host or a device) after `records` records at `data`; the first
  // record's unit index `first_record`. Empty without double quantization.
  NestedScales nested_view(const uint8_t* data, size_t records, size_t first_record) const {
    return nested ? nested_scales(data + table_offset(records), nested_weights, first_record) : NestedScales{};
  }
  // The unit's first element in its gathered buffer.
  size_t lead() const { return trainable.lead; }
  // The space holding unit coordinate x.
  const SpaceLayout& space_of(size_t x) const {
    return trainable.contains(x) ? trainable : (quantized.contains(x) ? quantized : frozen);
  }
  // This rank's part of a unit range that lies in one space (a parameter): the unit coordinates
  // it holds (or owns) and the index of their first element in the rank's shard buffer.
  struct Local {
    FlatRange range;
    size_t index = 0;
  };
  Local local_part(const FlatRange& r, bool owned = false) const {
    const SpaceLayout& s = space_of(r.begin);
    const FlatRange part = intersect(owned ? s.owned_range() : s.shard_range(), r);
    return {part, part.empty() ? 0 : s.local_index(part.begin)};
  }
};

// Shard and replica group sizes and this rank's position in each.
struct GroupShape {
  int shard_size = 1, shard_rank = 0, replica_size = 1, replica_rank = 0;
};

// The fp32 master parameters of this rank's shard of one unit (trainable space, then frozen), the
// records of its quantized space, and the gradient of its trainable space, on `device`; with
// EngineOptions::keep_half_shard the masters rounded to param_dtype (`half`, laid out as `params`)
// on `half_device`, the compute device. Read and write the whole shard through HostShard: `params`
// lacks the quantized space. HostShard::upload marks both spaces' copies stale; whatever writes
// `params` otherwise must say so (FsdpEngine::params_changed: the trainable spaces).
struct UnitShard {
  UnitShard(const UnitLayout& layout, Device& device, bool with_grads = true, Device* half_device = nullptr)
      : layout(layout),
        params(device, layout.held_numel()),
        grads(device, with_grads ? layout.trainable.shard_numel : 0),
        packed(device, layout.packed_bytes()),
        half(half_device ? *half_device : device, half_device ? layout.held_numel() : 0) {}
  UnitLayout layout;
  DeviceArray<float> params, grads;
  DeviceArray<uint8_t> packed;
  DeviceArray<uint16_t> half;
  bool half_current[2] = {false, false};  // per space (trainable, frozen): `half` is `params` rounded
};

// This rank's whole shard of one unit in fp32 on the host, indexed as UnitLayout::local_part: the
// trainable and frozen spaces as held, the quantized space dequantized (the values the model
// computes with). upload() stores it back -- quantizing the quantized space shard-locally, block by
// block, under double quantization with the shard group's absmax gathered -- which is how every
// loader fills a shard. In place where the shard lives on the host and has no quantized space.
class HostShard {
 public:
  // with_quantized false: the quantized space is left zero, not dequantized (a caller that only
  // writes it, or reads none of it); upload() then quantizes only what the caller wrote there.
  // Under double quantization upload() gathers the absmax of the unit's weights over `comm` (the
  // shard group, on `device`'s memory) to find their offsets and group scales: it is then collective.
  HostShard(UnitShard& shard, const ParamTable& table, int unit, bool with_quantized, Comm& comm, Device& device);
  float* data() { return direct_ ? shard_.params.data() : copy_.data(); }
  size_t size() const { return shard_.layout.shard_numel(); }
  // with_quantized false: the caller changed nothing in the quantized space (an adapter's load),
  // which keeps its records as they are rather than quantizing their values again.
  // Under double quantization `nested_given` may hold, per quantized weight of the unit in
  // declaration order, its offset and group scales as a file stored them (empty: computed from the
  // values); the absmax are coded as the nearest under them, so values that came from such records
  // come back as the same values.
  void upload(bool with_quantized = true, const std::vector<std::vector<float>>* nested_given = nullptr);

 private:
  // Fills the nested table: the given weights' offsets and scales, the others' from every rank's
  // absmax of the unit's records (`absmax`, this rank's), gathered when any is not given.
  void fill_nested_table(const std::vector<float>& absmax, const std::vector<std::vector<float>>* given,
                         uint8_t* table);

  UnitShard& shard_;
  const ParamTable& table_;
  int unit_;
  Comm& comm_;
  Device& device_;
  bool direct_;
  std::vector<float> copy_;
};

class FsdpEngine {
 public:
  // The communicators work on the backend's device memory (MPI: host, NCCL: GPU).
  FsdpEngine(const ParamTable& table, Comm& shard_comm, Comm& replica_comm, MemoryTracker& memory,
             const EngineOptions& options, const Backend& backend);
  ~FsdpEngine();

  // The layout of every unit for a group shape; every device buffer the engine and its
  // communicators' reductions hold on that rank, one entry per allocation in the constructor's
  // order (master shards and their gradients per unit, the gather slots, the gradient buffers,
  // the reduction's buffers); and those bytes per category: computed without allocating, the one
  // source for the engine, the tracker and the planner.
  static std::vector<UnitLayout> plan_layout(const ParamTable& table, const GroupShape& groups);
  static std::vector<PlannedAllocation> plan_allocations(const std::vector<UnitLayout>& layout,
                                                         const EngineOptions& options);
  // The gather slots (ParamSlot): every unit's (SHARD_GRAD_OP) or the root's and limit_all_gathers
  // blocks'; none where the model reads the shards themselves (fp32 on a shard group of one).
  struct GatherSlot {
    size_t numel = 0;         // the gathered buffer's elements (the largest unit it takes)
    size_t backed = 0;        // of them with fp32 memory behind (UnitLayout::backed_numel)
    size_t record_bytes = 0;  // the gathered quantized records
    // Elements of the slot's own 16-bit buffer (ParamSlot::wire): a 16-bit param_dtype's gathered
    // copy, but none where every unit it takes is gathered as its kept copy (a shard group of one
    // with keep_half_shard, no quantized space).
    size_t wire = 0;
  };
  static std::vector<GatherSlot> plan_gather_slots(const std::vector<UnitLayout>& layout, const EngineOptions& options);
  // Whether the shards keep a 16-bit copy (EngineOptions::keep_half_shard with a 16-bit param_dtype).
  static bool keeps_half_shard(const EngineOptions& options);
  static std::array<size_t, MEM_CATEGORY_COUNT> plan_memory(const std::vector<UnitLayout>& layout,
                                                            const EngineOptions& options);

  const ParamTable& table() const { return table_; }
  const EngineOptions& options() const { return options_; }
  int shard_group_size() const { return shard_comm_.size(); }
  const Backend& backend() const { return backend_; }
  // Where the master shards live and the operations the optimizer runs on them: the backend's
  // host memory with cpu_offload, else the compute device.
  Device& master_device() const { return options_.cpu_offload ? *backend_.host : *backend_.device; }
  // Where the model computes (its activations, a forward's output).
  Device& compute_device() const { return *backend_.device; }
  const LayerOps<float>& master_ops() const { return options_.cpu_offload ? *backend_.host_ops : *backend_.ops; }
  const ShardOps& master_shard_ops() const {
    return options_.cpu_offload ? *backend_.host_shard_ops : *backend_.shard_ops;
  }
  std::vector<UnitShard>& shards() { return shards_; }
  // The trainable master shards were written other than through HostShard (the optimizer's step):
  // their 16-bit copies (keep_half_shard) are rounded again at the next gather. The frozen spaces'
  // copies stay: a frozen base is rounded once.
  void params_changed() {
    for (UnitShard& s : shards_) s.half_current[0] = false;
  }
  // Fills the base model's parameters from a file: read(param, slice, part) writes the elements
  // `part` (unit coordinates) of `param` that this rank holds into `slice`; adapters, padding and
  // what read leaves keep their values. Every rank uploads every unit (collective under double
  // quantization), so a rank whose read throws goes on uploading and rethrows its first error at
  // the end. nested_given: per unit, HostShard::upload's.
  void fill_base_shards(const std::function<void(const ParamInfo&, float*, const FlatRange&)>& read,
                        const std::vector<std::vector<std::vector<float>>>* nested_given = nullptr);
  // Runs a loader that ends in fill_base_shards. Where it throws before reaching it (a header this
  // rank alone failed to read), the rank still takes part in the uploads, reading nothing, and
  // then rethrows: the other ranks are not left waiting in a collective upload.
  void load_base(const std::function<void()>& loader);
  // Unit u's whole shard on the host (see HostShard).
  HostShard host_shard(int unit, bool with_quantized = true) {
    return HostShard(shards_[unit], table_, unit, with_quantized, shard_comm_, *backend_.device);
  }
  const std::vector<UnitShard>& shards() const { return shards_; }
  size_t local_param_count() const;  // elements of this rank's shards, padding included

  // Each rank initializes only its own shard; element values depend on (seed, parameter, index)
  // alone, so the model is the same for any rank count and strategy.
  void init_parameters(uint64_t seed);
  void zero_grads();

  // Forward and backward of one micro-batch (host memory) under the model's loss (prepared first:
  // Loss::prepare); gradients are accumulated toward the shards. Adds the summed loss of this
  // rank's micro-batch to *loss_total (a double in the device's memory); the host waits for nothing.
  void train_micro_batch(TransformerModel<float>& model, const Batch& batch, float dloss, double* loss_total);
  // Completes the step's gradient reduction (deferred reduce-scatters, replica all-reduce). With
  // cpu_offload it also brings the gradient shards to the host: the step's one host wait, after
  // which whatever the caller queued with start_copy_to_host before the call is there too.
  void finish_step();
  // Where train_micro_batch marks the ends of its forward and backward (null: nowhere).
  void set_phase_timer(PhaseTimer* timer) { phase_timer_ = timer; }
  // Forward only (evaluation): adds the summed loss of this rank's micro-batch to *loss_total (device memory).
  void eval_micro_batch(TransformerModel<float>& model, const Batch& batch, double* loss_total);
  // Forward only, to the logits (a distillation teacher's): the model's TokenLogits::head_logits,
  // B*T x V, in the device's memory until the model's next forward.
  const float* forward_logits(TransformerModel<float>& model, const Batch& batch);
  // Forward only, to the model's prediction (Predictor::predict: a diffusion transformer's velocity),
  // in the device's memory until the model's next forward.
  const float* forward_prediction(TransformerModel<float>& model, const Batch& batch);
  // Forward only, through the embedding and the first `blocks` blocks (a text encoder's): the
  // gathered root, with which the model's HiddenStates gives hidden states 0..blocks (n_layer: the
  // final norm's output) until its next forward.
  const float* forward_hidden(TransformerModel<float>& model, const Batch& batch, int blocks);

  // Generation: one step of the model's decode path (model/model.hpp: KvDecoder) over n tokens (host memory),
  // the units gathered as in a forward -- each block into a block buffer before its decode_block,
  // the next one prefetched with forward_prefetch -- except that the root stays gathered from the
  // generation's first step (`first`) to its last. logits: host memory for the V logits of the
  // step's last token, or null to skip the head (a rank that does not sample). Collective over the
  // shard group; the parameters must not change between the steps of one generation.
  void decode_step(TransformerModel<float>& model, const int* tokens, int n, float* logits, bool first);

  // The full (unpadded) values of one unit, gathered on every rank: for tests.
  std::vector<float> gather_unit(int unit, bool gradients);

 private:
  // The forward through the blocks of a micro-batch (the first `blocks`; -1: all), the gathered root
  // returned for a head.
  const float* forward_to_head(TransformerModel<float>& model, const Batch& batch, int blocks = -1);
  // A buffer for one unsharded unit's parameters, filled by blocking or started all-gathers (one
  // per space: trainable, frozen).
  struct ParamSlot {
    DeviceArray<float> values;
    // The gathered unit in a 16-bit param_dtype, `values` its widening: `half` is bound to the ops
    // as that copy (LayerOps::bind_half_copy), so the GEMMs multiply it. `half` is `wire`, or on a
    // shard group of one, for a unit without a quantized space, that unit's own UnitShard::half.
    DeviceArray<uint16_t> wire;
    uint16_t* half = nullptr;
    DeviceArray<uint8_t> records;  // the gathered quantized space, before dequantization
    int unit = -1;                 // the unit held (valid for the current micro-batch), or -1
    int handles[3] = {-1, -1, -1};  // started all-gathers (trainable, frozen, quantized) not yet waited for
    bool pending() const { return handles[0] >= 0 || handles[1] >= 0 || handles[2] >= 0; }
  };
  const float* gather_params(int unit, bool for_backward);
  void prefetch_params(int unit);
  void forget_gathered();
  void forward_blocks(TransformerModel<float>& model, int blocks = -1);
  void start_gather(ParamSlot& slot, int unit, bool async);
  void finish_gather(ParamSlot& slot);
  float* gradient_target(int unit);
  void reduce_micro_batch_grads(int unit);
  DeviceArray<float>& grad_buffer(int unit);
  DeviceArray<float>& grad_shard(int unit);  // the reduction's target on the device
  // Into device memory from a master shard's (or its gradient's) memory: master_device()'s.
  void copy_from_master(void* dst, const void* src, size_t bytes);

  const ParamTable& table_;
  Comm& shard_comm_;
  Comm& replica_comm_;
  MemoryTracker& memory_;
  EngineOptions options_;
  Backend backend_;
  std::vector<UnitShard> shards_;
  std::array<size_t, MEM_CATEGORY_COUNT> engine_bytes_{};
  // Unsharded working buffers (none with a shard group of one in fp32). Parameters: SHARD_GRAD_OP
  // one slot per unit; FULL_SHARD/HYBRID slot 0 for the root and limit_all_gathers block slots.
  // Gradients: root and one block per micro-batch, or one per unit when they accumulate
  // unsharded over the step.
  std::vector<ParamSlot> slots_;
  // Per unit, where linear_weights_in_half_only: the gathered elements read in fp32 (all but the
  // linear weights), which are all a gather widens from the 16-bit copy.
  std::vector<std::vector<FlatRange>> widened_;
  int current_slot_ = -1;  // the block slot in use by the computation
  bool filling_ = false;   // fill_base_shards has started (load_base)
  std::vector<DeviceArray<float>> grad_buffers_;
  std::vector<DeviceArray<float>> device_grads_;  // cpu_offload: each unit's gradient shard on the device
  std::vector<int> reduce_handles_;  // per gradient buffer: its started reduce-scatter, or -1
  PhaseTimer* phase_timer_ = nullptr;
  void join_reduction(size_t buffer);
};

}  // namespace shardtrain
