// See convert.hpp. Both directions go through the one engine the trainer uses, in inference mode (no
// gradients), FULL_SHARD over the world: the import (load_hf_shards) and the checkpoint writer
// (save_checkpoint_weights) on the way in, the checkpoint reader (load_checkpoint_weights) and the
// export's folder commit (write_hf_folder, write_hf_shards) on the way out.
#include "app/convert.hpp"

#include <boost/program_options.hpp>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>

#include "app/hf_export.hpp"
#include "app/options.hpp"
#include "ckpt/checkpoint_io.hpp"
#include "ckpt/checkpoint_manager.hpp"
#include "ckpt/hf_model.hpp"
#include "comm/watchdog.hpp"
#include "core/counted.hpp"
#include "core/format.hpp"
#include "shard/memory.hpp"

namespace po = boost::program_options;

namespace shardtrain {
namespace {

namespace fs = std::filesystem;

const char* USAGE_LINE =
    "shardtrain convert --input PATH --output PATH [--layout sharded|gathered] [--config FILE] "
    "[--frozen-dtype nf4|fp4|fp8|bf16 [--quant-block N] [--quantize-all-linear]] [--dtype fp32|bf16|fp16] "
    "[--max-file-size SIZE] [--overwrite]";
const char* HELP = "; see 'shardtrain convert --help'";

struct ConvertOptions {
  std::string input, output, layout = "sharded", dtype = "fp32", config, max_file_size = "5GB", timeout = "300",
                                 frozen_dtype = "fp32", quant_block = "64";
  bool overwrite = false, quantize_all_linear = false, double_quant = false;
  // Options given that apply to one direction only.
  bool layout_given = false, config_given = false, dtype_given = false, max_file_size_given = false,
       quant_given = false, quant_block_given = false;
};

// Returns false when --help was asked for (the text printed by rank 0).
bool parse_convert_args(const Runtime& rt, const std::vector<std::string>& args, ConvertOptions& o) {
  po::options_description desc(std::string("usage: ") + USAGE_LINE + "\n\nconvert options");
  desc.add_options()  // one option per line
      ("help,h", "print the options")
      ("input", po::value(&o.input)->required(),
       "a Hugging Face model folder (config.json and safetensors: GPT-2, Llama, Qwen2, a diffusers FLUX transformer), "
       "Black Forest Labs' FLUX.1 single .safetensors file, or a ShardTrain checkpoint (.h5, either layout, saved on "
       "any rank count)")
      ("output", po::value(&o.output)->required(),
       "the checkpoint file to write (from a folder), or the folder to write (from a checkpoint; a FLUX checkpoint to "
       "a name ending in .safetensors: Black Forest Labs' single file)")
      ("layout", po::value(&o.layout)->default_value(o.layout),
       "to a checkpoint: sharded (one flat dataset per unit) or gathered (one per parameter); both load on any rank "
       "count")
      ("config", po::value(&o.config),
       "to a checkpoint: an INI file (as train's --config) whose model.* keys must agree with config.json, recorded "
       "in the checkpoint as its configuration")
      ("dtype", po::value(&o.dtype)->default_value(o.dtype),
       "to a folder: the weights' type, fp32 (the checkpoint's values, bit for bit), bf16 or fp16 (rounded to "
       "nearest even)")
      ("max-file-size", po::value(&o.max_file_size)->default_value(o.max_file_size),
       "to a folder: larger weights are split into files of at most this size with an index (model.safetensors.index.json, "
       "diffusers' diffusion_pytorch_model.safetensors.index.json)")
      ("frozen-dtype", po::value(&o.frozen_dtype)->default_value(o.frozen_dtype),
       "to a checkpoint: nf4, fp4 (bitsandbytes' 4-bit formats), fp8 or bf16 stores the blocks' linear weights "
       "quantized (their records, as a run with fsdp.frozen_dtype holds them: a frozen base for adapters, a "
       "teacher, a text encoder); fp32: every weight as it is")
      ("quant-block", po::value(&o.quant_block)->default_value(o.quant_block),
       "to a checkpoint with --frozen-dtype: elements per block, a power of two from 32 to 4096")
      ("double-quant", po::bool_switch(&o.double_quant),
       "to a checkpoint with --frozen-dtype nf4 or fp4: each block's absmax as an 8-bit code (bitsandbytes' "
       "double quantization, as fsdp.double_quant)")
      ("quantize-all-linear", po::bool_switch(&o.quantize_all_linear),
       "to a checkpoint with --frozen-dtype: also the linear layers a family keeps in full precision (FLUX's "
       "modulation)")
      ("overwrite", po::bool_switch(&o.overwrite), "replace --output if it exists")
      ("comm-timeout", po::value(&o.timeout)->default_value(o.timeout),
       "seconds any one collective may wait for a stalled rank before the job is aborted; 0 = never");
  po::variables_map vm;
  try {
    po::parsed_options parsed = po::command_line_parser(args).options(desc).run();
    po::store(parsed, vm);
    if (vm.count("help")) {
      if (rt.is_root()) std::cout << desc << "\n";
      return false;
    }
    reject_stray_words(po::collect_unrecognized(parsed.options, po::include_positional), "convert");
    po::notify(vm);
  } catch (const po::error& e) {
    throw UsageError(option_error_text(e) + HELP);
  }
  o.layout_given = !vm["layout"].defaulted(), o.config_given = vm.count("config") > 0;
  o.dtype_given = !vm["dtype"].defaulted(), o.max_file_size_given = !vm["max-file-size"].defaulted();
  o.quant_block_given = !vm["quant-block"].defaulted();
  o.quant_given = !vm["frozen-dtype"].defaulted() || o.quant_block_given || o.quantize_all_linear || o.double_quant;
  return true;
}

enum Direction { TO_CHECKPOINT, TO_FOLDER };

// A checkpoint's output as the family's single file (Black Forest Labs' FLUX.1 layout) rather than
// a Hugging Face folder: an output path ending in .safetensors.
bool single_file_output(const ConvertOptions& o) { return fs::path(o.output).extension() == ".safetensors"; }

// The direction the input gives, after every check that needs no reading of it: the paths and the
// options that apply to that direction. Throws UsageError.
Direction check_paths(const ConvertOptions& o) {
  std::error_code ec;
  if (!fs::exists(o.input, ec))
    throw UsageError("convert --input='" + printable_text(o.input) + "': no such file or folder");
  Direction d;
  if (is_hf_model(o.input))
    d = TO_CHECKPOINT;
  else if (is_hdf5_file(o.input))
    d = TO_FOLDER;
  else
    throw UsageError("convert --input='" + printable_text(o.input) + "' is " +
                     (fs::is_directory(o.input, ec)             ? "a folder without config.json: not a Hugging Face model folder"
                      : fs::path(o.input).extension() == ".safetensors" ? "a safetensors file in no model's single-file "
                                                                          "layout (Black Forest Labs' FLUX.1)"
                                                                        : "not an HDF5 file: not a ShardTrain checkpoint") +
                     "; give a Hugging Face model folder, a FLUX.1 single file or a checkpoint (.h5)");
  const std::string output = "convert --output='" + printable_text(o.output) + "'";
  if (fs::exists(o.output, ec)) {
    if (!o.overwrite)
      throw UsageError(output + " exists; remove it, name another, or pass --overwrite to replace it");
    if (d == TO_CHECKPOINT && fs::is_directory(o.output, ec))
      throw UsageError(output + " is a folder; a checkpoint is one file: name the .h5 file to write");
    if (d == TO_FOLDER && !fs::is_directory(o.output, ec) && !single_file_output(o))
      throw UsageError(output + " is a file; a Hugging Face model is a folder: name the folder to write (or a "
                       "FLUX.1 single .safetensors file)");
    if (d == TO_FOLDER && fs::is_directory(o.output, ec) && single_file_output(o))
      throw UsageError(output + " is a folder; a .safetensors output is one file: name the file to write");
  }
  auto only = [&](bool given, const char* option, const char* why) {
    if (given) throw UsageError(std::string(option) + " " + why + HELP);
  };
  if (d == TO_CHECKPOINT) {
    only(o.dtype_given, "--dtype", "applies to a Hugging Face folder written from a checkpoint; a checkpoint's "
                                   "weights are fp32 (F16 and BF16 tensors are widened exactly)");
    only(o.max_file_size_given, "--max-file-size", "applies to a Hugging Face folder written from a checkpoint");
    if (o.layout != "sharded" && o.layout != "gathered")
      throw UsageError("--layout='" + printable_text(o.layout) + "' is not allowed; allowed: sharded, gathered" + HELP);
  } else {
    only(o.quant_given, "--frozen-dtype, --quant-block and --quantize-all-linear",
         "apply to a checkpoint written from a Hugging Face folder; 'export --quantize' writes a bitsandbytes "
         "4-bit folder");
    only(o.layout_given, "--layout", "applies to a checkpoint written from a Hugging Face folder");
    only(o.config_given, "--config", "applies to a checkpoint written from a Hugging Face folder (a checkpoint "
                                     "records its own configuration)");
  }
  return d;
}

// The engine of a conversion: every rank's parameter shard, FULL_SHARD over the world, no gradients.
// Its gather buffers are allocated (calloc) but never touched by a conversion, so they take no memory.
struct ShardHolder {
  ShardHolder(const Runtime& rt, const ParamTable& table, Watchdog& watchdog)
      : world(make_mpi_comm(rt.world_comm(), &watchdog)),
        shard(make_mpi_comm(rt.split_world(0, rt.rank()), &watchdog)),
        replica(make_mpi_comm(rt.split_world(rt.rank(), 0), &watchdog)),
        engine(table, *shard, *replica, memory, inference_options(), cpu_backend()),
        ranks{*world, rt.world_comm(), &watchdog, "--output"} {}
  static EngineOptions inference_options() {
    EngineOptions options;
    options.inference = true;
    return options;
  }
  std::unique_ptr<Comm> world, shard, replica;
  MemoryTracker memory;
  FsdpEngine engine;
  CheckpointComm ranks;
};

// The model and its size, for the closing line.
std::string shape_of(const ParamTable& table) {
  return strprintf("%s, %.1fM parameters", model_summary(table.config()).c_str(), table.total_params() / 1e6);
}

void folder_to_checkpoint(const Runtime& rt, const ConvertOptions& o, Watchdog& watchdog) {
  const double t0 = MPI_Wtime();
  // The configuration as train reads it with checkpoint.init_from=FOLDER: the model from config.json,
  // the INI's model.* keys checked against it.
  Config config;
  rt.agree_on([&] {
    std::vector<std::string> args = {"--checkpoint.init_from", o.input};
    if (o.config_given) args.insert(args.begin(), {"--config", o.config});
    config = parse_train_args(args, "convert").config;
  });
  // --frozen-dtype: the blocks' linear weights frozen and held in the format, as a teacher's
  // (QuantConfig::inference), so the checkpoint stores their records.
  QuantConfig quant{QUANT_NONE, 64, o.quantize_all_linear, true, "--frozen-dtype"};
  rt.agree_on([&] {
    if (!parse_quant_type(o.frozen_dtype, &quant.type))
      throw UsageError("--frozen-dtype='" + printable_text(o.frozen_dtype) + "' is not allowed; allowed: fp32, nf4, "
                       "fp4, fp8, bf16" + HELP);
    quant.block = static_cast<size_t>(parse_whole_number(o.quant_block, "--quant-block", 1, 1 << 20));
    if (!quant_block_ok(static_cast<int>(quant.block)))
      throw UsageError("--quant-block=" + o.quant_block + " is not a power of two from 32 to 4096" + HELP);
    if (quant.type == QUANT_NONE && (o.quant_block_given || o.quantize_all_linear || o.double_quant))
      throw UsageError("--quant-block, --double-quant and --quantize-all-linear shape a quantized base: add "
                       "--frozen-dtype" + std::string(HELP));
    if (o.double_quant && !quant_nestable(quant.type))
      throw UsageError("--double-quant codes the absmax of nf4 and fp4 blocks and --frozen-dtype=" + o.frozen_dtype +
                       " has none: use nf4 or fp4" + HELP);
    quant.nested = o.double_quant;
  });
  std::unique_ptr<ParamTable> quantized_table;
  rt.agree_on([&] { quantized_table = std::make_unique<ParamTable>(config.model, std::vector<std::string>{},
                                                                   AdapterConfig{}, quant); });
  const ParamTable& table = *quantized_table;
  ShardHolder holder(rt, table, watchdog);
  rt.agree_on([&] { load_hf_shards(o.input, holder.engine); });
  const double t_read = MPI_Wtime();

  CheckpointState state;  // step 0: a fresh optimizer, whose moments are zero
  state.layout = o.layout;
  state.seed = config.train.seed;
  state.world_size = rt.world();
  state.strategy = sharding_strategy_name(SHARDING_FULL_SHARD);
  state.config_ini = resolved_ini(config);
  const std::string tmp = o.output + ".tmp";
  try {
    rt.agree_on([&] { save_checkpoint_weights(tmp, state, holder.engine, holder.ranks); });
    // Data first, then the name (as CheckpointManager commits a save).
    rt.agree_on([&] {
      if (!rt.is_root()) return;
      const std::string error =
          CheckpointManager::commit_synced(tmp, o.output, fs::absolute(o.output).parent_path().string());
      if (!error.empty()) throw CheckpointError(error);
    });
  } catch (const InputError&) {
    if (rt.is_root()) std::remove(tmp.c_str());  // never leave a half-written file behind
    throw;
  }
  const double t_end = MPI_Wtime();
  rt.info("converted Hugging Face model %s (%s) to checkpoint %s (%s layout%s, step 0, optimizer moments zero) on %s "
          "in %.2f s (read %.2f s, write %.2f s); parameter shard per rank %s",
          o.input.c_str(), shape_of(table).c_str(), o.output.c_str(), o.layout.c_str(),
          quant.type == QUANT_NONE ? ""
                                   : strprintf(", linear weights in %s blocks of %zu", quant_type_name(quant.type),
                                               quant.block).c_str(),
          counted(rt.world(), "rank").c_str(), t_end - t0, t_read - t0, t_end - t_read,
          human_bytes(static_cast<double>(holder.memory.current(MEM_SHARDED_PARAMS))).c_str());
}

void checkpoint_to_folder(const Runtime& rt, const ConvertOptions& o, Watchdog& watchdog) {
  const double t0 = MPI_Wtime();
  const DType dtype = parse_dtype_option(o.dtype, "--dtype");
  const uint64_t max_file_bytes = parse_memory_limit(o.max_file_size, "--max-file-size").bytes;
  CheckpointState state;
  rt.agree_on([&] { state = read_checkpoint_state(o.input); });
  if (rt.is_root() && !state.warning.empty()) std::fprintf(stderr, "warning: %s\n", state.warning.c_str());
  if (state.adapter.type != ADAPTER_NONE)
    throw UsageError("checkpoint '" + o.input + "' holds " + adapter_type_name(state.adapter.type) +
                     (state.adapters_only ? " adapters alone (checkpoint.adapters_only)" : " adapters") +
                     ": convert writes plain models; 'shardtrain export --adapter' writes the adapters as a PEFT "
                     "folder" + (state.adapters_only ? "" : ", 'export --format hf --merge' the merged model"));
  const ParamTable table(state.model);
  ShardHolder holder(rt, table, watchdog);
  rt.agree_on([&] { load_checkpoint_weights(o.input, holder.engine, holder.ranks); });
  const double t_read = MPI_Wtime();
  const bool single = single_file_output(o);
  if (single && !family_of(table.config()).single_file_layout())
    throw UsageError("convert --output='" + printable_text(o.output) + "': a single .safetensors file is " +
                     "written for FLUX (Black Forest Labs' layout); model.arch=" + table.config().arch +
                     " goes to a Hugging Face folder: name a folder");
  if (single && o.max_file_size_given)
    throw UsageError("--max-file-size applies to a Hugging Face folder; a single file holds every tensor" + std::string(HELP));
  const HfExportPlan plan = single ? single_file_export_plan(table, dtype, fs::path(o.output).filename().string())
                                   : hf_export_plan(table, dtype, max_file_bytes);
  auto write_tensors = [&](SafetensorsWriters& writers) { write_hf_shards(holder.engine, plan, writers); };
  if (single)
    write_model_file(rt, o.output, plan, write_tensors);
  else
    write_hf_folder(rt, table.config(), o.output, dtype, plan, write_tensors, recorded_tokenizer(state));
  const double t_end = MPI_Wtime();
  rt.info("converted checkpoint %s (step %lld) to %s %s (%s; %s%s, %s in %s) on %s in "
          "%.2f s (read %.2f s, write %.2f s); parameter shard per rank %s",
          o.input.c_str(), static_cast<long long>(state.step),
          single ? (std::string(family_of(table.config()).single_file_layout()) + " single file").c_str()
                 : "Hugging Face folder",
          o.output.c_str(),
          shape_of(table).c_str(), single ? "" : "config.json, ", plan.entry_name().c_str(),
          human_bytes(static_cast<double>(plan.tensor_bytes)).c_str(),
          counted(static_cast<long long>(plan.files.size()), "file").c_str(), counted(rt.world(), "rank").c_str(),
          t_end - t0, t_read - t0, t_end - t_read, human_bytes(static_cast<double>(holder.memory.current(MEM_SHARDED_PARAMS))).c_str());
}

}  // namespace

int run_convert(Runtime& rt, const std::vector<std::string>& args) {
  ConvertOptions o;
  bool go = false;
  Direction direction = TO_CHECKPOINT;
  double timeout = 0;
  rt.agree_on([&] {
    go = parse_convert_args(rt, args, o);
    if (!go) return;
    timeout = static_cast<double>(parse_whole_number(o.timeout, "--comm-timeout", 0, 1u << 30));
    direction = check_paths(o);
  });
  if (!go) return EXIT_CODE_OK;
  rt.set_collective_timeout({timeout, "--comm-timeout"});
  Watchdog watchdog(timeout, "--comm-timeout");
  if (direction == TO_CHECKPOINT)
    folder_to_checkpoint(rt, o, watchdog);
  else
    checkpoint_to_folder(rt, o, watchdog);
  return EXIT_CODE_OK;
}

}  // namespace shardtrain
