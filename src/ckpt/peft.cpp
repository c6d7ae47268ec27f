// See peft.hpp. The config keys PEFT 0.21.2 needs to load each method's adapter, and the ones we
// check on the way in: a setting we do not implement (rsLoRA, a LoRA bias, per-module ranks, LoHa's
// and LoKr's rank and module dropout, constrained OFT, OFT blocks given by their count) is refused
// rather than silently computed otherwise.
#include "ckpt/peft.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "ckpt/json_file.hpp"
#include "ckpt/safetensors.hpp"
#include "core/error.hpp"
#include "core/format.hpp"

namespace shardtrain {

std::vector<PeftTensor> peft_tensors(const ParamTable& table, const std::string& prefix) {
  const ModelFamily& family = family_of(table.config());
  std::vector<PeftTensor> out;
  table.for_each_adapted_site([&](int l, const LinearSite& site, int a) {
    const UnitInfo& unit = table.units()[block_unit(l)];
    // The table names a layer's adapter parameters "<its weight's name less .weight>.<PEFT's
    // suffix>" (model/param_table.hpp): the suffix follows the module path in PEFT's name.
    std::string base = table.param(block_unit(l), site.weight).name;
    base = base.substr(0, base.size() - std::string(".weight").size()) + ".";
    const std::string module = prefix + family.module_path(table.config(), l, site) + ".";
    // A layer the family's files fuse with others (Phi-3's q_proj in qkv_proj) is part of one module
    // with one adapter to PEFT, which ours are not.
    const HfTensor stored = family.hf_tensor(table.config(), table.param(block_unit(l), site.weight));
    if (!stored.rows.empty())
      throw UsageError("model.arch=" + table.config().arch + " stores " + site.module + " as rows of '" + stored.name +
                       "', which PEFT adapts as one layer (one A and one B for all its parts): its adapters have no "
                       "PEFT form; merge them (export --format hf --merge), or adapt only layers stored whole "
                       "(o_proj, down_proj)");
    for (size_t q = a; q < unit.params.size(); q++) {
      const ParamInfo& p = table.params()[unit.params[q]];
      if (!p.adapter || p.name.compare(0, base.size(), base) != 0) break;
      out.push_back({p.id, module + p.name.substr(base.size())});
    }
  });
  return out;
}

const char* peft_type_name(AdapterType type) {
  switch (type) {
    case ADAPTER_LORA:
    case ADAPTER_DORA: return "LORA";
    case ADAPTER_LOHA: return "LOHA";
    case ADAPTER_LOKR: return "LOKR";
    case ADAPTER_OFT: return "OFT";
    case ADAPTER_NONE: break;
  }
  return "";
}

std::string peft_adapter_config_json(const ParamTable& table, const std::string& base) {
  const AdapterConfig& a = table.adapter();
  const ModelConfig& c = table.config();
  nlohmann::json j;
  j["peft_type"] = peft_type_name(a.type);
  j["task_type"] = "CAUSAL_LM";
  j["peft_version"] = "0.21.2";
  j["base_model_name_or_path"] = base.empty() ? nlohmann::json() : nlohmann::json(base);
  j["revision"] = nullptr;
  j["target_modules"] = a.targets;
  j["inference_mode"] = true;
  j["modules_to_save"] = nullptr;
  j["layers_to_transform"] = nullptr;
  j["layers_pattern"] = nullptr;
  j["exclude_modules"] = nullptr;
  const ModelFamily& family = family_of(c);
  j["auto_mapping"] = {{"base_model_class", family.hf_class_of(c)}};
  const bool conv1d = family.hf_conv1d();  // transformers' Conv1D stores the weights (in, out)
  switch (a.type) {
    case ADAPTER_LORA:
    case ADAPTER_DORA:
      j["r"] = a.rank;
      j["lora_alpha"] = a.alpha;
      j["lora_dropout"] = a.dropout;
      j["fan_in_fan_out"] = conv1d;
      j["bias"] = "none";
      j["lora_bias"] = false;
      j["use_dora"] = a.type == ADAPTER_DORA;
      j["use_rslora"] = false;
      j["init_lora_weights"] = true;
      j["rank_pattern"] = nlohmann::json::object();
      j["alpha_pattern"] = nlohmann::json::object();
      break;
    case ADAPTER_LOHA:
    case ADAPTER_LOKR:
      j["r"] = a.rank;
      j["alpha"] = a.alpha;
      j["rank_dropout"] = 0.0;
      j["module_dropout"] = 0.0;
      j["use_effective_conv2d"] = false;
      j["init_weights"] = true;
      j["rank_pattern"] = nlohmann::json::object();
      j["alpha_pattern"] = nlohmann::json::object();
      if (a.type == ADAPTER_LOKR) {
        j["decompose_both"] = a.decompose_both;
        j["decompose_factor"] = a.decompose_factor;
        j["rank_dropout_scale"] = false;
      }
      break;
    case ADAPTER_OFT:  // the block size given, so r = 0 (PEFT takes exactly one of the two)
      j["r"] = 0;
      j["oft_block_size"] = a.block_size;
      j["use_cayley_neumann"] = a.cayley_neumann;
      j["num_cayley_neumann_terms"] = a.neumann_terms;
      j["block_share"] = a.block_share;
      j["coft"] = false;
      j["eps"] = 6e-5;
      j["module_dropout"] = 0.0;
      j["fan_in_fan_out"] = conv1d;
      j["bias"] = "none";
      j["init_weights"] = true;
      break;
    case ADAPTER_NONE: break;
  }
  return j.dump(2) + "\n";
}

namespace {

// The folder's adapter settings against the configured ones. r and alpha must be there; an absent
// key of another setting takes PEFT 0.21.2's default (PEFT saves them all).
void check_peft_config(const std::string& path, const nlohmann::json& j, const AdapterConfig& a) {
  auto fail = [&](const std::string& what) { throw UsageError("PEFT adapter config '" + path + "': " + what); };
  auto flag = [&](const char* key) { return j.contains(key) && j[key].is_boolean() && j[key].get<bool>(); };
  auto nonempty = [&](const char* key) { return j.contains(key) && j[key].is_object() && !j[key].empty(); };
  auto text = [&](const char* key) { return j.contains(key) ? j[key].dump() : std::string("(none)"); };
  auto boolean = [&](const char* key, bool fallback) {
    if (!j.contains(key) || j[key].is_null()) return fallback;
    if (!j[key].is_boolean()) fail(std::string(key) + "=" + j[key].dump() + " is not true or false");
    return j[key].get<bool>();
  };
  auto number = [&](const char* key, double fallback) {
    if (!j.contains(key) || j[key].is_null()) return fallback;
    if (!j[key].is_number()) fail(std::string(key) + "=" + j[key].dump() + " is not a number");
    return j[key].get<double>();
  };
  auto on_off = [](bool b) { return b ? "true" : "false"; };
  if (!j.is_object() || !j.contains("peft_type") || !j["peft_type"].is_string())
    throw CheckpointError("PEFT adapter config '" + path + "': no peft_type");
  const std::string type = j["peft_type"].get<std::string>();
  if (type != peft_type_name(a.type)) {
    const char* ours = type == "LORA" ? (flag("use_dora") ? "dora" : "lora")
                       : type == "LOHA" ? "loha"
                       : type == "LOKR" ? "lokr"
                       : type == "OFT"  ? "oft"
                                        : nullptr;
    fail("peft_type " + type + " but adapter.type=" + adapter_type_name(a.type) + " (which reads " +
         peft_type_name(a.type) + " adapters); " +
         (ours ? std::string("set adapter.type=") + ours
               : std::string("ShardTrain reads LORA, LOHA, LOKR and OFT adapters alone")));
  }
  auto check_rank_alpha = [&](const char* alpha_key) {
    if (!j.contains("r") || !j["r"].is_number_integer() || j["r"].get<int>() != a.rank)
      fail("r=" + text("r") + " but adapter.rank=" + std::to_string(a.rank) + "; set adapter.rank to the adapter's");
    if (!j.contains(alpha_key) || !j[alpha_key].is_number() || j[alpha_key].get<double>() != a.alpha)
      fail(std::string(alpha_key) + "=" + text(alpha_key) + " but adapter.alpha=" + strprintf("%g", a.alpha) +
           "; set adapter.alpha to the adapter's");
    if (nonempty("rank_pattern") || nonempty("alpha_pattern"))
      fail("rank_pattern/alpha_pattern give layers their own rank or alpha, which adapter.* cannot");
  };
  switch (a.type) {
    case ADAPTER_LORA:
    case ADAPTER_DORA:
      if (flag("use_dora") != (a.type == ADAPTER_DORA))
        fail(std::string("use_dora is ") + on_off(flag("use_dora")) + " but adapter.type=" + adapter_type_name(a.type) +
             "; set adapter.type=" + (flag("use_dora") ? "dora" : "lora"));
      if (flag("use_rslora")) fail("use_rslora is true: rsLoRA's scaling alpha/sqrt(r) is not implemented");
      if (flag("lora_bias")) fail("lora_bias is true: LoRA biases are not implemented");
      check_rank_alpha("lora_alpha");
      return;
    case ADAPTER_LOHA:
    case ADAPTER_LOKR: {
      // use_effective_conv2d concerns convolutions alone; init_weights only the initial values.
      check_rank_alpha("alpha");
      for (const char* key : {"rank_dropout", "module_dropout"})
        if (number(key, 0) > 0)
          fail(std::string(key) + "=" + j[key].dump() + ": " + type + "'s " + key +
               " is not implemented; set it to 0 in the adapter's config to train or continue it without");
      if (a.type != ADAPTER_LOKR) return;
      const bool both = boolean("decompose_both", false);
      if (both != a.decompose_both)
        fail(std::string("decompose_both is ") + on_off(both) + " but adapter.decompose_both=" +
             on_off(a.decompose_both) + "; set adapter.decompose_both=" + on_off(both));
      const double factor = number("decompose_factor", -1);
      if (factor != a.decompose_factor)
        fail("decompose_factor=" + strprintf("%g", factor) + " but adapter.decompose_factor=" +
             std::to_string(a.decompose_factor) + "; set adapter.decompose_factor=" + strprintf("%g", factor));
      return;
    }
    case ADAPTER_OFT: {
      // module_dropout is saved but never applied by PEFT 0.21.2; init_weights concerns the initial values.
      if (!j.contains("oft_block_size"))
        fail("no oft_block_size: a config of PEFT before 0.14 (oft_r), which PEFT 0.21.2 refuses too; "
             "save the adapter again with a recent PEFT");
      const double r = number("r", 0), block = number("oft_block_size", 32);
      if (r != 0 && block == 0)
        fail("r=" + strprintf("%g", r) + " sets the number of OFT blocks of each layer, so their size depends on "
             "the layer, which adapter.block_size cannot express; save the adapter with oft_block_size (the "
             "block size) and r=0");
      if (r != 0)
        fail("r=" + strprintf("%g", r) + " and oft_block_size=" + strprintf("%g", block) +
             " are both set (PEFT takes exactly one); set r=0 in the adapter's config");
      if (block != a.block_size)
        fail("oft_block_size=" + strprintf("%g", block) + " but adapter.block_size=" + std::to_string(a.block_size) +
             "; set adapter.block_size=" + strprintf("%g", block));
      const bool neumann = boolean("use_cayley_neumann", true);
      if (neumann != a.cayley_neumann)
        fail(std::string("use_cayley_neumann is ") + on_off(neumann) + " but adapter.cayley_neumann=" +
             on_off(a.cayley_neumann) + "; set adapter.cayley_neumann=" + on_off(neumann));
      const double terms = number("num_cayley_neumann_terms", 5);
      if (neumann && terms != a.neumann_terms)
        fail("num_cayley_neumann_terms=" + strprintf("%g", terms) + " but adapter.neumann_terms=" +
             std::to_string(a.neumann_terms) + "; set adapter.neumann_terms=" + strprintf("%g", terms));
      const bool share = boolean("block_share", false);
      if (share != a.block_share)
        fail(std::string("block_share is ") + on_off(share) + " but adapter.block_share=" + on_off(a.block_share) +
             "; set adapter.block_share=" + on_off(share));
      if (boolean("coft", false))
        fail("coft is true: constrained OFT (each rotation's parameters projected onto a ball of radius eps) is "
             "not implemented");
      return;
    }
    case ADAPTER_NONE: return;
  }
}

}  // namespace

void init_dora_magnitudes(FsdpEngine& engine, Comm& world) {
  const ParamTable& table = engine.table();
  if (table.adapter().type != ADAPTER_DORA) return;
  for (int l = 0; l < table.block_count(); l++) {
    const int u = block_unit(l);
    const std::vector<LinearSite>& sites = table.block_sites(l);
    UnitShard& s = engine.shards()[u];
    HostShard values = engine.host_shard(u);
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
        const double x = values.data()[owned.index + (e - owned.range.begin)];
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
        values.data()[local.index + (o - local.range.begin)] =
            static_cast<float>(std::sqrt(squares[first_row[k] + o - m.offset]));
    }
    values.upload(false);  // the magnitudes changed, not the base
  }
}

namespace {

// diffusers' LoRA file against the configured adapters: LoRA (not DoRA), and the rank and alpha of
// its lora_adapter_metadata -- or, in a file without it (older diffusers, other trainers), the rank
// of its tensors and alpha = rank, which is what diffusers' loader then assumes.
void check_diffusers_lora(const std::string& path, const SafetensorsReader& reader, const std::vector<PeftTensor>& wanted,
                          const AdapterConfig& a) {
  auto fail = [&](const std::string& what) { throw UsageError("diffusers LoRA file '" + path + "': " + what); };
  if (a.type != ADAPTER_LORA)
    fail(std::string("adapter.type=") + adapter_type_name(a.type) + ": diffusers' LoRA files hold LoRA; set "
         "adapter.type=lora");
  double rank = 0, alpha = 0;
  const auto meta = reader.metadata().find("lora_adapter_metadata");
  if (meta != reader.metadata().end()) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(meta->second);
    } catch (const nlohmann::json::exception&) {
      fail("its lora_adapter_metadata is not JSON; the file is damaged");
    }
    auto number = [&](const char* key) {
      if (!j.contains(key) || !j[key].is_number()) fail(std::string("lora_adapter_metadata has no number ") + key);
      return j[key].get<double>();
    };
    rank = number("transformer.r"), alpha = number("transformer.lora_alpha");
    if (j.contains("transformer.use_dora") && j["transformer.use_dora"].is_boolean() && j["transformer.use_dora"])
      fail("it holds DoRA adapters (use_dora true); set adapter.type=dora (not read from this layout yet)");
  } else {
    const SafetensorsTensor* first = wanted.empty() ? nullptr : reader.find(wanted.front().name);
    rank = first && !first->shape.empty() ? static_cast<double>(first->shape[0]) : 0;
    alpha = rank;
  }
  if (rank != a.rank || alpha != a.alpha)
    fail(strprintf("rank %g and alpha %g; the configuration says adapter.rank=%d, adapter.alpha=%g: set them to the "
                   "file's",
                   rank, alpha, a.rank, a.alpha));
}

// Each of this rank's adapter parameter elements from read(param, first element, count, dst),
// checked finite (label names the file in the message).
template <typename Read>
void fill_adapter_shards(FsdpEngine& engine, const std::string& label, Read read) {
  const ParamTable& table = engine.table();
  for (UnitShard& s : engine.shards()) {
    const int u = static_cast<int>(&s - engine.shards().data());
    HostShard values = engine.host_shard(u);  // the base stays
    bool any = false;
    for (int id : table.units()[u].params) {
      const ParamInfo& p = table.params()[id];
      const UnitLayout::Local local = s.layout.local_part(p.range());
      if (!p.adapter || local.range.empty()) continue;
      float* slice = values.data() + local.index;
      const size_t count = local.range.size();
      read(p, local.range.begin - p.offset, count, slice);
      for (size_t i = 0; i < count; i++)
        if (!std::isfinite(slice[i]))
          throw CheckpointError(label + ": tensor of " + p.name + " holds " + strprintf("%g", slice[i]) +
                                ": the file is damaged; use another adapter");
      any = true;
    }
    if (any) values.upload(false);  // the adapters changed, not the base
  }
}

// kohya-ss's LoRA files (sd-scripts, ai-toolkit; what ComfyUI loads): the modules of the model's
// single-file layout (ModelFamily::single_file_tensor: FLUX.1's Black Forest Labs names), each
// adapted one as "lora_unet_<its name, '_' for '.'>" with ".lora_down.weight" (rank, in),
// ".lora_up.weight" (rows, rank) and ".alpha" (a scalar; absent: the rank), adding
// (alpha / rank) up down to the module's weight. A fused module (FLUX's qkv, a single block's
// linear1) has one down for its parts and their ups stacked: each of our layers in it takes the
// down as its lora_A and its rows of up as its lora_B, times the file's alpha / rank over the
// configuration's adapter.alpha / adapter.rank -- so that our B A (alpha / rank) is the file's
// update exactly, rows for rows.
void load_kohya_lora(const std::string& path, const SafetensorsReader& reader, FsdpEngine& engine) {
  const ParamTable& table = engine.table();
  const ModelConfig& config = table.config();
  const ModelFamily& family = family_of(config);
  const AdapterConfig& a = table.adapter();
  const std::string label = "kohya LoRA file '" + path + "'";
  if (!family.single_file_layout())
    throw UsageError(label + ": kohya's names are those of a model's single-file layout, which model.arch=" +
                     config.arch + " has none of; use a PEFT or diffusers adapter");
  if (a.type != ADAPTER_LORA)
    throw UsageError(label + ": adapter.type=" + adapter_type_name(a.type) + ", but the file holds LoRA; set "
                     "adapter.type=lora");
  // Our adapted layers by the file's module: lora_A's and lora_B's ids and the layer's rows of it.
  struct Layer {
    int lora_a, lora_b;
    std::pair<int64_t, int64_t> rows;  // first row, rows
  };
  struct Module {
    std::vector<Layer> layers;
    int64_t rows = 0, in = 0;
  };
  std::map<std::string, Module> modules;
  table.for_each_adapted_site([&](int l, const LinearSite& site, int first) {
    const UnitInfo& unit = table.units()[block_unit(l)];
    const HfTensor t = family.single_file_tensor(config, table.param(block_unit(l), site.weight));
    if (t.rows.size() > 1)  // a layer stored in several pieces (swapped halves) has no kohya module of its own
      throw UsageError(label + ": " + site.module + " is stored in pieces in " + family.single_file_layout() +
                       "'s layout, which kohya's files do not adapt; remove it from adapter.targets");
    std::string name = "lora_unet_" + t.name.substr(0, t.name.size() - std::string(".weight").size());
    std::replace(name.begin() + 10, name.end(), '.', '_');
    Module& m = modules[name];
    m.rows = t.shape[0], m.in = t.shape[1];
    m.layers.push_back({unit.params[first], unit.params[first + 1],
                        t.rows.empty() ? std::make_pair(int64_t{0}, t.shape[0]) : t.rows.front()});
  });
  struct Source {
    const SafetensorsTensor* tensor = nullptr;
    int64_t first_row = 0;
    float scale = 1;
  };
  std::vector<Source> sources(table.params().size());
  std::set<std::string> used;
  for (const auto& [name, m] : modules) {
    const SafetensorsTensor* down = reader.find(name + ".lora_down.weight");
    const SafetensorsTensor* up = reader.find(name + ".lora_up.weight");
    const SafetensorsTensor* alpha = reader.find(name + ".alpha");
    if (!down || !up)
      throw CheckpointError(label + ": no '" + name + ".lora_down.weight' and '.lora_up.weight' (adapter.targets "
                            "adapts a layer the file does not)");
    const int64_t rank = down->shape.size() == 2 ? down->shape[0] : -1;
    if (down->shape != std::vector<int64_t>{rank, m.in} || up->shape != std::vector<int64_t>{m.rows, rank})
      throw CheckpointError(label + ": '" + name + "' has another shape than the configured model's layer");
    if (rank != a.rank)
      throw UsageError(strprintf("%s: '%s' has rank %lld; the configuration says adapter.rank=%d: set it to the file's",
                                 label.c_str(), name.c_str(), static_cast<long long>(rank), a.rank));
    int64_t covered = 0;
    for (const Layer& layer : m.layers) covered += layer.rows.second;
    if (covered != m.rows)
      throw UsageError(label + ": '" + name + "' adapts a fused layer (q, k, v, and a single block's MLP in) of "
                       "which adapter.targets has only some: target all of its parts");
    float file_alpha = static_cast<float>(rank);
    if (alpha) {
      if (alpha->numel != 1) throw CheckpointError(label + ": '" + name + ".alpha' is not one number");
      reader.read_fp32(*alpha, 0, 1, &file_alpha);
    }
    const float scale = static_cast<float>((double(file_alpha) / rank) / a.scaling());
    for (const Layer& layer : m.layers) {
      sources[layer.lora_a] = {down, 0, 1.0f};
      sources[layer.lora_b] = {up, layer.rows.first, scale};
    }
    used.insert({name + ".lora_down.weight", name + ".lora_up.weight", name + ".alpha"});
  }
  for (const SafetensorsTensor& t : reader.tensors())
    if (!used.count(t.name))
      throw CheckpointError(label + ": tensor '" + printable_text(t.name) + "' is not one the configured adapters have (" +
                            (t.name.rfind("lora_te", 0) == 0 ? "it adapts a text encoder, which this run does not train"
                                                             : "adapter.targets adapts fewer layers?") +
                            ")");
  fill_adapter_shards(engine, label, [&](const ParamInfo& p, size_t first, size_t count, float* dst) {
    const Source& s = sources[p.id];
    const size_t cols = p.numel / p.shape[0];
    reader.read_fp32(*s.tensor, s.first_row * cols + first, count, dst);
    if (s.scale != 1.0f)
      for (size_t i = 0; i < count; i++) dst[i] *= s.scale;
  });
}

}  // namespace

void load_peft_adapter(const std::string& source, FsdpEngine& engine) {
  const ParamTable& table = engine.table();
  const bool peft = family_of(table.config()).peft_folder();
  std::string weights;
  if (peft) {
    const std::string config_path = source + "/adapter_config.json";
    check_peft_config(config_path, read_json(config_path, "PEFT adapter config"), table.adapter());
    weights = source + "/adapter_model.safetensors";
  } else {  // diffusers: the folder save_lora_weights wrote, or the file itself
    std::error_code ec;
    weights = std::filesystem::is_directory(source, ec) ? source + "/pytorch_lora_weights.safetensors" : source;
  }
  const std::string label = (peft ? "PEFT adapter '" : "diffusers LoRA file '") + weights + "'";
  const SafetensorsReader reader(weights);
  if (!peft && std::any_of(reader.tensors().begin(), reader.tensors().end(),
                           [](const SafetensorsTensor& t) { return t.name.rfind("lora_unet_", 0) == 0; })) {
    load_kohya_lora(weights, reader, engine);
    return;
  }
  const std::vector<PeftTensor> wanted = peft_tensors(table, peft ? "base_model.model." : "transformer.");
  if (!peft) check_diffusers_lora(weights, reader, wanted, table.adapter());
  std::vector<const SafetensorsTensor*> sources(table.params().size(), nullptr);
  std::set<std::string> used;
  for (const PeftTensor& w : wanted) {
    const ParamInfo& p = table.params()[w.id];
    const SafetensorsTensor* t = reader.find(w.name);
    if (!t)
      throw CheckpointError(label + ": tensor '" + w.name +
                            "' is missing (adapter.targets adapts a layer the adapter does not)");
    if (t->shape != std::vector<int64_t>(p.shape.begin(), p.shape.end()))
      throw CheckpointError(label + ": tensor '" + w.name + "' has another shape than the configured model's");
    sources[w.id] = t;
    used.insert(w.name);
  }
  for (const SafetensorsTensor& t : reader.tensors())
    if (!used.count(t.name))
      throw CheckpointError(label + ": tensor '" + printable_text(t.name) +
                            "' is not one the configured adapters have (adapter.targets adapts fewer layers?)");
  fill_adapter_shards(engine, label, [&](const ParamInfo& p, size_t first, size_t count, float* dst) {
    reader.read_fp32(*sources[p.id], first, count, dst);
  });
}

}  // namespace shardtrain
