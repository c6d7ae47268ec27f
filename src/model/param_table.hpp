// The one parameter table: name, shape, unit, offset in the unit's flat buffer, init rule and
// weight-decay flag of every parameter. It drives allocation, initialization, sharding, the
// optimizer's decay masks and checkpoint dataset names; nothing is indexed by a bare integer
// elsewhere.
//
// Units are the FSDP granularity: unit 0 is "root" (embeddings, final norm, an untied LM head),
// units 1..L are the blocks. The model family (model/family.hpp) declares them and their
// parameters: GPT-2 root wte, wpe, ln_f and blocks "h.0".."h.{L-1}" with llm.c's names; Llama and
// Qwen2 root embed_tokens, norm (and lm_head when untied) and blocks "layers.0".. with Hugging
// Face's names less the "model." prefix, so each maps one to one onto a Hugging Face tensor
// (model/families/). A tied LM head has no entry of its own: the root unit stays gathered from the start of
// forward to the end of backward, so both uses of the embedding add into one gradient that is
// reduce-scattered once. A family's fused groups (Llama's q|k|v and gate|up) are adjacent in the
// unit, so the model multiplies each group as one matrix.
//
// Frozen parameters (train.freeze): each unit's flat buffer is laid out trainable parameters
// first, then frozen ones, then (fsdp.frozen_dtype) the quantized frozen linear weights, each group in declaration order, so the trainable ones form one
// contiguous range [0, trainable_numel) -- the only part with gradients, reduce-scatters and
// optimizer state (shard/fsdp_engine.hpp). `offset` is that layout's (what the model and the
// engine use); `file_offset` is the declaration order's, the same whatever is frozen, which
// checkpoints use, so a checkpoint loads whatever either run froze.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

#include "backend/quant.hpp"
#include "model/adapter.hpp"
#include "model/config.hpp"
#include "model/family.hpp"

namespace shardtrain {

// Elements [begin, end) of one unit's flat buffer: a parameter, a rank's shard, a dataset.
struct FlatRange {
  size_t begin = 0, end = 0;
  size_t size() const { return end > begin ? end - begin : 0; }
  bool empty() const { return end <= begin; }
};

// The elements in both ranges; empty (size 0) where they do not meet.
inline FlatRange intersect(const FlatRange& a, const FlatRange& b) {
  const size_t begin = std::max(a.begin, b.begin);
  return {begin, std::max(begin, std::min(a.end, b.end))};
}

enum InitRule {
  INIT_NORMAL,           // N(0, 0.02)
  INIT_NORMAL_RESIDUAL,  // N(0, 0.02 / sqrt(2 L)): the two projections into the residual stream
  INIT_ZEROS,
  INIT_ONES,
  INIT_KAIMING_UNIFORM,  // U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = shape[1]: PEFT's LoRA A
  INIT_WEIGHT_NORMS,     // DoRA's magnitude: the row norms of the base weight it adapts, set once
                         // the base is in place (init_dora_magnitudes); ones until then
};

struct ParamInfo {
  std::string name;
  std::vector<int> shape;
  size_t numel = 0;
  int unit = 0;
  size_t offset = 0;       // in the unit's flat buffer: trainable parameters first
  size_t file_offset = 0;  // in declaration order (checkpoints' unit coordinates)
  bool frozen = false;
  bool quantized = false;  // a frozen linear weight held in the run's quantized format (fsdp.frozen_dtype)
  // A block linear layer's weight: read only as a GEMM operand (LayerOps::copy_operand elsewhere),
  // so it may live in the gathered 16-bit copy alone (EngineOptions::linear_weights_in_half_only).
  bool linear_weight = false;
  bool adapter = false;  // an adapter's parameter (model/adapter.hpp), not the base model's
  InitRule init = INIT_ZEROS;
  bool weight_decay = false;
  int id = 0;  // position in the table; keys the init RNG
  FlatRange range() const { return {offset, offset + numel}; }
};

struct UnitInfo {
  std::string name;
  std::string kind;            // "root", or the family's kind of block ("block")
  size_t numel = 0;            // sum of its parameters, before padding
  size_t trainable_numel = 0;  // of its trainable parameters: elements [0, trainable_numel)
  std::vector<int> params;     // in declaration order
  // The quantized space after the trainable and frozen fp32 parameters: [plain_numel, plain_numel +
  // quantized_numel), each quantized weight starting on a block (the space's blocks never straddle
  // two weights) and the space a whole number of blocks. Zero without fsdp.frozen_dtype.
  size_t plain_numel = 0;
  size_t quantized_numel = 0;
  // Unit coordinates in use: numel, plus the quantized space's padding between weights.
  size_t extent() const { return plain_numel + quantized_numel; }
};

constexpr int ROOT_UNIT = 0;
inline int block_unit(int layer) { return 1 + layer; }

// Adapters (model/adapter.hpp): each adapted linear layer of block l adds, after the block's own
// parameters, "<its weight's name less .weight>." followed by PEFT's names: LoRA "lora_A.weight"
// (rank, in) and "lora_B.weight" (out, rank) -- e.g. h.3.attn.qkv.lora_A.weight,
// layers.3.self_attn.q_proj.lora_B.weight -- DoRA also "lora_magnitude_vector" (out); LoHa
// hada_w1_a (out, rank), hada_w1_b (rank, in), hada_w2_a, hada_w2_b; LoKr lokr_w1 (a, c) or
// lokr_w1_a (a, rank) and lokr_w1_b (rank, c), then lokr_w2 (b, d) or lokr_w2_a, lokr_w2_b
// (lokr_shape); OFT "oft_R.weight" (blocks, b (b - 1) / 2). Every parameter of the base model is
// frozen. Throws UsageError for a target that matches no layer, a rank the layers cannot take,
// or OFT blocks that do not tile a layer's inputs.
//
// Names matched by train.freeze: comma-separated shell glob patterns (fnmatch(3) without flags:
// `*` and `?` also match dots, `[0-5]` a character class), each matched against every parameter
// name. Throws UsageError when a pattern matches nothing, when the patterns split a group the
// model multiplies as one matrix (Llama's q|k|v or gate|up of a layer), or freeze everything.
//
// The items of a comma-separated value (train.freeze, adapter.targets): blanks around each
// trimmed, empty ones dropped.
std::vector<std::string> split_comma_list(const std::string& list);

class ParamTable {
 public:
  // quant: the format frozen linear weights are held in (backend/quant.hpp). Throws UsageError
  // when it quantizes nothing, or when a block size does not tile a weight the model multiplies
  // fused with the next one (Llama's q|k|v, gate|up).
  explicit ParamTable(const ModelConfig& config, const std::vector<std::string>& freeze = {},
                      const AdapterConfig& adapter = {}, const QuantConfig& quant = {});

  const ModelConfig& config() const { return config_; }
  const AdapterConfig& adapter() const { return adapter_; }
  const QuantConfig& quant() const { return quant_; }
  // The position in block `layer`'s unit (as param() takes it) of the adapter on block_sites(layer)[site]:
  // its first parameter, the others following in the order above. -1 where that layer has none.
  int adapter_param(int layer, int site) const { return adapter_params_.empty() ? -1 : adapter_params_[layer][site]; }
  // f(layer, site, its first adapter parameter's position) for every adapted layer, in block and
  // site order.
  template <typename F>
  void for_each_adapted_site(F f) const {
    for (int l = 0; l < block_count(); l++)
      for (size_t k = 0; k < block_sites(l).size(); k++)
        if (const int first = adapter_param(l, static_cast<int>(k)); first >= 0) f(l, block_sites(l)[k], first);
  }
  const std::vector<ParamInfo>& params() const { return params_; }
  const std::vector<UnitInfo>& units() const { return units_; }
  // The blocks: the units after the root in forward order, block b being unit block_unit(b), each
  // of a kind its family declared. The engine gathers and runs them one after the other.
  int block_count() const { return static_cast<int>(units_.size()) - 1; }
  // The adaptable linear layers of block b: its kind's (ModelFamily::linear_sites).
  const std::vector<LinearSite>& block_sites(int block) const { return sites_[block_kind_[block]]; }
  // Every kind's sites, each kind once: what sizes the adapters' scratch.
  std::vector<LinearSite> all_sites() const;
  size_t total_params() const;
  size_t trainable_params() const;
  bool any_frozen() const { return trainable_params() != total_params(); }
  // Parameter p of a unit (its position in the unit, the family's enums: Gpt2BlockParam,
  // LlamaRootParam, ...): its offset in the unit's flat buffer, and whether it is frozen.
  const ParamInfo& param(int unit, int p) const { return params_[units_[unit].params[p]]; }
  size_t offset(int unit, int p) const { return param(unit, p).offset; }
  bool frozen(int unit, int p) const { return param(unit, p).frozen; }
  // The lowest block whose backward is needed: below it no block has a trainable parameter and
  // neither do the embedding tables its input gradient would reach. 0 when the embeddings train.
  int backward_floor() const;
  // Model FLOPs per trained token (the family's formula).
  double flops_per_token(int seq_len) const;

  // For the family's add_params only: a new block unit of a kind (its index), and a parameter
  // appended to a unit; the order of the calls is the order of the units and of their parameters.
  int add_unit(const std::string& name, const std::string& kind = "block");
  void add_param(int unit, const std::string& name, std::vector<int> shape, InitRule init, bool decay);

 private:
  void add_adapters();
  // The adapter parameters of one layer (its weight's name less ".weight", its module path).
  void add_adapter(int unit, const std::string& base, const std::string& path, const LinearSite& site);
  void apply_freeze(const std::vector<std::string>& patterns);
  void mark_quantized();
  void assign_offsets();

  ModelConfig config_;
  AdapterConfig adapter_;
  QuantConfig quant_;
  std::vector<std::vector<int>> adapter_params_;  // [block][site]
  std::vector<std::vector<LinearSite>> sites_;   // per block kind, in order of first use
  std::vector<int> block_kind_;                  // [block]: its kind's index in sites_
  std::vector<ParamInfo> params_;
  std::vector<UnitInfo> units_;
};

// Parameter p (a position in the unit, as param() takes it) of a unit in its gathered buffer, and its
// gradient in the unit's gradient buffer: null for a frozen parameter (and for a unit without a
// gradient buffer, all frozen), so the layer skips that gradient and passes the input's on.
template <typename Real>
const Real* param_in(const ParamTable& table, const Real* unit_values, int unit, int p) {
  return unit_values + table.offset(unit, p);
}
template <typename Real>
Real* grad_in(const ParamTable& table, Real* unit_grads, int unit, int p) {
  return unit_grads && !table.frozen(unit, p) ? unit_grads + table.offset(unit, p) : nullptr;
}

}  // namespace shardtrain
