// See adapter.hpp.
#include "model/adapter.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "model/param_table.hpp"

namespace shardtrain {

const char* adapter_type_name(AdapterType type) {
  switch (type) {
    case ADAPTER_LORA: return "lora";
    case ADAPTER_DORA: return "dora";
    case ADAPTER_LOHA: return "loha";
    case ADAPTER_LOKR: return "lokr";
    case ADAPTER_OFT: return "oft";
    case ADAPTER_NONE: break;
  }
  return "none";
}

bool parse_adapter_type(const std::string& name, AdapterType* out) {
  for (AdapterType t : ADAPTER_TYPES)
    if (name == adapter_type_name(t)) return *out = t, true;
  return false;
}

std::pair<int, int> lokr_factorization(int dim, int factor) {
  if (factor > 0 && dim % factor == 0) return {factor, dim / factor};  // as given, not sorted
  if (factor <= 0) factor = dim;
  int m = 1, n = dim;
  while (m < n) {
    int next = m + 1;
    while (dim % next != 0) next++;
    if (next > factor) break;
    m = next, n = dim / next;
  }
  return {std::min(m, n), std::max(m, n)};
}

std::string adapter_settings(const AdapterConfig& a) {
  const std::string name = adapter_type_name(a.type);
  switch (a.type) {
    case ADAPTER_LORA:
    case ADAPTER_DORA: return name + strprintf(" rank %d alpha %g dropout %g", a.rank, a.alpha, a.dropout);
    case ADAPTER_LOHA: return name + strprintf(" rank %d alpha %g", a.rank, a.alpha);
    case ADAPTER_LOKR:
      return name + strprintf(" rank %d alpha %g decompose_both %s decompose_factor %d", a.rank, a.alpha,
                              a.decompose_both ? "true" : "false", a.decompose_factor);
    case ADAPTER_OFT:  // no rank, no scaling
      return name + strprintf(" block_size %d rotation %s block_share %s", a.block_size,
                              a.cayley_neumann ? strprintf("cayley-neumann %d terms", a.neumann_terms).c_str()
                                               : "exact",
                              a.block_share ? "true" : "false");
    case ADAPTER_NONE: break;
  }
  return name;
}

LokrShape lokr_shape(const AdapterConfig& adapter, int in, int out) {
  const auto [a, b] = lokr_factorization(out, adapter.decompose_factor);
  const auto [c, d] = lokr_factorization(in, adapter.decompose_factor);
  // PEFT: "r < max(...) / 2" in real numbers.
  return {a, b, c, d, adapter.decompose_both && 2 * adapter.rank < std::max(a, c), 2 * adapter.rank < std::max(b, d)};
}

std::vector<LinearSite> linear_sites(const ModelConfig& c) {
  const int C = c.n_embd;
  if (c.arch == ARCH_GPT2)
    return {{"attn.c_attn", BLOCK_QKV_W, BLOCK_QKV_B, PRODUCT_QKV, C, 3 * C, 0, 3 * C},
            {"attn.c_proj", BLOCK_ATTPROJ_W, BLOCK_ATTPROJ_B, PRODUCT_ATTN_OUT, C, C, 0, C},
            {"mlp.c_fc", BLOCK_FC_W, BLOCK_FC_B, PRODUCT_MLP_UP, C, 4 * C, 0, 4 * C},
            {"mlp.c_proj", BLOCK_FCPROJ_W, BLOCK_FCPROJ_B, PRODUCT_MLP_DOWN, 4 * C, C, 0, C}};
  const int KV = c.kv_heads() * c.head_size(), QKV = c.qkv_size(), I = c.mlp_size();
  return {{"self_attn.q_proj", LLAMA_Q_W, -1, PRODUCT_QKV, C, C, 0, QKV},
          {"self_attn.k_proj", LLAMA_K_W, -1, PRODUCT_QKV, C, KV, C, QKV},
          {"self_attn.v_proj", LLAMA_V_W, -1, PRODUCT_QKV, C, KV, C + KV, QKV},
          {"self_attn.o_proj", LLAMA_O_W, -1, PRODUCT_ATTN_OUT, C, C, 0, C},
          {"mlp.gate_proj", LLAMA_GATE_W, -1, PRODUCT_MLP_UP, C, I, 0, 2 * I},
          {"mlp.up_proj", LLAMA_UP_W, -1, PRODUCT_MLP_UP, C, I, I, 2 * I},
          {"mlp.down_proj", LLAMA_DOWN_W, -1, PRODUCT_MLP_DOWN, I, C, 0, C}};
}

std::string hf_module_path(const ModelConfig& c, int layer, const LinearSite& site) {
  return (c.arch == ARCH_GPT2 ? "transformer.h." : "model.layers.") + std::to_string(layer) + "." + site.module;
}

bool target_matches(const std::string& target, const std::string& path) {
  if (target == path) return true;
  return path.size() > target.size() && path.compare(path.size() - target.size(), target.size(), target) == 0 &&
         path[path.size() - target.size() - 1] == '.';
}

}  // namespace shardtrain
