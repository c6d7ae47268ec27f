// Causal multi-head self-attention, one (batch, head) pair per OpenMP iteration with single-
// threaded GEMMs inside: scores = q k^T * scale, masked row softmax, out = att v. The full TxT
// score GEMM computes the masked half too; it is cheaper than row-by-row GEMVs at GPT-2 sizes.
#include <cmath>

#include "backend/cpu/gemm.hpp"
#include "backend/cpu/ops.hpp"

namespace shardtrain::cpu {

template <typename Real>
void attention_forward(Real* out, Real* att, const Real* qkv, int B, int T, int C, int NH) {
  const int hs = C / NH;
  const int row = 3 * C;
  const Real scale = Real(1) / std::sqrt(Real(hs));
#pragma omp parallel for collapse(2) schedule(static)
  for (int b = 0; b < B; b++) {
    for (int h = 0; h < NH; h++) {
      const Real* q = qkv + static_cast<size_t>(b) * T * row + h * hs;
      const Real* k = q + C;
      const Real* v = q + 2 * C;
      Real* a = att + (static_cast<size_t>(b) * NH + h) * T * T;
      gemm(false, true, T, T, hs, scale, q, row, k, row, Real(0), a, T);
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
      Real* o = out + static_cast<size_t>(b) * T * C + h * hs;
      gemm(false, false, T, hs, T, Real(1), a, T, v, row, Real(0), o, C);
    }
  }
}

template <typename Real>
void attention_backward(Real* dqkv, Real* scratch, const Real* dout, const Real* qkv, const Real* att, int B, int T,
                        int C, int NH) {
  const int hs = C / NH;
  const int row = 3 * C;
  const Real scale = Real(1) / std::sqrt(Real(hs));
#pragma omp parallel for collapse(2) schedule(static)
  for (int b = 0; b < B; b++) {
    for (int h = 0; h < NH; h++) {
      const size_t qkv_offset = static_cast<size_t>(b) * T * row + h * hs;
      const Real* q = qkv + qkv_offset;
      const Real* k = q + C;
      const Real* v = q + 2 * C;
      Real* dq = dqkv + qkv_offset;
      Real* dk = dq + C;
      Real* dv = dq + 2 * C;
      const Real* a = att + (static_cast<size_t>(b) * NH + h) * T * T;
      const Real* dy = dout + static_cast<size_t>(b) * T * C + h * hs;
      Real* da = scratch + (static_cast<size_t>(b) * NH + h) * T * T;
      gemm(false, true, T, T, hs, Real(1), dy, C, v, row, Real(0), da, T);  // datt = dy v^T
      gemm(true, false, T, hs, T, Real(1), a, T, dy, C, Real(0), dv, row);  // dv = att^T dy
      // Softmax backward: dscore = att * (datt - sum_s att*datt); zero where masked.
      for (int t = 0; t < T; t++) {
        const Real* ar = a + static_cast<size_t>(t) * T;
        Real* dr = da + static_cast<size_t>(t) * T;
        Real dot = 0;
        for (int s = 0; s <= t; s++) dot += ar[s] * dr[s];
        for (int s = 0; s <= t; s++) dr[s] = ar[s] * (dr[s] - dot);
        for (int s = t + 1; s < T; s++) dr[s] = 0;
      }
      gemm(false, false, T, hs, T, scale, da, T, k, row, Real(0), dq, row);  // dq = dscore k * scale
      gemm(true, false, T, hs, T, scale, da, T, q, row, Real(0), dk, row);   // dk = dscore^T q * scale
    }
  }
}

template void attention_forward<float>(float*, float*, const float*, int, int, int, int);
template void attention_forward<double>(double*, double*, const double*, int, int, int, int);
template void attention_backward<float>(float*, float*, const float*, const float*, const float*, int, int, int, int);
template void attention_backward<double>(double*, double*, const double*, const double*, const double*, int, int, int,
                                         int);

}  // namespace shardtrain::cpu
