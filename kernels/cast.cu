// fp32 <-> 16-bit conversions (bf16 or fp16) with backend/dtype.hpp's float_to_half /
// half_to_float: the same integer code as the CPU, so the results are bit-identical to it, NaN
// payloads and subnormals included (round to nearest even). The fp32 -> 16-bit kernel of the
// backend: ShardOps::to_half, the 16-bit GEMM operands (matmul.cu) and the NCCL communicator's
// wire (which zeroes this rank's own slot) all launch it; LayerOps::round_to_half (16-bit
// activations) is the same float_to_half fused with the widening back, so its bits are to_half's
// then from_half's in one pass. Grid-stride loops with size_t indices;
// 16-bit elements are read and written one per thread (the conversion is integer work and the
// kernels are bandwidth-bound either way).
#include "common.cuh"

namespace shardtrain::kernels {
namespace {

constexpr int kThreads = 256;

template <DType kType>
__global__ void to_half_kernel(uint16_t* out, const float* in, size_t n, size_t zero_begin, size_t zero_end) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    out[i] = (i >= zero_begin && i < zero_end) ? uint16_t{0} : float_to_half(in[i], kType);
}

// Rows of `cols` floats into rows `ld` 16-bit elements apart (the padding columns are not written).
template <DType kType>
__global__ void to_half_rows_kernel(uint16_t* out, int ld, const float* in, int cols, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    out[i / cols * ld + i % cols] = float_to_half(in[i], kType);
}

template <DType kType>
__global__ void from_half_kernel(float* out, const uint16_t* in, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    out[i] = half_to_float(in[i], kType);
}

// values[i] rounded in place and its 16-bit value kept: afterwards values[i] == widen(half[i]).
template <DType kType>
__global__ void round_to_half_kernel(float* values, uint16_t* half, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint16_t h = float_to_half(values[i], kType);
    half[i] = h;
    values[i] = half_to_float(h, kType);
  }
}

void check_half_type(DType type) {
  SHARD_CHECK(type == DTYPE_BF16 || type == DTYPE_FP16, "16-bit conversion to %s", dtype_name(type));
}

}  // namespace

void launch_to_half(uint16_t* out, const float* in, size_t n, DType type, const LaunchContext& ctx, size_t zero_begin,
                    size_t zero_end) {
  check_half_type(type);
  if (n == 0) return;
  const unsigned grid = grid_for(n, kThreads, ctx);
  if (type == DTYPE_BF16)
    to_half_kernel<DTYPE_BF16><<<grid, kThreads, 0, ctx.stream>>>(out, in, n, zero_begin, zero_end);
  else
    to_half_kernel<DTYPE_FP16><<<grid, kThreads, 0, ctx.stream>>>(out, in, n, zero_begin, zero_end);
  CUDA_CHECK_LAUNCH();
}

void launch_to_half_rows(uint16_t* out, int ld, const float* in, int rows, int cols, DType type,
                         const LaunchContext& ctx) {
  check_half_type(type);
  SHARD_CHECK(rows >= 0 && cols >= 0 && ld >= cols, "to_half_rows: rows=%d cols=%d ld=%d", rows, cols, ld);
  const size_t n = static_cast<size_t>(rows) * cols;
  if (n == 0) return;
  if (ld == cols) return launch_to_half(out, in, n, type, ctx);  // contiguous: no per-element division
  const unsigned grid = grid_for(n, kThreads, ctx);
  if (type == DTYPE_BF16)
    to_half_rows_kernel<DTYPE_BF16><<<grid, kThreads, 0, ctx.stream>>>(out, ld, in, cols, n);
  else
    to_half_rows_kernel<DTYPE_FP16><<<grid, kThreads, 0, ctx.stream>>>(out, ld, in, cols, n);
  CUDA_CHECK_LAUNCH();
}

void launch_from_half(float* out, const uint16_t* in, size_t n, DType type, const LaunchContext& ctx) {
  check_half_type(type);
  if (n == 0) return;
  const unsigned grid = grid_for(n, kThreads, ctx);
  if (type == DTYPE_BF16)
    from_half_kernel<DTYPE_BF16><<<grid, kThreads, 0, ctx.stream>>>(out, in, n);
  else
    from_half_kernel<DTYPE_FP16><<<grid, kThreads, 0, ctx.stream>>>(out, in, n);
  CUDA_CHECK_LAUNCH();
}

void launch_round_to_half(float* values, uint16_t* half, size_t n, DType type, const LaunchContext& ctx) {
  check_half_type(type);
  if (n == 0) return;
  const unsigned grid = grid_for(n, kThreads, ctx);
  if (type == DTYPE_BF16)
    round_to_half_kernel<DTYPE_BF16><<<grid, kThreads, 0, ctx.stream>>>(values, half, n);
  else
    round_to_half_kernel<DTYPE_FP16><<<grid, kThreads, 0, ctx.stream>>>(values, half, n);
  CUDA_CHECK_LAUNCH();
}

}  // namespace shardtrain::kernels

// ShardOps::dequantize_blocks (backend/quant.hpp's records): one thread per element, the element's
// record found by its block; the same record_scale, dequantize_code and float_to_half as the CPU, so the
// values (and the 16-bit copy) are the CPU's bit for bit.
namespace shardtrain::kernels {
namespace {

__global__ void dequantize_blocks_kernel(float* out, uint16_t* half, DType half_type, const uint8_t* records,
                                         size_t n, QuantType type, size_t block, size_t record, NestedScales nested) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint8_t* r = records + i / block * record;
    float v = dequantize_code(type, r, i % block, record_scale(type, r, block, nested, i / block));
    if (half) {
      half[i] = float_to_half(v, half_type);
      v = half_to_float(half[i], half_type);
    }
    if (out) out[i] = v;
  }
}

}  // namespace

void launch_dequantize_blocks(float* out, uint16_t* half, DType half_type, const uint8_t* records, size_t blocks,
                              QuantType type, size_t block, const NestedScales& nested, const LaunchContext& ctx) {
  SHARD_CHECK(type != QUANT_NONE && quant_block_ok(static_cast<int>(block)), "dequantize_blocks of %s in blocks of %zu",
              quant_type_name(type), block);
  SHARD_CHECK(out || half, "dequantize_blocks with neither an fp32 nor a 16-bit output");
  if (half) check_half_type(half_type);
  const size_t n = blocks * block;
  if (n == 0) return;
  dequantize_blocks_kernel<<<grid_for(n, kThreads, ctx), kThreads, 0, ctx.stream>>>(
      out, half, half_type, records, n, type, block, quant_record_bytes(type, block, nested.map), nested);
  CUDA_CHECK_LAUNCH();
}

}  // namespace shardtrain::kernels
