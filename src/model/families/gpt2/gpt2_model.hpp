// GPT-2 (model/model.hpp's interface): learned positions, LayerNorm, GELU MLP, biases, the LM head
// tied to the token embedding.
#pragma once

#include <vector>

#include "model/decoder_lm.hpp"
#include "model/families/gpt2/gpt2_family.hpp"

namespace shardtrain {

template <typename Real>
class GptModel : public DecoderLM<Real> {
 public:
  // activation_dtype: how a block's saved tensors are stored (model/saved_activations.hpp).
  GptModel(const ParamTable& table, int batch, int seq_len, Checkpointing activation_checkpointing,
           const LayerOps<Real>& ops, DType activation_dtype = DTYPE_FP32);

  // Elements of each of a layer's saved tensors (SavedActivations' sizes).
  static std::vector<size_t> saved_tensor_elements(const ModelConfig& config, int batch, int seq_len);

  void embed_forward(const Real* root, const Batch& batch) override;
  void block_forward(int layer, const Real* block) override;
  void head_backward(Real* root_grad, const Real* root, Real dloss) override;
  void block_backward(int layer, Real* block_grad, const Real* block) override;
  void embed_backward(Real* root_grad) override;
  const Real* head_logits(const Real* root) override;
  const Real* final_norm(const Real* root) override;

  // Elements of a decode state (model.hpp's plan_decode_bytes), its tokens aside.
  static size_t plan_decode_elements(const ModelConfig& config, int max_len, int max_chunk);
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
  // A layer's saved tensors (in saved_) and its fp32 rest.
  enum Saved { LN1, QKV, ATTY, LN2, FCH, FCH_GELU };
  struct Layer {
    Array ln1_mean, ln1_rstd, lse, resid2, ln2_mean, ln2_rstd;
  };
  Layer& layer(int l) { return layers_[recompute_.set(l)]; }

  std::vector<Layer> layers_;  // one per block that keeps its own, one shared by the recomputing blocks
  Array lnf_mean_, lnf_rstd_;
  Array dqkv_, dfch_;  // backward scratch, shared by all layers
  // Generation: the key/value cache and one step's buffers (rows of its tokens; the head uses row 0
  // of ln, mean, rstd).
  struct Decode : DecodeCursor {
    DeviceArray<int> tokens;
    std::vector<Array> k, v;  // per layer, (max_len, C): row p holds position p's heads
    Array x, ln, mean, rstd, qkv, atty, resid2, fch, fch_gelu, scores, logits;
  } dec_;
};

}  // namespace shardtrain
