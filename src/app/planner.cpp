// See planner.hpp. Speed order among the combinations that fit: no CPU offload first (it copies
// every shard to the device per gather and runs AdamW on the CPU: the last resort, considered for
// FULL_SHARD only), then no recomputation (activation checkpointing repeats each block's forward,
// about a third more compute), then the fewest bytes moved per step per rank. Traffic per rank per
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

namespace shardtrain {
namespace {

struct Candidate {
  // NO_SHARD's gradients are unsharded anyway: it always all-reduces once per step.
  const char* reduce_label() const { return reduce_every_microbatch && strategy != SHARDING_NO_SHARD ? "micro" : "step"; }
  ShardingStrategy strategy;
  bool reduce_every_microbatch;
  bool checkpointing;
  bool offload;
  int shard_size, replicas;
  MemoryPlan memory;
  double traffic_bytes;
  bool fits;
};

double traffic_per_step(const ParamTable& table, const Candidate& c, const EngineOptions& options, int accumulation) {
  const double N = c.shard_size, R = c.replicas, A = accumulation;
  double psi = 0, block = 0;
  for (size_t u = 0; u < table.units().size(); u++) {
    double padded = std::ceil(static_cast<double>(table.units()[u].numel) / N) * N;
    psi += padded;
    if (u != ROOT_UNIT) block = padded;
  }
  double bytes = 0;
  if (N > 1) {
    const double regathered = std::max(0, table.config().n_layer - options.limit_all_gathers) * block;
    const double gathers = c.strategy == SHARDING_SHARD_GRAD_OP ? A * psi : A * (psi + regathered);
    const double reduces = (c.reduce_every_microbatch ? A : 1) * psi;
    bytes += (gathers * dtype_bytes(options.param_dtype) + reduces * dtype_bytes(options.reduce_dtype)) * (N - 1) / N;
  }
  if (R > 1) bytes += 4 * 2 * (psi / N) * (R - 1) / R;  // replica all-reduce, fp32
  return bytes;
}

}  // namespace

void run_planner(const Runtime& rt, const std::vector<std::string>& args) {
  int world = 0, ranks_per_node = 0;
  std::string limit_text;
  std::vector<std::string> train_args;
  for (size_t i = 0; i < args.size(); i++) {  // our three options; the rest are train options
    auto value = [&](const std::string& name) -> std::optional<std::string> {
      if (args[i] == "--" + name && i + 1 < args.size()) return args[++i];
      if (args[i].rfind("--" + name + "=", 0) == 0) return args[i].substr(name.size() + 3);
      return std::nullopt;
    };
    if (auto v = value("world-size")) {
      world = std::atoi(v->c_str());
    } else if (auto limit = value("memory-limit")) {
      limit_text = *limit;
    } else if (auto per_node = value("ranks-per-node")) {
      ranks_per_node = std::atoi(per_node->c_str());
    } else {
      train_args.push_back(args[i]);
    }
  }
  ParsedTrainArgs parsed = parse_train_args(train_args);
  if (parsed.help) {
    if (rt.is_root())
      std::printf("usage: shardtrain plan --config FILE --world-size N [--memory-limit 24GiB] [--ranks-per-node K]\n"
                  "                       [--section.key=value ...]\n\n"
                  "Predicts each rank's peak memory by category for every fsdp strategy and option on N ranks\n"
                  "(without allocating the model) and recommends the fastest combination that fits.\n"
                  "--memory-limit defaults to fsdp.memory_limit; --ranks-per-node (default N) sizes HYBRID_SHARD.\n");
    return;
  }
  const Config& config = parsed.config;
  if (world < 1) throw UsageError("plan needs --world-size N (the rank count to plan for), N >= 1");
  if (ranks_per_node < 0 || (ranks_per_node > 0 && world % ranks_per_node != 0))
    throw UsageError("--ranks-per-node must divide --world-size");
  if (ranks_per_node == 0) ranks_per_node = world;
  validate_config(config, world);
  const size_t limit = parse_memory_size(limit_text.empty() ? config.fsdp.memory_limit : limit_text, "--memory-limit");
  const int accumulation = config.train.global_batch / (config.train.micro_batch * world);
  ParamTable table(config.model);

  std::vector<Candidate> candidates;
  const ShardingStrategy strategies[] = {SHARDING_NO_SHARD, SHARDING_HYBRID_SHARD, SHARDING_SHARD_GRAD_OP,
                                         SHARDING_FULL_SHARD};
  for (ShardingStrategy s : strategies) {
    int shard = s == SHARDING_NO_SHARD ? 1 : (s == SHARDING_HYBRID_SHARD ? ranks_per_node : world);
    if (s == SHARDING_HYBRID_SHARD && (ranks_per_node == world || ranks_per_node == 1)) continue;  // = FULL/NO_SHARD
    for (bool every : {true, false}) {
      if (s == SHARDING_NO_SHARD && !every) continue;  // NO_SHARD always reduces once per step
      for (bool offload : {false, true}) {
        if (offload && s != SHARDING_FULL_SHARD) continue;
        for (bool ckpt : {false, true}) {
          Candidate c{s, every, ckpt, offload, shard, world / shard, {}, 0, false};
          EngineOptions options = engine_options(config);
          options.strategy = s, options.reduce_every_microbatch = every, options.cpu_offload = offload;
          c.memory = plan_rank_memory(config.model, GroupShape{shard, 0, world / shard, 0}, options,
                                      config.train.micro_batch, config.train.seq_len, ckpt);
          c.traffic_bytes = traffic_per_step(table, c, options, accumulation);
          c.fits = limit == 0 || c.memory.total() <= limit;
          candidates.push_back(c);
        }
      }
    }
  }
  if (!rt.is_root()) return;
  std::printf("plan: GPT-2 L=%d C=%d H=%d V=%d (%.1fM parameters), %d ranks (%d per node), micro_batch %d x "
              "seq_len %d, %d micro-batches per step, memory limit %s\n\n",
              config.model.n_layer, config.model.n_embd, config.model.n_head, config.model.vocab_size,
              table.total_params() / 1e6, world, ranks_per_node, config.train.micro_batch, config.train.seq_len,
              accumulation, limit ? format_bytes(static_cast<double>(limit)).c_str() : "none");
  std::printf("%-14s %-9s %-5s %-7s %10s %10s %10s %10s %10s %10s %11s %11s  %s\n", "strategy", "reduce", "ckpt",
              "offload", "params", "gathered", "grads", "optimizer", "activ.", "comm", "peak/rank", "traffic/st", "fits");
  for (const Candidate& c : candidates) {
    const auto& b = c.memory.bytes;
    std::printf("%-14s %-9s %-5s %-7s %10s %10s %10s %10s %10s %10s %11s %11s  %s\n",
                sharding_strategy_name(c.strategy), c.reduce_label(), c.checkpointing ? "yes" : "no",
                c.offload ? "yes" : "no", format_bytes(b[MEM_SHARDED_PARAMS]).c_str(),
                format_bytes(b[MEM_GATHERED_UNITS]).c_str(),
                format_bytes(b[MEM_GRADIENTS]).c_str(), format_bytes(b[MEM_OPTIMIZER_STATE]).c_str(),
                format_bytes(b[MEM_ACTIVATIONS]).c_str(), format_bytes(b[MEM_COMM_BUFFERS]).c_str(),
                format_bytes(c.memory.total()).c_str(), format_bytes(c.traffic_bytes).c_str(), c.fits ? "yes" : "NO");
  }
  // The same table for scripts: exact bytes.
  for (const Candidate& c : candidates)
    std::printf("PLAN strategy=%s reduce=%s checkpointing=%s offload=%s peak_bytes=%zu traffic_bytes=%.0f fits=%d\n",
                sharding_strategy_name(c.strategy), c.reduce_label(), c.checkpointing ? "yes" : "no",
                c.offload ? "yes" : "no", c.memory.total(), c.traffic_bytes, c.fits ? 1 : 0);
  std::vector<const Candidate*> fitting;
  for (const Candidate& c : candidates)
    if (c.fits) fitting.push_back(&c);
  std::sort(fitting.begin(), fitting.end(), [](const Candidate* a, const Candidate* b) {
    if (a->offload != b->offload) return !a->offload;
    if (a->checkpointing != b->checkpointing) return !a->checkpointing;
    if (a->traffic_bytes != b->traffic_bytes) return a->traffic_bytes < b->traffic_bytes;
    return a->memory.total() < b->memory.total();
  });
  if (fitting.empty()) {
    const Candidate* least = &candidates[0];
    for (const Candidate& c : candidates)
      if (c.memory.total() < least->memory.total()) least = &c;
    std::printf("\nnothing fits: the smallest need is %s per rank (%s with activation checkpointing); use more "
                "ranks, a smaller train.micro_batch or train.seq_len, or a larger limit\n",
                format_bytes(least->memory.total()).c_str(), sharding_strategy_name(least->strategy));
    return;
  }
  const Candidate& best = *fitting.front();
  std::printf("\nrecommended: fsdp.sharding_strategy=%s fsdp.reduce_every_microbatch=%s "
              "fsdp.activation_checkpointing=%s fsdp.cpu_offload=%s%s\n",
              sharding_strategy_name(best.strategy), best.reduce_every_microbatch ? "true" : "false",
              best.checkpointing ? "true" : "false", best.offload ? "true" : "false",
              best.strategy == SHARDING_HYBRID_SHARD ? strprintf(" fsdp.shard_group_size=%d", best.shard_size).c_str()
                                                     : "");
  std::printf("why: it needs %s per rank%s and moves %s per step per rank, the least among the combinations "
              "that fit%s.\n",
              format_bytes(best.memory.total()).c_str(),
              limit ? strprintf(" (limit %s)", format_bytes(static_cast<double>(limit)).c_str()).c_str() : "",
              format_bytes(best.traffic_bytes).c_str(),
              best.offload ? "; CPU offload is needed because nothing fits on the device without it"
              : best.checkpointing ? "; activation checkpointing is needed because nothing fits without it"
                                   : " without recomputing activations");
  for (const Candidate& c : candidates)
    if (!c.fits && !c.checkpointing && !c.offload && c.traffic_bytes < best.traffic_bytes)
      std::printf("  %s (reduce per %s) would move less but needs %s per rank\n", sharding_strategy_name(c.strategy),
                  c.reduce_label(), format_bytes(c.memory.total()).c_str());
}

}  // namespace shardtrain
