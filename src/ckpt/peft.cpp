// See peft.hpp. The config keys PEFT 0.21.2 needs to load a LoRA adapter, and the ones we check on
// the way in: a setting we do not implement (DoRA, rsLoRA, a LoRA bias, per-module ranks) is
// refused rather than silently computed otherwise.
#include "ckpt/peft.hpp"

#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "ckpt/json_file.hpp"
#include "ckpt/safetensors.hpp"
#include "core/error.hpp"

namespace shardtrain {

std::vector<PeftTensor> peft_tensors(const ParamTable& table) {
  const ModelConfig& c = table.config();
  const std::vector<LinearSite> sites = linear_sites(c);
  std::vector<PeftTensor> out;
  for (int l = 0; l < c.n_layer; l++)
    for (size_t k = 0; k < sites.size(); k++) {
      const int a = table.adapter_param(l, static_cast<int>(k));
      if (a < 0) continue;
      const std::string module = "base_model.model." + hf_module_path(c, l, sites[k]);
      out.push_back({table.param(block_unit(l), a).id, module + ".lora_A.weight"});
      out.push_back({table.param(block_unit(l), a + 1).id, module + ".lora_B.weight"});
      if (table.adapter().type == ADAPTER_DORA)  // PEFT's name has no ".weight"
        out.push_back({table.param(block_unit(l), a + 2).id, module + ".lora_magnitude_vector"});
    }
  return out;
}

std::string peft_adapter_config_json(const ParamTable& table) {
  const AdapterConfig& a = table.adapter();
  const ModelConfig& c = table.config();
  nlohmann::json j;
  j["peft_type"] = "LORA";
  j["task_type"] = "CAUSAL_LM";
  j["peft_version"] = "0.21.2";
  j["base_model_name_or_path"] = nullptr;
  j["r"] = a.rank;
  j["lora_alpha"] = a.alpha;
  j["lora_dropout"] = a.dropout;
  j["target_modules"] = a.targets;
  j["fan_in_fan_out"] = c.arch == ARCH_GPT2;  // transformers' Conv1D stores GPT-2's weights (in, out)
  j["bias"] = "none";
  j["lora_bias"] = false;
  j["use_dora"] = a.type == ADAPTER_DORA;
  j["use_rslora"] = false;
  j["init_lora_weights"] = true;
  j["inference_mode"] = true;
  j["rank_pattern"] = nlohmann::json::object();
  j["alpha_pattern"] = nlohmann::json::object();
  j["modules_to_save"] = nullptr;
  j["layers_to_transform"] = nullptr;
  j["layers_pattern"] = nullptr;
  j["exclude_modules"] = nullptr;
  j["auto_mapping"] = {{"base_model_class", c.arch == ARCH_GPT2 ? "GPT2LMHeadModel" : "LlamaForCausalLM"}};
  return j.dump(2) + "\n";
}

namespace {

// The folder's adapter settings against the configured ones.
void check_peft_config(const std::string& path, const nlohmann::json& j, const AdapterConfig& a) {
  auto fail = [&](const std::string& what) { throw UsageError("PEFT adapter config '" + path + "': " + what); };
  auto flag = [&](const char* key) { return j.contains(key) && j[key].is_boolean() && j[key].get<bool>(); };
  auto nonempty = [&](const char* key) { return j.contains(key) && j[key].is_object() && !j[key].empty(); };
  if (!j.is_object() || !j.contains("peft_type") || !j["peft_type"].is_string())
    throw CheckpointError("PEFT adapter config '" + path + "': no peft_type");
  const std::string type = j["peft_type"].get<std::string>();
  if (type != "LORA") fail("peft_type " + type + "; adapter.type=lora and dora read LORA adapters");
  if (flag("use_dora") != (a.type == ADAPTER_DORA))
    fail(std::string("use_dora is ") + (flag("use_dora") ? "true" : "false") + " but adapter.type=" +
         adapter_type_name(a.type) + "; set adapter.type=" + (flag("use_dora") ? "dora" : "lora"));
  if (flag("use_rslora")) fail("use_rslora is true: rsLoRA's scaling alpha/sqrt(r) is not implemented");
  if (flag("lora_bias")) fail("lora_bias is true: LoRA biases are not implemented");
  if (nonempty("rank_pattern") || nonempty("alpha_pattern"))
    fail("rank_pattern/alpha_pattern give layers their own rank or alpha, which adapter.* cannot");
  if (!j.contains("r") || !j["r"].is_number_integer() || j["r"].get<int>() != a.rank)
    fail("r=" + (j.contains("r") ? j["r"].dump() : std::string("(none)")) + " but adapter.rank=" +
         std::to_string(a.rank) + "; set adapter.rank to the adapter's");
  if (!j.contains("lora_alpha") || !j["lora_alpha"].is_number() || j["lora_alpha"].get<double>() != a.alpha)
    fail("lora_alpha=" + (j.contains("lora_alpha") ? j["lora_alpha"].dump() : std::string("(none)")) +
         " but adapter.alpha=" + strprintf("%g", a.alpha) + "; set adapter.alpha to the adapter's");
}

}  // namespace

void init_dora_magnitudes(FsdpEngine& engine, Comm& world) {
  const ParamTable& table = engine.table();
  if (table.adapter().type != ADAPTER_DORA) return;
  const std::vector<LinearSite> sites = linear_sites(table.config());
  for (int l = 0; l < table.config().n_layer; l++) {
    const int u = block_unit(l);
    UnitShard& s = engine.shards()[u];
    std::vector<float> values(s.layout.shard_numel());
    s.params.device()->copy(values.data(), s.params.data(), s.params.bytes());
    // Squared row norms of every adapted weight of the block, from the elements this rank owns.
    std::vector<double> squares;
    std::vector<size_t> first_row;  // per adapted site: its rows' position in `squares`
    for (size_t k = 0; k < sites.size(); k++) {
      first_row.push_back(squares.size());
      if (table.adapter_param(l, static_cast<int>(k)) < 0) continue;
      const ParamInfo& w = table.param(u, sites[k].weight);
      squares.resize(squares.size() + sites[k].out, 0.0);
      const UnitLayout::Local owned = s.layout.local_part(w.range(), true);
      for (size_t e = owned.range.begin; e < owned.range.end; e++) {
        const double x = values[owned.index + (e - owned.range.begin)];
        squares[first_row[k] + (e - w.offset) / sites[k].in] += x * x;
      }
    }
    world.all_reduce_sum(Span<double>(squares), "all_reduce(DoRA weight norms)");
    for (size_t k = 0; k < sites.size(); k++) {
      const int a = table.adapter_param(l, static_cast<int>(k));
      if (a < 0) continue;
      const ParamInfo& m = table.param(u, a + 2);
      const UnitLayout::Local local = s.layout.local_part(m.range());
      for (size_t o = local.range.begin; o < local.range.end; o++)
        values[local.index + (o - local.range.begin)] = static_cast<float>(std::sqrt(squares[first_row[k] + o - m.offset]));
    }
    s.params.device()->copy(s.params.data(), values.data(), s.params.bytes());
  }
}

void load_peft_adapter(const std::string& folder, FsdpEngine& engine) {
  const ParamTable& table = engine.table();
  const std::string config_path = folder + "/adapter_config.json", weights = folder + "/adapter_model.safetensors";
  check_peft_config(config_path, read_json(config_path, "PEFT adapter config"), table.adapter());
  const SafetensorsReader reader(weights);
  const std::vector<PeftTensor> wanted = peft_tensors(table);
  std::vector<const SafetensorsTensor*> sources(table.params().size(), nullptr);
  std::set<std::string> used;
  for (const PeftTensor& w : wanted) {
    const ParamInfo& p = table.params()[w.id];
    const SafetensorsTensor* t = reader.find(w.name);
    if (!t)
      throw CheckpointError("PEFT adapter '" + weights + "': tensor '" + w.name +
                            "' is missing (adapter.targets adapts a layer the adapter does not)");
    if (t->shape != std::vector<int64_t>(p.shape.begin(), p.shape.end()))
      throw CheckpointError("PEFT adapter '" + weights + "': tensor '" + w.name + "' has another shape than " +
                            "the configured model's");
    sources[w.id] = t;
    used.insert(w.name);
  }
  for (const SafetensorsTensor& t : reader.tensors())
    if (!used.count(t.name))
      throw CheckpointError("PEFT adapter '" + weights + "': tensor '" + t.name +
                            "' is not one the configured adapters have (adapter.targets adapts fewer layers?)");
  for (UnitShard& s : engine.shards()) {
    std::vector<float> values(s.layout.shard_numel());
    s.params.device()->copy(values.data(), s.params.data(), s.params.bytes());  // the base stays
    bool any = false;
    for (int id : table.units()[&s - engine.shards().data()].params) {
      const ParamInfo& p = table.params()[id];
      const UnitLayout::Local local = s.layout.local_part(p.range());
      if (!p.adapter || local.range.empty()) continue;
      float* slice = values.data() + local.index;
      const size_t count = local.range.size();
      reader.read_fp32(*sources[id], local.range.begin - p.offset, count, slice);
      for (size_t i = 0; i < count; i++)
        if (!std::isfinite(slice[i]))
          throw CheckpointError("PEFT adapter '" + weights + "': tensor of " + p.name + " holds " +
                                strprintf("%g", slice[i]) + ": the file is damaged; use another adapter");
      any = true;
    }
    if (any) s.params.device()->copy(s.params.data(), values.data(), s.params.bytes());
  }
}

}  // namespace shardtrain
