// shardtrain: the one executable. `shardtrain <subcommand> [options]`, launched by mpirun/srun
// (train) or directly (data). Every InputError reaching main has been agreed by all ranks (see
// Runtime::agree), so each rank exits 2 with the same message, printed once by rank 0.
#include <boost/program_options.hpp>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "app/convert.hpp"
#include "app/crash_report.hpp"
#include "app/encode_text.hpp"
#include "app/evaluate.hpp"
#include "app/generate.hpp"
#include "app/sample.hpp"
#include "app/hf_export.hpp"
#include "app/inspect.hpp"
#include "app/options.hpp"
#include "app/planner.hpp"
#include "app/signals.hpp"
#include "app/trainer.hpp"
#include "app/version.hpp"
#include "comm/runtime.hpp"
#include "core/error.hpp"
#include "ckpt/llmc.hpp"
#include "data/data_commands.hpp"
#include "data/synth.hpp"
#include "data/synth_images.hpp"

namespace po = boost::program_options;
using namespace shardtrain;

namespace {

const char* USAGE =
    "usage: shardtrain <command> [options]\n"
    "\n"
    "commands:\n"
    "  train          train a model with fully sharded data parallelism (launch with mpirun/srun): GPT-2, Llama,\n"
    "                 Qwen2 language models, FLUX diffusion transformers\n"
    "  data synth     write the built-in synthetic corpus as byte-level token files\n"
    "  data encode    encode text, JSON Lines or a folder of them: byte-level tokens (vocab_size 256), or with\n"
    "                 --tokenizer a Hugging Face byte-level BPE tokenizer.json\n"
    "  data decode    a token file back to text (bytes, or with --tokenizer its tokenizer.json)\n"
    "  data synth-images  a synthetic captioned image set (shapes, colours, sizes, positions) for a pixel-space model\n"
    "  data check-images  grade images of that world against their captions, per attribute\n"
    "  generate       continue a prompt with a trained checkpoint (greedy or sampled; any rank count)\n"
    "  eval           a language model's loss and perplexity on token files, from a checkpoint (any rank count)\n"
    "  sample         images (latents) from a FLUX checkpoint with the flow-matching Euler sampler\n"
    "  encode-text    a text encoder's embeddings of a file's captions, on N ranks, as cached embeddings\n"
    "  plan           predict each rank's memory for every strategy and option, and recommend one\n"
    "  inspect FILE   print what a checkpoint holds: format, step, configuration, parameters and norms\n"
    "  export         write a checkpoint's weights as an llm.c GPT-2 checkpoint, or (--format hf) as a Hugging\n"
    "                 Face (or diffusers) folder; --adapter its adapters (PEFT folder, diffusers LoRA file)\n"
    "  convert        a Hugging Face (or diffusers) folder to a checkpoint or back, on N ranks, without training\n"
    "  version        print the version (also --version)\n"
    "\n"
    "'shardtrain <command> --help' lists a command's options.\n";

// Parses a tool's own options (not train's): positional words are returned, not ignored.
std::vector<std::string> parse_tool_options(const std::vector<std::string>& args, const po::options_description& desc,
                                            po::variables_map& vm) {
  po::parsed_options parsed = po::command_line_parser(args).options(desc).run();
  po::store(parsed, vm);
  return po::collect_unrecognized(parsed.options, po::include_positional);
}

int run_data(Runtime& rt, const std::vector<std::string>& args) {
  if (args.empty() || (args[0] != "synth" && args[0] != "encode" && args[0] != "decode" && args[0] != "synth-images" &&
                       args[0] != "check-images"))
    throw UsageError("'shardtrain data' needs 'synth', 'encode', 'decode', 'synth-images' or 'check-images'; see "
                     "'shardtrain --help'");
  const bool synth = args[0] == "synth", decode = args[0] == "decode";
  const bool synth_images = args[0] == "synth-images", check_images = args[0] == "check-images";
  // The counts are read as text: Boost reads "-1" into an unsigned option as 2^64-1.
  std::string out_dir = "inputs/data", input, output, seed = "1", tokenizer, separator, first = "0", count = "0";
  std::string train_bytes = std::to_string(4 << 20), val_bytes = std::to_string(256 << 10), shard_tokens = "0";
  std::string timeout = "300", loss_on = "completion";
  std::string images, labels, json, image_size = "32", patch = "4", train_images = "8192", val_images = "256";
  double val_fraction = 0.05;
  bool val_shard = false;
  po::options_description desc("data " + args[0] + " options");
  desc.add_options()("help,h", "print the options")(
      "comm-timeout", po::value(&timeout)->default_value(timeout),
      "seconds the other ranks wait for a sign of life from rank 0, which does the work (0 = forever)");
  if (synth_images) {
    desc.add_options()  // one option per line
        ("out-dir", po::value(&out_dir)->default_value(out_dir),
         "folder for shapes_train.h5, shapes_val.h5, shapes_prompts.h5 and shapes_empty.h5")
        ("seed", po::value(&seed)->default_value(seed), "the images' seed (the word embeddings keep theirs)")
        ("train-images", po::value(&train_images)->default_value(train_images), "images in the training file")
        ("val-images", po::value(&val_images)->default_value(val_images), "images in the validation file; 0 = none")
        ("image-size", po::value(&image_size)->default_value(image_size), "pixels a side, 32 to 1024 (the checker reads every drawing exactly from 32)")
        ("patch", po::value(&patch)->default_value(patch), "pixels a side of one token's patch; divides --image-size");
  } else if (check_images) {
    desc.add_options()  // one option per line
        ("images", po::value(&images)->required(),
         "HDF5 file of pixel-space images: the output of 'shardtrain sample' from a model.pixel_patch model, or a "
         "synth-images file (its real images)")
        ("labels", po::value(&labels),
         "HDF5 file whose 'labels' say what each image should show (default: --images itself); the samples of "
         "shapes_prompts.h5 are graded against shapes_prompts.h5")
        ("json", po::value(&json), "also write the rates as one JSON line to this file");
  } else if (synth) {
    const std::string most = strprintf(", at most %zu", SYNTH_MAX_BYTES);
    desc.add_options()  // one option per line
        ("out-dir", po::value(&out_dir)->default_value(out_dir), "folder for synth_train.bin and synth_val.bin")
        ("jsonl", po::value(&input),
         "instead of token files: the corpus (--train-bytes of it) as JSON Lines documents in this file, one "
         "{\"text\": ...} per line of the corpus")
        ("seed", po::value(&seed)->default_value(seed), "corpus seed")
        ("train-bytes", po::value(&train_bytes)->default_value(train_bytes),
         ("tokens in the training file" + most).c_str())
        ("val-bytes", po::value(&val_bytes)->default_value(val_bytes),
         ("tokens in the validation file" + most + "; 0 = none").c_str());
  } else if (decode) {
    output = "-";
    desc.add_options()("input", po::value(&input)->required(), "token file to decode (llm.c .bin)")(
        "output", po::value(&output)->default_value(output), "text file to write; - = standard output")(
        "tokenizer", po::value(&tokenizer), "the tokenizer.json the file was encoded with; without it, byte-level")(
        "first", po::value(&first)->default_value(first), "index of the first token to decode")(
        "count", po::value(&count)->default_value(count), "tokens to decode; 0 = to the end");
  } else {
    desc.add_options()("input", po::value(&input)->required(),
                       "text file to encode; with --tokenizer also a .jsonl file (a \"text\" field per line) or a "
                       "folder of them (one document per text file)")(
        "output", po::value(&output)->required(), "token file to write (the training part)")(
        "val-fraction", po::value(&val_fraction)->default_value(val_fraction, "0.05"),
        "fraction written as the validation file, from the end: of the bytes; with --tokenizer of the documents "
        "(of the tokens when that is no whole document)")(
        "shard-tokens", po::value(&shard_tokens)->default_value(shard_tokens),
        "with --tokenizer: the training tokens in files of this many, OUTPUT_000000.bin, ...; 0 = one file")(
        "val-shard", po::bool_switch(&val_shard), "with --shard-tokens: the last shard is the validation file")(
        "tokenizer", po::value(&tokenizer), "Hugging Face tokenizer.json (byte-level BPE) instead of bytes; see docs/data.md")(
        "separator", po::value(&separator),
        "with --tokenizer: the token put before each document (default: the tokenizer's end-of-text token; none: no token)")(
        "loss-on", po::value(&loss_on)->default_value(loss_on),
        "chat and instruction records (\"segments\", from tools/chat_template.py): completion trains on the "
        "assistant's or completion's tokens only (a loss mask in the file), all on every token");
  }
  const std::string help = "; see 'shardtrain data " + args[0] + " --help'";
  po::variables_map vm;
  bool print_help = false;
  double timeout_seconds = 0;
  rt.agree_on([&] {
    try {
      const std::vector<std::string> words = parse_tool_options({args.begin() + 1, args.end()}, desc, vm);
      if ((print_help = vm.count("help") > 0)) return;
      reject_stray_words(words, "data " + args[0]);
      po::notify(vm);
    } catch (const po::error& e) {
      throw UsageError(option_error_text(e) + help);
    }
    timeout_seconds = static_cast<double>(parse_whole_number(timeout, "--comm-timeout", 0, 1u << 30));
  });
  if (print_help) {
    if (rt.is_root()) std::cout << desc << "\n";
    return EXIT_CODE_OK;
  }
  rt.set_collective_timeout({timeout_seconds, "--comm-timeout"});
  // The data commands are serial: rank 0 works, the others wait for it (Runtime::on_root).
  const std::string command = "data " + args[0];
  rt.on_root(command.c_str(), [&] {
    Runtime::debug_stall("root-work");
    if (synth_images) {
      ShapeWorld world;
      world.image_size = static_cast<int>(parse_whole_number(image_size, "--image-size", 32, 1024));
      const int patch_value = static_cast<int>(parse_whole_number(patch, "--patch", 1, 64));
      if (world.image_size % patch_value != 0)
        throw UsageError("--patch=" + patch + " does not divide --image-size=" + image_size + " into whole patches" + help);
      data_synth_images(out_dir, world, patch_value, parse_whole_number(seed, "--seed", 0, UINT64_MAX),
                        parse_whole_number(train_images, "--train-images", 1, 1u << 24),
                        parse_whole_number(val_images, "--val-images", 0, 1u << 24));
    } else if (check_images) {
      data_check_images(images, labels.empty() ? images : labels, json);
    } else if (synth) {
      const uint64_t seed_value = parse_whole_number(seed, "--seed", 0, UINT64_MAX);
      const size_t train_count = parse_whole_number(train_bytes, "--train-bytes", 1, SYNTH_MAX_BYTES);
      const size_t val_count = parse_whole_number(val_bytes, "--val-bytes", 0, SYNTH_MAX_BYTES);
      if (vm.count("jsonl"))
        data_synth_jsonl(input, seed_value, train_count);
      else
        data_synth(out_dir, seed_value, train_count, val_count);
    } else if (decode) {
      const uint64_t first_value = parse_whole_number(first, "--first", 0, UINT64_MAX);
      const uint64_t count_value = parse_whole_number(count, "--count", 0, UINT64_MAX);
      data_decode(input, tokenizer, output, first_value, count_value);
    } else if (vm.count("tokenizer")) {
      if (val_shard && !vm["val-fraction"].defaulted())
        throw UsageError("--val-shard and --val-fraction both choose the validation part; give one" + help);
      EncodeLayout layout;
      layout.val_fraction = val_shard ? 0 : val_fraction;
      layout.shard_tokens = parse_whole_number(shard_tokens, "--shard-tokens", 0, INT32_MAX);
      layout.val_last_shard = val_shard;
      if (loss_on != "completion" && loss_on != "all")
        throw UsageError("--loss-on='" + printable_text(loss_on) + "' must be completion or all" + help);
      data_encode_tokenized(input, tokenizer, output, layout, separator, loss_on == "completion");
    } else {
      if (vm.count("separator")) throw UsageError("--separator needs --tokenizer" + help);
      if (!vm["loss-on"].defaulted()) throw UsageError("--loss-on needs --tokenizer" + help);
      if (val_shard || shard_tokens != "0") throw UsageError("--shard-tokens and --val-shard need --tokenizer" + help);
      data_encode(input, output, val_fraction);
    }
  });
  return EXIT_CODE_OK;
}

// `inspect FILE` and `export --checkpoint FILE --output PATH`: inspect and the llm.c export are serial
// tools run by rank 0 (Runtime::on_root); the Hugging Face exports are shared by all ranks.
int run_checkpoint_tool(Runtime& rt, const std::vector<std::string>& args) {
  const bool inspect = args[0] == "inspect";
  const std::string usage = inspect ? "shardtrain inspect FILE"
                                    : "shardtrain export --checkpoint FILE --output PATH [--format llmc|hf [--merge] | "
                                      "--adapter] [hf options]";
  std::string checkpoint, output, format = "llmc", dtype = "fp32", max_file_size = "5GB", timeout = "300",
                                 quantize = "none", quant_block = "64";
  bool adapter = false, merge = false, double_quant = false;
  po::options_description desc("usage: " + usage + "\n\n" + args[0] + " options");
  desc.add_options()("help,h", "print the options")(
      "checkpoint", po::value(&checkpoint), "shardtrain checkpoint (.h5), either layout (or as the first word)");
  if (!inspect)
    desc.add_options()("output", po::value(&output)->required(),
                       "llmc: the llm.c checkpoint file to write; hf: the folder for config.json and model.safetensors")(
        "format", po::value(&format)->default_value(format),
        "llmc (llm.c GPT-2 fp32 weights) or hf (a Hugging Face GPT-2 or Llama folder the transformers library "
        "loads)")(
        "dtype", po::value(&dtype)->default_value(dtype), "hf: the type of the exported weights, fp32, bf16 or fp16")(
        "max-file-size", po::value(&max_file_size)->default_value(max_file_size),
        "hf: larger weights are split into files of at most this size with model.safetensors.index.json, as "
        "transformers' save_pretrained does")(
        "adapter", po::bool_switch(&adapter),
        "write the checkpoint's adapters as a Hugging Face PEFT folder (adapter_config.json, "
        "adapter_model.safetensors) instead of the model; --dtype applies")(
        "merge", po::bool_switch(&merge),
        "hf: fold the checkpoint's adapters into the weights as PEFT's merge_and_unload does and export a plain "
        "model")(
        "quantize", po::value(&quantize)->default_value(quantize),
        "hf: nf4 or fp4 writes the blocks' linear weights as bitsandbytes 4-bit tensors with config.json's "
        "quantization_config, as transformers saves a model loaded with load_in_4bit (Llama, Qwen2); none: as --dtype")(
        "quant-block", po::value(&quant_block)->default_value(quant_block),
        "hf --quantize: elements per block (one absmax each), a power of two from 32 to 4096")(
        "double-quant", po::bool_switch(&double_quant),
        "hf --quantize: also quantize the absmax to 8 bits in blocks of 256 (bnb_4bit_use_double_quant)")(
        "comm-timeout", po::value(&timeout)->default_value(timeout),
        "seconds before a collective that waits for a stalled or dead rank aborts every rank (0 = off)");
  const std::string help = "; see 'shardtrain " + args[0] + " --help'";
  po::variables_map vm;
  bool print_help = false;
  DType export_dtype = DTYPE_FP32;
  uint64_t max_file_bytes = 0;
  HfQuantizedExport quant;
  rt.agree_on([&] {
    try {
      std::vector<std::string> words = parse_tool_options({args.begin() + 1, args.end()}, desc, vm);
      if ((print_help = vm.count("help") > 0)) return;
      if (!vm.count("checkpoint")) {  // the checkpoint as the first word
        if (words.empty()) throw UsageError("missing argument FILE, the checkpoint: " + usage + help);
        checkpoint = words.front();
        words.erase(words.begin());
      }
      reject_stray_words(words, args[0]);
      po::notify(vm);
    } catch (const po::error& e) {
      throw UsageError(option_error_text(e) + help);
    }
    if (adapter && (merge || vm["format"].defaulted() == false))
      throw UsageError("export --adapter writes the adapters alone: it takes neither --merge nor --format");
    if (!adapter && merge && format != "hf")
      throw UsageError("--merge applies to --format=hf (llm.c's format has no adapters to fold)");
    if (!inspect && !adapter && format != "llmc" && format != "hf")
      throw UsageError("--format='" + printable_text(format) + "' is not allowed; allowed: llmc, hf");
    if (!inspect && !adapter && format == "llmc" && dtype != "fp32")
      throw UsageError("--dtype applies to --format=hf; llm.c weights are fp32");
    export_dtype = parse_dtype_option(dtype, "--dtype");
    auto given = [&](const char* option) { return vm.count(option) && !vm[option].defaulted(); };
    const bool quant_options = given("quantize") || given("quant-block") || double_quant;
    if (quant_options && (adapter || format != "hf"))
      throw UsageError("--quantize, --quant-block and --double-quant apply to --format=hf (a bitsandbytes 4-bit "
                       "folder of the model), not to " + std::string(adapter ? "--adapter" : "llm.c files"));
    if (quantize != "none" && (!parse_quant_type(quantize, &quant.type) ||
                               (quant.type != QUANT_NF4 && quant.type != QUANT_FP4)))
      throw UsageError("--quantize='" + printable_text(quantize) + "' is not allowed; allowed: none, nf4, fp4 "
                       "(bitsandbytes' 4-bit formats)");
    if ((given("quant-block") || double_quant) && quant.type == QUANT_NONE)
      throw UsageError("--quant-block and --double-quant shape a 4-bit export: add --quantize=nf4 or fp4");
    quant.block = static_cast<size_t>(parse_whole_number(quant_block, "--quant-block", 1, 1 << 20));
    if (!quant_block_ok(static_cast<int>(quant.block)))
      throw UsageError("--quant-block=" + quant_block + " is not one of bitsandbytes' block sizes: a power of two "
                       "from 32 to 4096 (64 is its default)");
    quant.double_quant = double_quant;
    if (!inspect && format == "hf") max_file_bytes = parse_memory_limit(max_file_size, "--max-file-size").bytes;
    rt.set_collective_timeout(
        {static_cast<double>(parse_whole_number(timeout, "--comm-timeout", 0, 1u << 30)), "--comm-timeout"});
  });
  if (print_help) {
    if (rt.is_root()) std::cout << desc << "\n";
  } else if (adapter) {
    rt.agree_on([&] { export_peft_folder(rt, checkpoint, output, export_dtype); });
  } else if (!inspect && format == "hf") {
    rt.agree_on([&] { export_hf_folder(rt, checkpoint, output, export_dtype, max_file_bytes, merge, quant); });
  } else {
    rt.on_root(args[0].c_str(), [&] {
      if (inspect)
        inspect_checkpoint(checkpoint);
      else
        export_llmc(checkpoint, output);
    });
  }
  return EXIT_CODE_OK;
}

int run_command(Runtime& rt, const std::vector<std::string>& args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    if (rt.is_root()) std::fputs(USAGE, stdout);
    if (args.empty()) throw UsageError("no command given; see 'shardtrain --help'");
    return EXIT_CODE_OK;
  }
  if (args[0] == "--version" || args[0] == "version") {
    if (rt.is_root())
      std::printf("shardtrain %s%s, built for %s\n", SHARDTRAIN_RELEASE,
                  *SHARDTRAIN_VERSION ? strprintf(" (git %s)", SHARDTRAIN_VERSION).c_str() : "", SHARDTRAIN_MARCH);
    return EXIT_CODE_OK;
  }
  const std::vector<std::string> rest(args.begin() + 1, args.end());
  if (args[0] == "train") {
    ParsedTrainArgs parsed;
    rt.agree_on([&] { parsed = parse_train_args(rest); });
    if (parsed.help) {
      if (rt.is_root()) std::cout << train_help() << "\n";
      return EXIT_CODE_OK;
    }
    rt.agree_on([&] { validate_config(parsed.config, rt.world()); });
    rt.set_collective_timeout({parsed.config.fsdp.comm_timeout, "fsdp.comm_timeout"});
    return run_training(rt, parsed.config);
  }
  if (args[0] == "data") return run_data(rt, rest);
  if (args[0] == "generate") return run_generate(rt, rest);
  if (args[0] == "eval") return run_eval(rt, rest);
  if (args[0] == "sample") return run_sample(rt, rest);
  if (args[0] == "encode-text") return run_encode_text(rt, rest);
  if (args[0] == "convert") return run_convert(rt, rest);
  if (args[0] == "plan") {
    rt.agree_on([&] { run_planner(rt, rest); });
    return EXIT_CODE_OK;
  }
  if (args[0] == "inspect" || args[0] == "export") return run_checkpoint_tool(rt, args);
  throw UsageError("unknown command '" + printable_text(args[0]) +
                   "'; commands: train, generate, eval, sample, encode-text, plan, data synth, data encode, data decode, data synth-images, data check-images, inspect, export, "
                   "convert, version");
}

}  // namespace

// libgomp's threads spin 300,000 times waiting for work before they sleep. On a machine whose cores
// other processes share, the spinning thread holds a core the working one needs: 2 threads trained
// the default model at half of 1 thread's tokens/s beside two busy processes on 2 cores. 30,000
// spins keep a quiet machine's speed and double that (docs/performance.md, "Threads on a shared
// machine"). libgomp reads its environment before main, so the program starts itself
// again with it, once, before MPI_Init (the same process: the launcher sees nothing); a user's
// GOMP_SPINCOUNT or OMP_WAIT_POLICY is left alone.
static void set_openmp_spin_count(char** argv) {
  if (std::getenv("GOMP_SPINCOUNT") || std::getenv("OMP_WAIT_POLICY")) return;
  // The binary's own path, not /proc/self/exe: the process keeps its name (ps, pgrep, Slurm).
  char self[4096];
  const ssize_t length = readlink("/proc/self/exe", self, sizeof self - 1);
  if (length <= 0) return;
  self[length] = '\0';
  setenv("GOMP_SPINCOUNT", "30000", 1);
  block_stop_signals(true);  // a stop signal meanwhile waits for the restarted program's handler
  execv(self, argv);  // returns only on failure: then run on with libgomp's defaults
  block_stop_signals(false);
  unsetenv("GOMP_SPINCOUNT");
}

int main(int argc, char** argv) {
  set_openmp_spin_count(argv);
  install_crash_reporter();
  // Before MPI_Init: a stop signal in the first moments of a training run is recorded, not fatal.
  if (argc > 1 && std::string(argv[1]) == "train") install_stop_signal_handlers(), exit_with_mpirun();
  block_stop_signals(false);  // blocked across the restart: a pending one is taken now
  std::vector<std::string> args(argv + 1, argv + argc);
  Runtime rt(&argc, &argv, startup_timeout(args));
  try {
    return run_command(rt, args);
  } catch (const InputError& e) {
    // Agreed by every rank (Runtime::agree), so all of them get here with the same message.
    if (rt.is_root()) std::fprintf(stderr, "shardtrain: error: %s\n", e.what());
    return EXIT_CODE_BAD_INPUT;
  } catch (const std::exception& e) {
    fatal_internal(__FILE__, __LINE__, __func__, std::string("unexpected exception: ") + e.what());
  }
}
