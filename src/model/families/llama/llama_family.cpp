// The Llama family's descriptor (llama_family.hpp). Our names are Hugging Face's less the "model."
// prefix (optional in files, as in a LlamaModel's own save), nn.Linear (out, in) as ours, nothing
// transposed; lm_head.weight is never prefixed, present when untied (ignored when tied). The rotary
// inv_freq buffers of older files are ignored.
#include "model/families/llama/llama_family.hpp"

#include <algorithm>
#include <cmath>
#include <map>

#include "core/error.hpp"
#include "model/families/llama/llama_model.hpp"
#include "model/param_table.hpp"
#include "model/rope_scaling.hpp"

namespace shardtrain {
namespace {

// config.json's rope_scaling and rope_parameters (either, or both saying the same -- transformers 4
// and 5 read them differently): the plain rotary embedding (rope_type default), linear, llama3 or
// yarn, in model.rope_scaling's text form; a rope_theta inside sets *theta. Every other type or key
// is refused, naming it.
std::string read_rope_scaling(const HfConfig& j, double* theta) {
  std::string found;
  const char* found_in = nullptr;
  double found_theta = 0;  // a rope_theta inside the dict read first, or 0
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    const nlohmann::json& rope = j[key];
    if (rope.is_null()) continue;
    const std::string where = std::string(key) + " " + rope.dump();
    if (!rope.is_object()) j.fail(where + " is not a JSON object or null");
    const nlohmann::json type_value =
        rope.contains("rope_type") ? rope["rope_type"] : rope.value("type", nlohmann::json("default"));
    if (rope.contains("rope_type") && rope.contains("type") && rope["type"] != rope["rope_type"])
      j.fail(where + ": its type and rope_type differ; give one");
    const std::string type = type_value.is_string() ? type_value.get<std::string>() : type_value.dump();
    if (type != "default" && !RopeScaling::settings_of(type))
      j.fail(where + ": rope_type '" + type + "' is not implemented; ShardTrain's rotary embeddings are the plain "
                     "one (default), linear, dynamic, llama3 and yarn");
    std::map<std::string, double> given;
    bool yarn_factor_from_lengths = false;
    for (const auto& item : rope.items()) {
      const std::string& name = item.key();
      if (name == "rope_type" || name == "type") continue;
      if (name != "rope_theta" && !RopeScaling::reads(type, name))
        j.fail(where + ": '" + name + "' is not implemented for rope_type " + type + " (ShardTrain reads " +
               (type == "default" ? std::string("rope_theta") : "rope_theta and its settings") + ")");
      const nlohmann::json& v = item.value();
      if (type == "yarn" && v.is_null() && name != "original_max_position_embeddings") {
        // transformers: a null setting takes its default, but truncate's None (falsy) truncates
        // nothing and factor's is max_position_embeddings / original_max_position_embeddings.
        if (name == "truncate") given[name] = 0;
        if (name == "factor") yarn_factor_from_lengths = true;
        continue;
      }
      if (name == "truncate" && (v.is_boolean() || v == 0 || v == 1)) {  // yarn's
        given[name] = v.is_boolean() ? (v.get<bool>() ? 1 : 0) : v.get<double>();
        continue;
      }
      if (!v.is_number() || !(v.get<double>() > 0))
        j.fail(std::string(key) + "." + name + " " + v.dump() + " is not a positive number");
      const double value = v.get<double>();
      if (name != "rope_theta") {
        given[name] = value;
        continue;
      }
      if (found_in && found_theta != 0 && value != found_theta)
        j.fail(std::string(found_in) + " and " + key + " disagree on rope_theta; give one");
      *theta = found_theta = value;
    }
    if (yarn_factor_from_lengths && given.count("original_max_position_embeddings"))
      given["factor"] = j.whole("max_position_embeddings") / given["original_max_position_embeddings"];
    RopeScaling scaling;
    std::string defect;
    if (type != "default" && !RopeScaling::from_settings(type, given, &scaling, &defect)) j.fail(where + ": " + defect);
    if (found_in && scaling.text() != found)
      j.fail(std::string(found_in) + " and " + key + " disagree; give one");
    found = scaling.text(), found_in = key;
  }
  return found;
}

// The text form as config.json's rope_scaling (null for none), as transformers 4 writes it.
nlohmann::ordered_json rope_scaling_json(const std::string& text) {
  RopeScaling s;
  std::string defect;
  SHARD_CHECK(RopeScaling::parse(text, &s, &defect), "%s", defect.c_str());
  if (s.type == RopeScaling::NONE) return nullptr;
  nlohmann::ordered_json j;
  j["rope_type"] = s.type_name();
  for (const auto& [name, value] : s.settings())  // an integer or a bool where transformers has one
    if (name == "original_max_position_embeddings")
      j[name] = static_cast<int64_t>(value);
    else if (name == "truncate")
      j[name] = value != 0;
    else
      j[name] = value;
  return j;
}

}  // namespace

std::string LlamaFamily::summary(const ModelConfig& c) const {
  return strprintf("%s L=%d C=%d H=%d KV=%d MLP=%d V=%d max_seq_len=%d rope_theta=%g norm_eps=%g %s%s%s%s%s%s%s",
                   display_name(), c.n_layer, c.n_embd, c.n_head, c.kv_heads(), c.mlp_size(), c.vocab_size,
                   c.max_seq_len, c.rope_theta, c.norm_eps, c.tie_embeddings ? "tied" : "untied",
                   c.head_dim > 0 ? strprintf(" head_dim=%d", c.head_dim).c_str() : "",
                   c.rope_scaling.empty() ? "" : " rope_scaling=", c.rope_scaling.c_str(),
                   c.nope_layers.empty() ? "" : " nope_layers=", c.nope_layers.c_str(),
                   c.sliding_window > 0 ? strprintf(" sliding_window=%d", c.sliding_window).c_str() : "");
}

std::vector<std::string> LlamaFamily::config_keys() const {
  return {"model.n_kv_head", "model.intermediate_size", "model.head_dim", "model.rope_theta", "model.rope_scaling",
          "model.norm_eps", "model.tie_embeddings", "model.sliding_window"};
}

std::string LlamaFamily::config_defect(const ModelConfig& m) const {
  if (m.n_kv_head < 0 || m.n_kv_head > m.n_head || m.n_head % m.kv_heads())
    return strprintf("model.n_kv_head=%d must divide model.n_head=%d (0 = model.n_head)", m.n_kv_head, m.n_head);
  if (m.head_dim < 0 || m.head_dim > (1 << 16))
    return strprintf("model.head_dim=%d is not in [0, 65536] (0 = model.n_embd / model.n_head)", m.head_dim);
  if (m.head_size() % 2)
    return strprintf("the head size (model.head_dim, or model.n_embd / model.n_head) = %d must be even: rotary "
                     "embeddings turn pairs of dimensions", m.head_size());
  // In 64 bits before any int product of them (attn_size, qkv_size) is formed.
  if (static_cast<int64_t>(m.n_head) * m.head_size() > (1 << 24))
    return strprintf("model.n_head x the head size = %lld is above 2^24", static_cast<long long>(m.n_head) * m.head_size());
  if (m.intermediate_size < 0 || m.intermediate_size > (1 << 24) ||
      static_cast<double>(m.n_layer) * 3 * m.n_embd * m.mlp_size() > 1e13)
    return strprintf("model.intermediate_size=%d is not in [0, 2^24] (0 = 4 x model.n_embd) or makes more than 10^13 "
                     "parameters", m.intermediate_size);
  const double C = m.n_embd, attention = (static_cast<double>(m.attn_size()) + m.kv_heads() * m.head_size()) * 2 * C;
  if (m.n_layer * (attention + 3 * C * m.mlp_size()) + 2.0 * m.vocab_size * C > 1e13)
    return "model.head_dim, model.intermediate_size and the width make more than 10^13 parameters";
  if (!(m.rope_theta > 0) || !std::isfinite(m.rope_theta)) return strprintf("model.rope_theta=%g must be > 0", m.rope_theta);
  RopeScaling scaling;
  std::string defect;
  if (!RopeScaling::parse(m.rope_scaling, &scaling, &defect)) return defect;
  std::vector<bool> nope;
  if (!parse_nope_layers(m.nope_layers, m.n_layer, &nope, &defect)) return defect;
  if (!(m.norm_eps > 0) || !std::isfinite(m.norm_eps)) return strprintf("model.norm_eps=%g must be > 0", m.norm_eps);
  if (m.sliding_window < 0 || m.sliding_window > (1 << 24))
    return strprintf("model.sliding_window=%d is not in [0, 2^24] (0 = every earlier position)", m.sliding_window);
  return "";
}

void LlamaFamily::add_params(ParamTable& t) const {
  const ModelConfig& c = t.config();
  const int C = c.n_embd, A = c.attn_size(), KV = c.kv_heads() * c.head_size(), I = c.mlp_size();
  // Order must match enum LlamaRootParam.
  t.add_param(ROOT_UNIT, "embed_tokens.weight", {c.vocab_size, C}, INIT_NORMAL, true);
  t.add_param(ROOT_UNIT, "norm.weight", {C}, INIT_ONES, false);
  if (!c.tie_embeddings) t.add_param(ROOT_UNIT, "lm_head.weight", {c.vocab_size, C}, INIT_NORMAL, true);
  for (int l = 0; l < c.n_layer; l++) {
    const std::string h = "layers." + std::to_string(l);
    const int u = t.add_unit(h);
    // Order must match enum LlamaBlockParam.
    t.add_param(u, h + ".input_layernorm.weight", {C}, INIT_ONES, false);
    t.add_param(u, h + ".self_attn.q_proj.weight", {A, C}, INIT_NORMAL, true);
    t.add_param(u, h + ".self_attn.k_proj.weight", {KV, C}, INIT_NORMAL, true);
    t.add_param(u, h + ".self_attn.v_proj.weight", {KV, C}, INIT_NORMAL, true);
    t.add_param(u, h + ".self_attn.o_proj.weight", {C, A}, INIT_NORMAL_RESIDUAL, true);
    t.add_param(u, h + ".post_attention_layernorm.weight", {C}, INIT_ONES, false);
    t.add_param(u, h + ".mlp.gate_proj.weight", {I, C}, INIT_NORMAL, true);
    t.add_param(u, h + ".mlp.up_proj.weight", {I, C}, INIT_NORMAL, true);
    t.add_param(u, h + ".mlp.down_proj.weight", {C, I}, INIT_NORMAL_RESIDUAL, true);
    if (variant().qkv_bias) {
      t.add_param(u, h + ".self_attn.q_proj.bias", {A}, INIT_ZEROS, false);
      t.add_param(u, h + ".self_attn.k_proj.bias", {KV}, INIT_ZEROS, false);
      t.add_param(u, h + ".self_attn.v_proj.bias", {KV}, INIT_ZEROS, false);
    }
    if (variant().qk_norm) {
      t.add_param(u, h + ".self_attn.q_norm.weight", {c.head_size()}, INIT_ONES, false);
      t.add_param(u, h + ".self_attn.k_norm.weight", {c.head_size()}, INIT_ONES, false);
    }
  }
}

std::vector<ModelFamily::FusedGroup> LlamaFamily::fused_groups(const ModelConfig&, const std::string&) const {
  std::vector<FusedGroup> groups = {{{LLAMA_Q_W, LLAMA_K_W, LLAMA_V_W}, "q_proj|k_proj|v_proj"},
                                    {{LLAMA_GATE_W, LLAMA_UP_W}, "gate_proj|up_proj"}};
  if (variant().qkv_bias) groups.push_back({{LLAMA_Q_B, LLAMA_K_B, LLAMA_V_B}, "q_proj|k_proj|v_proj biases"});
  return groups;
}

// 6 x (parameters outside the embedding table, + V x C for a tied head) + 12 L T A for attention's
// scores and weighted sums (A = n_head x head size; T the keys a query spans, counted whole as
// llm.c does: the window's W where a sliding window is shorter). The q/k norms' gains apply once
// per head: (n_head + KV) x head size per token where the parameters count 2 x head size.
double LlamaFamily::flops_per_token(const ParamTable& t, int seq_len) const {
  const ModelConfig& c = t.config();
  const double embedding = static_cast<double>(c.vocab_size) * c.n_embd;
  double applied = static_cast<double>(t.total_params()) - embedding + (c.tie_embeddings ? embedding : 0);
  if (variant().qk_norm) applied += static_cast<double>(c.n_layer) * (c.n_head + c.kv_heads() - 2) * c.head_size();
  const int span = c.window_within(seq_len) ? c.sliding_window : seq_len;
  return 6.0 * applied + 12.0 * c.n_layer * span * c.attn_size();
}

std::unique_ptr<TransformerModel<float>> LlamaFamily::make_model(const ParamTable& table, int batch, int seq_len,
                                                                 Checkpointing ckpt, const LayerOps<float>& ops,
                                                                 DType act) const {
  return std::make_unique<LlamaModel<float>>(table, batch, seq_len, ckpt, ops, act, variant());
}
std::unique_ptr<TransformerModel<double>> LlamaFamily::make_model(const ParamTable& table, int batch, int seq_len,
                                                                  Checkpointing ckpt, const LayerOps<double>& ops,
                                                                  DType act) const {
  return std::make_unique<LlamaModel<double>>(table, batch, seq_len, ckpt, ops, act, variant());
}

// LlamaModel's constructor's arrays, in its order.
std::vector<size_t> LlamaFamily::activation_arrays(const ModelConfig& c, int batch, int seq_len,
                                                   Checkpointing checkpointing, DType /*in SavedActivations*/) const {
  const size_t BT = static_cast<size_t>(batch) * seq_len, C = c.n_embd, NH = c.n_head, V = c.vocab_size;
  const size_t QKV = c.qkv_size(), I = c.mlp_size(), rope = static_cast<size_t>(seq_len) * (c.head_size() / 2);
  const size_t dln = BT * std::max(C, static_cast<size_t>(c.attn_size()));  // also the attention output's gradient
  std::vector<size_t> a = {rope, rope};  // the rotary cos and sin tables
  a.insert(a.end(), c.n_layer + 1, BT * C);  // the residual stream
  const bool qk_norm = variant().qk_norm;
  for (int l = 0; l < checkpointing.run(0, c.n_layer).sets(); l++) {  // ln1's rstd, lse, resid2, ln2's rstd
    a.insert(a.end(), {BT, BT * NH, BT * C, BT});
    if (qk_norm) a.insert(a.end(), {BT * NH, BT * c.kv_heads()});  // the q and k norms' rstd
  }
  a.insert(a.end(), {BT * C, BT, BT * V, BT});                            // lnf, its rstd, probs, losses
  a.insert(a.end(), {BT * C, dln, BT * QKV, BT * 2 * I, BT * I});  // dresid, dln, dqkv, dgate_up, dact
  if (qk_norm)  // the q|k norms' scratch and their input gradient
    a.insert(a.end(), 2, BT * (c.attn_size() + c.kv_heads() * c.head_size()));
  return a;
}

std::vector<size_t> LlamaFamily::saved_tensor_elements(const ModelConfig& c, int batch, int seq_len) const {
  return LlamaModel<float>::saved_tensor_elements(c, variant(), batch, seq_len);
}

size_t LlamaFamily::plan_decode_elements(const ModelConfig& c, int max_len, int max_chunk) const {
  return LlamaModel<float>::plan_decode_elements(c, variant(), max_len, max_chunk);
}

std::vector<LinearShape> LlamaFamily::gemm_shapes(const ModelConfig& c) const {
  const int C = c.n_embd, I = c.mlp_size();
  return {{C, c.qkv_size()}, {c.attn_size(), C}, {C, 2 * I}, {I, C}, {C, c.vocab_size}};  // gate|up fused
}

std::vector<LinearSite> LlamaFamily::linear_sites(const ModelConfig& c, const std::string&) const {
  const int C = c.n_embd, A = c.attn_size(), KV = c.kv_heads() * c.head_size(), QKV = c.qkv_size();
  const int I = c.mlp_size();
  const bool b = variant().qkv_bias;
  return {{"self_attn.q_proj", LLAMA_Q_W, b ? LLAMA_Q_B : -1, PRODUCT_QKV, C, A, 0, QKV},
          {"self_attn.k_proj", LLAMA_K_W, b ? LLAMA_K_B : -1, PRODUCT_QKV, C, KV, A, QKV},
          {"self_attn.v_proj", LLAMA_V_W, b ? LLAMA_V_B : -1, PRODUCT_QKV, C, KV, A + KV, QKV},
          {"self_attn.o_proj", LLAMA_O_W, -1, PRODUCT_ATTN_OUT, A, C, 0, C},
          {"mlp.gate_proj", LLAMA_GATE_W, -1, PRODUCT_MLP_UP, C, I, 0, 2 * I},
          {"mlp.up_proj", LLAMA_UP_W, -1, PRODUCT_MLP_UP, C, I, I, 2 * I},
          {"mlp.down_proj", LLAMA_DOWN_W, -1, PRODUCT_MLP_DOWN, I, C, 0, C}};
}

std::string LlamaFamily::module_path(const ModelConfig&, int layer, const LinearSite& site) const {
  return "model.layers." + std::to_string(layer) + "." + site.module;
}

ModelConfig LlamaFamily::read_decoder_config(const HfConfig& j, const ModelConfig& defaults) const {
  ModelConfig m;
  m.arch = name();
  m.n_layer = j.whole("num_hidden_layers");
  m.n_embd = j.whole("hidden_size");
  m.n_head = j.whole("num_attention_heads");
  // Null means "as many as the query heads"; an absent key the family's default.
  m.n_kv_head = defaults.n_kv_head && !j.present("num_key_value_heads") ? defaults.n_kv_head
                                                                         : j.whole("num_key_value_heads", m.n_head);
  m.intermediate_size = j.whole("intermediate_size");
  m.vocab_size = j.whole("vocab_size");
  m.max_seq_len = j.whole("max_position_embeddings", defaults.max_seq_len);
  m.rope_theta = j.positive("rope_theta", defaults.rope_theta);  // transformers' default_theta
  m.norm_eps = j.positive("rms_norm_eps", 1e-6);
  m.tie_embeddings = j.flag("tie_word_embeddings", defaults.tie_embeddings);
  // The rotary settings may also come as transformers 5's rope_parameters (with rope_theta inside).
  m.rope_scaling = read_rope_scaling(j, &m.rope_theta);
  const std::string act = j.text("hidden_act", "silu");
  if (act != "silu" && act != "swish")
    j.fail("hidden_act '" + act + "' is not implemented; ShardTrain's " + display_name() + " MLP uses silu");
  if (m.n_embd % m.n_head != 0) j.fail("hidden_size is not a multiple of num_attention_heads");
  // A head size of its own (Mistral-Nemo's 128 on 5120 / 32); the usual one is kept as 0.
  if (j.has("head_dim"))
    m.head_dim = j.whole("head_dim");
  else if (!j.present("head_dim"))
    m.head_dim = defaults.head_dim;  // Qwen3Config's 128
  canonicalize(m);
  if (m.head_size() % 2 != 0)
    j.fail(strprintf("the head size %d (head_dim, or hidden_size / num_attention_heads) is odd; rotary embeddings "
                     "turn pairs of dimensions", m.head_size()));
  if (m.n_head % m.n_kv_head != 0) j.fail("num_attention_heads is not a multiple of num_key_value_heads");
  return m;
}

// Qwen2Config and Qwen3Config slide the window (sliding_window, 4096 when absent) only with
// use_sliding_window, and only over the layers layer_types marks "sliding_attention" (without
// layer_types: from max_window_layers, 28 when absent, on; null there is transformers' TypeError).
int LlamaFamily::read_qwen_sliding_window(const HfConfig& j, const ModelConfig& m) {
  if (!j.flag("use_sliding_window", false)) return 0;
  const int window = !j.present("sliding_window") ? 4096 : j.has("sliding_window") ? j.whole("sliding_window") : 0;
  if (window <= 0) return 0;
  const nlohmann::json& types = j["layer_types"];
  int sliding = 0;
  if (types.is_array()) {
    for (const nlohmann::json& type : types) sliding += type == "sliding_attention";
  } else {
    const bool absent = !j.present("max_window_layers");
    const nlohmann::json& first = j["max_window_layers"];
    if (!absent && !(first.is_number_integer() && first.get<int64_t>() >= 0))
      j.fail("max_window_layers " + first.dump() + " is not a whole number >= 0 (the first layer of the window)");
    sliding = static_cast<int>(std::max<int64_t>(0, m.n_layer - (absent ? 28 : first.get<int64_t>())));
  }
  return sliding_window_over(j, m, window, sliding);
}

int LlamaFamily::sliding_window_over(const HfConfig& j, const ModelConfig& m, int window, int sliding) {
  if (sliding == 0 || window <= 0 || window >= m.max_seq_len) return 0;  // none that any sequence reaches
  if (sliding == m.n_layer) return window;
  j.fail(strprintf("a sliding window of %d positions on %d of the %d layers (the others seeing every earlier "
                   "position) is not implemented; ShardTrain slides its window over every layer or none "
                   "(use_sliding_window false, or a window on every layer, is read)",
                   window, sliding, m.n_layer));
}

void LlamaFamily::write_qwen_sliding_window(const ModelConfig& m, nlohmann::ordered_json& j) {
  const bool slides = m.sliding_window > 0;
  j["use_sliding_window"] = slides;
  j["sliding_window"] = slides ? nlohmann::ordered_json(m.sliding_window) : nlohmann::ordered_json(nullptr);
  j["max_window_layers"] = slides ? 0 : m.n_layer;
  if (slides) j["layer_types"] = std::vector<std::string>(m.n_layer, "sliding_attention");
}

// LlamaConfig's keys, absent ones taking its defaults (MistralConfig's for a mistral folder).
ModelConfig LlamaFamily::read_hf_config(const HfConfig& j) const {
  const bool mistral = j.text("model_type", "") == "mistral";
  ModelConfig defaults;
  defaults.n_kv_head = mistral ? 8 : 0;  // MistralConfig's default when the key is absent
  defaults.max_seq_len = mistral ? 4096 * 32 : 2048;
  defaults.tie_embeddings = false;
  ModelConfig m = read_decoder_config(j, defaults);
  for (const char* key : {"attention_bias", "mlp_bias"})
    if (j.flag(key, false)) j.fail(std::string(key) + " true is not implemented; ShardTrain's Llama has no biases");
  // Mistral's window: each query sees itself and the sliding_window - 1 positions before it.
  if (mistral) {
    const bool absent = !j.present("sliding_window");  // MistralConfig's default is 4096
    m.sliding_window = absent ? 4096 : j.has("sliding_window") ? j.whole("sliding_window") : 0;
    canonicalize(m);
  }
  return m;
}

void LlamaFamily::write_decoder_config(const ModelConfig& m, const char* model_type, nlohmann::ordered_json& j) const {
  j["architectures"] = {hf_class_of(m)};
  j["model_type"] = model_type;
  j["hidden_size"] = m.n_embd;
  j["intermediate_size"] = m.mlp_size();
  j["num_hidden_layers"] = m.n_layer;
  j["num_attention_heads"] = m.n_head;
  j["num_key_value_heads"] = m.kv_heads();
  if (m.head_dim > 0) j["head_dim"] = m.head_dim;
  j["vocab_size"] = m.vocab_size;
  j["max_position_embeddings"] = m.max_seq_len;
  j["hidden_act"] = "silu";
  j["rms_norm_eps"] = m.norm_eps;
  j["rope_theta"] = m.rope_theta;
  j["rope_scaling"] = rope_scaling_json(m.rope_scaling);
  j["attention_dropout"] = 0.0;
  j["tie_word_embeddings"] = m.tie_embeddings;
  // The token ids are not known to a checkpoint: null, rather than absent, which the config classes
  // would read as their own defaults.
  j["bos_token_id"] = nullptr;
  j["eos_token_id"] = nullptr;
  j["initializer_range"] = 0.02;
  j["use_cache"] = true;
}

// LlamaForCausalLM as transformers 4 writes it.
// LlamaConfig has no window: a Llama with one is Mistral's (the families built on Llama write
// their own configs and keep their classes).
const char* LlamaFamily::hf_class_of(const ModelConfig& m) const {
  return m.sliding_window > 0 && m.arch == "llama" ? "MistralForCausalLM" : hf_class();
}

void LlamaFamily::write_hf_config(const ModelConfig& m, nlohmann::ordered_json& j) const {
  const bool mistral = m.sliding_window > 0;
  write_decoder_config(m, mistral ? "mistral" : "llama", j);
  if (mistral) j["sliding_window"] = m.sliding_window;
  j["head_dim"] = m.head_size();
  j["attention_bias"] = false;
  j["mlp_bias"] = false;
  j["pretraining_tp"] = 1;
}

HfTensor LlamaFamily::hf_tensor(const ModelConfig&, const ParamInfo& p) const {
  HfTensor t;  // Hugging Face's names less the prefix, nn.Linear's (out, in) as ours
  for (int d : p.shape) t.shape.push_back(d);
  t.name = p.name == "lm_head.weight" ? p.name : hf_prefix() + p.name;
  return t;
}

// A tied model's lm_head.weight (an untied model's is a parameter, so never left over) and the
// rotary inv_freq buffers of older files.
bool LlamaFamily::hf_ignorable(const std::string& key) const {
  const std::string buffer = ".self_attn.rotary_emb.inv_freq";
  return key == "lm_head.weight" ||
         (key.size() >= buffer.size() && key.compare(key.size() - buffer.size(), buffer.size(), buffer) == 0);
}

const ModelFamily& llama_family() {
  static const LlamaFamily family;
  return family;
}

}  // namespace shardtrain
