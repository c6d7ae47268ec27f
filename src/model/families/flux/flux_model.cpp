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
// FLUX.2 (Flux2Transformer2DModel) differs in: no biases; temb = MLP_t(..) [+ MLP_g(..)] (no pooled
// vector); the modulations e W_img, e W_txt (6 chunks each) and e W_single (3) computed once, in the
// root, for every block of their kind; FF = W2 swiglu(W1 .) (W1: gate | up, 2F wide); a single
// block's q, k, v and MLP input are one product hn W_fused (3C + 2F wide), out = h + gate W_out
// [attention | swiglu(mlp)]; four rotary axes.
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
  d.D = c.head_size(), d.IN = c.in_channels, d.X = c.context_dim, d.P = c.pooled_dim, d.F = flux_mlp_width(c);
  d.flux2 = is_flux2(c), d.A = flux_id_axes(c);
  d.FH = d.flux2 ? 2 * d.F : d.F, d.SW = d.flux2 ? 3 * d.C + 2 * d.F : d.F;
  d.double_blocks = c.n_layer, d.single_blocks = c.n_single_layer, d.guidance = c.guidance_embeds;
  d.eps = static_cast<Real>(c.norm_eps);
  return d;
}

template <typename Real>
typename FluxModel<Real>::Span FluxModel<Real>::Carver::take(Real* base, size_t& used, size_t n) {
  const Span span{base && n ? base + used : nullptr, n};  // an empty one points nowhere
  used += (n + 63) / 64 * 64;  // each array 256-byte aligned (in floats), as the allocator's
  return span;
}

template <typename Real>
typename FluxModel<Real>::Span FluxModel<Real>::Carver::kept(size_t n) {
  Span span;
  if (!recomputing && !half) {
    span = take(own, own_used, n);
  } else {
    span = scratch(n);
    if (!recomputing) {  // 16 bits: the copy the block keeps
      span.half = own_half && n ? own_half + half_used : nullptr;
      half_used += (n + 127) / 128 * 128;  // 256-byte aligned too
    }
  }
  if (kept_list) kept_list->push_back(span);
  return span;
}

template <typename Real>
void FluxModel<Real>::carve(DoubleLayer& a, const Dims& d, Carver& take) {
  const size_t B = d.B, N = d.N, L = d.L, S = d.S, C = d.C, H = d.H, F = d.F, FH = d.FH;
  const size_t mods = d.flux2 ? 0 : 1;  // FLUX.1's modulations are the blocks' own, FLUX.2's the root's
  a.kept.clear(), take.kept_list = &a.kept;
  for (int s = 0; s < 2; s++) {
    Stream& t = a.s[s];
    const size_t n = B * (s == 0 ? N : L);  // rows
    t.mod = take.stat(mods * B * 6 * C), t.xn = take.kept(n * C), t.mean1 = take.stat(n), t.rstd1 = take.stat(n);
    // v, qn and kn live on in the joint qkv; y is split from the joint y again in the backward
    t.att = {take.kept(n * C), take.kept(n * C), take.scratch(n * C), take.scratch(n * C), take.scratch(n * C),
             take.stat(n * H), take.stat(n * H)};
    t.y = take.scratch(n * C), t.a = take.kept(n * C), t.x2 = take.kept(n * C), t.xn2 = take.kept(n * C);
    // g, the MLP's activation of h, is made again from h in the backward
    t.mean2 = take.stat(n), t.rstd2 = take.stat(n), t.h = take.kept(n * FH), t.g = take.scratch(n * F);
    t.f = take.kept(n * C);
  }
  a.qkv = take.kept(B * S * 3 * C), a.y = take.kept(B * S * C), a.lse = take.stat(B * H * S);
  take.kept_list = nullptr;
}

template <typename Real>
void FluxModel<Real>::carve(SingleLayer& a, const Dims& d, Carver& take) {
  const size_t B = d.B, S = d.S, C = d.C, H = d.H, F = d.F, FH = d.FH, n = B * S;
  const size_t mods = d.flux2 ? 0 : 1;
  a.kept.clear(), take.kept_list = &a.kept;
  a.mod = take.stat(mods * B * 3 * C), a.hn = take.kept(n * C), a.mean = take.stat(n), a.rstd = take.stat(n);
  a.att = {take.kept(n * C), take.kept(n * C), take.scratch(n * C), take.scratch(n * C), take.scratch(n * C),
           take.stat(n * H), take.stat(n * H)};
  // cat = [y | the MLP's activation of m] is made again from y and m in the backward (join_cat)
  a.qkv = take.kept(n * 3 * C), a.y = take.kept(n * C), a.lse = take.stat(B * H * S), a.m = take.kept(n * FH);
  a.cat = take.scratch(n * (C + F)), a.p = take.kept(n * C);
  take.kept_list = nullptr;
}

template <typename Real>
template <typename Take, typename TakeHalf>
void FluxModel<Real>::lay_out(Buffers& b, const Dims& d, Checkpointing checkpointing, DType activation_dtype,
                              Take&& take, TakeHalf&& take_half) {
  const size_t B = d.B, T = d.T, N = d.N, L = d.L, S = d.S, C = d.C, F = d.F, FH = d.FH;
  const size_t mods = d.flux2 ? 0 : 1;
  b.in_img = take(B * N * d.IN), b.in_txt = take(B * L * d.X), b.in_pooled = take(B * d.P);
  b.t_proj = take(B * FLUX_TIME_CHANNELS), b.g_proj = take(d.guidance ? B * FLUX_TIME_CHANNELS : 0);
  b.target = take(B * T * d.IN), b.rope_cos = take(S * (d.D / 2)), b.rope_sin = take(S * (d.D / 2));
  b.t_h = take(B * C), b.t_a = take(B * C), b.g_h = take(d.guidance ? B * C : 0), b.g_a = take(d.guidance ? B * C : 0);
  const size_t pooled = d.P > 0 ? 1 : 0;
  b.p_h = take(pooled * B * C), b.p_a = take(pooled * B * C), b.part = take(B * C), b.temb = take(B * C);
  b.temb_silu = take(B * C);
  for (int s = 0; s < 3; s++) b.shared_mod[s] = take((1 - mods) * B * (s < 2 ? 6 : 3) * C);
  const bool half = activation_dtype != DTYPE_FP32;
  auto block_inputs = [&](BlockInputs& s, int count, size_t n) {
    s.work.clear(), s.half.clear();
    for (int i = 0; i < (half ? std::min(count, 2) : count); i++) s.work.push_back(take(n));
    for (int i = 0; half && i < count - 1; i++) s.half.push_back(take_half(n));
  };
  block_inputs(b.img, d.double_blocks + 1, B * N * C);
  block_inputs(b.txt, d.double_blocks + 1, B * L * C);
  block_inputs(b.joint, d.single_blocks > 0 ? d.single_blocks + 1 : 0, B * S * C);
  // The blocks' working sets (Carver): the shared one, then the own regions of each block that keeps
  // its activations (a set of a kind's blocks: the first shared by those that recompute).
  const CheckpointedRun runs[2] = {checkpointing.run(0, d.double_blocks),
                                   checkpointing.run(d.double_blocks, d.single_blocks)};
  b.doubles.assign(runs[0].sets(), DoubleLayer{});
  b.singles.assign(runs[1].sets(), SingleLayer{});
  auto carver = [&](Real* shared, Real* own, uint16_t* own_half, bool recomputing) {
    Carver c;
    c.shared = shared, c.own = own, c.own_half = own_half, c.recomputing = recomputing, c.half = half;
    return c;
  };
  // Each kind's sizes as a recomputing block and as a keeping one carves them; [kind][recomputing]
  Carver sizes[2][2];
  for (int r = 0; r < 2; r++) {
    sizes[0][r] = sizes[1][r] = carver(nullptr, nullptr, nullptr, r == 1);
    DoubleLayer double_sizes;
    SingleLayer single_sizes;
    carve(double_sizes, d, sizes[0][r]), carve(single_sizes, d, sizes[1][r]);
  }
  size_t shared_used = 0;
  for (int kind = 0; kind < 2; kind++) {
    if (runs[kind].recomputed > 0) shared_used = std::max(shared_used, sizes[kind][1].shared_used);
    if (runs[kind].recomputed < runs[kind].blocks) shared_used = std::max(shared_used, sizes[kind][0].shared_used);
  }
  b.regions.clear(), b.half_regions.clear();
  if (!b.doubles.empty() || !b.singles.empty()) b.regions.push_back(take(shared_used));
  Real* shared = b.regions.empty() ? nullptr : b.regions[0].data();
  // (a region moved by the vectors' growth keeps its memory: the spans stay valid)
  auto carve_sets = [&](auto& sets, int kind) {
    for (size_t i = 0; i < sets.size(); i++) {
      const bool recomputing = i == 0 && runs[kind].recomputed > 0;
      const Carver& size = sizes[kind][recomputing];
      Real* own = nullptr;
      uint16_t* own_half = nullptr;
      if (size.own_used) b.regions.push_back(take(size.own_used)), own = b.regions.back().data();
      if (size.half_used) b.half_regions.push_back(take_half(size.half_used)), own_half = b.half_regions.back().data();
      Carver from = carver(shared, own, own_half, recomputing);
      carve(sets[i], d, from);
    }
  };
  carve_sets(b.doubles, 0), carve_sets(b.singles, 1);
  b.x_final = take(B * T * C), b.mod_out = take(B * 2 * C), b.xo = take(B * T * C), b.xo_mean = take(B * T);
  b.xo_rstd = take(B * T), b.out = take(B * T * d.IN), b.losses = take(B * T);
  const size_t rows = B * S;  // the scratch serves every stream and the joint sequence
  b.d_img = take(B * N * C), b.d_txt = take(B * L * C), b.d_joint = take(d.single_blocks ? rows * C : 0);
  b.d_mod = take(mods * 2 * B * 6 * C), b.d_silu = take(B * C), b.d_small = take(B * C), b.d_small2 = take(B * C);
  for (int s = 0; s < 3; s++) b.d_shared_mod[s] = take((1 - mods) * B * (s < 2 ? 6 : 3) * C);
  b.d_a = take(rows * C), b.d_y = take(rows * C), b.d_q = {b.d_y.data(), rows * C};
  b.d_k = take(rows * C), b.d_v = take(rows * C), b.d_q_pre = take(rows * C), b.d_k_pre = take(rows * C);
  b.d_xn = take(rows * C), b.d_tmp = take(rows * C);
  b.d_h = take(rows * (d.single_blocks ? std::max<size_t>(FH, d.SW) : FH));  // a single block's fused product's too
  b.d_g = take(rows * F);
  const size_t cat = d.single_blocks ? rows * (C + F) : 0, gate_up = d.single_blocks && d.flux2 ? rows * FH : 0;
  b.d_wide = take(std::max({cat, rows * 3 * C, gate_up}));
  b.d_cat = {b.d_wide.data(), cat}, b.d_qkv = {b.d_wide.data(), rows * 3 * C}, b.d_gate_up = {b.d_wide.data(), gate_up};
  b.d_xo = take(B * T * C), b.d_final = take(B * T * C);
}

template <typename Real>
std::vector<size_t> FluxModel<Real>::buffer_elements(const ModelConfig& c, int batch, int image_tokens,
                                                     Checkpointing checkpointing, DType activation_dtype) {
  std::vector<size_t> sizes;
  // Counting only: the arrays taken are empty, the regions' spans null.
  Buffers b;
  lay_out(
      b, dims_of(c, batch, image_tokens), checkpointing, activation_dtype,
      [&](size_t n) {
        sizes.push_back(n);
        return Array();
      },
      [&](size_t n) {
        sizes.push_back(half_as_reals(n));
        return DeviceArray<uint16_t>();
      });
  return sizes;
}

template <typename Real>
FluxModel<Real>::FluxModel(const ParamTable& table, int batch, int image_tokens, Checkpointing activation_checkpointing,
                           const LayerOps<Real>& ops, DType activation_dtype)
    : table_(table), ops_(ops), d_(dims_of(table.config(), batch, image_tokens)), lay_(flux_layout(table.config())),
      doubles_(activation_checkpointing.run(0, d_.double_blocks)),
      singles_(activation_checkpointing.run(d_.double_blocks, d_.single_blocks)), activation_dtype_(activation_dtype),
      adapter_bytes_(plan_adapter_bytes(table, batch * d_.S, sizeof(Real),
                                        dropout_key_rows(table.config(), batch, image_tokens))),
      adapters_(table, batch * d_.S, ops, dropout_key_rows(table.config(), batch, image_tokens)) {
  SHARD_CHECK(image_tokens >= 1 && image_tokens <= table.config().max_seq_len, "%d target tokens, max_seq_len %d",
              image_tokens, table.config().max_seq_len);
  // Pair k of rotary axis a turns by id_a * theta^(-2k / axes[a]) (computed in double as diffusers does).
  std::vector<int> axes;
  parse_rope_axes(table.config().rope_axes, d_.A, &axes);
  for (int a = 0; a < d_.A; a++)
    for (int k = 0; k < axes[a] / 2; k++) {
      rope_axis_.push_back(a);
      rope_freq_.push_back(1.0 / std::pow(table.config().rope_theta, 2.0 * k / axes[a]));
    }
  lay_out(
      buf_, d_, activation_checkpointing, activation_dtype_,
      [&](size_t n) {
        bytes_ += n * sizeof(Real);
        return Array(ops.device(), n);
      },
      [&](size_t n) {
        const size_t elements = half_as_reals(n) * sizeof(Real) / sizeof(uint16_t);
        bytes_ += elements * sizeof(uint16_t);
        return DeviceArray<uint16_t>(ops.device(), elements);
      });
}

template <typename Real>
void FluxModel<Real>::keep_input(BlockInputs& s, int i) {
  if (i >= static_cast<int>(s.half.size())) return;  // fp32, or the last index
  Array& work = s.work[i % 2];
  ops_.round_to_half(work.data(), s.half[i].data(), work.size(), activation_dtype_);
}

template <typename Real>
void FluxModel<Real>::restore_input(BlockInputs& s, int i) {
  if (s.half.empty()) return;
  Array& work = s.work[i % 2];
  ops_.widen_half(work.data(), s.half[i].data(), work.size(), activation_dtype_);
}

template <typename Real>
void FluxModel<Real>::keep(const Span& s) {
  if (activation_dtype_ != DTYPE_FP32) ops_.round_to_half(s.data(), s.half, s.size(), activation_dtype_);
}

template <typename Real>
void FluxModel<Real>::restore(const std::vector<Span>& kept) {
  for (const Span& s : kept)
    if (s.half) ops_.widen_half(s.data(), s.half, s.size(), activation_dtype_);
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
  const size_t A = d_.A;
  const float* txt = batch.get<float>(FLUX_TXT_IDS, d_.L * A);
  const float* img = batch.get<float>(FLUX_IMG_IDS, d_.N * A);
  // The ids rarely change between micro-batches (one grid per run): the tables are made again
  // only when they do.
  std::vector<float> ids(txt, txt + d_.L * A);
  ids.insert(ids.end(), img, img + d_.N * A);
  if (ids == rope_ids_) return;
  rope_ids_ = std::move(ids);
  const int half = d_.D / 2;
  std::vector<Real> cos(static_cast<size_t>(d_.S) * half), sin(cos.size());
  for (int t = 0; t < d_.S; t++)
    for (int pair = 0; pair < half; pair++) {
      const double angle = static_cast<double>(rope_ids_[A * t + rope_axis_[pair]]) * rope_freq_[pair];
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
const Real* FluxModel<Real>::at(const Real* w, int unit, int position) const {
  return position < 0 ? nullptr : param_in(table_, w, unit, position);
}

template <typename Real>
Real* FluxModel<Real>::grad_at(Real* g, int unit, int position) const {
  return position < 0 ? nullptr : grad_in(table_, g, unit, position);
}

template <typename Real>
void FluxModel<Real>::root_linear_forward(Real* out, const Real* x, int rows, int in, int width, FluxLinear lin) {
  ops_.matmul_forward(out, x, at(root_, ROOT_UNIT, lin.weight), at(root_, ROOT_UNIT, lin.bias), rows, in, width);
}

template <typename Real>
void FluxModel<Real>::root_linear_backward(Real* dx, const Real* x, const Real* dout, int rows, int in, int width,
                                           Real* g, FluxLinear lin) {
  ops_.matmul_backward(dx, grad_at(g, ROOT_UNIT, lin.weight), grad_at(g, ROOT_UNIT, lin.bias), dout, x,
                       at(root_, ROOT_UNIT, lin.weight), rows, in, width);
}

template <typename Real>
void FluxModel<Real>::embed_forward(const Real* root, const Batch& batch) {
  const int B = d_.B, C = d_.C;
  Buffers& b = buf_;
  root_ = root;
  upload(b.in_img, batch, FLUX_HIDDEN_STATES);
  upload(b.in_txt, batch, FLUX_ENCODER_HIDDEN_STATES);
  if (d_.P > 0) upload(b.in_pooled, batch, FLUX_POOLED);
  upload_sinusoid(b.t_proj, batch, FLUX_TIMESTEP);
  if (d_.guidance) upload_sinusoid(b.g_proj, batch, FLUX_GUIDANCE);
  upload_rope(batch);
  root_linear_forward(input(b.img, 0), b.in_img.data(), B * d_.N, d_.IN, C, lay_.x_embed);
  root_linear_forward(input(b.txt, 0), b.in_txt.data(), B * d_.L, d_.X, C, lay_.ctx_embed);
  keep_input(b.img, 0), keep_input(b.txt, 0);
  // The conditioning: each embedder is Linear, SiLU, Linear.
  auto mlp = [&](Real* out, Real* h, Real* a, const Real* in, int in_width, FluxLinear first, FluxLinear second) {
    root_linear_forward(h, in, B, in_width, C, first);
    ops_.silu_forward(a, h, static_cast<size_t>(B) * C);
    root_linear_forward(out, a, B, C, C, second);
  };
  const size_t BC = static_cast<size_t>(B) * C;
  mlp(b.temb.data(), b.t_h.data(), b.t_a.data(), b.t_proj.data(), FLUX_TIME_CHANNELS, lay_.time1, lay_.time2);
  if (d_.guidance) {
    mlp(b.part.data(), b.g_h.data(), b.g_a.data(), b.g_proj.data(), FLUX_TIME_CHANNELS, lay_.guidance1,
        lay_.guidance2);
    ops_.residual_forward(b.temb.data(), b.temb.data(), b.part.data(), BC);
  }
  if (d_.P > 0) {
    mlp(b.part.data(), b.p_h.data(), b.p_a.data(), b.in_pooled.data(), d_.P, lay_.text1, lay_.text2);
    ops_.residual_forward(b.temb.data(), b.temb.data(), b.part.data(), BC);
  }
  ops_.silu_forward(b.temb_silu.data(), b.temb.data(), BC);  // what every modulation reads
  if (d_.flux2)  // FLUX.2's modulations, once for every block of their kind
    for (int s = 0; s < 3; s++)
      root_linear_forward(b.shared_mod[s].data(), b.temb_silu.data(), B, C, (s < 2 ? 6 : 3) * C, lay_.shared_mod[s]);
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
                                     const Real* w, FluxLinear lin) {
  const int unit = block_unit(block);
  select_dropout_keys(block, product);
  adapters_.linear_forward(block, product, out, x, at(w, unit, lin.weight), at(w, unit, lin.bias), in, width, w, rows);
}

template <typename Real>
void FluxModel<Real>::linear_backward(int block, int product, Real* dx, const Real* x, const Real* dout, int rows,
                                      int in, int width, Real* g, const Real* w, FluxLinear lin) {
  const int unit = block_unit(block);
  select_dropout_keys(block, product);
  adapters_.linear_backward(block, product, dx, grad_at(g, unit, lin.weight), grad_at(g, unit, lin.bias), dout, x,
                            at(w, unit, lin.weight), in, width, w, g, rows);
}

template <typename Real>
void FluxModel<Real>::qk_norm_forward(int block, Attention& att, int rows, const Real* w, int norm_q, int norm_k) {
  const int unit = block_unit(block);
  keep(att.q), keep(att.k);
  ops_.rmsnorm_forward(att.qn.data(), att.q_rstd.data(), att.q.data(), at(w, unit, norm_q), d_.eps, rows * d_.H, d_.D);
  ops_.rmsnorm_forward(att.kn.data(), att.k_rstd.data(), att.k.data(), at(w, unit, norm_k), d_.eps, rows * d_.H, d_.D);
}

template <typename Real>
void FluxModel<Real>::qkv_forward(int block, int q_product, Attention& att, const Real* x, int rows, const Real* w,
                                  const FluxLayout::Stream& lin) {
  const int C = d_.C;
  linear_forward(block, q_product, att.q.data(), x, rows, C, C, w, lin.q);
  linear_forward(block, q_product + 1, att.k.data(), x, rows, C, C, w, lin.k);
  linear_forward(block, q_product + 2, att.v.data(), x, rows, C, C, w, lin.v);
  qk_norm_forward(block, att, rows, w, lin.norm_q, lin.norm_k);
}

template <typename Real>
void FluxModel<Real>::mlp_activation_forward(const Span& g, const Real* h, int rows) {
  if (d_.flux2)
    ops_.swiglu_forward(g.data(), h, rows, d_.F);
  else
    ops_.gelu_forward(g.data(), h, static_cast<size_t>(rows) * d_.F);
  keep(g);
}

template <typename Real>
void FluxModel<Real>::mlp_activation_backward(Real* dh, const Real* dg, const Real* h, int rows) {
  if (d_.flux2)
    ops_.swiglu_backward(dh, dg, h, rows, d_.F);
  else
    ops_.gelu_backward(dh, dg, h, static_cast<size_t>(rows) * d_.F);
}

template <typename Real>
void FluxModel<Real>::double_forward(int l, const Real* w, bool recompute) {
  const int B = d_.B, C = d_.C;
  DoubleLayer& a = double_layer(l);
  const int rows[2] = {d_.N, d_.L}, offset[2] = {d_.L, 0};  // image rows follow the text's
  const Real* in[2] = {input(buf_.img, l), input(buf_.txt, l)};
  Real* out[2] = {input(buf_.img, l + 1), input(buf_.txt, l + 1)};
  for (int s = 0; s < 2; s++) {
    Stream& t = a.s[s];
    const FluxLayout::Stream& lin = lay_.stream[s];
    const int n = rows[s], q0 = s * FLUX_D_PRODUCTS;
    if (!d_.flux2)
      linear_forward(l, q0 + FLUX_P_MOD, t.mod.data(), buf_.temb_silu.data(), B, C, 6 * C, w, lin.mod);
    const Real* mod = modulation(s, t.mod.data());
    ops_.modulate_forward(t.xn.data(), t.mean1.data(), t.rstd1.data(), in[s], mod, mod + C, 6 * C, B, n, C, d_.eps);
    keep(t.xn);
    qkv_forward(l, q0 + FLUX_P_Q, t.att, t.xn.data(), B * n, w, lin);
    join(a.qkv.data(), 3 * C, 0, t.att.qn.data(), n, offset[s]);
    join(a.qkv.data(), 3 * C, C, t.att.kn.data(), n, offset[s]);
    join(a.qkv.data(), 3 * C, 2 * C, t.att.v.data(), n, offset[s]);
  }
  ops_.rope_pairs_forward(a.qkv.data(), buf_.rope_cos.data(), buf_.rope_sin.data(), B, d_.S, d_.H, d_.H, d_.D);
  keep(a.qkv);
  ops_.bidirectional_attention_forward(a.y.data(), a.lse.data(), a.qkv.data(), B, d_.S, d_.H, d_.D);
  keep(a.y);
  for (int s = 0; s < 2; s++) {
    Stream& t = a.s[s];
    const FluxLayout::Stream& lin = lay_.stream[s];
    const int n = rows[s], q0 = s * FLUX_D_PRODUCTS;
    const Real* mod = modulation(s, t.mod.data());
    split(t.y.data(), a.y.data(), C, 0, n, offset[s]);
    linear_forward(l, q0 + FLUX_P_OUT, t.a.data(), t.y.data(), B * n, C, C, w, lin.out);
    keep(t.a);
    ops_.gate_forward(t.x2.data(), in[s], t.a.data(), mod + 2 * C, 6 * C, B, n, C);
    keep(t.x2);
    ops_.modulate_forward(t.xn2.data(), t.mean2.data(), t.rstd2.data(), t.x2.data(), mod + 3 * C, mod + 4 * C, 6 * C,
                          B, n, C, d_.eps);
    keep(t.xn2);
    linear_forward(l, q0 + FLUX_P_FF1, t.h.data(), t.xn2.data(), B * n, C, d_.FH, w, lin.ff1);
    keep(t.h);
    mlp_activation_forward(t.g, t.h.data(), B * n);
    linear_forward(l, q0 + FLUX_P_FF2, t.f.data(), t.g.data(), B * n, d_.F, C, w, lin.ff2);
    keep(t.f);
    ops_.gate_forward(out[s], t.x2.data(), t.f.data(), mod + 5 * C, 6 * C, B, n, C);
  }
  if (!recompute) keep_input(buf_.img, l + 1), keep_input(buf_.txt, l + 1);
}

// FLUX.2's single block up to its output product: q|k|v|gate|up = hn W_fused, q and k normed, the
// attention in y and [y | swiglu(gate | up)] in cat.
template <typename Real>
void FluxModel<Real>::single_fused_forward(SingleLayer& a, int block, const Real* w) {
  const int B = d_.B, C = d_.C, S = d_.S, rows = B * S, SW = d_.SW;
  // The product goes through d_h (rows x SW), a backward scratch free here: a block's backward
  // writes it only after its recompute.
  Real* fused = buf_.d_h.data();
  linear_forward(block, FLUX_SP_QKV_MLP, fused, a.hn.data(), rows, C, SW, w, lay_.s_qkv_mlp);
  ops_.copy_rows(a.att.q.data(), C, fused, SW, rows, C);
  ops_.copy_rows(a.att.k.data(), C, fused + C, SW, rows, C);
  ops_.copy_rows(a.att.v.data(), C, fused + 2 * C, SW, rows, C);
  ops_.copy_rows(a.m.data(), d_.FH, fused + 3 * C, SW, rows, d_.FH);
  keep(a.m);
  qk_norm_forward(block, a.att, rows, w, lay_.s_norm_q, lay_.s_norm_k);
}

template <typename Real>
void FluxModel<Real>::join_cat(SingleLayer& a) {
  const int rows = d_.B * d_.S, C = d_.C, F = d_.F;
  // The MLP's output goes through d_g (rows x F), a backward scratch free here: a block's backward
  // writes it only after its recompute, or after this.
  Real* mlp_out = buf_.d_g.data();
  mlp_activation_forward(Span{mlp_out, static_cast<size_t>(rows) * F}, a.m.data(), rows);
  ops_.copy_rows(a.cat.data(), C + F, a.y.data(), C, rows, C);
  ops_.copy_rows(a.cat.data() + C, C + F, mlp_out, F, rows, F);
}

template <typename Real>
void FluxModel<Real>::single_forward(int j, const Real* w, bool recompute) {
  const int B = d_.B, C = d_.C, S = d_.S, block = d_.double_blocks + j, F = d_.F;
  SingleLayer& a = single_layer(j);
  if (j == 0 && !recompute) {  // the streams join: [text; image]
    join(input(buf_.joint, 0), C, 0, input(buf_.txt, d_.double_blocks), d_.L, 0);
    join(input(buf_.joint, 0), C, 0, input(buf_.img, d_.double_blocks), d_.N, d_.L);
    keep_input(buf_.joint, 0);
  }
  const Real* in = input(buf_.joint, j);
  if (!d_.flux2) linear_forward(block, FLUX_SP_MOD, a.mod.data(), buf_.temb_silu.data(), B, C, 3 * C, w, lay_.s_mod);
  const Real* mod = modulation(2, a.mod.data());
  ops_.modulate_forward(a.hn.data(), a.mean.data(), a.rstd.data(), in, mod, mod + C, 3 * C, B, S, C, d_.eps);
  keep(a.hn);
  const int rows = B * S;
  if (d_.flux2) {
    single_fused_forward(a, block, w);  // q, k, v and the MLP's input product at once
  } else {
    const FluxLayout::Stream lin{{}, lay_.s_q, lay_.s_k, lay_.s_v, {}, {}, {}, lay_.s_norm_q, lay_.s_norm_k};
    qkv_forward(block, FLUX_SP_Q, a.att, a.hn.data(), rows, w, lin);
  }
  ops_.copy_rows(a.qkv.data(), 3 * C, a.att.qn.data(), C, rows, C);
  ops_.copy_rows(a.qkv.data() + C, 3 * C, a.att.kn.data(), C, rows, C);
  ops_.copy_rows(a.qkv.data() + 2 * C, 3 * C, a.att.v.data(), C, rows, C);
  ops_.rope_pairs_forward(a.qkv.data(), buf_.rope_cos.data(), buf_.rope_sin.data(), B, S, d_.H, d_.H, d_.D);
  keep(a.qkv);
  ops_.bidirectional_attention_forward(a.y.data(), a.lse.data(), a.qkv.data(), B, S, d_.H, d_.D);
  keep(a.y);
  if (!d_.flux2) {
    linear_forward(block, FLUX_SP_MLP, a.m.data(), a.hn.data(), rows, C, F, w, lay_.s_mlp);
    keep(a.m);
  }
  join_cat(a);
  linear_forward(block, FLUX_SP_OUT, a.p.data(), a.cat.data(), rows, C + F, C, w, lay_.s_out);
  keep(a.p);
  ops_.gate_forward(input(buf_.joint, j + 1), in, a.p.data(), mod + 2 * C, 3 * C, B, S, C);
  if (!recompute) keep_input(buf_.joint, j + 1);
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
  Buffers& b = buf_;
  root_ = root;
  if (d_.single_blocks > 0)  // only the target image tokens leave
    split(b.x_final.data(), input(b.joint, d_.single_blocks), C, 0, N, d_.L);
  else
    split(b.x_final.data(), input(b.img, d_.double_blocks), C, 0, N, 0, d_.N);
  root_linear_forward(b.mod_out.data(), b.temb_silu.data(), B, C, 2 * C, lay_.norm_out);
  ops_.modulate_forward(b.xo.data(), b.xo_mean.data(), b.xo_rstd.data(), b.x_final.data(), b.mod_out.data() + C,
                        b.mod_out.data(), 2 * C, B, N, C, d_.eps);  // AdaLayerNormContinuous: scale, then shift
  root_linear_forward(b.out.data(), b.xo.data(), B * N, C, d_.IN, lay_.proj_out);
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
  Buffers& b = buf_;
  root_ = root;
  this->loss().backward(ops_, b.out.data(), {nullptr, b.target.data()}, dloss, B * N, d_.IN);
  root_linear_backward(b.d_xo.data(), b.xo.data(), b.out.data(), B * N, C, d_.IN, g, lay_.proj_out);
  b.d_final.zero();
  Real* d_mod_out = d_.flux2 ? b.d_shared_mod[0].data() : b.d_mod.data();  // scratch until the blocks need it
  ops_.device().zero(d_mod_out, static_cast<size_t>(B) * 2 * C * sizeof(Real));
  ops_.modulate_backward(b.d_final.data(), d_mod_out + C, d_mod_out, b.d_xo.data(), b.x_final.data(),
                         b.mod_out.data(), b.xo_mean.data(), b.xo_rstd.data(), 2 * C, B, N, C);
  // The first contribution to the conditioning's gradient writes it; the blocks' add to it.
  root_linear_backward(b.d_silu.data(), b.temb_silu.data(), d_mod_out, B, C, 2 * C, g, lay_.norm_out);
  if (d_.flux2)  // the blocks add their modulations' gradients up here
    for (Array& d : b.d_shared_mod) d.zero();
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
                                          FluxLinear lin) {
  linear_backward(block, product, buf_.d_small.data(), buf_.temb_silu.data(), d_mod, d_.B, d_.C, width, g, w, lin);
  ops_.residual_forward(buf_.d_silu.data(), buf_.d_silu.data(), buf_.d_small.data(), buf_.d_silu.size());
}

template <typename Real>
void FluxModel<Real>::qk_norm_backward(int block, const Attention& att, int rows, Real* g, const Real* w, int norm_q,
                                       int norm_k) {
  const int unit = block_unit(block);
  Buffers& b = buf_;
  const size_t n = static_cast<size_t>(rows) * d_.C;
  ops_.device().zero(b.d_q_pre.data(), n * sizeof(Real));
  ops_.device().zero(b.d_k_pre.data(), n * sizeof(Real));
  ops_.rmsnorm_backward(b.d_q_pre.data(), grad_at(g, unit, norm_q), b.d_q.data(), att.q.data(), at(w, unit, norm_q),
                        att.q_rstd.data(), rows * d_.H, d_.D);
  ops_.rmsnorm_backward(b.d_k_pre.data(), grad_at(g, unit, norm_k), b.d_k.data(), att.k.data(), at(w, unit, norm_k),
                        att.k_rstd.data(), rows * d_.H, d_.D);
}

// From d_q, d_k, d_v (gradients of the normed q, k and of v): the norms' and projections'
// gradients, and the input's in d_xn.
template <typename Real>
void FluxModel<Real>::qkv_backward(int block, int q_product, const Real* x, const Attention& att, int rows, Real* g,
                                   const Real* w, const FluxLayout::Stream& lin) {
  const int C = d_.C;
  Buffers& b = buf_;
  const size_t n = static_cast<size_t>(rows) * C;
  qk_norm_backward(block, att, rows, g, w, lin.norm_q, lin.norm_k);
  linear_backward(block, q_product, b.d_xn.data(), x, b.d_q_pre.data(), rows, C, C, g, w, lin.q);
  linear_backward(block, q_product + 1, b.d_tmp.data(), x, b.d_k_pre.data(), rows, C, C, g, w, lin.k);
  ops_.residual_forward(b.d_xn.data(), b.d_xn.data(), b.d_tmp.data(), n);
  linear_backward(block, q_product + 2, b.d_tmp.data(), x, b.d_v.data(), rows, C, C, g, w, lin.v);
  ops_.residual_forward(b.d_xn.data(), b.d_xn.data(), b.d_tmp.data(), n);
}

template <typename Real>
void FluxModel<Real>::double_backward(int l, Real* g, const Real* w) {
  const int B = d_.B, C = d_.C;
  Buffers& b = buf_;
  restore_input(b.img, l), restore_input(b.txt, l);
  DoubleLayer& a = double_layer(l);
  const int rows[2] = {d_.N, d_.L}, offset[2] = {d_.L, 0};
  if (doubles_.recomputes(l)) {
    double_forward(l, w, true);  // this block's activations again, from its input
  } else {  // the kept tensors back, and what the backward reads but the forward did not keep made again
    restore(a.kept);
    for (int s = 0; s < 2; s++) {
      split(a.s[s].y.data(), a.y.data(), C, 0, rows[s], offset[s]);  // its rows of the attention output
      mlp_activation_forward(a.s[s].g, a.s[s].h.data(), B * rows[s]);
    }
  }
  const Real* in[2] = {input(b.img, l), input(b.txt, l)};
  Real* d_res[2] = {b.d_img.data(), b.d_txt.data()};  // the running residual gradients
  // The modulations' gradients: this block's own (FLUX.1), or added to the root's (FLUX.2).
  if (!d_.flux2) b.d_mod.zero();
  Real* d_mods[2];
  for (int s = 0; s < 2; s++)
    d_mods[s] = d_.flux2 ? b.d_shared_mod[s].data() : b.d_mod.data() + static_cast<size_t>(s) * B * 6 * C;
  for (int s = 0; s < 2; s++) {
    Stream& t = a.s[s];
    const FluxLayout::Stream& lin = lay_.stream[s];
    const int n = rows[s], q0 = s * FLUX_D_PRODUCTS;
    const Real* mod = modulation(s, t.mod.data());
    Real* d_mod = d_mods[s];
    ops_.gate_backward(b.d_a.data(), d_mod + 5 * C, d_res[s], t.f.data(), mod + 5 * C, 6 * C, B, n, C);
    linear_backward(l, q0 + FLUX_P_FF2, b.d_g.data(), t.g.data(), b.d_a.data(), B * n, d_.F, C, g, w, lin.ff2);
    mlp_activation_backward(b.d_h.data(), b.d_g.data(), t.h.data(), B * n);
    linear_backward(l, q0 + FLUX_P_FF1, b.d_xn.data(), t.xn2.data(), b.d_h.data(), B * n, C, d_.FH, g, w, lin.ff1);
    ops_.modulate_backward(d_res[s], d_mod + 3 * C, d_mod + 4 * C, b.d_xn.data(), t.x2.data(), mod + 4 * C,
                           t.mean2.data(), t.rstd2.data(), 6 * C, B, n, C);
    ops_.gate_backward(b.d_a.data(), d_mod + 2 * C, d_res[s], t.a.data(), mod + 2 * C, 6 * C, B, n, C);
    linear_backward(l, q0 + FLUX_P_OUT, b.d_tmp.data(), t.y.data(), b.d_a.data(), B * n, C, C, g, w, lin.out);
    join(b.d_y.data(), C, 0, b.d_tmp.data(), n, offset[s]);
  }
  ops_.bidirectional_attention_backward(b.d_qkv.data(), b.d_y.data(), a.qkv.data(), a.y.data(), a.lse.data(), B,
                                        d_.S, d_.H, d_.D);
  ops_.rope_pairs_backward(b.d_qkv.data(), buf_.rope_cos.data(), buf_.rope_sin.data(), B, d_.S, d_.H, d_.H, d_.D);
  for (int s = 0; s < 2; s++) {
    Stream& t = a.s[s];
    const FluxLayout::Stream& lin = lay_.stream[s];
    const int n = rows[s], q0 = s * FLUX_D_PRODUCTS;
    const Real* mod = modulation(s, t.mod.data());
    Real* d_mod = d_mods[s];
    split(b.d_q.data(), b.d_qkv.data(), 3 * C, 0, n, offset[s]);
    split(b.d_k.data(), b.d_qkv.data(), 3 * C, C, n, offset[s]);
    split(b.d_v.data(), b.d_qkv.data(), 3 * C, 2 * C, n, offset[s]);
    qkv_backward(l, q0 + FLUX_P_Q, t.xn.data(), t.att, B * n, g, w, lin);
    ops_.modulate_backward(d_res[s], d_mod, d_mod + C, b.d_xn.data(), in[s], mod + C, t.mean1.data(),
                           t.rstd1.data(), 6 * C, B, n, C);
    if (!d_.flux2) modulation_backward(l, q0 + FLUX_P_MOD, d_mod, 6 * C, g, w, lin.mod);
  }
}

// FLUX.2's single block from d_cat's MLP part (d_g) and the attention's d_q, d_k, d_v: the fused
// product's gradient [d_q_pre | d_k_pre | d_v | d gate|up] assembled, its backward into d_xn.
template <typename Real>
void FluxModel<Real>::single_fused_backward(SingleLayer& a, int block, Real* g, const Real* w) {
  const int C = d_.C, rows = d_.B * d_.S, SW = d_.SW;
  Buffers& b = buf_;
  qk_norm_backward(block, a.att, rows, g, w, lay_.s_norm_q, lay_.s_norm_k);
  Real* d_fused = b.d_h.data();  // rows x SW
  ops_.copy_rows(d_fused, SW, b.d_q_pre.data(), C, rows, C);
  ops_.copy_rows(d_fused + C, SW, b.d_k_pre.data(), C, rows, C);
  ops_.copy_rows(d_fused + 2 * C, SW, b.d_v.data(), C, rows, C);
  mlp_activation_backward(b.d_gate_up.data(), b.d_g.data(), a.m.data(), rows);
  ops_.copy_rows(d_fused + 3 * C, SW, b.d_gate_up.data(), d_.FH, rows, d_.FH);
  linear_backward(block, FLUX_SP_QKV_MLP, b.d_xn.data(), a.hn.data(), d_fused, rows, C, SW, g, w, lay_.s_qkv_mlp);
}

template <typename Real>
void FluxModel<Real>::single_backward(int j, Real* g, const Real* w) {
  const int B = d_.B, C = d_.C, S = d_.S, rows = B * S, block = d_.double_blocks + j, F = d_.F;
  Buffers& b = buf_;
  restore_input(b.joint, j);
  SingleLayer& a = single_layer(j);
  if (singles_.recomputes(j)) {
    single_forward(j, w, true);
  } else {
    restore(a.kept);
    join_cat(a);
  }
  const Real* mod = modulation(2, a.mod.data());
  Real* d_mod = d_.flux2 ? b.d_shared_mod[2].data() : b.d_mod.data();
  if (!d_.flux2) b.d_mod.zero();
  ops_.gate_backward(b.d_a.data(), d_mod + 2 * C, b.d_joint.data(), a.p.data(), mod + 2 * C, 3 * C, B, S, C);
  linear_backward(block, FLUX_SP_OUT, b.d_cat.data(), a.cat.data(), b.d_a.data(), rows, C + F, C, g, w, lay_.s_out);
  ops_.copy_rows(b.d_y.data(), C, b.d_cat.data(), C + F, rows, C);
  ops_.copy_rows(b.d_g.data(), F, b.d_cat.data() + C, C + F, rows, F);
  if (!d_.flux2) {
    mlp_activation_backward(b.d_h.data(), b.d_g.data(), a.m.data(), rows);
    // The MLP's input gradient (kept in d_a while the attention's is computed into d_xn).
    linear_backward(block, FLUX_SP_MLP, b.d_xn.data(), a.hn.data(), b.d_h.data(), rows, C, F, g, w, lay_.s_mlp);
  }
  ops_.bidirectional_attention_backward(b.d_qkv.data(), b.d_y.data(), a.qkv.data(), a.y.data(), a.lse.data(), B, S,
                                        d_.H, d_.D);
  ops_.rope_pairs_backward(b.d_qkv.data(), buf_.rope_cos.data(), buf_.rope_sin.data(), B, S, d_.H, d_.H, d_.D);
  ops_.copy_rows(b.d_q.data(), C, b.d_qkv.data(), 3 * C, rows, C);
  ops_.copy_rows(b.d_k.data(), C, b.d_qkv.data() + C, 3 * C, rows, C);
  ops_.copy_rows(b.d_v.data(), C, b.d_qkv.data() + 2 * C, 3 * C, rows, C);
  if (d_.flux2) {
    single_fused_backward(a, block, g, w);
  } else {
    ops_.device().copy_on_device(b.d_a.data(), b.d_xn.data(), static_cast<size_t>(rows) * C * sizeof(Real));
    const FluxLayout::Stream lin{{}, lay_.s_q, lay_.s_k, lay_.s_v, {}, {}, {}, lay_.s_norm_q, lay_.s_norm_k};
    qkv_backward(block, FLUX_SP_Q, a.hn.data(), a.att, rows, g, w, lin);
    ops_.residual_forward(b.d_xn.data(), b.d_xn.data(), b.d_a.data(), static_cast<size_t>(rows) * C);
  }
  ops_.modulate_backward(b.d_joint.data(), d_mod, d_mod + C, b.d_xn.data(), input(b.joint, j), mod + C, a.mean.data(),
                         a.rstd.data(), 3 * C, B, S, C);
  if (!d_.flux2) modulation_backward(block, FLUX_SP_MOD, b.d_mod.data(), 3 * C, g, w, lay_.s_mod);
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
  const size_t BC = static_cast<size_t>(B) * C;
  if (d_.flux2)  // the shared modulations' gradients, summed over their blocks, into the conditioning's
    for (int s = 0; s < 3; s++) {
      root_linear_backward(b.d_small.data(), b.temb_silu.data(), b.d_shared_mod[s].data(), B, C, (s < 2 ? 6 : 3) * C,
                           g, lay_.shared_mod[s]);
      ops_.residual_forward(b.d_silu.data(), b.d_silu.data(), b.d_small.data(), BC);
    }
  // d temb = silu'(temb) d silu(temb); each embedder's MLP gets all of it.
  ops_.silu_backward(b.d_small.data(), b.d_silu.data(), b.temb.data(), BC);
  auto mlp_backward = [&](const Real* h, const Real* a, const Real* in, int in_width, FluxLinear first,
                          FluxLinear second) {
    root_linear_backward(b.d_small2.data(), a, b.d_small.data(), B, C, C, g, second);
    ops_.silu_backward(b.d_small2.data(), b.d_small2.data(), h, BC);
    root_linear_backward(nullptr, in, b.d_small2.data(), B, in_width, C, g, first);
  };
  mlp_backward(b.t_h.data(), b.t_a.data(), b.t_proj.data(), FLUX_TIME_CHANNELS, lay_.time1, lay_.time2);
  if (d_.guidance)
    mlp_backward(b.g_h.data(), b.g_a.data(), b.g_proj.data(), FLUX_TIME_CHANNELS, lay_.guidance1, lay_.guidance2);
  if (d_.P > 0) mlp_backward(b.p_h.data(), b.p_a.data(), b.in_pooled.data(), d_.P, lay_.text1, lay_.text2);
  root_linear_backward(nullptr, b.in_img.data(), b.d_img.data(), B * d_.N, d_.IN, C, g, lay_.x_embed);
  root_linear_backward(nullptr, b.in_txt.data(), b.d_txt.data(), B * d_.L, d_.X, C, g, lay_.ctx_embed);
}

template class FluxModel<float>;
template class FluxModel<double>;

}  // namespace shardtrain
