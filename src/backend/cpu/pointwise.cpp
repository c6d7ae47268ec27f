// The memory-bound layers: token(+position) embedding, GELU, SwiGLU, residual add, counter-keyed
// dropout, and the fused softmax cross-entropy over the vocabulary. Scatter-adds into embedding
// gradients run over fixed column blocks so that each element is summed in token order, whatever
// the thread count; a null dwte or dwpe (frozen table) is skipped.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/cpu/gemm.hpp"
#include "backend/cpu/ops.hpp"
#include "backend/math.hpp"
#include "core/error.hpp"
#include "core/random.hpp"

namespace shardtrain::cpu {

template <typename Real>
void encoder_forward(Real* out, const int* tokens, const Real* wte, const Real* wpe, int B, int T, int C,
                     const int* positions) {
#pragma omp parallel for schedule(static)
  for (int bt = 0; bt < B * T; bt++) {
    const Real* e = wte + static_cast<size_t>(tokens[bt]) * C;
    Real* o = out + static_cast<size_t>(bt) * C;
    if (!wpe) {
      for (int i = 0; i < C; i++) o[i] = e[i];
      continue;
    }
    const Real* p = wpe + static_cast<size_t>(positions ? positions[bt] : bt % T) * C;
    for (int i = 0; i < C; i++) o[i] = e[i] + p[i];
  }
}

template <typename Real>
void encoder_backward(Real* dwte, Real* dwpe, const Real* dout, const int* tokens, int B, int T, int C,
                      const int* positions) {
  if (!dwte && !dwpe) return;  // both tables frozen (or absent)
  int blocks = (C + COLUMN_BLOCK - 1) / COLUMN_BLOCK;
#pragma omp parallel for schedule(static)
  for (int blk = 0; blk < blocks; blk++) {
    int lo = blk * COLUMN_BLOCK, hi = std::min(C, lo + COLUMN_BLOCK);
    for (int bt = 0; bt < B * T; bt++) {
      const Real* d = dout + static_cast<size_t>(bt) * C;
      if (dwte) {
        Real* e = dwte + static_cast<size_t>(tokens[bt]) * C;
        for (int i = lo; i < hi; i++) e[i] += d[i];
      }
      if (dwpe) {
        Real* p = dwpe + static_cast<size_t>(positions ? positions[bt] : bt % T) * C;
        for (int i = lo; i < hi; i++) p[i] += d[i];
      }
    }
  }
}

template <typename Real>
void gelu_forward(Real* out, const Real* inp, size_t n) {
#pragma omp parallel for simd schedule(static)
  for (size_t i = 0; i < n; i++) out[i] = gelu_value(inp[i]);
}

template <typename Real>
void gelu_backward(Real* dinp, const Real* dout, const Real* inp, size_t n) {
#pragma omp parallel for simd schedule(static)
  for (size_t i = 0; i < n; i++) dinp[i] = dout[i] * gelu_derivative(inp[i]);
}

template <typename Real>
void swiglu_forward(Real* out, const Real* gate_up, int N, int I) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; n++) {
    const Real* g = gate_up + static_cast<size_t>(n) * 2 * I;
    const Real* u = g + I;
    Real* o = out + static_cast<size_t>(n) * I;
#pragma omp simd
    for (int i = 0; i < I; i++) o[i] = silu_value(g[i]) * u[i];
  }
}

template <typename Real>
void swiglu_backward(Real* dgate_up, const Real* dout, const Real* gate_up, int N, int I) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; n++) {
    const Real* g = gate_up + static_cast<size_t>(n) * 2 * I;
    const Real* u = g + I;
    const Real* dy = dout + static_cast<size_t>(n) * I;
    Real* dg = dgate_up + static_cast<size_t>(n) * 2 * I;
    Real* du = dg + I;
#pragma omp simd
    for (int i = 0; i < I; i++) {
      dg[i] = dy[i] * u[i] * silu_derivative(g[i]);
      du[i] = dy[i] * silu_value(g[i]);
    }
  }
}

template <typename Real>
void residual_forward(Real* out, const Real* a, const Real* b, size_t n) {
#pragma omp parallel for simd schedule(static)
  for (size_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}

template <typename Real>
void row_norms(Real* out, const Real* x, int rows, int cols) {
#pragma omp parallel for schedule(static)
  for (int r = 0; r < rows; r++) {
    double sum = 0;
    for (int c = 0; c < cols; c++) sum += static_cast<double>(x[static_cast<size_t>(r) * cols + c]) * x[static_cast<size_t>(r) * cols + c];
    out[r] = static_cast<Real>(std::sqrt(sum));
  }
}

template <typename Real>
void column_affine(Real* y, int ld, int rows, int cols, const Real* scale, const Real* shift) {
#pragma omp parallel for schedule(static)
  for (int r = 0; r < rows; r++) {
    Real* row = y + static_cast<size_t>(r) * ld;
    for (int c = 0; c < cols; c++) {
      const Real b = shift ? shift[c] : Real(0);
      row[c] = scale[c] * (row[c] - b) + b;
    }
  }
}

template <typename Real>
void scale_rows(Real* y, int rows, int cols, const Real* scale, Real offset) {
#pragma omp parallel for schedule(static)
  for (int r = 0; r < rows; r++) {
    const Real factor = scale[r] + offset;
    Real* row = y + static_cast<size_t>(r) * cols;
    for (int c = 0; c < cols; c++) row[c] = factor * row[c];
  }
}

template <typename Real>
void column_dot_accumulate(Real* out, const Real* a, int lda, const Real* b, int ldb, int rows, int cols,
                           const Real* divisor) {
#pragma omp parallel for schedule(static)
  for (int c = 0; c < cols; c++) {
    double sum = 0;
    for (int r = 0; r < rows; r++)
      sum += static_cast<double>(a[static_cast<size_t>(r) * lda + c]) * b[static_cast<size_t>(r) * ldb + c];
    out[c] += static_cast<Real>(sum / divisor[c]);
  }
}

template <typename Real>
void divide(Real* out, const Real* a, const Real* b, size_t n) {
#pragma omp parallel for simd schedule(static)
  for (size_t i = 0; i < n; i++) out[i] = a[i] / b[i];
}

template <typename Real>
void dropout(Real* out, const Real* inp, const uint64_t* row_keys, uint64_t site, int N, int C, float p) {
  SHARD_CHECK(N >= 0 && C >= 0 && p >= 0.0f && p <= 1.0f, "dropout: N=%d C=%d p=%g", N, C, static_cast<double>(p));
  const size_t n = static_cast<size_t>(N) * C;
  if (p == 0.0f) {  // the identity: every element kept, and x / 1 == x
    if (out != inp && n) std::memmove(out, inp, n * sizeof(Real));
    return;
  }
  const uint32_t threshold = dropout_threshold24(p);
  const Real keep_fraction = Real(1) - Real(p);  // a division, as the formula reads (CUDA: the same one)
#pragma omp parallel for schedule(static)
  for (int r = 0; r < N; r++) {
    const uint64_t key = dropout_row_key(row_keys[r], site);
    const Real* x = inp + static_cast<size_t>(r) * C;
    Real* y = out + static_cast<size_t>(r) * C;
    for (int c = 0; c < C; c++)
      y[c] = counter_keep(key, static_cast<uint64_t>(c), threshold) ? x[c] / keep_fraction : Real(0);
  }
}

template <typename Real>
void softmax_crossentropy_forward(Real* losses, Real* logits_to_probs, const int* targets, int N, int V) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; n++) {
    Real* r = logits_to_probs + static_cast<size_t>(n) * V;
    Real max = r[0];
#pragma omp simd reduction(max : max)
    for (int i = 1; i < V; i++) max = r[i] > max ? r[i] : max;
    // -log p[target] = log(sum exp(l - max)) - (l[target] - max): exact even when p underflows. An
    // ignored target (< 0, a loss mask's) has no loss; the probabilities are still computed.
    const bool ignored = targets[n] < 0;
    Real target_shifted = ignored ? Real(0) : r[targets[n]] - max;
    Real sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int i = 0; i < V; i++) {
      r[i] = exp_fast(r[i] - max);
      sum += r[i];
    }
    Real inv = Real(1) / sum;
#pragma omp simd
    for (int i = 0; i < V; i++) r[i] *= inv;
    losses[n] = ignored ? Real(0) : std::log(sum) - target_shifted;
  }
}

template <typename Real>
void softmax_crossentropy_backward(Real* probs_to_dlogits, const int* targets, Real dloss, int N, int V) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; n++) {
    Real* r = probs_to_dlogits + static_cast<size_t>(n) * V;
    if (targets[n] < 0) {  // ignored: no gradient
      std::fill(r, r + V, Real(0));
      continue;
    }
    for (int i = 0; i < V; i++) r[i] *= dloss;
    r[targets[n]] -= dloss;
  }
}

#define INSTANTIATE(Real)                                                                                   \
  template void encoder_forward<Real>(Real*, const int*, const Real*, const Real*, int, int, int, const int*); \
  template void encoder_backward<Real>(Real*, Real*, const Real*, const int*, int, int, int, const int*);  \
  template void gelu_forward<Real>(Real*, const Real*, size_t);                                             \
  template void gelu_backward<Real>(Real*, const Real*, const Real*, size_t);                               \
  template void swiglu_forward<Real>(Real*, const Real*, int, int);                                         \
  template void swiglu_backward<Real>(Real*, const Real*, const Real*, int, int);                           \
  template void residual_forward<Real>(Real*, const Real*, const Real*, size_t);                            \
  template void dropout<Real>(Real*, const Real*, const uint64_t*, uint64_t, int, int, float);              \
  template void row_norms<Real>(Real*, const Real*, int, int);                                              \
  template void column_affine<Real>(Real*, int, int, int, const Real*, const Real*);                        \
  template void scale_rows<Real>(Real*, int, int, const Real*, Real);                                          \
  template void column_dot_accumulate<Real>(Real*, const Real*, int, const Real*, int, int, int, const Real*); \
  template void divide<Real>(Real*, const Real*, const Real*, size_t);                                      \
  template void softmax_crossentropy_forward<Real>(Real*, Real*, const int*, int, int);                     \
  template void softmax_crossentropy_backward<Real>(Real*, const int*, Real, int, int);
INSTANTIATE(float)
INSTANTIATE(double)
#undef INSTANTIATE

}  // namespace shardtrain::cpu
