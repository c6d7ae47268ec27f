// The NCCL communicator's elementwise kernels: the fp32 accumulation into the shard after a
// reduce-scatter (see comm_kernels.hpp). The per-element widening is backend/dtype.hpp's, shared
// with the CPU, so the unit tests of that header cover the GPU's wire numerics too. Grid-stride
// loops with size_t indices: any n, no 2^31 limit.
#include "comm_kernels.hpp"

#include "common.cuh"

namespace shardtrain {
namespace {

using kernels::grid_for;

constexpr int kThreads = 256;

__global__ void add_from_wire_kernel(float* shard, const uint16_t* wire_sum, const float* own, size_t n, DType wire) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    shard[i] += half_to_float(wire_sum[i], wire) + (own ? own[i] : 0.0f);
}

__global__ void add_kernel(float* shard, const float* in, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    shard[i] += in[i];
}

}  // namespace

void launch_comm_add_from_wire(float* shard, const uint16_t* wire_sum, const float* own, size_t n, DType wire,
                               const kernels::LaunchContext& ctx) {
  SHARD_CHECK(wire == DTYPE_BF16 || wire == DTYPE_FP16, "wire type %s is not 16-bit", dtype_name(wire));
  if (n == 0) return;
  add_from_wire_kernel<<<grid_for(n, kThreads, ctx), kThreads, 0, ctx.stream>>>(shard, wire_sum, own, n, wire);
  CUDA_CHECK_LAUNCH();
}

void launch_comm_add(float* shard, const float* in, size_t n, const kernels::LaunchContext& ctx) {
  if (n == 0) return;
  add_kernel<<<grid_for(n, kThreads, ctx), kThreads, 0, ctx.stream>>>(shard, in, n);
  CUDA_CHECK_LAUNCH();
}

}  // namespace shardtrain
