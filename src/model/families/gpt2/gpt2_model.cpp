// GPT-2 forward/backward on explicit buffers (see model.hpp, gpt2_model.hpp). Each block:
//   ln1 = LN(x); qkv = ln1 Wqkv^T + b; y = attn(qkv); r2 = x + y Wp^T + b;
//   ln2 = LN(r2); h = gelu(ln2 Wfc^T + b); out = r2 + h Wfp^T + b.
// The backward runs the same steps in reverse with one running residual gradient dresid_.
#include "model/families/gpt2/gpt2_model.hpp"

#include <algorithm>

#include "core/error.hpp"

namespace shardtrain {

template <typename Real>
GptModel<Real>::GptModel(const ParamTable& table, int batch, int seq_len, Checkpointing activation_checkpointing,
                         const LayerOps<Real>& ops, DType activation_dtype)
    : Base(table, batch, seq_len, activation_checkpointing, ops, activation_dtype,
           saved_tensor_elements(table.config(), batch, seq_len)) {
  const size_t BT = static_cast<size_t>(B_) * T_, C = cfg_.n_embd, NH = cfg_.n_head;
  ActivationList list = this->activation_list();  // Gpt2Family::activation_arrays: the plan, in order
  for (int l = 0; l <= cfg_.n_layer; l++) resid_.push_back(list.take(BT * C));
  layers_.resize(recompute_.sets());
  for (Layer& a : layers_) {
    a.ln1_mean = list.take(BT), a.ln1_rstd = list.take(BT), a.lse = list.take(BT * NH), a.resid2 = list.take(BT * C);
    a.ln2_mean = list.take(BT), a.ln2_rstd = list.take(BT);
  }
  lnf_ = list.take(BT * C), lnf_mean_ = list.take(BT), lnf_rstd_ = list.take(BT);
  probs_ = list.take(BT * cfg_.vocab_size), losses_ = list.take(BT);
  dresid_ = list.take(BT * C), dln_ = list.take(BT * C), dqkv_ = list.take(BT * 3 * C), dfch_ = list.take(BT * 4 * C);
  list.done();
}

template <typename Real>
std::vector<size_t> GptModel<Real>::saved_tensor_elements(const ModelConfig& c, int batch, int seq_len) {
  const size_t BT = static_cast<size_t>(batch) * seq_len, C = c.n_embd;
  std::vector<size_t> sizes(FCH_GELU + 1);
  sizes[LN1] = sizes[ATTY] = sizes[LN2] = BT * C;
  sizes[QKV] = BT * 3 * C;
  sizes[FCH] = sizes[FCH_GELU] = BT * 4 * C;
  return sizes;
}

template <typename Real>
void GptModel<Real>::embed_forward(const Real* root, const Batch& batch) {
  this->upload_tokens(batch);
  ops_.encoder_forward(resid_[0].data(), tokens_.data(), param_in(table_, root, ROOT_UNIT, ROOT_WTE),
                       param_in(table_, root, ROOT_UNIT, ROOT_WPE), B_, T_, cfg_.n_embd, this->positions());
}

template <typename Real>
void GptModel<Real>::block_forward(int l, const Real* w) {
  const int N = B_ * T_, C = cfg_.n_embd, NH = cfg_.n_head;
  Layer& a = layer(l);
  auto W = [&](Gpt2BlockParam p) { return param_in(table_, w, block_unit(l), p); };
  auto S = [&](Saved t) { return saved_.at(l, t); };
  auto produced = [&](Saved t) { saved_.produced(l, t); };
  const Real* x = resid_[l].data();
  ops_.layernorm_forward(S(LN1), a.ln1_mean.data(), a.ln1_rstd.data(), x, W(BLOCK_LN1_W), W(BLOCK_LN1_B), N, C);
  produced(LN1);
  adapters_.linear_forward(l, PRODUCT_QKV, S(QKV), S(LN1), W(BLOCK_QKV_W), W(BLOCK_QKV_B), C, 3 * C, w);
  produced(QKV);
  ops_.attention_forward(S(ATTY), a.lse.data(), S(QKV), B_, T_, NH, NH, C / NH, this->doc_start());
  produced(ATTY);
  // The projection output is only needed summed into the residual: reuse resid2 for it.
  adapters_.linear_forward(l, PRODUCT_ATTN_OUT, a.resid2.data(), S(ATTY), W(BLOCK_ATTPROJ_W), W(BLOCK_ATTPROJ_B), C,
                           C, w);
  ops_.residual_forward(a.resid2.data(), a.resid2.data(), x, a.resid2.size());
  ops_.layernorm_forward(S(LN2), a.ln2_mean.data(), a.ln2_rstd.data(), a.resid2.data(), W(BLOCK_LN2_W),
                         W(BLOCK_LN2_B), N, C);
  produced(LN2);
  adapters_.linear_forward(l, PRODUCT_MLP_UP, S(FCH), S(LN2), W(BLOCK_FC_W), W(BLOCK_FC_B), C, 4 * C, w);
  produced(FCH);
  const size_t hidden = static_cast<size_t>(N) * 4 * C;
  ops_.gelu_forward(S(FCH_GELU), S(FCH), hidden);
  produced(FCH_GELU);
  Real* out = resid_[l + 1].data();
  adapters_.linear_forward(l, PRODUCT_MLP_DOWN, out, S(FCH_GELU), W(BLOCK_FCPROJ_W), W(BLOCK_FCPROJ_B), 4 * C, C, w);
  ops_.residual_forward(out, out, a.resid2.data(), resid_[l + 1].size());
}

template <typename Real>
const Real* GptModel<Real>::final_norm(const Real* root) {
  auto R = [&](Gpt2RootParam p) { return param_in(table_, root, ROOT_UNIT, p); };
  ops_.layernorm_forward(lnf_.data(), lnf_mean_.data(), lnf_rstd_.data(), resid_[cfg_.n_layer].data(), R(ROOT_LNF_W),
                         R(ROOT_LNF_B), B_ * T_, cfg_.n_embd);
  return lnf_.data();
}

template <typename Real>
const Real* GptModel<Real>::head_logits(const Real* root) {
  const int N = B_ * T_, C = cfg_.n_embd, V = cfg_.vocab_size;
  final_norm(root);
  ops_.matmul_forward(probs_.data(), lnf_.data(), param_in(table_, root, ROOT_UNIT, ROOT_WTE),
                      static_cast<const Real*>(nullptr), N, C, V);
  return probs_.data();
}

template <typename Real>
void GptModel<Real>::head_backward(Real* g, const Real* root, Real dloss) {
  const int N = B_ * T_, C = cfg_.n_embd, V = cfg_.vocab_size;
  auto R = [&](Gpt2RootParam p) { return param_in(table_, root, ROOT_UNIT, p); };
  auto G = [&](Gpt2RootParam p) { return grad_in(table_, g, ROOT_UNIT, p); };
  this->loss_backward(dloss);
  ops_.matmul_backward(dln_.data(), G(ROOT_WTE), static_cast<Real*>(nullptr), probs_.data(), lnf_.data(), R(ROOT_WTE),
                       N, C, V);
  dresid_.zero();
  ops_.layernorm_backward(dresid_.data(), G(ROOT_LNF_W), G(ROOT_LNF_B), dln_.data(), resid_[cfg_.n_layer].data(),
                          R(ROOT_LNF_W), lnf_mean_.data(), lnf_rstd_.data(), N, C);
}

template <typename Real>
void GptModel<Real>::block_backward(int l, Real* g, const Real* w) {
  const int N = B_ * T_, C = cfg_.n_embd, NH = cfg_.n_head;
  if (recompute_.recomputes(l))
    block_forward(l, w);  // recompute this block's activations from its saved input
  else
    saved_.restore(l);
  Layer& a = layer(l);
  auto W = [&](Gpt2BlockParam p) { return param_in(table_, w, block_unit(l), p); };
  auto G = [&](Gpt2BlockParam p) { return grad_in(table_, g, block_unit(l), p); };
  auto S = [&](Saved t) { return saved_.at(l, t); };
  // MLP: out = r2 + proj(gelu(fc(ln2(r2)))); dresid_ holds d(out) and becomes d(r2).
  adapters_.linear_backward(l, PRODUCT_MLP_DOWN, dfch_.data(), G(BLOCK_FCPROJ_W), G(BLOCK_FCPROJ_B), dresid_.data(),
                            S(FCH_GELU), W(BLOCK_FCPROJ_W), 4 * C, C, w, g);
  ops_.gelu_backward(dfch_.data(), dfch_.data(), S(FCH), dfch_.size());
  adapters_.linear_backward(l, PRODUCT_MLP_UP, dln_.data(), G(BLOCK_FC_W), G(BLOCK_FC_B), dfch_.data(), S(LN2),
                            W(BLOCK_FC_W), C, 4 * C, w, g);
  ops_.layernorm_backward(dresid_.data(), G(BLOCK_LN2_W), G(BLOCK_LN2_B), dln_.data(), a.resid2.data(), W(BLOCK_LN2_W),
                          a.ln2_mean.data(), a.ln2_rstd.data(), N, C);
  // Attention: r2 = x + proj(attn(qkv(ln1(x)))); dresid_ becomes d(x).
  adapters_.linear_backward(l, PRODUCT_ATTN_OUT, dln_.data(), G(BLOCK_ATTPROJ_W), G(BLOCK_ATTPROJ_B), dresid_.data(),
                            S(ATTY), W(BLOCK_ATTPROJ_W), C, C, w, g);
  ops_.attention_backward(dqkv_.data(), dln_.data(), S(QKV), S(ATTY), a.lse.data(), B_, T_, NH, NH, C / NH,
                          this->doc_start());
  adapters_.linear_backward(l, PRODUCT_QKV, dln_.data(), G(BLOCK_QKV_W), G(BLOCK_QKV_B), dqkv_.data(), S(LN1),
                            W(BLOCK_QKV_W), C, 3 * C, w, g);
  ops_.layernorm_backward(dresid_.data(), G(BLOCK_LN1_W), G(BLOCK_LN1_B), dln_.data(), resid_[l].data(), W(BLOCK_LN1_W),
                          a.ln1_mean.data(), a.ln1_rstd.data(), N, C);
}

template <typename Real>
void GptModel<Real>::embed_backward(Real* g) {
  ops_.encoder_backward(grad_in(table_, g, ROOT_UNIT, ROOT_WTE), grad_in(table_, g, ROOT_UNIT, ROOT_WPE),
                        dresid_.data(), tokens_.data(), B_, T_, cfg_.n_embd, this->positions());
}

template <typename Real>
size_t GptModel<Real>::plan_decode_elements(const ModelConfig& c, int max_len, int max_chunk) {
  const size_t C = c.n_embd, L = c.n_layer, M = max_len, n = max_chunk;
  const size_t cache = 2 * L * M * C;
  // x, ln, atty, resid2; mean, rstd; qkv; fch, fch_gelu; the scores; the logits
  const size_t step = 4 * n * C + 2 * n + 3 * n * C + 2 * n * 4 * C + n * c.n_head * M + c.vocab_size;
  return cache + step;
}

template <typename Real>
void GptModel<Real>::begin_decode(int max_len, int max_chunk) {
  SHARD_CHECK(max_len >= 1 && max_len <= cfg_.max_seq_len && max_chunk >= 1 && max_chunk <= max_len,
              "begin_decode(%d, %d) with max_seq_len %d", max_len, max_chunk, cfg_.max_seq_len);
  end_decode();
  adapters_.begin_decode(max_chunk);
  const size_t C = cfg_.n_embd, M = max_len, n = max_chunk;
  Device& dev = ops_.device();
  auto array = [&](size_t count) { return Array(dev, count); };
  Decode& d = dec_;
  d.max_len = max_len, d.max_chunk = max_chunk;
  d.tokens = DeviceArray<int>(dev, n);
  for (int l = 0; l < cfg_.n_layer; l++) d.k.push_back(array(M * C)), d.v.push_back(array(M * C));
  d.x = array(n * C), d.ln = array(n * C), d.mean = array(n), d.rstd = array(n), d.qkv = array(n * 3 * C);
  d.atty = array(n * C), d.resid2 = array(n * C), d.fch = array(n * 4 * C), d.fch_gelu = array(n * 4 * C);
  d.scores = array(n * cfg_.n_head * M), d.logits = array(cfg_.vocab_size);
}

template <typename Real>
void GptModel<Real>::decode_embed(const Real* root, const int* tokens, int n) {
  Decode& d = dec_;
  const size_t C = cfg_.n_embd;
  d.advance(n);
  ops_.device().copy_to_device(d.tokens.data(), tokens, n * sizeof(int));
  // Positions start..start+n-1: the position table from row start on.
  ops_.encoder_forward(d.x.data(), d.tokens.data(), param_in(table_, root, ROOT_UNIT, ROOT_WTE),
                       param_in(table_, root, ROOT_UNIT, ROOT_WPE) + d.start * C, 1, n, C, nullptr);
}

template <typename Real>
void GptModel<Real>::decode_block(int l, const Real* w) {
  Decode& d = dec_;
  const int N = d.n, C = cfg_.n_embd, NH = cfg_.n_head;
  auto W = [&](Gpt2BlockParam p) { return param_in(table_, w, block_unit(l), p); };
  ops_.layernorm_forward(d.ln.data(), d.mean.data(), d.rstd.data(), d.x.data(), W(BLOCK_LN1_W), W(BLOCK_LN1_B), N, C);
  adapters_.linear_decode(l, PRODUCT_QKV, d.qkv.data(), d.ln.data(), W(BLOCK_QKV_W), W(BLOCK_QKV_B), C, 3 * C, w, N);
  ops_.attention_decode(d.atty.data(), d.scores.data(), d.k[l].data(), d.v[l].data(), d.qkv.data(), N, d.start, NH,
                        NH, C / NH, 0);
  adapters_.linear_decode(l, PRODUCT_ATTN_OUT, d.resid2.data(), d.atty.data(), W(BLOCK_ATTPROJ_W), W(BLOCK_ATTPROJ_B),
                          C, C, w, N);
  ops_.residual_forward(d.resid2.data(), d.resid2.data(), d.x.data(), static_cast<size_t>(N) * C);
  ops_.layernorm_forward(d.ln.data(), d.mean.data(), d.rstd.data(), d.resid2.data(), W(BLOCK_LN2_W), W(BLOCK_LN2_B),
                         N, C);
  adapters_.linear_decode(l, PRODUCT_MLP_UP, d.fch.data(), d.ln.data(), W(BLOCK_FC_W), W(BLOCK_FC_B), C, 4 * C, w, N);
  ops_.gelu_forward(d.fch_gelu.data(), d.fch.data(), static_cast<size_t>(N) * 4 * C);
  adapters_.linear_decode(l, PRODUCT_MLP_DOWN, d.x.data(), d.fch_gelu.data(), W(BLOCK_FCPROJ_W), W(BLOCK_FCPROJ_B),
                          4 * C, C, w, N);
  ops_.residual_forward(d.x.data(), d.x.data(), d.resid2.data(), static_cast<size_t>(N) * C);
}

template <typename Real>
void GptModel<Real>::decode_head(const Real* root, Real* logits) {
  Decode& d = dec_;
  const int C = cfg_.n_embd, V = cfg_.vocab_size;
  const Real* last = d.x.data() + static_cast<size_t>(d.n - 1) * C;
  ops_.layernorm_forward(d.ln.data(), d.mean.data(), d.rstd.data(), last, param_in(table_, root, ROOT_UNIT, ROOT_LNF_W),
                         param_in(table_, root, ROOT_UNIT, ROOT_LNF_B), 1, C);
  ops_.matmul_forward(d.logits.data(), d.ln.data(), param_in(table_, root, ROOT_UNIT, ROOT_WTE),
                      static_cast<const Real*>(nullptr), 1, C, V);
  ops_.device().copy_to_host(logits, d.logits.data(), d.logits.bytes());
}

template class GptModel<float>;
template class GptModel<double>;

}  // namespace shardtrain
