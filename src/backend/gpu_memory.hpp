// The CUDA backend's own device memory, sized in plain C++ (no CUDA headers; compiled in every
// build) so that the memory plan (app/memory_plan.hpp) and the backend use the same numbers: the
// caching allocator's size classes (backend/cuda/cuda_device.cpp), the cuBLASLt workspace, each
// kernel's workspace (kernels/launch.hpp's *_workspace_bytes, defined here), the 16-bit GEMM
// operand copies (kernels/matmul.cu), cuDNN's fused attention (backend/cuda/cudnn_attention.cpp:
// its staging buffers exactly, cuDNN's own workspace as an estimate) and an estimate of what NCCL
// allocates by itself.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace shardtrain::gpu {

// ---- the caching allocator (backend/cuda/cuda_device.cpp) -----------------------------------------
// Requests are rounded up to a size class: 512 B up to 1 MiB, 2 MiB above.
constexpr size_t kAllocatorSmallLimit = size_t{1} << 20;
constexpr size_t kAllocatorSmallGranule = 512;
constexpr size_t kAllocatorLargeGranule = size_t{2} << 20;
// A backed prefix (CudaDevice::allocate_backed_prefix) maps physical memory in the driver's
// minimum granularity, queried at run time: 2 MiB on every GPU the program runs on today.
constexpr size_t kMappedGranule = size_t{2} << 20;
size_t mapped_block_bytes(size_t bytes);
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
// A diffusion transformer's per-sample parameter sums over a sample's T rows of C.
size_t modulate_backward_workspace_bytes(int T, int C);
size_t gate_backward_workspace_bytes(int T, int C);
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
// rounds dout (N x OC, its rows gemm_padded_row(OC) apart), weight and inp once for both of its
// products. weight_copy false: the weight
// comes already rounded (the engine's gathered 16-bit unit, LayerOps::bind_half_copy), so only the
// activations are copied -- how every GEMM of a training or generation run goes. An input bound
// to its 16-bit copy (16-bit activations) is not copied either: then both are upper bounds, kept
// so (the backward asks for this size and leaves the input's tail unused; the LM head's input,
// never bound, sets the largest request anyway).
size_t matmul_forward_operand_bytes(int N, int C, int OC, bool weight_copy);
size_t matmul_backward_operand_bytes(int N, int C, int OC, bool weight_copy);
// The row length of a 16-bit operand copy: `cols` rounded up to 8 elements (16 bytes), the
// leading-dimension alignment cuBLASLt's fast Hopper kernels need. GPT-2's 50257 logits per row
// ran its LM head's backward at 131 TFLOP/s, against 441 for Llama's 49152 (docs/performance.md).
inline int gemm_padded_row(int cols) { return (cols + 7) / 8 * 8; }

// ---- cuDNN's fused attention (backend/cuda/cudnn_attention.cpp, train.attention=cudnn) -------------
// The head sizes cuDNN's SDPA engines take: multiples of 8 up to 128. "" when it takes HS, else
// why not. CudnnAttention::unsupported_reason asks this first, then the runtime cuDNN's own limits
// (the backward of cuDNN before 9.16 also needs T a multiple of 128; the plan does not know the
// runtime version and counts the backward's memory regardless, an upper bound).
constexpr int kCudnnAttentionHeadSizeMultiple = 8;
constexpr int kCudnnAttentionMaxHeadSize = 128;
std::string cudnn_attention_head_size_refusal(int HS);
// The largest head size the tiled attention kernels hold (kernels/attention.cu: 32 lanes x 8 dims).
constexpr int kTiledAttentionMaxHeadSize = 256;
inline bool cudnn_attention_takes_head_size(int HS) { return cudnn_attention_head_size_refusal(HS).empty(); }

// Its staging buffers, each one grow-only allocation that every call reuses (sized here, for the
// plan and for CudnnAttention alike):
// - qkv16 (every call) and dqkv16 (backward): qkv in bf16, B*T*(NH+2KV)*HS*2 bytes each;
size_t cudnn_attention_qkv_bytes(int B, int T, int NH, int KV, int HS);
// - out16 (the forward's output; the backward's out rounded again) and dout16 (backward): out in
//   bf16, B*T*NH*HS*2 bytes each;
size_t cudnn_attention_out_bytes(int B, int T, int NH, int HS);
// - row_sums (backward: D = rowsum(dout * out), which cuDNN reads per tile) and lse_copy: one fp32
//   per query row, B*NH*T*4 bytes each. lse_copy holds the statistics only when the caller's lse is
//   not 16-byte aligned (cuDNN's requirement); every model's lse is an allocation of its own
//   (aligned to the allocator's 512 bytes), so the plan has no lse_copy.
size_t cudnn_attention_row_bytes(int B, int T, int NH);
// - bias (packed documents only): the (B,1,T,T) bf16 score bias, B*T*T*2 bytes.
size_t cudnn_attention_bias_bytes(int B, int T);

// cuDNN's own workspace: cuDNN tells it only from a finalized execution plan (a GPU, the runtime
// cuDNN and the engine the heuristics pick), so the plan takes these upper-bound ESTIMATES; on a
// GPU CudnnAttention::workspace_bytes() gives the real one (tests/gpu/test_cudnn_attention.cpp
// holds it within them). T' = T rounded up to kCudnnAttentionTile.
// Forward: a flash forward keeps its tiles and softmax statistics on chip; reported workspaces
// are 0 or a few bytes (XLA's SDPA tests: 16 B on Hopper, 0 on Blackwell). Allowed: fp32 row
// maxima and sums in memory, 2 * B*NH*T'*4, plus kCudnnAttentionWorkspaceSlackBytes.
// Backward (the deterministic form: dQ one product per query tile, no fp32 accumulator added into
// with atomics): cuDNN keeps dP in its workspace, B*NH*T'*T'*2 bytes -- cuDNN frontend's own sizing
// of that path (scaled_dot_product_flash_attention.h: b * h_q * ceil64(s_q) * ceil64(s_kv) * 2).
// Added, for engines that order an fp32 dQ reduction through memory instead (cuDNN 9.25's
// deterministic Hopper path, linear in T): B*NH*T'*HS*4; with grouped heads (KV < NH), the
// per-query-head dK and dV before their group sums: 2 * B*NH*T'*HS*4; and the slack.
constexpr int kCudnnAttentionTile = 64;
constexpr size_t kCudnnAttentionWorkspaceSlackBytes = size_t{1} << 20;  // engines' fixed state
size_t cudnn_attention_forward_workspace_estimate(int B, int T, int NH, int KV, int HS);
size_t cudnn_attention_backward_workspace_estimate(int B, int T, int NH, int KV, int HS);

// What CudnnAttention holds after its calls: each buffer grows to the largest request, so several
// shapes (the student's forward and backward, a distillation teacher's forward) take the larger
// of each buffer, and the workspace the largest plan's.
struct CudnnAttentionMemory {
  size_t qkv16 = 0, out16 = 0, dout16 = 0, dqkv16 = 0, row_sums = 0, bias = 0;  // staging, exact
  size_t workspace = 0;                                                         // cuDNN's, an estimate
  size_t staging() const { return qkv16 + out16 + dout16 + dqkv16 + row_sums + bias; }
  size_t total() const { return staging() + workspace; }
  // The separate allocations (the ones made), for the allocator's rounding: staging, workspace.
  std::vector<size_t> allocations() const;
  // After the other's calls as well.
  CudnnAttentionMemory& grow_to(const CudnnAttentionMemory& other);
};
// A forward (backward false) or a forward and a backward of one shape; documents: packed documents.
CudnnAttentionMemory cudnn_attention_memory(int B, int T, int NH, int KV, int HS, bool backward,
                                            bool documents = false);

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
