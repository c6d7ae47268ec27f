// Causal self-attention with grouped-query heads on the GPU, with the CPU's interface
// (backend/cpu/ops.hpp: packed documents too, each row seeing the keys of its own document), the
// same kernels without the causal mask (a diffusion transformer's joint attention: every row sees
// every key), and the rotary embedding applied to its q and k. Each row of
// qkv(B,T,(NH+2KV)*HS) holds q (NH heads) | k (KV heads) | v (KV heads) of HS each; query head h
// reads key/value head h / G, G = NH/KV (KV = NH: GPT-2's multi-head attention). out(B,T,NH*HS);
// lse(B,NH,T) each query row's log-sum-exp; scale 1/sqrt(HS).
//
// Tiled as backend/cpu/attention.cpp (flash attention): no T x T matrix, fp32 throughout, tiles of
// kTile = 32 query rows and 32 keys (a warp's width), read from the token-major rows directly into
// shared memory (no head-major copies). A block has kWarps warps; a warp owns kTile / kWarps query
// rows (or keys), a lane one key (or query row) of the tile for the scores, and dimensions lane,
// lane + 32, ... of the warp's output rows in registers (HS <= 32 * kMaxDimsPerLane).
// Forward: one block per (query tile, head, batch); for the key tiles up to the diagonal in order,
// each row's scores (lane = key), the online softmax (warp max and sum, fixed shuffle trees; the
// running output rescaled when the max grows), out += p v with p broadcast lane by lane. At the
// end out /= l and lse = m + log(l).
// Backward: D = rowsum(dout * out), one warp per row; then two kernels that recompute
// p = exp(score - lse): dK and dV, one block per (key tile, key/value head, batch), summing its
// group's query heads and the query tiles from the diagonal on, in order; dQ, one block per (query
// tile, head, batch), summing the key tiles in order. dS = p (dP - D), dP = dout v^T. Each output
// element has one owner thread that adds its terms in a fixed order: no atomics, the bits repeat
// (not the CPU's bits: other summation orders; within fp32 rounding of it). The only workspace is
// D (B*NH*T floats).
//
// Decode (generation with a key/value cache): the new tokens' k, v are copied into the cache, then
// one block per (new token, query head) scores its q against the cached keys up to its own
// position, takes the softmax and sums the cached values: a row, not a matrix, so no GEMM.
//
// Rope: one thread per rotated pair (x[i], x[i + HS/2]) -- or, interleaved (FLUX), (x[2i], x[2i+1])
// -- of every q and k head vector, in place on the token-major qkv (or dqkv); the backward is the
// same turn with the sine negated.
#include <cmath>
#include <type_traits>

#include "backend/gpu_memory.hpp"
#include "backend/math.hpp"
#include "common.cuh"

namespace shardtrain::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kTile = kWarpSize;                // query rows and keys per tile: one per lane
constexpr int kWarps = 8;                       // per attention block
constexpr int kRowsPerWarp = kTile / kWarps;    // rows (or keys) a warp owns
constexpr int kMaxDimsPerLane = 8;              // HS <= 256
static_assert(kWarpSize * kMaxDimsPerLane == gpu::kTiledAttentionMaxHeadSize, "the planner's and options' bound");
constexpr int kAttentionThreads = kWarps * kWarpSize;

// A (kTile, HS) tile in shared memory, rows padded to HS + 1 floats so that lanes reading one
// column of different rows hit different banks.
struct SharedTile {
  float* p;
  int stride;
  __device__ float* row(int i) const { return p + i * stride; }
};

// rows [r0, r0 + n) of one head of token-major rows (`row` floats apart, the head at `col`) into
// the tile; all threads of the block.
__device__ void load_tile(SharedTile tile, const float* base, int r0, int n, size_t row, int col, int HS) {
  for (int idx = threadIdx.x; idx < n * HS; idx += blockDim.x) {
    const int i = idx / HS, d = idx - i * HS;
    tile.row(i)[d] = base[(r0 + i) * row + col + d];
  }
}

__device__ float dot_rows(const float* a, const float* b, int HS) {
  float acc = 0.0f;
  for (int d = 0; d < HS; d++) acc = fmaf(a[d], b[d], acc);
  return acc;
}

// acc[c] += w * x[lane + 32 c] for the lane's dimensions.
template <int kDims>
__device__ void add_scaled_row(float (&acc)[kDims], float w, const float* x, int lane, int HS) {
#pragma unroll
  for (int c = 0; c < kDims; c++) {
    const int d = lane + c * kWarpSize;
    if (d < HS) acc[c] = fmaf(w, x[d], acc[c]);
  }
}

struct AttentionDims {
  int T, NH, KV, HS, group;
  size_t row;  // floats of a qkv row
  float scale;
  const int* doc_start;  // (B,T): the first position of each row's document; nullptr: none
  bool causal;           // false: every query row sees every key (no documents then)
  // The end of the keys query tile [t0, t0 + nq) reads, and the first query tile key tile k0 meets.
  __device__ int key_end(int t0, int nq) const { return causal ? t0 + nq : T; }
  __device__ int first_query_tile(int k0) const { return causal ? k0 : 0; }
  // Whether query row t sees key s by position (the causal mask).
  __device__ bool before(int t, int s) const { return !causal || s <= t; }
  // Whether query row t of sequence b sees key s by document (the causal test is before()'s).
  __device__ bool in_document(int b, int t, int s) const {
    return !doc_start || s >= doc_start[static_cast<size_t>(b) * T + t];
  }
  // The first key tile query tile t0 needs: its first row's document's (documents only move forward).
  __device__ int first_key_tile(int b, int t0) const {
    return doc_start ? doc_start[static_cast<size_t>(b) * T + t0] / kTile * kTile : 0;
  }
  __device__ const float* head(const float* qkv, int b) const { return qkv + static_cast<size_t>(b) * T * row; }
  __device__ size_t stat(int b, int h, int t) const { return (static_cast<size_t>(b) * NH + h) * T + t; }
  __device__ size_t y(int b, int t, int h) const { return (static_cast<size_t>(b) * T + t) * NH * HS + h * HS; }
};

template <int kDims>
__global__ void __launch_bounds__(kAttentionThreads)
    attention_forward_kernel(float* out, float* lse, const float* qkv, AttentionDims dims) {
  extern __shared__ float smem[];
  const int HS = dims.HS, stride = HS + 1;
  const SharedTile qs{smem, stride}, ks{smem + kTile * stride, stride}, vs{smem + 2 * kTile * stride, stride};
  const int b = blockIdx.z, h = blockIdx.y, kv = h / dims.group, t0 = blockIdx.x * kTile;
  const int nq = min(kTile, dims.T - t0), warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const float* base = dims.head(qkv, b);
  load_tile(qs, base, t0, nq, dims.row, h * HS, HS);
  float m[kRowsPerWarp], l[kRowsPerWarp], o[kRowsPerWarp][kDims];
#pragma unroll
  for (int j = 0; j < kRowsPerWarp; j++) {
    m[j] = -INFINITY, l[j] = 0.0f;
#pragma unroll
    for (int c = 0; c < kDims; c++) o[j][c] = 0.0f;
  }
  const int key_end = dims.key_end(t0, nq);
  for (int k0 = dims.first_key_tile(b, t0); k0 < key_end; k0 += kTile) {
    const int nk = min(kTile, key_end - k0);  // causal: keys past the tile's last query are all masked
    __syncthreads();                          // the previous tile's readers are done
    load_tile(ks, base, k0, nk, dims.row, (dims.NH + kv) * HS, HS);
    load_tile(vs, base, k0, nk, dims.row, (dims.NH + dims.KV + kv) * HS, HS);
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kRowsPerWarp; j++) {
      const int i = warp * kRowsPerWarp + j;
      if (i >= nq) break;  // warp-uniform
      const bool visible = lane < nk && dims.before(t0 + i, k0 + lane) && dims.in_document(b, t0 + i, k0 + lane);
      const float score = visible ? dims.scale * dot_rows(qs.row(i), ks.row(lane), HS) : -INFINITY;
      // m is finite from the row's first tile with a visible key on (without documents the first
      // key tile, which holds key 0); until then nothing has been summed.
      const float m_new = fmaxf(m[j], warp_max(score));
      const float p = visible ? exp_fast(score - m_new) : 0.0f;
      const float rescale = m[j] == -INFINITY ? 0.0f : exp_fast(m[j] - m_new);
      l[j] = l[j] * rescale + warp_sum(p);
#pragma unroll
      for (int c = 0; c < kDims; c++) o[j][c] *= rescale;
      for (int s = 0; s < nk; s++) add_scaled_row(o[j], __shfl_sync(kFullMask, p, s), vs.row(s), lane, HS);
      m[j] = m_new;
    }
  }
#pragma unroll
  for (int j = 0; j < kRowsPerWarp; j++) {
    const int i = warp * kRowsPerWarp + j;
    if (i >= nq) break;
    const float inv = 1.0f / l[j];
    float* y = out + dims.y(b, t0 + i, h);
#pragma unroll
    for (int c = 0; c < kDims; c++) {
      const int d = lane + c * kWarpSize;
      if (d < HS) y[d] = o[j][c] * inv;
    }
    if (lane == 0) lse[dims.stat(b, h, t0 + i)] = m[j] + logf(l[j]);
  }
}

// D[b,h,t] = dout . out over the head's HS elements: one warp per (b, t, h) row.
__global__ void attention_row_dot_kernel(float* D, const float* dout, const float* out, AttentionDims dims,
                                         size_t rows) {
  const size_t r = (blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x) / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (r >= rows) return;
  const int h = static_cast<int>(r % dims.NH);
  const size_t bt = r / dims.NH;
  const int b = static_cast<int>(bt / dims.T), t = static_cast<int>(bt % dims.T);
  const float* dy = dout + dims.y(b, t, h);
  const float* y = out + dims.y(b, t, h);
  float acc = 0.0f;
  for (int d = lane; d < dims.HS; d += kWarpSize) acc = fmaf(dy[d], y[d], acc);
  acc = warp_sum(acc);
  if (lane == 0) D[dims.stat(b, h, t)] = acc;
}

// dK, dV of one key tile: warp-owned keys, lane = query row of each query tile.
template <int kDims>
__global__ void __launch_bounds__(kAttentionThreads)
    attention_backward_kv_kernel(float* dqkv, const float* dout, const float* qkv, const float* lse, const float* D,
                                 AttentionDims dims) {
  extern __shared__ float smem[];
  const int HS = dims.HS, stride = HS + 1;
  const SharedTile ks{smem, stride}, vs{smem + kTile * stride, stride}, qs{smem + 2 * kTile * stride, stride},
      dys{smem + 3 * kTile * stride, stride};
  float* row_lse = smem + 4 * kTile * stride;
  float* row_D = row_lse + kTile;
  const int b = blockIdx.z, kv = blockIdx.y, k0 = blockIdx.x * kTile, nk = min(kTile, dims.T - k0);
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize, C = dims.NH * HS;
  const float* base = dims.head(qkv, b);
  const float* dout_b = dout + static_cast<size_t>(b) * dims.T * C;
  load_tile(ks, base, k0, nk, dims.row, (dims.NH + kv) * HS, HS);
  load_tile(vs, base, k0, nk, dims.row, (dims.NH + dims.KV + kv) * HS, HS);
  float dk[kRowsPerWarp][kDims], dv[kRowsPerWarp][kDims];
#pragma unroll
  for (int j = 0; j < kRowsPerWarp; j++)
#pragma unroll
    for (int c = 0; c < kDims; c++) dk[j][c] = 0.0f, dv[j][c] = 0.0f;
  for (int g = 0; g < dims.group; g++) {
    const int h = kv * dims.group + g;
    for (int t0 = dims.first_query_tile(k0); t0 < dims.T; t0 += kTile) {
      // Packed documents: rows from t0 on start their documents after this key tile (document
      // starts only move forward), so none of them sees it. Block-uniform: one break for all.
      if (dims.doc_start && dims.doc_start[static_cast<size_t>(b) * dims.T + t0] >= k0 + nk) break;
      const int nq = min(kTile, dims.T - t0);
      __syncthreads();
      load_tile(qs, base, t0, nq, dims.row, h * HS, HS);
      load_tile(dys, dout_b, t0, nq, C, h * HS, HS);
      for (int i = threadIdx.x; i < nq; i += blockDim.x)
        row_lse[i] = lse[dims.stat(b, h, t0 + i)], row_D[i] = D[dims.stat(b, h, t0 + i)];
      __syncthreads();
#pragma unroll
      for (int j = 0; j < kRowsPerWarp; j++) {
        const int key = warp * kRowsPerWarp + j;
        if (key >= nk) break;  // warp-uniform
        float p = 0.0f, ds = 0.0f;
        if (lane < nq && dims.before(t0 + lane, k0 + key) && dims.in_document(b, t0 + lane, k0 + key)) {
          p = exp_fast(dims.scale * dot_rows(qs.row(lane), ks.row(key), HS) - row_lse[lane]);
          ds = p * (dot_rows(dys.row(lane), vs.row(key), HS) - row_D[lane]);
        }
        for (int i = 0; i < nq; i++) {
          add_scaled_row(dv[j], __shfl_sync(kFullMask, p, i), dys.row(i), lane, HS);
          add_scaled_row(dk[j], __shfl_sync(kFullMask, ds, i), qs.row(i), lane, HS);
        }
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kRowsPerWarp; j++) {
    const int key = warp * kRowsPerWarp + j;
    if (key >= nk) break;
    float* row = dqkv + (static_cast<size_t>(b) * dims.T + k0 + key) * dims.row;
#pragma unroll
    for (int c = 0; c < kDims; c++) {
      const int d = lane + c * kWarpSize;
      if (d < HS) {
        row[(dims.NH + kv) * HS + d] = dk[j][c] * dims.scale;
        row[(dims.NH + dims.KV + kv) * HS + d] = dv[j][c];
      }
    }
  }
}

// dQ of one query tile: warp-owned query rows, lane = key of each key tile.
template <int kDims>
__global__ void __launch_bounds__(kAttentionThreads)
    attention_backward_q_kernel(float* dqkv, const float* dout, const float* qkv, const float* lse, const float* D,
                                AttentionDims dims) {
  extern __shared__ float smem[];
  const int HS = dims.HS, stride = HS + 1;
  const SharedTile qs{smem, stride}, dys{smem + kTile * stride, stride}, ks{smem + 2 * kTile * stride, stride},
      vs{smem + 3 * kTile * stride, stride};
  const int b = blockIdx.z, h = blockIdx.y, kv = h / dims.group, t0 = blockIdx.x * kTile;
  const int nq = min(kTile, dims.T - t0), warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int C = dims.NH * HS;
  const float* base = dims.head(qkv, b);
  load_tile(qs, base, t0, nq, dims.row, h * HS, HS);
  load_tile(dys, dout + static_cast<size_t>(b) * dims.T * C, t0, nq, C, h * HS, HS);
  float dq[kRowsPerWarp][kDims], row_lse[kRowsPerWarp], row_D[kRowsPerWarp];
#pragma unroll
  for (int j = 0; j < kRowsPerWarp; j++) {
    const int i = min(warp * kRowsPerWarp + j, nq - 1);
    row_lse[j] = lse[dims.stat(b, h, t0 + i)], row_D[j] = D[dims.stat(b, h, t0 + i)];
#pragma unroll
    for (int c = 0; c < kDims; c++) dq[j][c] = 0.0f;
  }
  const int key_end = dims.key_end(t0, nq);
  for (int k0 = dims.first_key_tile(b, t0); k0 < key_end; k0 += kTile) {
    const int nk = min(kTile, key_end - k0);
    __syncthreads();
    load_tile(ks, base, k0, nk, dims.row, (dims.NH + kv) * HS, HS);
    load_tile(vs, base, k0, nk, dims.row, (dims.NH + dims.KV + kv) * HS, HS);
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kRowsPerWarp; j++) {
      const int i = warp * kRowsPerWarp + j;
      if (i >= nq) break;  // warp-uniform
      float ds = 0.0f;
      if (lane < nk && dims.before(t0 + i, k0 + lane) && dims.in_document(b, t0 + i, k0 + lane)) {
        const float p = exp_fast(dims.scale * dot_rows(qs.row(i), ks.row(lane), HS) - row_lse[j]);
        ds = p * (dot_rows(dys.row(i), vs.row(lane), HS) - row_D[j]);
      }
      for (int s = 0; s < nk; s++) add_scaled_row(dq[j], __shfl_sync(kFullMask, ds, s), ks.row(s), lane, HS);
    }
  }
#pragma unroll
  for (int j = 0; j < kRowsPerWarp; j++) {
    const int i = warp * kRowsPerWarp + j;
    if (i >= nq) break;
    float* row = dqkv + (static_cast<size_t>(b) * dims.T + t0 + i) * dims.row + h * HS;
#pragma unroll
    for (int c = 0; c < kDims; c++) {
      const int d = lane + c * kWarpSize;
      if (d < HS) row[d] = dq[j][c] * dims.scale;
    }
  }
}

// Calls fn(std::integral_constant<int, kDims>) with the register width the head size needs.
template <typename Fn>
void with_dims_per_lane(int HS, Fn fn) {
  const int lanes = (HS + kWarpSize - 1) / kWarpSize;
  if (lanes <= 1)
    fn(std::integral_constant<int, 1>());
  else if (lanes <= 2)
    fn(std::integral_constant<int, 2>());
  else if (lanes <= 4)
    fn(std::integral_constant<int, 4>());
  else
    fn(std::integral_constant<int, kMaxDimsPerLane>());
}

// Launches `kernel` with `shared` bytes of dynamic shared memory, opting in above the 48 KiB default.
template <typename Kernel, typename... Args>
void launch_tiled(Kernel kernel, dim3 grid, size_t shared, const LaunchContext& ctx, Args... args) {
  if (shared > 48 * 1024)
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)));
  kernel<<<grid, kAttentionThreads, shared, ctx.stream>>>(args...);
  CUDA_CHECK_LAUNCH();
}

size_t tile_floats(int HS) { return static_cast<size_t>(kTile) * (HS + 1); }

AttentionDims attention_dims(int T, int NH, int KV, int HS, const int* doc_start, bool causal) {
  return {T,         NH, KV, HS, NH / KV, static_cast<size_t>(NH + 2 * KV) * HS, 1.0f / sqrtf(static_cast<float>(HS)),
          doc_start, causal};
}

// Pair i < HS/2 of q-or-k head `head` of token bt: x[i], x[i + HS/2] (interleaved: x[2i], x[2i+1])
// turned by the angle of (t, i), as backend/cpu/attention.cpp's rope_turn; sign -1 turns back. heads = NH + KV (the
// query heads, then the key heads: v is untouched).
__global__ void rope_kernel(float* qkv, const float* cos_table, const float* sin_table, const int* positions, int T,
                            int heads, int row, int HS, float sign, bool interleaved, size_t n) {
  const int half = HS / 2, step = interleaved ? 2 : 1, partner = interleaved ? 1 : half;
  for (size_t idx = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; idx < n;
       idx += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const int i = static_cast<int>(idx % half);
    const size_t rest = idx / half;
    const int head = static_cast<int>(rest % heads);
    const size_t bt = rest / heads;
    const size_t angle = (positions ? static_cast<size_t>(positions[bt]) : bt % T) * half + i;
    float* x = qkv + bt * row + static_cast<size_t>(head) * HS;
    const float c = cos_table[angle], s = sign * sin_table[angle];
    float& a = x[i * step];
    float& b = x[i * step + partner];
    const float lo = a, hi = b;
    a = lo * c - hi * s;
    b = hi * c + lo * s;
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
// (from start+i-window+1 with a window) into scratch, the softmax (block max and sum, fixed
// trees), then out = sum_p a_p v_p with the threads split into `groups` of HS (each group every
// groups-th position), the groups' partial sums added in group order. No atomics: the bits repeat.
__global__ void attention_decode_kernel(float* out, float* scratch, const float* k_cache, const float* v_cache,
                                        const float* qkv, int start, int T, int NH, int KV, int HS, int window,
                                        float scale) {
  extern __shared__ float q[];  // HS
  __shared__ float reduce[kWarpSize];
  __shared__ float partial[kThreads];
  const int i = blockIdx.x / NH, h = blockIdx.x % NH, kv = h / (NH / KV), len = start + i + 1;
  const int first = window > 0 ? max(0, len - window) : 0;
  const int row = (NH + 2 * KV) * HS, kv_width = KV * HS;
  for (int d = threadIdx.x; d < HS; d += blockDim.x) q[d] = qkv[static_cast<size_t>(i) * row + h * HS + d];
  __syncthreads();
  float* s = scratch + (static_cast<size_t>(i) * NH + h) * T;
  float max = -INFINITY;
  for (int p = first + threadIdx.x; p < len; p += blockDim.x) {
    const float* k = k_cache + static_cast<size_t>(p) * kv_width + kv * HS;
    float dot = 0.0f;
    for (int d = 0; d < HS; d++) dot += q[d] * k[d];
    s[p] = dot * scale;
    max = fmaxf(max, s[p]);
  }
  max = block_max(max, reduce);
  float sum = 0.0f;
  for (int p = first + threadIdx.x; p < len; p += blockDim.x) {
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
      for (int p = first; p < len; p++) acc += s[p] * v[static_cast<size_t>(p) * kv_width + d];
      o[d] = acc * inv;
    }
    return;
  }
  const int g = threadIdx.x / HS, d = threadIdx.x % HS;
  if (g < groups) {
    float acc = 0.0f;
    for (int p = first + g; p < len; p += groups) acc += s[p] * v[static_cast<size_t>(p) * kv_width + d];
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

// The tiled kernels keep a warp's rows in registers: HS up to 32 * kMaxDimsPerLane.
void check_tiled_args(const char* what, int B, int T, int NH, int KV, int HS) {
  check_attention_args(what, B, T, NH, KV, HS);
  SHARD_CHECK(HS <= kWarpSize * kMaxDimsPerLane, "%s: head size %d > %d, the most the tiled kernels hold", what, HS,
              kWarpSize * kMaxDimsPerLane);
}

void launch_rope(float* qkv, const float* cos, const float* sin, const int* positions, int B, int T, int NH, int KV,
                 int HS, float sign, bool interleaved, const char* what, const LaunchContext& ctx) {
  SHARD_CHECK(B >= 0 && T >= 0 && NH > 0 && KV > 0 && HS > 0 && HS % 2 == 0 && NH % KV == 0,
              "%s: B=%d T=%d NH=%d KV=%d HS=%d (HS must be even, NH divide by KV)", what, B, T, NH, KV, HS);
  const size_t n = static_cast<size_t>(B) * T * (NH + KV) * (HS / 2);
  if (n == 0) return;
  rope_kernel<<<grid_for(n, kThreads, ctx), kThreads, 0, ctx.stream>>>(qkv, cos, sin, positions, T, NH + KV,
                                                                        (NH + 2 * KV) * HS, HS, sign, interleaved, n);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

namespace {

void attention_forward(float* out, float* lse, const float* qkv, int B, int T, int NH, int KV, int HS,
                       const int* doc_start, bool causal, const LaunchContext& ctx) {
  check_tiled_args("attention_forward", B, T, NH, KV, HS);
  if (B == 0 || T == 0) return;
  const AttentionDims dims = attention_dims(T, NH, KV, HS, doc_start, causal);
  const dim3 grid(static_cast<unsigned>(ceil_div(T, kTile)), NH, B);
  with_dims_per_lane(HS, [&](auto lanes) {
    launch_tiled(attention_forward_kernel<decltype(lanes)::value>, grid, 3 * tile_floats(HS) * sizeof(float), ctx,
                 out, lse, qkv, dims);
  });
}

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse, int B,
                        int T, int NH, int KV, int HS, const int* doc_start, bool causal, void* workspace,
                        const LaunchContext& ctx) {
  check_tiled_args("attention_backward", B, T, NH, KV, HS);
  if (B == 0 || T == 0) return;
  const AttentionDims dims = attention_dims(T, NH, KV, HS, doc_start, causal);
  float* D = static_cast<float*>(workspace);
  const size_t rows = static_cast<size_t>(B) * T * NH;
  attention_row_dot_kernel<<<static_cast<unsigned>(ceil_div(rows * kWarpSize, kThreads)), kThreads, 0, ctx.stream>>>(
      D, dout, out, dims, rows);
  CUDA_CHECK_LAUNCH();
  const unsigned tiles = static_cast<unsigned>(ceil_div(T, kTile));
  with_dims_per_lane(HS, [&](auto lanes) {
    constexpr int kDims = decltype(lanes)::value;
    launch_tiled(attention_backward_kv_kernel<kDims>, dim3(tiles, KV, B),
                 (4 * tile_floats(HS) + 2 * kTile) * sizeof(float), ctx, dqkv, dout, qkv, lse,
                 static_cast<const float*>(D), dims);
    launch_tiled(attention_backward_q_kernel<kDims>, dim3(tiles, NH, B), 4 * tile_floats(HS) * sizeof(float), ctx,
                 dqkv, dout, qkv, lse, static_cast<const float*>(D), dims);
  });
}

}  // namespace

namespace {

// bias[b][0][t][s] = 0 where key s lies in query t's document (s >= doc_start[b][t]), else -inf.
__global__ void document_bias_kernel(uint16_t* bias, const int* doc_start, int T, size_t n) {
  constexpr uint16_t kBf16MinusInfinity = 0xFF80;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x)
    bias[i] = static_cast<int>(i % T) >= doc_start[i / T] ? uint16_t{0} : kBf16MinusInfinity;
}

}  // namespace

void launch_document_bias(uint16_t* bias, const int* doc_start, int B, int T, const LaunchContext& ctx) {
  constexpr int kThreads = 256;
  const size_t n = static_cast<size_t>(B) * T * T;
  document_bias_kernel<<<grid_for(n, kThreads, ctx), kThreads, 0, ctx.stream>>>(bias, doc_start, T, n);
  CUDA_CHECK_LAUNCH();
}

void launch_attention_forward(float* out, float* lse, const float* qkv, int B, int T, int NH, int KV, int HS,
                              const int* doc_start, const LaunchContext& ctx) {
  attention_forward(out, lse, qkv, B, T, NH, KV, HS, doc_start, true, ctx);
}

void launch_attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                               int B, int T, int NH, int KV, int HS, const int* doc_start, void* workspace,
                               const LaunchContext& ctx) {
  attention_backward(dqkv, dout, qkv, out, lse, B, T, NH, KV, HS, doc_start, true, workspace, ctx);
}

void launch_bidirectional_attention_forward(float* out, float* lse, const float* qkv, int B, int T, int NH, int HS,
                                            const LaunchContext& ctx) {
  attention_forward(out, lse, qkv, B, T, NH, NH, HS, nullptr, false, ctx);
}

void launch_bidirectional_attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                                             const float* lse, int B, int T, int NH, int HS, void* workspace,
                                             const LaunchContext& ctx) {
  attention_backward(dqkv, dout, qkv, out, lse, B, T, NH, NH, HS, nullptr, false, workspace, ctx);
}

void launch_attention_decode(float* out, float* scratch, float* k_cache, float* v_cache, const float* qkv, int Q,
                             int start, int NH, int KV, int HS, int window, const LaunchContext& ctx) {
  check_attention_args("attention_decode", 1, Q, NH, KV, HS);
  SHARD_CHECK(start >= 0 && window >= 0, "attention_decode: start=%d window=%d", start, window);
  if (Q == 0) return;
  const int kv_width = KV * HS;
  const size_t n = static_cast<size_t>(Q) * 2 * kv_width;
  kv_append_kernel<<<grid_for(n, kThreads, ctx), kThreads, 0, ctx.stream>>>(k_cache, v_cache, qkv, start,
                                                                             (NH + 2 * KV) * HS, NH * HS, kv_width, n);
  CUDA_CHECK_LAUNCH();
  const float scale = 1.0f / sqrtf(static_cast<float>(HS));
  attention_decode_kernel<<<static_cast<unsigned>(Q) * NH, kThreads, HS * sizeof(float), ctx.stream>>>(
      out, scratch, k_cache, v_cache, qkv, start, start + Q, NH, KV, HS, window, scale);
  CUDA_CHECK_LAUNCH();
}

void launch_rope_forward(float* qkv, const float* cos, const float* sin, int B, int T, int NH, int KV, int HS,
                         const int* positions, const LaunchContext& ctx) {
  launch_rope(qkv, cos, sin, positions, B, T, NH, KV, HS, 1.0f, false, "rope_forward", ctx);
}

void launch_rope_backward(float* dqkv, const float* cos, const float* sin, int B, int T, int NH, int KV, int HS,
                          const int* positions, const LaunchContext& ctx) {
  launch_rope(dqkv, cos, sin, positions, B, T, NH, KV, HS, -1.0f, false, "rope_backward", ctx);
}

void launch_rope_pairs_forward(float* qkv, const float* cos, const float* sin, int B, int T, int NH, int KV, int HS,
                               const LaunchContext& ctx) {
  launch_rope(qkv, cos, sin, nullptr, B, T, NH, KV, HS, 1.0f, true, "rope_pairs_forward", ctx);
}

void launch_rope_pairs_backward(float* dqkv, const float* cos, const float* sin, int B, int T, int NH, int KV, int HS,
                                const LaunchContext& ctx) {
  launch_rope(dqkv, cos, sin, nullptr, B, T, NH, KV, HS, -1.0f, true, "rope_pairs_backward", ctx);
}

}  // namespace shardtrain::kernels
