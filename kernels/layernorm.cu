// The norms over the last dimension on the GPU, with the shapes and accumulation rule of
// backend/cpu/layernorm.cpp. LayerNorm, GPT-2 style (eps 1e-5, biased variance): out(N,C), saved
// mean(N) and rstd(N); the backward accumulates dinp(N,C) += (it adds onto the residual-stream
// gradient), dweight(C) += and dbias(C) +=. RMSNorm, Llama style (no mean, no bias, eps given):
// out(N,C) = inp * rstd * weight, saved rstd(N); the backward accumulates dinp += and dweight +=.
// A null dweight or dbias (frozen parameter) is skipped; dinp is computed the same regardless.
//
// Forward and the backward's dinp: one warp per row (8 rows per 256-thread block); each lane
// strides over the row, the warp sums with a fixed shuffle tree. The variance is two-pass (sum of
// squared deviations from the mean), as on the CPU, so a large mean costs no digits. fp32
// throughout; the per-row sums are reassociated (32 lane partials), so results differ from the
// CPU's sequential sums in the last bits only.
// The parameter gradients: column sums over rows with the deterministic two-stage reduction of
// common.cuh (fixed row chunks, then chunks in order), no atomics. LayerNorm's kernels are
// row_norm.cuh's, shared with dit.cu's adaptive LayerNorm.
#include "row_norm.cuh"

namespace shardtrain::kernels {
namespace {

constexpr float kLayerNormEps = 1e-5f;

// LayerNorm's affine: a weight and a bias per column.
struct ColumnAffine {
  const float* weight;
  const float* bias;
  __device__ float gain(int, int i) const { return weight[i]; }
  __device__ float shift(int, int i) const { return bias[i]; }
};

__global__ void rmsnorm_forward_kernel(float* out, float* rstd, const float* inp, const float* weight, float eps, int N,
                                       int C) {
  const int lane = threadIdx.x % kWarpSize;
  const int row = blockIdx.x * kNormRowsPerBlock + threadIdx.x / kWarpSize;
  if (row >= N) return;
  const float* x = inp + static_cast<size_t>(row) * C;
  float* y = out + static_cast<size_t>(row) * C;
  float squares = 0.0f;
  for (int i = lane; i < C; i += kWarpSize) squares += x[i] * x[i];
  const float s = 1.0f / sqrtf(warp_sum(squares) / C + eps);
  for (int i = lane; i < C; i += kWarpSize) y[i] = x[i] * s * weight[i];
  if (lane == 0) rstd[row] = s;
}

// dinp += rstd * (g - norm * mean(g * norm)), g = dout * weight, norm = x * rstd.
__global__ void rmsnorm_backward_dinp_kernel(float* dinp, const float* dout, const float* inp, const float* weight,
                                             const float* rstd, int N, int C) {
  const int lane = threadIdx.x % kWarpSize;
  const int row = blockIdx.x * kNormRowsPerBlock + threadIdx.x / kWarpSize;
  if (row >= N) return;
  const size_t offset = static_cast<size_t>(row) * C;
  const float* x = inp + offset;
  const float* dy = dout + offset;
  float* dx = dinp + offset;
  const float s = rstd[row];
  float g_norm_mean = 0.0f;
  for (int i = lane; i < C; i += kWarpSize) g_norm_mean += dy[i] * weight[i] * x[i] * s;
  g_norm_mean = warp_sum(g_norm_mean) / C;
  for (int i = lane; i < C; i += kWarpSize) dx[i] += s * (dy[i] * weight[i] - x[i] * s * g_norm_mean);
}

// Row n, column c of dweight: norm * dout.
struct RmsNormWeightTerm {
  const float* dout;
  const float* inp;
  const float* rstd;
  int C;
  __device__ void operator()(int n, int c, float* t) const {
    const size_t i = static_cast<size_t>(n) * C + c;
    t[0] = inp[i] * rstd[n] * dout[i];
  }
};

}  // namespace

void launch_layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                              const float* bias, int N, int C, const LaunchContext& ctx) {
  SHARD_CHECK(N >= 0 && C > 0, "layernorm_forward: N=%d C=%d", N, C);
  if (N == 0) return;
  normalize_rows_kernel<<<norm_row_blocks(N), kNormRowsPerBlock * kWarpSize, 0, ctx.stream>>>(
      out, mean, rstd, inp, ColumnAffine{weight, bias}, kLayerNormEps, N, C);
  CUDA_CHECK_LAUNCH();
}

void launch_layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                               const float* weight, const float* mean, const float* rstd, int N, int C,
                               void* workspace, const LaunchContext& ctx) {
  SHARD_CHECK(N >= 0 && C > 0, "layernorm_backward: N=%d C=%d", N, C);
  if (N == 0) return;
  normalize_rows_backward_kernel<<<norm_row_blocks(N), kNormRowsPerBlock * kWarpSize, 0, ctx.stream>>>(
      dinp, dout, inp, ColumnAffine{weight, nullptr}, mean, rstd, N, C);
  CUDA_CHECK_LAUNCH();
  // dweight and dbias each may be null (frozen): both null, no column sums (and no workspace read);
  // one null, the pair is still summed (so the other's bits are those of the full backward) but
  // only the non-null one is stored.
  if (dweight || dbias)
    column_sums_accumulate<2>(ColumnTargets{{dweight, dbias}}, static_cast<float*>(workspace), N, C,
                              NormParamTerms{dout, inp, mean, rstd, C}, ctx);
}

void launch_rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, float eps, int N, int C,
                            const LaunchContext& ctx) {
  SHARD_CHECK(N >= 0 && C > 0 && eps >= 0.0f, "rmsnorm_forward: N=%d C=%d eps=%g", N, C, static_cast<double>(eps));
  if (N == 0) return;
  rmsnorm_forward_kernel<<<norm_row_blocks(N), kNormRowsPerBlock * kWarpSize, 0, ctx.stream>>>(out, rstd, inp, weight,
                                                                                              eps, N, C);
  CUDA_CHECK_LAUNCH();
}

void launch_rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                             const float* rstd, int N, int C, void* workspace, const LaunchContext& ctx) {
  SHARD_CHECK(N >= 0 && C > 0, "rmsnorm_backward: N=%d C=%d", N, C);
  if (N == 0) return;
  rmsnorm_backward_dinp_kernel<<<norm_row_blocks(N), kNormRowsPerBlock * kWarpSize, 0, ctx.stream>>>(
      dinp, dout, inp, weight, rstd, N, C);
  CUDA_CHECK_LAUNCH();
  if (dweight)  // null: a frozen weight, no column sums (and no workspace read)
    column_sums_accumulate<1>(ColumnTargets{{dweight, nullptr}}, static_cast<float*>(workspace), N, C,
                              RmsNormWeightTerm{dout, inp, rstd, C}, ctx);
}

}  // namespace shardtrain::kernels
