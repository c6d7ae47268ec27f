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
  return t;
}

std::string MemoryPlan::describe() const {
  std::string s;
  for (int c = 0; c < MEM_CATEGORY_COUNT; c++)
    if (bytes[c]) s += strprintf("%s%s %s", s.empty() ? "" : ", ", mem_category_name(static_cast<MemCategory>(c)),
                                 human_bytes(static_cast<double>(bytes[c])).c_str());
  return s;
}

MemoryPlan plan_rank_memory(const ModelConfig& model, const GroupShape& groups, const EngineOptions& engine,
                            int micro_batch, int seq_len, bool activation_checkpointing) {
  ParamTable table(model);
  std::vector<UnitLayout> layout = FsdpEngine::plan_layout(table, groups);
  MemoryPlan plan;
  plan.bytes = FsdpEngine::plan_memory(layout, engine);
  // AdamW's two moments per element, beside the master shards (none on the device when offloaded).
  plan.bytes[MEM_OPTIMIZER_STATE] = 2 * plan.bytes[MEM_SHARDED_PARAMS];
  if (engine.cpu_offload) {
    size_t shard_numel = 0;
    for (const UnitLayout& unit : layout) shard_numel += unit.shard_numel;
    plan.offloaded_bytes = 4 * shard_numel * sizeof(float);  // master, gradient, two moments
  }
  plan.bytes[MEM_ACTIVATIONS] = plan_activation_bytes(model, micro_batch, seq_len, activation_checkpointing);
  return plan;
}

}  // namespace shardtrain
