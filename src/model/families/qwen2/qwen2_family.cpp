// The Qwen2 family's descriptor (qwen2_family.hpp): what differs from Llama's -- the q/k/v biases,
// the names and Qwen2Config's keys and defaults.
#include "model/families/qwen2/qwen2_family.hpp"

#include "core/error.hpp"
#include "model/families/llama/llama_family.hpp"

namespace shardtrain {
namespace {

class Qwen2Family final : public LlamaFamily {
 public:
  const char* name() const override { return "qwen2"; }
  const char* description() const override { return "Qwen2/Qwen2.5 (Llama with q/k/v biases)"; }
  const char* hf_class() const override { return "Qwen2ForCausalLM"; }
  bool reads_model_type(const std::string& type) const override { return type == "qwen2"; }

  // Qwen2Config's keys, absent ones taking its defaults (32 key/value heads, 32768 positions).
  ModelConfig read_hf_config(const HfConfig& j) const override {
    ModelConfig defaults;
    defaults.n_kv_head = 32;
    defaults.max_seq_len = 32768;
    defaults.tie_embeddings = false;
    ModelConfig m = read_decoder_config(j, defaults);
    m.sliding_window = read_qwen_sliding_window(j, m);
    return m;
  }
  // Qwen2ForCausalLM as transformers 4 writes it.
  void write_hf_config(const ModelConfig& m, nlohmann::ordered_json& j) const override {
    write_decoder_config(m, "qwen2", j);
    write_qwen_sliding_window(m, j);
  }

 protected:
  const char* display_name() const override { return "Qwen2"; }
  LlamaVariant variant() const override { return {true, false}; }
};

}  // namespace

const ModelFamily& qwen2_family() {
  static const Qwen2Family family;
  return family;
}

}  // namespace shardtrain
