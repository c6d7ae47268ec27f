// LayerOps<float> and ShardOps on a CudaDevice (backend/cuda/cuda_backend.hpp): each method
// forwards to its launcher in kernels/launch.hpp (plain C++: this file needs no nvcc) on the
// device's compute stream, with the device's cuBLASLt handle and GEMM workspace. The semantics
// are backend/cpu/ops.hpp's.
//
// Temporary device memory (attention backward's per-row sums, the encoder's sort, the two-stage
// column sums of the norms and biases and of DoRA's magnitude gradient) comes from one workspace
// owned by the ops object, allocated from the device's caching allocator on first need and grown
// to the largest request so far; a backward whose parameter gradients are all null (frozen) asks
// for none. Reusing it across ops is safe because everything runs in order on the compute stream;
// growing it releases the old block to the allocator, whose reuse is ordered on that same stream
// (cuda_device.cpp).
// With 16-bit GEMM operands the weights come rounded: the engine binds each gathered unit's 16-bit
// copy (LayerOps::bind_half_copy) and matmul multiplies it; so does a model with 16-bit
// activations for its working activations, whose bound copies matmul multiplies as inputs and
// cuDNN's attention reads as its bf16 qkv and out. Whatever is not bound is rounded per GEMM.
// The reductions use a fixed device scratch and a pinned host word; those that return a value are
// the only methods that wait for the stream (accumulate_* leave theirs in device memory). An ops object must be destroyed before its device.
#include <memory>

#include "backend/cuda/cuda_backend.hpp"
#include "backend/cuda/cuda_handles.hpp"
#include "backend/cuda/cudnn_attention.hpp"
#include "backend/half_copies.hpp"
#include "kernels/cuda_check.hpp"
#include "kernels/launch.hpp"

namespace shardtrain {
namespace {

using kernels::GemmContext;
using kernels::LaunchContext;

LaunchContext launch_context(CudaDevice& device) {
  LaunchContext ctx;
  ctx.stream = cuda_stream(device.compute_stream());
  CUDA_CHECK(cudaDeviceGetAttribute(&ctx.sm_count, cudaDevAttrMultiProcessorCount, device.ordinal()));
  return ctx;
}

class CudaLayerOps final : public LayerOps<float> {
 public:
  CudaLayerOps(CudaDevice& device, DType gemm_operands, bool cudnn_attention) : device_(device) {
    gemm_.launch = launch_context(device);
    gemm_.operands = gemm_operands;
    gemm_.handle = device.cublaslt();
    gemm_.workspace = device.gemm_workspace();
    gemm_.workspace_bytes = device.gemm_workspace_bytes();
    gemm_.plans = plans_.get();
    gemm_.operand_scratch = [this](size_t bytes) { return grow(&operands_, &operands_bytes_, bytes); };
    reduce_scratch_ = device_.allocate(kernels::reduce_scratch_bytes());
    CUDA_CHECK(cudaMallocHost(&host_result_, sizeof(double)));
    if (cudnn_attention) cudnn_ = std::make_unique<CudnnAttention>(device);
  }
  ~CudaLayerOps() override {
    // Best effort, as CudaDevice's own teardown: queued work may still read the workspace.
    (void)cudaStreamSynchronize(gemm_.launch.stream);
    if (workspace_) device_.release(workspace_, workspace_bytes_);
    if (operands_) device_.release(operands_, operands_bytes_);
    device_.release(reduce_scratch_, kernels::reduce_scratch_bytes());
    if (host_result_) (void)cudaFreeHost(host_result_);
  }
  CudaLayerOps(const CudaLayerOps&) = delete;
  CudaLayerOps& operator=(const CudaLayerOps&) = delete;

  Device& device() const override { return device_; }

  void encoder_forward(float* out, const int* tokens, const float* wte, const float* wpe, int B, int T, int C,
                       const int* positions) const override {
    kernels::launch_encoder_forward(out, tokens, wte, wpe, B, T, C, positions, launch());
  }
  void encoder_backward(float* dwte, float* dwpe, const float* dout, const int* tokens, int B, int T, int C,
                        const int* positions) const override {
    // The sort of dwte's rows by token (and of dwpe's by position, when positions are given).
    void* ws = dwte || (dwpe && positions) ? workspace(kernels::encoder_backward_workspace_bytes(B, T)) : nullptr;
    kernels::launch_encoder_backward(dwte, dwpe, dout, tokens, B, T, C, positions, ws, launch());
  }
  void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                         const float* bias, int N, int C) const override {
    kernels::launch_layernorm_forward(out, mean, rstd, inp, weight, bias, N, C, launch());
  }
  void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                          const float* weight, const float* mean, const float* rstd, int N, int C) const override {
    void* ws = dweight || dbias ? workspace(kernels::layernorm_backward_workspace_bytes(N, C)) : nullptr;
    kernels::launch_layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, ws, launch());
  }
  void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int N, int C,
                      int OC) const override {
    kernels::launch_matmul_forward(out, inp, gemm_operand_copy(inp, N, C), weight, gemm_operand_copy(weight, OC, C),
                                   bias, N, C, OC, gemm_);
  }
  void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                       const float* weight, int N, int C, int OC) const override {
    void* ws = dbias ? workspace(kernels::matmul_backward_workspace_bytes(N, OC)) : nullptr;
    kernels::launch_matmul_backward(dinp, dweight, dbias, dout, inp, gemm_operand_copy(inp, N, C), weight,
                                    gemm_operand_copy(weight, OC, C), N, C, OC, ws, gemm_);
  }
  void gemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda, const float* B,
            int ldb, float beta, float* C, int ldc) const override {
    kernels::launch_gemm(gemm_, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);  // fp32 always
  }
  void documents_changed(const int* doc_start) const override {
    if (cudnn_) cudnn_->documents_changed(doc_start);
  }
  // Packed documents (doc_start) too: cuDNN's graph adds their score bias.
  void attention_forward(float* out, float* lse, const float* qkv, int B, int T, int NH, int KV, int HS,
                         const int* doc_start) const override {
    if (cudnn_forward(out, lse, qkv, B, T, NH, KV, HS, true, doc_start)) return;
    kernels::launch_attention_forward(out, lse, qkv, B, T, NH, KV, HS, doc_start, launch());
  }
  void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse, int B,
                          int T, int NH, int KV, int HS, const int* doc_start) const override {
    if (cudnn_backward(dqkv, dout, qkv, out, lse, B, T, NH, KV, HS, true, doc_start)) return;
    void* ws = workspace(kernels::attention_backward_workspace_bytes(B, T, NH, KV, HS));  // each row's D
    kernels::launch_attention_backward(dqkv, dout, qkv, out, lse, B, T, NH, KV, HS, doc_start, ws, launch());
  }
  void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, float eps, int N,
                       int C) const override {
    kernels::launch_rmsnorm_forward(out, rstd, inp, weight, eps, N, C, launch());
  }
  void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                        const float* rstd, int N, int C) const override {
    void* ws = dweight ? workspace(kernels::rmsnorm_backward_workspace_bytes(N, C)) : nullptr;
    kernels::launch_rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, N, C, ws, launch());
  }
  void attention_decode(float* out, float* scratch, float* k_cache, float* v_cache, const float* qkv, int Q,
                        int start, int NH, int KV, int HS, int window) const override {
    kernels::launch_attention_decode(out, scratch, k_cache, v_cache, qkv, Q, start, NH, KV, HS, window, launch());
  }
  void rope_forward(float* qkv, const float* cos, const float* sin, int B, int T, int NH, int KV, int HS,
                    const int* positions) const override {
    kernels::launch_rope_forward(qkv, cos, sin, B, T, NH, KV, HS, positions, launch());
  }
  void rope_backward(float* dqkv, const float* cos, const float* sin, int B, int T, int NH, int KV, int HS,
                     const int* positions) const override {
    kernels::launch_rope_backward(dqkv, cos, sin, B, T, NH, KV, HS, positions, launch());
  }
  // A diffusion transformer's layers; its unmasked attention on cuDNN's graph without the mask
  // when train.attention picks cuDNN, else on the tiled kernels.
  void bidirectional_attention_forward(float* out, float* lse, const float* qkv, int B, int T, int NH,
                                       int HS) const override {
    if (cudnn_forward(out, lse, qkv, B, T, NH, NH, HS, false)) return;
    kernels::launch_bidirectional_attention_forward(out, lse, qkv, B, T, NH, HS, launch());
  }
  void bidirectional_attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                                        const float* lse, int B, int T, int NH, int HS) const override {
    if (cudnn_backward(dqkv, dout, qkv, out, lse, B, T, NH, NH, HS, false)) return;
    void* ws = workspace(kernels::attention_backward_workspace_bytes(B, T, NH, NH, HS));  // each row's D
    kernels::launch_bidirectional_attention_backward(dqkv, dout, qkv, out, lse, B, T, NH, HS, ws, launch());
  }
  void rope_pairs_forward(float* qkv, const float* cos, const float* sin, int B, int T, int NH, int KV,
                          int HS) const override {
    kernels::launch_rope_pairs_forward(qkv, cos, sin, B, T, NH, KV, HS, launch());
  }
  void rope_pairs_backward(float* dqkv, const float* cos, const float* sin, int B, int T, int NH, int KV,
                           int HS) const override {
    kernels::launch_rope_pairs_backward(dqkv, cos, sin, B, T, NH, KV, HS, launch());
  }
  void modulate_forward(float* out, float* mean, float* rstd, const float* inp, const float* shift,
                        const float* scale, int ld, int B, int T, int C, float eps) const override {
    kernels::launch_modulate_forward(out, mean, rstd, inp, shift, scale, ld, B, T, C, eps, launch());
  }
  void modulate_backward(float* dinp, float* dshift, float* dscale, const float* dout, const float* inp,
                         const float* scale, const float* mean, const float* rstd, int ld, int B, int T,
                         int C) const override {
    void* ws = dshift || dscale ? workspace(kernels::modulate_backward_workspace_bytes(T, C)) : nullptr;
    kernels::launch_modulate_backward(dinp, dshift, dscale, dout, inp, scale, mean, rstd, ld, B, T, C, ws, launch());
  }
  void gate_forward(float* out, const float* resid, const float* y, const float* gate, int ld, int B, int T,
                    int C) const override {
    kernels::launch_gate_forward(out, resid, y, gate, ld, B, T, C, launch());
  }
  void gate_backward(float* dy, float* dgate, const float* dout, const float* y, const float* gate, int ld, int B,
                     int T, int C) const override {
    void* ws = dgate ? workspace(kernels::gate_backward_workspace_bytes(T, C)) : nullptr;
    kernels::launch_gate_backward(dy, dgate, dout, y, gate, ld, B, T, C, ws, launch());
  }
  void silu_forward(float* out, const float* inp, size_t n) const override {
    kernels::launch_silu_forward(out, inp, n, launch());
  }
  void silu_backward(float* dinp, const float* dout, const float* inp, size_t n) const override {
    kernels::launch_silu_backward(dinp, dout, inp, n, launch());
  }
  void squared_error_forward(float* losses, float* out_to_grad, const float* target, int N, int W) const override {
    kernels::launch_squared_error_forward(losses, out_to_grad, target, N, W, launch());
  }
  void copy_rows(float* dst, int ld_dst, const float* src, int ld_src, int rows, int cols) const override {
    SHARD_CHECK(rows >= 0 && cols >= 0 && ld_dst >= cols && ld_src >= cols, "copy_rows: rows=%d cols=%d ld %d, %d",
                rows, cols, ld_dst, ld_src);
    if (rows == 0 || cols == 0) return;
    CUDA_CHECK(cudaMemcpy2DAsync(dst, ld_dst * sizeof(float), src, ld_src * sizeof(float), cols * sizeof(float), rows,
                                 cudaMemcpyDeviceToDevice, launch().stream));
  }
  void swiglu_forward(float* out, const float* gate_up, int N, int I) const override {
    kernels::launch_swiglu_forward(out, gate_up, N, I, launch());
  }
  void swiglu_backward(float* dgate_up, const float* dout, const float* gate_up, int N, int I) const override {
    kernels::launch_swiglu_backward(dgate_up, dout, gate_up, N, I, launch());
  }
  void gelu_forward(float* out, const float* inp, size_t n) const override {
    kernels::launch_gelu_forward(out, inp, n, launch());
  }
  void gelu_backward(float* dinp, const float* dout, const float* inp, size_t n) const override {
    kernels::launch_gelu_backward(dinp, dout, inp, n, launch());
  }
  void residual_forward(float* out, const float* a, const float* b, size_t n) const override {
    kernels::launch_residual_forward(out, a, b, n, launch());
  }
  void row_norms(float* out, const float* x, int rows, int cols) const override {
    kernels::launch_row_norms(out, x, rows, cols, launch());
  }
  void column_affine(float* y, int ld, int rows, int cols, const float* scale, const float* shift) const override {
    kernels::launch_column_affine(y, ld, rows, cols, scale, shift, launch());
  }
  void scale_rows(float* y, int rows, int cols, const float* scale, float offset) const override {
    kernels::launch_scale_rows(y, rows, cols, scale, offset, launch());
  }
  void column_dot_accumulate(float* out, const float* a, int lda, const float* b, int ldb, int rows, int cols,
                             const float* divisor) const override {
    void* ws = cols > 0 ? workspace(kernels::column_dot_accumulate_workspace_bytes(rows, cols)) : nullptr;  // partials
    kernels::launch_column_dot_accumulate(out, a, lda, b, ldb, rows, cols, divisor, ws, launch());
  }
  void divide(float* out, const float* a, const float* b, size_t n) const override {
    kernels::launch_divide(out, a, b, n, launch());
  }
  void multiply(float* out, const float* a, const float* b, size_t n, float s) const override {
    kernels::launch_multiply(out, a, b, n, s, launch());
  }
  void kron(float* out, const float* A, int p, int q, const float* B, int r, int t, float s) const override {
    kernels::launch_kron(out, A, p, q, B, r, t, s, launch());
  }
  void kron_backward(float* dA, float* dB, const float* dout, const float* A, int p, int q, const float* B, int r,
                     int t, float s) const override {
    kernels::launch_kron_backward(dA, dB, dout, A, p, q, B, r, t, s, launch());
  }
  void dropout(float* out, const float* inp, const uint64_t* row_keys, uint64_t site, int N, int C,
               float p) const override {
    kernels::launch_dropout(out, inp, row_keys, site, N, C, p, launch());
  }
  void softmax_crossentropy_forward(float* losses, float* logits_to_probs, const int* targets, int N,
                                    int V) const override {
    kernels::launch_softmax_crossentropy_forward(losses, logits_to_probs, targets, N, V, launch());
  }
  void softmax_crossentropy_backward(float* probs_to_dlogits, const int* targets, float dloss, int N,
                                     int V) const override {
    kernels::launch_softmax_crossentropy_backward(probs_to_dlogits, targets, dloss, N, V, launch());
  }
  void distill_loss_forward(float* losses, float* student_to_grad, const float* teacher, const int* targets, int N,
                            int V, float alpha, float temperature) const override {
    kernels::launch_distill_loss_forward(losses, student_to_grad, teacher, targets, N, V, alpha, temperature, launch());
  }

  double sum(const float* x, size_t n) const override {
    device_.count_host_sync();
    return kernels::reduce_sum(x, n, reduce_scratch_, host_result_, launch());
  }
  double sum_squares(const float* x, size_t n) const override {
    device_.count_host_sync();
    return kernels::reduce_sum_squares(x, n, reduce_scratch_, host_result_, launch());
  }
  size_t count_nonfinite(const float* x, size_t n) const override {
    device_.count_host_sync();
    return kernels::reduce_count_nonfinite(x, n, reduce_scratch_, host_result_, launch());
  }
  void accumulate_sum(double* total, const float* x, size_t n) const override {
    kernels::accumulate_sum(total, x, n, reduce_scratch_, launch());
  }
  void accumulate_sum_squares(double* total, const float* x, size_t n) const override {
    kernels::accumulate_sum_squares(total, x, n, reduce_scratch_, launch());
  }
  void scale(float* x, size_t n, float s) const override { kernels::launch_scale(x, n, s, launch()); }
  void round_to_half(float* values, uint16_t* half, size_t n, DType type) const override {
    kernels::launch_round_to_half(values, half, n, type, launch());
  }
  void widen_half(float* values, const uint16_t* half, size_t n, DType type) const override {
    kernels::launch_from_half(values, half, n, type, launch());
  }
  void bind_half_copy(const float* values, const uint16_t* half, size_t n, DType type) const override {
    half_copies_.bind(values, half, n, type);
  }
  void unbind_half_copy(const float* values) const override { half_copies_.unbind(values); }
  bool multiplies_half_copies(DType type) const override { return gemm_.operands == type; }
  void copy_operand(float* dst, const float* src, size_t n) const override {
    if (const uint16_t* half = gemm_.operands == DTYPE_FP32 ? nullptr : half_copies_.find(src, n, gemm_.operands))
      return kernels::launch_from_half(dst, half, n, gemm_.operands, launch());
    device().copy_on_device(dst, src, n * sizeof(float));
  }

 private:
  // The bound 16-bit copy of a GEMM operand (rows x cols: a weight or an input) in the GEMMs' operand
  // type, or null (fp32 GEMMs, or not bound).
  const uint16_t* gemm_operand_copy(const float* operand, int rows, int cols) const {
    if (gemm_.operands == DTYPE_FP32) return nullptr;
    return half_copies_.find(operand, static_cast<size_t>(rows) * cols, gemm_.operands);
  }
  // The bound bf16 copy of [values, values + n), or null: cuDNN's attention takes bf16 whatever
  // the GEMMs' operand type.
  const uint16_t* bf16_copy(const float* values, size_t n) const { return half_copies_.find(values, n, DTYPE_BF16); }
  static size_t qkv_elements(int B, int T, int NH, int KV, int HS) {
    return static_cast<size_t>(B) * T * (NH + 2 * KV) * HS;
  }
  const LaunchContext& launch() const { return gemm_.launch; }
  // cuDNN's attention with the bf16 copies bound to the ops (false: no cuDNN here, or no plan for
  // the shape; the caller runs the tiled kernels).
  bool cudnn_forward(float* out, float* lse, const float* qkv, int B, int T, int NH, int KV, int HS, bool causal,
                     const int* doc_start = nullptr) const {
    return cudnn_ && cudnn_->forward(out, lse, qkv, B, T, NH, KV, HS, bf16_copy(qkv, qkv_elements(B, T, NH, KV, HS)),
                                     causal, doc_start);
  }
  bool cudnn_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse, int B,
                      int T, int NH, int KV, int HS, bool causal, const int* doc_start = nullptr) const {
    return cudnn_ && cudnn_->backward(dqkv, dout, qkv, out, lse, B, T, NH, KV, HS,
                                      bf16_copy(qkv, qkv_elements(B, T, NH, KV, HS)),
                                      bf16_copy(out, static_cast<size_t>(B) * T * NH * HS), causal, doc_start);
  }

  // At least `bytes` of device memory, valid until the next call (stream-ordered reuse).
  void* workspace(size_t bytes) const { return grow(&workspace_, &workspace_bytes_, bytes); }

  // A grow-only buffer: the old block goes back to the cache, whose reuse is ordered on the same
  // compute stream as every use of it.
  void* grow(void** buffer, size_t* size, size_t bytes) const {
    if (bytes > *size) {
      if (*buffer) device_.release(*buffer, *size);
      *buffer = nullptr;
      *size = 0;
      *buffer = device_.allocate(bytes);
      *size = bytes;
    }
    return *buffer;
  }

  CudaDevice& device_;
  std::unique_ptr<kernels::GemmPlanCache, kernels::GemmPlanCacheDeleter> plans_ = kernels::make_gemm_plan_cache();
  GemmContext gemm_;
  void* reduce_scratch_ = nullptr;
  void* host_result_ = nullptr;
  mutable void* workspace_ = nullptr;
  mutable size_t workspace_bytes_ = 0;
  mutable void* operands_ = nullptr;  // the 16-bit GEMM operand copies (GemmContext::operand_scratch)
  mutable size_t operands_bytes_ = 0;
  std::unique_ptr<CudnnAttention> cudnn_;  // train.attention=cudnn; null: the tiled kernels
  mutable HalfCopies half_copies_;         // gathered 16-bit units and 16-bit activations (bind_half_copy)
};

class CudaShardOps final : public ShardOps {
 public:
  explicit CudaShardOps(CudaDevice& device) : launch_(launch_context(device)) {}

  void to_half(uint16_t* out, const float* in, size_t n, DType type) const override {
    kernels::launch_to_half(out, in, n, type, launch_);
  }
  void from_half(float* out, const uint16_t* in, size_t n, DType type) const override {
    kernels::launch_from_half(out, in, n, type, launch_);
  }
  void dequantize_blocks(float* out, uint16_t* half, DType half_type, const uint8_t* records, size_t blocks,
                         QuantType type, size_t block, const NestedScales& nested) const override {
    kernels::launch_dequantize_blocks(out, half, half_type, records, blocks, type, block, nested, launch_);
  }
  void adamw_multi(const AdamWSegment* segments, size_t count, const double* sums, const AdamWClip& clip,
                   const AdamWStep& step) const override {
    kernels::launch_adamw_multi(segments, count, sums, clip, step, launch_);
  }

 private:
  LaunchContext launch_;
};

}  // namespace

std::unique_ptr<LayerOps<float>> make_cuda_layer_ops(CudaDevice& device, DType gemm_operands, bool cudnn_attention) {
  return std::make_unique<CudaLayerOps>(device, gemm_operands, cudnn_attention);
}

std::unique_ptr<ShardOps> make_cuda_shard_ops(CudaDevice& device) { return std::make_unique<CudaShardOps>(device); }

}  // namespace shardtrain
