// Launchers of the NCCL communicator's small kernels (kernels/comm_kernels.cu), as plain C++: no
// CUDA syntax, so src/comm/cuda/nccl_comm.cpp (compiled by mpicxx) can include it. `stream` is a
// cudaStream_t (CUstream_st*). Every launcher returns after queuing its kernel, checks the launch
// (fatal on error), and does nothing for n == 0.
//
// They implement the 16-bit wire of reduce_scatter_add with the numerics of comm/mpi_comm.cpp's
// ring: values travel and partial sums are rounded in bf16/fp16 (round to nearest even, exactly
// backend/dtype.hpp's float_to_half), while this rank's own term and the accumulation into the
// shard stay fp32.
#pragma once

#include <cstddef>
#include <cstdint>

#include "backend/dtype.hpp"

struct CUstream_st;

namespace shardtrain {

// out[i] = float_to_half(in[i], wire) for i in [0, n), except 0 (+0.0 in bf16 and fp16) for i in
// [zero_begin, zero_end): the slot of this rank's own term, which is added later in fp32.
void launch_comm_to_wire(uint16_t* out, const float* in, size_t n, size_t zero_begin, size_t zero_end, DType wire,
                         CUstream_st* stream);

// shard[i] += half_to_float(wire_sum[i], wire) + own[i] (own may be null: no own term).
void launch_comm_add_from_wire(float* shard, const uint16_t* wire_sum, const float* own, size_t n, DType wire,
                               CUstream_st* stream);

// shard[i] += in[i]
void launch_comm_add(float* shard, const float* in, size_t n, CUstream_st* stream);

}  // namespace shardtrain
