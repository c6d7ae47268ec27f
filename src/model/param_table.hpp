// The one parameter table: name, shape, unit, offset in the unit's flat buffer, init rule and
// weight-decay flag of every parameter. It drives allocation, initialization, sharding, the
// optimizer's decay masks and checkpoint dataset names; nothing is indexed by a bare integer
// elsewhere.
//
// Units are the FSDP granularity: unit 0 is "root" (embeddings, final norm, an untied LM head),
// units 1..L are the blocks. GPT-2: root wte, wpe, ln_f; blocks "h.0".."h.{L-1}" with llm.c's
// names. Llama: root embed_tokens, norm (and lm_head when untied); blocks "layers.0".. with
// Hugging Face's names less the "model." prefix, so each maps one to one onto a Hugging Face
// tensor. A tied LM head has no entry of its own: the root unit stays gathered from the start of
// forward to the end of backward, so both uses of the embedding add into one gradient that is
// reduce-scattered once. Llama's q|k|v and gate|up weights are adjacent in the unit, in that
// order, so the model multiplies each group as one fused matrix.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

#include "model/config.hpp"

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
};

struct ParamInfo {
  std::string name;
  std::vector<int> shape;
  size_t numel = 0;
  int unit = 0;
  size_t offset = 0;  // in the unit's flat buffer
  InitRule init = INIT_ZEROS;
  bool weight_decay = false;
  int id = 0;  // position in the table; keys the init RNG
  FlatRange range() const { return {offset, offset + numel}; }
};

struct UnitInfo {
  std::string name;
  size_t numel = 0;  // sum of its parameters, before padding
  std::vector<int> params;
};

// Positions of the parameters inside a block unit (the same for every block) and the root unit.
enum BlockParam {
  BLOCK_LN1_W, BLOCK_LN1_B, BLOCK_QKV_W, BLOCK_QKV_B, BLOCK_ATTPROJ_W, BLOCK_ATTPROJ_B,
  BLOCK_LN2_W, BLOCK_LN2_B, BLOCK_FC_W, BLOCK_FC_B, BLOCK_FCPROJ_W, BLOCK_FCPROJ_B, BLOCK_PARAM_COUNT,
};
enum RootParam { ROOT_WTE, ROOT_WPE, ROOT_LNF_W, ROOT_LNF_B, ROOT_PARAM_COUNT };
enum LlamaBlockParam {
  LLAMA_ATTN_NORM_W, LLAMA_Q_W, LLAMA_K_W, LLAMA_V_W, LLAMA_O_W,
  LLAMA_MLP_NORM_W, LLAMA_GATE_W, LLAMA_UP_W, LLAMA_DOWN_W, LLAMA_BLOCK_PARAM_COUNT,
};
enum LlamaRootParam { LLAMA_EMBED, LLAMA_NORM_W, LLAMA_LM_HEAD };  // LLAMA_LM_HEAD only when untied

constexpr int ROOT_UNIT = 0;
inline int block_unit(int layer) { return 1 + layer; }

// The architecture and shape in one line for logs: "GPT-2 L=12 C=768 H=12 V=50257 max_seq_len=1024"
// or "Llama L=30 C=576 H=9 KV=3 MLP=1536 V=49152 max_seq_len=2048 rope_theta=10000 tied".
std::string model_summary(const ModelConfig& config);

class ParamTable {
 public:
  explicit ParamTable(const ModelConfig& config);

  const ModelConfig& config() const { return config_; }
  const std::vector<ParamInfo>& params() const { return params_; }
  const std::vector<UnitInfo>& units() const { return units_; }
  size_t total_params() const;
  // Offset of a block parameter (BlockParam or LlamaBlockParam) inside its unit, the same for
  // every block; of a root parameter (RootParam or LlamaRootParam) inside the root unit.
  size_t block_offset(int p) const { return params_[units_[1].params[p]].offset; }
  size_t root_offset(int p) const { return params_[units_[ROOT_UNIT].params[p]].offset; }
  // Model FLOPs per trained token: 6 * (parameters outside the embedding tables + V*C for the LM
  // head) + 12*L*T*C for attention's scores and weighted sums.
  double flops_per_token(int seq_len) const;

 private:
  void add_gpt2_params();
  void add_llama_params();
  void add(int unit, const std::string& name, std::vector<int> shape, InitRule init, bool decay);

  ModelConfig config_;
  std::vector<ParamInfo> params_;
  std::vector<UnitInfo> units_;
};

}  // namespace shardtrain
