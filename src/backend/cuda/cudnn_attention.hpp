// cuDNN's fused scaled-dot-product attention (flash attention on the tensor cores) behind the
// LayerOps attention interface (backend/layer_ops.hpp; semantics backend/cpu/ops.hpp): causal
// (or, for a diffusion transformer's joint attention, unmasked), grouped-query heads, lse(B,NH,T) = each query row's natural-log log-sum-exp of its scaled
// scores, the same quantity the CPU and the tiled kernels save, so either backward accepts
// either forward's lse. train.attention=cudnn (docs/gpu.md, "Attention kernels").
//
// Precision: qkv (and in the backward dout and out) are rounded to bf16 once per call into
// staging buffers -- or, for qkv and out, read from the bf16 copies the caller passes (16-bit
// activations): the same bits. Q, K and V are strided views of that one buffer (no repacking).
// Scores, softmax statistics and every accumulation are fp32; the probabilities (and the score
// gradients) enter the second products as bf16, and out and dqkv come back from bf16.
// The backward is the deterministic form (no fp32 dQ accumulator with atomics; cuDNN's dP
// workspace instead) and only engines without cuDNN's non-determinism note are used: same
// inputs, same bits.
//
// Plans are built once per shape (B, T, NH, KV, HS, causal or not) and direction, and kept. A shape cuDNN has
// no engine for (head size not a multiple of 8 or over 128, or no engine config finalizes)
// makes forward()/backward() return false having written nothing, after printing one line per
// shape and direction that names the shape and cuDNN's reason; the caller then runs the tiled
// kernels (whose lse means the same). Every other cuDNN failure aborts (fatal_internal).
//
// Memory, grow-only and reused by every call (all on the device's caching allocator, in stream
// order on its compute stream), sized by backend/gpu_memory.hpp (cudnn_attention_*_bytes), which
// the memory plan counts: bf16 qkv and dqkv (B*T*(NH+2KV)*HS*2 bytes each), bf16 out and dout
// (B*T*NH*HS*2 each), the backward's per-row sums (B*NH*T*4), a copy of lse (B*NH*T*4) only when
// the caller's lse is not 16-byte aligned, and cuDNN's workspace (the largest plan's, known only
// from the finalized plan; the deterministic backward's dP workspace is about B*NH*T*T*2 bytes;
// the plan takes gpu_memory.hpp's cudnn_attention_*_workspace_estimate). A call given qkv's bf16
// copy does not grow the bf16 qkv buffer: the plan's count is then an upper bound.
// Everything is queued on the device's compute stream; nothing waits for it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "backend/cuda/cuda_backend.hpp"

namespace shardtrain {

class CudnnAttention {
 public:
  // A cuDNN handle on device's compute stream. Must be destroyed before the device.
  explicit CudnnAttention(CudaDevice& device);
  ~CudnnAttention();
  CudnnAttention(const CudnnAttention&) = delete;
  CudnnAttention& operator=(const CudnnAttention&) = delete;

  // LayerOps::attention_forward / attention_backward. False: cuDNN cannot run this shape,
  // nothing was written (see above). qkv_bf16, out_bf16 (may be null): bf16 copies of qkv and out
  // (bound to the ops, LayerOps::bind_half_copy: qkv == widen(qkv_bf16)), read instead of rounding
  // qkv and out into the staging buffers when 16-byte aligned, the alignment cuDNN is promised.
  // causal false: no mask (every row sees every key), a plan of its own. doc_start (B,T) in
  // device memory (causal only): packed documents, row t of sequence b seeing keys doc_start[b][t]
  // <= s <= t (backend/cpu/ops.hpp), through an additive score bias (plans of their own; the bias
  // buffer B*T*T*2 bytes, built once per micro-batch: documents_changed).
  bool forward(float* out, float* lse, const float* qkv, int B, int T, int NH, int KV, int HS,
               const uint16_t* qkv_bf16 = nullptr, bool causal = true, const int* doc_start = nullptr);
  bool backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse, int B, int T,
                int NH, int KV, int HS, const uint16_t* qkv_bf16 = nullptr, const uint16_t* out_bf16 = nullptr,
                bool causal = true, const int* doc_start = nullptr);

  // The document starts at doc_start were rewritten: the score bias built from them is stale. The
  // bias is built on the first call with a doc_start (and B, T) and reused by the calls after it
  // -- the layers' forwards, recomputes and backwards of one micro-batch -- until this is called
  // for that array (LayerOps::documents_changed, from the model's upload of a micro-batch).
  void documents_changed(const int* doc_start);

  // Why cuDNN's attention is not used for this shape before asking cuDNN (head size, the
  // runtime cuDNN's version), or "" when it may be.
  static std::string unsupported_reason(int T, int HS, bool backward);
  // Device memory held now: cuDNN's workspace, and the staging buffers (lse_copy included).
  size_t workspace_bytes() const;
  size_t staging_bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shardtrain
