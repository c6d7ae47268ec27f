// fp32 <-> 16-bit conversions (bf16 or fp16) with backend/dtype.hpp's float_to_half /
// half_to_float: the same integer code as the CPU, so the results are bit-identical to it, NaN
// payloads and subnormals included (round to nearest even). The fp32 -> 16-bit kernel of the
// backend: ShardOps::to_half, the 16-bit GEMM operands (matmul.cu) and the NCCL communicator's
// wire (which zeroes this rank's own slot) all launch it; LayerOps::round_to_half (16-bit
// activations) is the same float_to_half fused with the widening back, so its bits are to_half's
// then from_half's in one pass. Grid-stride loops with size_t indices.
//
// The kernels are bandwidth-bound (16-bit activations round and widen every saved tensor of every
// layer: 17-22% of a bf16 step on an H200 with one element per thread), so each thread converts a
// pack of 8 elements through 16-byte loads and stores when every pointer is 16-byte aligned
// (separate allocations are); a call's last n % 8 elements, and a misaligned call, go one element
// per thread. The same per-element code either way: the same bits.
#include <type_traits>

#include "common.cuh"

namespace shardtrain::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kPack = 8;  // elements per 16-byte access of 16-bit values

// E consecutive elements, loaded and stored as one (E = kPack: 16-byte aligned accesses).
template <typename T, int E>
struct alignas(E == 1 ? alignof(T) : 16) Pack {
  T v[E];
};

template <int E, typename T>
__device__ __forceinline__ Pack<T, E> load_pack(const T* base, size_t p) {
  return reinterpret_cast<const Pack<T, E>*>(base)[p];
}
template <int E, typename T>
__device__ __forceinline__ void store_pack(T* base, size_t p, const Pack<T, E>& pack) {
  reinterpret_cast<Pack<T, E>*>(base)[p] = pack;
}

// Each kernel converts `packs` packs of E elements; `first` is the index of element 0 in the
// caller's array (the tail launch starts past the packed part), for to_half's zeroed range.
template <DType kType, int E>
__global__ void to_half_kernel(uint16_t* out, const float* in, size_t packs, size_t first, size_t zero_begin,
                               size_t zero_end) {
  for (size_t p = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; p < packs;
       p += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const Pack<float, E> x = load_pack<E>(in, p);
    Pack<uint16_t, E> h;
#pragma unroll
    for (int k = 0; k < E; k++) {
      const size_t i = first + p * E + k;
      h.v[k] = (i >= zero_begin && i < zero_end) ? uint16_t{0} : float_to_half(x.v[k], kType);
    }
    store_pack<E>(out, p, h);
  }
}

template <DType kType, int E>
__global__ void from_half_kernel(float* out, const uint16_t* in, size_t packs) {
  for (size_t p = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; p < packs;
       p += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const Pack<uint16_t, E> h = load_pack<E>(in, p);
    Pack<float, E> x;
#pragma unroll
    for (int k = 0; k < E; k++) x.v[k] = half_to_float(h.v[k], kType);
    store_pack<E>(out, p, x);
  }
}

// values[i] rounded in place and its 16-bit value kept (unless half is null): afterwards
// values[i] == widen(half[i]).
template <DType kType, int E>
__global__ void round_to_half_kernel(float* values, uint16_t* half, size_t packs) {
  for (size_t p = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; p < packs;
       p += static_cast<size_t>(gridDim.x) * blockDim.x) {
    Pack<float, E> x = load_pack<E>(values, p);
    Pack<uint16_t, E> h;
#pragma unroll
    for (int k = 0; k < E; k++) {
      h.v[k] = float_to_half(x.v[k], kType);
      x.v[k] = half_to_float(h.v[k], kType);
    }
    if (half) store_pack<E>(half, p, h);
    store_pack<E>(values, p, x);
  }
}

// Rows of `cols` floats into rows `ld` 16-bit elements apart (the padding columns are not written).
template <DType kType>
__global__ void to_half_rows_kernel(uint16_t* out, int ld, const float* in, int cols, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    out[i / cols * ld + i % cols] = float_to_half(in[i], kType);
}

void check_half_type(DType type) {
  SHARD_CHECK(type == DTYPE_BF16 || type == DTYPE_FP16, "16-bit conversion to %s", dtype_name(type));
}

// Runs launch(E, offset, packs) as packs of kPack for the 16-byte aligned part (when `aligned`)
// and one element per thread for the rest, the kernel's template chosen by `type`.
template <typename Launch>
void launch_packed(size_t n, bool aligned, const Launch& launch) {
  const size_t packed = aligned ? n / kPack * kPack : 0;
  if (packed > 0) launch(std::integral_constant<int, kPack>{}, size_t{0}, packed / kPack);
  if (n > packed) launch(std::integral_constant<int, 1>{}, packed, n - packed);
}

}  // namespace

void launch_to_half(uint16_t* out, const float* in, size_t n, DType type, const LaunchContext& ctx, size_t zero_begin,
                    size_t zero_end) {
  check_half_type(type);
  launch_packed(n, all_aligned16(out, in), [&](auto e, size_t first, size_t packs) {
    constexpr int E = decltype(e)::value;
    const unsigned grid = grid_for(packs, kThreads, ctx);
    if (type == DTYPE_BF16)
      to_half_kernel<DTYPE_BF16, E><<<grid, kThreads, 0, ctx.stream>>>(out + first, in + first, packs, first,
                                                                          zero_begin, zero_end);
    else
      to_half_kernel<DTYPE_FP16, E><<<grid, kThreads, 0, ctx.stream>>>(out + first, in + first, packs, first,
                                                                          zero_begin, zero_end);
    CUDA_CHECK_LAUNCH();
  });
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
  launch_packed(n, all_aligned16(out, in), [&](auto e, size_t first, size_t packs) {
    constexpr int E = decltype(e)::value;
    const unsigned grid = grid_for(packs, kThreads, ctx);
    if (type == DTYPE_BF16)
      from_half_kernel<DTYPE_BF16, E><<<grid, kThreads, 0, ctx.stream>>>(out + first, in + first, packs);
    else
      from_half_kernel<DTYPE_FP16, E><<<grid, kThreads, 0, ctx.stream>>>(out + first, in + first, packs);
    CUDA_CHECK_LAUNCH();
  });
}

void launch_round_to_half(float* values, uint16_t* half, size_t n, DType type, const LaunchContext& ctx) {
  check_half_type(type);
  launch_packed(n, all_aligned16(values, half), [&](auto e, size_t first, size_t packs) {
    constexpr int E = decltype(e)::value;
    const unsigned grid = grid_for(packs, kThreads, ctx);
    uint16_t* kept = half ? half + first : nullptr;  // null: rounded in place only
    if (type == DTYPE_BF16)
      round_to_half_kernel<DTYPE_BF16, E><<<grid, kThreads, 0, ctx.stream>>>(values + first, kept, packs);
    else
      round_to_half_kernel<DTYPE_FP16, E><<<grid, kThreads, 0, ctx.stream>>>(values + first, kept, packs);
    CUDA_CHECK_LAUNCH();
  });
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
