// Launchers of the NCCL communicator's accumulation kernels (kernels/comm_kernels.cu), as plain
// C++: no CUDA syntax, so src/comm/cuda/nccl_comm.cpp (compiled by mpicxx) can include it. Every
// launcher returns after queuing its kernel on ctx.stream, checks the launch (fatal on error),
// and does nothing for n == 0.
//
// With launch_to_half (launch.hpp), which rounds the wire and zeroes this rank's own slot, they
// implement the 16-bit wire of reduce_scatter_add with the numerics of comm/mpi_comm.cpp's ring:
// values travel and partial sums are rounded in bf16/fp16 (round to nearest even, exactly
// backend/dtype.hpp's float_to_half), while this rank's own term and the accumulation into the
// shard stay fp32.
#pragma once

#include <cstddef>
#include <cstdint>

#include "backend/dtype.hpp"
#include "kernels/launch.hpp"

namespace shardtrain {

// shard[i] += half_to_float(wire_sum[i], wire) + own[i] (own may be null: no own term).
void launch_comm_add_from_wire(float* shard, const uint16_t* wire_sum, const float* own, size_t n, DType wire,
                               const kernels::LaunchContext& ctx);

// shard[i] += in[i]
void launch_comm_add(float* shard, const float* in, size_t n, const kernels::LaunchContext& ctx);

}  // namespace shardtrain
