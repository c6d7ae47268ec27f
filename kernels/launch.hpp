// The launchers of the CUDA backend's kernels (kernels/*.cu), as plain C++: no CUDA syntax, only
// the runtime's and cuBLASLt's C types, for host-only translation units (built by mpicxx):
// src/backend/cuda/cuda_ops.cpp implements LayerOps<float> and ShardOps (backend/layer_ops.hpp)
// with these calls; the NCCL communicator (comm/cuda/nccl_comm.cpp) rounds its wire with
// launch_to_half. Nothing here knows a Device: a stream and the SM count are all they need.
//
// Every launcher has the semantics, argument order and accumulation rule of the CPU function of
// the same name in backend/cpu/ops.hpp (parameter gradients +=, activation gradients =, except
// layernorm_backward's and rmsnorm_backward's dinp, +=). It validates its dimensions
// (SHARD_CHECK), queues its work on ctx.stream and returns without waiting; only the reductions
// returning a host value wait.
// Launchers that need temporary device memory take a `workspace` of at least the bytes that
// their *_workspace_bytes() function gives for the same dimensions; the caller owns it and may
// reuse it for the next launch on the same stream. Those functions, except encoder's (which asks
// CUB), are backend/gpu_memory.hpp's (plain C++, shared with the memory plan), named here by
// using-declarations.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <cstdint>

#include "backend/dtype.hpp"
#include "backend/gpu_memory.hpp"
#include "backend/math.hpp"
#include "backend/quant.hpp"

namespace shardtrain::kernels {

// Where kernels run: the stream, and the SM count that sizes grid-stride grids.
struct LaunchContext {
  cudaStream_t stream = nullptr;
  int sm_count = 1;
};

// cuBLASLt descriptors, layouts and the heuristic's algorithm per distinct GEMM (types, shape,
// leading dimensions, strides, alignments, bias or not): a training step repeats the same few
// dozen GEMMs, so each is planned once. Owned by the ops object; defined in matmul.cu.
struct GemmPlanCache;
struct GemmPlanCacheDeleter {
  void operator()(GemmPlanCache* cache) const;
};
std::unique_ptr<GemmPlanCache, GemmPlanCacheDeleter> make_gemm_plan_cache();

// What GEMMs need besides the stream: the cuBLASLt handle and its workspace, and the type the
// fp32 operands are rounded to for the tensor cores (fsdp.param_dtype on the GPU: bf16 or fp16
// operands, fp32 accumulation and output, as torch.autocast; fp32: exact fp32 arithmetic).
struct GemmContext {
  LaunchContext launch;
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  DType operands = DTYPE_FP32;
  // Device memory of at least the given bytes for the 16-bit operand copies, valid until the next
  // call and reused in stream order (the ops object's grow-only buffer, from the caching
  // allocator). Empty: stream-ordered pool memory (cudaMallocAsync), for hand-made contexts.
  std::function<void*(size_t)> operand_scratch;
  GemmPlanCache* plans = nullptr;  // null: plan every call afresh
};

// ---- GEMM (matmul.cu) ------------------------------------------------------------------------------
// Row-major C(M,N) = alpha * op(A) @ op(B) + beta * C, as backend/cpu/gemm.hpp's gemm(): op(A) is
// (M,K), stored (M,K) with leading dimension lda, or (K,M) when trans_a. `batch` matrices at
// element strides stride_a/b/c (batch 1: strides unused). bias (length N, may be null) is added to
// every row of the result (cuBLASLt's bias epilogue, or a fill + beta = 1 where the epilogue has
// no kernel for the operands' alignment); beta must be 0 with a bias. fp32 in, fp32 out,
// CUBLAS_COMPUTE_32F: exact fp32 arithmetic, no TF32 -- unless ctx.operands is bf16 or fp16: then
// A and B are rounded to it (into stream-ordered temporary memory) and multiplied on the tensor
// cores with fp32 accumulation. A16, B16 (each may be null): A's or B's copy in that 16-bit type
// already (a weight or an activation bound to the ops, LayerOps::bind_half_copy), multiplied
// instead of rounding A or B.
void gemm_row_major(const GemmContext& ctx, bool trans_a, bool trans_b, int M, int N, int K, float alpha,
                    const float* A, int lda, long long stride_a, const float* B, int ldb, long long stride_b, float beta,
                    float* C, int ldc, long long stride_c, int batch, const float* bias, const uint16_t* A16 = nullptr,
                    const uint16_t* B16 = nullptr);
// LayerOps::gemm: one row-major C(M,N) = alpha * op(A) @ op(B) + beta * C with cblas_sgemm's
// contract (backend/cpu/gemm.hpp's gemm()): any alpha and beta (beta = 0: C is not read), leading
// dimensions at least the stored row lengths (ldc > N: C is a column slice of a wider matrix),
// K = 0 as C = beta * C without reading A or B. Always fp32 operands and CUBLAS_COMPUTE_32F (no
// TF32), whatever ctx.operands: the adapters' products, which must match the CPU closely.
void launch_gemm(const GemmContext& ctx, bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A,
                 int lda, const float* B, int ldb, float beta, float* C, int ldc);

// ---- layers ----------------------------------------------------------------------------------------
// Parameter gradients may be null (frozen parameters, or no position table), as on the CPU: dwte,
// dwpe, layernorm's dweight and dbias, rmsnorm's dweight, matmul's dweight and dbias (and matmul's
// dinp); a null one is neither computed nor written, and a launcher whose only outputs are null
// launches nothing and does not read its workspace.
// wpe / dwpe may be null: no position table (llama), the position part is skipped. positions (B,T)
// or nullptr: the wpe row of each token (nullptr: t).
void launch_encoder_forward(float* out, const int* tokens, const float* wte, const float* wpe, int B, int T, int C,
                            const int* positions, const LaunchContext& ctx);
size_t encoder_backward_workspace_bytes(int B, int T);
void launch_encoder_backward(float* dwte, float* dwpe, const float* dout, const int* tokens, int B, int T, int C,
                             const int* positions, void* workspace, const LaunchContext& ctx);

void launch_layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                              const float* bias, int N, int C, const LaunchContext& ctx);
using gpu::layernorm_backward_workspace_bytes;
void launch_layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                               const float* weight, const float* mean, const float* rstd, int N, int C,
                               void* workspace, const LaunchContext& ctx);

// RMSNorm (layernorm.cu): saves rstd(N); the backward's dinp and dweight are accumulated (+=).
void launch_rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, float eps, int N, int C,
                            const LaunchContext& ctx);
using gpu::rmsnorm_backward_workspace_bytes;
void launch_rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                             const float* rstd, int N, int C, void* workspace, const LaunchContext& ctx);

// inp16, weight16 (each may be null): the input's or the weight's copy in GemmContext::operands (a
// bound activation or weight), multiplied instead of rounding that operand; ignored with fp32
// operands. The backward reads inp16 only for dweight.
void launch_matmul_forward(float* out, const float* inp, const uint16_t* inp16, const float* weight,
                           const uint16_t* weight16, const float* bias, int N, int C, int OC, const GemmContext& ctx);
using gpu::matmul_backward_workspace_bytes;
void launch_matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                            const uint16_t* inp16, const float* weight, const uint16_t* weight16, int N, int C, int OC,
                            void* workspace, const GemmContext& ctx);

// Grouped-query attention, tiled (attention.cu): qkv rows q (NH heads) | k (KV heads) | v (KV
// heads) of HS each, NH % KV == 0, HS <= 256; lse (B,NH,T). The backward's workspace: B*NH*T floats.
// doc_start (B,T) in device memory, or nullptr: packed documents, as backend/cpu/ops.hpp says.
using gpu::attention_backward_workspace_bytes;
void launch_attention_forward(float* out, float* lse, const float* qkv, int B, int T, int NH, int KV, int HS,
                              const int* doc_start, const LaunchContext& ctx);
void launch_attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                               int B, int T, int NH, int KV, int HS, const int* doc_start, void* workspace,
                               const LaunchContext& ctx);

// cuDNN's packed documents (backend/cuda/cudnn_attention.cpp): the additive score bias (B,1,T,T)
// in bf16, 0 where key s is in query t's document (s >= doc_start[b][t]) and -inf elsewhere.
void launch_document_bias(uint16_t* bias, const int* doc_start, int B, int T, const LaunchContext& ctx);

// The same without the causal mask (every row sees every key; KV = NH, no documents): a diffusion
// transformer's joint attention, backend/cpu/ops.hpp's bidirectional_attention_*.
void launch_bidirectional_attention_forward(float* out, float* lse, const float* qkv, int B, int T, int NH, int HS,
                                            const LaunchContext& ctx);
void launch_bidirectional_attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                                             const float* lse, int B, int T, int NH, int HS, void* workspace,
                                             const LaunchContext& ctx);

// Generation: Q new tokens' q|k|v rows at positions start..start+Q-1; k, v appended to the caches
// (max_len, KV*HS), each query attending causally over the cache (its last `window` positions; 0:
// all); scratch Q*NH*(start+Q) floats.
void launch_attention_decode(float* out, float* scratch, float* k_cache, float* v_cache, const float* qkv, int Q,
                             int start, int NH, int KV, int HS, int window, const LaunchContext& ctx);

// Rotary embedding in place on the q and k heads of qkv (attention.cu); cos, sin: (T, HS/2) device
// tables; HS even. The backward turns dqkv back (the rotation's transpose). positions (B,T) or
// nullptr: each token's row of the tables (nullptr: t).
void launch_rope_forward(float* qkv, const float* cos, const float* sin, int B, int T, int NH, int KV, int HS,
                         const int* positions, const LaunchContext& ctx);
void launch_rope_backward(float* dqkv, const float* cos, const float* sin, int B, int T, int NH, int KV, int HS,
                          const int* positions, const LaunchContext& ctx);

// FLUX's rotary turn of interleaved pairs (x[2i], x[2i+1]) (attention.cu), rope_pairs_* of
// backend/cpu/ops.hpp; the tables' row is each token's t.
void launch_rope_pairs_forward(float* qkv, const float* cos, const float* sin, int B, int T, int NH, int KV, int HS,
                               const LaunchContext& ctx);
void launch_rope_pairs_backward(float* dqkv, const float* cos, const float* sin, int B, int T, int NH, int KV, int HS,
                                const LaunchContext& ctx);

// A diffusion transformer's layers (dit.cu), backend/cpu/ops.hpp's: adaptive LayerNorm (eps given,
// no affine; per-sample shift and scale rows `ld` apart; saves mean and rstd; the backward's dinp
// +=, dshift and dscale += per sample, either may be null), the gated residual (out may be resid;
// the backward's dy =, dgate += per sample, may be null), and the squared error of N rows of W
// (losses =, out_to_grad overwritten by 2 (out - target)). One warp per row for the row sums; the
// per-sample parameter sums are common.cuh's deterministic column sums over each sample's T rows
// (workspace: *_workspace_bytes(T, C), reused sample after sample). No atomics.
void launch_modulate_forward(float* out, float* mean, float* rstd, const float* inp, const float* shift,
                             const float* scale, int ld, int B, int T, int C, float eps, const LaunchContext& ctx);
using gpu::modulate_backward_workspace_bytes;
void launch_modulate_backward(float* dinp, float* dshift, float* dscale, const float* dout, const float* inp,
                              const float* scale, const float* mean, const float* rstd, int ld, int B, int T, int C,
                              void* workspace, const LaunchContext& ctx);
void launch_gate_forward(float* out, const float* resid, const float* y, const float* gate, int ld, int B, int T,
                         int C, const LaunchContext& ctx);
using gpu::gate_backward_workspace_bytes;
void launch_gate_backward(float* dy, float* dgate, const float* dout, const float* y, const float* gate, int ld,
                          int B, int T, int C, void* workspace, const LaunchContext& ctx);
void launch_squared_error_forward(float* losses, float* out_to_grad, const float* target, int N, int W,
                                  const LaunchContext& ctx);

// SwiGLU (pointwise.cu): gate_up rows gate (I) | up (I); the backward writes dgate_up (=).
void launch_swiglu_forward(float* out, const float* gate_up, int N, int I, const LaunchContext& ctx);
void launch_swiglu_backward(float* dgate_up, const float* dout, const float* gate_up, int N, int I,
                            const LaunchContext& ctx);

void launch_gelu_forward(float* out, const float* inp, size_t n, const LaunchContext& ctx);
void launch_gelu_backward(float* dinp, const float* dout, const float* inp, size_t n, const LaunchContext& ctx);
void launch_silu_forward(float* out, const float* inp, size_t n, const LaunchContext& ctx);
void launch_silu_backward(float* dinp, const float* dout, const float* inp, size_t n, const LaunchContext& ctx);
void launch_residual_forward(float* out, const float* a, const float* b, size_t n, const LaunchContext& ctx);
// x *= s
void launch_scale(float* x, size_t n, float s, const LaunchContext& ctx);
// Dropout (pointwise.cu), backend/cpu/ops.hpp's: out = keep ? inp / (1 - p) : 0 over N rows of C,
// the CPU's mask bit for bit; row_keys: N keys in device memory; out may be inp; p in [0, 1].
void launch_dropout(float* out, const float* inp, const uint64_t* row_keys, uint64_t site, int N, int C, float p,
                    const LaunchContext& ctx);

// DoRA's per-output-feature arithmetic (dora.cu; divide: pointwise.cu), backend/cpu/ops.hpp's:
// out[r] = sqrt(sum_c x[r*cols + c]^2), x dense (rows, cols);
// y[r*ld + c] = scale[c] * (y[r*ld + c] - shift[c]) + shift[c] in place, shift may be null (0);
// y[r*cols + c] = (scale[r] + offset) * y[r*cols + c] in place, y dense (rows, cols);
// out[c] += (sum_r a[r*lda + c] * b[r*ldb + c]) / divisor[c] (rows = 0: out[c] += 0 / divisor[c]);
// out[i] = a[i] / b[i] (out may be a or b). ld, lda, ldb >= cols: column slices of wider rows,
// 4-byte aligned suffices. Sums in double, deterministic (no atomics, fixed orders).
void launch_row_norms(float* out, const float* x, int rows, int cols, const LaunchContext& ctx);
void launch_column_affine(float* y, int ld, int rows, int cols, const float* scale, const float* shift,
                          const LaunchContext& ctx);
void launch_scale_rows(float* y, int rows, int cols, const float* scale, float offset, const LaunchContext& ctx);
using gpu::column_dot_accumulate_workspace_bytes;
void launch_column_dot_accumulate(float* out, const float* a, int lda, const float* b, int ldb, int rows, int cols,
                                  const float* divisor, void* workspace, const LaunchContext& ctx);
void launch_divide(float* out, const float* a, const float* b, size_t n, const LaunchContext& ctx);

// LoHa's and LoKr's weight deltas (kron.cu), backend/cpu/ops.hpp's multiply, kron and
// kron_backward: out[i] = (s * a[i]) * b[i] (out may be a or b); out (p*r, q*t) = kron(A (p, q),
// B (r, t)) with elements (s * A[i, j]) * B[k, l] -- both bit-identical to the CPU; dA (p, q) and dB
// (r, t) written (=), either may be null, each element a sum in double in a fixed order (a
// function of the shape), times s in double, rounded once. No workspace, no atomics.
void launch_multiply(float* out, const float* a, const float* b, size_t n, float s, const LaunchContext& ctx);
void launch_kron(float* out, const float* A, int p, int q, const float* B, int r, int t, float s,
                 const LaunchContext& ctx);
void launch_kron_backward(float* dA, float* dB, const float* dout, const float* A, int p, int q, const float* B, int r,
                          int t, float s, const LaunchContext& ctx);

void launch_softmax_crossentropy_forward(float* losses, float* logits_to_probs, const int* targets, int N, int V,
                                         const LaunchContext& ctx);
void launch_softmax_crossentropy_backward(float* probs_to_dlogits, const int* targets, float dloss, int N, int V,
                                          const LaunchContext& ctx);

// Knowledge distillation's fused loss (distill.cu), backend/cpu/ops.hpp's distill_loss_forward:
// losses (N) = alpha CE + (1 - alpha) T^2 KL(teacher_T || student_T), the student's logits (N,V)
// overwritten with the loss's gradient (not times dloss); teacher read only; targets in device
// memory. One block per row, the CPU's arithmetic (double row sums and per-element math, exp_fast
// in float) with fixed block-tree sums in place of the CPU's sequential ones. No workspace, no atomics.
void launch_distill_loss_forward(float* losses, float* student_to_grad, const float* teacher, const int* targets,
                                 int N, int V, float alpha, float temperature, const LaunchContext& ctx);

// ---- reductions to the host (reduce.cu) --------------------------------------------------------------
// `scratch`: reduce_scratch_bytes() of device memory; `host_result`: 8 bytes of (preferably pinned)
// host memory. Both belong to the caller; the launcher waits for the stream and returns the value.
using gpu::reduce_scratch_bytes;
double reduce_sum(const float* x, size_t n, void* scratch, void* host_result, const LaunchContext& ctx);
double reduce_sum_squares(const float* x, size_t n, void* scratch, void* host_result, const LaunchContext& ctx);
size_t reduce_count_nonfinite(const float* x, size_t n, void* scratch, void* host_result, const LaunchContext& ctx);
// *total (device memory) += the sum (of squares) of x, the value reduce_sum(_squares) returns; the
// host does not wait. `scratch` as above.
void accumulate_sum(double* total, const float* x, size_t n, void* scratch, const LaunchContext& ctx);
void accumulate_sum_squares(double* total, const float* x, size_t n, void* scratch, const LaunchContext& ctx);

// ---- 16-bit conversions and shard work (cast.cu, adamw.cu) -----------------------------------------
// out[i] = float_to_half(in[i], type), except +0 for i in [zero_begin, zero_end) (the NCCL wire's
// own slot, whose term is added later in fp32; empty by default). Every fp32 -> 16-bit rounding
// but round_to_half's (the same float_to_half).
void launch_to_half(uint16_t* out, const float* in, size_t n, DType type, const LaunchContext& ctx,
                    size_t zero_begin = 0, size_t zero_end = 0);
// The same for `rows` rows of `cols` floats into rows `ld` elements apart (padding not written).
void launch_to_half_rows(uint16_t* out, int ld, const float* in, int rows, int cols, DType type,
                         const LaunchContext& ctx);
void launch_from_half(float* out, const uint16_t* in, size_t n, DType type, const LaunchContext& ctx);
// LayerOps::round_to_half: values[i] rounded in place (float_to_half, then widened) and half[i] the
// 16-bit value (a null half: none kept), in one pass: the bits of launch_to_half then launch_from_half.
void launch_round_to_half(float* values, uint16_t* half, size_t n, DType type, const LaunchContext& ctx);
// ShardOps::dequantize_blocks: `blocks` quantized records into out (and, half non-null, half_type copies).
void launch_dequantize_blocks(float* out, uint16_t* half, DType half_type, const uint8_t* records, size_t blocks,
                              QuantType type, size_t block, const NestedScales& nested, const LaunchContext& ctx);
// ShardOps::adamw_multi: one launch, one block per segment (device-memory table), the multiplier
// from `sums` (device memory) in every thread, no update when adamw_grad_multiplier says so.
void launch_adamw_multi(const AdamWSegment* segments, size_t count, const double* sums, const AdamWClip& clip,
                        const AdamWStep& step, const LaunchContext& ctx);

}  // namespace shardtrain::kernels
