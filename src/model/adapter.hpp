// Adapters on a frozen base (docs/adapters.md): which linear layers of a block they can adapt, how
// a target names them, and the method's settings. The adapter's own parameters are rows of the
// ParamTable like any other, in the unit of the block they adapt (model/param_table.hpp); the
// arithmetic is model/lora.hpp. Following Hugging Face PEFT 0.21.2's definitions.
#pragma once

#include <string>
#include <vector>

#include "model/config.hpp"

namespace shardtrain {

// LoRA, and DoRA: LoRA whose layer output is rescaled per output feature by a trained magnitude
// over the (detached) norm of the adapted weight (model/lora.hpp).
enum AdapterType { ADAPTER_NONE, ADAPTER_LORA, ADAPTER_DORA };
constexpr AdapterType ADAPTER_TYPES[] = {ADAPTER_NONE, ADAPTER_LORA, ADAPTER_DORA};
const char* adapter_type_name(AdapterType type);
// Returns false for an unknown name.
bool parse_adapter_type(const std::string& name, AdapterType* out);

struct AdapterConfig {
  AdapterType type = ADAPTER_NONE;
  // PEFT's target_modules as a list: an entry names a module path exactly or is a suffix of it
  // after a dot ("mlp.c_fc" adapts transformer.h.<l>.mlp.c_fc of every block).
  std::vector<std::string> targets;
  int rank = 8;
  double alpha = 16;
  double dropout = 0;  // on the adapter's input, in training
  double scaling() const { return alpha / rank; }
};

// The four matrix products of a block, in both architectures. Llama multiplies q|k|v and gate|up
// as one matrix each.
enum BlockProduct { PRODUCT_QKV, PRODUCT_ATTN_OUT, PRODUCT_MLP_UP, PRODUCT_MLP_DOWN };

// A linear layer of a block that an adapter can target. Its outputs are columns [column, column
// + out) of `product`, which is `width` wide.
struct LinearSite {
  const char* module;  // its path inside the block: "attn.c_attn", "self_attn.q_proj"
  int weight;          // the base weight: BlockParam or LlamaBlockParam
  int bias;            // its bias (the same enums), or -1 (Llama has none)
  BlockProduct product;
  int in, out;
  int column, width;
};

// The linear layers of one block of this architecture, in the order the forward runs them.
std::vector<LinearSite> linear_sites(const ModelConfig& config);
// Hugging Face's module path of a block's layer: "transformer.h.3.attn.c_attn",
// "model.layers.3.self_attn.q_proj".
std::string hf_module_path(const ModelConfig& config, int layer, const LinearSite& site);
// PEFT's rule for a list entry: the path itself, or a suffix of it after a dot.
bool target_matches(const std::string& target, const std::string& path);

}  // namespace shardtrain
