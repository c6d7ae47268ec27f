// What a run computes on and with (train.device, fsdp.param_dtype, fsdp.activation_dtype,
// fsdp.comm_backend, train.attention), as the compute backend (app/compute_backend.hpp) and the memory plan
// (app/memory_plan.hpp) take it. options.cpp fills it from the configuration (compute_options).
#pragma once

#include <string>

#include "backend/dtype.hpp"

namespace shardtrain {

// The collectives on device buffers. NCCL: one GPU per rank, collectives on the GPU. MPI: host
// MPI; on a GPU each collective goes through host staging buffers, so several ranks may share
// one GPU. AUTO: NCCL on cuda, MPI on the CPU (the only choice there).
enum CommBackend { COMM_AUTO, COMM_NCCL, COMM_MPI };
constexpr CommBackend COMM_BACKENDS[] = {COMM_AUTO, COMM_NCCL, COMM_MPI};
inline const char* comm_backend_name(CommBackend b) {
  return b == COMM_NCCL ? "nccl" : b == COMM_MPI ? "mpi" : "auto";
}

// The attention kernels of a GPU run: the tiled fp32 kernels (kernels/attention.cu) or cuDNN's
// fused scaled-dot-product attention (bf16 inputs). AUTO: cuDNN with 16-bit GEMM operands (20x the
// tiled kernels' speed at T = 1024 on an H200, docs/performance.md), the tiled kernels in fp32,
// which a bf16 attention would not keep exact. The CPU has the tiled ones only.
enum AttentionKernel { ATTENTION_AUTO, ATTENTION_TILED, ATTENTION_CUDNN };
constexpr AttentionKernel ATTENTION_KERNELS[] = {ATTENTION_AUTO, ATTENTION_TILED, ATTENTION_CUDNN};
inline const char* attention_kernel_name(AttentionKernel a) {
  return a == ATTENTION_TILED ? "tiled" : a == ATTENTION_CUDNN ? "cudnn" : "auto";
}

// fsdp.activation_dtype: how the activations backward reads are stored and computed from: a
// decoder's saved tensors (model/saved_activations.hpp), FLUX's block inputs
// (model/families/flux/flux_model.hpp). AUTO: as fsdp.param_dtype.
enum ActivationDtype { ACTIVATIONS_AUTO, ACTIVATIONS_FP32, ACTIVATIONS_BF16, ACTIVATIONS_FP16 };
constexpr ActivationDtype ACTIVATION_DTYPES[] = {ACTIVATIONS_AUTO, ACTIVATIONS_FP32, ACTIVATIONS_BF16,
                                                 ACTIVATIONS_FP16};
inline const char* activation_dtype_name(ActivationDtype a) {
  return a == ACTIVATIONS_FP32 ? "fp32" : a == ACTIVATIONS_BF16 ? "bf16" : a == ACTIVATIONS_FP16 ? "fp16" : "auto";
}

// fsdp.keep_half_shard: whether each shard keeps its 16-bit copy between optimizer steps
// (EngineOptions::keep_half_shard). AUTO: on the CPU without cpu_offload, where rounding the masters
// at every gather is a memory pass per unit that the step of a small model feels; off on a GPU,
// where that pass is short against the step and memory is what runs out, and with offload.
enum KeepHalfShard { KEEP_HALF_AUTO, KEEP_HALF_ON, KEEP_HALF_OFF };
constexpr KeepHalfShard KEEP_HALF_CHOICES[] = {KEEP_HALF_AUTO, KEEP_HALF_ON, KEEP_HALF_OFF};
inline const char* keep_half_shard_name(KeepHalfShard k) {
  return k == KEEP_HALF_ON ? "true" : k == KEEP_HALF_OFF ? "false" : "auto";
}

struct ComputeOptions {
  std::string device = "cpu";  // cpu | cuda
  // fsdp.param_dtype: on a GPU bf16/fp16 GEMM operands for the tensor cores; on the CPU bf16
  // GEMMs (oneDNN), fp16 only a storage and wire format.
  DType compute_dtype = DTYPE_FP32;
  CommBackend comm = COMM_AUTO;
  AttentionKernel attention = ATTENTION_AUTO;
  DType activation_dtype = DTYPE_FP32;  // fsdp.activation_dtype resolved
  // data.documents: the attention masks packed documents (cuDNN's graph then holds a score bias).
  bool packed_documents = false;

  bool gpu() const { return device == "cuda"; }
  // AUTO resolved.
  CommBackend comm_backend() const { return comm != COMM_AUTO ? comm : gpu() ? COMM_NCCL : COMM_MPI; }
  bool nccl() const { return comm_backend() == COMM_NCCL; }
  AttentionKernel attention_kernel() const {
    if (attention != ATTENTION_AUTO) return attention;
    return gpu() && compute_dtype != DTYPE_FP32 ? ATTENTION_CUDNN : ATTENTION_TILED;
  }
};

// Whether the backend's linear layers multiply the gathered 16-bit copies themselves, never their
// fp32 widening (LayerOps::multiplies_half_copies; EngineOptions::linear_weights_in_half_only): CUDA's
// 16-bit GEMMs, and on the CPU oneDNN's bf16 kernels where the CPU has bf16 dot products.
bool gemms_multiply_half_copies(const ComputeOptions& options);

}  // namespace shardtrain
