// Declares every `train` option once (name, field, default, meaning) and derives from that one
// list the Boost parser, --help and the resolved INI. See options.hpp.
#include "app/options.hpp"

#include <algorithm>
#include <boost/program_options.hpp>
#include <fstream>
#include <functional>
#include <iomanip>
#include <sstream>

#include "app/memory_plan.hpp"
#include "core/error.hpp"
#include "shard/fsdp_engine.hpp"

namespace po = boost::program_options;

namespace shardtrain {
namespace {

struct OptionList {
  po::options_description desc{"train options (INI section.key, or --section.key=value)"};
  std::vector<std::pair<std::string, std::function<std::string()>>> printers;

  // 10 significant digits and true/false: readable in --help and exact enough in the INI record.
  template <typename T>
  static std::string text(const T& value) {
    std::ostringstream s;
    s << std::setprecision(10) << std::boolalpha << value;
    return s.str();
  }

  template <typename T>
  void add(const char* name, T* field, const char* help) {
    desc.add_options()(name, po::value<T>(field)->default_value(*field, text(*field)), help);
    printers.emplace_back(name, [field] { return text(*field); });
  }
};

// The single list of options. `c` holds the defaults on entry and receives parsed values.
void declare_options(OptionList& o, Config& c) {
  o.add("model.n_layer", &c.model.n_layer, "transformer blocks (L)");
  o.add("model.n_embd", &c.model.n_embd, "width (C); a multiple of model.n_head");
  o.add("model.n_head", &c.model.n_head, "attention heads (H)");
  o.add("model.vocab_size", &c.model.vocab_size, "vocabulary size (V), at most 65536 (uint16 tokens)");
  o.add("model.max_seq_len", &c.model.max_seq_len, "rows of the position-embedding table");
  o.add("train.steps", &c.train.steps, "optimizer steps");
  o.add("train.global_batch", &c.train.global_batch,
        "sequences per optimizer step; a multiple of micro_batch x ranks (the rest is gradient accumulation)");
  o.add("train.micro_batch", &c.train.micro_batch, "sequences per rank per forward/backward");
  o.add("train.seq_len", &c.train.seq_len, "tokens per training sequence, <= model.max_seq_len");
  o.add("train.lr", &c.train.lr, "peak learning rate");
  o.add("train.min_lr_ratio", &c.train.min_lr_ratio, "final learning rate of the cosine, as a fraction of lr");
  o.add("train.warmup_steps", &c.train.warmup_steps, "linear warmup steps");
  o.add("train.weight_decay", &c.train.weight_decay, "AdamW decoupled weight decay (not on norms and biases)");
  o.add("train.beta1", &c.train.beta1, "AdamW beta1");
  o.add("train.beta2", &c.train.beta2, "AdamW beta2");
  o.add("train.eps", &c.train.eps, "AdamW epsilon");
  o.add("train.grad_clip", &c.train.grad_clip, "clip the global gradient norm to this; 0 disables");
  o.add("train.seed", &c.train.seed, "seed of initialization and data order");
  o.add("train.eval_every", &c.train.eval_every, "validation every N steps and at the end; 0 = never");
  o.add("train.eval_batches", &c.train.eval_batches, "global batches per validation");
  o.add("train.metrics_file", &c.train.metrics_file, "JSON Lines metrics written by rank 0; empty = none");
  o.add("train.tensorboard_dir", &c.train.tensorboard_dir,
        "folder for TensorBoard event files written by rank 0 (loss, val loss, lr, grad norm, tokens/s, MFU, "
        "memory); empty = none");
  o.add("train.log_every", &c.train.log_every, "print a step line every N steps (and the first and last)");
  o.add("train.run_name", &c.train.run_name, "name of the run, used in logs");
  o.add("train.threads", &c.train.threads, "threads per rank; 0 = the cores available to the rank");
  o.add("train.peak_gflops", &c.train.peak_gflops,
        "per-rank peak GFLOP/s for MFU; 0 = measure SGEMM at start (cpu), the card's dense bf16 peak (cuda)");
  o.add("train.device", &c.train.device,
        "cpu (OpenBLAS + MPI) or cuda (one GPU per rank by node-local rank, NCCL; needs a make CUDA=1 build)");
  o.add("data.train_file", &c.data.train_file, "training tokens (llm.c .bin format)");
  o.add("data.val_file", &c.data.val_file, "validation tokens; empty = no validation");
  o.add("fsdp.sharding_strategy", &c.fsdp.sharding_strategy,
        "FULL_SHARD (ZeRO-3), SHARD_GRAD_OP (ZeRO-2), NO_SHARD (DDP) or HYBRID_SHARD (FULL_SHARD within groups, "
        "replicated across them)");
  o.add("fsdp.shard_group_size", &c.fsdp.shard_group_size,
        "HYBRID_SHARD: ranks per shard group, dividing the rank count; 0 = the ranks of one node");
  o.add("fsdp.reduce_every_microbatch", &c.fsdp.reduce_every_microbatch,
        "reduce-scatter gradients after every micro-batch (less memory); false = accumulate unsharded gradients "
        "and reduce once per step (less traffic)");
  o.add("fsdp.activation_checkpointing", &c.fsdp.activation_checkpointing,
        "keep only each block's input and recompute the block in backward (less activation memory, ~1/3 more "
        "compute)");
  o.add("fsdp.param_dtype", &c.fsdp.param_dtype,
        "fp32, bf16 or fp16: the type parameters are gathered and communicated in (fp32 master weights and "
        "moments; on the CPU, compute widens to fp32); fp16 turns on dynamic loss scaling");
  o.add("fsdp.reduce_dtype", &c.fsdp.reduce_dtype,
        "fp32, bf16 or fp16: the type gradients are reduce-scattered in (replica all-reduces stay fp32)");
  o.add("fsdp.forward_prefetch", &c.fsdp.forward_prefetch,
        "start the next block's all-gather before the current block's forward computes");
  o.add("fsdp.backward_prefetch", &c.fsdp.backward_prefetch,
        "NONE, BACKWARD_PRE (start the next block's all-gather before the current block's backward) or "
        "BACKWARD_POST (after it)");
  o.add("fsdp.cpu_offload", &c.fsdp.cpu_offload,
        "keep the fp32 master shards, their gradients and the AdamW moments in (pinned) host memory and step the "
        "optimizer on the CPU: less device memory, a copy of each shard per gather and per step");
  o.add("fsdp.limit_all_gathers", &c.fsdp.limit_all_gathers,
        "unsharded blocks held at once (FULL_SHARD, HYBRID_SHARD): 2 lets one all-gather run ahead, each more "
        "costs one block of memory; 1 disables prefetching");
  o.add("fsdp.memory_limit", &c.fsdp.memory_limit,
        "per-rank memory budget (e.g. 24GiB, 512MiB): a configuration that would exceed it stops before "
        "allocating, with the need by category; empty = no limit");
  o.add("fsdp.comm_timeout", &c.fsdp.comm_timeout,
        "seconds a collective may wait before all ranks are aborted; 0 disables the watchdog");
  o.add("checkpoint.dir", &c.checkpoint.dir, "checkpoint folder; empty = checkpoints/<train.run_name>");
  o.add("checkpoint.every", &c.checkpoint.every, "save every N steps; 0 = only at the end");
  o.add("checkpoint.format", &c.checkpoint.format,
        "sharded (each unit's flat shards + index) or gathered (one dataset per parameter, full shape)");
  o.add("checkpoint.resume", &c.checkpoint.resume,
        "auto (newest valid checkpoint in checkpoint.dir, if any), none, or a checkpoint file");
  o.add("checkpoint.keep", &c.checkpoint.keep, "newest complete checkpoints kept; older ones are removed");
  o.add("checkpoint.init_from", &c.checkpoint.init_from, "llm.c GPT-2 checkpoint (.bin) to initialise the weights from");
  o.add("checkpoint.save", &c.checkpoint.save, "write checkpoints (true/false)");
  o.add("checkpoint.allow_data_change", &c.checkpoint.allow_data_change,
        "resume even though data.train_file or data.val_file differ from the checkpoint's (true/false)");
  o.add("debug.stall_rank", &c.debug.stall_rank, "testing only: this rank sleeps stall_seconds at stall_step");
  o.add("debug.stall_step", &c.debug.stall_step, "testing only: step of the injected stall");
  o.add("debug.stall_seconds", &c.debug.stall_seconds, "testing only: length of the injected stall");
  o.add("debug.inject_inf_step", &c.debug.inject_inf_step, "testing only: poison this step's gradient with inf");
  o.add("debug.skip_communication", &c.debug.skip_communication,
        "benchmarks only: the engine's collectives move no data (wrong results; measures exposed communication)");
}

void require(bool ok, const std::string& message) {
  if (!ok) throw UsageError(message);
}

}  // namespace

ParsedTrainArgs parse_train_args(const std::vector<std::string>& raw_args) {
  // "--key=" (an empty value, e.g. --data.val_file= to switch validation off) becomes
  // "--key" "", which Boost accepts.
  std::vector<std::string> args;
  for (const std::string& a : raw_args) {
    if (a.size() > 3 && a.compare(0, 2, "--") == 0 && a.back() == '=') {
      args.push_back(a.substr(0, a.size() - 1));
      args.emplace_back();
    } else {
      args.push_back(a);
    }
  }
  ParsedTrainArgs parsed;
  OptionList options;
  declare_options(options, parsed.config);
  po::options_description cli;
  cli.add_options()("help,h", "print the options")("config", po::value<std::string>(&parsed.config.config_file),
                                                   "INI file with [model] [train] [data] [fsdp] [checkpoint] sections");
  cli.add(options.desc);
  po::variables_map vm;
  try {
    int style = po::command_line_style::default_style & ~po::command_line_style::allow_guessing;
    po::parsed_options from_cli = po::command_line_parser(args).options(cli).style(style).run();
    po::store(from_cli, vm);
    if (vm.count("help")) {
      parsed.help = true;
      return parsed;
    }
    if (vm.count("config")) {
      const std::string path = vm["config"].as<std::string>();
      std::ifstream file(path);
      if (!file) throw UsageError("cannot read config file '" + path + "' (--config): check the path");
      // The command line wins: drop the file's values for keys given there.
      po::parsed_options from_file = po::parse_config_file(file, options.desc);
      auto& opts = from_file.options;
      opts.erase(std::remove_if(opts.begin(), opts.end(),
                                [&](const po::option& o) {
                                  for (const po::option& c : from_cli.options)
                                    if (c.string_key == o.string_key) return true;
                                  return false;
                                }),
                 opts.end());
      po::store(from_file, vm);
    }
    po::notify(vm);
  } catch (const po::error& e) {
    std::string where = vm.count("config") ? " (in " + vm["config"].as<std::string>() + " or the command line)" : "";
    throw UsageError(std::string(e.what()) + where + "; see 'shardtrain train --help'");
  }
  return parsed;
}

void validate_config(const Config& c, int world) {
  const ModelConfig& m = c.model;
  const TrainOptions& t = c.train;
  require(m.n_layer >= 1, "model.n_layer must be >= 1");
  require(m.n_head >= 1, "model.n_head must be >= 1");
  require(m.n_embd >= 1 && m.n_embd % m.n_head == 0,
          strprintf("model.n_embd=%d must be a positive multiple of model.n_head=%d", m.n_embd, m.n_head));
  require(m.vocab_size >= 2 && m.vocab_size <= 65536,
          strprintf("model.vocab_size=%d must be in [2, 65536] (tokens are uint16)", m.vocab_size));
  require(m.max_seq_len >= 1, "model.max_seq_len must be >= 1");
  require(t.seq_len >= 1 && t.seq_len <= m.max_seq_len,
          strprintf("train.seq_len=%d must be in [1, model.max_seq_len=%d]", t.seq_len, m.max_seq_len));
  require(t.steps >= 1, "train.steps must be >= 1");
  require(t.micro_batch >= 1, "train.micro_batch must be >= 1");
  require(t.global_batch >= 1 && t.global_batch % (t.micro_batch * world) == 0,
          strprintf("train.global_batch=%d must be a multiple of train.micro_batch x ranks = %d x %d = %d "
                    "(global_batch / (micro_batch x ranks) is the gradient accumulation)",
                    t.global_batch, t.micro_batch, world, t.micro_batch * world));
  require(t.lr > 0, "train.lr must be > 0");
  require(t.min_lr_ratio >= 0 && t.min_lr_ratio <= 1, "train.min_lr_ratio must be in [0, 1]");
  require(t.warmup_steps >= 0, "train.warmup_steps must be >= 0");
  require(t.weight_decay >= 0, "train.weight_decay must be >= 0");
  require(t.beta1 >= 0 && t.beta1 < 1 && t.beta2 >= 0 && t.beta2 < 1, "train.beta1 and train.beta2 must be in [0, 1)");
  require(t.eps > 0, "train.eps must be > 0");
  require(t.grad_clip >= 0, "train.grad_clip must be >= 0 (0 disables clipping)");
  require(t.eval_every >= 0, "train.eval_every must be >= 0");
  require(t.eval_batches >= 1, "train.eval_batches must be >= 1");
  require(t.log_every >= 1, "train.log_every must be >= 1");
  require(t.threads >= 0, "train.threads must be >= 0 (0 = automatic)");
  require(t.peak_gflops >= 0, "train.peak_gflops must be >= 0 (0 = measure)");
  require(!c.data.train_file.empty(), "data.train_file is required");
  ShardingStrategy strategy;
  require(t.device == "cpu" || t.device == "cuda",
          "train.device='" + t.device + "' is not a device; allowed: cpu, cuda");
  require(t.device == "cpu" || !c.debug.skip_communication,
          "debug.skip_communication is implemented for train.device=cpu only; remove it");
  require(parse_sharding_strategy(c.fsdp.sharding_strategy, &strategy),
          "fsdp.sharding_strategy='" + c.fsdp.sharding_strategy +
              "' is not a strategy; allowed: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD");
  require(c.fsdp.shard_group_size >= 0, "fsdp.shard_group_size must be >= 0 (0 = the ranks of one node)");
  require(strategy == SHARDING_HYBRID_SHARD || c.fsdp.shard_group_size == 0,
          "fsdp.shard_group_size is only meaningful with fsdp.sharding_strategy=HYBRID_SHARD; remove it or "
          "switch the strategy");
  require(c.fsdp.shard_group_size == 0 || world % c.fsdp.shard_group_size == 0,
          strprintf("fsdp.shard_group_size=%d must divide the rank count %d", c.fsdp.shard_group_size, world));
  require(c.checkpoint.every >= 0, "checkpoint.every must be >= 0 (0 = only at the end)");
  require(c.checkpoint.format == "sharded" || c.checkpoint.format == "gathered",
          "checkpoint.format='" + c.checkpoint.format + "' is not a format; allowed: sharded, gathered");
  require(!c.checkpoint.resume.empty(), "checkpoint.resume must be auto, none or a checkpoint file");
  require(c.checkpoint.keep >= 1, "checkpoint.keep must be >= 1");
  BackwardPrefetch prefetch;
  require(parse_backward_prefetch(c.fsdp.backward_prefetch, &prefetch),
          "fsdp.backward_prefetch='" + c.fsdp.backward_prefetch + "' is not a mode; allowed: NONE, BACKWARD_PRE, "
          "BACKWARD_POST");
  require(c.fsdp.limit_all_gathers >= 1, "fsdp.limit_all_gathers must be >= 1 (1 disables prefetching)");
  DType dtype;
  require(parse_dtype(c.fsdp.param_dtype, &dtype),
          "fsdp.param_dtype='" + c.fsdp.param_dtype + "' is not a type; allowed: fp32, bf16, fp16");
  require(parse_dtype(c.fsdp.reduce_dtype, &dtype),
          "fsdp.reduce_dtype='" + c.fsdp.reduce_dtype + "' is not a type; allowed: fp32, bf16, fp16");
  parse_memory_size(c.fsdp.memory_limit, "fsdp.memory_limit");
  require(c.fsdp.comm_timeout >= 0, "fsdp.comm_timeout must be >= 0 seconds (0 disables the watchdog)");
}

std::string train_help() {
  Config defaults;
  OptionList options;
  declare_options(options, defaults);
  std::ostringstream s;
  s << "usage: shardtrain train [--config FILE] [--section.key=value ...]\n\n"
    << "  --config FILE     INI file with [model] [train] [data] [fsdp] [checkpoint] sections; the command\n"
    << "                    line wins\n"
    << "  --help            this text\n\n"
    << options.desc;
  return s.str();
}

EngineOptions engine_options(const Config& c) {
  EngineOptions o;
  parse_sharding_strategy(c.fsdp.sharding_strategy, &o.strategy);
  o.reduce_every_microbatch = c.fsdp.reduce_every_microbatch;
  parse_dtype(c.fsdp.param_dtype, &o.param_dtype);
  parse_dtype(c.fsdp.reduce_dtype, &o.reduce_dtype);
  o.forward_prefetch = c.fsdp.forward_prefetch;
  parse_backward_prefetch(c.fsdp.backward_prefetch, &o.backward_prefetch);
  o.limit_all_gathers = c.fsdp.limit_all_gathers;
  o.cpu_offload = c.fsdp.cpu_offload;
  o.overlap_reduce_scatter = c.train.device == "cuda";  // NCCL progresses on its own stream; MPI does not
  o.nccl = c.train.device == "cuda";
  return o;
}

std::string checkpoint_dir(const Config& config) {
  return config.checkpoint.dir.empty() ? "checkpoints/" + config.train.run_name : config.checkpoint.dir;
}

std::string resolved_ini(const Config& config) {
  Config copy = config;
  OptionList options;
  declare_options(options, copy);
  std::ostringstream s;
  std::string section;
  for (const auto& [name, print] : options.printers) {
    std::string sec = name.substr(0, name.find('.'));
    if (sec != section) s << (section.empty() ? "" : "\n") << "[" << (section = sec) << "]\n";
    s << name.substr(name.find('.') + 1) << " = " << print() << "\n";
  }
  return s.str();
}

}  // namespace shardtrain
