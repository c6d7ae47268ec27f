// The transformer layer math on the CPU (GPT-2's and Llama's): OpenBLAS GEMMs plus OpenMP loops, templated on the element
// type and instantiated for float (training) and double (finite-difference gradient checks).
//
// Shapes follow llm.c: B batch, T time, C channels, OC output channels, NH query heads, KV
// key/value heads, HS head size, I MLP width, V vocabulary, N = B*T rows. Linear weights are (OC, C) row-major, out = inp @ weight^T + bias.
// Argument order: <op>_forward(outputs..., saved..., inputs..., params..., dims) and
// <op>_backward(d_inputs..., d_params..., d_out, inputs..., params..., saved..., dims).
// Accumulation rule: parameter gradients are ACCUMULATED (+=), so one buffer can collect the
// contributions of tied uses and of several micro-batches; activation gradients are WRITTEN (=),
// except layernorm_backward's and rmsnorm_backward's dinp, which are accumulated because they add
// onto the residual stream.
// Null parameter gradients: every parameter gradient of a backward (dwte, dwpe, dweight, dbias) may
// be null -- a frozen parameter -- and is then neither computed nor touched; the other outputs are
// the same, bit for bit, as with it. The input gradients are still computed (matmul's dinp may be
// null too: no gradient flows further down).
// Every loop has a fixed schedule and no atomics: same inputs and threads give the same bits.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace shardtrain::cpu {

// out(B,T,C) = wte[tokens[b,t]] + wpe[p], p = positions[b,t] or t when positions is null; wpe may be
// null (no position table: llama).
template <typename Real>
void encoder_forward(Real* out, const int* tokens, const Real* wte, const Real* wpe, int B, int T, int C,
                     const int* positions = nullptr);
// dwte(V,C) += scatter of dout by token; dwpe(maxT,C) += scatter of dout by position (summed over
// the batch), rows added in increasing b*T+t. Each skipped if null (both null: nothing to do).
template <typename Real>
void encoder_backward(Real* dwte, Real* dwpe, const Real* dout, const int* tokens, int B, int T, int C,
                      const int* positions = nullptr);

// out(N,C) = (inp - mean) * rstd * weight + bias, eps 1e-5; saves mean(N), rstd(N).
template <typename Real>
void layernorm_forward(Real* out, Real* mean, Real* rstd, const Real* inp, const Real* weight, const Real* bias,
                       int N, int C);
// dinp(N,C) +=, dweight(C) +=, dbias(C) +=. dweight and dbias each may be null (skipped).
template <typename Real>
void layernorm_backward(Real* dinp, Real* dweight, Real* dbias, const Real* dout, const Real* inp,
                        const Real* weight, const Real* mean, const Real* rstd, int N, int C);

// RMSNorm (Llama): out(N,C) = inp * rstd * weight, rstd = 1 / sqrt(mean(inp^2) + eps); saves rstd(N).
template <typename Real>
void rmsnorm_forward(Real* out, Real* rstd, const Real* inp, const Real* weight, Real eps, int N, int C);
// dinp(N,C) +=, dweight(C) += (skipped if null).
template <typename Real>
void rmsnorm_backward(Real* dinp, Real* dweight, const Real* dout, const Real* inp, const Real* weight,
                      const Real* rstd, int N, int C);

// out(N,OC) = inp(N,C) @ weight(OC,C)^T + bias(OC); bias may be null.
template <typename Real>
void matmul_forward(Real* out, const Real* inp, const Real* weight, const Real* bias, int N, int C, int OC);
// dinp(N,C) = dout @ weight; dweight(OC,C) += dout^T @ inp; dbias(OC) += column sums of dout.
// Each of the three skipped if null.
template <typename Real>
void matmul_backward(Real* dinp, Real* dweight, Real* dbias, const Real* dout, const Real* inp,
                     const Real* weight, int N, int C, int OC);

// Causal self-attention with grouped-query heads. Each row of qkv(B,T,(NH+2KV)*HS) holds q (NH
// heads) | k (KV heads) | v (KV heads) of HS each; query head h reads key/value head h / (NH/KV)
// (KV = NH: plain multi-head attention, GPT-2's 3C rows). out(B,T,NH*HS); scale 1/sqrt(HS).
// lse(B,NH,T) saves each query row's log-sum-exp of its scaled scores, log sum_{s<=t} exp(score),
// all the backward needs besides qkv and out: memory O(T), no T x T matrix (attention.cpp tiles
// it). `tiles`: the query and key tile sizes, a speed choice (tests vary them; the default is
// the measured best, docs/performance.md); the values differ between tile sizes only by rounding.
// `passes`: how the backward shares its work among threads -- two passes (dK and dV by key tiles,
// then dQ by query tiles, each recomputing the tiles' probabilities: B*NH*T/key + B*NH*T/query
// tasks) or one (dK, dV and dQ together, one task per sequence and query head: 5 products per
// tile pair instead of 7). The bits are the same; `automatic` gives one pass to the heads that
// fill whole rounds of the threads and two to the rest (one pass needs the key tile to be a
// multiple of the query tile).
struct AttentionTiles {
  int query = 64, key = 128;
  enum class Passes { automatic, one, two } passes = Passes::automatic;
};
// causal = false: every query row attends to all T keys (a diffusion transformer's joint
// attention); lse then sums over all of them. doc_start(B,T), with the causal mask only: packed
// documents, row t of sequence b sees keys doc_start[b][t] <= s <= t, doc_start[b][t] being the
// first position of its document (non-decreasing along a sequence, <= t); nullptr: one document.
template <typename Real>
void attention_forward(Real* out, Real* lse, const Real* qkv, int B, int T, int NH, int KV, int HS,
                       AttentionTiles tiles = AttentionTiles(), bool causal = true, const int* doc_start = nullptr);
// dqkv(B,T,(NH+2KV)*HS) = gradient w.r.t. qkv (written), given the forward's out and lse.
template <typename Real>
void attention_backward(Real* dqkv, const Real* dout, const Real* qkv, const Real* out, const Real* lse, int B,
                        int T, int NH, int KV, int HS, AttentionTiles tiles = AttentionTiles(), bool causal = true,
                        const int* doc_start = nullptr);

// Attention for generation with a key/value cache (one sequence). qkv(Q,(NH+2KV)*HS) holds Q new
// tokens at positions start..start+Q-1, laid out as above (rope already applied). Their k and v
// are first copied to rows start..start+Q-1 of k_cache and v_cache (each (max_len, KV*HS), row p
// the k or v heads of position p); then query row i attends causally over cache rows 0..start+i
// (with a `window` > 0, only the last `window` of them: from start+i-window+1 on):
// out(Q,NH*HS) = softmax(q k^T / sqrt(HS)) v, what attention_forward gives for that position of
// the whole sequence (up to rounding). scratch: Q*NH*(start+Q) elements (the scores).
template <typename Real>
void attention_decode(Real* out, Real* scratch, Real* k_cache, Real* v_cache, const Real* qkv, int Q, int start,
                      int NH, int KV, int HS, int window = 0);

// Rotary position embedding in place on the q and k heads of qkv (layout as attention; v is
// untouched), Hugging Face's "rotate_half" form: in each head vector, element i < HS/2 pairs with
// i + HS/2 and the pair at position t turns by the angle with cos[t][i], sin[t][i] (tables (T, HS/2)):
//   x[i] <- x[i] cos - x[i + HS/2] sin,  x[i + HS/2] <- x[i + HS/2] cos + x[i] sin.
// positions (B,T), if given, replace t: the table row of each token.
template <typename Real>
void rope_forward(Real* qkv, const Real* cos, const Real* sin, int B, int T, int NH, int KV, int HS,
                  const int* positions = nullptr);
// In place on dqkv: the inverse turn (the rotation's transpose), giving the gradient before rope.
template <typename Real>
void rope_backward(Real* dqkv, const Real* cos, const Real* sin, int B, int T, int NH, int KV, int HS,
                   const int* positions = nullptr);

// FLUX's rotary embedding (model/families/flux): in each q and k head vector of qkv (layout as
// attention) the interleaved pairs (x[2i], x[2i+1]) turn by the angle with cos[t][i], sin[t][i]
// (tables (T, HS/2), from the tokens' position ids):
//   x[2i] <- x[2i] cos - x[2i+1] sin,  x[2i+1] <- x[2i+1] cos + x[2i] sin.
template <typename Real>
void rope_pairs_forward(Real* qkv, const Real* cos, const Real* sin, int B, int T, int NH, int KV, int HS);
// In place on dqkv: the inverse turn.
template <typename Real>
void rope_pairs_backward(Real* dqkv, const Real* cos, const Real* sin, int B, int T, int NH, int KV, int HS);

// Adaptive LayerNorm (FLUX's AdaLayerNormZero / Continuous): LayerNorm without affine (eps) of
// each of the B*T rows of inp(B,T,C), then modulated per sample:
//   out[b,t,:] = xhat * (1 + scale[b,:]) + shift[b,:],  xhat = (inp - mean) * rstd;
// shift and scale are rows of `ld` elements apart (chunks of a modulation product). Saves
// mean, rstd (B*T).
template <typename Real>
void modulate_forward(Real* out, Real* mean, Real* rstd, const Real* inp, const Real* shift, const Real* scale,
                      int ld, int B, int T, int C, Real eps);
// dinp += (accumulated: the residual stream), dshift[b,:] += sum_t dout, dscale[b,:] += sum_t
// dout * xhat (rows `ld` apart, either may be null).
template <typename Real>
void modulate_backward(Real* dinp, Real* dshift, Real* dscale, const Real* dout, const Real* inp, const Real* scale,
                       const Real* mean, const Real* rstd, int ld, int B, int T, int C);
// Gated residual: out[b,t,:] = resid[b,t,:] + gate[b,:] * y[b,t,:] (out may be resid; gate rows
// `ld` apart).
template <typename Real>
void gate_forward(Real* out, const Real* resid, const Real* y, const Real* gate, int ld, int B, int T, int C);
// dy = gate * dout (written), dgate[b,:] += sum_t dout * y (may be null). The residual's gradient
// is dout itself.
template <typename Real>
void gate_backward(Real* dy, Real* dgate, const Real* dout, const Real* y, const Real* gate, int ld, int B, int T,
                   int C);
// out = silu(inp) = inp * sigmoid(inp); dinp = dout * silu'(inp) (written).
template <typename Real>
void silu_forward(Real* out, const Real* inp, size_t n);
template <typename Real>
void silu_backward(Real* dinp, const Real* dout, const Real* inp, size_t n);
// Squared error of N rows of W values against target: losses[r] = sum_j (out - target)^2 and, in
// place of out, that sum's gradient 2 (out - target).
template <typename Real>
void squared_error_forward(Real* losses, Real* out_to_grad, const Real* target, int N, int W);
// dst rows of `cols` elements, `ld_dst` apart, from src rows `ld_src` apart.
template <typename Real>
void copy_rows(Real* dst, int ld_dst, const Real* src, int ld_src, int rows, int cols);

// SwiGLU: out(N,I) = silu(gate) * up, where each row of gate_up(N,2I) holds gate (I) | up (I).
template <typename Real>
void swiglu_forward(Real* out, const Real* gate_up, int N, int I);
// dgate_up(N,2I) = gradient w.r.t. gate_up (written).
template <typename Real>
void swiglu_backward(Real* dgate_up, const Real* dout, const Real* gate_up, int N, int I);

// out = gelu(inp), n elements (tanh approximation, backend/math.hpp).
template <typename Real>
void gelu_forward(Real* out, const Real* inp, size_t n);
// dinp = dout * gelu'(inp).
template <typename Real>
void gelu_backward(Real* dinp, const Real* dout, const Real* inp, size_t n);

// out = a + b, n elements (the residual stream).
template <typename Real>
void residual_forward(Real* out, const Real* a, const Real* b, size_t n);

// DoRA's per-output-feature arithmetic (model/lora.hpp) on a matrix of `rows` x `cols` with row
// stride ld (a column slice of a wider product where ld > cols):
// out[r] = sqrt(sum_c x[r*cols + c]^2), x dense (rows, cols); accumulated in double.
template <typename Real>
void row_norms(Real* out, const Real* x, int rows, int cols);
// y[r*ld + c] = scale[c] * (y[r*ld + c] - shift[c]) + shift[c]; shift may be null (0).
template <typename Real>
void column_affine(Real* y, int ld, int rows, int cols, const Real* scale, const Real* shift);
// y[r*cols + c] = (scale[r] + offset) * y[r*cols + c], y dense (rows, cols): DoRA-with-dropout's
// weights with each output feature's row scaled by its gain (offset 0) or its gain less one (-1).
template <typename Real>
void scale_rows(Real* y, int rows, int cols, const Real* scale, Real offset);
// out[c] += (sum_r a[r*lda + c] * b[r*ldb + c]) / divisor[c]; the sum in double, rows in order.
template <typename Real>
void column_dot_accumulate(Real* out, const Real* a, int lda, const Real* b, int ldb, int rows, int cols,
                           const Real* divisor);
// out[i] = a[i] / b[i].
template <typename Real>
void divide(Real* out, const Real* a, const Real* b, size_t n);

// LoHa's and LoKr's weight deltas (model/delta_adapters.hpp), adapter_ops.cpp. Every product is
// evaluated left to right, as written: (s * a) * b, two roundings, which the CUDA backend repeats.
// out[i] = s * a[i] * b[i] for i < n; out may be a or b.
template <typename Real>
void multiply(Real* out, const Real* a, const Real* b, size_t n, Real s);
// Row-major Kronecker product, out (p*r, q*t) = s * kron(A (p, q), B (r, t)):
//   out[(i*r + k) * (q*t) + j*t + l] = s * A[i*q + j] * B[k*t + l].
// out must not overlap A or B. Any of p, q, r, t may be 0 (nothing written).
template <typename Real>
void kron(Real* out, const Real* A, int p, int q, const Real* B, int r, int t, Real s);
// Its gradients given dout (p*r, q*t), WRITTEN (=, not accumulated: they feed the factors'
// gradients, not a parameter buffer):
//   dA[i*q + j] = s * sum_{k,l} dout[(i*r + k) * (q*t) + j*t + l] * B[k*t + l],
//   dB[k*t + l] = s * sum_{i,j} dout[(i*r + k) * (q*t) + j*t + l] * A[i*q + j].
// Each sum in double, its terms in row-major order ((k, l) for dA, (i, j) for dB), then times s
// in double and rounded once. dA or dB may be null (not computed; the other keeps its bits). An
// empty sum (r*t = 0 for dA, p*q = 0 for dB) writes s * 0. Outputs must not overlap the inputs.
template <typename Real>
void kron_backward(Real* dA, Real* dB, const Real* dout, const Real* A, int p, int q, const Real* B, int r, int t,
                   Real s);

// Dropout over N rows of C, keyed by a counter RNG (core/random.hpp), so the mask is a pure
// function of (row_keys[r], site, c, p) -- no state, the same on every backend, thread count and
// rerun:  out[r*C + c] = keep(r, c) ? inp[r*C + c] / (1 - p) : 0, with
//   keep(r, c) = counter_keep(dropout_row_key(row_keys[r], site), c, dropout_threshold24(p)),
// the top 24 bits of the counter draw against round(p * 2^24) (an integer comparison, so the CUDA
// backend decides identically). row_keys: N keys (host memory here; device memory on a GPU
// backend). p in [0, 1]: p = 0 copies (nothing when out == inp); p = 1 writes zeros. In place
// (out == inp) is allowed. A dropped element is +0 whatever the input (NaN and inf included).
// Backward: the same call with the same row_keys, site and p on the output gradient gives the
// input gradient (the same mask and scale): dropout(dinp, dout, row_keys, site, N, C, p).
template <typename Real>
void dropout(Real* out, const Real* inp, const uint64_t* row_keys, uint64_t site, int N, int C, float p);

// In place: logits(N,V) become softmax probabilities; losses(N) = -log prob[target].
template <typename Real>
void softmax_crossentropy_forward(Real* losses, Real* logits_to_probs, const int* targets, int N, int V);
// In place: probs(N,V) become dlogits = (probs - onehot(target)) * dloss, the same dloss for
// every row (the loss is a mean over all tokens of the global batch).
template <typename Real>
void softmax_crossentropy_backward(Real* probs_to_dlogits, const int* targets, Real dloss, int N, int V);

// Knowledge distillation's loss on N rows of V logits (docs/distillation.md), distill_loss.cpp:
// student s (N,V), teacher t (N,V, read only), targets (N, each in [0, V)), alpha in [0, 1],
// temperature T > 0. Per row,
//   losses[r] = alpha * CE(softmax(s), target) + (1 - alpha) * T^2 * KL(softmax(t / T) || softmax(s / T)),
// and s is overwritten with d losses[r] / d s (not yet times dloss: the caller scales it),
//   alpha * (softmax(s) - onehot(target)) + (1 - alpha) * T * (softmax(s / T) - softmax(t / T)).
// Each row on its own, in this order (the CUDA kernel, kernels/distill.cu, repeats it with another
// summation order): m_s = max s, m_t = max t; in double, with w = 1 / T, x_i = s_i - m_s and
// y_i = t_i - m_t, the three exponentials e1_i = exp_fast(Real(x_i)), e2_i = exp_fast(Real(x_i w)),
// e3_i = exp_fast(Real(y_i w)) (float rows use float exponentials, the cross-entropy op's), summed
// in double in index order into Z1, Z2, Z3 (each >= 1: the maximum contributes exp(0)); then
//   CE = log Z1 - x_target,   KL = sum_i p_i (log p_i - log q_i),   p_i = e3_i / Z3,
//   log p_i = y_i w - log Z3,   log q_i = x_i w - log Z2,
//   grad_i = alpha (e1_i / Z1 - [i = target]) + (1 - alpha) T (e2_i / Z2 - e3_i / Z3),
// all in double (divisions, never products, before the differences, so no FMA contraction can
// split two equal terms); a term with p_i = 0 adds 0, so an underflowing teacher probability is
// harmless. Each gradient element and each loss is rounded to Real once. A teacher equal to the
// student gives KL = 0 and a KL gradient of 0 exactly (the same operations on the same numbers).
// Rows run in parallel, each sequentially: the bits do not depend on the thread count. N = 0 does
// nothing; V >= 1. A target outside [0, V), T <= 0 or alpha outside [0, 1] is a SHARD_CHECK failure
// (the CUDA kernel, which cannot check device-resident targets up front, gives such a row a NaN loss).
template <typename Real>
void distill_loss_forward(Real* losses, Real* student_to_grad, const Real* teacher, const int* targets, int N,
                          int V, Real alpha, Real temperature);

// Sums in double: sequential; squares in fixed blocks of 4096, each summed in index order, then the
// blocks in block order, so the bits do not depend on the thread count (an OpenMP reduction's
// grouping would). They feed the loss and clipping.
template <typename Real>
double sum(const Real* x, size_t n) {
  double s = 0;
  for (size_t i = 0; i < n; i++) s += x[i];
  return s;
}
template <typename Real>
double sum_squares(const Real* x, size_t n) {
  constexpr size_t kBlock = 4096;
  std::vector<double> partial((n + kBlock - 1) / kBlock);
#pragma omp parallel for schedule(static)
  for (size_t b = 0; b < partial.size(); b++) {
    double s = 0;
    for (size_t i = b * kBlock, end = std::min(n, i + kBlock); i < end; i++) s += static_cast<double>(x[i]) * x[i];
    partial[b] = s;
  }
  double s = 0;
  for (double p : partial) s += p;
  return s;
}

}  // namespace shardtrain::cpu
