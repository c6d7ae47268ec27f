// Causal self-attention with grouped-query heads, its one-query-row form against a key/value cache
// (generation), and the rotary embedding applied to its q and k.
// Forward: one (batch, query head) pair per OpenMP iteration with single-threaded GEMMs inside:
// scores = q k^T * scale, masked row softmax, out = att v. The full TxT score GEMM computes the
// masked half too; it is cheaper than row-by-row GEMVs at these sizes. Backward: one (batch,
// key/value head) pair per iteration, its query heads in order, so the key/value gradients that
// several query heads share are summed in a fixed order by one thread (no atomics). Decode: one
// (new token, query head) pair per iteration, scores, softmax and the weighted sum of v as plain
// loops over the cached positions (a row, not a matrix: no GEMM to gain from).
#include <cmath>
#include <cstring>
#include <limits>

#include "backend/cpu/gemm.hpp"
#include "backend/cpu/ops.hpp"

namespace shardtrain::cpu {

template <typename Real>
void attention_forward(Real* out, Real* att, const Real* qkv, int B, int T, int NH, int KV, int HS) {
  const int row = (NH + 2 * KV) * HS, group = NH / KV, C = NH * HS;
  const Real scale = Real(1) / std::sqrt(Real(HS));
#pragma omp parallel for collapse(2) schedule(static)
  for (int b = 0; b < B; b++) {
    for (int h = 0; h < NH; h++) {
      const Real* base = qkv + static_cast<size_t>(b) * T * row;
      const Real* q = base + h * HS;
      const Real* k = base + (NH + h / group) * HS;
      const Real* v = base + (NH + KV + h / group) * HS;
      Real* a = att + (static_cast<size_t>(b) * NH + h) * T * T;
      gemm(false, true, T, T, HS, scale, q, row, k, row, Real(0), a, T);
      for (int t = 0; t < T; t++) {
        Real* r = a + static_cast<size_t>(t) * T;
        Real max = r[0];
        for (int s = 1; s <= t; s++) max = r[s] > max ? r[s] : max;
        Real sum = 0;
        for (int s = 0; s <= t; s++) {
          r[s] = std::exp(r[s] - max);
          sum += r[s];
        }
        Real inv = Real(1) / sum;
        for (int s = 0; s <= t; s++) r[s] *= inv;
        for (int s = t + 1; s < T; s++) r[s] = 0;
      }
      Real* o = out + static_cast<size_t>(b) * T * C + h * HS;
      gemm(false, false, T, HS, T, Real(1), a, T, v, row, Real(0), o, C);
    }
  }
}

template <typename Real>
void attention_backward(Real* dqkv, Real* scratch, const Real* dout, const Real* qkv, const Real* att, int B, int T,
                        int NH, int KV, int HS) {
  const int row = (NH + 2 * KV) * HS, group = NH / KV, C = NH * HS;
  const Real scale = Real(1) / std::sqrt(Real(HS));
#pragma omp parallel for collapse(2) schedule(static)
  for (int b = 0; b < B; b++) {
    for (int kv = 0; kv < KV; kv++) {
      const size_t base = static_cast<size_t>(b) * T * row;
      const Real* k = qkv + base + (NH + kv) * HS;
      const Real* v = qkv + base + (NH + KV + kv) * HS;
      Real* dk = dqkv + base + (NH + kv) * HS;
      Real* dv = dqkv + base + (NH + KV + kv) * HS;
      for (int g = 0; g < group; g++) {
        const int h = kv * group + g;
        const Real beta = g == 0 ? Real(0) : Real(1);  // the first query head writes dk, dv; the rest add
        const Real* q = qkv + base + h * HS;
        Real* dq = dqkv + base + h * HS;
        const Real* a = att + (static_cast<size_t>(b) * NH + h) * T * T;
        const Real* dy = dout + static_cast<size_t>(b) * T * C + h * HS;
        Real* da = scratch + (static_cast<size_t>(b) * NH + h) * T * T;
        gemm(false, true, T, T, HS, Real(1), dy, C, v, row, Real(0), da, T);  // datt = dy v^T
        gemm(true, false, T, HS, T, Real(1), a, T, dy, C, beta, dv, row);     // dv (+)= att^T dy
        // Softmax backward: dscore = att * (datt - sum_s att*datt); zero where masked.
        for (int t = 0; t < T; t++) {
          const Real* ar = a + static_cast<size_t>(t) * T;
          Real* dr = da + static_cast<size_t>(t) * T;
          Real dot = 0;
          for (int s = 0; s <= t; s++) dot += ar[s] * dr[s];
          for (int s = 0; s <= t; s++) dr[s] = ar[s] * (dr[s] - dot);
          for (int s = t + 1; s < T; s++) dr[s] = 0;
        }
        gemm(false, false, T, HS, T, scale, da, T, k, row, Real(0), dq, row);  // dq = dscore k * scale
        gemm(true, false, T, HS, T, scale, da, T, q, row, beta, dk, row);      // dk (+)= dscore^T q * scale
      }
    }
  }
}

template <typename Real>
void attention_decode(Real* out, Real* scratch, Real* k_cache, Real* v_cache, const Real* qkv, int Q, int start,
                      int NH, int KV, int HS) {
  const int row = (NH + 2 * KV) * HS, group = NH / KV, C = NH * HS, KVC = KV * HS, T = start + Q;
  const Real scale = Real(1) / std::sqrt(Real(HS));
  for (int i = 0; i < Q; i++) {
    std::memcpy(k_cache + static_cast<size_t>(start + i) * KVC, qkv + static_cast<size_t>(i) * row + C,
                KVC * sizeof(Real));
    std::memcpy(v_cache + static_cast<size_t>(start + i) * KVC, qkv + static_cast<size_t>(i) * row + C + KVC,
                KVC * sizeof(Real));
  }
#pragma omp parallel for collapse(2) schedule(static)
  for (int i = 0; i < Q; i++) {
    for (int h = 0; h < NH; h++) {
      const int len = start + i + 1, kv = h / group;
      const Real* q = qkv + static_cast<size_t>(i) * row + h * HS;
      Real* s = scratch + (static_cast<size_t>(i) * NH + h) * T;
      Real max = -std::numeric_limits<Real>::infinity();
      for (int p = 0; p < len; p++) {
        const Real* k = k_cache + static_cast<size_t>(p) * KVC + kv * HS;
        Real dot = 0;
        for (int d = 0; d < HS; d++) dot += q[d] * k[d];
        s[p] = dot * scale;
        max = s[p] > max ? s[p] : max;
      }
      Real sum = 0;
      for (int p = 0; p < len; p++) {
        s[p] = std::exp(s[p] - max);
        sum += s[p];
      }
      const Real inv = Real(1) / sum;
      Real* o = out + static_cast<size_t>(i) * C + h * HS;
      for (int d = 0; d < HS; d++) o[d] = 0;
      for (int p = 0; p < len; p++) {
        const Real a = s[p] * inv;
        const Real* v = v_cache + static_cast<size_t>(p) * KVC + kv * HS;
        for (int d = 0; d < HS; d++) o[d] += a * v[d];
      }
    }
  }
}

// Turns every q and k head vector of each token by its position's angles; sign = -1 turns back.
template <typename Real>
void rope_turn(Real* qkv, const Real* cos, const Real* sin, int B, int T, int NH, int KV, int HS, Real sign) {
  const int row = (NH + 2 * KV) * HS, half = HS / 2;
#pragma omp parallel for schedule(static)
  for (int bt = 0; bt < B * T; bt++) {
    const Real* c = cos + static_cast<size_t>(bt % T) * half;
    const Real* s = sin + static_cast<size_t>(bt % T) * half;
    Real* r = qkv + static_cast<size_t>(bt) * row;
    for (int head = 0; head < NH + KV; head++) {  // the query heads, then the key heads
      Real* x = r + head * HS;
      for (int i = 0; i < half; i++) {
        const Real lo = x[i], hi = x[i + half], si = sign * s[i];
        x[i] = lo * c[i] - hi * si;
        x[i + half] = hi * c[i] + lo * si;
      }
    }
  }
}

template <typename Real>
void rope_forward(Real* qkv, const Real* cos, const Real* sin, int B, int T, int NH, int KV, int HS) {
  rope_turn(qkv, cos, sin, B, T, NH, KV, HS, Real(1));
}

template <typename Real>
void rope_backward(Real* dqkv, const Real* cos, const Real* sin, int B, int T, int NH, int KV, int HS) {
  rope_turn(dqkv, cos, sin, B, T, NH, KV, HS, Real(-1));
}

#define INSTANTIATE(Real)                                                                                       \
  template void attention_forward<Real>(Real*, Real*, const Real*, int, int, int, int, int);                    \
  template void attention_backward<Real>(Real*, Real*, const Real*, const Real*, const Real*, int, int, int, int, \
                                         int);                                                                  \
  template void attention_decode<Real>(Real*, Real*, Real*, Real*, const Real*, int, int, int, int, int);         \
  template void rope_forward<Real>(Real*, const Real*, const Real*, int, int, int, int, int);                    \
  template void rope_backward<Real>(Real*, const Real*, const Real*, int, int, int, int, int);
INSTANTIATE(float)
INSTANTIATE(double)
#undef INSTANTIATE

}  // namespace shardtrain::cpu
