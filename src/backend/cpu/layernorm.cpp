// The norms over the last dimension. LayerNorm, GPT-2 style: eps 1e-5, biased variance; the forward
// saves mean and rstd per row for the backward. RMSNorm, Llama style: no mean, no bias, eps given;
// the forward saves rstd. Parameter gradients are column sums done in fixed
// column blocks, skipped where null (frozen); dinp is accumulated (+=) onto the residual-stream
// gradient, the same bits with or without the parameter gradients.
#include <algorithm>
#include <cmath>

#include "backend/cpu/gemm.hpp"
#include "backend/cpu/ops.hpp"

namespace shardtrain::cpu {

constexpr double LAYERNORM_EPS = 1e-5;

template <typename Real>
void layernorm_forward(Real* out, Real* mean, Real* rstd, const Real* inp, const Real* weight, const Real* bias,
                       int N, int C) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; n++) {
    const Real* x = inp + static_cast<size_t>(n) * C;
    Real* y = out + static_cast<size_t>(n) * C;
    Real sum = 0;
    for (int i = 0; i < C; i++) sum += x[i];
    Real m = sum / C;
    Real var = 0;
    for (int i = 0; i < C; i++) var += (x[i] - m) * (x[i] - m);
    Real s = Real(1) / std::sqrt(var / C + Real(LAYERNORM_EPS));
    for (int i = 0; i < C; i++) y[i] = (x[i] - m) * s * weight[i] + bias[i];
    mean[n] = m;
    rstd[n] = s;
  }
}

template <typename Real>
void layernorm_backward(Real* dinp, Real* dweight, Real* dbias, const Real* dout, const Real* inp, const Real* weight,
                        const Real* mean, const Real* rstd, int N, int C) {
  // dinp = rstd * (g - mean(g) - norm * mean(g * norm)), with g = dout * weight.
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; n++) {
    const Real* x = inp + static_cast<size_t>(n) * C;
    const Real* dy = dout + static_cast<size_t>(n) * C;
    Real* dx = dinp + static_cast<size_t>(n) * C;
    Real m = mean[n], s = rstd[n];
    Real g_mean = 0, g_norm_mean = 0;
    for (int i = 0; i < C; i++) {
      Real g = dy[i] * weight[i];
      g_mean += g;
      g_norm_mean += g * (x[i] - m) * s;
    }
    g_mean /= C;
    g_norm_mean /= C;
    for (int i = 0; i < C; i++) {
      Real norm = (x[i] - m) * s;
      dx[i] += s * (dy[i] * weight[i] - g_mean - norm * g_norm_mean);
    }
  }
  if (!dweight && !dbias) return;  // frozen weight and bias
  int blocks = (C + COLUMN_BLOCK - 1) / COLUMN_BLOCK;
#pragma omp parallel for schedule(static)
  for (int blk = 0; blk < blocks; blk++) {
    int lo = blk * COLUMN_BLOCK, hi = std::min(C, lo + COLUMN_BLOCK);
    for (int n = 0; n < N; n++) {
      const Real* x = inp + static_cast<size_t>(n) * C;
      const Real* dy = dout + static_cast<size_t>(n) * C;
      if (dbias)
        for (int i = lo; i < hi; i++) dbias[i] += dy[i];
      if (dweight)
        for (int i = lo; i < hi; i++) dweight[i] += (x[i] - mean[n]) * rstd[n] * dy[i];
    }
  }
}

template <typename Real>
void rmsnorm_forward(Real* out, Real* rstd, const Real* inp, const Real* weight, Real eps, int N, int C) {
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; n++) {
    const Real* x = inp + static_cast<size_t>(n) * C;
    Real* y = out + static_cast<size_t>(n) * C;
    Real squares = 0;
    for (int i = 0; i < C; i++) squares += x[i] * x[i];
    Real s = Real(1) / std::sqrt(squares / C + eps);
    for (int i = 0; i < C; i++) y[i] = x[i] * s * weight[i];
    rstd[n] = s;
  }
}

template <typename Real>
void rmsnorm_backward(Real* dinp, Real* dweight, const Real* dout, const Real* inp, const Real* weight,
                      const Real* rstd, int N, int C) {
  // dinp = rstd * (g - norm * mean(g * norm)), with g = dout * weight and norm = inp * rstd.
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; n++) {
    const Real* x = inp + static_cast<size_t>(n) * C;
    const Real* dy = dout + static_cast<size_t>(n) * C;
    Real* dx = dinp + static_cast<size_t>(n) * C;
    const Real s = rstd[n];
    Real g_norm_mean = 0;
    for (int i = 0; i < C; i++) g_norm_mean += dy[i] * weight[i] * x[i] * s;
    g_norm_mean /= C;
    for (int i = 0; i < C; i++) dx[i] += s * (dy[i] * weight[i] - x[i] * s * g_norm_mean);
  }
  if (!dweight) return;  // frozen weight
  int blocks = (C + COLUMN_BLOCK - 1) / COLUMN_BLOCK;
#pragma omp parallel for schedule(static)
  for (int blk = 0; blk < blocks; blk++) {
    int lo = blk * COLUMN_BLOCK, hi = std::min(C, lo + COLUMN_BLOCK);
    for (int n = 0; n < N; n++) {
      const Real* x = inp + static_cast<size_t>(n) * C;
      const Real* dy = dout + static_cast<size_t>(n) * C;
      for (int i = lo; i < hi; i++) dweight[i] += x[i] * rstd[n] * dy[i];
    }
  }
}

template void layernorm_forward<float>(float*, float*, float*, const float*, const float*, const float*, int, int);
template void layernorm_forward<double>(double*, double*, double*, const double*, const double*, const double*, int,
                                        int);
template void layernorm_backward<float>(float*, float*, float*, const float*, const float*, const float*,
                                        const float*, const float*, int, int);
template void layernorm_backward<double>(double*, double*, double*, const double*, const double*, const double*,
                                         const double*, const double*, int, int);

template void rmsnorm_forward<float>(float*, float*, const float*, const float*, float, int, int);
template void rmsnorm_forward<double>(double*, double*, const double*, const double*, double, int, int);
template void rmsnorm_backward<float>(float*, float*, const float*, const float*, const float*, const float*, int,
                                      int);
template void rmsnorm_backward<double>(double*, double*, const double*, const double*, const double*, const double*,
                                       int, int);

}  // namespace shardtrain::cpu
