// The layers a diffusion transformer adds (model/families/flux) on the GPU, with the semantics of
// backend/cpu/dit_ops.cpp: adaptive LayerNorm with per-sample shift and scale (FLUX's
// AdaLayerNormZero / Continuous), the gated residual, and the squared error of a regression head.
// (SiLU is pointwise.cu's, the interleaved rotary turn and the unmasked attention attention.cu's.)
//
// The adaptive LayerNorm is row_norm.cuh's (LayerNorm's kernels with a per-sample affine); a row's
// squared error is summed as its rows are: one warp per row, lanes striding over the row, a fixed
// shuffle tree, so the results differ from the CPU's sequential sums in the last bits only.
// Per-sample parameter gradients (dshift, dscale, dgate: sums over a sample's T rows): common.cuh's
// deterministic two-stage column sums, one launch pair per sample into that sample's row of the
// gradient. No atomics: the same inputs give the same bits.
#include "row_norm.cuh"

namespace shardtrain::kernels {
namespace {

constexpr int kThreads = 256;

// The modulation of sample row / T: gain 1 + scale, shift, from rows `ld` apart.
struct SampleAffine {
  const float* shift_rows;
  const float* scale_rows;
  int ld, T;
  __device__ float gain(int row, int i) const { return 1.0f + scale_rows[static_cast<size_t>(row / T) * ld + i]; }
  __device__ float shift(int row, int i) const { return shift_rows[static_cast<size_t>(row / T) * ld + i]; }
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
  const int row = blockIdx.x * kNormRowsPerBlock + threadIdx.x / kWarpSize;
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
  normalize_rows_kernel<<<norm_row_blocks(rows), kNormRowsPerBlock * kWarpSize, 0, ctx.stream>>>(
      out, mean, rstd, inp, SampleAffine{shift, scale, ld, T}, eps, rows, C);
  CUDA_CHECK_LAUNCH();
}

void launch_modulate_backward(float* dinp, float* dshift, float* dscale, const float* dout, const float* inp,
                              const float* scale, const float* mean, const float* rstd, int ld, int B, int T, int C,
                              void* workspace, const LaunchContext& ctx) {
  check_rows("modulate_backward", ld, B, T, C);
  const int rows = B * T;
  if (rows == 0) return;
  normalize_rows_backward_kernel<<<norm_row_blocks(rows), kNormRowsPerBlock * kWarpSize, 0, ctx.stream>>>(
      dinp, dout, inp, SampleAffine{nullptr, scale, ld, T}, mean, rstd, rows, C);
  CUDA_CHECK_LAUNCH();
  if (!dshift && !dscale) return;
  for (int b = 0; b < B; b++) {
    const size_t first = static_cast<size_t>(b) * T;
    const ColumnTargets targets{{dscale ? dscale + static_cast<size_t>(b) * ld : nullptr,
                                 dshift ? dshift + static_cast<size_t>(b) * ld : nullptr}};
    column_sums_accumulate<2>(targets, static_cast<float*>(workspace), T, C,
                              NormParamTerms{dout + first * C, inp + first * C, mean + first, rstd + first, C}, ctx);
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
  squared_error_kernel<<<norm_row_blocks(N), kNormRowsPerBlock * kWarpSize, 0, ctx.stream>>>(losses, out_to_grad,
                                                                                            target, W, N);
  CUDA_CHECK_LAUNCH();
}

}  // namespace shardtrain::kernels
