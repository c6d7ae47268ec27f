// See gpu_memory.hpp.
#include "backend/gpu_memory.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/error.hpp"

namespace shardtrain::gpu {
namespace {

size_t ceil_div(size_t a, size_t b) { return (a + b - 1) / b; }

size_t round_up(size_t bytes, size_t granule) {
  return bytes > SIZE_MAX - (granule - 1) ? SIZE_MAX : ceil_div(bytes, granule) * granule;
}

}  // namespace

size_t allocator_block_bytes(size_t bytes) {
  return round_up(bytes, bytes <= kAllocatorSmallLimit ? kAllocatorSmallGranule : kAllocatorLargeGranule);
}

size_t mapped_block_bytes(size_t bytes) { return round_up(bytes, kMappedGranule); }

size_t allocator_rounding_bytes(const std::vector<size_t>& allocations) {
  size_t extra = 0;
  for (size_t bytes : allocations) extra += allocator_block_bytes(bytes) - bytes;
  return extra;
}

ColumnChunks column_chunks(int N) {
  const int rows = std::max(kColumnSumMinRows, static_cast<int>(ceil_div(static_cast<size_t>(std::max(N, 0)),
                                                                         kColumnSumMaxChunks)));
  return {rows, std::max(1, static_cast<int>(ceil_div(static_cast<size_t>(std::max(N, 0)), rows)))};
}

size_t column_sums_partial_floats(int kSums, int N, int C) {
  return static_cast<size_t>(kSums) * column_chunks(N).chunks * static_cast<size_t>(C);
}

size_t attention_backward_workspace_bytes(int B, int T, int NH, int KV, int HS) {
  SHARD_CHECK(B >= 0 && T >= 0 && NH >= 1 && KV >= 1 && HS >= 1,
              "attention_backward_workspace_bytes: B=%d T=%d NH=%d KV=%d HS=%d", B, T, NH, KV, HS);
  return static_cast<size_t>(B) * NH * T * sizeof(float);  // D
}

size_t layernorm_backward_workspace_bytes(int N, int C) {
  return column_sums_partial_floats(2, std::max(N, 1), std::max(C, 1)) * sizeof(float);
}

size_t rmsnorm_backward_workspace_bytes(int N, int C) {
  return column_sums_partial_floats(1, std::max(N, 1), std::max(C, 1)) * sizeof(float);
}

size_t matmul_backward_workspace_bytes(int N, int OC) {
  return column_sums_partial_floats(1, std::max(N, 1), std::max(OC, 1)) * sizeof(float);
}

size_t modulate_backward_workspace_bytes(int T, int C) {
  return column_sums_partial_floats(2, std::max(T, 1), std::max(C, 1)) * sizeof(float);
}

size_t gate_backward_workspace_bytes(int T, int C) {
  return column_sums_partial_floats(1, std::max(T, 1), std::max(C, 1)) * sizeof(float);
}

size_t column_dot_accumulate_workspace_bytes(int rows, int cols) {
  if (rows < 0 || cols <= 0) return 0;
  return static_cast<size_t>(column_chunks(rows).chunks) * static_cast<size_t>(cols) * sizeof(double);
}

size_t reduce_scratch_bytes() { return (kReduceBlocks + 1) * sizeof(double); }

size_t encoder_backward_workspace_estimate(int B, int T) {
  const size_t BT = static_cast<size_t>(std::max(1, B * T));
  WorkspaceCarver carver(nullptr);
  carver.take<int>(BT), carver.take<int>(BT), carver.take<int>(BT);  // positions, sorted tokens, sorted positions
  carver.take<char>(2 * BT * sizeof(int) + kCubSortOverheadBytes);  // CUB's temporary storage
  return carver.bytes();
}

size_t gemm_operand_bytes(size_t a_elements, size_t b_elements) {
  WorkspaceCarver sizing(nullptr);
  sizing.take<uint16_t>(a_elements), sizing.take<uint16_t>(b_elements);
  return sizing.bytes();
}

size_t matmul_forward_operand_bytes(int N, int C, int OC, bool weight_copy) {
  return gemm_operand_bytes(static_cast<size_t>(N) * C, weight_copy ? static_cast<size_t>(OC) * C : 0);
}

size_t matmul_backward_operand_bytes(int N, int C, int OC, bool weight_copy) {
  WorkspaceCarver sizing(nullptr);  // kernels/matmul.cu's order: dout, weight (when copied), inp
  sizing.take<uint16_t>(static_cast<size_t>(N) * gemm_padded_row(OC)),
      sizing.take<uint16_t>(weight_copy ? static_cast<size_t>(OC) * C : 0), sizing.take<uint16_t>(static_cast<size_t>(N) * C);
  return sizing.bytes();
}

std::string cudnn_attention_head_size_refusal(int HS) {
  if (HS <= 0) return strprintf("head size %d", HS);
  if (HS % kCudnnAttentionHeadSizeMultiple != 0)
    return strprintf("head size %d is not a multiple of %d", HS, kCudnnAttentionHeadSizeMultiple);
  if (HS > kCudnnAttentionMaxHeadSize) return strprintf("head size %d is over %d", HS, kCudnnAttentionMaxHeadSize);
  return "";
}

namespace {

void check_attention_shape(const char* what, int B, int T, int NH, int KV, int HS) {
  SHARD_CHECK(B >= 0 && T >= 0 && NH >= 1 && KV >= 1 && HS >= 1 && NH % KV == 0, "%s: B=%d T=%d NH=%d KV=%d HS=%d",
              what, B, T, NH, KV, HS);
}

// T rounded up to cuDNN's tile.
size_t tiled_rows(int T) { return ceil_div(static_cast<size_t>(T), kCudnnAttentionTile) * kCudnnAttentionTile; }

}  // namespace

size_t cudnn_attention_qkv_bytes(int B, int T, int NH, int KV, int HS) {
  check_attention_shape("cudnn_attention_qkv_bytes", B, T, NH, KV, HS);
  return static_cast<size_t>(B) * T * (static_cast<size_t>(NH) + 2 * static_cast<size_t>(KV)) * HS * sizeof(uint16_t);
}

size_t cudnn_attention_out_bytes(int B, int T, int NH, int HS) {
  check_attention_shape("cudnn_attention_out_bytes", B, T, NH, 1, HS);
  return static_cast<size_t>(B) * T * NH * static_cast<size_t>(HS) * sizeof(uint16_t);
}

size_t cudnn_attention_row_bytes(int B, int T, int NH) {
  check_attention_shape("cudnn_attention_row_bytes", B, T, NH, 1, 1);
  return static_cast<size_t>(B) * NH * static_cast<size_t>(T) * sizeof(float);
}

size_t cudnn_attention_bias_bytes(int B, int T) {
  check_attention_shape("cudnn_attention_bias_bytes", B, T, 1, 1, 1);
  return static_cast<size_t>(B) * T * static_cast<size_t>(T) * sizeof(uint16_t);
}

size_t cudnn_attention_forward_workspace_estimate(int B, int T, int NH, int KV, int HS) {
  check_attention_shape("cudnn_attention_forward_workspace_estimate", B, T, NH, KV, HS);
  const size_t rows = static_cast<size_t>(B) * NH * tiled_rows(T);
  return 2 * rows * sizeof(float) + kCudnnAttentionWorkspaceSlackBytes;  // row maxima and sums
}

size_t cudnn_attention_backward_workspace_estimate(int B, int T, int NH, int KV, int HS) {
  check_attention_shape("cudnn_attention_backward_workspace_estimate", B, T, NH, KV, HS);
  const size_t heads = static_cast<size_t>(B) * NH, Tp = tiled_rows(T);
  const size_t dp = heads * Tp * Tp * sizeof(uint16_t);                             // dP, bf16
  const size_t dq = heads * Tp * static_cast<size_t>(HS) * sizeof(float);            // an fp32 dQ
  const size_t group_partials = KV < NH ? 2 * heads * Tp * static_cast<size_t>(HS) * sizeof(float) : 0;  // dK, dV
  return dp + dq + group_partials + kCudnnAttentionWorkspaceSlackBytes;
}

std::vector<size_t> CudnnAttentionMemory::allocations() const {
  std::vector<size_t> list;
  for (size_t bytes : {qkv16, out16, dout16, dqkv16, row_sums, bias, workspace})
    if (bytes) list.push_back(bytes);
  return list;
}

CudnnAttentionMemory& CudnnAttentionMemory::grow_to(const CudnnAttentionMemory& o) {
  qkv16 = std::max(qkv16, o.qkv16), out16 = std::max(out16, o.out16), dout16 = std::max(dout16, o.dout16);
  dqkv16 = std::max(dqkv16, o.dqkv16), row_sums = std::max(row_sums, o.row_sums), bias = std::max(bias, o.bias);
  workspace = std::max(workspace, o.workspace);
  return *this;
}

CudnnAttentionMemory cudnn_attention_memory(int B, int T, int NH, int KV, int HS, bool backward, bool documents) {
  CudnnAttentionMemory m;
  if (documents) m.bias = cudnn_attention_bias_bytes(B, T);
  m.qkv16 = cudnn_attention_qkv_bytes(B, T, NH, KV, HS);
  m.out16 = cudnn_attention_out_bytes(B, T, NH, HS);
  m.workspace = cudnn_attention_forward_workspace_estimate(B, T, NH, KV, HS);
  if (backward) {
    m.dout16 = cudnn_attention_out_bytes(B, T, NH, HS);
    m.dqkv16 = cudnn_attention_qkv_bytes(B, T, NH, KV, HS);
    m.row_sums = cudnn_attention_row_bytes(B, T, NH);
    m.workspace = std::max(m.workspace, cudnn_attention_backward_workspace_estimate(B, T, NH, KV, HS));
  }
  return m;
}

NcclBufferSizes nccl_buffer_sizes(const std::function<const char*(const char*)>& getenv) {
  auto read = [&](const char* name, long long fallback) {
    const char* text = getenv ? getenv(name) : std::getenv(name);
    if (!text || !*text) return fallback;
    errno = 0;
    char* end = nullptr;
    const long long value = std::strtoll(text, &end, 0);
    return errno == 0 && *end == '\0' && value > 0 ? value : fallback;  // -2: NCCL's default
  };
  NcclBufferSizes sizes;
  sizes.simple = static_cast<size_t>(read("NCCL_BUFFSIZE", static_cast<long long>(sizes.simple)));
  sizes.ll = static_cast<size_t>(read("NCCL_LL_BUFFSIZE", static_cast<long long>(sizes.ll)));
  sizes.ll128 = static_cast<size_t>(read("NCCL_LL128_BUFFSIZE", static_cast<long long>(sizes.ll128)));
  sizes.channels = static_cast<int>(std::min<long long>(read("NCCL_MAX_NCHANNELS", sizes.channels), 64));
  return sizes;
}

size_t nccl_communicator_bytes(int ranks, const NcclBufferSizes& sizes) {
  return ranks > 1 ? static_cast<size_t>(sizes.channels) * sizes.per_channel() : 0;
}

}  // namespace shardtrain::gpu
