// Options of `shardtrain train`: one struct per INI section, parsed with Boost.Program_options
// from `--config FILE` and from `--section.key=value` on the command line (which wins). Every
// option is declared once, in options.cpp, with its default and meaning; --help prints them and
// resolved_ini() writes the resolved configuration back as INI text. options.cpp is the one place
// that turns text into values: strategies, types and sizes arrive here typed and checked, and
// everything below takes these structs.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "app/compute_options.hpp"
#include "model/checkpointing.hpp"
#include "core/format.hpp"
#include "data/flow_matching.hpp"
#include "model/config.hpp"
#include "optim/adamw.hpp"
#include "shard/fsdp_engine.hpp"

namespace boost::program_options {
class error;
class options_description;
class variables_map;
}

namespace shardtrain {

class Comm;
class Runtime;
class Watchdog;

struct TrainOptions {
  int steps = 20;
  int global_batch = 8;  // sequences per optimizer step
  int micro_batch = 2;   // sequences per rank per forward/backward
  int seq_len = 32;
  double epochs = 0;  // > 0: steps from the data (passes over the training windows) instead of `steps`
  double lr = 1e-3;
  LrSchedule lr_schedule = LR_COSINE;
  double min_lr_ratio = 0.1;
  int warmup_steps = 0;
  int decay_steps = 0;  // lr_schedule=wsd: the final decay's steps; 0 = a fifth of those after the warmup
  double weight_decay = 0.1;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double grad_clip = 1.0;
  uint64_t seed = 1337;
  int eval_every = 0;
  int eval_batches = 2;
  std::string metrics_file;     // empty = checkpoints/<run_name>/metrics.jsonl
  std::string tensorboard_dir;  // TensorBoard event files; empty = none
  int log_every = 1;            // console step lines every N steps
  std::string run_name = "run";
  int threads = 0;           // per rank; 0 = the cores available to this rank
  double peak_gflops = 0;    // per rank, for MFU; 0 = measure an SGEMM at start-up
  std::string device = "cpu";  // cpu | cuda
  AttentionKernel attention = ATTENTION_AUTO;  // the GPU's attention kernels
  std::string freeze;          // comma-separated glob patterns of parameters not trained
  bool op_times = false;       // time every layer op (backend/op_timer.hpp), a table at the end
};

struct DataOptions {
  std::string train_file = "inputs/data/synth_train.bin";
  std::string val_file;
  std::string tokenizer;  // the tokenizer.json the files were encoded with ("" = bytes), for `generate`
  bool documents = false;  // attention within each packed document (docs/data.md, "Packed documents")
  int document_start = -1;  // the token each document starts with; -1: data.tokenizer's
  bool restart_positions = false;  // with documents: positions count from each document's start
};

// A size in bytes with the text it was written as (for messages and the INI record).
struct MemorySize {
  size_t bytes = 0;  // 0 = none
  std::string text;
};

struct FsdpOptions {
  ShardingStrategy sharding_strategy = SHARDING_FULL_SHARD;
  int shard_group_size = 0;            // HYBRID_SHARD: ranks per shard group; 0 = the ranks of a node
  bool reduce_every_microbatch = true;  // false: accumulate unsharded, reduce once per step
  bool activation_checkpointing = false;
  int checkpoint_blocks = 0;  // with it: recompute only the first N blocks; 0 = every block
  DType param_dtype = DTYPE_FP32;   // gathered parameters and their all-gather
  DType reduce_dtype = DTYPE_FP32;  // the gradient reduce-scatter's wire type
  ActivationDtype activation_dtype = ACTIVATIONS_AUTO;  // the blocks' saved activations
  bool forward_prefetch = false;
  BackwardPrefetch backward_prefetch = BACKWARD_PREFETCH_PRE;
  int limit_all_gathers = 2;  // unsharded block buffers; 1 disables prefetching
  bool cpu_offload = false;   // master shards, gradients and moments in host memory, AdamW on the CPU
  KeepHalfShard keep_half_shard = KEEP_HALF_AUTO;  // 16-bit param_dtype: each shard also kept rounded (EngineOptions)
  MemorySize memory_limit;    // e.g. 24GiB: emulates a device's memory; none by default
  double comm_timeout = 300;  // seconds; 0 disables the watchdog
  CommBackend comm_backend = COMM_AUTO;  // collectives on device buffers: NCCL or MPI
  QuantType frozen_dtype = QUANT_NONE;   // frozen linear weights held in NF4, FP4 or FP8 (backend/quant.hpp)
  int quant_block = 64;                  // its block of elements
  bool quantize_all_linear = false;      // FLUX's modulation too
  bool double_quant = false;             // NF4/FP4 absmax as 8-bit codes (bitsandbytes' compress_statistics)
};

struct CheckpointOptions {
  std::string dir;            // empty = checkpoints/<train.run_name>
  int every = 0;              // save every N steps (and at the end when > 0); 0 = only at the end
  std::string format = "sharded";  // sharded | gathered
  std::string resume = "auto";     // auto | none | PATH
  int keep = 2;               // newest complete checkpoints kept
  std::string init_from;      // llm.c GPT-2 checkpoint to start from (fresh optimizer)
  bool save = true;           // false: never write checkpoints
  bool allow_data_change = false;  // resume although data.train_file/val_file differ from the checkpoint's
  bool adapters_only = false;  // saves hold the adapters alone (and the base's checksum); needs adapters and init_from
  bool keep_best = false;      // also save at each new best validation loss and keep that checkpoint (`best`)
};

// Fault injection for the tests of the error paths; never set in production configs.
struct DebugOptions {
  int stall_rank = -1;
  int stall_step = 0;
  double stall_seconds = 0;
  int inject_inf_step = 0;  // 1-based step whose gradient rank 0 poisons with inf; 0 = never
  bool skip_communication = false;  // benchmarks only: shard/replica collectives move nothing
};

// [adapter]: adapters on the frozen base (model/adapter.hpp, docs/adapters.md).
struct AdapterOptions {
  AdapterType type = ADAPTER_NONE;
  std::string targets;  // comma-separated module paths or their dotted suffixes
  int rank = 8;
  double alpha = 16;
  double dropout = 0;
  std::string init_from;  // a PEFT adapter folder to start from
  bool decompose_both = false;  // LoKr
  int decompose_factor = -1;
  int block_size = 32;  // OFT
  bool cayley_neumann = true;
  int neumann_terms = 5;
  bool block_share = false;
};

// [distill]: knowledge distillation from a frozen teacher model (app/teacher.hpp, docs/distillation.md).
struct DistillOptions {
  std::string teacher;  // a ShardTrain checkpoint or a Hugging Face model folder; empty = no distillation
  double alpha = 0.5;   // the cross-entropy's weight; the KL term gets 1 - alpha
  double temperature = 2;
  QuantType teacher_dtype = QUANT_NONE;  // the teacher's linear weights held in NF4, FP4 or FP8
};

// [text_encoder]: a frozen text encoder in the job, conditioning a diffusion transformer
// (app/text_encoder.hpp); empty source: the embeddings come cached in the data files.
struct TextEncoderOptions {
  std::string source;     // a ShardTrain checkpoint (.h5) or a Hugging Face model folder
  std::string tokenizer;  // its tokenizer.json; empty: the folder's, or the checkpoint's data.tokenizer
  std::string layers = "-1";  // hidden states to concatenate, comma-separated
  QuantType dtype = QUANT_NONE;  // its linear weights' format (NF4, FP4, FP8, bf16)
  std::string sharding_strategy;  // FULL_SHARD or NO_SHARD; empty: the model's groups
  bool enabled() const { return !source.empty(); }
};

struct Config {
  std::string config_file;
  ModelConfig model;
  TrainOptions train;
  DataOptions data;
  FlowOptions flow;  // [flow]: flow-matching training of a diffusion transformer (data/flow_matching.hpp)
  FsdpOptions fsdp;
  CheckpointOptions checkpoint;
  AdapterOptions adapter;
  DistillOptions distill;
  TextEncoderOptions text_encoder;
  DebugOptions debug;
};

struct ParsedTrainArgs {
  Config config;
  bool help = false;
};

// Parses `train` arguments (argv after the subcommand). Throws UsageError naming the option and
// pointing at `shardtrain <command> --help` (`plan` takes the same options).
ParsedTrainArgs parse_train_args(const std::vector<std::string>& args, const char* command = "train");
// Checks value ranges and combinations that need the rank count. Throws UsageError.
void validate_config(const Config& config, int world);
// Every option with its default and meaning.
std::string train_help();
// The resolved configuration as INI text.
std::string resolved_ini(const Config& config);
// The engine's options from a validated Config.
EngineOptions engine_options(const Config& config);
// train.device, fsdp.param_dtype, fsdp.comm_backend and train.attention.
ComputeOptions compute_options(const Config& config);
// fsdp.activation_checkpointing with fsdp.checkpoint_blocks: which blocks recompute.
Checkpointing checkpointing_of(const Config& config);
// The parameter table the configuration trains: the model with train.freeze applied. Throws
// UsageError for a pattern that matches nothing or freezes what cannot be (model/param_table.hpp).
ParamTable config_param_table(const Config& config);
// distill.teacher_dtype with fsdp.quant_block: the format of the teacher's linear weights.
QuantConfig teacher_quant(const Config& config);
// text_encoder.dtype with fsdp.quant_block: the format of the text encoder's linear weights.
QuantConfig text_encoder_quant(const Config& config);
// The ranks of the text encoder's shard group on `world` ranks (text_encoder.sharding_strategy:
// FULL_SHARD all of them, NO_SHARD one), or 0 for the model's shard group.
int text_encoder_shard_size(const Config& config, int world);
AdapterConfig adapter_config(const Config& config);
// The checkpoint folder: checkpoint.dir, or checkpoints/<train.run_name>.
std::string checkpoint_dir(const Config& config);

// Shared by every command's option parsing:
// Boost's message for a parse error, formatted here: Boost's own what() never returns when a value or
// option name contains a placeholder such as %value%.
std::string option_error_text(const boost::program_options::error& e);
// Throws UsageError naming the first word no option took (Boost ignores them), e.g. from
// po::collect_unrecognized(parsed.options, po::include_positional); `command` is e.g. "train".
void reject_stray_words(const std::vector<std::string>& words, const std::string& command);
// A whole number in [min, max] written in decimal digits only (no sign, no suffix, no wrap-around of
// "-1" as strtoull and Boost do). Throws UsageError naming `option`.
uint64_t parse_whole_number(const std::string& text, const std::string& option, uint64_t min, uint64_t max);
// Parses a command's options (`args`, the words after it) into `vm` (notified): false after
// printing `desc` on rank 0 for --help; UsageError naming the option and `shardtrain <command>
// --help` for a bad one or a stray word. No prefix guessing: --step is not --steps.
bool parse_command_options(const Runtime& rt, const std::vector<std::string>& args,
                           const boost::program_options::options_description& desc, const std::string& command,
                           boost::program_options::variables_map& vm);
// Collective: `path` if it names a file, else the newest complete checkpoint of the run folder it
// names (what generate and sample take). Throws UsageError (agreed) naming `option` otherwise.
std::string checkpoint_file_or_newest(const Runtime& rt, Comm& comm, const std::string& path, const std::string& option,
                                      Watchdog* watchdog);
// A real number of `text` for --option of `command`, or a UsageError naming the option and what it
// allows (in [min, max], min itself only when min_included).
double parse_real(const std::string& text, const std::string& option, const std::string& allowed, double min,
                  double max, bool min_included, const std::string& command);
// fp32, bf16 or fp16 as an option's value (a tool's --dtype); UsageError naming `option` otherwise.
DType parse_dtype_option(const std::string& text, const std::string& option);
// fsdp.memory_limit, plan --memory-limit: empty (none) or a positive size with a unit (24GiB, 512MiB,
// 1.5GB). Throws UsageError naming `option`.
MemorySize parse_memory_limit(const std::string& text, const char* option);
// option -> value of every `key = value` under its `[section]` in INI text, as Boost reads the config
// file (unknown keys kept: a checkpoint's record may hold options of another version).
std::map<std::string, std::string> ini_option_values(const std::string& ini_text);

}  // namespace shardtrain
