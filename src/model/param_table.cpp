// Builds the parameter table (see param_table.hpp). Linear weights are (out, in), as in llm.c and
// Hugging Face's nn.Linear, so weights move to and from their files without transposes (GPT-2's
// Hugging Face Conv1D weights are the exception, transposed on import and export).
#include "model/param_table.hpp"

#include <fnmatch.h>

#include <algorithm>

#include "core/error.hpp"
#include "model/family.hpp"

namespace shardtrain {

std::vector<std::string> split_comma_list(const std::string& list) {
  std::vector<std::string> patterns;
  size_t start = 0;
  while (start <= list.size()) {
    size_t comma = list.find(',', start);
    if (comma == std::string::npos) comma = list.size();
    std::string item = list.substr(start, comma - start);
    const size_t a = item.find_first_not_of(" \t"), b = item.find_last_not_of(" \t");
    item = a == std::string::npos ? "" : item.substr(a, b - a + 1);
    if (!item.empty()) patterns.push_back(item);
    start = comma + 1;
  }
  return patterns;
}

ParamTable::ParamTable(const ModelConfig& c, const std::vector<std::string>& freeze, const AdapterConfig& adapter,
                       const QuantConfig& quant)
    : config_(c), adapter_(adapter), quant_(quant) {
  units_.push_back(UnitInfo{"root", "root", 0, 0, {}, 0, 0});
  const ModelFamily& family = family_of(c);
  family.add_params(*this);
  std::vector<std::string> kinds;  // the sites of each kind of block, asked once
  for (int b = 0; b < block_count(); b++) {
    const std::string& kind = units_[block_unit(b)].kind;
    size_t k = std::find(kinds.begin(), kinds.end(), kind) - kinds.begin();
    if (k == kinds.size()) kinds.push_back(kind), sites_.push_back(family.linear_sites(c, kind));
    block_kind_.push_back(static_cast<int>(k));
  }
  add_adapters();
  apply_freeze(freeze);
}

void ParamTable::add_adapters() {
  if (adapter_.type == ADAPTER_NONE) return;
  const ModelFamily& family = family_of(config_);
  const std::vector<LinearSite> all = all_sites();
  std::string layers;
  for (const LinearSite& site : all) layers += (layers.empty() ? "" : ", ") + std::string(site.module);
  if (adapter_.targets.empty())
    throw UsageError(std::string("adapter.type=") + adapter_type_name(adapter_.type) +
                     " adapts nothing: set adapter.targets to linear layers, e.g. " + all[0].module + " (" +
                     config_.arch + ": " + layers + ")");
  std::vector<bool> used(adapter_.targets.size(), false);
  adapter_params_.resize(block_count());
  for (int l = 0; l < block_count(); l++) {
    const int u = block_unit(l);
    const std::vector<LinearSite>& sites = block_sites(l);
    adapter_params_[l].assign(sites.size(), -1);
    for (size_t k = 0; k < sites.size(); k++) {
      const LinearSite& site = sites[k];
      const std::string path = family.module_path(config_, l, site);
      bool match = false;
      for (size_t t = 0; t < adapter_.targets.size(); t++)
        if (target_matches(adapter_.targets[t], path)) used[t] = match = true;
      if (!match) continue;
      std::string base = param(u, site.weight).name;
      base = base.substr(0, base.size() - std::string(".weight").size());
      adapter_params_[l][k] = static_cast<int>(units_[u].params.size());
      add_adapter(u, base, path, site);
      for (size_t id = units_[u].params[adapter_params_[l][k]]; id < params_.size(); id++) params_[id].adapter = true;
    }
  }
  for (size_t t = 0; t < adapter_.targets.size(); t++)
    if (!used[t])
      throw UsageError("adapter.targets: '" + adapter_.targets[t] + "' matches no linear layer of this " +
                       config_.arch + " model (" + family.module_path(config_, 0, block_sites(0)[0]) +
                       ", ...; the layers of a block: " + layers + ")");
  for (ParamInfo& p : params_) p.frozen = !p.adapter;  // the base is frozen
}

void ParamTable::add_adapter(int u, const std::string& base, const std::string& path, const LinearSite& site) {
  const int r = adapter_.rank, in = site.in, out = site.out;
  if (adapter_.type != ADAPTER_LOKR && adapter_.type != ADAPTER_OFT && r > std::min(in, out))
    throw UsageError(strprintf("adapter.rank=%d is larger than %s (%d inputs, %d outputs): a rank above "
                               "min(in, out) adds parameters and nothing else; lower adapter.rank",
                               r, path.c_str(), in, out));
  switch (adapter_.type) {
    case ADAPTER_LORA:
    case ADAPTER_DORA:
      add_param(u, base + ".lora_A.weight", {r, in}, INIT_KAIMING_UNIFORM, true);
      add_param(u, base + ".lora_B.weight", {out, r}, INIT_ZEROS, true);
      if (adapter_.type == ADAPTER_DORA) add_param(u, base + ".lora_magnitude_vector", {out}, INIT_WEIGHT_NORMS, false);
      return;
    case ADAPTER_LOHA:  // PEFT: the second product starts at zero, so delta W does
      add_param(u, base + ".hada_w1_a", {out, r}, INIT_KAIMING_UNIFORM, true);
      add_param(u, base + ".hada_w1_b", {r, in}, INIT_KAIMING_UNIFORM, true);
      add_param(u, base + ".hada_w2_a", {out, r}, INIT_KAIMING_UNIFORM, true);
      add_param(u, base + ".hada_w2_b", {r, in}, INIT_ZEROS, true);
      return;
    case ADAPTER_LOKR: {  // PEFT: w1 (or its first factor) starts at zero
      const LokrShape k = lokr_shape(adapter_, in, out);
      if (k.w1_low_rank) {
        add_param(u, base + ".lokr_w1_a", {k.a, r}, INIT_ZEROS, true);
        add_param(u, base + ".lokr_w1_b", {r, k.c}, INIT_KAIMING_UNIFORM, true);
      } else {
        add_param(u, base + ".lokr_w1", {k.a, k.c}, INIT_ZEROS, true);
      }
      if (k.w2_low_rank) {
        add_param(u, base + ".lokr_w2_a", {k.b, r}, INIT_KAIMING_UNIFORM, true);
        add_param(u, base + ".lokr_w2_b", {r, k.d}, INIT_KAIMING_UNIFORM, true);
      } else {
        add_param(u, base + ".lokr_w2", {k.b, k.d}, INIT_KAIMING_UNIFORM, true);
      }
      return;
    }
    case ADAPTER_OFT: {  // PEFT: zero, the identity rotation
      const int b = adapter_.block_size;
      if (in % b != 0) {
        int below = b, above = b;
        while (in % below != 0) below--;
        while (in % above != 0) above++;
        throw UsageError(strprintf("adapter.block_size=%d does not divide the %d inputs of %s: OFT's blocks must "
                                   "tile them; set adapter.block_size to a divisor such as %d or %d",
                                   b, in, path.c_str(), below, above));
      }
      add_param(u, base + ".oft_R.weight", {adapter_.block_share ? 1 : in / b, b * (b - 1) / 2}, INIT_ZEROS, true);
      return;
    }
    case ADAPTER_NONE: break;
  }
}

void ParamTable::apply_freeze(const std::vector<std::string>& patterns) {
  for (const std::string& pattern : patterns) {
    bool matched = false;
    for (ParamInfo& p : params_)
      if (fnmatch(pattern.c_str(), p.name.c_str(), 0) == 0) p.frozen = matched = true;
    if (!matched)
      throw UsageError("train.freeze: pattern '" + pattern + "' matches no parameter (names as in `shardtrain " +
                       "inspect`, e.g. " + params_.back().name + "; globs: * ? [0-5])");
  }
  if (std::all_of(params_.begin(), params_.end(), [](const ParamInfo& p) { return p.frozen; }))
    throw UsageError("train.freeze freezes every parameter: nothing would train; freeze fewer");
  // The groups a block multiplies as one matrix must stay adjacent: all frozen or none.
  for (size_t u = 1; u < units_.size(); u++)
    for (const ModelFamily::FusedGroup& group : family_of(config_).fused_groups(config_, units_[u].kind))
      for (int q : group.params)
        if (param(static_cast<int>(u), q).frozen != param(static_cast<int>(u), group.params[0]).frozen)
          throw UsageError("train.freeze freezes part of " + units_[u].name + "'s " + group.label +
                           ", which is multiplied as one matrix: freeze all of the group or none of it");
  for (int l = 0; l < block_count(); l++)
    for (const LinearSite& site : block_sites(l)) params_[units_[block_unit(l)].params[site.weight]].linear_weight = true;
  mark_quantized();
  assign_offsets();
}

// The frozen weights of the blocks' linear layers that the family lets a format hold (FLUX keeps
// its modulation in full precision), as bitsandbytes' replacement of nn.Linear does; embeddings,
// norms and the head stay fp32.
void ParamTable::mark_quantized() {
  if (quant_.type == QUANT_NONE) return;
  const ModelFamily& family = family_of(config_);
  const std::string option = std::string(quant_.option) + "=" + quant_type_name(quant_.type);
  size_t count = 0;
  for (int l = 0; l < block_count(); l++)
    for (const LinearSite& site : block_sites(l)) {
      ParamInfo& w = params_[units_[block_unit(l)].params[site.weight]];
      if (quant_.inference) w.frozen = true;
      if (w.frozen && (quant_.all_linear || family.quantizable(site))) w.quantized = true, count++;
    }
  if (count == 0)
    throw UsageError(option + " quantizes frozen linear weights and this run freezes none: train adapters " +
                     "(adapter.type) or freeze blocks (train.freeze), or set fsdp.frozen_dtype=fp32");
  // A fused group stays adjacent only in one space, and in the quantized one only when its members
  // are whole blocks.
  for (size_t u = 1; u < units_.size(); u++)
    for (const ModelFamily::FusedGroup& group : family.fused_groups(config_, units_[u].kind)) {
      bool all = true;
      for (int q : group.params) all = all && param(static_cast<int>(u), q).quantized;
      if (!all)
        for (int q : group.params) params_[units_[u].params[q]].quantized = false;
      for (size_t k = 0; k + 1 < group.params.size(); k++) {
        const ParamInfo& p = param(static_cast<int>(u), group.params[k]);
        if (!p.quantized || p.numel % quant_.block == 0) continue;
        const size_t fits = p.numel & (~p.numel + 1);  // the largest power of two dividing it
        throw UsageError(strprintf("%s: fsdp.quant_block=%zu does not tile %s (%zu elements), which is multiplied "
                                   "as one matrix with the next weight of %s: %s",
                                   option.c_str(), quant_.block, p.name.c_str(), p.numel, group.label,
                                   fits >= 32 ? strprintf("set fsdp.quant_block=%zu", std::min<size_t>(fits, 4096)).c_str()
                                              : "no block size of 32 or more divides it; keep these weights in full "
                                                "precision (fsdp.frozen_dtype=fp32)"));
      }
    }
}

// Trainable first, then frozen, then quantized (each weight on a block boundary), each in
// declaration order.
void ParamTable::assign_offsets() {
  for (UnitInfo& unit : units_) {
    size_t at = 0;
    unit.trainable_numel = 0;
    for (int id : unit.params)
      if (!params_[id].frozen) params_[id].offset = at, at += params_[id].numel, unit.trainable_numel += params_[id].numel;
    for (int id : unit.params)
      if (params_[id].frozen && !params_[id].quantized) params_[id].offset = at, at += params_[id].numel;
    unit.plain_numel = at;
    for (int id : unit.params)
      if (params_[id].quantized)
        params_[id].offset = at, at += (params_[id].numel + quant_.block - 1) / quant_.block * quant_.block;
    unit.quantized_numel = at - unit.plain_numel;
  }
}

std::vector<LinearSite> ParamTable::all_sites() const {
  std::vector<LinearSite> all;
  for (const std::vector<LinearSite>& kind : sites_) all.insert(all.end(), kind.begin(), kind.end());
  return all;
}

int ParamTable::add_unit(const std::string& name, const std::string& kind) {
  units_.push_back(UnitInfo{name, kind, 0, 0, {}, 0, 0});
  return static_cast<int>(units_.size()) - 1;
}

void ParamTable::add_param(int unit, const std::string& name, std::vector<int> shape, InitRule init, bool decay) {
  ParamInfo p;
  p.name = name;
  p.numel = 1;
  for (int d : shape) p.numel *= static_cast<size_t>(d);
  p.shape = std::move(shape);
  p.unit = unit;
  p.offset = p.file_offset = units_[unit].numel;
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

int ParamTable::backward_floor() const {
  for (int p : family_of(config_).input_params())  // a family lists its optional ones too (FLUX's guidance)
    if (p < static_cast<int>(units_[ROOT_UNIT].params.size()) && !frozen(ROOT_UNIT, p)) return 0;
  int layer = 0;
  while (layer < block_count() && units_[block_unit(layer)].trainable_numel == 0) layer++;
  return layer;
}

size_t ParamTable::trainable_params() const {
  size_t n = 0;
  for (const auto& u : units_) n += u.trainable_numel;
  return n;
}

double ParamTable::flops_per_token(int seq_len) const { return family_of(config_).flops_per_token(*this, seq_len); }

}  // namespace shardtrain
