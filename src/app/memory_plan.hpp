// Every byte a rank allocates, predicted from the configuration alone: the engine's shards and
// unsharded buffers (FsdpEngine::plan_memory), the optimizer's moments, and the model's
// activations (plan_activation_bytes, model/model.hpp). The trainer checks the prediction against
// fsdp.memory_limit before it allocates anything, and `shardtrain plan` evaluates it for every
// strategy and option on any rank count. All allocations are made at start-up, so the plan is
// also each rank's peak. With train.device=cuda the plan adds the CUDA backend's own memory
// (GpuBackendPlan, from backend/gpu_memory.hpp), which the trainer does not track per category.
#pragma once

#include <algorithm>
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

// A frozen model that runs its forward beside the trained one, sharded as its own units, with no
// gradients, no optimizer state and no offload: a distillation teacher over the student's
// sequences, a text encoder over the captions' tokens. Its name in the plan and the option that
// sets it, its table, the tokens of a micro-batch row, whether those are the trained model's
// sequences (packed documents apply), and its groups.
struct FrozenCompanion {
  std::string role;
  std::string option;
  ParamTable table;
  int seq_len = 0;
  bool documents = false;
  int shard_size = 0;  // the ranks its units are sharded over; 0: the trained model's shard group
  // Its groups on a rank of the trained model's `groups`: those, or its own shard size's -- the
  // model's replica group where that is its size (how the trainer makes them: no new communicators).
  GroupShape groups(const GroupShape& trained) const;
};
// The run's on `world` ranks: distill.teacher's and text_encoder.source's models, read from their
// files (on every rank: call under agree_on). UsageError for a source that is neither kind.
std::vector<FrozenCompanion> frozen_companions(const Config& config, int world);
// A companion's bytes per category on a rank of `groups`, without allocating: the engine's in
// inference (options with inference set) and a forward-only model's activations for micro-batches
// of `batch` rows of `seq_len` tokens.
std::array<size_t, MEM_CATEGORY_COUNT> plan_forward_only_memory(const ParamTable& table, const GroupShape& groups,
                                                                const EngineOptions& options, int batch, int seq_len);
// The engine options of a companion of a model trained with `trained`: inference (no gradients, no
// reductions), its shards on the device (nothing to offload: no optimizer state), and each unit
// gathered for its forward and freed (SHARD_GRAD_OP's keeping them gathered serves a backward).
EngineOptions forward_only_options(const EngineOptions& trained);

struct MemoryPlan {
  std::array<size_t, MEM_CATEGORY_COUNT> bytes{};  // on the compute device
  // fsdp.cpu_offload: master shards, their gradients and the moments in host memory. On the CPU
  // backend the host is the device, so these add to the same memory (offload saves nothing there).
  size_t offloaded_bytes = 0;
  // The frozen companions' bytes (plan_forward_only_memory), beside `bytes`.
  struct Frozen {
    std::string role, option;
    int shard_size = 0;  // its shard group's ranks
    std::array<size_t, MEM_CATEGORY_COUNT> bytes{};
  };
  std::vector<Frozen> frozen;
  // train.device=cuda: the backend's own bytes (zero on the CPU); `bytes` stays what the trainer
  // tracks, category by category.
  GpuBackendPlan gpu;
  // fsdp.comm_backend=mpi on a GPU: the staged communicators' page-locked host buffers
  // (plan_comm_staging_bytes), host memory beside the device's.
  size_t staging_bytes = 0;
  size_t total() const;  // the trained model's, the companions' and the GPU backend's
  std::string describe() const;  // "sharded_params 1.2 MiB, gradients ... | teacher: sharded_params ..."
};

// `table`: the model with what the configuration freezes (config_param_table); `frozen`: its
// companions (MemoryPlan::frozen, and their gathers in the staging). `compute`:
// the device and its kernels; `gemms`: the linear layers multiplied (gemm_workload), for the GEMMs'
// workspace.
MemoryPlan plan_rank_memory(const ParamTable& table, const GroupShape& groups, const EngineOptions& engine,
                            int micro_batch, int seq_len, Checkpointing activation_checkpointing,
                            const ComputeOptions& compute, const GemmWorkload& gemms,
                            const std::vector<FrozenCompanion>& frozen = {});
// The device arrays of the engine, the optimizer and the model that `bytes` sums, one by one, in
// the order they are made (the rounding needs each). GPU memory only: with fsdp.cpu_offload the
// masters, their gradients and the moments are host memory and not listed.
std::vector<PlannedAllocation> plan_device_allocations(const ParamTable& table, const GroupShape& groups,
                                                       const EngineOptions& engine, int micro_batch, int seq_len,
                                                       Checkpointing activation_checkpointing,
                                                       DType activation_dtype = DTYPE_FP32);
// The CUDA backend's own memory for this run (GpuBackendPlan), given the allocations it rounds.
// step_communicator: the trainer's world communicator for the step's sums (made on a GPU unless
// fsdp.cpu_offload: docs/architecture.md, "One host synchronization per step") is NCCL's too.
// frozen: the companions; their forwards run on the same ops (cuDNN attention's buffers grow to the
// largest of theirs and the trained model's).
GpuBackendPlan plan_gpu_backend(const ParamTable& table, const GroupShape& groups, int micro_batch, int seq_len,
                                const ComputeOptions& compute, const GemmWorkload& gemms,
                                const std::vector<PlannedAllocation>& allocations, bool step_communicator,
                                const std::vector<FrozenCompanion>& frozen = {});
// train.attention=cudnn: what cuDNN attention holds after a step of the trained model (forward and
// backward) and the companions (forward), each when cuDNN takes its head size; zero otherwise.
gpu::CudnnAttentionMemory plan_cudnn_attention(const ModelConfig& trained, const std::vector<FrozenCompanion>& frozen,
                                               int micro_batch, int seq_len, const ComputeOptions& compute);

// The GEMMs' workspace of a run: the trained model's layers and its companions', at the most rows
// a product of a micro-batch has (ModelFamily::product_rows; its bytes: plan_gemm_workspace_bytes,
// in the plan's "workspace").
GemmWorkload gemm_workload(const ModelConfig& trained, const std::vector<FrozenCompanion>& frozen, int micro_batch,
                           int seq_len);

// The trainer's step sums (device memory, one copy to the host per step): the loss and the squared
// gradient norm, then for a flow-matching model (ModelFamily::samples_images) the loss summed per
// noise-level bucket, sigma in [k / FLOW_LOSS_BUCKETS, (k + 1) / FLOW_LOSS_BUCKETS).
constexpr int FLOW_LOSS_BUCKETS = 10;
int step_loss_buckets(const ModelConfig& model);
inline size_t step_sums_bytes(const ModelConfig& model) { return (2 + step_loss_buckets(model)) * sizeof(double); }
// The bucket of noise level sigma.
inline int flow_loss_bucket(double sigma) {
  return std::clamp(static_cast<int>(sigma * FLOW_LOSS_BUCKETS), 0, FLOW_LOSS_BUCKETS - 1);
}
// What a tracker holds now, by category.
std::array<size_t, MEM_CATEGORY_COUNT> tracked_categories(const MemoryTracker& tracker);
// "sharded_params 1.2 MiB, gradients ..." of the categories that hold bytes.
std::string describe_categories(const std::array<size_t, MEM_CATEGORY_COUNT>& bytes);


}  // namespace shardtrain
