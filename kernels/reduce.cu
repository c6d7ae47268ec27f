// Whole-buffer reductions returned to the host: sum and sum of squares (the gradient norm) in
// double, and the count of inf/NaN elements; and the two sums added to a double in device memory
// instead (accumulate_*), which the host does not wait for.
//
// Deterministic by construction: the grid is a function of n only (kBlocks at most, never of
// the device or of the pointer's alignment), element i is always added by thread
// i mod (blocks * threads) in increasing i, the block sums with a fixed shuffle tree, and a single
// block then adds the per-block partials with the same tree. Same input, same bits, every run.
// Each element is widened to double before it is squared or added, so the only error is double
// reassociation (~1e-16 relative): not the CPU's bits (a sequential double sum), but as close as
// makes no difference. Scalar loads on purpose: a float4 path would make the summation order depend
// on the pointer's alignment. The result travels through pinned host memory; this is the one
// place in the backend where the host waits for the stream.
#include <cmath>
#include <cstring>

#include "common.cuh"

namespace shardtrain::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kBlocks = gpu::kReduceBlocks;  // reduce_scratch_bytes() holds kBlocks + 1 doubles

enum ReduceKind { REDUCE_SUM, REDUCE_SUM_SQUARES, REDUCE_NONFINITE };

template <ReduceKind kKind>
struct ReduceTraits;
template <>
struct ReduceTraits<REDUCE_SUM> {
  using Acc = double;
  __device__ static Acc term(float x) { return static_cast<double>(x); }
};
template <>
struct ReduceTraits<REDUCE_SUM_SQUARES> {
  using Acc = double;
  __device__ static Acc term(float x) {
    const double d = static_cast<double>(x);
    return d * d;
  }
};
template <>
struct ReduceTraits<REDUCE_NONFINITE> {
  using Acc = unsigned long long;
  __device__ static Acc term(float x) { return isfinite(x) ? 0ull : 1ull; }
};

template <ReduceKind kKind>
__global__ void reduce_partial_kernel(typename ReduceTraits<kKind>::Acc* partial, const float* x, size_t n) {
  using Acc = typename ReduceTraits<kKind>::Acc;
  __shared__ Acc shared[kWarpSize];
  Acc acc = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    acc += ReduceTraits<kKind>::term(x[i]);
  acc = block_sum(acc, shared);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// One block: result[0] = sum of partial[0, blocks), or result[0] += it.
template <typename Acc>
__global__ void reduce_final_kernel(Acc* result, const Acc* partial, int blocks, bool accumulate) {
  __shared__ Acc shared[kWarpSize];
  Acc acc = 0;
  for (int i = threadIdx.x; i < blocks; i += blockDim.x) acc += partial[i];
  acc = block_sum(acc, shared);
  if (threadIdx.x == 0) *result = accumulate ? *result + acc : acc;
}

// The partials of x into `scratch`, then their sum into (or onto) *result.
template <ReduceKind kKind>
void reduce_into(typename ReduceTraits<kKind>::Acc* result, bool accumulate, const float* x, size_t n, void* scratch,
                 const LaunchContext& ctx) {
  using Acc = typename ReduceTraits<kKind>::Acc;
  Acc* partial = static_cast<Acc*>(scratch);
  const int blocks = static_cast<int>(std::min<size_t>(kBlocks, ceil_div(n, kThreads)));
  reduce_partial_kernel<kKind><<<blocks, kThreads, 0, ctx.stream>>>(partial, x, n);
  CUDA_CHECK_LAUNCH();
  reduce_final_kernel<Acc><<<1, kThreads, 0, ctx.stream>>>(result, partial, blocks, accumulate);
  CUDA_CHECK_LAUNCH();
}

// 8-byte slots: kBlocks partials, then the result.
template <ReduceKind kKind>
typename ReduceTraits<kKind>::Acc reduce(const float* x, size_t n, void* scratch, void* host_result,
                                         const LaunchContext& ctx) {
  using Acc = typename ReduceTraits<kKind>::Acc;
  static_assert(sizeof(Acc) == 8, "8-byte accumulators");
  if (n == 0) return 0;
  Acc* result = static_cast<Acc*>(scratch) + kBlocks;
  reduce_into<kKind>(result, false, x, n, scratch, ctx);
  CUDA_CHECK(cudaMemcpyAsync(host_result, result, sizeof(Acc), cudaMemcpyDeviceToHost, ctx.stream));
  CUDA_CHECK(cudaStreamSynchronize(ctx.stream));
  Acc value;
  std::memcpy(&value, host_result, sizeof value);
  return value;
}

}  // namespace

double reduce_sum(const float* x, size_t n, void* scratch, void* host_result, const LaunchContext& ctx) {
  return reduce<REDUCE_SUM>(x, n, scratch, host_result, ctx);
}

double reduce_sum_squares(const float* x, size_t n, void* scratch, void* host_result, const LaunchContext& ctx) {
  return reduce<REDUCE_SUM_SQUARES>(x, n, scratch, host_result, ctx);
}

void accumulate_sum(double* total, const float* x, size_t n, void* scratch, const LaunchContext& ctx) {
  if (n > 0) reduce_into<REDUCE_SUM>(total, true, x, n, scratch, ctx);
}

void accumulate_sum_squares(double* total, const float* x, size_t n, void* scratch, const LaunchContext& ctx) {
  if (n > 0) reduce_into<REDUCE_SUM_SQUARES>(total, true, x, n, scratch, ctx);
}

size_t reduce_count_nonfinite(const float* x, size_t n, void* scratch, void* host_result, const LaunchContext& ctx) {
  return static_cast<size_t>(reduce<REDUCE_NONFINITE>(x, n, scratch, host_result, ctx));
}

}  // namespace shardtrain::kernels
