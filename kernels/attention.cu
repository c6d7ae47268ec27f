// Causal self-attention with grouped-query heads on the GPU, with the CPU's saved-state interface
// (backend/cpu/attention.cpp), and the rotary embedding applied to its q and k. Each row of
// qkv(B,T,(NH+2KV)*HS) holds q (NH heads) | k (KV heads) | v (KV heads) of HS each; query head h
// reads key/value head h / G, G = NH/KV (KV = NH: GPT-2's multi-head attention). out(B,T,NH*HS);
// att(B,NH,T,T) keeps the softmax probabilities, zero above the diagonal; scale 1/sqrt(HS).
//
// The G query heads of one key/value head are consecutive, so in head-major layout their q (and
// their rows of att, dy, dscore) form one stacked (G*T, .) matrix. Every product is then one
// strided-batched cuBLASLt GEMM over the B*KV key/value heads, each multiplying a group's stack by
// its one k or v -- no copies of k and v per query head. For KV = NH these are exactly the B*NH
// per-head GEMMs of plain multi-head attention.
// Forward: split qkv into head-major q (B,NH,T,HS), k, v (B,KV,T,HS); att = scale q k^T (the full
// T x T, like the CPU); the causal softmax in place, one warp per row; y = att v; merge y into out.
// Backward: split qkv and dout; datt = dy v^T into `scratch`; dv = att^T dy; softmax backward in
// place (dscore = att * (datt - sum(att * datt)), zero above the diagonal); dq = scale dscore k;
// dk = scale dscore^T q; merge dq|dk|dv into dqkv (written, =).
// The key/value gradients shared by a group are sums over its G query heads: dv = [att_1; ...;
// att_G]^T [dy_1; ...; dy_G] is one GEMM whose reduction runs over the G*T stacked rows, and so is
// dk. The group's sum is part of cuBLASLt's fixed reduction order -- deterministic, no per-head
// partials, no atomics.
//
// The head-major copies live in a workspace of attention_workspace_bytes(): q, k, v, then y
// (forward) or dy, dv (backward); dq overwrites dy (dead after dv and datt) and dk overwrites v
// (dead after datt). fp32 GEMMs (matmul.cu); expf in the softmax as the CPU's std::exp (both
// within 2 ulp).
//
// Decode (generation with a key/value cache): the new tokens' k, v are copied into the cache, then
// one block per (new token, query head) scores its q against the cached keys up to its own
// position, takes the softmax and sums the cached values: a row, not a matrix, so no GEMM.
//
// Rope: one thread per rotated pair (x[i], x[i + HS/2]) of every q and k head vector, in place on
// the token-major qkv (or dqkv); the backward is the same turn with the sine negated.
#include <cmath>

#include "common.cuh"

namespace shardtrain::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kRowsPerBlock = kThreads / kWarpSize;

// The head-major sides of a permute: part p is (B, heads[p], T, HS) at p[p]. The parts' heads are
// consecutive in the token-major rows, which they fill: q|k|v of qkv, or all heads of out.
struct HeadParts {
  float* p[3];
  int heads[3];  // 0 for unused parts
};

// Token-major element `i` (in units of kVec floats) of the (B, T, sum heads, HS) rows: its
// position in the head-major part that holds it.
template <int kVec>
__device__ inline float* head_major(const HeadParts& parts, size_t i, int row_vecs, int T, int HS) {
  const int head_vecs = HS / kVec;
  const size_t bt = i / row_vecs;
  const int within = static_cast<int>(i - bt * row_vecs);
  int h = within / head_vecs;
  const int d = within - h * head_vecs;
  int part = 0;
  while (h >= parts.heads[part]) h -= parts.heads[part++];
  const size_t b = bt / T;
  const int t = static_cast<int>(bt - b * T);
  return parts.p[part] + (((b * parts.heads[part] + h) * T + t) * head_vecs + d) * kVec;
}

// parts[b,h,t,:] = src[(b*T + t) row + h], over the whole rows. kVec 4: float4 copies.
template <int kVec>
__global__ void split_heads_kernel(HeadParts parts, const float* src, int B, int T, int HS) {
  using V = typename VecOf<kVec>::type;
  const int row_vecs = (parts.heads[0] + parts.heads[1] + parts.heads[2]) * HS / kVec;
  const size_t n = static_cast<size_t>(B) * T * row_vecs;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    *reinterpret_cast<V*>(head_major<kVec>(parts, i, row_vecs, T, HS)) = reinterpret_cast<const V*>(src)[i];
}

// The inverse: dst[(b*T + t) row + h] = parts[b,h,t,:].
template <int kVec>
__global__ void merge_heads_kernel(float* dst, HeadParts parts, int B, int T, int HS) {
  using V = typename VecOf<kVec>::type;
  const int row_vecs = (parts.heads[0] + parts.heads[1] + parts.heads[2]) * HS / kVec;
  const size_t n = static_cast<size_t>(B) * T * row_vecs;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    reinterpret_cast<V*>(dst)[i] = *reinterpret_cast<const V*>(head_major<kVec>(parts, i, row_vecs, T, HS));
}

// float4 copies when HS and every pointer allow them (the workspace parts are 256-byte aligned; a
// misaligned token-major buffer takes the scalar path). The bits are the same either way.
bool permute_vec4(const float* token_major, const HeadParts& parts, int HS) {
  return HS % 4 == 0 && aligned16(token_major) && all_aligned16(parts.p[0], parts.p[1], parts.p[2]);
}

size_t row_floats(const HeadParts& parts, int B, int T, int HS) {
  return static_cast<size_t>(B) * T * (parts.heads[0] + parts.heads[1] + parts.heads[2]) * HS;
}

void split_heads(HeadParts parts, const float* src, int B, int T, int HS, const LaunchContext& ctx) {
  const size_t n = row_floats(parts, B, T, HS);
  if (permute_vec4(src, parts, HS))
    split_heads_kernel<4><<<grid_for(n / 4, kThreads, ctx), kThreads, 0, ctx.stream>>>(parts, src, B, T, HS);
  else
    split_heads_kernel<1><<<grid_for(n, kThreads, ctx), kThreads, 0, ctx.stream>>>(parts, src, B, T, HS);
  CUDA_CHECK_LAUNCH();
}

void merge_heads(float* dst, HeadParts parts, int B, int T, int HS, const LaunchContext& ctx) {
  const size_t n = row_floats(parts, B, T, HS);
  if (permute_vec4(dst, parts, HS))
    merge_heads_kernel<4><<<grid_for(n / 4, kThreads, ctx), kThreads, 0, ctx.stream>>>(dst, parts, B, T, HS);
  else
    merge_heads_kernel<1><<<grid_for(n, kThreads, ctx), kThreads, 0, ctx.stream>>>(dst, parts, B, T, HS);
  CUDA_CHECK_LAUNCH();
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

// Pair i < HS/2 of q-or-k head `head` of token bt: x[i], x[i + HS/2] turned by the angle of
// (t, i), as backend/cpu/attention.cpp's rope_turn; sign -1 turns back. heads = NH + KV (the
// query heads, then the key heads: v is untouched).
__global__ void rope_kernel(float* qkv, const float* cos_table, const float* sin_table, int T, int heads, int row,
                            int HS, float sign, size_t n) {
  const int half = HS / 2;
  for (size_t idx = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; idx < n;
       idx += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const int i = static_cast<int>(idx % half);
    const size_t rest = idx / half;
    const int head = static_cast<int>(rest % heads);
    const size_t bt = rest / heads;
    const size_t angle = (bt % T) * half + i;
    float* x = qkv + bt * row + static_cast<size_t>(head) * HS;
    const float c = cos_table[angle], s = sign * sin_table[angle];
    const float lo = x[i], hi = x[i + half];
    x[i] = lo * c - hi * s;
    x[i + half] = hi * c + lo * s;
  }
}

// Generation: k and v of the Q new tokens' qkv rows into cache rows start..start+Q-1.
__global__ void kv_append_kernel(float* k_cache, float* v_cache, const float* qkv, int start, int row, int q_width,
                                 int kv_width, size_t n) {
  for (size_t idx = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; idx < n;
       idx += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t i = idx / (2 * kv_width);
    const int within = static_cast<int>(idx - i * 2 * kv_width);  // k's then v's elements
    const float value = qkv[i * row + q_width + within];
    float* cache = within < kv_width ? k_cache : v_cache;
    cache[(start + i) * kv_width + within % kv_width] = value;
  }
}

// One block per (new token i, query head h): scores of its q against the cached k rows 0..start+i
// into scratch, the softmax (block max and sum, fixed trees), then out = sum_p a_p v_p with the
// threads split into `groups` of HS (each group every groups-th position), the groups' partial sums
// added in group order. No atomics: the bits repeat.
__global__ void attention_decode_kernel(float* out, float* scratch, const float* k_cache, const float* v_cache,
                                        const float* qkv, int start, int T, int NH, int KV, int HS, float scale) {
  extern __shared__ float q[];  // HS
  __shared__ float reduce[kWarpSize];
  __shared__ float partial[kThreads];
  const int i = blockIdx.x / NH, h = blockIdx.x % NH, kv = h / (NH / KV), len = start + i + 1;
  const int row = (NH + 2 * KV) * HS, kv_width = KV * HS;
  for (int d = threadIdx.x; d < HS; d += blockDim.x) q[d] = qkv[static_cast<size_t>(i) * row + h * HS + d];
  __syncthreads();
  float* s = scratch + (static_cast<size_t>(i) * NH + h) * T;
  float max = -INFINITY;
  for (int p = threadIdx.x; p < len; p += blockDim.x) {
    const float* k = k_cache + static_cast<size_t>(p) * kv_width + kv * HS;
    float dot = 0.0f;
    for (int d = 0; d < HS; d++) dot += q[d] * k[d];
    s[p] = dot * scale;
    max = fmaxf(max, s[p]);
  }
  max = block_max(max, reduce);
  float sum = 0.0f;
  for (int p = threadIdx.x; p < len; p += blockDim.x) {
    const float e = expf(s[p] - max);
    s[p] = e;
    sum += e;
  }
  const float inv = 1.0f / block_sum(sum, reduce);  // its barriers also publish s to the block
  const int groups = HS <= static_cast<int>(blockDim.x) ? static_cast<int>(blockDim.x) / HS : 1;
  const float* v = v_cache + kv * HS;
  float* o = out + static_cast<size_t>(i) * NH * HS + h * HS;
  if (groups == 1) {
    for (int d = threadIdx.x; d < HS; d += blockDim.x) {
      float acc = 0.0f;
      for (int p = 0; p < len; p++) acc += s[p] * v[static_cast<size_t>(p) * kv_width + d];
      o[d] = acc * inv;
    }
    return;
  }
  const int g = threadIdx.x / HS, d = threadIdx.x % HS;
  if (g < groups) {
    float acc = 0.0f;
    for (int p = g; p < len; p += groups) acc += s[p] * v[static_cast<size_t>(p) * kv_width + d];
    partial[threadIdx.x] = acc;
  }
  __syncthreads();
  if (threadIdx.x < HS) {
    float acc = 0.0f;
    for (int k = 0; k < groups; k++) acc += partial[k * HS + threadIdx.x];
    o[threadIdx.x] = acc * inv;
  }
}

void check_attention_args(const char* what, int B, int T, int NH, int KV, int HS) {
  SHARD_CHECK(B >= 0 && T >= 0 && NH > 0 && KV > 0 && HS > 0 && NH % KV == 0,
              "%s: B=%d T=%d NH=%d KV=%d HS=%d (NH must divide by KV)", what, B, T, NH, KV, HS);
}

unsigned row_blocks(size_t rows) { return static_cast<unsigned>(ceil_div(rows, kRowsPerBlock)); }

void launch_rope(float* qkv, const float* cos, const float* sin, int B, int T, int NH, int KV, int HS, float sign,
                 const char* what, const LaunchContext& ctx) {
  SHARD_CHECK(B >= 0 && T >= 0 && NH > 0 && KV > 0 && HS > 0 && HS % 2 == 0 && NH % KV == 0,
              "%s: B=%d T=%d NH=%d KV=%d HS=%d (HS must be even, NH divide by KV)", what, B, T, NH, KV, HS);
  const size_t n = static_cast<size_t>(B) * T * (NH + KV) * (HS / 2);
  if (n == 0) return;
  rope_kernel<<<grid_for(n, kThreads, ctx), kThreads, 0, ctx.stream>>>(qkv, cos, sin, T, NH + KV, (NH + 2 * KV) * HS,
                                                                        HS, sign, n);
  CUDA_CHECK_LAUNCH();
}

// The dimensions both directions use, and the workspace cut into head-major buffers: q (NH heads),
// k, v (KV heads), then y (NH) or dy (NH) and dv (KV).
struct HeadLayout {
  int Gt;     // rows of a group's stacked matrices: G query heads x T
  int batch;  // B * KV: one GEMM batch per key/value head and its group
  long long q_stride, kv_stride, att_stride;  // elements of a group's q stack, one k or v, a group's att
  float scale;
  float *q, *k, *v, *fourth, *fifth;
  size_t bytes;  // of the workspace (with workspace null, the carving only counts)
  HeadLayout(int B, int T, int NH, int KV, int HS, void* workspace)
      : Gt(NH / KV * T),
        batch(B * KV),
        q_stride(static_cast<long long>(NH / KV) * T * HS),
        kv_stride(static_cast<long long>(T) * HS),
        att_stride(static_cast<long long>(NH / KV) * T * T),
        scale(1.0f / sqrtf(static_cast<float>(HS))) {
    WorkspaceCarver carver(workspace);
    const size_t query = static_cast<size_t>(B) * T * NH * HS, kv = static_cast<size_t>(B) * T * KV * HS;
    q = carver.take<float>(query);
    k = carver.take<float>(kv);
    v = carver.take<float>(kv);
    fourth = carver.take<float>(query);
    fifth = carver.take<float>(kv);
    bytes = carver.bytes();
  }
};

}  // namespace

size_t attention_workspace_bytes(int B, int T, int NH, int KV, int HS) {
  check_attention_args("attention_workspace_bytes", B, T, NH, KV, HS);
  return HeadLayout(B, T, NH, KV, HS, nullptr).bytes;
}

void launch_attention_forward(float* out, float* att, const float* qkv, int B, int T, int NH, int KV, int HS,
                              void* workspace, const GemmContext& ctx) {
  check_attention_args("attention_forward", B, T, NH, KV, HS);
  if (B == 0 || T == 0) return;
  const HeadLayout h(B, T, NH, KV, HS, workspace);
  const LaunchContext& launch = ctx.launch;
  float* y = h.fourth;

  split_heads(HeadParts{{h.q, h.k, h.v}, {NH, KV, KV}}, qkv, B, T, HS, launch);
  // att = scale * q @ k^T: per group (G*T, T), its stacked queries against its one k
  gemm_row_major(ctx, false, true, h.Gt, T, HS, h.scale, h.q, HS, h.q_stride, h.k, HS, h.kv_stride, 0.0f, att, T,
                 h.att_stride, h.batch, nullptr);
  const size_t rows = static_cast<size_t>(B) * NH * T;
  causal_softmax_forward_kernel<<<row_blocks(rows), kThreads, 0, launch.stream>>>(att, rows, T);
  CUDA_CHECK_LAUNCH();
  // y = att @ v: per group (G*T, HS)
  gemm_row_major(ctx, false, false, h.Gt, HS, T, 1.0f, att, T, h.att_stride, h.v, HS, h.kv_stride, 0.0f, y, HS,
                 h.q_stride, h.batch, nullptr);
  merge_heads(out, HeadParts{{y, nullptr, nullptr}, {NH, 0, 0}}, B, T, HS, launch);
}

void launch_attention_backward(float* dqkv, float* scratch, const float* dout, const float* qkv, const float* att,
                               int B, int T, int NH, int KV, int HS, void* workspace, const GemmContext& ctx) {
  check_attention_args("attention_backward", B, T, NH, KV, HS);
  if (B == 0 || T == 0) return;
  const HeadLayout h(B, T, NH, KV, HS, workspace);
  const LaunchContext& launch = ctx.launch;
  float *dy = h.fourth, *dv = h.fifth;
  float* dq = dy;  // dy is dead once datt and dv are computed
  float* dk = h.v;  // v is dead once datt is computed
  float* da = scratch;

  split_heads(HeadParts{{h.q, h.k, h.v}, {NH, KV, KV}}, qkv, B, T, HS, launch);
  split_heads(HeadParts{{dy, nullptr, nullptr}, {NH, 0, 0}}, dout, B, T, HS, launch);
  // datt = dy @ v^T per group (G*T, T); dv = att^T @ dy, the group's G heads summed inside the
  // GEMM's reduction over its G*T stacked rows (a fixed order)
  gemm_row_major(ctx, false, true, h.Gt, T, HS, 1.0f, dy, HS, h.q_stride, h.v, HS, h.kv_stride, 0.0f, da, T,
                 h.att_stride, h.batch, nullptr);
  gemm_row_major(ctx, true, false, T, HS, h.Gt, 1.0f, att, T, h.att_stride, dy, HS, h.q_stride, 0.0f, dv, HS,
                 h.kv_stride, h.batch, nullptr);
  const size_t rows = static_cast<size_t>(B) * NH * T;
  causal_softmax_backward_kernel<<<row_blocks(rows), kThreads, 0, launch.stream>>>(da, att, rows, T);
  CUDA_CHECK_LAUNCH();
  // dq = scale * dscore @ k per group (G*T, HS); dk = scale * dscore^T @ q, summed over the group
  // as dv
  gemm_row_major(ctx, false, false, h.Gt, HS, T, h.scale, da, T, h.att_stride, h.k, HS, h.kv_stride, 0.0f, dq, HS,
                 h.q_stride, h.batch, nullptr);
  gemm_row_major(ctx, true, false, T, HS, h.Gt, h.scale, da, T, h.att_stride, h.q, HS, h.q_stride, 0.0f, dk, HS,
                 h.kv_stride, h.batch, nullptr);
  merge_heads(dqkv, HeadParts{{dq, dk, dv}, {NH, KV, KV}}, B, T, HS, launch);
}

void launch_attention_decode(float* out, float* scratch, float* k_cache, float* v_cache, const float* qkv, int Q,
                             int start, int NH, int KV, int HS, const LaunchContext& ctx) {
  check_attention_args("attention_decode", 1, Q, NH, KV, HS);
  SHARD_CHECK(start >= 0, "attention_decode: start=%d", start);
  if (Q == 0) return;
  const int kv_width = KV * HS;
  const size_t n = static_cast<size_t>(Q) * 2 * kv_width;
  kv_append_kernel<<<grid_for(n, kThreads, ctx), kThreads, 0, ctx.stream>>>(k_cache, v_cache, qkv, start,
                                                                             (NH + 2 * KV) * HS, NH * HS, kv_width, n);
  CUDA_CHECK_LAUNCH();
  const float scale = 1.0f / sqrtf(static_cast<float>(HS));
  attention_decode_kernel<<<static_cast<unsigned>(Q) * NH, kThreads, HS * sizeof(float), ctx.stream>>>(
      out, scratch, k_cache, v_cache, qkv, start, start + Q, NH, KV, HS, scale);
  CUDA_CHECK_LAUNCH();
}

void launch_rope_forward(float* qkv, const float* cos, const float* sin, int B, int T, int NH, int KV, int HS,
                         const LaunchContext& ctx) {
  launch_rope(qkv, cos, sin, B, T, NH, KV, HS, 1.0f, "rope_forward", ctx);
}

void launch_rope_backward(float* dqkv, const float* cos, const float* sin, int B, int T, int NH, int KV, int HS,
                          const LaunchContext& ctx) {
  launch_rope(dqkv, cos, sin, B, T, NH, KV, HS, -1.0f, "rope_backward", ctx);
}

}  // namespace shardtrain::kernels
