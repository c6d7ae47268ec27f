// The Phi-3 family's descriptor (phi3_family.hpp): what differs from Llama's -- the fused tensors of
// its files, the names and Phi3Config's keys and defaults.
#include "model/families/phi3/phi3_family.hpp"

#include "core/error.hpp"
#include "model/families/llama/llama_family.hpp"

namespace shardtrain {
namespace {

class Phi3Family final : public LlamaFamily {
 public:
  const char* name() const override { return "phi3"; }
  const char* description() const override { return "Phi-3/Phi-4 (Llama with fused qkv and gate_up tensors)"; }
  const char* hf_class() const override { return "Phi3ForCausalLM"; }
  bool reads_model_type(const std::string& type) const override { return type == "phi3"; }
  // bitsandbytes quantizes the fused tensors whole, which our per-projection layers cannot read.
  bool hf_bnb_4bit() const override { return false; }

  // Phi3Config's keys, absent ones taking its defaults (4096 positions, rms_norm_eps 1e-5, an untied
  // head); its window (sliding_window, null for none) slides over every layer.
  ModelConfig read_hf_config(const HfConfig& j) const override {
    ModelConfig defaults;
    defaults.max_seq_len = 4096;
    defaults.tie_embeddings = false;
    ModelConfig m = read_decoder_config(j, defaults);
    if (!j.present("rms_norm_eps")) m.norm_eps = 1e-5;
    // resid_pdrop, embd_pdrop and attention_dropout are ignored, as every family's dropouts are.
    const nlohmann::json& parameters = j["rope_parameters"];
    const nlohmann::json& factor = j.has("partial_rotary_factor") ? j["partial_rotary_factor"]
                                   : parameters.is_object() && parameters.contains("partial_rotary_factor")
                                       ? parameters["partial_rotary_factor"]
                                       : nlohmann::json(1.0);
    if (!factor.is_number() || factor.get<double>() != 1.0)
      j.fail("partial_rotary_factor " + factor.dump() + " is not implemented; ShardTrain turns every dimension of "
             "each head (1.0)");
    if (j.has("sliding_window")) m.sliding_window = sliding_window_over(j, m, j.whole("sliding_window"), m.n_layer);
    return m;
  }
  // Phi3ForCausalLM as transformers writes it.
  void write_hf_config(const ModelConfig& m, nlohmann::ordered_json& j) const override {
    write_decoder_config(m, "phi3", j);
    j["original_max_position_embeddings"] = m.max_seq_len;
    j["partial_rotary_factor"] = 1.0;
    j["resid_pdrop"] = 0.0;
    j["embd_pdrop"] = 0.0;
    j["sliding_window"] = m.sliding_window > 0 ? nlohmann::ordered_json(m.sliding_window) : nlohmann::ordered_json(nullptr);
    j["pad_token_id"] = nullptr;  // Phi3Config's default, 32000, would be past a smaller vocabulary
  }
  // q, k and v are rows of qkv_proj; gate and up of gate_up_proj.
  HfTensor hf_tensor(const ModelConfig& c, const ParamInfo& p) const override {
    HfTensor t = LlamaFamily::hf_tensor(c, p);
    const struct {
      const char* ours;
      const char* fused;
    } parts[] = {{".self_attn.q_proj.weight", ".self_attn.qkv_proj.weight"},
                 {".self_attn.k_proj.weight", ".self_attn.qkv_proj.weight"},
                 {".self_attn.v_proj.weight", ".self_attn.qkv_proj.weight"},
                 {".mlp.gate_proj.weight", ".mlp.gate_up_proj.weight"},
                 {".mlp.up_proj.weight", ".mlp.gate_up_proj.weight"}};
    for (int i = 0; i < 5; i++) {
      const std::string suffix = parts[i].ours;
      if (t.name.size() < suffix.size() || t.name.compare(t.name.size() - suffix.size(), suffix.size(), suffix) != 0)
        continue;
      const int64_t q = static_cast<int64_t>(c.n_head) * c.head_size(), kv = int64_t{c.kv_heads()} * c.head_size();
      const int64_t f = c.mlp_size();
      const int64_t first[5] = {0, q, q + kv, 0, f}, rows = i < 3 ? q + 2 * kv : 2 * f;
      t.name = t.name.substr(0, t.name.size() - suffix.size()) + parts[i].fused;
      t.rows = {{first[i], t.shape[0]}};
      t.shape[0] = rows;
      return t;
    }
    return t;
  }

 protected:
  const char* display_name() const override { return "Phi-3"; }
};

}  // namespace

const ModelFamily& phi3_family() {
  static const Phi3Family family;
  return family;
}

}  // namespace shardtrain
