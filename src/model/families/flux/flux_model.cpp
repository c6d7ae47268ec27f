// FLUX.1's forward and backward (flux_model.hpp), step for step as diffusers' FluxTransformer2DModel:
//   x = x_embedder(hidden_states), c = context_embedder(encoder_hidden_states)
//   temb = MLP_t(sinusoid(1000 sigma)) [+ MLP_g(sinusoid(1000 g))] + MLP_p(pooled); e = silu(temb)
//   double block, per stream s (image, text): shift1, scale1, gate1, shift2, scale2, gate2 = e W_s + b
//     xn = LN(x)(1 + scale1) + shift1; q, k, v = xn W; q, k = RMSNorm per head
//     joint attention over [text; image] after the rotary turn; a = y W_out
//     x2 = x + gate1 a; x_out = x2 + gate2 FF(LN(x2)(1 + scale2) + shift2), FF = W2 gelu_tanh(W1 .)
//   single block on h = [text; image]: shift, scale, gate = e W + b; hn = LN(h)(1 + scale) + shift
//     out = h + gate proj_out([attention(hn) | gelu_tanh(hn W_mlp)])
//   final: scale, shift = e W + b (that order); out = proj_out(LN(x)(1 + scale) + shift), image rows.
// LN has no affine and eps 1e-6 (model.norm_eps), as the q/k RMSNorm.
#include "model/families/flux/flux_model.hpp"

#include <cmath>

#include "core/error.hpp"
#include "core/random.hpp"
#include "model/param_table.hpp"

namespace shardtrain {

template <typename Real>
typename FluxModel<Real>::Dims FluxModel<Real>::dims_of(const ModelConfig& c, int batch, int image_tokens) {
  Dims d;
  d.B = batch, d.T = image_tokens, d.N = image_tokens + c.condition_len, d.L = c.context_len, d.S = d.L + d.N;
  d.C = c.n_embd, d.H = c.n_head;
  d.D = c.head_size(), d.IN = c.in_channels, d.X = c.context_dim, d.P = c.pooled_dim, d.F = 4 * c.n_embd;
  d.double_blocks = c.n_layer, d.single_blocks = c.n_single_layer, d.guidance = c.guidance_embeds;
  d.eps = static_cast<Real>(c.norm_eps);
  return d;
}

template <typename Real>
template <typename Take>
void FluxModel<Real>::lay_out(Buffers& b, const Dims& d, bool checkpointing, Take&& take) {
  const size_t B = d.B, T = d.T, N = d.N, L = d.L, S = d.S, C = d.C, H = d.H, F = d.F;
  b.in_img = take(B * N * d.IN), b.in_txt = take(B * L * d.X), b.in_pooled = take(B * d.P);
  b.t_proj = take(B * FLUX_TIME_CHANNELS), b.g_proj = take(d.guidance ? B * FLUX_TIME_CHANNELS : 0);
  b.target = take(B * T * d.IN), b.rope_cos = take(S * (d.D / 2)), b.rope_sin = take(S * (d.D / 2));
  b.t_h = take(B * C), b.t_a = take(B * C), b.g_h = take(d.guidance ? B * C : 0), b.g_a = take(d.guidance ? B * C : 0);
  b.p_h = take(B * C), b.p_a = take(B * C), b.part = take(B * C), b.temb = take(B * C), b.temb_silu = take(B * C);
  b.img.clear(), b.txt.clear(), b.joint.clear();
  for (int l = 0; l <= d.double_blocks; l++) b.img.push_back(take(B * N * C)), b.txt.push_back(take(B * L * C));
  for (int j = 0; j <= d.single_blocks && d.single_blocks > 0; j++) b.joint.push_back(take(B * S * C));
  b.doubles.clear(), b.singles.clear();
  b.doubles.resize(d.double_blocks == 0 ? 0 : checkpointing ? 1 : d.double_blocks);
  for (DoubleLayer& a : b.doubles) {
    for (int s = 0; s < 2; s++) {
      Stream& t = a.s[s];
      const size_t n = B * (s == 0 ? N : L);  // rows
      t.mod = take(B * 6 * C), t.xn = take(n * C), t.mean1 = take(n), t.rstd1 = take(n);
      t.q = take(n * C), t.k = take(n * C), t.v = take(n * C), t.qn = take(n * C), t.kn = take(n * C);
      t.q_rstd = take(n * H), t.k_rstd = take(n * H), t.y = take(n * C), t.a = take(n * C), t.x2 = take(n * C);
      t.xn2 = take(n * C), t.mean2 = take(n), t.rstd2 = take(n), t.h = take(n * F), t.g = take(n * F);
      t.f = take(n * C);
    }
    a.qkv = take(B * S * 3 * C), a.y = take(B * S * C), a.lse = take(B * H * S);
  }
  b.singles.resize(d.single_blocks == 0 ? 0 : checkpointing ? 1 : d.single_blocks);
  for (SingleLayer& a : b.singles) {
    const size_t n = B * S;
    a.mod = take(B * 3 * C), a.hn = take(n * C), a.mean = take(n), a.rstd = take(n);
    a.q = take(n * C), a.k = take(n * C), a.v = take(n * C), a.qn = take(n * C), a.kn = take(n * C);
    a.q_rstd = take(n * H), a.k_rstd = take(n * H), a.qkv = take(n * 3 * C), a.y = take(n * C);
    a.lse = take(B * H * S), a.m = take(n * F), a.cat = take(n * 5 * C), a.p = take(n * C);
  }
  b.x_final = take(B * T * C), b.mod_out = take(B * 2 * C), b.xo = take(B * T * C), b.xo_mean = take(B * T);
  b.xo_rstd = take(B * T), b.out = take(B * T * d.IN), b.losses = take(B * T);
  const size_t rows = B * S;  // the scratch serves every stream and the joint sequence
  b.d_img = take(B * N * C), b.d_txt = take(B * L * C), b.d_joint = take(d.single_blocks ? rows * C : 0);
  b.d_mod = take(2 * B * 6 * C), b.d_silu = take(B * C), b.d_small = take(B * C), b.d_small2 = take(B * C);
  b.d_a = take(rows * C), b.d_y = take(rows * C), b.d_qkv = take(rows * 3 * C), b.d_q = take(rows * C);
  b.d_k = take(rows * C), b.d_v = take(rows * C), b.d_q_pre = take(rows * C), b.d_k_pre = take(rows * C);
  b.d_xn = take(rows * C), b.d_tmp = take(rows * C), b.d_h = take(rows * F), b.d_g = take(rows * F);
  b.d_cat = take(d.single_blocks ? rows * 5 * C : 0), b.gelu_out = take(d.single_blocks ? rows * F : 0);
  b.d_xo = take(B * T * C), b.d_final = take(B * T * C);
}

template <typename Real>
std::vector<size_t> FluxModel<Real>::buffer_elements(const ModelConfig& c, int batch, int image_tokens,
                                                     bool checkpointing) {
  std::vector<size_t> sizes;
  Buffers b;
  lay_out(b, dims_of(c, batch, image_tokens), checkpointing, [&](size_t n) {
    sizes.push_back(n);
    return Array();
  });
  return sizes;
}

template <typename Real>
FluxModel<Real>::FluxModel(const ParamTable& table, int batch, int image_tokens, bool activation_checkpointing,
                           const LayerOps<Real>& ops)
    : table_(table), ops_(ops), d_(dims_of(table.config(), batch, image_tokens)),
      checkpointing_(activation_checkpointing),
      adapter_bytes_(plan_adapter_bytes(table, batch * d_.S, sizeof(Real),
                                        dropout_key_rows(table.config(), batch, image_tokens))),
      adapters_(table, batch * d_.S, ops, dropout_key_rows(table.config(), batch, image_tokens)) {
  SHARD_CHECK(image_tokens >= 1 && image_tokens <= table.config().max_seq_len, "%d target tokens, max_seq_len %d",
              image_tokens, table.config().max_seq_len);
  // Pair k of rotary axis a turns by id_a * theta^(-2k / axes[a]) (computed in double as diffusers does).
  std::array<int, 3> axes{};
  parse_rope_axes(table.config().rope_axes, &axes);
  for (int a = 0; a < 3; a++)
    for (int k = 0; k < axes[a] / 2; k++) {
      rope_axis_.push_back(a);
      rope_freq_.push_back(1.0 / std::pow(table.config().rope_theta, 2.0 * k / axes[a]));
    }
  lay_out(buf_, d_, checkpointing_, [&](size_t n) {
    bytes_ += n * sizeof(Real);
    return Array(ops.device(), n);
  });
}

// --- inputs ---

template <typename Real>
void FluxModel<Real>::upload(Array& dst, const Batch& batch, const char* name) {
  const float* host = batch.get<float>(name, dst.size());
  if constexpr (std::is_same_v<Real, float>) {
    ops_.device().copy_to_device(dst.data(), host, dst.bytes());
  } else {
    const std::vector<Real> wide(host, host + dst.size());
    ops_.device().copy_to_device(dst.data(), wide.data(), dst.bytes());
  }
}

// diffusers' Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0) of 1000 x the value:
// [cos(t f_j), sin(t f_j)], f_j = 10000^(-j / 128).
template <typename Real>
void FluxModel<Real>::upload_sinusoid(Array& dst, const Batch& batch, const char* name) {
  const float* values = batch.get<float>(name, d_.B);
  const int half = FLUX_TIME_CHANNELS / 2;
  std::vector<Real> host(static_cast<size_t>(d_.B) * FLUX_TIME_CHANNELS);
  for (int b = 0; b < d_.B; b++) {
    // diffusers scales in fp32 and multiplies the fp32 frequencies in fp32; each step here is
    // correctly rounded (frequency and cos/sin from double), so a reference can repeat it exactly.
    const float t = values[b] * 1000.0f;
    for (int j = 0; j < half; j++) {
      const float freq = static_cast<float>(std::exp(-std::log(10000.0) * j / half));
      const double angle = t * freq;  // the fp32 product
      host[static_cast<size_t>(b) * FLUX_TIME_CHANNELS + j] = static_cast<Real>(static_cast<float>(std::cos(angle)));
      host[static_cast<size_t>(b) * FLUX_TIME_CHANNELS + half + j] =
          static_cast<Real>(static_cast<float>(std::sin(angle)));
    }
  }
  ops_.device().copy_to_device(dst.data(), host.data(), dst.bytes());
}

// The rotary tables of the joint sequence [text; image] from the position ids (rope_axis_,
// rope_freq_), computed in double and rounded.
template <typename Real>
void FluxModel<Real>::upload_rope(const Batch& batch) {
  const float* txt = batch.get<float>(FLUX_TXT_IDS, static_cast<size_t>(d_.L) * 3);
  const float* img = batch.get<float>(FLUX_IMG_IDS, static_cast<size_t>(d_.N) * 3);
  // The ids rarely change between micro-batches (one grid per run): the tables are made again
  // only when they do.
  std::vector<float> ids(txt, txt + static_cast<size_t>(d_.L) * 3);
  ids.insert(ids.end(), img, img + static_cast<size_t>(d_.N) * 3);
  if (ids == rope_ids_) return;
  rope_ids_ = std::move(ids);
  const int half = d_.D / 2;
  std::vector<Real> cos(static_cast<size_t>(d_.S) * half), sin(cos.size());
  for (int t = 0; t < d_.S; t++)
    for (int pair = 0; pair < half; pair++) {
      const double angle = static_cast<double>(rope_ids_[3 * t + rope_axis_[pair]]) * rope_freq_[pair];
      cos[static_cast<size_t>(t) * half + pair] = static_cast<Real>(std::cos(angle));
      sin[static_cast<size_t>(t) * half + pair] = static_cast<Real>(std::sin(angle));
    }
  ops_.device().copy_to_device(buf_.rope_cos.data(), cos.data(), buf_.rope_cos.bytes());
  ops_.device().copy_to_device(buf_.rope_sin.data(), sin.data(), buf_.rope_sin.bytes());
}

template <typename Real>
void FluxModel<Real>::join(Real* joint, int joint_width, int column, const Real* stream, int n, int offset,
                           int joint_rows) {
  if (joint_rows == 0) joint_rows = d_.S;
  for (int b = 0; b < d_.B; b++)
    ops_.copy_rows(joint + (static_cast<size_t>(b) * joint_rows + offset) * joint_width + column, joint_width,
                   stream + static_cast<size_t>(b) * n * d_.C, d_.C, n, d_.C);
}

template <typename Real>
void FluxModel<Real>::split(Real* stream, const Real* joint, int joint_width, int column, int n, int offset,
                            int joint_rows) {
  if (joint_rows == 0) joint_rows = d_.S;
  for (int b = 0; b < d_.B; b++)
    ops_.copy_rows(stream + static_cast<size_t>(b) * n * d_.C, d_.C,
                   joint + (static_cast<size_t>(b) * joint_rows + offset) * joint_width + column, joint_width, n,
                   d_.C);
}

// --- forward ---

template <typename Real>
void FluxModel<Real>::embed_forward(const Real* root, const Batch& batch) {
  const int B = d_.B, C = d_.C;
  auto R = [&](int p) { return param_in(table_, root, ROOT_UNIT, p); };
  Buffers& b = buf_;
  root_ = root;
  upload(b.in_img, batch, FLUX_HIDDEN_STATES);
  upload(b.in_txt, batch, FLUX_ENCODER_HIDDEN_STATES);
  upload(b.in_pooled, batch, FLUX_POOLED);
  upload_sinusoid(b.t_proj, batch, FLUX_TIMESTEP);
  if (d_.guidance) upload_sinusoid(b.g_proj, batch, FLUX_GUIDANCE);
  upload_rope(batch);
  ops_.matmul_forward(b.img[0].data(), b.in_img.data(), R(FLUX_X_EMBED_W), R(FLUX_X_EMBED_B), B * d_.N, d_.IN, C);
  ops_.matmul_forward(b.txt[0].data(), b.in_txt.data(), R(FLUX_CTX_EMBED_W), R(FLUX_CTX_EMBED_B), B * d_.L, d_.X, C);
  // The conditioning: each embedder is Linear, SiLU, Linear.
  auto mlp = [&](Real* out, Real* h, Real* a, const Real* in, int in_width, int w1) {
    ops_.matmul_forward(h, in, R(w1), R(w1 + 1), B, in_width, C);
    ops_.silu_forward(a, h, static_cast<size_t>(B) * C);
    ops_.matmul_forward(out, a, R(w1 + 2), R(w1 + 3), B, C, C);
  };
  const size_t BC = static_cast<size_t>(B) * C;
  mlp(b.temb.data(), b.t_h.data(), b.t_a.data(), b.t_proj.data(), FLUX_TIME_CHANNELS, FLUX_TIME_1_W);
  if (d_.guidance) {
    mlp(b.part.data(), b.g_h.data(), b.g_a.data(), b.g_proj.data(), FLUX_TIME_CHANNELS, FLUX_GUIDANCE_1_W);
    ops_.residual_forward(b.temb.data(), b.temb.data(), b.part.data(), BC);
  }
  mlp(b.part.data(), b.p_h.data(), b.p_a.data(), b.in_pooled.data(), d_.P, FLUX_TEXT_1_W);
  ops_.residual_forward(b.temb.data(), b.temb.data(), b.part.data(), BC);
  ops_.silu_forward(b.temb_silu.data(), b.temb.data(), BC);  // what every modulation reads
}

// Adapter dropout's keys, a run per kind of row: the image tokens (B*N), the text tokens (B*L), the
// joint sequence (B*S) and the samples (B, the modulations' rows).
enum FluxKeyRun { FLUX_KEYS_IMAGE, FLUX_KEYS_TEXT, FLUX_KEYS_JOINT, FLUX_KEYS_SAMPLES };

template <typename Real>
int FluxModel<Real>::dropout_key_rows(const ModelConfig& config, int batch, int image_tokens) {
  const Dims d = dims_of(config, batch, image_tokens);
  return 2 * d.B * d.S + d.B;
}

template <typename Real>
size_t FluxModel<Real>::dropout_key_first(int run) const {
  const size_t B = d_.B, N = d_.N, S = d_.S;
  const size_t first[] = {0, B * N, B * S, 2 * B * S};
  return first[run];
}

template <typename Real>
void FluxModel<Real>::set_dropout_keys(const uint64_t* keys) {
  if (!keys || table_.adapter().dropout == 0) return adapters_.set_dropout_keys(nullptr);
  // Each row's key from its sample's (the trainer's key of the sample's first target token, a
  // function of the seed, the step and the sequence), its kind of row and its position: the same
  // masks on any rank count, and none shared between kinds.
  dropout_keys_.resize(dropout_key_rows(table_.config(), d_.B, d_.T));
  const int lengths[] = {d_.N, d_.L, d_.S, 1};
  for (int run = FLUX_KEYS_IMAGE; run <= FLUX_KEYS_SAMPLES; run++)
    for (int b = 0; b < d_.B; b++)
      for (int i = 0; i < lengths[run]; i++)
        dropout_keys_[dropout_key_first(run) + static_cast<size_t>(b) * lengths[run] + i] =
            counter_bits(keys[static_cast<size_t>(b) * d_.T], (static_cast<uint64_t>(run) << 32) | i);
  adapters_.set_dropout_keys(dropout_keys_.data());
}

template <typename Real>
void FluxModel<Real>::select_dropout_keys(int block, int product) {
  int run = FLUX_KEYS_JOINT;
  if (block < d_.double_blocks)
    run = product % FLUX_D_PRODUCTS == FLUX_P_MOD ? FLUX_KEYS_SAMPLES
          : product < FLUX_D_PRODUCTS         ? FLUX_KEYS_IMAGE
                                              : FLUX_KEYS_TEXT;
  else if (product == FLUX_SP_MOD)
    run = FLUX_KEYS_SAMPLES;
  adapters_.select_dropout_keys(dropout_key_first(run));
}

template <typename Real>
void FluxModel<Real>::linear_forward(int block, int product, Real* out, const Real* x, int rows, int in, int width,
                                     const Real* w, int weight) {
  const int unit = block_unit(block);
  select_dropout_keys(block, product);
  ops_.matmul_forward(out, x, param_in(table_, w, unit, weight), param_in(table_, w, unit, weight + 1), rows, in,
                      width);
  adapters_.forward(block, product, x, out, w, rows);
}

template <typename Real>
void FluxModel<Real>::linear_backward(int block, int product, Real* dx, const Real* x, const Real* dout, int rows,
                                      int in, int width, Real* g, const Real* w, int weight) {
  const int unit = block_unit(block);
  select_dropout_keys(block, product);
  const Real* d = adapters_.output_grad(block, product, x, dout, w, g, rows);
  ops_.matmul_backward(dx, grad_in(table_, g, unit, weight), grad_in(table_, g, unit, weight + 1), d, x,
                       param_in(table_, w, unit, weight), rows, in, width);
  adapters_.backward(block, product, x, d, dx, w, g, rows);
}

template <typename Real>
void FluxModel<Real>::qkv_forward(int block, int q_product, Real* q, Real* k, Real* v, Real* qn, Real* kn,
                                  Real* q_rstd, Real* k_rstd, const Real* x, int rows, const Real* w, int q_param) {
  const int C = d_.C;
  auto W = [&](int p) { return param_in(table_, w, block_unit(block), q_param + p); };
  linear_forward(block, q_product, q, x, rows, C, C, w, q_param);
  linear_forward(block, q_product + 1, k, x, rows, C, C, w, q_param + 2);
  linear_forward(block, q_product + 2, v, x, rows, C, C, w, q_param + 4);
  ops_.rmsnorm_forward(qn, q_rstd, q, W(6), d_.eps, rows * d_.H, d_.D);
  ops_.rmsnorm_forward(kn, k_rstd, k, W(7), d_.eps, rows * d_.H, d_.D);
}

template <typename Real>
void FluxModel<Real>::double_forward(int l, const Real* w) {
  const int B = d_.B, C = d_.C;
  DoubleLayer& a = double_layer(l);
  const int rows[2] = {d_.N, d_.L}, offset[2] = {d_.L, 0};  // image rows follow the text's
  const Real* in[2] = {buf_.img[l].data(), buf_.txt[l].data()};
  Real* out[2] = {buf_.img[l + 1].data(), buf_.txt[l + 1].data()};
  for (int s = 0; s < 2; s++) {
    Stream& t = a.s[s];
    const int n = rows[s], p0 = s * FLUX_D_STREAM_PARAMS, q0 = s * FLUX_D_PRODUCTS;
    linear_forward(l, q0 + FLUX_P_MOD, t.mod.data(), buf_.temb_silu.data(), B, C, 6 * C, w, p0 + FLUX_D_MOD_W);
    ops_.modulate_forward(t.xn.data(), t.mean1.data(), t.rstd1.data(), in[s], t.mod.data(), t.mod.data() + C, 6 * C,
                          B, n, C, d_.eps);
    qkv_forward(l, q0 + FLUX_P_Q, t.q.data(), t.k.data(), t.v.data(), t.qn.data(), t.kn.data(), t.q_rstd.data(),
                t.k_rstd.data(), t.xn.data(), B * n, w, p0 + FLUX_D_Q_W);
    join(a.qkv.data(), 3 * C, 0, t.qn.data(), n, offset[s]);
    join(a.qkv.data(), 3 * C, C, t.kn.data(), n, offset[s]);
    join(a.qkv.data(), 3 * C, 2 * C, t.v.data(), n, offset[s]);
  }
  ops_.rope_pairs_forward(a.qkv.data(), buf_.rope_cos.data(), buf_.rope_sin.data(), B, d_.S, d_.H, d_.H, d_.D);
  ops_.bidirectional_attention_forward(a.y.data(), a.lse.data(), a.qkv.data(), B, d_.S, d_.H, d_.D);
  for (int s = 0; s < 2; s++) {
    Stream& t = a.s[s];
    const int n = rows[s], p0 = s * FLUX_D_STREAM_PARAMS, q0 = s * FLUX_D_PRODUCTS;
    const size_t nC = static_cast<size_t>(B) * n * C;
    split(t.y.data(), a.y.data(), C, 0, n, offset[s]);
    linear_forward(l, q0 + FLUX_P_OUT, t.a.data(), t.y.data(), B * n, C, C, w, p0 + FLUX_D_OUT_W);
    ops_.gate_forward(t.x2.data(), in[s], t.a.data(), t.mod.data() + 2 * C, 6 * C, B, n, C);
    ops_.modulate_forward(t.xn2.data(), t.mean2.data(), t.rstd2.data(), t.x2.data(), t.mod.data() + 3 * C,
                          t.mod.data() + 4 * C, 6 * C, B, n, C, d_.eps);
    linear_forward(l, q0 + FLUX_P_FF1, t.h.data(), t.xn2.data(), B * n, C, d_.F, w, p0 + FLUX_D_FF1_W);
    ops_.gelu_forward(t.g.data(), t.h.data(), nC * 4);
    linear_forward(l, q0 + FLUX_P_FF2, t.f.data(), t.g.data(), B * n, d_.F, C, w, p0 + FLUX_D_FF2_W);
    ops_.gate_forward(out[s], t.x2.data(), t.f.data(), t.mod.data() + 5 * C, 6 * C, B, n, C);
  }
}

template <typename Real>
void FluxModel<Real>::single_forward(int j, const Real* w) {
  const int B = d_.B, C = d_.C, S = d_.S, block = d_.double_blocks + j;
  SingleLayer& a = single_layer(j);
  if (j == 0) {  // the streams join: [text; image]
    join(buf_.joint[0].data(), C, 0, buf_.txt[d_.double_blocks].data(), d_.L, 0);
    join(buf_.joint[0].data(), C, 0, buf_.img[d_.double_blocks].data(), d_.N, d_.L);
  }
  const Real* in = buf_.joint[j].data();
  linear_forward(block, FLUX_SP_MOD, a.mod.data(), buf_.temb_silu.data(), B, C, 3 * C, w, FLUX_S_MOD_W);
  ops_.modulate_forward(a.hn.data(), a.mean.data(), a.rstd.data(), in, a.mod.data(), a.mod.data() + C, 3 * C, B, S,
                        C, d_.eps);
  qkv_forward(block, FLUX_SP_Q, a.q.data(), a.k.data(), a.v.data(), a.qn.data(), a.kn.data(), a.q_rstd.data(),
              a.k_rstd.data(), a.hn.data(), B * S, w, FLUX_S_Q_W);
  const int rows = B * S;
  ops_.copy_rows(a.qkv.data(), 3 * C, a.qn.data(), C, rows, C);
  ops_.copy_rows(a.qkv.data() + C, 3 * C, a.kn.data(), C, rows, C);
  ops_.copy_rows(a.qkv.data() + 2 * C, 3 * C, a.v.data(), C, rows, C);
  ops_.rope_pairs_forward(a.qkv.data(), buf_.rope_cos.data(), buf_.rope_sin.data(), B, S, d_.H, d_.H, d_.D);
  ops_.bidirectional_attention_forward(a.y.data(), a.lse.data(), a.qkv.data(), B, S, d_.H, d_.D);
  linear_forward(block, FLUX_SP_MLP, a.m.data(), a.hn.data(), rows, C, d_.F, w, FLUX_S_MLP_W);
  ops_.gelu_forward(buf_.gelu_out.data(), a.m.data(), static_cast<size_t>(rows) * d_.F);
  ops_.copy_rows(a.cat.data(), 5 * C, a.y.data(), C, rows, C);
  ops_.copy_rows(a.cat.data() + C, 5 * C, buf_.gelu_out.data(), d_.F, rows, d_.F);
  linear_forward(block, FLUX_SP_OUT, a.p.data(), a.cat.data(), rows, 5 * C, C, w, FLUX_S_OUT_W);
  ops_.gate_forward(buf_.joint[j + 1].data(), in, a.p.data(), a.mod.data() + 2 * C, 3 * C, B, S, C);
}

template <typename Real>
void FluxModel<Real>::block_forward(int block, const Real* w) {
  if (block < d_.double_blocks)
    double_forward(block, w);
  else
    single_forward(block - d_.double_blocks, w);
}

template <typename Real>
const Real* FluxModel<Real>::predict(const Real* root) {
  const int B = d_.B, C = d_.C, N = d_.T;  // the target tokens
  auto R = [&](int p) { return param_in(table_, root, ROOT_UNIT, p); };
  Buffers& b = buf_;
  if (d_.single_blocks > 0)  // only the target image tokens leave
    split(b.x_final.data(), b.joint[d_.single_blocks].data(), C, 0, N, d_.L);
  else
    split(b.x_final.data(), b.img[d_.double_blocks].data(), C, 0, N, 0, d_.N);
  ops_.matmul_forward(b.mod_out.data(), b.temb_silu.data(), R(FLUX_NORM_OUT_W), R(FLUX_NORM_OUT_B), B, C, 2 * C);
  ops_.modulate_forward(b.xo.data(), b.xo_mean.data(), b.xo_rstd.data(), b.x_final.data(), b.mod_out.data() + C,
                        b.mod_out.data(), 2 * C, B, N, C, d_.eps);  // AdaLayerNormContinuous: scale, then shift
  ops_.matmul_forward(b.out.data(), b.xo.data(), R(FLUX_PROJ_OUT_W), R(FLUX_PROJ_OUT_B), B * N, C, d_.IN);
  return b.out.data();
}

template <typename Real>
void FluxModel<Real>::head_forward(const Real* root, const Batch& batch, double* loss_total) {
  Buffers& b = buf_;
  predict(root);
  upload(b.target, batch, FLUX_TARGET);
  this->loss().forward(ops_, b.losses.data(), b.out.data(), {nullptr, b.target.data()}, d_.B * d_.T, d_.IN);
  ops_.accumulate_sum(loss_total, b.losses.data(), b.losses.size());
}

// --- backward ---

template <typename Real>
void FluxModel<Real>::head_backward(Real* g, const Real* root, Real dloss) {
  const int B = d_.B, C = d_.C, N = d_.T;  // the target tokens
  auto R = [&](int p) { return param_in(table_, root, ROOT_UNIT, p); };
  auto G = [&](int p) { return grad_in(table_, g, ROOT_UNIT, p); };
  Buffers& b = buf_;
  this->loss().backward(ops_, b.out.data(), {nullptr, b.target.data()}, dloss, B * N, d_.IN);
  ops_.matmul_backward(b.d_xo.data(), G(FLUX_PROJ_OUT_W), G(FLUX_PROJ_OUT_B), b.out.data(), b.xo.data(),
                       R(FLUX_PROJ_OUT_W), B * N, C, d_.IN);
  b.d_final.zero();
  ops_.device().zero(b.d_mod.data(), static_cast<size_t>(B) * 2 * C * sizeof(Real));
  ops_.modulate_backward(b.d_final.data(), b.d_mod.data() + C, b.d_mod.data(), b.d_xo.data(), b.x_final.data(),
                         b.mod_out.data(), b.xo_mean.data(), b.xo_rstd.data(), 2 * C, B, N, C);
  // The first contribution to the conditioning's gradient writes it; the blocks' add to it.
  ops_.matmul_backward(b.d_silu.data(), G(FLUX_NORM_OUT_W), G(FLUX_NORM_OUT_B), b.d_mod.data(), b.temb_silu.data(),
                       R(FLUX_NORM_OUT_W), B, C, 2 * C);
  if (d_.single_blocks > 0) {  // the text and condition tokens' rows get no gradient from the loss
    b.d_joint.zero();
    join(b.d_joint.data(), C, 0, b.d_final.data(), N, d_.L);
  } else {
    b.d_img.zero(), b.d_txt.zero();
    join(b.d_img.data(), C, 0, b.d_final.data(), N, 0, d_.N);
  }
}

template <typename Real>
void FluxModel<Real>::modulation_backward(int block, int product, const Real* d_mod, int width, Real* g, const Real* w,
                                          int weight_param) {
  linear_backward(block, product, buf_.d_small.data(), buf_.temb_silu.data(), d_mod, d_.B, d_.C, width, g, w,
                  weight_param);
  ops_.residual_forward(buf_.d_silu.data(), buf_.d_silu.data(), buf_.d_small.data(), buf_.d_silu.size());
}

// From d_q, d_k, d_v (gradients of the normed q, k and of v): the norms' and projections'
// gradients, and the input's in d_xn.
template <typename Real>
void FluxModel<Real>::qkv_backward(int block, int q_product, const Real* x, const Real* q, const Real* k,
                                   const Real* q_rstd, const Real* k_rstd, int rows, Real* g, const Real* w,
                                   int q_param) {
  const int C = d_.C, unit = block_unit(block);
  auto W = [&](int p) { return param_in(table_, w, unit, q_param + p); };
  auto G = [&](int p) { return grad_in(table_, g, unit, q_param + p); };
  Buffers& b = buf_;
  const size_t n = static_cast<size_t>(rows) * C;
  ops_.device().zero(b.d_q_pre.data(), n * sizeof(Real));
  ops_.device().zero(b.d_k_pre.data(), n * sizeof(Real));
  ops_.rmsnorm_backward(b.d_q_pre.data(), G(6), b.d_q.data(), q, W(6), q_rstd, rows * d_.H, d_.D);
  ops_.rmsnorm_backward(b.d_k_pre.data(), G(7), b.d_k.data(), k, W(7), k_rstd, rows * d_.H, d_.D);
  linear_backward(block, q_product, b.d_xn.data(), x, b.d_q_pre.data(), rows, C, C, g, w, q_param);
  linear_backward(block, q_product + 1, b.d_tmp.data(), x, b.d_k_pre.data(), rows, C, C, g, w, q_param + 2);
  ops_.residual_forward(b.d_xn.data(), b.d_xn.data(), b.d_tmp.data(), n);
  linear_backward(block, q_product + 2, b.d_tmp.data(), x, b.d_v.data(), rows, C, C, g, w, q_param + 4);
  ops_.residual_forward(b.d_xn.data(), b.d_xn.data(), b.d_tmp.data(), n);
}

template <typename Real>
void FluxModel<Real>::double_backward(int l, Real* g, const Real* w) {
  const int B = d_.B, C = d_.C;
  if (checkpointing_) double_forward(l, w);  // this block's activations again, from its input
  DoubleLayer& a = double_layer(l);
  Buffers& b = buf_;
  const int rows[2] = {d_.N, d_.L}, offset[2] = {d_.L, 0};
  const Real* in[2] = {b.img[l].data(), b.txt[l].data()};
  Real* d_res[2] = {b.d_img.data(), b.d_txt.data()};  // the running residual gradients
  b.d_mod.zero();
  for (int s = 0; s < 2; s++) {
    Stream& t = a.s[s];
    const int n = rows[s], p0 = s * FLUX_D_STREAM_PARAMS, q0 = s * FLUX_D_PRODUCTS;
    Real* d_mod = b.d_mod.data() + static_cast<size_t>(s) * B * 6 * C;
    ops_.gate_backward(b.d_a.data(), d_mod + 5 * C, d_res[s], t.f.data(), t.mod.data() + 5 * C, 6 * C, B, n, C);
    linear_backward(l, q0 + FLUX_P_FF2, b.d_g.data(), t.g.data(), b.d_a.data(), B * n, d_.F, C, g, w,
                    p0 + FLUX_D_FF2_W);
    ops_.gelu_backward(b.d_h.data(), b.d_g.data(), t.h.data(), static_cast<size_t>(B) * n * d_.F);
    linear_backward(l, q0 + FLUX_P_FF1, b.d_xn.data(), t.xn2.data(), b.d_h.data(), B * n, C, d_.F, g, w,
                    p0 + FLUX_D_FF1_W);
    ops_.modulate_backward(d_res[s], d_mod + 3 * C, d_mod + 4 * C, b.d_xn.data(), t.x2.data(), t.mod.data() + 4 * C,
                           t.mean2.data(), t.rstd2.data(), 6 * C, B, n, C);
    ops_.gate_backward(b.d_a.data(), d_mod + 2 * C, d_res[s], t.a.data(), t.mod.data() + 2 * C, 6 * C, B, n, C);
    linear_backward(l, q0 + FLUX_P_OUT, b.d_tmp.data(), t.y.data(), b.d_a.data(), B * n, C, C, g, w,
                    p0 + FLUX_D_OUT_W);
    join(b.d_y.data(), C, 0, b.d_tmp.data(), n, offset[s]);
  }
  ops_.bidirectional_attention_backward(b.d_qkv.data(), b.d_y.data(), a.qkv.data(), a.y.data(), a.lse.data(), B,
                                        d_.S, d_.H, d_.D);
  ops_.rope_pairs_backward(b.d_qkv.data(), buf_.rope_cos.data(), buf_.rope_sin.data(), B, d_.S, d_.H, d_.H, d_.D);
  for (int s = 0; s < 2; s++) {
    Stream& t = a.s[s];
    const int n = rows[s], p0 = s * FLUX_D_STREAM_PARAMS, q0 = s * FLUX_D_PRODUCTS;
    Real* d_mod = b.d_mod.data() + static_cast<size_t>(s) * B * 6 * C;
    split(b.d_q.data(), b.d_qkv.data(), 3 * C, 0, n, offset[s]);
    split(b.d_k.data(), b.d_qkv.data(), 3 * C, C, n, offset[s]);
    split(b.d_v.data(), b.d_qkv.data(), 3 * C, 2 * C, n, offset[s]);
    qkv_backward(l, q0 + FLUX_P_Q, t.xn.data(), t.q.data(), t.k.data(), t.q_rstd.data(), t.k_rstd.data(), B * n, g,
                 w, p0 + FLUX_D_Q_W);
    ops_.modulate_backward(d_res[s], d_mod, d_mod + C, b.d_xn.data(), in[s], t.mod.data() + C, t.mean1.data(),
                           t.rstd1.data(), 6 * C, B, n, C);
    modulation_backward(l, q0 + FLUX_P_MOD, d_mod, 6 * C, g, w, p0 + FLUX_D_MOD_W);
  }
}

template <typename Real>
void FluxModel<Real>::single_backward(int j, Real* g, const Real* w) {
  const int B = d_.B, C = d_.C, S = d_.S, rows = B * S, block = d_.double_blocks + j;
  if (checkpointing_) single_forward(j, w);
  SingleLayer& a = single_layer(j);
  Buffers& b = buf_;
  b.d_mod.zero();
  ops_.gate_backward(b.d_a.data(), b.d_mod.data() + 2 * C, b.d_joint.data(), a.p.data(), a.mod.data() + 2 * C, 3 * C,
                     B, S, C);
  linear_backward(block, FLUX_SP_OUT, b.d_cat.data(), a.cat.data(), b.d_a.data(), rows, 5 * C, C, g, w,
                  FLUX_S_OUT_W);
  ops_.copy_rows(b.d_y.data(), C, b.d_cat.data(), 5 * C, rows, C);
  ops_.copy_rows(b.d_g.data(), d_.F, b.d_cat.data() + C, 5 * C, rows, d_.F);
  ops_.gelu_backward(b.d_h.data(), b.d_g.data(), a.m.data(), static_cast<size_t>(rows) * d_.F);
  // The MLP's input gradient (kept in d_a while the attention's is computed into d_xn).
  linear_backward(block, FLUX_SP_MLP, b.d_xn.data(), a.hn.data(), b.d_h.data(), rows, C, d_.F, g, w, FLUX_S_MLP_W);
  ops_.bidirectional_attention_backward(b.d_qkv.data(), b.d_y.data(), a.qkv.data(), a.y.data(), a.lse.data(), B, S,
                                        d_.H, d_.D);
  ops_.rope_pairs_backward(b.d_qkv.data(), buf_.rope_cos.data(), buf_.rope_sin.data(), B, S, d_.H, d_.H, d_.D);
  ops_.copy_rows(b.d_q.data(), C, b.d_qkv.data(), 3 * C, rows, C);
  ops_.copy_rows(b.d_k.data(), C, b.d_qkv.data() + C, 3 * C, rows, C);
  ops_.copy_rows(b.d_v.data(), C, b.d_qkv.data() + 2 * C, 3 * C, rows, C);
  ops_.device().copy_on_device(b.d_a.data(), b.d_xn.data(), static_cast<size_t>(rows) * C * sizeof(Real));
  qkv_backward(block, FLUX_SP_Q, a.hn.data(), a.q.data(), a.k.data(), a.q_rstd.data(), a.k_rstd.data(), rows, g, w,
               FLUX_S_Q_W);
  ops_.residual_forward(b.d_xn.data(), b.d_xn.data(), b.d_a.data(), static_cast<size_t>(rows) * C);
  ops_.modulate_backward(b.d_joint.data(), b.d_mod.data(), b.d_mod.data() + C, b.d_xn.data(), b.joint[j].data(),
                         a.mod.data() + C, a.mean.data(), a.rstd.data(), 3 * C, B, S, C);
  modulation_backward(block, FLUX_SP_MOD, b.d_mod.data(), 3 * C, g, w, FLUX_S_MOD_W);
  if (j == 0) {  // the joined stream's gradient back to the two streams
    split(b.d_txt.data(), b.d_joint.data(), C, 0, d_.L, 0);
    split(b.d_img.data(), b.d_joint.data(), C, 0, d_.N, d_.L);
  }
}

template <typename Real>
void FluxModel<Real>::block_backward(int block, Real* g, const Real* w) {
  if (block < d_.double_blocks)
    double_backward(block, g, w);
  else
    single_backward(block - d_.double_blocks, g, w);
}

template <typename Real>
void FluxModel<Real>::embed_backward(Real* g) {
  const int B = d_.B, C = d_.C;
  Buffers& b = buf_;
  auto R = [&](int p) { return param_in(table_, root_, ROOT_UNIT, p); };  // gathered since embed_forward
  auto G = [&](int p) { return grad_in(table_, g, ROOT_UNIT, p); };
  const size_t BC = static_cast<size_t>(B) * C;
  // d temb = silu'(temb) d silu(temb); each embedder's MLP gets all of it.
  ops_.silu_backward(b.d_small.data(), b.d_silu.data(), b.temb.data(), BC);
  auto mlp_backward = [&](const Real* h, const Real* a, const Real* in, int in_width, int w1) {
    ops_.matmul_backward(b.d_small2.data(), G(w1 + 2), G(w1 + 3), b.d_small.data(), a, R(w1 + 2), B, C, C);
    ops_.silu_backward(b.d_small2.data(), b.d_small2.data(), h, BC);
    ops_.matmul_backward(nullptr, G(w1), G(w1 + 1), b.d_small2.data(), in, R(w1), B, in_width, C);
  };
  mlp_backward(b.t_h.data(), b.t_a.data(), b.t_proj.data(), FLUX_TIME_CHANNELS, FLUX_TIME_1_W);
  if (d_.guidance) mlp_backward(b.g_h.data(), b.g_a.data(), b.g_proj.data(), FLUX_TIME_CHANNELS, FLUX_GUIDANCE_1_W);
  mlp_backward(b.p_h.data(), b.p_a.data(), b.in_pooled.data(), d_.P, FLUX_TEXT_1_W);
  ops_.matmul_backward(nullptr, G(FLUX_X_EMBED_W), G(FLUX_X_EMBED_B), b.d_img.data(), b.in_img.data(),
                       R(FLUX_X_EMBED_W), B * d_.N, d_.IN, C);
  ops_.matmul_backward(nullptr, G(FLUX_CTX_EMBED_W), G(FLUX_CTX_EMBED_B), b.d_txt.data(), b.in_txt.data(),
                       R(FLUX_CTX_EMBED_W), B * d_.L, d_.X, C);
}

template class FluxModel<float>;
template class FluxModel<double>;

}  // namespace shardtrain
