// Builds the parameter table of GPT-2 (see param_table.hpp). Shapes are llm.c's: linear weights
// (out, in), so weights move to and from llm.c checkpoints without transposes.
#include "model/param_table.hpp"

#include "core/error.hpp"

namespace shardtrain {

ParamTable::ParamTable(const ModelConfig& c) : config_(c) {
  const int C = c.n_embd;
  units_.push_back(UnitInfo{"root", 0, {}});
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
  double wpe = static_cast<double>(c.max_seq_len) * c.n_embd;
  double non_embedding = static_cast<double>(total_params()) - wpe - static_cast<double>(c.vocab_size) * c.n_embd;
  double head = static_cast<double>(c.vocab_size) * c.n_embd;
  return 6.0 * (non_embedding + head) + 12.0 * c.n_layer * seq_len * c.n_embd;
}

}  // namespace shardtrain
