// Every byte a rank allocates, predicted from the configuration alone: the engine's shards and
// unsharded buffers (FsdpEngine::plan_memory), the optimizer's moments, and the model's
// activations (plan_activation_bytes, model/model.hpp). The trainer checks the prediction against
// fsdp.memory_limit before it allocates anything, and `shardtrain plan` evaluates it for every
// strategy and option on any rank count. All allocations are made at start-up, so the plan is
// also each rank's peak. With train.device=cuda the plan adds the CUDA backend's own memory
// (GpuBackendPlan, from backend/gpu_memory.hpp), which the trainer does not track per category.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "app/compute_backend.hpp"
#include "backend/gpu_memory.hpp"
#include "app/options.hpp"
#include "shard/fsdp_engine.hpp"

namespace shardtrain {

// train.device=cuda: what the CUDA backend allocates besides the model's, engine's and optimizer's
// arrays. All of it counts in MemoryPlan::total() (the pre-flight against the GPU's free memory).
struct GpuBackendPlan {
  // In the "workspace" category:
  size_t cublaslt = 0;             // cuBLASLt's workspace
  size_t kernel_workspace = 0;     // the kernels' shared workspace, grown to the largest request
  const char* largest_kernel = "";  // whose request that is
  size_t reduce_scratch = 0;       // the reductions' fixed scratch
  size_t operand_copies = 0;       // fsdp.param_dtype=bf16|fp16: the largest GEMM's 16-bit operands
  // train.attention=cudnn with a head size cuDNN takes (gpu_memory.hpp): cuDNN attention's bf16
  // staging buffers, exact, and cuDNN's own workspace, an upper-bound ESTIMATE (cuDNN sizes it
  // only at run time). Zero with the tiled kernels.
  gpu::CudnnAttentionMemory cudnn_attention;
  size_t attention() const { return cudnn_attention.total(); }
  // In "comm_buffers": NCCL's own buffers, an estimate (gpu_memory.hpp says how).
  size_t nccl = 0;
  int nccl_communicators = 0;  // those with more than one rank
  gpu::NcclBufferSizes nccl_sizes;
  // Its own line: what the caching allocator's size classes add to every planned allocation.
  size_t rounding = 0;
  size_t allocations = 0;  // how many allocations were rounded
  size_t workspace() const { return cublaslt + kernel_workspace + reduce_scratch + operand_copies + attention(); }
  size_t total() const { return workspace() + nccl + rounding; }
};

// One planned device allocation (for the allocator's rounding).
struct PlannedAllocation {
  MemCategory category;
  size_t bytes;
};

struct MemoryPlan {
  std::array<size_t, MEM_CATEGORY_COUNT> bytes{};  // on the compute device
  // fsdp.cpu_offload: master shards, their gradients and the moments in host memory. On the CPU
  // backend the host is the device, so these add to the same memory (offload saves nothing there).
  size_t offloaded_bytes = 0;
  // distill.teacher: the frozen teacher's bytes, beside `bytes` (app/teacher.hpp's plan_teacher_memory).
  std::array<size_t, MEM_CATEGORY_COUNT> teacher{};
  // train.device=cuda: the backend's own bytes (zero on the CPU); `bytes` stays what the trainer
  // tracks, category by category.
  GpuBackendPlan gpu;
  // fsdp.comm_backend=mpi on a GPU: the staged communicators' page-locked host buffers
  // (plan_comm_staging_bytes), host memory beside the device's.
  size_t staging_bytes = 0;
  size_t total() const;  // the student's, the teacher's and the GPU backend's
  std::string describe() const;  // "sharded_params 1.2 MiB, gradients ... | teacher: sharded_params ..."
};

// `table`: the model with what the configuration freezes (config_param_table); `teacher`:
// distill.teacher's table or null (MemoryPlan::teacher, and its gathers in the staging). `compute`:
// the device and its kernels; `gemms`: the linear layers multiplied (gemm_workload), for the GEMMs'
// workspace.
MemoryPlan plan_rank_memory(const ParamTable& table, const GroupShape& groups, const EngineOptions& engine,
                            int micro_batch, int seq_len, bool activation_checkpointing,
                            const ComputeOptions& compute, const GemmWorkload& gemms,
                            const ParamTable* teacher = nullptr);
// The device arrays of the engine, the optimizer and the model that `bytes` sums, one by one, in
// the order they are made (the rounding needs each). GPU memory only: with fsdp.cpu_offload the
// masters, their gradients and the moments are host memory and not listed.
std::vector<PlannedAllocation> plan_device_allocations(const ParamTable& table, const GroupShape& groups,
                                                       const EngineOptions& engine, int micro_batch, int seq_len,
                                                       bool activation_checkpointing,
                                                       DType activation_dtype = DTYPE_FP32);
// The CUDA backend's own memory for this run (GpuBackendPlan), given the allocations it rounds.
// step_communicator: the trainer's world communicator for the step's sums (made on a GPU unless
// fsdp.cpu_offload: docs/architecture.md, "One host synchronization per step") is NCCL's too.
// teacher: distill.teacher's model or null; its forward runs on the same ops (cuDNN attention's
// buffers grow to the larger of its and the student's).
GpuBackendPlan plan_gpu_backend(const ParamTable& table, const GroupShape& groups, int micro_batch, int seq_len,
                                const ComputeOptions& compute, const GemmWorkload& gemms,
                                const std::vector<PlannedAllocation>& allocations, bool step_communicator,
                                const ParamTable* teacher = nullptr);
// train.attention=cudnn: what cuDNN attention holds after a step of the student (forward and
// backward) and the teacher (forward), each when cuDNN takes its head size; zero otherwise.
gpu::CudnnAttentionMemory plan_cudnn_attention(const ModelConfig& student, const ModelConfig* teacher,
                                               int micro_batch, int seq_len, const ComputeOptions& compute);

// The GEMMs' workspace of a run: the student's layers and, when distilling, the teacher's, at the
// most rows a product of a micro-batch has (ModelFamily::product_rows; its bytes:
// plan_gemm_workspace_bytes, in the plan's "workspace").
GemmWorkload gemm_workload(const ModelConfig& student, const ModelConfig* teacher, int micro_batch, int seq_len);

// "sharded_params 1.2 MiB, gradients ..." of the categories that hold bytes.
std::string describe_categories(const std::array<size_t, MEM_CATEGORY_COUNT>& bytes);


}  // namespace shardtrain
