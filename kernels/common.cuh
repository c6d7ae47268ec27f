// Device-side helpers shared by the kernels of kernels/*.cu: grid sizing, float4 access, warp and
// block reductions with a fixed tree (deterministic: the same inputs give the same bits on every
// run), the deterministic two-stage column sum used by the bias and norm parameter gradients, the
// carving of one workspace into aligned sub-buffers (backend/gpu_memory.hpp's, which also sizes
// the column sums' chunks), and the device copy of the counter RNG's dropout decision. CUDA
// syntax; include only from .cu files.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "backend/gpu_memory.hpp"
#include "core/random.hpp"
#include "cuda_check.hpp"
#include "launch.hpp"

namespace shardtrain::kernels {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xFFFFFFFFu;

inline size_t ceil_div(size_t a, size_t b) { return (a + b - 1) / b; }

// Blocks for a grid-stride loop over `work` items with `threads` per block: enough to fill every
// SM (`blocks_per_sm` resident blocks each), never more than the work needs.
inline unsigned grid_for(size_t work, int threads, const LaunchContext& ctx, int blocks_per_sm = 8) {
  const size_t needed = std::max<size_t>(1, ceil_div(work, static_cast<size_t>(threads)));
  const size_t fill = static_cast<size_t>(std::max(1, ctx.sm_count)) * blocks_per_sm;
  return static_cast<unsigned>(std::min(needed, fill));
}

// True when every pointer given is 16-byte aligned (float4 loads and stores are legal).
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
template <typename... P>
bool all_aligned16(const P*... p) {
  return (aligned16(p) && ...);
}

// The load/store type of kVec consecutive floats: float, or float4 (16-byte aligned addresses).
template <int kVec>
struct VecOf;
template <>
struct VecOf<1> {
  using type = float;
};
template <>
struct VecOf<4> {
  using type = float4;
};

// Sizes shared with the memory plan (backend/gpu_memory.hpp, plain C++): the workspace carver
// (sub-buffers 256-byte aligned; with a null base it only sizes, so one function both sizes a
// workspace and carves it: take() in the same order both times) and the column sums' chunking.
using gpu::WorkspaceCarver;
using gpu::ColumnChunks;
using gpu::column_chunks;
using gpu::column_sums_partial_floats;
using gpu::kColumnSumMaxChunks;
using gpu::kColumnSumMinRows;

// ---- the counter RNG on the device (dropout) -------------------------------------------------------
// Mirrors of core/random.hpp's mix64, counter_bits, counter_keep, dropout_threshold24 and
// dropout_row_key, callable from kernels: the same integer arithmetic, so the same bits and the
// same keep decisions as the CPU backend's dropout. The static_asserts below check them against
// the host functions at compile time; the GPU tests compare whole masks.
__host__ __device__ constexpr uint64_t rng_mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
__host__ __device__ constexpr uint64_t rng_counter_bits(uint64_t key, uint64_t counter) {
  return rng_mix64(key ^ rng_mix64(counter));
}
// Keep with probability 1 - threshold24 / 2^24: the top 24 bits of the draw against the threshold.
__host__ __device__ constexpr bool rng_counter_keep(uint64_t key, uint64_t counter, uint32_t threshold24) {
  return static_cast<uint32_t>(rng_counter_bits(key, counter) >> 40) >= threshold24;
}
// round(p * 2^24), p clamped to [0, 1] (NaN: 0).
__host__ __device__ constexpr uint32_t rng_dropout_threshold24(float p) {
  if (!(p > 0.0f)) return 0;
  if (p >= 1.0f) return uint32_t{1} << 24;
  return static_cast<uint32_t>(static_cast<double>(p) * 16777216.0 + 0.5);
}
__host__ __device__ constexpr uint64_t rng_dropout_row_key(uint64_t row_key, uint64_t site) {
  return rng_mix64(row_key ^ rng_mix64(site ^ 0xD1B54A32D192ED03ull));
}

static_assert(rng_mix64(0) == ::shardtrain::mix64(0) && rng_mix64(~0ull) == ::shardtrain::mix64(~0ull) &&
                  rng_mix64(0x0123456789ABCDEFull) == ::shardtrain::mix64(0x0123456789ABCDEFull),
              "mix64 mirror");
static_assert(rng_dropout_row_key(42, 7) == ::shardtrain::dropout_row_key(42, 7) &&
                  rng_dropout_row_key(~0ull, 0) == ::shardtrain::dropout_row_key(~0ull, 0),
              "dropout_row_key mirror");
static_assert(rng_counter_bits(0x5EEDull, 12345) == ::shardtrain::counter_bits(0x5EEDull, 12345) &&
                  rng_counter_keep(0x5EEDull, 12345, 1u << 23) ==
                      ::shardtrain::counter_keep(0x5EEDull, 12345, 1u << 23) &&
                  rng_counter_keep(3, 4, 0) && !rng_counter_keep(3, 4, 1u << 24),
              "counter_keep mirror");
static_assert(rng_dropout_threshold24(0.0f) == 0 && rng_dropout_threshold24(1.0f) == (1u << 24) &&
                  rng_dropout_threshold24(0.1f) == ::shardtrain::dropout_threshold24(0.1f) &&
                  rng_dropout_threshold24(0.5f) == (1u << 23) &&
                  rng_dropout_threshold24(1e-9f) == ::shardtrain::dropout_threshold24(1e-9f),
              "dropout_threshold24 mirror");

// ---- warp and block reductions (fixed shuffle trees) ----------------------------------------------
template <typename T>
__device__ inline T warp_sum(T v) {
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

__device__ inline float warp_max(float v) {
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

// Sum over the block, returned to every thread. blockDim.x must be a multiple of 32 (<= 1024);
// `shared` holds 32 elements. Safe to call repeatedly with the same `shared`.
template <typename T>
__device__ inline T block_sum(T v, T* shared) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int warps = blockDim.x / kWarpSize;
  v = warp_sum(v);
  __syncthreads();  // the previous call's readers are done with `shared`
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : T(0);
  return warp_sum(v);
}

__device__ inline float block_max(float v, float* shared) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int warps = blockDim.x / kWarpSize;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : -INFINITY;
  return warp_max(v);
}

// ---- deterministic column sums --------------------------------------------------------------------
// Sums over the N rows of kSums functions term(n, c, out[kSums]) of an (N, C) grid, added (+=) into
// targets[s][c]. Stage 1: rows are cut into fixed chunks (a function of N only); a block of
// 32 columns x 8 row-lanes sums one chunk, each lane over every 8th row, then the 8 lanes in order,
// into partial[s][chunk][c]. Stage 2, in the same 32 x 8 layout: lane y adds chunks y, y+8, ...
// in order, then the 8 lanes are added in order and the total to the target. No atomics: the
// same inputs give the same bits on every run.
// The chunking (column_chunks, column_sums_partial_floats) is gpu_memory.hpp's, declared above.
constexpr int kColumnSumRowLanes = 8;

// This thread's column of the row lanes, added in lane order (fixed: deterministic).
__device__ inline float lane_total(const float (&lanes)[kColumnSumRowLanes][kWarpSize]) {
  float total = 0.0f;
  for (int lane = 0; lane < kColumnSumRowLanes; lane++) total += lanes[lane][threadIdx.x];
  return total;
}

template <int kSums, typename Term>
__global__ void column_partial_sums_kernel(float* partial, int N, int C, int rows_per_chunk, Term term) {
  __shared__ float lanes[kSums][kColumnSumRowLanes][kWarpSize];
  const int c = blockIdx.x * kWarpSize + threadIdx.x;
  const int chunk = blockIdx.y;
  const int lo = chunk * rows_per_chunk, hi = min(N, lo + rows_per_chunk);
  float acc[kSums];
  for (int s = 0; s < kSums; s++) acc[s] = 0.0f;
  if (c < C) {
    for (int n = lo + threadIdx.y; n < hi; n += kColumnSumRowLanes) {
      float t[kSums];
      term(n, c, t);
      for (int s = 0; s < kSums; s++) acc[s] += t[s];
    }
  }
  for (int s = 0; s < kSums; s++) lanes[s][threadIdx.y][threadIdx.x] = acc[s];
  __syncthreads();
  if (threadIdx.y == 0 && c < C)
    for (int s = 0; s < kSums; s++)
      partial[(static_cast<size_t>(s) * gridDim.y + chunk) * C + c] = lane_total(lanes[s]);
}

// The sums' destinations. A null target (a frozen parameter's gradient) is summed like the others
// but not stored, so that the other sums keep their bits; all null: nothing is launched.
struct ColumnTargets {
  float* target[2];
};

// Stage 2, laid out as stage 1 (32 columns x 8 lanes per block, so a 768-wide sum keeps 24 blocks
// busy instead of 3): lane y adds chunks y, y+8, ... in order, then lane 0 adds the 8 lanes in
// order. The order is a function of the chunk count alone: deterministic.
template <int kSums>
__global__ void column_sums_finish_kernel(ColumnTargets targets, const float* partial, int chunks, int C) {
  __shared__ float lanes[kSums][kColumnSumRowLanes][kWarpSize];
  const int c = blockIdx.x * kWarpSize + threadIdx.x;
  float acc[kSums];
  for (int s = 0; s < kSums; s++) acc[s] = 0.0f;
  if (c < C)
    for (int chunk = threadIdx.y; chunk < chunks; chunk += kColumnSumRowLanes)
      for (int s = 0; s < kSums; s++) acc[s] += partial[(static_cast<size_t>(s) * chunks + chunk) * C + c];
  for (int s = 0; s < kSums; s++) lanes[s][threadIdx.y][threadIdx.x] = acc[s];
  __syncthreads();
  if (threadIdx.y == 0 && c < C)
    for (int s = 0; s < kSums; s++)
      if (targets.target[s]) targets.target[s][c] += lane_total(lanes[s]);
}

// Host half: targets[s][c] += sum over n of term(n, c)[s]. `partial`: column_sums_partial_floats().
template <int kSums, typename Term>
void column_sums_accumulate(ColumnTargets targets, float* partial, int N, int C, Term term, const LaunchContext& ctx) {
  static_assert(kSums >= 1 && kSums <= 2, "at most two column sums at once");
  if (N <= 0 || C <= 0) return;
  bool any_target = false;
  for (int s = 0; s < kSums; s++) any_target = any_target || targets.target[s] != nullptr;
  if (!any_target) return;
  const ColumnChunks ch = column_chunks(N);
  const dim3 block(kWarpSize, kColumnSumRowLanes);
  const dim3 grid(static_cast<unsigned>(ceil_div(static_cast<size_t>(C), kWarpSize)), static_cast<unsigned>(ch.chunks));
  column_partial_sums_kernel<kSums><<<grid, block, 0, ctx.stream>>>(partial, N, C, ch.rows_per_chunk, term);
  CUDA_CHECK_LAUNCH();
  column_sums_finish_kernel<kSums><<<grid.x, block, 0, ctx.stream>>>(targets, partial, ch.chunks, C);
  CUDA_CHECK_LAUNCH();
}

}  // namespace shardtrain::kernels
