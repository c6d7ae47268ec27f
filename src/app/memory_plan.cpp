// See memory_plan.hpp.
#include "app/memory_plan.hpp"

#include <cmath>
#include <cstdlib>

#include "core/error.hpp"
#include "core/format.hpp"

namespace shardtrain {

size_t MemoryPlan::total() const {
  size_t t = 0;
  for (size_t b : bytes) t += b;
  for (size_t b : teacher) t += b;
  return t;
}

std::string describe_categories(const std::array<size_t, MEM_CATEGORY_COUNT>& bytes) {
  std::string s;
  for (int c = 0; c < MEM_CATEGORY_COUNT; c++)
    if (bytes[c]) s += strprintf("%s%s %s", s.empty() ? "" : ", ", mem_category_name(static_cast<MemCategory>(c)),
                                 human_bytes(static_cast<double>(bytes[c])).c_str());
  return s;
}

std::string MemoryPlan::describe() const {
  const std::string t = describe_categories(teacher);
  return describe_categories(bytes) + (t.empty() ? "" : " | teacher: " + t);
}


GemmWorkload gemm_workload(const ModelConfig& student, const ModelConfig* teacher, int rows) {
  GemmWorkload w{linear_layers(student), rows};
  if (teacher)
    for (const cpu::LinearShape& l : linear_layers(*teacher)) w.layers.push_back(l);
  return w;
}

MemoryPlan plan_rank_memory(const ParamTable& table, const GroupShape& groups, const EngineOptions& engine,
                            int micro_batch, int seq_len, bool activation_checkpointing,
                            const ComputeOptions& compute, const GemmWorkload& gemms) {
  std::vector<UnitLayout> layout = FsdpEngine::plan_layout(table, groups);
  MemoryPlan plan;
  plan.bytes = FsdpEngine::plan_memory(layout, engine);
  // AdamW's two moments per trainable element, beside the master shards (none on the device when
  // offloaded); frozen parameters have none.
  size_t shard_numel = 0, trainable_shard_numel = 0;
  for (const UnitLayout& unit : layout)
    shard_numel += unit.shard_numel(), trainable_shard_numel += unit.trainable.shard_numel;
  if (!engine.cpu_offload) plan.bytes[MEM_OPTIMIZER_STATE] = 2 * trainable_shard_numel * sizeof(float);
  if (engine.cpu_offload)  // master, gradient, two moments
    plan.offloaded_bytes = (shard_numel + 3 * trainable_shard_numel) * sizeof(float);
  plan.bytes[MEM_ACTIVATIONS] = plan_activation_bytes(table, micro_batch, seq_len, activation_checkpointing);
  plan.bytes[MEM_WORKSPACE] = plan_gemm_workspace_bytes(compute.device, compute.compute_dtype, gemms);
  return plan;
}

}  // namespace shardtrain
