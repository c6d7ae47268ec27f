// See memory_plan.hpp.
#include "app/memory_plan.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <tuple>
#include <utility>

#include "app/teacher.hpp"
#include "app/text_encoder.hpp"
#include "core/error.hpp"
#include "core/format.hpp"
#include "model/adapter_layers.hpp"
#include "model/model.hpp"
#include "model/saved_activations.hpp"
#include "optim/adamw.hpp"

namespace shardtrain {

std::vector<FrozenCompanion> frozen_companions(const Config& c, int world) {
  std::vector<FrozenCompanion> frozen;
  if (!c.distill.teacher.empty())
    frozen.push_back({"teacher", "distill.teacher", teacher_param_table(c.distill.teacher, teacher_quant(c)),
                      c.train.seq_len, true, 0});
  if (c.text_encoder.enabled())
    frozen.push_back({"text encoder", "text_encoder.source",
                      text_encoder_param_table(c.text_encoder, text_encoder_quant(c)), c.model.context_len, false,
                      text_encoder_shard_size(c, world)});
  return frozen;
}

GroupShape FrozenCompanion::groups(const GroupShape& trained) const {
  if (shard_size == 0 || shard_size == trained.shard_size) return trained;
  if (shard_size == trained.replica_size)
    return GroupShape{trained.replica_size, trained.replica_rank, trained.shard_size, trained.shard_rank};
  const int world = trained.shard_size * trained.replica_size;
  return GroupShape{shard_size, 0, world / shard_size, 0};
}

EngineOptions forward_only_options(const EngineOptions& trained) {
  EngineOptions options = trained;
  options.inference = true;  // no gradients, no reductions
  options.cpu_offload = false;
  if (options.strategy == SHARDING_SHARD_GRAD_OP) options.strategy = SHARDING_FULL_SHARD;
  return options;
}

std::array<size_t, MEM_CATEGORY_COUNT> plan_forward_only_memory(const ParamTable& table, const GroupShape& groups,
                                                                const EngineOptions& options, int batch, int seq_len) {
  std::array<size_t, MEM_CATEGORY_COUNT> bytes =
      FsdpEngine::plan_memory(FsdpEngine::plan_layout(table, groups), forward_only_options(options));
  bytes[MEM_ACTIVATIONS] += plan_activation_bytes(table, batch, seq_len, true);  // forward only: block inputs kept
  return bytes;
}

size_t MemoryPlan::total() const {
  size_t t = 0;
  for (size_t b : bytes) t += b;
  for (const Frozen& f : frozen)
    for (size_t b : f.bytes) t += b;
  return t + gpu.total();
}

std::string describe_categories(const std::array<size_t, MEM_CATEGORY_COUNT>& bytes) {
  std::string s;
  for (int c = 0; c < MEM_CATEGORY_COUNT; c++)
    if (bytes[c]) s += strprintf("%s%s %s", s.empty() ? "" : ", ", mem_category_name(static_cast<MemCategory>(c)),
                                 human_bytes(static_cast<double>(bytes[c])).c_str());
  return s;
}

int step_loss_buckets(const ModelConfig& model) {
  return family_of(model).samples_images() ? FLOW_LOSS_BUCKETS : 0;
}

std::array<size_t, MEM_CATEGORY_COUNT> tracked_categories(const MemoryTracker& tracker) {
  std::array<size_t, MEM_CATEGORY_COUNT> bytes{};
  for (int c = 0; c < MEM_CATEGORY_COUNT; c++) bytes[c] = tracker.current(static_cast<MemCategory>(c));
  return bytes;
}

std::string MemoryPlan::describe() const {
  std::string s = describe_categories(bytes);
  for (const Frozen& f : frozen) s += " | " + f.role + ": " + describe_categories(f.bytes);
  if (gpu.total())
    s += strprintf(" | GPU backend: workspace %s%s, NCCL buffers %s (estimate), allocator rounding %s",
                   human_bytes(static_cast<double>(gpu.workspace())).c_str(),
                   gpu.attention() ? strprintf(" (of it cuDNN attention %s, its workspace an estimate)",
                                               human_bytes(static_cast<double>(gpu.attention())).c_str())
                                         .c_str()
                                   : "",
                   human_bytes(static_cast<double>(gpu.nccl)).c_str(),
                   human_bytes(static_cast<double>(gpu.rounding)).c_str());
  if (staging_bytes) s += " | host staging " + human_bytes(static_cast<double>(staging_bytes));
  return s;
}


GemmWorkload gemm_workload(const ModelConfig& trained, const std::vector<FrozenCompanion>& frozen, int micro_batch,
                           int seq_len) {
  GemmWorkload w{linear_layers(trained), family_of(trained).product_rows(trained, micro_batch, seq_len)};
  for (const FrozenCompanion& f : frozen) {
    const ModelConfig& c = f.table.config();
    w.rows = std::max(w.rows, family_of(c).product_rows(c, micro_batch, f.seq_len));
    for (const cpu::LinearShape& l : linear_layers(c)) w.layers.push_back(l);
  }
  return w;
}

namespace {

// The model's activation arrays as its constructor makes them (ModelFamily::activation_arrays; their
// sum is plan_activation_bytes): the saved tensors
// (SavedActivations: per set in fp32, or one fp32 working set and per-set 16-bit copies), then
// the rest. The adapters' buffers count as one allocation.
void add_activation_allocations(const ParamTable& table, int batch, int seq_len, Checkpointing checkpointing,
                                DType activation_dtype, std::vector<PlannedAllocation>* list) {
  const ModelConfig& c = table.config();
  const size_t BT = static_cast<size_t>(batch) * seq_len;
  const int sets = checkpointing.run(0, c.n_layer).sets();
  for (size_t bytes : SavedActivations<float>::plan_allocations(
           activation_dtype, sets, plan_saved_tensor_elements(c, batch, seq_len), sizeof(float)))
    list->push_back({MEM_ACTIVATIONS, bytes});
  const ModelFamily& family = family_of(c);
  if (family.id_bytes(c, batch, seq_len) > 0) {  // a decoder's (model/decoder_lm.hpp)
    SHARD_CHECK(family.id_bytes(c, batch, seq_len) == decoder_lm_id_bytes(batch, seq_len), "%s's id arrays",
                family.name());
    list->push_back({MEM_ACTIVATIONS, BT * sizeof(int)});  // tokens
    list->push_back({MEM_ACTIVATIONS, BT * sizeof(int)});  // targets
    list->push_back({MEM_ACTIVATIONS, BT * sizeof(int)});  // document starts
    list->push_back({MEM_ACTIVATIONS, BT * sizeof(int)});  // positions
  }
  for (size_t n : family.activation_arrays(c, batch, seq_len, checkpointing, activation_dtype))
    if (n) list->push_back({MEM_ACTIVATIONS, n * sizeof(float)});  // an empty array allocates nothing
  const size_t adapters = plan_adapter_bytes(table, family.product_rows(c, batch, seq_len), sizeof(float),
                                             family.adapter_key_rows(c, batch, seq_len));
  if (adapters) list->push_back({MEM_ACTIVATIONS, adapters});
}

// The largest request of the kernels' shared workspace (kernels/launch.hpp), and whose. Every
// backward that could ask is counted, frozen parameters included (they ask for less or nothing).
std::pair<size_t, const char*> largest_kernel_workspace(const ParamTable& table, int B, int T) {
  const ModelConfig& c = table.config();
  const ModelFamily& family = family_of(c);
  const int N = family.product_rows(c, B, T);  // the rows of the largest products
  std::pair<size_t, const char*> largest{0, ""};
  auto consider = [&](size_t bytes, const char* kernel) {
    if (bytes > largest.first) largest = {bytes, kernel};
  };
  for (const ModelFamily::KernelWorkspace& w : family.kernel_workspaces(c, B, T)) consider(w.bytes, w.kernel);
  const std::vector<cpu::LinearShape> linears = linear_layers(c);
  for (const LinearSite& site : table.all_sites())  // the biased products
    if (site.bias >= 0) consider(gpu::matmul_backward_workspace_bytes(N, site.width), "matmul backward (bias)");
  if (table.adapter().type == ADAPTER_DORA)
    for (const cpu::LinearShape& l : linears)
      consider(gpu::column_dot_accumulate_workspace_bytes(N, l.out), "DoRA magnitude backward");
  return largest;
}

}  // namespace

std::vector<PlannedAllocation> plan_device_allocations(const ParamTable& table, const GroupShape& groups,
                                                       const EngineOptions& engine, int micro_batch, int seq_len,
                                                       Checkpointing activation_checkpointing, DType activation_dtype) {
  const std::vector<UnitLayout> layout = FsdpEngine::plan_layout(table, groups);
  std::vector<PlannedAllocation> list = FsdpEngine::plan_allocations(layout, engine);  // the engine's, its reductions'
  auto add = [&](MemCategory category, size_t bytes) {
    if (bytes) list.push_back({category, bytes});
  };
  // AdamW's two moments per unit (host memory when offloaded).
  if (!engine.cpu_offload) {
    for (const UnitLayout& l : layout)
      add(MEM_OPTIMIZER_STATE, l.trainable.shard_numel * sizeof(float)),
          add(MEM_OPTIMIZER_STATE, l.trainable.shard_numel * sizeof(float));
    add(MEM_OPTIMIZER_STATE, AdamW::plan_table_bytes(table, groups.shard_size));  // the fused step's table
  }
  add(MEM_WORKSPACE, step_sums_bytes(table.config()));  // the trainer's step sums
  add_activation_allocations(table, micro_batch, seq_len, activation_checkpointing, activation_dtype, &list);
  return list;
}

gpu::CudnnAttentionMemory plan_cudnn_attention(const ModelConfig& trained, const std::vector<FrozenCompanion>& frozen,
                                               int micro_batch, int seq_len, const ComputeOptions& compute) {
  gpu::CudnnAttentionMemory m;
  if (!compute.gpu() || compute.attention_kernel() != ATTENTION_CUDNN) return m;
  // A head size cuDNN refuses runs on the tiled kernels.
  auto add = [&](const ModelConfig& c, int tokens, bool backward, bool documents) {
    const int T = family_of(c).attention_tokens(c, tokens);
    if (gpu::cudnn_attention_takes_head_size(c.head_size()))
      m.grow_to(gpu::cudnn_attention_memory(micro_batch, T, c.n_head, c.kv_heads(), c.head_size(), backward,
                                            documents));
  };
  // A sliding window is masked as the documents are (model/decoder_lm.hpp: the rows' first keys).
  add(trained, seq_len, true, compute.packed_documents || trained.window_within(seq_len));
  for (const FrozenCompanion& f : frozen)  // forward only
    add(f.table.config(), f.seq_len, false,
        (compute.packed_documents && f.documents) || f.table.config().window_within(f.seq_len));
  return m;
}

GpuBackendPlan plan_gpu_backend(const ParamTable& table, const GroupShape& groups, int micro_batch, int seq_len,
                                const ComputeOptions& compute, const GemmWorkload& gemms,
                                const std::vector<PlannedAllocation>& allocations, bool step_communicator,
                                const std::vector<FrozenCompanion>& frozen) {
  GpuBackendPlan g;
  if (!compute.gpu()) return g;
  g.cublaslt = gpu::kCublasLtWorkspaceBytes;
  std::tie(g.kernel_workspace, g.largest_kernel) = largest_kernel_workspace(table, micro_batch, seq_len);
  g.reduce_scratch = gpu::reduce_scratch_bytes();
  // The backward's two activation copies bound the forward's one; the weights come rounded (the
  // engine's gathered 16-bit units, bound to the ops).
  if (compute.compute_dtype != DTYPE_FP32)
    for (const cpu::LinearShape& l : gemms.layers)
      g.operand_copies = std::max(g.operand_copies, gpu::matmul_backward_operand_bytes(gemms.rows, l.in, l.out, false));
  g.cudnn_attention =
      plan_cudnn_attention(table.config(), frozen, micro_batch, seq_len, compute);
  if (compute.nccl()) {
    g.nccl_sizes = gpu::nccl_buffer_sizes();
    const int world = step_communicator ? groups.shard_size * groups.replica_size : 1;
    for (int ranks : {groups.shard_size, groups.replica_size, world}) {
      g.nccl += gpu::nccl_communicator_bytes(ranks, g.nccl_sizes);
      g.nccl_communicators += ranks > 1;
    }
  }
  // Every allocation from the caching allocator: the planned arrays and the backend's own buffers
  // (not NCCL's, which NCCL makes with cudaMalloc). A mapped head comes from the driver instead.
  std::vector<size_t> sizes;
  for (const PlannedAllocation& a : allocations)
    if (a.mapped)
      g.rounding += gpu::mapped_block_bytes(a.bytes) - a.bytes;
    else
      sizes.push_back(a.bytes);
  const size_t mapped = allocations.size() - sizes.size();
  for (size_t bytes : {g.cublaslt, g.kernel_workspace, g.reduce_scratch, g.operand_copies})
    if (bytes) sizes.push_back(bytes);
  for (size_t bytes : g.cudnn_attention.allocations()) sizes.push_back(bytes);  // each buffer its own
  g.rounding += gpu::allocator_rounding_bytes(sizes);
  g.allocations = sizes.size() + mapped;
  return g;
}

MemoryPlan plan_rank_memory(const ParamTable& table, const GroupShape& groups, const EngineOptions& engine,
                            int micro_batch, int seq_len, Checkpointing activation_checkpointing,
                            const ComputeOptions& compute, const GemmWorkload& gemms,
                            const std::vector<FrozenCompanion>& frozen) {
  std::vector<UnitLayout> layout = FsdpEngine::plan_layout(table, groups);
  MemoryPlan plan;
  plan.bytes = FsdpEngine::plan_memory(layout, engine);
  // AdamW's two moments per trainable element, beside the master shards (none on the device when
  // offloaded); frozen parameters have none.
  size_t held_numel = 0, trainable_shard_numel = 0, packed_bytes = 0;
  for (const UnitLayout& unit : layout) {
    held_numel += unit.held_numel(), trainable_shard_numel += unit.trainable.shard_numel;
    packed_bytes += unit.packed_bytes();
  }
  // And the fused step's segment table (optim/adamw.hpp) beside them; (offloaded) the step's sums
  // beside the masters.
  const size_t table_bytes = AdamW::plan_table_bytes(table, groups.shard_size);
  if (!engine.cpu_offload) plan.bytes[MEM_OPTIMIZER_STATE] = 2 * trainable_shard_numel * sizeof(float) + table_bytes;
  if (engine.cpu_offload)  // master, gradient, two moments, the table, the sums
    plan.offloaded_bytes = (held_numel + 3 * trainable_shard_numel) * sizeof(float) + packed_bytes + table_bytes +
                           step_sums_bytes(table.config());
  plan.bytes[MEM_ACTIVATIONS] = plan_activation_bytes(table, micro_batch, seq_len, activation_checkpointing,
                                                      sizeof(float), compute.activation_dtype);
  // The GEMMs' workspace and the step's loss and gradient-norm sums on the device.
  plan.bytes[MEM_WORKSPACE] =
      plan_gemm_workspace_bytes(compute.device, compute.compute_dtype, gemms) + step_sums_bytes(table.config());
  std::vector<FrozenLayout> frozen_layouts;
  for (const FrozenCompanion& f : frozen) {
    const GroupShape own = f.groups(groups);
    plan.frozen.push_back({f.role, f.option, own.shard_size,
                           plan_forward_only_memory(f.table, own, engine, micro_batch, f.seq_len)});
    // Its gathers run on the model's replica communicator where it takes that as its shard group.
    frozen_layouts.push_back({FsdpEngine::plan_layout(f.table, own), own.shard_size != groups.shard_size});
  }
  plan.staging_bytes = plan_comm_staging_bytes(compute, groups, engine, layout, step_sums_bytes(table.config()),
                                               frozen_layouts);
  if (compute.gpu())
    plan.gpu = plan_gpu_backend(
        table, groups, micro_batch, seq_len, compute, gemms,
        plan_device_allocations(table, groups, engine, micro_batch, seq_len, activation_checkpointing,
                                compute.activation_dtype),
        !engine.cpu_offload, frozen);
  return plan;
}

}  // namespace shardtrain
