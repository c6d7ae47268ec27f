// The Llama family (model/family.hpp), as transformers' LlamaForCausalLM computes it: RMSNorm,
// rotary positions, grouped-query attention, a SwiGLU MLP, no biases, a tied or untied LM head;
// Hugging Face's parameter names less the "model." prefix. Mistral folders without a sliding
// window read as Llama. The descriptor is a class so that decoders that are Llama plus a little
// (Qwen2: q/k/v biases; Qwen3: q/k norms) derive from it in their own folders.
#pragma once

#include "model/family.hpp"

namespace shardtrain {

// Positions of the parameters inside a block unit and the root unit. q|k|v and gate|up are
// adjacent, so each group is one GEMM; a variant's parameters (LlamaVariant) follow the block's
// weights.
enum LlamaBlockParam {
  LLAMA_ATTN_NORM_W, LLAMA_Q_W, LLAMA_K_W, LLAMA_V_W, LLAMA_O_W,
  LLAMA_MLP_NORM_W, LLAMA_GATE_W, LLAMA_UP_W, LLAMA_DOWN_W, LLAMA_BLOCK_PARAM_COUNT,
  LLAMA_Q_B = LLAMA_BLOCK_PARAM_COUNT, LLAMA_K_B, LLAMA_V_B,  // with qkv_bias, adjacent
};
enum LlamaRootParam { LLAMA_EMBED, LLAMA_NORM_W, LLAMA_LM_HEAD };  // LLAMA_LM_HEAD only when untied

// What a decoder built on Llama's block adds to it, each part's parameters present only when set,
// in this order after the block's weights: biases on q_proj, k_proj and v_proj (Qwen2), and an
// RMSNorm over each query and each key head's head_dim before the rotary turn, one weight of
// head_dim for all query heads and one for all key heads (Qwen3's q_norm and k_norm).
struct LlamaVariant {
  bool qkv_bias = false;
  bool qk_norm = false;
  int q_norm_param() const { return LLAMA_BLOCK_PARAM_COUNT + (qkv_bias ? 3 : 0); }
  int k_norm_param() const { return q_norm_param() + 1; }
};

class LlamaFamily : public ModelFamily {
 public:
  const char* name() const override { return "llama"; }
  const char* description() const override {
    return "Llama (rotary positions, RMSNorm, SwiGLU, grouped-query attention, no biases)";
  }
  std::string summary(const ModelConfig& config) const override;
  std::vector<std::string> config_keys() const override;
  std::string config_defect(const ModelConfig& config) const override;

  void add_params(ParamTable& table) const override;
  std::vector<FusedGroup> fused_groups(const ModelConfig& config, const std::string& kind) const override;
  std::vector<int> input_params() const override { return {LLAMA_EMBED}; }
  double flops_per_token(const ParamTable& table, int seq_len) const override;

  std::unique_ptr<TransformerModel<float>> make_model(const ParamTable& table, int batch, int seq_len,
                                                      Checkpointing ckpt, const LayerOps<float>& ops,
                                                      DType act) const override;
  std::unique_ptr<TransformerModel<double>> make_model(const ParamTable& table, int batch, int seq_len,
                                                       Checkpointing ckpt, const LayerOps<double>& ops,
                                                       DType act) const override;
  std::vector<size_t> activation_arrays(const ModelConfig& config, int batch, int seq_len, Checkpointing checkpointing,
                                        DType activation_dtype) const override;
  std::vector<size_t> saved_tensor_elements(const ModelConfig& config, int batch, int seq_len) const override;
  size_t plan_decode_elements(const ModelConfig& config, int max_len, int max_chunk) const override;
  std::vector<LinearShape> gemm_shapes(const ModelConfig& config) const override;
  NormKind norm_kind() const override { return NORM_RMS; }
  bool kv_decoding() const override { return true; }
  size_t id_bytes(const ModelConfig&, int batch, int seq_len) const override {
    return decoder_lm_id_bytes(batch, seq_len);
  }
  bool token_logits() const override { return true; }
  bool hidden_states() const override { return true; }

  std::vector<LinearSite> linear_sites(const ModelConfig& config, const std::string& kind) const override;
  std::string module_path(const ModelConfig& config, int layer, const LinearSite& site) const override;

  const char* hf_class() const override { return "LlamaForCausalLM"; }
  const char* hf_class_of(const ModelConfig& config) const override;
  bool reads_model_type(const std::string& type) const override { return type == "llama" || type == "mistral"; }
  ModelConfig read_hf_config(const HfConfig& json) const override;
  void write_hf_config(const ModelConfig& config, nlohmann::ordered_json& json) const override;
  const char* hf_prefix() const override { return "model."; }
  bool hf_bnb_4bit() const override { return true; }
  HfTensor hf_tensor(const ModelConfig& config, const ParamInfo& param) const override;
  bool hf_ignorable(const std::string& key) const override;

 protected:
  // The family as logs name it: "Llama".
  virtual const char* display_name() const { return "Llama"; }
  // What the decoder adds to Llama's block (none: Llama).
  virtual LlamaVariant variant() const { return {}; }
  // Qwen's use_sliding_window, sliding_window, layer_types and max_window_layers keys: the window
  // when every layer slides, 0 when none does (or no sequence reaches the window); a window over
  // some layers only is refused (sliding_window_over).
  static int read_qwen_sliding_window(const HfConfig& json, const ModelConfig& config);
  // model.sliding_window from a window of `window` positions over `sliding` of the layers: the
  // window, 0 for none, or json.fail naming the mix, which ShardTrain does not implement.
  static int sliding_window_over(const HfConfig& json, const ModelConfig& config, int window, int sliding);
  // And written back as Qwen2Config, Qwen3Config and SmolLM3Config read them (layer_types too).
  static void write_qwen_sliding_window(const ModelConfig& config, nlohmann::ordered_json& json);
  // LlamaConfig's keys common to the decoders built on it; `defaults`: the family's when absent.
  ModelConfig read_decoder_config(const HfConfig& json, const ModelConfig& defaults) const;
  // And written: the keys LlamaConfig shares with the decoders built on it.
  void write_decoder_config(const ModelConfig& config, const char* model_type, nlohmann::ordered_json& json) const;
};

const ModelFamily& llama_family();

}  // namespace shardtrain
