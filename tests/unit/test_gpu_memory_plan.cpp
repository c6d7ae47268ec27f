// The GPU part of the memory plan (backend/gpu_memory.hpp, app/memory_plan.hpp) against
// independent oracles: the allocator's size classes by a naive granule loop, the kernels'
// workspaces by the formulas in their own comments, the per-allocation list by the category sums
// the trainer checks, and the cuda plan minus the cpu plan by the GPU-only items summed here;
// cuDNN attention's buffers (train.attention=cudnn) by the sizes its header states.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "app/memory_plan.hpp"
#include "backend/gpu_memory.hpp"
#include "model/adapter.hpp"
#include "shard/fsdp_engine.hpp"
#include "support/model_fixtures.hpp"

namespace shardtrain {
namespace {

// Naive: add granules until the request fits; 512 B granules up to 1 MiB, 2 MiB ones above.
size_t naive_block(size_t bytes) {
  const size_t granule = bytes <= (size_t{1} << 20) ? 512 : (size_t{2} << 20);
  size_t block = 0;
  while (block < bytes) block += granule;
  return block;
}

size_t naive_rounding(const std::vector<size_t>& sizes) {
  size_t extra = 0;
  for (size_t s : sizes) extra += naive_block(s) - s;
  return extra;
}

ModelConfig gpt_config() {
  ModelConfig c;
  c.n_layer = 3, c.n_embd = 96, c.n_head = 4, c.vocab_size = 1000, c.max_seq_len = 64;
  return c;
}

ModelConfig llama_config() {
  ModelConfig c;
  c.arch = "llama", c.n_layer = 2, c.n_embd = 64, c.n_head = 4, c.n_kv_head = 2, c.intermediate_size = 160;
  c.vocab_size = 500, c.max_seq_len = 64;
  return c;
}

TEST(GpuMemory, AllocatorBlocksMatchANaiveGranuleLoop) {
  for (size_t bytes : {size_t{1}, size_t{511}, size_t{512}, size_t{513}, size_t{4096}, (size_t{1} << 20) - 1,
                       size_t{1} << 20, (size_t{1} << 20) + 1, size_t{3} << 20, (size_t{5} << 20) + 7,
                       size_t{32} << 20})
    EXPECT_EQ(gpu::allocator_block_bytes(bytes), naive_block(bytes)) << bytes;
  EXPECT_EQ(gpu::allocator_block_bytes(0), 0u);
  EXPECT_EQ(gpu::allocator_block_bytes(SIZE_MAX - 5), SIZE_MAX);  // saturates instead of wrapping
  const std::vector<size_t> sizes = {100, 513, 1 << 20, (1 << 20) + 1, 7 << 20, 12345678};
  EXPECT_EQ(gpu::allocator_rounding_bytes(sizes), naive_rounding(sizes));
  EXPECT_EQ(gpu::allocator_rounding_bytes({512, 2 << 20}), 0u);
}

TEST(GpuMemory, KernelWorkspacesFollowTheKernelsFormulas) {
  // attention.cu: B*NH*T floats (each query row's D).
  EXPECT_EQ(gpu::attention_backward_workspace_bytes(3, 70, 6, 2, 16), size_t{3} * 6 * 70 * 4);
  // Column sums (common.cuh): chunks of max(32, ceil(N/256)) rows; LayerNorm two sums, RMSNorm and
  // the bias one, each a float per chunk and column.
  auto chunks = [](int N) {
    const int rows = std::max(32, (N + 255) / 256);
    return std::max(1, (N + rows - 1) / rows);
  };
  for (int N : {1, 31, 32, 33, 1000, 8192, 8193, 100000}) {
    EXPECT_EQ(gpu::column_chunks(N).chunks, chunks(N)) << N;
    EXPECT_LE(gpu::column_chunks(N).chunks, gpu::kColumnSumMaxChunks);
    EXPECT_EQ(gpu::layernorm_backward_workspace_bytes(N, 80), size_t{2} * chunks(N) * 80 * 4) << N;
    EXPECT_EQ(gpu::rmsnorm_backward_workspace_bytes(N, 80), size_t{1} * chunks(N) * 80 * 4) << N;
    EXPECT_EQ(gpu::matmul_backward_workspace_bytes(N, 300), size_t{1} * chunks(N) * 300 * 4) << N;
    EXPECT_EQ(gpu::column_dot_accumulate_workspace_bytes(N, 300), size_t{1} * chunks(N) * 300 * 8) << N;
  }
  for (int T : {1, 33, 4096}) {  // dit.cu: per-sample sums over T rows, reused sample after sample
    EXPECT_EQ(gpu::modulate_backward_workspace_bytes(T, 80), size_t{2} * chunks(T) * 80 * 4) << T;
    EXPECT_EQ(gpu::gate_backward_workspace_bytes(T, 80), size_t{1} * chunks(T) * 80 * 4) << T;
  }
  EXPECT_EQ(gpu::column_dot_accumulate_workspace_bytes(10, 0), 0u);
  EXPECT_EQ(gpu::reduce_scratch_bytes(), size_t{513} * 8);  // reduce.cu: 512 block partials + the result
  // encoder.cu: three int arrays of B*T, each 256-aligned, then CUB's storage (estimated).
  // B*T = 100: arrays of 400 bytes at 0, 512 and 1024; CUB's part at 1536.
  EXPECT_EQ(gpu::encoder_backward_workspace_estimate(2, 50), 1536 + 2 * 100 * 4 + gpu::kCubSortOverheadBytes);
}

TEST(GpuMemory, OperandCopiesAreTheCarvedSixteenBitOperands) {
  // matmul.cu: forward rounds inp (N x C) and weight (OC x C); the backward dout (N x OC, rows of
  // OC rounded up to 8 elements: OC = 19 -> 24), weight and inp; each copy 2 bytes per element,
  // starting 256-aligned. A weight that comes rounded (the engine's gathered 16-bit unit) is not copied.
  auto up = [](size_t b) { return (b + 255) / 256 * 256; };
  const int N = 37, C = 50, OC = 19, OC_PADDED = 24;
  EXPECT_EQ(gpu::gemm_padded_row(OC), OC_PADDED);
  EXPECT_EQ(gpu::gemm_padded_row(48), 48);
  EXPECT_EQ(gpu::matmul_forward_operand_bytes(N, C, OC, true), up(2 * N * C) + 2 * OC * C);
  EXPECT_EQ(gpu::matmul_backward_operand_bytes(N, C, OC, true),
            up(up(2 * N * OC_PADDED) + 2 * OC * C) + 2 * N * C);
  EXPECT_GE(gpu::matmul_backward_operand_bytes(N, C, OC, true), gpu::matmul_forward_operand_bytes(N, C, OC, true));
  EXPECT_EQ(gpu::matmul_forward_operand_bytes(N, C, OC, false), up(2 * N * C));
  EXPECT_EQ(gpu::matmul_backward_operand_bytes(N, C, OC, false), up(up(2 * N * OC_PADDED)) + 2 * N * C);
}

TEST(GpuMemory, NcclEstimateReadsNcclsVariables) {
  std::map<std::string, std::string> env;
  auto getenv = [&](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  };
  gpu::NcclBufferSizes d = gpu::nccl_buffer_sizes(getenv);
  EXPECT_EQ(d.simple, size_t{4} << 20);   // NCCL's DEFAULT_BUFFSIZE
  EXPECT_EQ(d.ll, size_t{512} << 10);     // 8 lines x 512 threads x 8 steps x 16 B
  EXPECT_EQ(d.ll128, size_t{4915200});    // 120 x 640 threads x 8 steps x 8 B
  EXPECT_EQ(d.channels, 32);
  EXPECT_EQ(gpu::nccl_communicator_bytes(1, d), 0u);  // a single rank connects to nobody
  EXPECT_EQ(gpu::nccl_communicator_bytes(8, d), 32 * ((size_t{4} << 20) + (size_t{512} << 10) + 4915200));
  env = {{"NCCL_BUFFSIZE", "1048576"}, {"NCCL_LL_BUFFSIZE", "-2"}, {"NCCL_LL128_BUFFSIZE", "junk"},
         {"NCCL_MAX_NCHANNELS", "4"}};
  gpu::NcclBufferSizes e = gpu::nccl_buffer_sizes(getenv);
  EXPECT_EQ(e.simple, size_t{1} << 20);
  EXPECT_EQ(e.ll, d.ll);        // -2 is NCCL's "default"
  EXPECT_EQ(e.ll128, d.ll128);  // not a number: the default
  EXPECT_EQ(e.channels, 4);
  EXPECT_EQ(gpu::nccl_communicator_bytes(2, e), 4 * e.per_channel());
}

// cuDNN attention (backend/cuda/cudnn_attention.cpp), its buffers written out from the header's
// description: bf16 qkv and dqkv B*T*(NH+2KV)*HS*2 bytes each, bf16 out and dout B*T*NH*HS*2 each,
// the backward's fp32 row sums B*NH*T*4; the forward makes only qkv and out.
struct CudnnBuffers {
  size_t qkv16, out16, dout16, dqkv16, row_sums;
};
CudnnBuffers cudnn_buffers(size_t B, size_t T, size_t NH, size_t KV, size_t HS, bool backward) {
  const size_t qkv = B * T * (NH + 2 * KV) * HS * 2, out = B * T * NH * HS * 2, rows = B * NH * T * 4;
  return backward ? CudnnBuffers{qkv, out, out, qkv, rows} : CudnnBuffers{qkv, out, 0, 0, 0};
}
// The workspace estimates as gpu_memory.hpp states them, T' = T rounded up to 64: forward 2 fp32
// per row plus 1 MiB; backward dP (bf16, T' x T' per head) + an fp32 dQ (+ fp32 dK and dV
// partials per query head when KV < NH) plus 1 MiB.
size_t forward_estimate(size_t B, size_t T, size_t NH) {
  const size_t Tp = (T + 63) / 64 * 64;
  return 2 * B * NH * Tp * 4 + (size_t{1} << 20);
}
size_t backward_estimate(size_t B, size_t T, size_t NH, size_t KV, size_t HS) {
  const size_t Tp = (T + 63) / 64 * 64;
  return B * NH * Tp * Tp * 2 + B * NH * Tp * HS * 4 + (KV < NH ? 2 * B * NH * Tp * HS * 4 : 0) + (size_t{1} << 20);
}

TEST(GpuMemory, CudnnAttentionStagingIsEachBuffersFormula) {
  struct S {
    int B, T, NH, KV, HS;
  };
  for (const S s : {S{1, 1, 1, 1, 8}, S{2, 7, 4, 2, 64}, S{3, 130, 6, 3, 128}, S{8, 1024, 12, 12, 64}}) {
    const CudnnBuffers b = cudnn_buffers(s.B, s.T, s.NH, s.KV, s.HS, true);
    EXPECT_EQ(gpu::cudnn_attention_qkv_bytes(s.B, s.T, s.NH, s.KV, s.HS), b.qkv16);
    EXPECT_EQ(gpu::cudnn_attention_out_bytes(s.B, s.T, s.NH, s.HS), b.out16);
    EXPECT_EQ(gpu::cudnn_attention_row_bytes(s.B, s.T, s.NH), b.row_sums);
    for (bool backward : {false, true}) {
      const CudnnBuffers want = cudnn_buffers(s.B, s.T, s.NH, s.KV, s.HS, backward);
      const gpu::CudnnAttentionMemory m = gpu::cudnn_attention_memory(s.B, s.T, s.NH, s.KV, s.HS, backward);
      EXPECT_EQ(m.qkv16, want.qkv16);
      EXPECT_EQ(m.out16, want.out16);
      EXPECT_EQ(m.dout16, want.dout16);
      EXPECT_EQ(m.dqkv16, want.dqkv16);
      EXPECT_EQ(m.row_sums, want.row_sums);
      EXPECT_EQ(m.staging(), want.qkv16 + want.out16 + want.dout16 + want.dqkv16 + want.row_sums);
      // The workspace is the largest plan's: the backward's when there is one.
      const size_t workspace = backward ? std::max(forward_estimate(s.B, s.T, s.NH),
                                                   backward_estimate(s.B, s.T, s.NH, s.KV, s.HS))
                                        : forward_estimate(s.B, s.T, s.NH);
      EXPECT_EQ(m.workspace, workspace);
      EXPECT_EQ(m.total(), m.staging() + workspace);
      // Each buffer its own allocation: two staging buffers and the workspace, or five and it.
      EXPECT_EQ(m.allocations().size(), backward ? 6u : 3u);
    }
  }
  // GPT-2 small's heads at B=8, T=1024: 2 x 36 MiB of qkv, 2 x 12 MiB of out, 384 KiB of row sums,
  // docs/gpu.md's "about 100 MiB".
  EXPECT_EQ(gpu::cudnn_attention_memory(8, 1024, 12, 12, 64, true).staging(),
            2 * (size_t{36} << 20) + 2 * (size_t{12} << 20) + (size_t{384} << 10));
}

// Packed documents add the (B,1,T,T) bf16 score bias, one more allocation, to either direction;
// the run's plan has it exactly when data.documents is set and cuDNN runs the attention.
TEST(GpuMemory, CudnnAttentionPackedDocumentsAddTheirScoreBias) {
  for (bool backward : {false, true}) {
    const gpu::CudnnAttentionMemory plain = gpu::cudnn_attention_memory(4, 96, 4, 2, 16, backward);
    const gpu::CudnnAttentionMemory docs = gpu::cudnn_attention_memory(4, 96, 4, 2, 16, backward, true);
    EXPECT_EQ(docs.bias, size_t{4} * 96 * 96 * 2);
    EXPECT_EQ(docs.staging(), plain.staging() + docs.bias);
    EXPECT_EQ(docs.allocations().size(), plain.allocations().size() + 1);
  }
  ModelConfig llama;
  llama.arch = "llama", llama.n_layer = 2, llama.n_embd = 64, llama.n_head = 4, llama.n_kv_head = 2;
  llama.vocab_size = 256, llama.max_seq_len = 96, llama.intermediate_size = 128;
  ComputeOptions compute;
  compute.device = "cuda", compute.attention = ATTENTION_CUDNN;
  const size_t without = plan_cudnn_attention(llama, {}, 4, 96, compute).staging();
  compute.packed_documents = true;
  EXPECT_EQ(plan_cudnn_attention(llama, {}, 4, 96, compute).staging(), without + size_t{4} * 96 * 96 * 2);
  compute.attention = ATTENTION_TILED;
  EXPECT_EQ(plan_cudnn_attention(llama, {}, 4, 96, compute).staging(), 0u);
}

TEST(GpuMemory, CudnnAttentionWorkspaceEstimatesBoundTheDpWorkspace) {
  // T' = T rounded up to 64: T = 64 and 65 differ by a whole tile.
  EXPECT_EQ(gpu::cudnn_attention_forward_workspace_estimate(2, 64, 4, 4, 64), forward_estimate(2, 64, 4));
  EXPECT_EQ(gpu::cudnn_attention_forward_workspace_estimate(2, 65, 4, 4, 64), 2 * 2 * 4 * 128 * 4 + (1 << 20));
  EXPECT_EQ(gpu::cudnn_attention_backward_workspace_estimate(2, 64, 4, 4, 64),
            size_t{2} * 4 * 64 * 64 * 2 + size_t{2} * 4 * 64 * 64 * 4 + (1 << 20));
  EXPECT_EQ(gpu::cudnn_attention_backward_workspace_estimate(2, 65, 4, 2, 64),
            size_t{2} * 4 * 128 * 128 * 2 + 3 * (size_t{2} * 4 * 128 * 64 * 4) + (1 << 20));  // + dK, dV partials
  for (int T : {1, 7, 130, 1024, 4096})
    for (int KV : {1, 4, 12}) {
      const size_t bwd = gpu::cudnn_attention_backward_workspace_estimate(8, T, 12, KV, 64);
      EXPECT_EQ(bwd, backward_estimate(8, T, 12, KV, 64)) << T << " " << KV;
      // At least the deterministic backward's dP workspace (cuDNN frontend's sizing, B*NH*T*T*2
      // on 64-row tiles), and more than the forward's.
      EXPECT_GE(bwd, size_t{8} * 12 * T * T * 2);
      EXPECT_GT(bwd, gpu::cudnn_attention_forward_workspace_estimate(8, T, 12, KV, 64));
    }
  // GPT-2 small at T = 1024: dP alone is 192 MiB (docs/gpu.md).
  EXPECT_EQ(gpu::cudnn_attention_backward_workspace_estimate(8, 1024, 12, 12, 64),
            (size_t{192} << 20) + (size_t{24} << 20) + (size_t{1} << 20));
}

TEST(GpuMemory, CudnnAttentionHeadSizeRule) {
  for (int HS : {8, 16, 24, 64, 96, 128}) EXPECT_TRUE(gpu::cudnn_attention_takes_head_size(HS)) << HS;
  for (int HS : {0, -8, 1, 10, 12, 60, 136, 256}) {
    EXPECT_FALSE(gpu::cudnn_attention_takes_head_size(HS)) << HS;
    EXPECT_NE(gpu::cudnn_attention_head_size_refusal(HS).find(std::to_string(HS)), std::string::npos) << HS;
  }
}

struct PlanCase {
  ModelConfig model;
  GroupShape groups;
  EngineOptions engine;
  bool checkpointing;
};

std::vector<PlanCase> plan_cases() {
  std::vector<PlanCase> cases;
  for (const ModelConfig& model : {gpt_config(), llama_config()})
    for (bool ckpt : {false, true}) {
      EngineOptions e;
      cases.push_back({model, GroupShape{4, 0, 1, 0}, e, ckpt});
      e.nccl = true, e.overlap_reduce_scatter = true;
      cases.push_back({model, GroupShape{3, 1, 2, 0}, e, ckpt});  // padded units, replicas
      e.param_dtype = DTYPE_BF16, e.reduce_dtype = DTYPE_BF16, e.strategy = SHARDING_SHARD_GRAD_OP;
      cases.push_back({model, GroupShape{2, 0, 1, 0}, e, ckpt});
      e = EngineOptions{}, e.cpu_offload = true, e.reduce_every_microbatch = false;
      cases.push_back({model, GroupShape{4, 2, 1, 0}, e, ckpt});
      e = EngineOptions{}, e.strategy = SHARDING_NO_SHARD;
      cases.push_back({model, GroupShape{1, 0, 4, 1}, e, ckpt});
    }
  return cases;
}

// The list the rounding needs sums, category by category, to what the plan (and the trainer's
// tracking) has: a changed constructor that the list does not follow fails here.
TEST(GpuMemoryPlan, AllocationListSumsToThePlannedCategories) {
  ComputeOptions cpu;
  for (const PlanCase& c : plan_cases()) {
    const ParamTable table(c.model);
    const MemoryPlan plan = plan_rank_memory(table, c.groups, c.engine, 2, 24, c.checkpointing, cpu, {});
    std::array<size_t, MEM_CATEGORY_COUNT> sums{};
    for (const PlannedAllocation& a : plan_device_allocations(table, c.groups, c.engine, 2, 24, c.checkpointing)) {
      EXPECT_GT(a.bytes, 0u);
      sums[a.category] += a.bytes;
    }
    for (int k = 0; k < MEM_CATEGORY_COUNT; k++)
      EXPECT_EQ(sums[k], plan.bytes[k]) << mem_category_name(static_cast<MemCategory>(k)) << " "
                                        << c.model.arch << " shard " << c.groups.shard_size;
  }
}

// A quantized frozen base (fsdp.frozen_dtype): its records, held and gathered, in the list too.
TEST(GpuMemoryPlan, AllocationListCountsAQuantizedBase) {
  ComputeOptions cpu;
  AdapterConfig lora;
  lora.type = ADAPTER_LORA, lora.rank = 4;
  for (const PlanCase& c : plan_cases())
    for (QuantType type : {QUANT_NF4, QUANT_FP8, QUANT_BF16}) {
      AdapterConfig adapter = lora;
      adapter.targets = {c.model.arch == "llama" ? "q_proj" : "c_attn"};
      const ParamTable table(c.model, {}, adapter, QuantConfig{type, 32});
      const MemoryPlan plan = plan_rank_memory(table, c.groups, c.engine, 2, 24, c.checkpointing, cpu, {});
      std::array<size_t, MEM_CATEGORY_COUNT> sums{};
      for (const PlannedAllocation& a : plan_device_allocations(table, c.groups, c.engine, 2, 24, c.checkpointing))
        sums[a.category] += a.bytes;
      for (int k = 0; k < MEM_CATEGORY_COUNT; k++)
        EXPECT_EQ(sums[k], plan.bytes[k]) << mem_category_name(static_cast<MemCategory>(k)) << " " << c.model.arch
                                          << " " << quant_type_name(type) << " shard " << c.groups.shard_size;
    }
}

TEST(GpuMemoryPlan, ActivationListCoversAdapters) {
  AdapterConfig lora;
  lora.type = ADAPTER_DORA, lora.rank = 4, lora.targets = {"attn.c_attn", "mlp.c_fc"};
  const ParamTable table(gpt_config(), {}, lora);
  size_t sum = 0;
  for (const PlannedAllocation& a : plan_device_allocations(table, GroupShape{}, EngineOptions{}, 2, 24, false))
    if (a.category == MEM_ACTIVATIONS) sum += a.bytes;
  EXPECT_EQ(sum, plan_activation_bytes(table, 2, 24, false));
}

// With bf16 operands a block buffer's quantized tail has no memory: CUDA maps its fp32 head in
// the driver's 2 MiB granules, and the rounding counts those, not the allocator's classes, for
// exactly the gathered buffers that take that path (a DeviceArray whose backed part is short).
TEST(GpuMemoryPlan, MappedHeadsRoundToTheDriversGranule) {
  AdapterConfig lora;
  lora.type = ADAPTER_LORA, lora.rank = 4, lora.targets = {"q_proj"};
  const ParamTable table(llama_config(), {}, lora, QuantConfig{QUANT_NF4, 32});
  EngineOptions e;
  e.param_dtype = DTYPE_BF16, e.linear_weights_in_half_only = true;
  const GroupShape groups{2, 0, 1, 0};
  std::vector<PlannedAllocation> list = plan_device_allocations(table, groups, e, 2, 24, false);
  size_t short_slots = 0;
  for (const FsdpEngine::GatherSlot& slot : FsdpEngine::plan_gather_slots(FsdpEngine::plan_layout(table, groups), e))
    short_slots += slot.backed > 0 && slot.backed < slot.numel;
  size_t mapped = 0, expected = 0;
  for (PlannedAllocation& a : list)
    if (a.mapped) {
      EXPECT_EQ(a.category, MEM_GATHERED_UNITS);
      EXPECT_LT(a.bytes, size_t{1} << 20);  // llama_config's heads: where the two roundings differ
      mapped++;
      expected += ((a.bytes + (size_t{2} << 20) - 1) / (size_t{2} << 20) * (size_t{2} << 20) - a.bytes) -
                  (naive_block(a.bytes) - a.bytes);
      a.mapped = false;  // as an allocator block
    }
  EXPECT_EQ(mapped, short_slots);
  EXPECT_GT(mapped, 0u);
  ComputeOptions cuda;
  cuda.device = "cuda", cuda.compute_dtype = DTYPE_BF16, cuda.attention = ATTENTION_TILED;
  const GemmWorkload gemms = gemm_workload(table.config(), {}, 2, 24);
  const GpuBackendPlan as_mapped =
      plan_gpu_backend(table, groups, 2, 24, cuda, gemms, plan_device_allocations(table, groups, e, 2, 24, false),
                       false, {});
  const GpuBackendPlan as_blocks = plan_gpu_backend(table, groups, 2, 24, cuda, gemms, list, false, {});
  EXPECT_EQ(as_mapped.rounding - as_blocks.rounding, expected);
  EXPECT_EQ(as_mapped.allocations, as_blocks.allocations);
}

// cuda minus cpu, with the same engine options: exactly the GPU-only items, summed here from the
// formulas above (not from GpuBackendPlan's own total).
TEST(GpuMemoryPlan, CudaPlanMinusCpuPlanIsTheBackendsOwnMemory) {
  for (const PlanCase& c : plan_cases()) {
    const ParamTable table(c.model);
    const int B = 2, T = 24, N = B * T;
    const GemmWorkload gemms = gemm_workload(c.model, {}, B, T);
    for (DType dtype : {DTYPE_FP32, DTYPE_BF16}) {
      ComputeOptions cpu, cuda;
      cuda.device = "cuda", cuda.compute_dtype = dtype;
      cuda.attention = ATTENTION_TILED;  // cuDNN's buffers: CudnnAttentionIsTheCudnnPlanMinusTheTiledPlan
      cpu.compute_dtype = DTYPE_FP32;  // the CPU's own bf16 GEMM workspace is not what is compared
      const MemoryPlan on_cpu = plan_rank_memory(table, c.groups, c.engine, B, T, c.checkpointing, cpu, gemms);
      const MemoryPlan on_gpu = plan_rank_memory(table, c.groups, c.engine, B, T, c.checkpointing, cuda, gemms);
      EXPECT_EQ(on_gpu.bytes, on_cpu.bytes);  // the tracked categories are the same arrays
      EXPECT_EQ(on_cpu.gpu.total(), 0u);

      const ModelConfig& m = c.model;
      size_t kernels = std::max(gpu::attention_backward_workspace_bytes(B, T, m.n_head, m.kv_heads(), m.head_size()),
                                gpu::encoder_backward_workspace_estimate(B, T));
      if (m.arch == "llama") {
        kernels = std::max(kernels, gpu::rmsnorm_backward_workspace_bytes(N, m.n_embd));
      } else {
        kernels = std::max(kernels, gpu::layernorm_backward_workspace_bytes(N, m.n_embd));
        for (int oc : {3 * m.n_embd, m.n_embd, 4 * m.n_embd})  // qkv, attention and MLP projections
          kernels = std::max(kernels, gpu::matmul_backward_workspace_bytes(N, oc));
      }
      size_t operands = 0;  // the LM head's backward: dout N x V and inp N x C (the weight comes rounded)
      if (dtype != DTYPE_FP32) operands = gpu::matmul_backward_operand_bytes(N, m.n_embd, m.vocab_size, false);
      // The shard and replica communicators, and the step sums' world communicator unless offloaded.
      const size_t per_communicator = gpu::nccl_communicator_bytes(2, gpu::nccl_buffer_sizes());
      const bool world = !c.engine.cpu_offload && c.groups.shard_size * c.groups.replica_size > 1;
      const size_t nccl = cuda.nccl() ? ((c.groups.shard_size > 1) + (c.groups.replica_size > 1) + world) * per_communicator
                                      : 0;
      std::vector<size_t> sizes = {gpu::kCublasLtWorkspaceBytes, kernels, gpu::reduce_scratch_bytes()};
      if (operands) sizes.push_back(operands);
      const size_t workspace = sizes[0] + sizes[1] + sizes[2] + operands;
      for (const PlannedAllocation& a : plan_device_allocations(table, c.groups, c.engine, B, T, c.checkpointing))
        sizes.push_back(a.bytes);
      const size_t rounding = naive_rounding(sizes);
      EXPECT_EQ(on_gpu.gpu.workspace(), workspace);
      EXPECT_EQ(on_gpu.gpu.nccl, nccl);
      EXPECT_EQ(on_gpu.gpu.rounding, rounding);
      EXPECT_EQ(on_gpu.total() - on_cpu.total(), workspace + nccl + rounding)
          << m.arch << " shard " << c.groups.shard_size << " " << dtype_name(dtype);
    }
  }
}

// train.attention=cudnn adds exactly cuDNN attention's buffers: the cudnn plan minus the tiled
// plan is the new field in the workspace, and in the rounding each of its allocations' own. auto
// plans what it runs: the tiled kernels in fp32, cuDNN with bf16 operands.
TEST(GpuMemoryPlan, CudnnAttentionIsTheCudnnPlanMinusTheTiledPlan) {
  for (const PlanCase& c : plan_cases()) {
    const ParamTable table(c.model);
    const int B = 2, T = 24;
    const GemmWorkload gemms = gemm_workload(c.model, {}, B, T);
    for (DType dtype : {DTYPE_FP32, DTYPE_BF16}) {
      ComputeOptions tiled, autod, cudnn;
      for (ComputeOptions* o : {&tiled, &autod, &cudnn}) o->device = "cuda", o->compute_dtype = dtype;
      tiled.attention = ATTENTION_TILED, cudnn.attention = ATTENTION_CUDNN;  // autod: AUTO
      const MemoryPlan t = plan_rank_memory(table, c.groups, c.engine, B, T, c.checkpointing, tiled, gemms);
      const MemoryPlan a = plan_rank_memory(table, c.groups, c.engine, B, T, c.checkpointing, autod, gemms);
      const MemoryPlan d = plan_rank_memory(table, c.groups, c.engine, B, T, c.checkpointing, cudnn, gemms);
      EXPECT_EQ(t.gpu.attention(), 0u);
      EXPECT_EQ(t.gpu.cudnn_attention.allocations().size(), 0u);
      EXPECT_EQ(autod.attention_kernel(), dtype == DTYPE_FP32 ? ATTENTION_TILED : ATTENTION_CUDNN);
      EXPECT_EQ(a.total(), dtype == DTYPE_FP32 ? t.total() : d.total());

      const ModelConfig& m = c.model;
      const CudnnBuffers b = cudnn_buffers(B, T, m.n_head, m.kv_heads(), m.head_size(), true);
      const size_t workspace = backward_estimate(B, T, m.n_head, m.kv_heads(), m.head_size());
      const size_t staging = b.qkv16 + b.out16 + b.dout16 + b.dqkv16 + b.row_sums;
      ASSERT_GT(staging, 0u);
      EXPECT_EQ(d.gpu.cudnn_attention.staging(), staging);
      EXPECT_EQ(d.gpu.cudnn_attention.workspace, workspace);
      EXPECT_EQ(d.gpu.attention(), staging + workspace);
      EXPECT_EQ(d.bytes, t.bytes);  // the tracked categories do not change
      EXPECT_EQ(d.gpu.workspace() - t.gpu.workspace(), staging + workspace);
      EXPECT_EQ(d.gpu.nccl, t.gpu.nccl);
      const size_t rounding = naive_rounding({b.qkv16, b.out16, b.dout16, b.dqkv16, b.row_sums, workspace});
      EXPECT_EQ(d.gpu.rounding - t.gpu.rounding, rounding);
      EXPECT_EQ(d.gpu.allocations - t.gpu.allocations, 6u);
      // The pre-flight check compares total() with the GPU's free memory: the field is in it.
      EXPECT_EQ(d.total() - t.total(), staging + workspace + rounding)
          << m.arch << " shard " << c.groups.shard_size << " " << dtype_name(dtype);
    }
  }
}

// A head size cuDNN refuses (12: not a multiple of 8; 136: over 128) runs on the tiled kernels:
// nothing of cuDNN's is planned.
TEST(GpuMemoryPlan, CudnnAttentionOfARefusedHeadSizeIsZero) {
  for (int n_head : {8, 1}) {
    ModelConfig c = gpt_config();
    c.n_embd = n_head == 8 ? 96 : 136, c.n_head = n_head;
    ASSERT_FALSE(gpu::cudnn_attention_takes_head_size(c.head_size()));
    const ParamTable table(c);
    ComputeOptions tiled, cudnn;
    tiled.device = cudnn.device = "cuda", tiled.attention = ATTENTION_TILED, cudnn.attention = ATTENTION_CUDNN;
    const MemoryPlan t = plan_rank_memory(table, GroupShape{2, 0, 1, 0}, EngineOptions{}, 2, 24, false, tiled, {});
    const MemoryPlan d = plan_rank_memory(table, GroupShape{2, 0, 1, 0}, EngineOptions{}, 2, 24, false, cudnn, {});
    EXPECT_EQ(d.gpu.attention(), 0u) << c.head_size();
    EXPECT_EQ(d.total(), t.total()) << c.head_size();
  }
}

// A distillation teacher's forward runs on the same ops: each staging buffer grows to the larger of
// the student's (forward and backward) and the teacher's (forward: qkv and out), the workspace to
// the largest plan's. A teacher whose head size cuDNN refuses adds nothing.
TEST(GpuMemoryPlan, CudnnAttentionCountsTheTeachersForward) {
  const ModelConfig student = gpt_config();  // NH 4, HS 24
  ModelConfig big = gpt_config(), refused = gpt_config();
  big.n_embd = 256, big.n_head = 2;            // HS 128: larger qkv and out than the student's
  refused.n_embd = 160, refused.n_head = 16;  // HS 10
  const ParamTable table(student), big_table(big), refused_table(refused);
  ComputeOptions cudnn;
  cudnn.device = "cuda", cudnn.attention = ATTENTION_CUDNN;
  const int B = 2, T = 24;
  const MemoryPlan alone = plan_rank_memory(table, GroupShape{}, EngineOptions{}, B, T, false, cudnn, {});
  const MemoryPlan with_big =
      plan_rank_memory(table, GroupShape{}, EngineOptions{}, B, T, false, cudnn, {}, {{"teacher", "distill.teacher", big_table, T, true, 0}});
  const MemoryPlan with_refused =
      plan_rank_memory(table, GroupShape{}, EngineOptions{}, B, T, false, cudnn, {}, {{"teacher", "distill.teacher", refused_table, T, true, 0}});
  const CudnnBuffers s = cudnn_buffers(B, T, 4, 4, 24, true), t = cudnn_buffers(B, T, 2, 2, 128, false);
  ASSERT_GT(t.qkv16, s.qkv16);
  ASSERT_GT(t.out16, s.out16);
  const gpu::CudnnAttentionMemory& g = with_big.gpu.cudnn_attention;
  EXPECT_EQ(g.qkv16, t.qkv16);
  EXPECT_EQ(g.out16, t.out16);
  EXPECT_EQ(g.dout16, s.dout16);
  EXPECT_EQ(g.dqkv16, s.dqkv16);
  EXPECT_EQ(g.row_sums, s.row_sums);
  EXPECT_EQ(g.workspace, std::max(backward_estimate(B, T, 4, 4, 24), forward_estimate(B, T, 2)));
  EXPECT_EQ(alone.gpu.cudnn_attention.staging(), s.qkv16 + s.out16 + s.dout16 + s.dqkv16 + s.row_sums);
  EXPECT_EQ(with_refused.gpu.attention(), alone.gpu.attention());
}

// FLUX's kernels ask for their own workspaces: the joint attention's row sums over S = L + N tokens,
// the q/k norms over B*S*H rows of a head, the per-sample modulation and gate sums over S rows,
// and the biased products over B*S rows; none of a decoder's (no embedding sort, no LayerNorm
// with parameters). A long text makes the joint attention the largest.
TEST(GpuMemoryPlan, FluxPlansItsOwnKernelsWorkspaces) {
  ModelConfig m = testing::tiny_flux_config();
  m.context_len = 3984;
  const ParamTable table(m);
  const int B = 4, T = 16, S = m.context_len + T, H = m.n_head, D = m.head_size(), C = m.n_embd;
  size_t biases = 0;
  for (const LinearSite& site : table.all_sites())
    if (site.bias >= 0) biases = std::max(biases, gpu::matmul_backward_workspace_bytes(B * S, site.width));
  const size_t attention = size_t{4} * B * H * S;
  ASSERT_EQ(gpu::attention_backward_workspace_bytes(B, S, H, H, D), attention);
  const size_t expected = std::max({attention, gpu::rmsnorm_backward_workspace_bytes(B * S * H, D),
                                    gpu::modulate_backward_workspace_bytes(S, C),
                                    gpu::gate_backward_workspace_bytes(S, C), biases});
  ASSERT_EQ(expected, attention);
  ComputeOptions cuda;
  cuda.device = "cuda", cuda.attention = ATTENTION_TILED;
  const MemoryPlan plan = plan_rank_memory(table, GroupShape{1, 0, 1, 0}, EngineOptions{}, B, T, false, cuda, {});
  EXPECT_EQ(plan.gpu.kernel_workspace, expected);
  EXPECT_STREQ(plan.gpu.largest_kernel, "joint attention backward");
  EXPECT_EQ(plan.gpu.attention(), 0u);
  // Every kind of row asks (the column sums' chunks do not grow steadily with the rows): the image
  // stream's N = T and the text's L rows too, and the samples' modulations.
  for (int rows : {T, m.context_len, S}) {
    EXPECT_GE(plan.gpu.kernel_workspace, gpu::modulate_backward_workspace_bytes(rows, C)) << rows;
    EXPECT_GE(plan.gpu.kernel_workspace, gpu::matmul_backward_workspace_bytes(B * rows, 4 * C)) << rows;
  }
  EXPECT_GE(plan.gpu.kernel_workspace, gpu::matmul_backward_workspace_bytes(B, 6 * C));

  // The allocation list (the allocator's rounding) holds what the model allocates: no token ids,
  // no empty arrays, the adapters with their dropout keys; it sums to the plan's categories.
  for (bool ckpt : {false, true}) {
    AdapterConfig lora;
    lora.type = ADAPTER_LORA, lora.targets = {"attn.to_q", "proj_mlp"}, lora.rank = 4, lora.dropout = 0.1;
    const ParamTable adapted(m, {}, lora);
    const MemoryPlan p = plan_rank_memory(adapted, GroupShape{2, 0, 1, 0}, EngineOptions{}, B, T, ckpt, ComputeOptions{}, {});
    std::array<size_t, MEM_CATEGORY_COUNT> sums{};
    for (const PlannedAllocation& a : plan_device_allocations(adapted, GroupShape{2, 0, 1, 0}, EngineOptions{}, B, T, ckpt)) {
      EXPECT_GT(a.bytes, 0u);
      sums[a.category] += a.bytes;
    }
    for (int k = 0; k < MEM_CATEGORY_COUNT; k++)
      EXPECT_EQ(sums[k], p.bytes[k]) << mem_category_name(static_cast<MemCategory>(k)) << " flux ckpt " << ckpt;
  }

  // cuDNN's attention (its unmasked graph) over the joint sequence: the staging buffers of S tokens.
  m.context_len = 40;  // S = 56
  const ParamTable small(m);
  cuda.attention = ATTENTION_CUDNN, cuda.compute_dtype = DTYPE_BF16;
  const MemoryPlan with_cudnn = plan_rank_memory(small, GroupShape{1, 0, 1, 0}, EngineOptions{}, B, T, false, cuda, {});
  const CudnnBuffers b = cudnn_buffers(B, 56, H, H, D, true);
  EXPECT_EQ(with_cudnn.gpu.cudnn_attention.staging(), b.qkv16 + b.out16 + b.dout16 + b.dqkv16 + b.row_sums);
  EXPECT_EQ(with_cudnn.gpu.cudnn_attention.workspace, backward_estimate(B, 56, H, H, D));
}

TEST(GpuMemoryPlan, MpiOnTheGpuHasNoNcclBuffers) {
  const ParamTable table(gpt_config());
  ComputeOptions cuda;
  cuda.device = "cuda", cuda.comm = COMM_MPI;
  const MemoryPlan plan = plan_rank_memory(table, GroupShape{4, 0, 1, 0}, EngineOptions{}, 2, 24, false, cuda, {});
  EXPECT_EQ(plan.gpu.nccl, 0u);
  EXPECT_GT(plan.gpu.workspace(), gpu::kCublasLtWorkspaceBytes);
}

}  // namespace
}  // namespace shardtrain
