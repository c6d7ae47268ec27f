// Llama (model/model.hpp's interface), as Hugging Face's LlamaForCausalLM computes it: RMSNorm
// before attention and MLP and at the end, rotary positions on q and k ("rotate_half" layout),
// grouped-query attention, the SwiGLU MLP down(silu(gate(x)) * up(x)), no biases, and an LM head
// tied to the token embedding or its own matrix; a variant's additions (LlamaVariant: Qwen2's q/k/v
// biases, Qwen3's q/k norms). The q|k|v and gate|up weights lie adjacent in the
// block unit (model/param_table.hpp), so each group is one GEMM.
#pragma once

#include <vector>

#include "model/decoder_lm.hpp"
#include "model/families/llama/llama_family.hpp"

namespace shardtrain {

template <typename Real>
class LlamaModel : public DecoderLM<Real> {
 public:
  // activation_dtype: how a block's saved tensors are stored (model/saved_activations.hpp).
  LlamaModel(const ParamTable& table, int batch, int seq_len, Checkpointing activation_checkpointing,
             const LayerOps<Real>& ops, DType activation_dtype = DTYPE_FP32, LlamaVariant variant = {});

  // Elements of each of a layer's saved tensors (SavedActivations' sizes).
  static std::vector<size_t> saved_tensor_elements(const ModelConfig& config, LlamaVariant variant, int batch,
                                                   int seq_len);

  void embed_forward(const Real* root, const Batch& batch) override;
  void block_forward(int layer, const Real* block) override;
  void head_backward(Real* root_grad, const Real* root, Real dloss) override;
  void block_backward(int layer, Real* block_grad, const Real* block) override;
  void embed_backward(Real* root_grad) override;
  const Real* head_logits(const Real* root) override;
  const Real* final_norm(const Real* root) override;

  // Elements of a decode state (model.hpp's plan_decode_bytes), its tokens aside.
  static size_t plan_decode_elements(const ModelConfig& config, LlamaVariant variant, int max_len, int max_chunk);
  void begin_decode(int max_len, int max_chunk) override;
  void end_decode() override { dec_ = Decode(), adapters_.end_decode(); }
  size_t decode_bytes() const override {
    return dec_.max_len ? plan_decode_bytes(table_, dec_.max_len, dec_.max_chunk, sizeof(Real)) : 0;
  }
  int decode_position() const override { return dec_.pos; }
  void decode_embed(const Real* root, const int* tokens, int n) override;
  void decode_block(int layer, const Real* block) override;
  void decode_head(const Real* root, Real* logits) override;

 private:
  using Base = DecoderLM<Real>;
  using typename Base::Array;
  using typename Base::ActivationList;
  using Base::table_, Base::ops_, Base::adapters_, Base::cfg_, Base::B_, Base::T_, Base::recompute_;
  using Base::tokens_, Base::targets_, Base::resid_, Base::saved_, Base::lnf_, Base::probs_, Base::losses_;
  using Base::dresid_, Base::dln_;
  // A layer's saved tensors (in saved_) and its fp32 rest. QK_PRE (with q/k norms): the heads'
  // q and k before their norms, all rows' q then all rows' k.
  enum Saved { LN1, QKV, ATTY, LN2, GATE_UP, ACT, QK_PRE };
  struct Layer {
    Array ln1_rstd, lse, resid2, ln2_rstd;
    Array q_rstd, k_rstd;  // with q/k norms: per row and head
  };
  Layer& layer(int l) { return layers_[recompute_.set(l)]; }
  // The LM head's weight in the root unit: lm_head, or the tied embedding.
  int head_param() const { return cfg_.tie_embeddings ? LLAMA_EMBED : LLAMA_LM_HEAD; }
  // The q|k|v bias in a block's parameters and its gradient, or null.
  const Real* qkv_bias(const Real* block, int layer) const {
    return variant_.qkv_bias ? param_in(table_, block, block_unit(layer), LLAMA_Q_B) : nullptr;
  }
  Real* qkv_bias_grad(Real* block_grad, int layer) const {
    return variant_.qkv_bias ? grad_in(table_, block_grad, block_unit(layer), LLAMA_Q_B) : nullptr;
  }
  // The q/k norms on N rows of q|k|v: q and k copied out of them (into pre: all rows' q, then all
  // rows' k) and back (merge_qk), and normed back into them from pre (normed: the same layout, scratch).
  void split_qk(Real* pre, const Real* qkv, int N) const;
  void merge_qk(Real* qkv, const Real* from, int N) const;
  void qk_norm_forward(int layer, const Real* block, Real* qkv, const Real* pre, Real* normed, Real* q_rstd,
                       Real* k_rstd, int N) const;
  // Their backward in place on dqkv's q and k columns (the gradients of the normed q and k in,
  // of the projection's q and k out), the weights' gradients added.
  void qk_norm_backward(int layer, const Real* block, Real* block_grad, Real* dqkv, const Real* pre,
                        const Real* q_rstd, const Real* k_rstd, int N);

  LlamaVariant variant_;
  std::vector<bool> nope_;  // per block: no rotary embeddings (model.nope_layers, SmolLM3)
  Array rope_cos_, rope_sin_;  // (T, head_size / 2)
  std::vector<Layer> layers_;  // one per block that keeps its own, one shared by the recomputing blocks
  Array lnf_rstd_;
  Array dqkv_, dgate_up_, dact_;  // backward scratch, shared by all layers
  Array qk_scratch_, dqk_pre_;     // with q/k norms: their normed output, then their output and input gradients
  // Rope tables (T, head_size / 2) on the device (allocated unless they are that size), Hugging Face's angles.
  void make_rope_tables(int T, Array& cos, Array& sin) const;
  // Generation: the key/value cache and one step's buffers (rows of its tokens; the head uses row 0
  // of ln and rstd).
  struct Decode : DecodeCursor {
    DeviceArray<int> tokens;
    Array rope_cos, rope_sin;  // (max_len, head_size / 2)
    std::vector<Array> k, v;   // per layer, (max_len, n_kv_head * head_size), keys after rope
    Array x, ln, rstd, qkv, atty, resid2, gate_up, act, scores, logits;
    Array qk_pre, qk_normed, qk_rstd;  // with q/k norms
  } dec_;
};

}  // namespace shardtrain
