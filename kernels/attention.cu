// Causal multi-head self-attention on the GPU with the CPU's saved-state interface
// (backend/cpu/attention.cpp): qkv(B,T,3C) holds q|k|v, each NH heads of hs = C/NH; out(B,T,C);
// att(B,NH,T,T) keeps the softmax probabilities, zero above the diagonal; scale 1/sqrt(hs).
//
// Forward: split qkv into head-major q, k, v (B,NH,T,hs) (one permute kernel); att = scale q k^T
// as one strided-batched cuBLASLt GEMM over the B*NH heads (the full T x T, like the CPU); the
// causal softmax in place, one warp per row; y = att v (batched GEMM); merge y's heads into
// out(B,T,C).
// Backward: split qkv and dout; datt = dy v^T into `scratch`; dv = att^T dy; softmax backward in
// place (dscore = att * (datt - sum(att * datt)), zero above the diagonal); dq = scale dscore k;
// dk = scale dscore^T q; merge dq|dk|dv into dqkv (written, =).
//
// The head-major copies live in a workspace of attention_workspace_bytes(): 5 slots of B*T*C
// floats. Forward: q k v y. Backward: q k v dy dv, then dq overwrites dy (dead after dv and datt)
// and dk overwrites v (dead after datt). fp32 GEMMs (matmul.cu); expf in the softmax as the CPU's
// std::exp (both within 2 ulp).
#include <cmath>

#include "common.cuh"

namespace shardtrain::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kRowsPerBlock = kThreads / kWarpSize;
constexpr int kSlots = 5;

// Up to three same-shaped tensors: the parts q|k|v of a permute.
struct Parts {
  float* p[3];
};
struct ConstParts {
  const float* p[3];
};

// Head-major element i = [b,h,t,d] of a (B,NH,T,hs) tensor: its offset (b*T + t)*row_stride +
// h*hs + d in the token-major (B,T,row_stride) layout.
__device__ inline size_t token_major_offset(size_t i, int T, int NH, int hs, int row_stride) {
  const int d = static_cast<int>(i % hs);
  size_t rest = i / hs;
  const int t = static_cast<int>(rest % T);
  rest /= T;
  const int h = static_cast<int>(rest % NH);
  const size_t b = rest / NH;
  return (b * T + t) * row_stride + static_cast<size_t>(h) * hs + d;
}

// dst.p[part][b,h,t,d] = src[(b*T + t)*row_stride + part*C + h*hs + d], part < parts.
__global__ void split_heads_kernel(Parts dst, const float* src, int row_stride, int parts, int B, int T, int NH,
                                   int hs) {
  const size_t n = static_cast<size_t>(B) * NH * T * hs;
  const int C = NH * hs;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const float* s = src + token_major_offset(i, T, NH, hs, row_stride);
    for (int part = 0; part < parts; part++) dst.p[part][i] = s[static_cast<size_t>(part) * C];
  }
}

// dst[(b*T + t)*row_stride + part*C + h*hs + d] = src.p[part][b,h,t,d], part < parts.
__global__ void merge_heads_kernel(float* dst, ConstParts src, int row_stride, int parts, int B, int T, int NH,
                                   int hs) {
  const size_t n = static_cast<size_t>(B) * NH * T * hs;
  const int C = NH * hs;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float* o = dst + token_major_offset(i, T, NH, hs, row_stride);
    for (int part = 0; part < parts; part++) o[static_cast<size_t>(part) * C] = src.p[part][i];
  }
}

// Row r of the (rows, T) score matrix, query position t = r % T: softmax over s <= t in place,
// zero for s > t. One warp per row.
__global__ void causal_softmax_forward_kernel(float* att, size_t rows, int T) {
  const int lane = threadIdx.x % kWarpSize;
  const size_t row = blockIdx.x * static_cast<size_t>(kRowsPerBlock) + threadIdx.x / kWarpSize;
  if (row >= rows) return;
  const int t = static_cast<int>(row % T);
  float* r = att + row * T;
  float max = -INFINITY;
  for (int s = lane; s <= t; s += kWarpSize) max = fmaxf(max, r[s]);
  max = warp_max(max);
  float sum = 0.0f;
  for (int s = lane; s <= t; s += kWarpSize) {
    const float e = expf(r[s] - max);
    r[s] = e;
    sum += e;
  }
  const float inv = 1.0f / warp_sum(sum);
  for (int s = lane; s <= t; s += kWarpSize) r[s] *= inv;
  for (int s = t + 1 + lane; s < T; s += kWarpSize) r[s] = 0.0f;
}

// In place on datt: dscore[s] = att[s] * (datt[s] - sum_s' att[s'] datt[s']) for s <= t, 0 above.
__global__ void causal_softmax_backward_kernel(float* datt, const float* att, size_t rows, int T) {
  const int lane = threadIdx.x % kWarpSize;
  const size_t row = blockIdx.x * static_cast<size_t>(kRowsPerBlock) + threadIdx.x / kWarpSize;
  if (row >= rows) return;
  const int t = static_cast<int>(row % T);
  const float* a = att + row * T;
  float* d = datt + row * T;
  float dot = 0.0f;
  for (int s = lane; s <= t; s += kWarpSize) dot += a[s] * d[s];
  dot = warp_sum(dot);
  for (int s = lane; s <= t; s += kWarpSize) d[s] = a[s] * (d[s] - dot);
  for (int s = t + 1 + lane; s < T; s += kWarpSize) d[s] = 0.0f;
}

void check_attention_args(const char* what, int B, int T, int C, int NH) {
  SHARD_CHECK(B >= 0 && T >= 0 && C > 0 && NH > 0 && C % NH == 0, "%s: B=%d T=%d C=%d NH=%d (C must divide by NH)",
              what, B, T, C, NH);
}

unsigned row_blocks(size_t rows) { return static_cast<unsigned>(ceil_div(rows, kRowsPerBlock)); }

}  // namespace

size_t attention_workspace_bytes(int B, int T, int C) {
  WorkspaceCarver carver(nullptr);
  for (int slot = 0; slot < kSlots; slot++) carver.take<float>(static_cast<size_t>(B) * T * C);
  return carver.bytes();
}

// The dimensions both directions use, and the workspace cut into five head-major (B,NH,T,hs)
// buffers: q, k, v, then y (forward) or dy, dv (backward).
struct HeadLayout {
  int hs, BNH;
  size_t btc;
  long long head, square;  // elements of one head's (T,hs) and (T,T) matrices: the batch strides
  float scale;
  float *q, *k, *v, *fourth, *fifth;
  HeadLayout(int B, int T, int C, int NH, void* workspace)
      : hs(C / NH),
        BNH(B * NH),
        btc(static_cast<size_t>(B) * T * C),
        head(static_cast<long long>(T) * (C / NH)),
        square(static_cast<long long>(T) * T),
        scale(1.0f / sqrtf(static_cast<float>(C / NH))) {
    WorkspaceCarver carver(workspace);
    float** parts[5] = {&q, &k, &v, &fourth, &fifth};
    for (float** p : parts) *p = carver.take<float>(btc);
  }
};

void launch_attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH, void* workspace,
                              const GemmContext& ctx) {
  check_attention_args("attention_forward", B, T, C, NH);
  if (B == 0 || T == 0) return;
  const HeadLayout h(B, T, C, NH, workspace);
  const int hs = h.hs, BNH = h.BNH;
  const long long head = h.head, square = h.square;
  const LaunchContext& launch = ctx.launch;
  float *q = h.q, *k = h.k, *v = h.v, *y = h.fourth;

  split_heads_kernel<<<grid_for(h.btc, kThreads, launch), kThreads, 0, launch.stream>>>(Parts{{q, k, v}}, qkv, 3 * C, 3,
                                                                                      B, T, NH, hs);
  CUDA_CHECK_LAUNCH();
  // att = scale * q @ k^T, per head (T,T)
  gemm_row_major(ctx, false, true, T, T, hs, h.scale, q, hs, head, k, hs, head, 0.0f, att, T, square, BNH, nullptr);
  const size_t rows = static_cast<size_t>(BNH) * T;
  causal_softmax_forward_kernel<<<row_blocks(rows), kThreads, 0, launch.stream>>>(att, rows, T);
  CUDA_CHECK_LAUNCH();
  // y = att @ v, per head (T,hs)
  gemm_row_major(ctx, false, false, T, hs, T, 1.0f, att, T, square, v, hs, head, 0.0f, y, hs, head, BNH, nullptr);
  merge_heads_kernel<<<grid_for(h.btc, kThreads, launch), kThreads, 0, launch.stream>>>(out, ConstParts{{y}}, C, 1, B,
                                                                                      T, NH, hs);
  CUDA_CHECK_LAUNCH();
}

void launch_attention_backward(float* dqkv, float* scratch, const float* dout, const float* qkv, const float* att,
                               int B, int T, int C, int NH, void* workspace, const GemmContext& ctx) {
  check_attention_args("attention_backward", B, T, C, NH);
  if (B == 0 || T == 0) return;
  const HeadLayout h(B, T, C, NH, workspace);
  const int hs = h.hs, BNH = h.BNH;
  const long long head = h.head, square = h.square;
  const LaunchContext& launch = ctx.launch;
  float *q = h.q, *k = h.k, *v = h.v, *dy = h.fourth, *dv = h.fifth;
  float* dq = dy;  // dy is dead once datt and dv are computed
  float* dk = v;   // v is dead once datt is computed
  float* da = scratch;

  split_heads_kernel<<<grid_for(h.btc, kThreads, launch), kThreads, 0, launch.stream>>>(Parts{{q, k, v}}, qkv, 3 * C, 3,
                                                                                      B, T, NH, hs);
  CUDA_CHECK_LAUNCH();
  split_heads_kernel<<<grid_for(h.btc, kThreads, launch), kThreads, 0, launch.stream>>>(Parts{{dy}}, dout, C, 1, B, T,
                                                                                      NH, hs);
  CUDA_CHECK_LAUNCH();
  // datt = dy @ v^T; dv = att^T @ dy
  gemm_row_major(ctx, false, true, T, T, hs, 1.0f, dy, hs, head, v, hs, head, 0.0f, da, T, square, BNH, nullptr);
  gemm_row_major(ctx, true, false, T, hs, T, 1.0f, att, T, square, dy, hs, head, 0.0f, dv, hs, head, BNH, nullptr);
  const size_t rows = static_cast<size_t>(BNH) * T;
  causal_softmax_backward_kernel<<<row_blocks(rows), kThreads, 0, launch.stream>>>(da, att, rows, T);
  CUDA_CHECK_LAUNCH();
  // dq = scale * dscore @ k; dk = scale * dscore^T @ q
  gemm_row_major(ctx, false, false, T, hs, T, h.scale, da, T, square, k, hs, head, 0.0f, dq, hs, head, BNH, nullptr);
  gemm_row_major(ctx, true, false, T, hs, T, h.scale, da, T, square, q, hs, head, 0.0f, dk, hs, head, BNH, nullptr);
  merge_heads_kernel<<<grid_for(h.btc, kThreads, launch), kThreads, 0, launch.stream>>>(dqkv, ConstParts{{dq, dk, dv}},
                                                                                      3 * C, 3, B, T, NH, hs);
  CUDA_CHECK_LAUNCH();
}

}  // namespace shardtrain::kernels
