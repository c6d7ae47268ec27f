// Builds the parameter table (see param_table.hpp). Linear weights are (out, in), as in llm.c and
// Hugging Face's nn.Linear, so weights move to and from their files without transposes (GPT-2's
// Hugging Face Conv1D weights are the exception, transposed on import and export).
#include "model/param_table.hpp"

#include "core/error.hpp"

namespace shardtrain {

std::string model_summary(const ModelConfig& c) {
  if (c.arch == ARCH_GPT2)
    return strprintf("GPT-2 L=%d C=%d H=%d V=%d max_seq_len=%d", c.n_layer, c.n_embd, c.n_head, c.vocab_size,
                     c.max_seq_len);
  return strprintf("Llama L=%d C=%d H=%d KV=%d MLP=%d V=%d max_seq_len=%d rope_theta=%g norm_eps=%g %s", c.n_layer,
                   c.n_embd, c.n_head, c.kv_heads(), c.mlp_size(), c.vocab_size, c.max_seq_len, c.rope_theta,
                   c.norm_eps, c.tie_embeddings ? "tied" : "untied");
}

ParamTable::ParamTable(const ModelConfig& c) : config_(c) {
  units_.push_back(UnitInfo{"root", 0, {}});
  if (c.arch == ARCH_LLAMA)
    add_llama_params();
  else
    add_gpt2_params();
}

void ParamTable::add_gpt2_params() {
  const ModelConfig& c = config_;
  const int C = c.n_embd;
  add(ROOT_UNIT, "wte", {c.vocab_size, C}, INIT_NORMAL, true);
  add(ROOT_UNIT, "wpe", {c.max_seq_len, C}, INIT_NORMAL, true);
  add(ROOT_UNIT, "ln_f.weight", {C}, INIT_ONES, false);
  add(ROOT_UNIT, "ln_f.bias", {C}, INIT_ZEROS, false);
  for (int l = 0; l < c.n_layer; l++) {
    std::string h = "h." + std::to_string(l);
    int u = block_unit(l);
    units_.push_back(UnitInfo{h, 0, {}});
    // Order must match enum BlockParam.
    add(u, h + ".ln_1.weight", {C}, INIT_ONES, false);
    add(u, h + ".ln_1.bias", {C}, INIT_ZEROS, false);
    add(u, h + ".attn.qkv.weight", {3 * C, C}, INIT_NORMAL, true);
    add(u, h + ".attn.qkv.bias", {3 * C}, INIT_ZEROS, false);
    add(u, h + ".attn.proj.weight", {C, C}, INIT_NORMAL_RESIDUAL, true);
    add(u, h + ".attn.proj.bias", {C}, INIT_ZEROS, false);
    add(u, h + ".ln_2.weight", {C}, INIT_ONES, false);
    add(u, h + ".ln_2.bias", {C}, INIT_ZEROS, false);
    add(u, h + ".mlp.fc.weight", {4 * C, C}, INIT_NORMAL, true);
    add(u, h + ".mlp.fc.bias", {4 * C}, INIT_ZEROS, false);
    add(u, h + ".mlp.proj.weight", {C, 4 * C}, INIT_NORMAL_RESIDUAL, true);
    add(u, h + ".mlp.proj.bias", {C}, INIT_ZEROS, false);
  }
}

void ParamTable::add_llama_params() {
  const ModelConfig& c = config_;
  const int C = c.n_embd, KV = c.kv_heads() * c.head_size(), I = c.mlp_size();
  // Order must match enum LlamaRootParam.
  add(ROOT_UNIT, "embed_tokens.weight", {c.vocab_size, C}, INIT_NORMAL, true);
  add(ROOT_UNIT, "norm.weight", {C}, INIT_ONES, false);
  if (!c.tie_embeddings) add(ROOT_UNIT, "lm_head.weight", {c.vocab_size, C}, INIT_NORMAL, true);
  for (int l = 0; l < c.n_layer; l++) {
    std::string h = "layers." + std::to_string(l);
    int u = block_unit(l);
    units_.push_back(UnitInfo{h, 0, {}});
    // Order must match enum LlamaBlockParam.
    add(u, h + ".input_layernorm.weight", {C}, INIT_ONES, false);
    add(u, h + ".self_attn.q_proj.weight", {C, C}, INIT_NORMAL, true);
    add(u, h + ".self_attn.k_proj.weight", {KV, C}, INIT_NORMAL, true);
    add(u, h + ".self_attn.v_proj.weight", {KV, C}, INIT_NORMAL, true);
    add(u, h + ".self_attn.o_proj.weight", {C, C}, INIT_NORMAL_RESIDUAL, true);
    add(u, h + ".post_attention_layernorm.weight", {C}, INIT_ONES, false);
    add(u, h + ".mlp.gate_proj.weight", {I, C}, INIT_NORMAL, true);
    add(u, h + ".mlp.up_proj.weight", {I, C}, INIT_NORMAL, true);
    add(u, h + ".mlp.down_proj.weight", {C, I}, INIT_NORMAL_RESIDUAL, true);
  }
}

void ParamTable::add(int unit, const std::string& name, std::vector<int> shape, InitRule init, bool decay) {
  ParamInfo p;
  p.name = name;
  p.numel = 1;
  for (int d : shape) p.numel *= static_cast<size_t>(d);
  p.shape = std::move(shape);
  p.unit = unit;
  p.offset = units_[unit].numel;
  p.init = init;
  p.weight_decay = decay;
  p.id = static_cast<int>(params_.size());
  units_[unit].numel += p.numel;
  units_[unit].params.push_back(p.id);
  params_.push_back(std::move(p));
}

size_t ParamTable::total_params() const {
  size_t n = 0;
  for (const auto& u : units_) n += u.numel;
  return n;
}

double ParamTable::flops_per_token(int seq_len) const {
  const ModelConfig& c = config_;
  const double embedding = static_cast<double>(c.vocab_size) * c.n_embd;
  const double positions = c.arch == ARCH_GPT2 ? static_cast<double>(c.max_seq_len) * c.n_embd : 0.0;
  // An untied head is a parameter of its own, already in the total; a tied one is the embedding.
  const double matmul_params = static_cast<double>(total_params()) - positions - embedding + (c.tied() ? embedding : 0);
  return 6.0 * matmul_params + 12.0 * c.n_layer * seq_len * c.n_embd;
}

}  // namespace shardtrain
