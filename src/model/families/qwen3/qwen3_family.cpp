// The Qwen3 family's descriptor (qwen3_family.hpp): what differs from Llama's -- the q/k norms,
// the names and Qwen3Config's keys and defaults.
#include "model/families/qwen3/qwen3_family.hpp"

#include "backend/gpu_memory.hpp"
#include "core/error.hpp"
#include "model/families/llama/llama_family.hpp"

namespace shardtrain {
namespace {

class Qwen3Family final : public LlamaFamily {
 public:
  const char* name() const override { return "qwen3"; }
  const char* description() const override { return "Qwen3 (Llama with RMSNorms of each query and key head)"; }
  const char* hf_class() const override { return "Qwen3ForCausalLM"; }
  bool reads_model_type(const std::string& type) const override { return type == "qwen3"; }

  // Qwen3Config's keys, absent ones taking its defaults (32 key/value heads, heads of 128, 32768
  // positions).
  ModelConfig read_hf_config(const HfConfig& j) const override {
    ModelConfig defaults;
    defaults.n_kv_head = 32;
    defaults.head_dim = 128;
    defaults.max_seq_len = 32768;
    defaults.tie_embeddings = false;
    ModelConfig m = read_decoder_config(j, defaults);
    // Qwen3's attention_bias would put biases on o_proj too.
    if (j.flag("attention_bias", false))
      j.fail("attention_bias true is not implemented; ShardTrain's Qwen3 has no biases");
    m.sliding_window = read_qwen_sliding_window(j, m);
    return m;
  }
  // Qwen3ForCausalLM as transformers 4 writes it.
  void write_hf_config(const ModelConfig& m, nlohmann::ordered_json& j) const override {
    write_decoder_config(m, "qwen3", j);
    j["head_dim"] = m.head_size();
    j["attention_bias"] = false;
    write_qwen_sliding_window(m, j);
  }

  // The q/k norms' backward runs over every row's heads.
  std::vector<KernelWorkspace> kernel_workspaces(const ModelConfig& c, int batch, int seq_len) const override {
    std::vector<KernelWorkspace> w = LlamaFamily::kernel_workspaces(c, batch, seq_len);
    w.push_back({gpu::rmsnorm_backward_workspace_bytes(batch * seq_len * c.n_head, c.head_size()),
                 "q/k RMSNorm backward"});
    return w;
  }

 protected:
  const char* display_name() const override { return "Qwen3"; }
  LlamaVariant variant() const override { return {false, true}; }
};

}  // namespace

const ModelFamily& qwen3_family() {
  static const Qwen3Family family;
  return family;
}

}  // namespace shardtrain
