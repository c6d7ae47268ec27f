// Adapters on a frozen base (docs/adapters.md): which linear layers of a block they can adapt, how
// a target names them, and the method's settings. The adapter's own parameters are rows of the
// ParamTable like any other, in the unit of the block they adapt (model/param_table.hpp); the
// arithmetic is model/lora.hpp. Following Hugging Face PEFT 0.21.2's definitions.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "model/config.hpp"

namespace shardtrain {

// LoRA, and DoRA: LoRA whose layer output is rescaled per output feature by a trained magnitude
// over the (detached) norm of the adapted weight (model/lora.hpp). LoHa, LoKr and OFT change the
// weight itself: a Hadamard product of two low-rank products, a Kronecker product, a block-diagonal
// rotation of the inputs (model/delta_adapters.hpp).
enum AdapterType { ADAPTER_NONE, ADAPTER_LORA, ADAPTER_DORA, ADAPTER_LOHA, ADAPTER_LOKR, ADAPTER_OFT };
constexpr AdapterType ADAPTER_TYPES[] = {ADAPTER_NONE, ADAPTER_LORA, ADAPTER_DORA,
                                         ADAPTER_LOHA, ADAPTER_LOKR, ADAPTER_OFT};
const char* adapter_type_name(AdapterType type);
// Returns false for an unknown name.
bool parse_adapter_type(const std::string& name, AdapterType* out);

// Whether the method changes the weight (LoHa, LoKr, OFT) rather than adding a product's output.
inline bool changes_weight(AdapterType type) {
  return type == ADAPTER_LOHA || type == ADAPTER_LOKR || type == ADAPTER_OFT;
}

struct AdapterConfig {
  AdapterType type = ADAPTER_NONE;
  // PEFT's target_modules as a list: an entry names a module path exactly or is a suffix of it
  // after a dot ("mlp.c_fc" adapts transformer.h.<l>.mlp.c_fc of every block).
  std::vector<std::string> targets;
  int rank = 8;
  double alpha = 16;
  double dropout = 0;  // on the adapter's input, in training (LoRA)
  // LoKr: w1 too may be a low-rank product (w2 always may); the Kronecker factors' first
  // dimension divides the layer's by decompose_factor (-1: the divisor pair nearest the square root).
  bool decompose_both = false;
  int decompose_factor = -1;
  // OFT: rotation blocks of block_size inputs (PEFT's oft_block_size), each one the truncated
  // Cayley-Neumann series of neumann_terms terms or (cayley_neumann false) the exact Cayley
  // transform; block_share: one rotation for all the blocks of a layer.
  int block_size = 32;
  bool cayley_neumann = true;
  int neumann_terms = 5;
  bool block_share = false;
  // alpha / rank (LoRA, DoRA, LoHa, LoKr; OFT has no scaling).
  double scaling() const { return alpha / rank; }
  bool weight_delta() const { return changes_weight(type); }
};

// LoKr's shapes for a layer of `in` inputs and `out` outputs: delta W = s kron(w1 (a, c), w2 (b, d)),
// out = a b and in = c d (PEFT's factorization); each factor a rank-`rank` product where PEFT
// makes it one (w1 only with decompose_both).
struct LokrShape {
  int a, b, c, d;
  bool w1_low_rank, w2_low_rank;
};
LokrShape lokr_shape(const AdapterConfig& adapter, int in, int out);
// The method and its settings as the start line and `inspect` print them: "lora rank 8 alpha 16
// dropout 0", "oft block_size 32 rotation cayley-neumann 5 terms block_share false".
std::string adapter_settings(const AdapterConfig& adapter);
// PEFT's factorization(dim, factor): dim = m n, (m, n) as PEFT orders them.
std::pair<int, int> lokr_factorization(int dim, int factor);

// A block's matrix products are numbered by its family; a site names the product it adds to. The
// four of a decoder block (Llama multiplies q|k|v and gate|up as one matrix each):
using BlockProduct = int;
enum DecoderProduct { PRODUCT_QKV, PRODUCT_ATTN_OUT, PRODUCT_MLP_UP, PRODUCT_MLP_DOWN };

// A linear layer of a block that an adapter can target. Its outputs are columns [column, column
// + out) of `product`, which is `width` wide.
struct LinearSite {
  const char* module;  // its path inside the block: "attn.c_attn", "self_attn.q_proj"
  int weight;          // the base weight's position in the block unit (the family's enums)
  int bias;            // its bias's, or -1 (Llama has none)
  BlockProduct product;
  int in, out;
  int column, width;
};

// PEFT's rule for a list entry: the path itself, or a suffix of it after a dot.
bool target_matches(const std::string& target, const std::string& path);

}  // namespace shardtrain
