// See memory_plan.hpp.
#include "app/memory_plan.hpp"

#include <cmath>
#include <cstdlib>

#include "core/error.hpp"

namespace shardtrain {

size_t MemoryPlan::total() const {
  size_t t = 0;
  for (size_t b : bytes) t += b;
  return t;
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) bytes /= 1024, u++;
  return strprintf(u == 0 ? "%.0f %s" : "%.1f %s", bytes, units[u]);
}

std::string MemoryPlan::describe() const {
  std::string s;
  for (int c = 0; c < MEM_CATEGORY_COUNT; c++)
    if (bytes[c]) s += strprintf("%s%s %s", s.empty() ? "" : ", ", mem_category_name(static_cast<MemCategory>(c)),
                                 format_bytes(static_cast<double>(bytes[c])).c_str());
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
  plan.bytes[MEM_ACTIVATIONS] =
      GptModel<float>::plan_activation_bytes(model, micro_batch, seq_len, activation_checkpointing);
  return plan;
}

size_t parse_memory_size(const std::string& text, const char* option) {
  if (text.empty()) return 0;
  char* end = nullptr;
  double value = std::strtod(text.c_str(), &end);
  std::string unit(end);
  const struct {
    const char* name;
    double scale;
  } units[] = {{"", 1}, {"B", 1}, {"KiB", 1024.0}, {"MiB", 1048576.0}, {"GiB", 1073741824.0},
               {"TiB", 1099511627776.0}, {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12}};
  // 2^63 bytes (8 EiB) is beyond any machine and still converts to size_t without overflow.
  constexpr double largest = 9223372036854775808.0;
  for (const auto& u : units) {
    if (unit != u.name || end == text.c_str() || !(value > 0) || !std::isfinite(value)) continue;
    if (value * u.scale >= largest)
      throw UsageError(std::string(option) + "='" + text + "' is larger than any machine; write a size below 8 EiB");
    return static_cast<size_t>(value * u.scale);
  }
  throw UsageError(std::string(option) + "='" + text +
                   "' is not a size; write a positive number with an optional unit, e.g. 24GiB, 512MiB, 1.5GB");
}

}  // namespace shardtrain
