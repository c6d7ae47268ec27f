// Linear layers: out(N,OC) = inp(N,C) @ weight(OC,C)^T + bias. Both directions are GEMMs (a single
// row forward, as generation runs, a matrix-vector product); the
// bias gradient is a column sum done in fixed column blocks (deterministic, no atomics). Each
// gradient of the backward may be null (frozen weight or bias, or no input gradient wanted).
#include <algorithm>

#include "backend/cpu/gemm.hpp"
#include "backend/cpu/ops.hpp"

namespace shardtrain::cpu {

template <typename Real>
void matmul_forward(Real* out, const Real* inp, const Real* weight, const Real* bias, int N, int C, int OC) {
  Real beta = 0;
  if (bias) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) std::copy(bias, bias + OC, out + static_cast<size_t>(n) * OC);
    beta = 1;
  }
  if (N == 1)  // one row (generation): weight @ inp as a matrix-vector product, no packing
    gemv(OC, C, Real(1), weight, C, inp, beta, out);
  else
    gemm(false, true, N, OC, C, Real(1), inp, C, weight, C, beta, out, OC);
}

template <typename Real>
void matmul_backward(Real* dinp, Real* dweight, Real* dbias, const Real* dout, const Real* inp, const Real* weight,
                     int N, int C, int OC) {
  if (dinp) gemm(false, false, N, C, OC, Real(1), dout, OC, weight, C, Real(0), dinp, C);
  if (dweight) gemm(true, false, OC, C, N, Real(1), dout, OC, inp, C, Real(1), dweight, C);
  if (dbias) {
    int blocks = (OC + COLUMN_BLOCK - 1) / COLUMN_BLOCK;
#pragma omp parallel for schedule(static)
    for (int blk = 0; blk < blocks; blk++) {
      int lo = blk * COLUMN_BLOCK, hi = std::min(OC, lo + COLUMN_BLOCK);
      for (int n = 0; n < N; n++) {
        const Real* row = dout + static_cast<size_t>(n) * OC;
        for (int o = lo; o < hi; o++) dbias[o] += row[o];
      }
    }
  }
}

template void matmul_forward<float>(float*, const float*, const float*, const float*, int, int, int);
template void matmul_forward<double>(double*, const double*, const double*, const double*, int, int, int);
template void matmul_backward<float>(float*, float*, float*, const float*, const float*, const float*, int, int, int);
template void matmul_backward<double>(double*, double*, double*, const double*, const double*, const double*, int,
                                      int, int);

}  // namespace shardtrain::cpu
