// The layers a diffusion transformer adds (model/families/flux): adaptive LayerNorm with per-sample
// shift and scale, gated residuals, SiLU, the squared error of a regression head, and a strided
// row copy (joining and splitting the text and image
// streams). Reductions over a sample's positions (the modulation's gradients) run per column in
// position order: the same bits for any thread count.
#include <cmath>
#include <cstring>

#include "backend/cpu/ops.hpp"
#include "backend/math.hpp"

namespace shardtrain::cpu {

template <typename Real>
void modulate_forward(Real* out, Real* mean, Real* rstd, const Real* inp, const Real* shift, const Real* scale,
                      int ld, int B, int T, int C, Real eps) {
#pragma omp parallel for schedule(static)
  for (int bt = 0; bt < B * T; bt++) {
    const Real* x = inp + static_cast<size_t>(bt) * C;
    const Real* sh = shift + static_cast<size_t>(bt / T) * ld;
    const Real* sc = scale + static_cast<size_t>(bt / T) * ld;
    Real* y = out + static_cast<size_t>(bt) * C;
    Real sum = 0;
    for (int i = 0; i < C; i++) sum += x[i];
    const Real m = sum / C;
    Real var = 0;
    for (int i = 0; i < C; i++) var += (x[i] - m) * (x[i] - m);
    const Real s = Real(1) / std::sqrt(var / C + eps);
    for (int i = 0; i < C; i++) y[i] = (x[i] - m) * s * (Real(1) + sc[i]) + sh[i];
    mean[bt] = m, rstd[bt] = s;
  }
}

template <typename Real>
void modulate_backward(Real* dinp, Real* dshift, Real* dscale, const Real* dout, const Real* inp, const Real* scale,
                       const Real* mean, const Real* rstd, int ld, int B, int T, int C) {
  // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dout * (1 + scale).
#pragma omp parallel for schedule(static)
  for (int bt = 0; bt < B * T; bt++) {
    const Real* x = inp + static_cast<size_t>(bt) * C;
    const Real* dy = dout + static_cast<size_t>(bt) * C;
    const Real* sc = scale + static_cast<size_t>(bt / T) * ld;
    Real* dx = dinp + static_cast<size_t>(bt) * C;
    const Real m = mean[bt], s = rstd[bt];
    Real g_mean = 0, g_norm_mean = 0;
    for (int i = 0; i < C; i++) {
      const Real g = dy[i] * (Real(1) + sc[i]);
      g_mean += g;
      g_norm_mean += g * (x[i] - m) * s;
    }
    g_mean /= C, g_norm_mean /= C;
    for (int i = 0; i < C; i++) {
      const Real xhat = (x[i] - m) * s;
      dx[i] += s * (dy[i] * (Real(1) + sc[i]) - g_mean - xhat * g_norm_mean);
    }
  }
  if (!dshift && !dscale) return;
#pragma omp parallel for collapse(2) schedule(static)
  for (int b = 0; b < B; b++)
    for (int i = 0; i < C; i++) {
      Real sh = 0, sc = 0;
      for (int t = 0; t < T; t++) {
        const size_t bt = static_cast<size_t>(b) * T + t;
        const Real dy = dout[bt * C + i];
        sh += dy;
        sc += dy * (inp[bt * C + i] - mean[bt]) * rstd[bt];
      }
      if (dshift) dshift[static_cast<size_t>(b) * ld + i] += sh;
      if (dscale) dscale[static_cast<size_t>(b) * ld + i] += sc;
    }
}

template <typename Real>
void gate_forward(Real* out, const Real* resid, const Real* y, const Real* gate, int ld, int B, int T, int C) {
#pragma omp parallel for schedule(static)
  for (int bt = 0; bt < B * T; bt++) {
    const Real* g = gate + static_cast<size_t>(bt / T) * ld;
    const size_t row = static_cast<size_t>(bt) * C;
    for (int i = 0; i < C; i++) out[row + i] = resid[row + i] + g[i] * y[row + i];
  }
}

template <typename Real>
void gate_backward(Real* dy, Real* dgate, const Real* dout, const Real* y, const Real* gate, int ld, int B, int T,
                   int C) {
#pragma omp parallel for schedule(static)
  for (int bt = 0; bt < B * T; bt++) {
    const Real* g = gate + static_cast<size_t>(bt / T) * ld;
    const size_t row = static_cast<size_t>(bt) * C;
    for (int i = 0; i < C; i++) dy[row + i] = g[i] * dout[row + i];
  }
  if (!dgate) return;
#pragma omp parallel for collapse(2) schedule(static)
  for (int b = 0; b < B; b++)
    for (int i = 0; i < C; i++) {
      Real sum = 0;
      for (int t = 0; t < T; t++) {
        const size_t at = (static_cast<size_t>(b) * T + t) * C + i;
        sum += dout[at] * y[at];
      }
      dgate[static_cast<size_t>(b) * ld + i] += sum;
    }
}

template <typename Real>
void silu_forward(Real* out, const Real* inp, size_t n) {
#pragma omp parallel for simd schedule(static)
  for (size_t i = 0; i < n; i++) out[i] = silu_value(inp[i]);
}

template <typename Real>
void silu_backward(Real* dinp, const Real* dout, const Real* inp, size_t n) {
#pragma omp parallel for simd schedule(static)
  for (size_t i = 0; i < n; i++) dinp[i] = dout[i] * silu_derivative(inp[i]);
}

template <typename Real>
void squared_error_forward(Real* losses, Real* out_to_grad, const Real* target, int N, int W) {
#pragma omp parallel for schedule(static)
  for (int r = 0; r < N; r++) {
    Real* o = out_to_grad + static_cast<size_t>(r) * W;
    const Real* t = target + static_cast<size_t>(r) * W;
    Real sum = 0;
    for (int j = 0; j < W; j++) {
      const Real d = o[j] - t[j];
      sum += d * d;
      o[j] = 2 * d;
    }
    losses[r] = sum;
  }
}

template <typename Real>
void copy_rows(Real* dst, int ld_dst, const Real* src, int ld_src, int rows, int cols) {
#pragma omp parallel for schedule(static)
  for (int r = 0; r < rows; r++)
    std::memcpy(dst + static_cast<size_t>(r) * ld_dst, src + static_cast<size_t>(r) * ld_src, cols * sizeof(Real));
}

#define INSTANTIATE(Real)                                                                                           \
  template void modulate_forward<Real>(Real*, Real*, Real*, const Real*, const Real*, const Real*, int, int, int,   \
                                       int, Real);                                                                  \
  template void modulate_backward<Real>(Real*, Real*, Real*, const Real*, const Real*, const Real*, const Real*,    \
                                        const Real*, int, int, int, int);                                           \
  template void gate_forward<Real>(Real*, const Real*, const Real*, const Real*, int, int, int, int);               \
  template void gate_backward<Real>(Real*, Real*, const Real*, const Real*, const Real*, int, int, int, int);       \
  template void silu_forward<Real>(Real*, const Real*, size_t);                                                     \
  template void silu_backward<Real>(Real*, const Real*, const Real*, size_t);                                       \
  template void squared_error_forward<Real>(Real*, Real*, const Real*, int, int);                                   \
  template void copy_rows<Real>(Real*, int, const Real*, int, int, int);
INSTANTIATE(float)
INSTANTIATE(double)
#undef INSTANTIATE

}  // namespace shardtrain::cpu
