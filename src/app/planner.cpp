// See planner.hpp. Speed order among the combinations that fit: no CPU offload first (it copies
// every shard to the device per gather and runs AdamW on the CPU: the last resort, considered for
// FULL_SHARD only), then the fewest blocks recomputed (activation checkpointing repeats a block's
// forward, about a third more of its compute: where recomputing every block fits and none does
// not, the fewest first blocks that fit, fsdp.checkpoint_blocks), then the fewest bytes moved per
// step per rank. Traffic per rank per
// step, Psi = padded parameters, N = shard group size, R = replicas, A = micro-batches per step
// (ring collectives move (n-1)/n):
//   FULL_SHARD/HYBRID  A (Psi + max(0, L - K) Psi_block)(N-1)/N all-gathers (the backward re-gathers
//                      the blocks no longer held in the K = limit_all_gathers buffers)
//                      + (A or 1) Psi (N-1)/N reduce-scatters
//   SHARD_GRAD_OP      A Psi (N-1)/N all-gathers + (A or 1) Psi (N-1)/N reduce-scatters
//   NO_SHARD / HYBRID replicas: all-reduce of 2 (Psi/N)(R-1)/R
#include "app/planner.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <optional>

#include "app/memory_plan.hpp"
#include "app/options.hpp"
#include "core/counted.hpp"
#include "core/format.hpp"

namespace shardtrain {
namespace {

constexpr uint64_t MAX_PLANNED_RANKS = 1 << 20;

struct Candidate {
  // NO_SHARD's gradients are unsharded anyway: it always all-reduces once per step.
  const char* reduce_label() const { return reduce_every_microbatch && strategy != SHARDING_NO_SHARD ? "micro" : "step"; }
  ShardingStrategy strategy;
  bool reduce_every_microbatch;
  Checkpointing checkpointing;
  int recomputed;  // blocks: 0, some (fsdp.checkpoint_blocks) or all
  bool offload;
  int shard_size, replicas;
  MemoryPlan memory;
  double traffic_bytes;
  bool fits;
};

double traffic_per_step(const ParamTable& table, const Candidate& c, const EngineOptions& options, int accumulation) {
  const double N = c.shard_size, R = c.replicas, A = accumulation;
  // Every parameter is gathered -- a quantized space as its records (docs/quantization.md) --;
  // only the trainable ones (docs/freezing.md) are reduced.
  auto padded = [N](double numel) { return std::ceil(numel / N) * N; };
  const QuantConfig& quant = table.quant();
  auto gathered_bytes = [&](const UnitInfo& unit) {
    return padded(static_cast<double>(unit.plain_numel)) * dtype_bytes(options.param_dtype) +
           padded(static_cast<double>(unit.quantized_numel / quant.block)) *
               quant_record_bytes(quant.type, quant.block, quant.nested);
  };
  double psi = 0, trainable = 0, block = 0;
  for (size_t u = 0; u < table.units().size(); u++) {
    const UnitInfo& unit = table.units()[u];
    psi += gathered_bytes(unit);
    trainable += padded(static_cast<double>(unit.trainable_numel));
    if (u != ROOT_UNIT) block = gathered_bytes(unit);
  }
  double bytes = 0;
  if (N > 1) {
    const double regathered = std::max(0, table.block_count() - options.limit_all_gathers) * block;
    const double gathers = c.strategy == SHARDING_SHARD_GRAD_OP ? A * psi : A * (psi + regathered);
    const double reduces = (c.reduce_every_microbatch ? A : 1) * trainable;
    bytes += (gathers + reduces * dtype_bytes(options.reduce_dtype)) * (N - 1) / N;
  }
  if (R > 1) bytes += 4 * 2 * (trainable / N) * (R - 1) / R;  // replica all-reduce, fp32
  return bytes;
}

// Every strategy and option for `config`'s model and batch shape on `world` ranks.
std::vector<Candidate> plan_candidates(const Config& config, int world, int ranks_per_node, size_t limit) {
  const ParamTable table = config_param_table(config);
  const std::vector<FrozenCompanion> frozen = frozen_companions(config, world);  // a teacher's, a text encoder's; read once
  const int accumulation = std::max(1, config.train.global_batch / (config.train.micro_batch * world));
  const GemmWorkload gemms = gemm_workload(config.model, frozen, config.train.micro_batch, config.train.seq_len);
  const int blocks = table.block_count();
  std::vector<Candidate> candidates;
  const ShardingStrategy strategies[] = {SHARDING_NO_SHARD, SHARDING_HYBRID_SHARD, SHARDING_SHARD_GRAD_OP,
                                         SHARDING_FULL_SHARD};
  for (ShardingStrategy s : strategies) {
    int shard = s == SHARDING_NO_SHARD ? 1 : (s == SHARDING_HYBRID_SHARD ? ranks_per_node : world);
    if (s == SHARDING_HYBRID_SHARD && (ranks_per_node == world || ranks_per_node == 1)) continue;  // = FULL/NO_SHARD
    for (bool every : {true, false}) {
      if (s == SHARDING_NO_SHARD && every) continue;  // NO_SHARD always reduces once per step
      for (bool offload : {false, true}) {
        if (offload && s != SHARDING_FULL_SHARD) continue;
        Config candidate = config;  // what the engine derives from them (fsdp.keep_half_shard=auto) follows
        candidate.fsdp.sharding_strategy = s, candidate.fsdp.reduce_every_microbatch = every;
        candidate.fsdp.cpu_offload = offload;
        const EngineOptions options = engine_options(candidate);
        auto plan = [&](Checkpointing ckpt) {
          Candidate c{s, every, ckpt, ckpt.count(blocks), offload, shard, world / shard, {}, 0, false};
          c.memory = plan_rank_memory(table, GroupShape{shard, 0, world / shard, 0}, options,
                                      config.train.micro_batch, config.train.seq_len, ckpt,
                                      compute_options(config), gemms, frozen);
          c.traffic_bytes = traffic_per_step(table, c, options, accumulation);
          c.fits = limit == 0 || c.memory.total() <= limit;
          return c;
        };
        const Candidate none = plan(false), every_block = plan(true);
        candidates.push_back(none);
        // Between them, the fewest first blocks that fit: each recomputed block frees its
        // activations (but a decoder's first, whose set the others share), so the bytes fall with
        // the count, and a bisection finds it.
        if (!none.fits && every_block.fits) {
          std::optional<Candidate> fewest;
          for (int lo = 1, hi = blocks - 1; lo <= hi;) {
            const int k = (lo + hi) / 2;
            Candidate some = plan(Checkpointing::first(k));
            if (some.fits) fewest = some, hi = k - 1;
            else lo = k + 1;
          }
          if (fewest) candidates.push_back(*fewest);
        }
        candidates.push_back(every_block);
      }
    }
  }
  return candidates;
}

// The GPU backend's part of every candidate's peak, item by item (the same for every candidate
// but NCCL's, which depends on the communicators, and the rounding, which is per allocation).
void describe_gpu_backend(const GpuBackendPlan& g, bool nccl) {
  std::printf("\nGPU backend (in peak/rank): workspace = cuBLASLt %s + kernels %s (largest: %s) + reductions %s + "
              "16-bit GEMM operands %s%s; rounding = the caching allocator's size classes (512 B up to 1 MiB, "
              "2 MiB above) and the mapped fp32 heads' 2 MiB granules, over %zu allocations\n",
              human_bytes(static_cast<double>(g.cublaslt)).c_str(),
              human_bytes(static_cast<double>(g.kernel_workspace)).c_str(), g.largest_kernel,
              human_bytes(static_cast<double>(g.reduce_scratch)).c_str(),
              human_bytes(static_cast<double>(g.operand_copies)).c_str(),
              g.attention() ? (" + cuDNN attention ~" + human_bytes(static_cast<double>(g.attention()))).c_str() : "",
              g.allocations);
  if (g.attention()) {
    const gpu::CudnnAttentionMemory& a = g.cudnn_attention;
    auto h = [](size_t bytes) { return human_bytes(static_cast<double>(bytes)); };
    std::printf("~ workspace includes cuDNN attention (train.attention=cudnn) %s: bf16 staging %s (qkv %s, dqkv %s, "
                "out %s, dout %s, row sums %s) + cuDNN's own workspace %s, an ESTIMATE (upper bound: the "
                "deterministic backward's dP, B*NH*T'^2*2 bytes, + an fp32 dQ and with grouped heads fp32 dK and dV "
                "partials, B*NH*T'*HS*4 each, + %s; T' = seq_len rounded up to %d); cuDNN sizes it only at run time\n",
                h(g.attention()).c_str(), h(a.staging()).c_str(), h(a.qkv16).c_str(), h(a.dqkv16).c_str(),
                h(a.out16).c_str(), h(a.dout16).c_str(), h(a.row_sums).c_str(), h(a.workspace).c_str(),
                h(gpu::kCudnnAttentionWorkspaceSlackBytes).c_str(), gpu::kCudnnAttentionTile);
  }
  if (nccl)
    std::printf("~ comm includes NCCL's own buffers, an ESTIMATE: per communicator of more than one rank, %d "
                "channels x (Simple %s + LL %s + LL128 %s) (NCCL_MAX_NCHANNELS, NCCL_BUFFSIZE, NCCL_LL_BUFFSIZE, "
                "NCCL_LL128_BUFFSIZE); NCCL picks its channels at start-up\n",
                g.nccl_sizes.channels, human_bytes(static_cast<double>(g.nccl_sizes.simple)).c_str(),
                human_bytes(static_cast<double>(g.nccl_sizes.ll)).c_str(),
                human_bytes(static_cast<double>(g.nccl_sizes.ll128)).c_str());
  std::printf("\n");
}

// The fastest candidate that fits (see the top of this file), or null.
const Candidate* recommend(const std::vector<Candidate>& candidates) {
  const Candidate* best = nullptr;
  auto faster = [](const Candidate& a, const Candidate& b) {
    if (a.offload != b.offload) return !a.offload;
    if (a.recomputed != b.recomputed) return a.recomputed < b.recomputed;
    if (a.traffic_bytes != b.traffic_bytes) return a.traffic_bytes < b.traffic_bytes;
    return a.memory.total() < b.memory.total();
  };
  for (const Candidate& c : candidates)
    if (c.fits && (!best || faster(c, *best))) best = &c;
  return best;
}

// "no", "yes" (every block) or "12/56" (the first 12 of 56 blocks).
std::string recompute_label(const Candidate& c, int blocks) {
  return c.recomputed == 0 ? "no" : c.checkpointing.every() ? "yes" : strprintf("%d/%d", c.recomputed, blocks);
}

std::string describe_fit(const Candidate& c) {
  return strprintf("%s per rank with %s%s%s", human_bytes(static_cast<double>(c.memory.total())).c_str(),
                   sharding_strategy_name(c.strategy),
                   !c.checkpointing.any() ? ""
                   : c.checkpointing.every()
                       ? " + activation checkpointing"
                       : strprintf(" + activation checkpointing of %d blocks", c.recomputed).c_str(),
                   c.offload ? " + CPU offload" : "");
}

// When nothing fits: the nearest changes that would, one dimension at a time, with their numbers.
std::string what_would_fit(const Config& config, int world, int ranks_per_node, size_t limit) {
  std::vector<std::string> ways;
  auto fits = [&](const Config& c, int ranks, int per_node, const std::string& change) {
    std::vector<Candidate> candidates = plan_candidates(c, ranks, per_node, limit);
    const Candidate* best = recommend(candidates);
    if (best) ways.push_back(change + " (" + describe_fit(*best) + ")");
    return best != nullptr;
  };
  const int per_rank = config.train.global_batch / world;  // sequences per rank per step
  for (int micro = config.train.micro_batch - 1; micro >= 1; micro--) {
    Config c = config;
    c.train.micro_batch = micro;
    // global_batch stays a multiple of micro_batch x ranks
    if (per_rank % micro == 0 && fits(c, world, ranks_per_node, strprintf("train.micro_batch=%d", micro))) break;
  }
  if (config.fsdp.param_dtype == DTYPE_FP32) {
    Config c = config;
    c.fsdp.param_dtype = DTYPE_BF16;
    fits(c, world, ranks_per_node, "fsdp.param_dtype=bf16");
  }
  for (int64_t ranks = int64_t{world} * 2; ranks <= 65536; ranks *= 2) {
    Config c = config;
    c.train.global_batch = static_cast<int>(std::max<int64_t>(config.train.global_batch, ranks * config.train.micro_batch));
    const int per_node = static_cast<int>(std::min<int64_t>(ranks_per_node, ranks));
    if (fits(c, static_cast<int>(ranks), per_node, strprintf("%lld ranks", static_cast<long long>(ranks)))) break;
  }
  for (int seq = config.train.seq_len / 2; seq >= 1; seq /= 2) {
    Config c = config;
    c.train.seq_len = seq;
    if (fits(c, world, ranks_per_node, strprintf("train.seq_len=%d", seq))) break;
  }
  std::string text;
  for (const std::string& way : ways) text += (text.empty() ? "" : "; ") + way;
  return text.empty() ? "no single change of micro-batch, param dtype, rank count (up to 65536) or sequence length "
                        "fits; raise the limit"
                      : text;
}

}  // namespace

void run_planner(const Runtime& rt, const std::vector<std::string>& args) {
  int world = 0, ranks_per_node = 0;
  bool lines = false;  // --format lines: the PLAN lines for scripts after the table
  MemorySize limit_option;
  std::vector<std::string> train_args;
  for (size_t i = 0; i < args.size(); i++) {  // our three options; the rest are train options
    auto value = [&](const std::string& name) -> std::optional<std::string> {
      if (args[i] == "--" + name) {
        if (i + 1 == args.size()) throw UsageError("--" + name + " needs a value; see 'shardtrain plan --help'");
        return args[++i];
      }
      if (args[i].rfind("--" + name + "=", 0) == 0) return args[i].substr(name.size() + 3);
      return std::nullopt;
    };
    if (auto v = value("world-size")) {
      world = static_cast<int>(parse_whole_number(*v, "--world-size", 1, MAX_PLANNED_RANKS));
    } else if (auto limit = value("memory-limit")) {
      limit_option = parse_memory_limit(*limit, "--memory-limit");
    } else if (auto format = value("format")) {
      if (*format != "table" && *format != "lines")
        throw UsageError("--format='" + printable_text(*format) + "' is not allowed; allowed: table, lines");
      lines = *format == "lines";
    } else if (auto per_node = value("ranks-per-node")) {
      ranks_per_node = static_cast<int>(parse_whole_number(*per_node, "--ranks-per-node", 1, MAX_PLANNED_RANKS));
    } else {
      train_args.push_back(args[i]);
    }
  }
  ParsedTrainArgs parsed = parse_train_args(train_args, "plan");
  if (parsed.help) {
    if (rt.is_root())
      std::printf("usage: shardtrain plan --config FILE --world-size N [--memory-limit 24GiB] [--ranks-per-node K]\n"
                  "                       [--format table|lines] [--section.key=value ...]\n\n"
                  "Predicts each rank's peak memory by category for every fsdp strategy and option on N ranks\n"
                  "(without allocating the model) and recommends the fastest combination that fits.\n"
                  "--memory-limit defaults to fsdp.memory_limit; --ranks-per-node (default N) sizes HYBRID_SHARD;\n"
                  "--format lines adds one 'PLAN key=value ...' line per row, exact bytes, for scripts.\n");
    return;
  }
  const Config& config = parsed.config;
  if (world < 1) throw UsageError("plan needs --world-size N (the rank count to plan for), N >= 1");
  if (ranks_per_node < 0 || (ranks_per_node > 0 && world % ranks_per_node != 0))
    throw UsageError("--ranks-per-node must divide --world-size");
  if (ranks_per_node == 0) ranks_per_node = world;
  validate_config(config, world);
  const size_t limit = limit_option.bytes ? limit_option.bytes : config.fsdp.memory_limit.bytes;
  const int accumulation = config.train.global_batch / (config.train.micro_batch * world);
  ParamTable table(config.model);
  std::vector<Candidate> candidates = plan_candidates(config, world, ranks_per_node, limit);
  if (!rt.is_root()) return;
  std::printf("plan: %s (%.1fM parameters), %s (%d per node), micro_batch %d x "
              "seq_len %d, %s per step, memory limit %s\n\n",
              model_summary(config.model).c_str(), table.total_params() / 1e6, counted(world, "rank").c_str(), ranks_per_node, config.train.micro_batch,
              config.train.seq_len, counted(accumulation, "micro-batch", "micro-batches").c_str(), limit ? human_bytes(static_cast<double>(limit)).c_str() : "none");
  // On a GPU two more columns: the backend's workspace and the allocator's rounding; "comm" then
  // includes NCCL's own buffers, an estimate (marked ~), and with train.attention=cudnn "workspace"
  // cuDNN's attention workspace, an estimate too (marked ~).
  const bool gpu = compute_options(config).gpu();
  const bool nccl_estimate = std::any_of(candidates.begin(), candidates.end(),
                                         [](const Candidate& c) { return c.memory.gpu.nccl > 0; });
  const bool attention_estimate = std::any_of(candidates.begin(), candidates.end(),
                                              [](const Candidate& c) { return c.memory.gpu.attention() > 0; });
  std::printf("%-14s %-9s %-5s %-7s %10s %10s %10s %10s %10s %11s", "strategy", "reduce", "ckpt", "offload", "params",
              "gathered", "grads", "optimizer", "activ.", nccl_estimate ? "comm~" : "comm");
  if (gpu) std::printf(" %10s %10s", attention_estimate ? "workspace~" : "workspace", "rounding");
  std::printf(" %11s %11s  %s\n", "peak/rank", "traffic/st", "fits");
  for (const Candidate& c : candidates) {
    const auto& b = c.memory.bytes;
    const GpuBackendPlan& g = c.memory.gpu;
    std::printf("%-14s %-9s %-5s %-7s %10s %10s %10s %10s %10s %11s", sharding_strategy_name(c.strategy),
                c.reduce_label(), recompute_label(c, table.block_count()).c_str(), c.offload ? "yes" : "no",
                human_bytes(b[MEM_SHARDED_PARAMS]).c_str(), human_bytes(b[MEM_GATHERED_UNITS]).c_str(),
                human_bytes(b[MEM_GRADIENTS]).c_str(), human_bytes(b[MEM_OPTIMIZER_STATE]).c_str(),
                human_bytes(b[MEM_ACTIVATIONS]).c_str(),
                ((g.nccl ? "~" : "") + human_bytes(b[MEM_COMM_BUFFERS] + g.nccl)).c_str());
    if (gpu)
      std::printf(" %10s %10s", ((g.attention() ? "~" : "") + human_bytes(b[MEM_WORKSPACE] + g.workspace())).c_str(),
                  human_bytes(g.rounding).c_str());
    std::printf(" %11s %11s  %s\n", human_bytes(c.memory.total()).c_str(), human_bytes(c.traffic_bytes).c_str(),
                c.fits ? "yes" : "NO");
  }
  if (gpu) describe_gpu_backend(candidates.front().memory.gpu, nccl_estimate);
  if (!candidates.front().memory.frozen.empty()) {  // their bytes depend on the shard group alone; peak/rank includes them
    std::vector<int> shown;
    for (const Candidate& c : candidates) {
      if (std::find(shown.begin(), shown.end(), c.shard_size) != shown.end()) continue;
      shown.push_back(c.shard_size);
      for (const MemoryPlan::Frozen& f : c.memory.frozen)
        std::printf("%s%s (%s, frozen, in peak/rank) with a shard group of %d: %s\n", shown.size() == 1 ? "\n" : "",
                    f.role.c_str(), f.option.c_str(), f.shard_size, describe_categories(f.bytes).c_str());
    }
    std::printf("\n");
  }
  // The same table for scripts: exact bytes (on a GPU also the backend's: nccl_bytes is the estimate).
  for (const Candidate& c : lines ? candidates : std::vector<Candidate>{}) {
    std::printf("PLAN strategy=%s reduce=%s checkpointing=%s offload=%s peak_bytes=%zu traffic_bytes=%.0f fits=%d",
                sharding_strategy_name(c.strategy), c.reduce_label(), recompute_label(c, table.block_count()).c_str(),
                c.offload ? "yes" : "no", c.memory.total(), c.traffic_bytes, c.fits ? 1 : 0);
    const GpuBackendPlan& g = c.memory.gpu;
    if (gpu)
      std::printf(" gpu_workspace_bytes=%zu cudnn_attention_bytes=%zu nccl_bytes=%zu rounding_bytes=%zu", g.workspace(),
                  g.attention(), g.nccl, g.rounding);
    for (int k = 0; k < MEM_CATEGORY_COUNT; k++)  // as the step records' peak_mem
      std::printf(" %s_bytes=%zu", mem_category_name(static_cast<MemCategory>(k)), c.memory.bytes[k]);
    std::printf("\n");
  }
  const Candidate* recommended = recommend(candidates);
  if (!recommended) {
    std::fflush(stdout);
    throw UsageError(strprintf("nothing fits in %s per rank on %d ranks; what would: %s",
                               human_bytes(static_cast<double>(limit)).c_str(), world,
                               what_would_fit(config, world, ranks_per_node, limit).c_str()));
  }
  const Candidate& best = *recommended;
  std::printf("\nrecommended: fsdp.sharding_strategy=%s fsdp.reduce_every_microbatch=%s "
              "fsdp.activation_checkpointing=%s%s fsdp.cpu_offload=%s%s\n",
              sharding_strategy_name(best.strategy), best.reduce_every_microbatch ? "true" : "false",
              best.checkpointing.any() ? "true" : "false",
              best.checkpointing.any() && !best.checkpointing.every()
                  ? strprintf(" fsdp.checkpoint_blocks=%d", best.recomputed).c_str()
                  : "",
              best.offload ? "true" : "false",
              best.strategy == SHARDING_HYBRID_SHARD ? strprintf(" fsdp.shard_group_size=%d", best.shard_size).c_str()
                                                     : "");
  std::printf("why: it needs %s per rank%s and moves %s per step per rank, the least among the combinations "
              "that fit%s.\n",
              human_bytes(best.memory.total()).c_str(),
              limit ? strprintf(" (limit %s)", human_bytes(static_cast<double>(limit)).c_str()).c_str() : "",
              human_bytes(best.traffic_bytes).c_str(),
              best.offload ? "; CPU offload is needed because nothing fits on the device without it"
              : best.checkpointing.every() ? "; activation checkpointing is needed because nothing fits without it"
              : best.checkpointing.any()
                  ? strprintf("; recomputing the first %d of the %d blocks fits and recomputing fewer does not",
                              best.recomputed, table.block_count()).c_str()
                  : " without recomputing activations");
  for (const Candidate& c : candidates)
    if (!c.fits && !c.checkpointing.any() && !c.offload && c.traffic_bytes < best.traffic_bytes)
      std::printf("  %s (reduce per %s) would move less but needs %s per rank\n", sharding_strategy_name(c.strategy),
                  c.reduce_label(), human_bytes(c.memory.total()).c_str());
}

}  // namespace shardtrain
