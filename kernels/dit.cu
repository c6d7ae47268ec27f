// The layers a diffusion transformer adds (model/families/flux) on the GPU, with the semantics of
// backend/cpu/dit_ops.cpp: adaptive LayerNorm with per-sample shift and scale (FLUX's
// AdaLayerNormZero / Continuous), the gated residual, and the squared error of a regression head.
// (SiLU is pointwise.cu's, the interleaved rotary turn and the unmasked attention attention.cu's.)
//
// Row sums (the norm's mean and variance, its backward's two means, a row's squared error): one
// warp per row, lanes striding over the row, a fixed shuffle tree -- the layernorm kernels' layout
// (layernorm.cu), so the results differ from the CPU's sequential sums in the last bits only.
// Per-sample parameter gradients (dshift, dscale, dgate: sums over a sample's T rows): common.cuh's
// deterministic two-stage column sums, one launch pair per sample into that sample's row of the
// gradient. No atomics: the same inputs give the same bits.
#include "common.cuh"

namespace shardtrain::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kRowsPerBlock = kThreads / kWarpSize;

unsigned row_blocks(int rows) { return static_cast<unsigned>(ceil_div(static_cast<size_t>(rows), kRowsPerBlock)); }

// out = xhat * (1 + scale[b]) + shift[b], xhat = (x - mean) * rstd (two-pass variance, as the CPU).
__global__ void modulate_forward_kernel(float* out, float* mean, float* rstd, const float* inp, const float* shift,
                                        const float* scale, int ld, int T, int C, float eps, int rows) {
  const int lane = threadIdx.x % kWarpSize;
  const int row = blockIdx.x * kRowsPerBlock + threadIdx.x / kWarpSize;
  if (row >= rows) return;
  const float* x = inp + static_cast<size_t>(row) * C;
  const float* sh = shift + static_cast<size_t>(row / T) * ld;
  const float* sc = scale + static_cast<size_t>(row / T) * ld;
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
  for (int i = lane; i < C; i += kWarpSize) y[i] = (x[i] - m) * s * (1.0f + sc[i]) + sh[i];
  if (lane == 0) mean[row] = m, rstd[row] = s;
}

// dinp += rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dout * (1 + scale[b]).
__global__ void modulate_backward_dinp_kernel(float* dinp, const float* dout, const float* inp, const float* scale,
                                              const float* mean, const float* rstd, int ld, int T, int C, int rows) {
  const int lane = threadIdx.x % kWarpSize;
  const int row = blockIdx.x * kRowsPerBlock + threadIdx.x / kWarpSize;
  if (row >= rows) return;
  const size_t offset = static_cast<size_t>(row) * C;
  const float* x = inp + offset;
  const float* dy = dout + offset;
  const float* sc = scale + static_cast<size_t>(row / T) * ld;
  float* dx = dinp + offset;
  const float m = mean[row], s = rstd[row];
  float g_mean = 0.0f, g_norm_mean = 0.0f;
  for (int i = lane; i < C; i += kWarpSize) {
    const float g = dy[i] * (1.0f + sc[i]);
    g_mean += g;
    g_norm_mean += g * (x[i] - m) * s;
  }
  g_mean = warp_sum(g_mean) / C;
  g_norm_mean = warp_sum(g_norm_mean) / C;
  for (int i = lane; i < C; i += kWarpSize) {
    const float xhat = (x[i] - m) * s;
    dx[i] += s * (dy[i] * (1.0f + sc[i]) - g_mean - xhat * g_norm_mean);
  }
}

// Row n of one sample (the pointers start at the sample's first row), column c: {dshift, dscale} terms.
struct ModulateTerms {
  const float* dout;
  const float* inp;
  const float* mean;
  const float* rstd;
  int C;
  __device__ void operator()(int n, int c, float* t) const {
    const size_t i = static_cast<size_t>(n) * C + c;
    t[0] = dout[i];
    t[1] = dout[i] * (inp[i] - mean[n]) * rstd[n];
  }
};

// out = resid + gate[b] * y (one element per thread; out may be resid); dy = gate[b] * dout.
__global__ void gate_forward_kernel(float* out, const float* resid, const float* y, const float* gate, int ld, int T,
                                    int C, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t row = i / C;
    out[i] = resid[i] + gate[row / T * ld + i % C] * y[i];
  }
}

__global__ void gate_backward_dy_kernel(float* dy, const float* dout, const float* gate, int ld, int T, int C,
                                        size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t row = i / C;
    dy[i] = gate[row / T * ld + i % C] * dout[i];
  }
}

struct GateTerm {
  const float* dout;
  const float* y;
  int C;
  __device__ void operator()(int n, int c, float* t) const {
    const size_t i = static_cast<size_t>(n) * C + c;
    t[0] = dout[i] * y[i];
  }
};

__global__ void squared_error_kernel(float* losses, float* out_to_grad, const float* target, int W, int rows) {
  const int lane = threadIdx.x % kWarpSize;
  const int row = blockIdx.x * kRowsPerBlock + threadIdx.x / kWarpSize;
  if (row >= rows) return;
  float* o = out_to_grad + static_cast<size_t>(row) * W;
  const float* t = target + static_cast<size_t>(row) * W;
  float sum = 0.0f;
  for (int j = lane; j < W; j += kWarpSize) {
    const float d = o[j] - t[j];
    sum += d * d;
    o[j] = 2.0f * d;
  }
  sum = warp_sum(sum);
  if (lane == 0) losses[row] = sum;
}

void check_rows(const char* what, int ld, int B, int T, int C) {
  SHARD_CHECK(B >= 0 && T >= 0 && C > 0 && ld >= C, "%s: B=%d T=%d C=%d ld=%d (ld must be >= C)", what, B, T, C, ld);
}

}  // namespace

void launch_modulate_forward(float* out, float* mean, float* rstd, const float* inp, const float* shift,
                             const float* scale, int ld, int B, int T, int C, float eps, const LaunchContext& ctx) {
  check_rows("modulate_forward", ld, B, T, C);
  const int rows = B * T;
  if (rows == 0) return;
  modulate_forward_kernel<<<row_blocks(rows), kThreads, 0, ctx.stream>>>(out, mean, rstd, inp, shift, scale, ld, T, C,
                                                                         eps, rows);
  CUDA_CHECK_LAUNCH();
}

void launch_modulate_backward(float* dinp, float* dshift, float* dscale, const float* dout, const float* inp,
                              const float* scale, const float* mean, const float* rstd, int ld, int B, int T, int C,
                              void* workspace, const LaunchContext& ctx) {
  check_rows("modulate_backward", ld, B, T, C);
  const int rows = B * T;
  if (rows == 0) return;
  modulate_backward_dinp_kernel<<<row_blocks(rows), kThreads, 0, ctx.stream>>>(dinp, dout, inp, scale, mean, rstd, ld,
                                                                               T, C, rows);
  CUDA_CHECK_LAUNCH();
  if (!dshift && !dscale) return;
  for (int b = 0; b < B; b++) {
    const size_t first = static_cast<size_t>(b) * T;
    const ColumnTargets targets{{dshift ? dshift + static_cast<size_t>(b) * ld : nullptr,
                                 dscale ? dscale + static_cast<size_t>(b) * ld : nullptr}};
    column_sums_accumulate<2>(targets, static_cast<float*>(workspace), T, C,
                              ModulateTerms{dout + first * C, inp + first * C, mean + first, rstd + first, C}, ctx);
  }
}

void launch_gate_forward(float* out, const float* resid, const float* y, const float* gate, int ld, int B, int T,
                         int C, const LaunchContext& ctx) {
  check_rows("gate_forward", ld, B, T, C);
  const size_t n = static_cast<size_t>(B) * T * C;
  if (n == 0) return;
  gate_forward_kernel<<<grid_for(n, kThreads, ctx), kThreads, 0, ctx.stream>>>(out, resid, y, gate, ld, T, C, n);
  CUDA_CHECK_LAUNCH();
}

void launch_gate_backward(float* dy, float* dgate, const float* dout, const float* y, const float* gate, int ld,
                          int B, int T, int C, void* workspace, const LaunchContext& ctx) {
  check_rows("gate_backward", ld, B, T, C);
  const size_t n = static_cast<size_t>(B) * T * C;
  if (n == 0) return;
  if (dgate)
    for (int b = 0; b < B; b++) {
      const size_t first = static_cast<size_t>(b) * T * C;
      column_sums_accumulate<1>(ColumnTargets{{dgate + static_cast<size_t>(b) * ld, nullptr}},
                                static_cast<float*>(workspace), T, C, GateTerm{dout + first, y + first, C}, ctx);
    }
  gate_backward_dy_kernel<<<grid_for(n, kThreads, ctx), kThreads, 0, ctx.stream>>>(dy, dout, gate, ld, T, C, n);
  CUDA_CHECK_LAUNCH();
}

void launch_squared_error_forward(float* losses, float* out_to_grad, const float* target, int N, int W,
                                  const LaunchContext& ctx) {
  SHARD_CHECK(N >= 0 && W > 0, "squared_error_forward: N=%d W=%d", N, W);
  if (N == 0) return;
  squared_error_kernel<<<row_blocks(N), kThreads, 0, ctx.stream>>>(losses, out_to_grad, target, W, N);
  CUDA_CHECK_LAUNCH();
}

}  // namespace shardtrain::kernels
