// LayerNorm's row arithmetic, shared by LayerNorm (layernorm.cu: a weight and bias per column) and a
// diffusion transformer's adaptive LayerNorm (dit.cu: a per-sample gain 1 + scale and shift):
// xhat = (x - mean) * rstd over each of N rows of C (two-pass variance, as the CPU), then
// y = xhat * gain + shift; the backward's dinp += rstd (g - mean(g) - xhat mean(g xhat)),
// g = dout * gain; and the parameters' terms of row n, column c: {xhat * dout, dout}. One warp per
// row (8 rows per 256-thread block), lanes striding over the row, fixed shuffle trees. Affine:
// a struct with __device__ gain(row, i) and shift(row, i). CUDA syntax; include from .cu files.
#pragma once

#include "common.cuh"

namespace shardtrain::kernels {

constexpr int kNormRowsPerBlock = 8;

inline unsigned norm_row_blocks(int N) {
  return static_cast<unsigned>(ceil_div(static_cast<size_t>(N), kNormRowsPerBlock));
}

template <typename Affine>
__global__ void normalize_rows_kernel(float* out, float* mean, float* rstd, const float* inp, Affine affine, float eps,
                                      int N, int C) {
  const int lane = threadIdx.x % kWarpSize;
  const int row = blockIdx.x * kNormRowsPerBlock + threadIdx.x / kWarpSize;
  if (row >= N) return;
  const float* x = inp + static_cast<size_t>(row) * C;
  float* y = out + static_cast<size_t>(row) * C;
  float sum = 0.0f;
  for (int i = lane; i < C; i += kWarpSize) sum += x[i];
  const float m = warp_sum(sum) / C;
  float var = 0.0f;
  for (int i = lane; i < C; i += kWarpSize) {
    const float d = x[i] - m;
    var += d * d;
  }
  const float s = 1.0f / sqrtf(warp_sum(var) / C + eps);
  for (int i = lane; i < C; i += kWarpSize) y[i] = (x[i] - m) * s * affine.gain(row, i) + affine.shift(row, i);
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = s;
  }
}

template <typename Affine>
__global__ void normalize_rows_backward_kernel(float* dinp, const float* dout, const float* inp, Affine affine,
                                               const float* mean, const float* rstd, int N, int C) {
  const int lane = threadIdx.x % kWarpSize;
  const int row = blockIdx.x * kNormRowsPerBlock + threadIdx.x / kWarpSize;
  if (row >= N) return;
  const size_t offset = static_cast<size_t>(row) * C;
  const float* x = inp + offset;
  const float* dy = dout + offset;
  float* dx = dinp + offset;
  const float m = mean[row], s = rstd[row];
  float g_mean = 0.0f, g_norm_mean = 0.0f;
  for (int i = lane; i < C; i += kWarpSize) {
    const float g = dy[i] * affine.gain(row, i);
    g_mean += g;
    g_norm_mean += g * (x[i] - m) * s;
  }
  g_mean = warp_sum(g_mean) / C;
  g_norm_mean = warp_sum(g_norm_mean) / C;
  for (int i = lane; i < C; i += kWarpSize) {
    const float norm = (x[i] - m) * s;
    dx[i] += s * (dy[i] * affine.gain(row, i) - g_mean - norm * g_norm_mean);
  }
}

// Row n, column c of the affine's gradients: {gain's term xhat * dout, shift's term dout}.
struct NormParamTerms {
  const float* dout;
  const float* inp;
  const float* mean;
  const float* rstd;
  int C;
  __device__ void operator()(int n, int c, float* t) const {
    const size_t i = static_cast<size_t>(n) * C + c;
    const float dy = dout[i];
    t[0] = (inp[i] - mean[n]) * rstd[n] * dy;
    t[1] = dy;
  }
};

}  // namespace shardtrain::kernels
