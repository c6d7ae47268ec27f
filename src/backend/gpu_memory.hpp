// The CUDA backend's own device memory, sized in plain C++ (no CUDA headers; compiled in every
// build) so that the memory plan (app/memory_plan.hpp) and the backend use the same numbers: the
// caching allocator's size classes (backend/cuda/cuda_device.cpp), the cuBLASLt workspace, each
// kernel's workspace (kernels/launch.hpp's *_workspace_bytes, defined here), the 16-bit GEMM
// operand copies (kernels/matmul.cu) and an estimate of what NCCL allocates by itself.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

namespace shardtrain::gpu {

// ---- the caching allocator (backend/cuda/cuda_device.cpp) -----------------------------------------
// Requests are rounded up to a size class: 512 B up to 1 MiB, 2 MiB above.
constexpr size_t kAllocatorSmallLimit = size_t{1} << 20;
constexpr size_t kAllocatorSmallGranule = 512;
constexpr size_t kAllocatorLargeGranule = size_t{2} << 20;
// The block a request of `bytes` gets from the driver (0 for 0; SIZE_MAX where rounding overflows).
size_t allocator_block_bytes(size_t bytes);
// What rounding adds over these allocations: the sum of block_bytes(b) - b.
size_t allocator_rounding_bytes(const std::vector<size_t>& allocations);

// ---- cuBLASLt -----------------------------------------------------------------------------------
// The workspace the device gives every cuBLASLt matmul (allocated once, from the allocator).
constexpr size_t kCublasLtWorkspaceBytes = size_t{32} << 20;

// ---- carving one workspace into sub-buffers --------------------------------------------------------
// Each sub-buffer starts 256-byte aligned (what cuBLASLt and vector loads want). With a null base
// it only sizes: the same calls size (base null) and cut (base given) a workspace.
constexpr size_t kWorkspaceAlignment = 256;
class WorkspaceCarver {
 public:
  explicit WorkspaceCarver(void* base) : base_(static_cast<char*>(base)) {}
  template <typename T>
  T* take(size_t count) {
    offset_ = (offset_ + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
    T* p = base_ ? reinterpret_cast<T*>(base_ + offset_) : nullptr;
    offset_ += count * sizeof(T);
    return p;
  }
  size_t bytes() const { return offset_; }

 private:
  char* base_;
  size_t offset_ = 0;
};

// ---- the deterministic two-stage column sums (kernels/common.cuh) -----------------------------------
// Rows are cut into at most kColumnSumMaxChunks chunks of at least kColumnSumMinRows rows (a
// function of N only); stage 1 writes one partial sum per chunk and column.
constexpr int kColumnSumMaxChunks = 256;
constexpr int kColumnSumMinRows = 32;
struct ColumnChunks {
  int rows_per_chunk;
  int chunks;
};
ColumnChunks column_chunks(int N);
// Floats of the partial sums of kSums column sums over (N, C).
size_t column_sums_partial_floats(int kSums, int N, int C);

// ---- each kernel's workspace (kernels/launch.hpp declares them for the launchers) --------------------
// Attention backward (attention.cu): D = rowsum(dout * out) per query row, B*NH*T floats.
size_t attention_backward_workspace_bytes(int B, int T, int NH, int KV, int HS);
// LayerNorm backward: two column sums (dweight, dbias) over N rows of C; RMSNorm: one (dweight).
size_t layernorm_backward_workspace_bytes(int N, int C);
size_t rmsnorm_backward_workspace_bytes(int N, int C);
// Matmul backward's dbias: one column sum over N rows of OC.
size_t matmul_backward_workspace_bytes(int N, int OC);
// DoRA's column dot products (dora.cu): per chunk of rows and column, one double.
size_t column_dot_accumulate_workspace_bytes(int rows, int cols);
// The reductions' fixed scratch (reduce.cu): kReduceBlocks partial sums and the result, doubles.
constexpr int kReduceBlocks = 512;
size_t reduce_scratch_bytes();
// Encoder backward (encoder.cu): three int arrays of B*T (the positions, sorted tokens and
// positions) plus CUB's radix-sort temporary storage, which only CUB can size exactly
// (cub::DeviceRadixSort::SortPairs with a null buffer); here estimated as CUB's alternate key and
// value buffers (2 B*T ints) plus kCubSortOverheadBytes for its histograms and tile state.
constexpr size_t kCubSortOverheadBytes = size_t{64} << 10;
size_t encoder_backward_workspace_estimate(int B, int T);

// ---- 16-bit GEMM operand copies (kernels/matmul.cu, fsdp.param_dtype=bf16|fp16) ----------------------
// A GEMM rounds op(A) (a_elements) and op(B) (b_elements) into one carved buffer.
size_t gemm_operand_bytes(size_t a_elements, size_t b_elements);
// Matmul (N rows, C in, OC out): the forward rounds inp (N x C) and weight (OC x C); the backward
// rounds dout (N x OC), weight and inp once for both of its products.
size_t matmul_forward_operand_bytes(int N, int C, int OC);
size_t matmul_backward_operand_bytes(int N, int C, int OC);

// ---- NCCL (an estimate: NCCL allocates with cudaMalloc, outside our allocator) -----------------------
// Per channel, each connection's receiving end holds one buffer per protocol: Simple
// (NCCL_BUFFSIZE, default 4 MiB), LL (NCCL_LL_BUFFSIZE, default 8 lines x 512 threads x 8 steps x
// 16 B = 512 KiB) and LL128 (NCCL_LL128_BUFFSIZE, default 120 elements x 640 threads x 8 steps x
// 8 B = 4,915,200 B) -- NCCL's src/init.cc DEFAULT_*BUFFSIZE, overridable by the same variables.
// A ring gives each rank one receiving connection per channel. Channels: NCCL picks them from the
// topology at init, at most 32 (MAXCHANNELS); NCCL_MAX_NCHANNELS caps them, so it is taken when set.
constexpr size_t kNcclDefaultBuffSize = size_t{1} << 22;
constexpr size_t kNcclDefaultLlBuffSize = size_t{8} * 512 * 8 * 16;
constexpr size_t kNcclDefaultLl128BuffSize = size_t{120} * 640 * 8 * 8;
constexpr int kNcclDefaultChannels = 32;
struct NcclBufferSizes {
  size_t simple = kNcclDefaultBuffSize, ll = kNcclDefaultLlBuffSize, ll128 = kNcclDefaultLl128BuffSize;
  int channels = kNcclDefaultChannels;
  size_t per_channel() const { return simple + ll + ll128; }
};
// NCCL_BUFFSIZE, NCCL_LL_BUFFSIZE, NCCL_LL128_BUFFSIZE, NCCL_MAX_NCHANNELS from `getenv` (the
// process environment by default); a variable that is unset, not a positive whole number, or -2
// (NCCL's "default") keeps the default.
NcclBufferSizes nccl_buffer_sizes(const std::function<const char*(const char*)>& getenv = nullptr);
// The buffers of one communicator of `ranks` ranks: none for a single rank (no connections).
size_t nccl_communicator_bytes(int ranks, const NcclBufferSizes& sizes);

}  // namespace shardtrain::gpu
