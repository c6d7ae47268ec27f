// The SmolLM3 family's descriptor (smollm3_family.hpp): what differs from Llama's -- the NoPE
// blocks, the names and SmolLM3Config's keys and defaults.
#include "model/families/smollm3/smollm3_family.hpp"

#include "core/error.hpp"
#include "model/families/llama/llama_family.hpp"

namespace shardtrain {
namespace {

class SmolLM3Family final : public LlamaFamily {
 public:
  const char* name() const override { return "smollm3"; }
  const char* description() const override { return "SmolLM3 (Llama with blocks without rotary embeddings)"; }
  const char* hf_class() const override { return "SmolLM3ForCausalLM"; }
  bool reads_model_type(const std::string& type) const override { return type == "smollm3"; }
  std::vector<std::string> config_keys() const override {
    std::vector<std::string> keys = LlamaFamily::config_keys();
    keys.push_back("model.nope_layers");
    return keys;
  }

  // SmolLM3Config's keys, absent ones taking its defaults (4 key/value heads, 32768 positions, a tied
  // head); no_rope_layers (1: the block turns q and k) or, without it, a NoPE block every
  // no_rope_layer_interval (4) blocks, the last of each run.
  ModelConfig read_hf_config(const HfConfig& j) const override {
    ModelConfig defaults;
    defaults.n_kv_head = 4;
    defaults.max_seq_len = 32768;
    defaults.rope_theta = 2000000.0;  // SmolLM3Config's default_theta
    defaults.tie_embeddings = true;
    ModelConfig m = read_decoder_config(j, defaults);
    for (const char* key : {"attention_bias", "mlp_bias"})
      if (j.flag(key, false)) j.fail(std::string(key) + " true is not implemented; ShardTrain's SmolLM3 has no biases");
    std::vector<bool> nope(m.n_layer);
    const nlohmann::json& flags = j["no_rope_layers"];
    if (flags.is_null()) {
      const int interval = j.whole("no_rope_layer_interval", 4);
      for (int l = 0; l < m.n_layer; l++) nope[l] = (l + 1) % interval == 0;
    } else {  // transformers reads the first num_hidden_layers flags
      if (!flags.is_array() || static_cast<int>(flags.size()) < m.n_layer)
        j.fail(strprintf("no_rope_layers is not a list of num_hidden_layers = %d flags", m.n_layer));
      for (int l = 0; l < m.n_layer; l++) {
        const nlohmann::json& f = flags[l];
        if (!(f.is_boolean() || f == 0 || f == 1))
          j.fail("no_rope_layers " + flags.dump() + " holds a value other than 0 or 1");
        nope[l] = f.is_boolean() ? !f.get<bool>() : f == 0;
      }
    }
    m.nope_layers = nope_layers_text(nope);
    // transformers slides a window only with use_sliding_window and a window, over the blocks
    // layer_types marks sliding_attention (without layer_types: the NoPE blocks).
    if (j.flag("use_sliding_window", false) && j.has("sliding_window")) {
      const nlohmann::json& types = j["layer_types"];
      int sliding = 0;
      if (types.is_array())
        for (const nlohmann::json& type : types) sliding += type == "sliding_attention";
      else
        for (bool without : nope) sliding += without;
      m.sliding_window = sliding_window_over(j, m, j.whole("sliding_window"), sliding);
    }
    return m;
  }
  // SmolLM3ForCausalLM as transformers writes it: the flags for every block.
  void write_hf_config(const ModelConfig& m, nlohmann::ordered_json& j) const override {
    write_decoder_config(m, "smollm3", j);
    std::vector<bool> nope;
    std::string defect;
    SHARD_CHECK(parse_nope_layers(m.nope_layers, m.n_layer, &nope, &defect), "%s", defect.c_str());
    nlohmann::ordered_json flags = nlohmann::ordered_json::array();
    for (bool without : nope) flags.push_back(without ? 0 : 1);
    j["no_rope_layers"] = flags;
    j["attention_bias"] = false;
    j["mlp_bias"] = false;
    j["use_sliding_window"] = m.sliding_window > 0;  // over every block (layer_types), as read
    j["sliding_window"] = m.sliding_window > 0 ? nlohmann::ordered_json(m.sliding_window) : nlohmann::ordered_json(nullptr);
    if (m.sliding_window > 0) j["layer_types"] = std::vector<std::string>(m.n_layer, "sliding_attention");
    j["pad_token_id"] = nullptr;  // SmolLM3Config's default, 128004, would be past a smaller vocabulary
  }

 protected:
  const char* display_name() const override { return "SmolLM3"; }
};

}  // namespace

const ModelFamily& smollm3_family() {
  static const SmolLM3Family family;
  return family;
}

}  // namespace shardtrain
