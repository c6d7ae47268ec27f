// The NCCL communicator's elementwise kernels: fp32 -> 16-bit wire conversion and the fp32
// accumulation into the shard after a reduce-scatter (see comm_kernels.hpp). The per-element
// rounding is backend/dtype.hpp's, shared with the CPU, so the unit tests of that header cover
// the GPU's wire numerics too. Grid-stride loops with size_t indices: any n, no 2^31 limit.
#include "comm_kernels.hpp"

#include <algorithm>

#include "cuda_check.hpp"
#include "backend/dtype.hpp"

namespace shardtrain {
namespace {

constexpr int kThreads = 256;

// Enough blocks to fill an H100 many times over; the grid-stride loop covers the rest.
unsigned grid_for(size_t n) { return static_cast<unsigned>(std::min<size_t>((n + kThreads - 1) / kThreads, 65536)); }

__global__ void to_wire_kernel(uint16_t* out, const float* in, size_t n, size_t zero_begin, size_t zero_end,
                               DType wire) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    out[i] = (i >= zero_begin && i < zero_end) ? uint16_t{0} : float_to_half(in[i], wire);
}

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

void launch_comm_to_wire(uint16_t* out, const float* in, size_t n, size_t zero_begin, size_t zero_end, DType wire,
                         CUstream_st* stream) {
  SHARD_CHECK(wire == DTYPE_BF16 || wire == DTYPE_FP16, "wire type %s is not 16-bit", dtype_name(wire));
  if (n == 0) return;
  to_wire_kernel<<<grid_for(n), kThreads, 0, stream>>>(out, in, n, zero_begin, zero_end, wire);
  CUDA_CHECK_LAUNCH();
}

void launch_comm_add_from_wire(float* shard, const uint16_t* wire_sum, const float* own, size_t n, DType wire,
                               CUstream_st* stream) {
  SHARD_CHECK(wire == DTYPE_BF16 || wire == DTYPE_FP16, "wire type %s is not 16-bit", dtype_name(wire));
  if (n == 0) return;
  add_from_wire_kernel<<<grid_for(n), kThreads, 0, stream>>>(shard, wire_sum, own, n, wire);
  CUDA_CHECK_LAUNCH();
}

void launch_comm_add(float* shard, const float* in, size_t n, CUstream_st* stream) {
  if (n == 0) return;
  add_kernel<<<grid_for(n), kThreads, 0, stream>>>(shard, in, n);
  CUDA_CHECK_LAUNCH();
}

}  // namespace shardtrain
