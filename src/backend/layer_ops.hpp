// The operations the model, the FSDP engine and the optimizer run on device buffers: one
// interface, two implementations -- the CPU backend (backend/cpu/, OpenBLAS + OpenMP, for float
// and double) and the CUDA backend (kernels/, cuBLASLt + hand-written kernels, for float).
// Every pointer is memory of the backend's device() (DeviceArray data), except where a comment
// says host. The layer operations have exactly the semantics, argument order and accumulation
// rules of backend/cpu/ops.hpp, which documents them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include "backend/device.hpp"
#include "backend/dtype.hpp"
#include "backend/math.hpp"
#include "backend/quant.hpp"

namespace shardtrain {

// A linear layer's weight shape (out x in): what the backends size GEMM workspaces from.
struct LinearShape {
  int in = 0, out = 0;
};

// What a backend that lacks a layer throws when a model calls it.
struct MissingOp : std::runtime_error {
  using std::runtime_error::runtime_error;
};

template <typename Real>
class LayerOps {
 public:
  virtual ~LayerOps() = default;
  virtual Device& device() const = 0;

 protected:
  [[noreturn]] static void missing_op(const char* op) {
    throw MissingOp(std::string("this compute backend has no ") + op +
                    " layer (a diffusion transformer's): train this model on the CPU backend (train.device=cpu)");
  }

 public:

  // Layers (backend/cpu/ops.hpp). attention_forward saves lse (B*NH*T elements: O(T) memory, no
  // T x T probabilities); attention_backward takes it and the forward's out.
  // Null gradients (frozen parameters): dwte and dwpe of encoder_backward, dweight and dbias of
  // layernorm_backward and matmul_backward, dweight of rmsnorm_backward each may be null -- then
  // neither computed nor touched, and every other output the same bits as with it; matmul's
  // dinp may be null too (no input gradient wanted).
  // positions (B,T) in device memory: the row of wpe (or of the rope tables) each token takes;
  // nullptr: its place t in the sequence (data.restart_positions sets them per packed document).
  virtual void encoder_forward(Real* out, const int* tokens, const Real* wte, const Real* wpe, int B, int T, int C,
                               const int* positions) const = 0;
  virtual void encoder_backward(Real* dwte, Real* dwpe, const Real* dout, const int* tokens, int B, int T, int C,
                                const int* positions) const = 0;
  virtual void layernorm_forward(Real* out, Real* mean, Real* rstd, const Real* inp, const Real* weight,
                                 const Real* bias, int N, int C) const = 0;
  virtual void layernorm_backward(Real* dinp, Real* dweight, Real* dbias, const Real* dout, const Real* inp,
                                  const Real* weight, const Real* mean, const Real* rstd, int N, int C) const = 0;
  virtual void matmul_forward(Real* out, const Real* inp, const Real* weight, const Real* bias, int N, int C,
                              int OC) const = 0;
  virtual void matmul_backward(Real* dinp, Real* dweight, Real* dbias, const Real* dout, const Real* inp,
                               const Real* weight, int N, int C, int OC) const = 0;
  // Row-major C(M,N) = alpha op(A) op(B) + beta C, leading dimensions given: the adapters'
  // products (model/lora.hpp), whose outputs and output gradients are column slices of a fused
  // product (ldc > N). op(X) = X^T where trans_X.
  virtual void gemm(bool trans_a, bool trans_b, int M, int N, int K, Real alpha, const Real* A, int lda,
                    const Real* B, int ldb, Real beta, Real* C, int ldc) const = 0;
  // doc_start(B,T) in device memory, or nullptr: packed documents, each row attending within its
  // own (backend/cpu/ops.hpp).
  virtual void attention_forward(Real* out, Real* lse, const Real* qkv, int B, int T, int NH, int KV, int HS,
                                 const int* doc_start) const = 0;
  virtual void attention_backward(Real* dqkv, const Real* dout, const Real* qkv, const Real* out, const Real* lse,
                                  int B, int T, int NH, int KV, int HS, const int* doc_start) const = 0;
  // Llama's layers. cos, sin: rope tables (T, HS/2) in device memory.
  virtual void rmsnorm_forward(Real* out, Real* rstd, const Real* inp, const Real* weight, Real eps, int N,
                               int C) const = 0;
  virtual void rmsnorm_backward(Real* dinp, Real* dweight, const Real* dout, const Real* inp, const Real* weight,
                                const Real* rstd, int N, int C) const = 0;
  virtual void rope_forward(Real* qkv, const Real* cos, const Real* sin, int B, int T, int NH, int KV, int HS,
                            const int* positions) const = 0;
  virtual void rope_backward(Real* dqkv, const Real* cos, const Real* sin, int B, int T, int NH, int KV, int HS,
                             const int* positions) const = 0;
  // Generation with a key/value cache (backend/cpu/ops.hpp): Q new tokens' q|k|v rows appended to
  // the cache and attended causally over it (over its last `window` positions; 0: all of it).
  // `scratch`: Q*NH*(start+Q) elements. Not pure: a backend that does not generate (a test's
  // counting stand-in) need not provide it.
  virtual void attention_decode(Real* out, Real* scratch, Real* k_cache, Real* v_cache, const Real* qkv, int Q,
                                int start, int NH, int KV, int HS, int window) const = 0;
  virtual void swiglu_forward(Real* out, const Real* gate_up, int N, int I) const = 0;
  virtual void swiglu_backward(Real* dgate_up, const Real* dout, const Real* gate_up, int N, int I) const = 0;
  virtual void gelu_forward(Real* out, const Real* inp, size_t n) const = 0;
  virtual void gelu_backward(Real* dinp, const Real* dout, const Real* inp, size_t n) const = 0;
  virtual void residual_forward(Real* out, const Real* a, const Real* b, size_t n) const = 0;
  // A diffusion transformer's layers (model/families/flux; exact rules in backend/cpu/ops.hpp):
  // attention over every position (no causal mask), the rotary turn of interleaved pairs,
  // adaptive LayerNorm with per-sample shift and scale rows `ld` apart, gated residuals, SiLU, the
  // squared error of a regression head, and a strided row copy. Not pure: a backend without them
  // refuses such a model when it runs one (MissingOp).
  virtual void bidirectional_attention_forward(Real* out, Real* lse, const Real* qkv, int B, int T, int NH,
                                               int HS) const {
    missing_op("bidirectional attention");
  }
  virtual void bidirectional_attention_backward(Real* dqkv, const Real* dout, const Real* qkv, const Real* out,
                                                const Real* lse, int B, int T, int NH, int HS) const {
    missing_op("bidirectional attention");
  }
  virtual void rope_pairs_forward(Real* qkv, const Real* cos, const Real* sin, int B, int T, int NH, int KV,
                                  int HS) const {
    missing_op("rope_pairs");
  }
  virtual void rope_pairs_backward(Real* dqkv, const Real* cos, const Real* sin, int B, int T, int NH, int KV,
                                   int HS) const {
    missing_op("rope_pairs");
  }
  virtual void modulate_forward(Real* out, Real* mean, Real* rstd, const Real* inp, const Real* shift,
                                const Real* scale, int ld, int B, int T, int C, Real eps) const {
    missing_op("modulate");
  }
  virtual void modulate_backward(Real* dinp, Real* dshift, Real* dscale, const Real* dout, const Real* inp,
                                 const Real* scale, const Real* mean, const Real* rstd, int ld, int B, int T,
                                 int C) const {
    missing_op("modulate");
  }
  virtual void gate_forward(Real* out, const Real* resid, const Real* y, const Real* gate, int ld, int B, int T,
                            int C) const {
    missing_op("gate");
  }
  virtual void gate_backward(Real* dy, Real* dgate, const Real* dout, const Real* y, const Real* gate, int ld, int B,
                             int T, int C) const {
    missing_op("gate");
  }
  virtual void silu_forward(Real* out, const Real* inp, size_t n) const { missing_op("silu"); }
  virtual void silu_backward(Real* dinp, const Real* dout, const Real* inp, size_t n) const { missing_op("silu"); }
  virtual void squared_error_forward(Real* losses, Real* out_to_grad, const Real* target, int N, int W) const {
    missing_op("squared_error");
  }
  virtual void copy_rows(Real* dst, int ld_dst, const Real* src, int ld_src, int rows, int cols) const {
    missing_op("copy_rows");
  }

  // DoRA's per-output-feature arithmetic (backend/cpu/ops.hpp): row norms of a dense matrix, a
  // column-wise affine map, a row-wise scale and a column-wise dot product over a strided slice, a
  // quotient.
  virtual void row_norms(Real* out, const Real* x, int rows, int cols) const = 0;
  virtual void column_affine(Real* y, int ld, int rows, int cols, const Real* scale, const Real* shift) const = 0;
  virtual void scale_rows(Real* y, int rows, int cols, const Real* scale, Real offset) const = 0;
  virtual void column_dot_accumulate(Real* out, const Real* a, int lda, const Real* b, int ldb, int rows, int cols,
                                     const Real* divisor) const = 0;
  virtual void divide(Real* out, const Real* a, const Real* b, size_t n) const = 0;
  // LoHa's and LoKr's weight deltas (model/delta_adapters.hpp); exact rules in backend/cpu/ops.hpp.
  // out[i] = s * a[i] * b[i] for i < n (out may be a or b).
  virtual void multiply(Real* out, const Real* a, const Real* b, size_t n, Real s) const = 0;
  // Row-major Kronecker product: out (p*r, q*t) = s * kron(A (p, q), B (r, t)), i.e.
  // out[(i*r + k) * (q*t) + j*t + l] = s * A[i*q + j] * B[k*t + l].
  virtual void kron(Real* out, const Real* A, int p, int q, const Real* B, int r, int t, Real s) const = 0;
  // Its gradients given dout (p*r, q*t), both overwritten (not accumulated; either may be null):
  //   dA[i, j] = s * sum_{k,l} dout[(i*r+k), (j*t+l)] * B[k, l];
  //   dB[k, l] = s * sum_{i,j} dout[(i*r+k), (j*t+l)] * A[i, j].
  virtual void kron_backward(Real* dA, Real* dB, const Real* dout, const Real* A, int p, int q, const Real* B, int r,
                             int t, Real s) const = 0;
  // Dropout of N rows of C keyed by the counter RNG (backend/cpu/ops.hpp): out = keep ? inp / (1 - p)
  // : 0, keep(r, c) a pure function of (row_keys[r], site, c, p), the same mask on every backend.
  // row_keys: N keys in the device's memory. In place (out == inp) allowed; p in [0, 1], p = 0 the
  // identity. Backward: the same call (same row_keys, site, p) on the output gradient.
  virtual void dropout(Real* out, const Real* inp, const uint64_t* row_keys, uint64_t site, int N, int C,
                       float p) const = 0;
  virtual void softmax_crossentropy_forward(Real* losses, Real* logits_to_probs, const int* targets, int N,
                                            int V) const = 0;
  virtual void softmax_crossentropy_backward(Real* probs_to_dlogits, const int* targets, Real dloss, int N,
                                             int V) const = 0;
  // Knowledge distillation (docs/distillation.md) on N rows of V logits, temperature T > 0 and
  // weight alpha in [0, 1]: each row's loss
  //   losses[r] = alpha * CE(softmax(s), target) + (1 - alpha) * T^2 * KL(softmax(t / T) || softmax(s / T))
  // and, in place of the student's logits s, the gradient of losses[r] with respect to them,
  //   alpha * (softmax(s) - onehot(target)) + (1 - alpha) * T * (softmax(s / T) - softmax(t / T)),
  // which the caller scales by its dloss (LayerOps::scale). teacher (t) is read only. Row statistics
  // (max, log-sum-exp, the KL sum) in at least fp32 with max-subtraction; KL uses log-probabilities,
  // so a teacher probability that underflows to 0 contributes 0, never NaN.
  virtual void distill_loss_forward(Real* losses, Real* student_to_grad, const Real* teacher, const int* targets,
                                    int N, int V, Real alpha, Real temperature) const = 0;

  // Reductions, returned to the host (a host synchronization, counted on device()), in an order
  // fixed by n alone -- not by threads -- so deterministic (CPU, in double: sum sequential;
  // sum_squares sequential within blocks of 4096 elements, then over the blocks in order. CUDA: a
  // fixed tree, not the CPU's bits).
  virtual double sum(const Real* x, size_t n) const = 0;
  virtual double sum_squares(const Real* x, size_t n) const = 0;
  // Elements that are inf or NaN.
  virtual size_t count_nonfinite(const Real* x, size_t n) const = 0;
  // The same sums added to *total, one double in the device's memory, without the host waiting:
  // the step's loss and gradient norm stay on the device until the step ends. The added value has
  // the bits sum() / sum_squares() return.
  virtual void accumulate_sum(double* total, const Real* x, size_t n) const = 0;
  virtual void accumulate_sum_squares(double* total, const Real* x, size_t n) const = 0;
  // x *= s
  virtual void scale(Real* x, size_t n, Real s) const = 0;

  // 16-bit activation storage (fsdp.activation_dtype, model/saved_activations.hpp): values[i]
  // rounded to `type` in place (round to nearest even as backend/dtype.hpp) and the 16-bit value
  // written to half[i], so that afterwards values[i] == widen(half[i]). One pass. A null half: the
  // rounding alone (a recomputed activation, whose copy checkpointing does not keep).
  virtual void round_to_half(Real* values, uint16_t* half, size_t n, DType type) const = 0;
  // values[i] = widen(half[i]).
  virtual void widen_half(Real* values, const uint16_t* half, size_t n, DType type) const = 0;

  // "Operands rounded once": a 16-bit copy of an fp32 buffer. While [values, values + n) is bound,
  // the caller guarantees values[i] == widen(half[i]) whenever an op reads it, and a
  // matmul_forward/backward whose weight or input lies inside it multiplies that copy instead of
  // rounding the operand again -- the same bits, without the rounding pass or its copy. Ops whose
  // GEMMs do not take 16-bit operands of `type` ignore it. The engine binds each gathered-unit
  // buffer of a 16-bit param_dtype for the buffer's life (shard/fsdp_engine.hpp); a model with
  // 16-bit activations binds its working activations to the current layer's saved copies
  // (model/saved_activations.hpp). Binding again replaces.
  virtual void bind_half_copy(const Real* values, const uint16_t* half, size_t n, DType type) const {
    (void)values, (void)half, (void)n, (void)type;
  }
  virtual void unbind_half_copy(const Real* values) const { (void)values; }
  // Whether matmul_forward/backward multiply a bound copy of `type` itself, never reading the fp32
  // values beside it -- which may then be addresses only (EngineOptions::linear_weights_in_half_only).
  virtual bool multiplies_half_copies(DType type) const {
    (void)type;
    return false;
  }
  // dst[0, n) = the values the ops see at src: the widening of its bound 16-bit copy where one is
  // bound (src's own values may be addresses only), else src's values. For the few products on a
  // base weight outside matmul (DoRA's norms, OFT's rotation), which LayerOps::gemm takes in fp32.
  virtual void copy_operand(Real* dst, const Real* src, size_t n) const {
    device().copy_on_device(dst, src, n * sizeof(Real));
  }
  // The packed documents' starts at doc_start (the attention's argument, device memory) were just
  // rewritten (a new micro-batch): whatever the ops derived from them is stale. Ops that keep
  // nothing ignore it (CUDA's cuDNN attention keeps the documents' score bias).
  virtual void documents_changed(const int* doc_start) const { (void)doc_start; }
};

// fp32-only work of the engine and optimizer: 16-bit wire/parameter formats and the AdamW step.
class ShardOps {
 public:
  virtual ~ShardOps() = default;
  // out[i] = round(in[i]) to `type` (bf16 or fp16, round to nearest even as backend/dtype.hpp).
  virtual void to_half(uint16_t* out, const float* in, size_t n, DType type) const = 0;
  virtual void from_half(float* out, const uint16_t* in, size_t n, DType type) const = 0;
  // A gathered quantized space (backend/quant.hpp): `blocks` records of `block` elements each into
  // out[b * block + i], and with a 16-bit `half` (non-null) their rounding to half_type into half,
  // out then being its widening (what LayerOps::bind_half_copy requires of a bound buffer). A null
  // `out` writes the 16-bit copy alone (EngineOptions::linear_weights_in_half_only). Under double
  // quantization `nested` is the unit's nested table in the same memory (else empty).
  virtual void dequantize_blocks(float* out, uint16_t* half, DType half_type, const uint8_t* records, size_t blocks,
                                 QuantType type, size_t block, const NestedScales& nested) const {
    throw MissingOp("this compute backend has no dequantization kernels: a quantized frozen base "
                    "(fsdp.frozen_dtype) cannot be gathered on it");
  }
  // The whole AdamW step in one launch: for every segment (a table of `count` entries in the
  // device's memory, each at most kAdamWSegmentElements) and i in [0, n), adamw_update(&param[i],
  // &m[i], &v[i], grad[i] * multiplier, decay, step), with the multiplier adamw_grad_multiplier
  // computes from `sums` (two doubles in the device's memory) -- or no update at all when it says
  // the step is not finite. The host reads nothing: no synchronization.
  virtual void adamw_multi(const AdamWSegment* segments, size_t count, const double* sums, const AdamWClip& clip,
                           const AdamWStep& step) const = 0;
};

// What the engine, optimizer and trainer compute with: a device and its fp32 operations, and
// the host memory beside it with the operations on that memory (where fsdp.cpu_offload keeps
// and steps the master shards).
struct Backend {
  Device* device = nullptr;
  Device* host = nullptr;  // host memory the device copies to and from fastest (pinned for a GPU)
  const LayerOps<float>* ops = nullptr;
  const ShardOps* shard_ops = nullptr;
  const LayerOps<float>* host_ops = nullptr;
  const ShardOps* host_shard_ops = nullptr;
};

// The CPU backend (host memory).
template <typename Real>
const LayerOps<Real>& cpu_layer_ops();
const ShardOps& cpu_shard_ops();
const Backend& cpu_backend();

}  // namespace shardtrain
