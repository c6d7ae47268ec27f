// Every byte a rank allocates, predicted from the configuration alone: the engine's shards and
// unsharded buffers (FsdpEngine::plan_memory), the optimizer's moments, and the model's
// activations (plan_activation_bytes, model/model.hpp). The trainer checks the prediction against
// fsdp.memory_limit before it allocates anything, and `shardtrain plan` evaluates it for every
// strategy and option on any rank count. All allocations are made at start-up, so the plan is
// also each rank's peak.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "app/compute_backend.hpp"
#include "app/options.hpp"
#include "shard/fsdp_engine.hpp"

namespace shardtrain {

struct MemoryPlan {
  std::array<size_t, MEM_CATEGORY_COUNT> bytes{};  // on the compute device
  // fsdp.cpu_offload: master shards, their gradients and the moments in host memory. On the CPU
  // backend the host is the device, so these add to the same memory (offload saves nothing there).
  size_t offloaded_bytes = 0;
  // distill.teacher: the frozen teacher's bytes, beside `bytes` (app/teacher.hpp's plan_teacher_memory).
  std::array<size_t, MEM_CATEGORY_COUNT> teacher{};
  size_t total() const;  // the student's and the teacher's
  std::string describe() const;  // "sharded_params 1.2 MiB, gradients ... | teacher: sharded_params ..."
};

// `table`: the model with what the configuration freezes (config_param_table). Without the
// teacher: app/teacher.hpp's plan_teacher_memory gives MemoryPlan::teacher. `compute`: the device
// and its kernels; `gemms`: the linear layers multiplied (gemm_workload), for the GEMMs' workspace.
MemoryPlan plan_rank_memory(const ParamTable& table, const GroupShape& groups, const EngineOptions& engine,
                            int micro_batch, int seq_len, bool activation_checkpointing,
                            const ComputeOptions& compute, const GemmWorkload& gemms);
// The GEMMs' workspace of a run: the student's layers and, when distilling, the teacher's, at
// micro_batch x seq_len rows (its bytes: plan_gemm_workspace_bytes, in the plan's "workspace").
GemmWorkload gemm_workload(const ModelConfig& student, const ModelConfig* teacher, int rows);

// "sharded_params 1.2 MiB, gradients ..." of the categories that hold bytes.
std::string describe_categories(const std::array<size_t, MEM_CATEGORY_COUNT>& bytes);


}  // namespace shardtrain
