// Llama forward/backward on explicit buffers (see model.hpp, llama_model.hpp). Each block:
//   n1 = rms(x) w1; q|k|v = n1 Wqkv^T (+ b: Qwen2); (Qwen3: q, k = rms(q) wq, rms(k) wk per head);
//   rope(q, k) (not in model.nope_layers' blocks: SmolLM3); y = attn(q, k, v); r2 = x + y Wo^T;
//   n2 = rms(r2) w2; g|u = n2 Wgu^T; out = r2 + (silu(g) * u) Wdown^T.
// The backward runs the same steps in reverse with one running residual gradient dresid_.
#include "model/families/llama/llama_model.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"
#include "model/rope_scaling.hpp"

namespace shardtrain {

template <typename Real>
LlamaModel<Real>::LlamaModel(const ParamTable& table, int batch, int seq_len, Checkpointing activation_checkpointing,
                             const LayerOps<Real>& ops, DType activation_dtype, LlamaVariant variant)
    : Base(table, batch, seq_len, activation_checkpointing, ops, activation_dtype,
           saved_tensor_elements(table.config(), variant, batch, seq_len)),
      variant_(variant) {
  SHARD_CHECK(cfg_.head_size() % 2 == 0, "rotary embeddings need an even head size, not %d", cfg_.head_size());
  std::string defect;
  SHARD_CHECK(parse_nope_layers(cfg_.nope_layers, cfg_.n_layer, &nope_, &defect), "%s", defect.c_str());
  const size_t BT = static_cast<size_t>(B_) * T_, C = cfg_.n_embd, NH = cfg_.n_head, I = cfg_.mlp_size();
  const size_t rope = static_cast<size_t>(T_) * (cfg_.head_size() / 2);
  const size_t A = cfg_.attn_size(), KV = cfg_.kv_heads();
  ActivationList list = this->activation_list();  // LlamaFamily::activation_arrays: the plan, in order
  rope_cos_ = list.take(rope), rope_sin_ = list.take(rope);
  make_rope_tables(T_, rope_cos_, rope_sin_);
  for (int l = 0; l <= cfg_.n_layer; l++) resid_.push_back(list.take(BT * C));
  layers_.resize(recompute_.sets());
  for (Layer& a : layers_) {
    a.ln1_rstd = list.take(BT), a.lse = list.take(BT * NH), a.resid2 = list.take(BT * C), a.ln2_rstd = list.take(BT);
    if (variant_.qk_norm) a.q_rstd = list.take(BT * NH), a.k_rstd = list.take(BT * KV);
  }
  lnf_ = list.take(BT * C), lnf_rstd_ = list.take(BT);
  probs_ = list.take(BT * cfg_.vocab_size), losses_ = list.take(BT);
  dresid_ = list.take(BT * C), dln_ = list.take(BT * std::max(C, A)), dqkv_ = list.take(BT * cfg_.qkv_size());
  dgate_up_ = list.take(BT * 2 * I), dact_ = list.take(BT * I);
  if (variant_.qk_norm) {
    const size_t qk = BT * (NH + KV) * cfg_.head_size();
    qk_scratch_ = list.take(qk), dqk_pre_ = list.take(qk);
  }
  list.done();
}

// Hugging Face's tables: inv_freq[i] (theta^(-2i/d), scaled: model/rope_scaling.hpp) and the angle
// t * inv_freq[i], both rounded to fp32 as its rotary embedding computes them; cos and sin of that
// angle, times yarn's attention factor (1 for the other types).
template <typename Real>
void LlamaModel<Real>::make_rope_tables(int T, Array& cos_table, Array& sin_table) const {
  const size_t half = cfg_.head_size() / 2;
  RopeScaling scaling;
  std::string defect;
  SHARD_CHECK(RopeScaling::parse(cfg_.rope_scaling, &scaling, &defect), "%s", defect.c_str());
  const std::vector<float> inv_freq = rope_inverse_frequencies(cfg_.head_size(), cfg_.rope_theta, scaling);
  const double m = scaling.attention_scaling();
  std::vector<Real> cos(T * half), sin(T * half);
  for (int t = 0; t < T; t++)
    for (size_t i = 0; i < half; i++) {
      const double angle = static_cast<float>(t) * inv_freq[i];
      // rounded, then scaled in that precision, as transformers' fp32 cos() * attention_scaling
      cos[t * half + i] = static_cast<Real>(std::cos(angle)) * static_cast<Real>(m);
      sin[t * half + i] = static_cast<Real>(std::sin(angle)) * static_cast<Real>(m);
    }
  Device& dev = ops_.device();
  if (cos_table.size() != cos.size()) cos_table = Array(dev, cos.size()), sin_table = Array(dev, sin.size());
  dev.copy_to_device(cos_table.data(), cos.data(), cos_table.bytes());
  dev.copy_to_device(sin_table.data(), sin.data(), sin_table.bytes());
}

template <typename Real>
std::vector<size_t> LlamaModel<Real>::saved_tensor_elements(const ModelConfig& c, LlamaVariant variant, int batch,
                                                            int seq_len) {
  const size_t BT = static_cast<size_t>(batch) * seq_len, C = c.n_embd, I = c.mlp_size();
  std::vector<size_t> sizes(variant.qk_norm ? QK_PRE + 1 : ACT + 1);
  if (variant.qk_norm) sizes[QK_PRE] = BT * (c.n_head + c.kv_heads()) * c.head_size();
  sizes[LN1] = sizes[LN2] = BT * C;
  sizes[ATTY] = BT * c.attn_size();
  sizes[QKV] = BT * c.qkv_size();
  sizes[GATE_UP] = BT * 2 * I;
  sizes[ACT] = BT * I;
  return sizes;
}

template <typename Real>
void LlamaModel<Real>::embed_forward(const Real* root, const Batch& batch) {
  this->upload_tokens(batch);
  ops_.encoder_forward(resid_[0].data(), tokens_.data(), param_in(table_, root, ROOT_UNIT, LLAMA_EMBED), nullptr, B_,
                       T_, cfg_.n_embd, nullptr);
}

template <typename Real>
void LlamaModel<Real>::block_forward(int l, const Real* w) {
  const int N = B_ * T_, C = cfg_.n_embd, NH = cfg_.n_head, KV = cfg_.kv_heads(), HS = cfg_.head_size();
  const int I = cfg_.mlp_size();
  const Real eps = static_cast<Real>(cfg_.norm_eps);
  auto W = [&](LlamaBlockParam p) { return param_in(table_, w, block_unit(l), p); };
  auto S = [&](Saved t) { return saved_.at(l, t); };
  auto produced = [&](Saved t) { saved_.produced(l, t); };
  Layer& a = layer(l);
  const Real* x = resid_[l].data();
  ops_.rmsnorm_forward(S(LN1), a.ln1_rstd.data(), x, W(LLAMA_ATTN_NORM_W), eps, N, C);
  produced(LN1);
  adapters_.linear_forward(l, PRODUCT_QKV, S(QKV), S(LN1), W(LLAMA_Q_W), qkv_bias(w, l), C, cfg_.qkv_size(),
                           w);  // q|k|v fused
  if (variant_.qk_norm) {
    split_qk(S(QK_PRE), S(QKV), N);
    produced(QK_PRE);
    qk_norm_forward(l, w, S(QKV), S(QK_PRE), qk_scratch_.data(), a.q_rstd.data(), a.k_rstd.data(), N);
  }
  if (!nope_[l])  // SmolLM3's NoPE blocks attend without positions
    ops_.rope_forward(S(QKV), rope_cos_.data(), rope_sin_.data(), B_, T_, NH, KV, HS, this->positions());
  produced(QKV);  // after rope: what attention reads (rope's backward needs no values)
  ops_.attention_forward(S(ATTY), a.lse.data(), S(QKV), B_, T_, NH, KV, HS, this->doc_start());
  produced(ATTY);
  // The projection output is only needed summed into the residual: reuse resid2 for it.
  adapters_.linear_forward(l, PRODUCT_ATTN_OUT, a.resid2.data(), S(ATTY), W(LLAMA_O_W), nullptr, NH * HS, C, w);
  ops_.residual_forward(a.resid2.data(), a.resid2.data(), x, a.resid2.size());
  ops_.rmsnorm_forward(S(LN2), a.ln2_rstd.data(), a.resid2.data(), W(LLAMA_MLP_NORM_W), eps, N, C);
  produced(LN2);
  adapters_.linear_forward(l, PRODUCT_MLP_UP, S(GATE_UP), S(LN2), W(LLAMA_GATE_W), nullptr, C, 2 * I,
                           w);  // gate|up fused
  produced(GATE_UP);
  ops_.swiglu_forward(S(ACT), S(GATE_UP), N, I);
  produced(ACT);
  Real* out = resid_[l + 1].data();
  adapters_.linear_forward(l, PRODUCT_MLP_DOWN, out, S(ACT), W(LLAMA_DOWN_W), nullptr, I, C, w);
  ops_.residual_forward(out, out, a.resid2.data(), resid_[l + 1].size());
}

template <typename Real>
const Real* LlamaModel<Real>::final_norm(const Real* root) {
  ops_.rmsnorm_forward(lnf_.data(), lnf_rstd_.data(), resid_[cfg_.n_layer].data(),
                       param_in(table_, root, ROOT_UNIT, LLAMA_NORM_W), static_cast<Real>(cfg_.norm_eps), B_ * T_,
                       cfg_.n_embd);
  return lnf_.data();
}

template <typename Real>
const Real* LlamaModel<Real>::head_logits(const Real* root) {
  const int N = B_ * T_, C = cfg_.n_embd, V = cfg_.vocab_size;
  final_norm(root);
  ops_.matmul_forward(probs_.data(), lnf_.data(), param_in(table_, root, ROOT_UNIT, head_param()), nullptr, N, C, V);
  return probs_.data();
}

template <typename Real>
void LlamaModel<Real>::head_backward(Real* g, const Real* root, Real dloss) {
  const int N = B_ * T_, C = cfg_.n_embd, V = cfg_.vocab_size;
  this->loss_backward(dloss);
  ops_.matmul_backward(dln_.data(), grad_in(table_, g, ROOT_UNIT, head_param()), nullptr, probs_.data(), lnf_.data(),
                       param_in(table_, root, ROOT_UNIT, head_param()), N, C, V);
  dresid_.zero();
  ops_.rmsnorm_backward(dresid_.data(), grad_in(table_, g, ROOT_UNIT, LLAMA_NORM_W), dln_.data(),
                        resid_[cfg_.n_layer].data(), param_in(table_, root, ROOT_UNIT, LLAMA_NORM_W), lnf_rstd_.data(),
                        N, C);
}

template <typename Real>
void LlamaModel<Real>::block_backward(int l, Real* g, const Real* w) {
  const int N = B_ * T_, C = cfg_.n_embd, NH = cfg_.n_head, KV = cfg_.kv_heads(), HS = cfg_.head_size();
  const int I = cfg_.mlp_size();
  if (recompute_.recomputes(l))
    block_forward(l, w);  // recompute this block's activations from its saved input
  else
    saved_.restore(l);
  Layer& a = layer(l);
  auto W = [&](LlamaBlockParam p) { return param_in(table_, w, block_unit(l), p); };
  auto G = [&](LlamaBlockParam p) { return grad_in(table_, g, block_unit(l), p); };
  auto S = [&](Saved t) { return saved_.at(l, t); };
  // MLP: out = r2 + down(swiglu(gate_up(norm2(r2)))); dresid_ holds d(out) and becomes d(r2).
  adapters_.linear_backward(l, PRODUCT_MLP_DOWN, dact_.data(), G(LLAMA_DOWN_W), nullptr, dresid_.data(), S(ACT),
                            W(LLAMA_DOWN_W), I, C, w, g);
  ops_.swiglu_backward(dgate_up_.data(), dact_.data(), S(GATE_UP), N, I);
  adapters_.linear_backward(l, PRODUCT_MLP_UP, dln_.data(), G(LLAMA_GATE_W), nullptr, dgate_up_.data(), S(LN2),
                            W(LLAMA_GATE_W), C, 2 * I, w, g);
  ops_.rmsnorm_backward(dresid_.data(), G(LLAMA_MLP_NORM_W), dln_.data(), a.resid2.data(), W(LLAMA_MLP_NORM_W),
                        a.ln2_rstd.data(), N, C);
  // Attention: r2 = x + o(attn(rope(qkv(norm1(x))))); dresid_ becomes d(x).
  adapters_.linear_backward(l, PRODUCT_ATTN_OUT, dln_.data(), G(LLAMA_O_W), nullptr, dresid_.data(), S(ATTY),
                            W(LLAMA_O_W), NH * HS, C, w, g);
  ops_.attention_backward(dqkv_.data(), dln_.data(), S(QKV), S(ATTY), a.lse.data(), B_, T_, NH, KV, HS,
                          this->doc_start());
  if (!nope_[l])
    ops_.rope_backward(dqkv_.data(), rope_cos_.data(), rope_sin_.data(), B_, T_, NH, KV, HS, this->positions());
  if (variant_.qk_norm) qk_norm_backward(l, w, g, dqkv_.data(), S(QK_PRE), a.q_rstd.data(), a.k_rstd.data(), N);
  adapters_.linear_backward(l, PRODUCT_QKV, dln_.data(), G(LLAMA_Q_W), qkv_bias_grad(g, l), dqkv_.data(), S(LN1),
                            W(LLAMA_Q_W), C, cfg_.qkv_size(), w, g);
  ops_.rmsnorm_backward(dresid_.data(), G(LLAMA_ATTN_NORM_W), dln_.data(), resid_[l].data(), W(LLAMA_ATTN_NORM_W),
                        a.ln1_rstd.data(), N, C);
}

template <typename Real>
void LlamaModel<Real>::split_qk(Real* pre, const Real* qkv, int N) const {
  const int A = cfg_.attn_size(), KVS = cfg_.kv_heads() * cfg_.head_size(), QKV = cfg_.qkv_size();
  ops_.copy_rows(pre, A, qkv, QKV, N, A);
  ops_.copy_rows(pre + static_cast<size_t>(N) * A, KVS, qkv + A, QKV, N, KVS);
}

template <typename Real>
void LlamaModel<Real>::merge_qk(Real* qkv, const Real* from, int N) const {
  const int A = cfg_.attn_size(), KVS = cfg_.kv_heads() * cfg_.head_size(), QKV = cfg_.qkv_size();
  ops_.copy_rows(qkv, QKV, from, A, N, A);
  ops_.copy_rows(qkv + A, QKV, from + static_cast<size_t>(N) * A, KVS, N, KVS);
}

template <typename Real>
void LlamaModel<Real>::qk_norm_forward(int l, const Real* w, Real* qkv, const Real* pre, Real* normed, Real* q_rstd,
                                       Real* k_rstd, int N) const {
  const int HS = cfg_.head_size();
  const Real eps = static_cast<Real>(cfg_.norm_eps);
  const size_t k_at = static_cast<size_t>(N) * cfg_.attn_size();
  ops_.rmsnorm_forward(normed, q_rstd, pre, param_in(table_, w, block_unit(l), variant_.q_norm_param()), eps,
                       N * cfg_.n_head, HS);
  ops_.rmsnorm_forward(normed + k_at, k_rstd, pre + k_at, param_in(table_, w, block_unit(l), variant_.k_norm_param()),
                       eps, N * cfg_.kv_heads(), HS);
  merge_qk(qkv, normed, N);
}

template <typename Real>
void LlamaModel<Real>::qk_norm_backward(int l, const Real* w, Real* g, Real* dqkv, const Real* pre,
                                        const Real* q_rstd, const Real* k_rstd, int N) {
  const int HS = cfg_.head_size(), u = block_unit(l);
  const size_t k_at = static_cast<size_t>(N) * cfg_.attn_size();
  Real* dout = qk_scratch_.data();
  Real* dinp = dqk_pre_.data();
  split_qk(dout, dqkv, N);
  dqk_pre_.zero();  // rmsnorm_backward adds into its input gradient
  ops_.rmsnorm_backward(dinp, grad_in(table_, g, u, variant_.q_norm_param()), dout, pre,
                        param_in(table_, w, u, variant_.q_norm_param()), q_rstd, N * cfg_.n_head, HS);
  ops_.rmsnorm_backward(dinp + k_at, grad_in(table_, g, u, variant_.k_norm_param()), dout + k_at, pre + k_at,
                        param_in(table_, w, u, variant_.k_norm_param()), k_rstd, N * cfg_.kv_heads(), HS);
  merge_qk(dqkv, dinp, N);
}

template <typename Real>
void LlamaModel<Real>::embed_backward(Real* g) {
  ops_.encoder_backward(grad_in(table_, g, ROOT_UNIT, LLAMA_EMBED), nullptr, dresid_.data(), tokens_.data(), B_, T_,
                        cfg_.n_embd, nullptr);
}

template <typename Real>
size_t LlamaModel<Real>::plan_decode_elements(const ModelConfig& c, LlamaVariant variant, int max_len,
                                              int max_chunk) {
  const size_t C = c.n_embd, L = c.n_layer, M = max_len, n = max_chunk, I = c.mlp_size();
  const size_t cache = 2 * L * M * c.kv_heads() * c.head_size();
  const size_t rope = 2 * M * (c.head_size() / 2);
  // x, ln, resid2; atty; rstd; qkv; gate_up, act; the scores; the logits
  const size_t step = 3 * n * C + n * c.attn_size() + n + n * c.qkv_size() + n * 3 * I + n * c.n_head * M +
                      c.vocab_size;
  // the q/k norms' input, output and rstd
  const size_t qk_norm = variant.qk_norm ? n * (c.n_head + c.kv_heads()) * (2 * c.head_size() + 1) : 0;
  return cache + rope + step + qk_norm;
}

template <typename Real>
void LlamaModel<Real>::begin_decode(int max_len, int max_chunk) {
  SHARD_CHECK(max_len >= 1 && max_len <= cfg_.max_seq_len && max_chunk >= 1 && max_chunk <= max_len,
              "begin_decode(%d, %d) with max_seq_len %d", max_len, max_chunk, cfg_.max_seq_len);
  end_decode();
  adapters_.begin_decode(max_chunk);
  const size_t C = cfg_.n_embd, M = max_len, n = max_chunk, I = cfg_.mlp_size();
  const size_t KVC = static_cast<size_t>(cfg_.kv_heads()) * cfg_.head_size();
  Device& dev = ops_.device();
  auto array = [&](size_t count) { return Array(dev, count); };
  Decode& d = dec_;
  d.max_len = max_len, d.max_chunk = max_chunk;
  d.tokens = DeviceArray<int>(dev, n);
  make_rope_tables(max_len, d.rope_cos, d.rope_sin);
  for (int l = 0; l < cfg_.n_layer; l++) d.k.push_back(array(M * KVC)), d.v.push_back(array(M * KVC));
  d.x = array(n * C), d.ln = array(n * C), d.rstd = array(n), d.qkv = array(n * cfg_.qkv_size());
  d.atty = array(n * cfg_.attn_size()), d.resid2 = array(n * C), d.gate_up = array(n * 2 * I), d.act = array(n * I);
  d.scores = array(n * cfg_.n_head * M), d.logits = array(cfg_.vocab_size);
  if (variant_.qk_norm) {
    const size_t heads = n * (cfg_.n_head + cfg_.kv_heads());
    d.qk_pre = array(heads * cfg_.head_size()), d.qk_normed = array(heads * cfg_.head_size()), d.qk_rstd = array(heads);
  }
}

template <typename Real>
void LlamaModel<Real>::decode_embed(const Real* root, const int* tokens, int n) {
  Decode& d = dec_;
  d.advance(n);
  ops_.device().copy_to_device(d.tokens.data(), tokens, n * sizeof(int));
  ops_.encoder_forward(d.x.data(), d.tokens.data(), param_in(table_, root, ROOT_UNIT, LLAMA_EMBED), nullptr, 1, n,
                       cfg_.n_embd, nullptr);
}

template <typename Real>
void LlamaModel<Real>::decode_block(int l, const Real* w) {
  Decode& d = dec_;
  const int N = d.n, C = cfg_.n_embd, NH = cfg_.n_head, KV = cfg_.kv_heads(), HS = cfg_.head_size();
  const int I = cfg_.mlp_size();
  const Real eps = static_cast<Real>(cfg_.norm_eps);
  auto W = [&](LlamaBlockParam p) { return param_in(table_, w, block_unit(l), p); };
  const size_t half = HS / 2;
  ops_.rmsnorm_forward(d.ln.data(), d.rstd.data(), d.x.data(), W(LLAMA_ATTN_NORM_W), eps, N, C);
  adapters_.linear_decode(l, PRODUCT_QKV, d.qkv.data(), d.ln.data(), W(LLAMA_Q_W), qkv_bias(w, l), C, cfg_.qkv_size(),
                          w, N);
  if (variant_.qk_norm) {
    split_qk(d.qk_pre.data(), d.qkv.data(), N);
    qk_norm_forward(l, w, d.qkv.data(), d.qk_pre.data(), d.qk_normed.data(), d.qk_rstd.data(),
                    d.qk_rstd.data() + static_cast<size_t>(N) * NH, N);
  }
  // Positions start..start+N-1: the tables from row start on, as one sequence of N.
  if (!nope_[l])
    ops_.rope_forward(d.qkv.data(), d.rope_cos.data() + d.start * half, d.rope_sin.data() + d.start * half, 1, N, NH,
                      KV, HS, nullptr);
  ops_.attention_decode(d.atty.data(), d.scores.data(), d.k[l].data(), d.v[l].data(), d.qkv.data(), N, d.start, NH,
                        KV, HS, cfg_.sliding_window);
  adapters_.linear_decode(l, PRODUCT_ATTN_OUT, d.resid2.data(), d.atty.data(), W(LLAMA_O_W), nullptr, NH * HS, C, w,
                          N);
  ops_.residual_forward(d.resid2.data(), d.resid2.data(), d.x.data(), static_cast<size_t>(N) * C);
  ops_.rmsnorm_forward(d.ln.data(), d.rstd.data(), d.resid2.data(), W(LLAMA_MLP_NORM_W), eps, N, C);
  adapters_.linear_decode(l, PRODUCT_MLP_UP, d.gate_up.data(), d.ln.data(), W(LLAMA_GATE_W), nullptr, C, 2 * I, w, N);
  ops_.swiglu_forward(d.act.data(), d.gate_up.data(), N, I);
  adapters_.linear_decode(l, PRODUCT_MLP_DOWN, d.x.data(), d.act.data(), W(LLAMA_DOWN_W), nullptr, I, C, w, N);
  ops_.residual_forward(d.x.data(), d.x.data(), d.resid2.data(), static_cast<size_t>(N) * C);
}

template <typename Real>
void LlamaModel<Real>::decode_head(const Real* root, Real* logits) {
  Decode& d = dec_;
  const int C = cfg_.n_embd, V = cfg_.vocab_size;
  const Real* last = d.x.data() + static_cast<size_t>(d.n - 1) * C;
  ops_.rmsnorm_forward(d.ln.data(), d.rstd.data(), last, param_in(table_, root, ROOT_UNIT, LLAMA_NORM_W),
                       static_cast<Real>(cfg_.norm_eps), 1, C);
  ops_.matmul_forward(d.logits.data(), d.ln.data(), param_in(table_, root, ROOT_UNIT, head_param()), nullptr, 1, C, V);
  ops_.device().copy_to_host(logits, d.logits.data(), d.logits.bytes());
}

template class LlamaModel<float>;
template class LlamaModel<double>;

}  // namespace shardtrain
