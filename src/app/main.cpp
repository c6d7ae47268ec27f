// shardtrain: the one executable. `shardtrain <subcommand> [options]`, launched by mpirun/srun
// (train) or directly (data). Every InputError reaching main has been agreed by all ranks (see
// Runtime::agree), so each rank exits 2 with the same message, printed once by rank 0.
#include <boost/program_options.hpp>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "app/inspect.hpp"
#include "app/options.hpp"
#include "app/planner.hpp"
#include "app/trainer.hpp"
#include "comm/runtime.hpp"
#include "core/error.hpp"
#include "ckpt/llmc.hpp"
#include "data/data_commands.hpp"

namespace po = boost::program_options;
using namespace shardtrain;

namespace {

const char* USAGE =
    "usage: shardtrain <command> [options]\n"
    "\n"
    "commands:\n"
    "  train          train a GPT model with fully sharded data parallelism (launch with mpirun/srun)\n"
    "  data synth     write the built-in synthetic corpus as byte-level token files\n"
    "  data encode    encode any text file as byte-level tokens (vocab_size 256)\n"
    "  plan           predict each rank's memory for every strategy and option, and recommend one\n"
    "  inspect FILE   print what a checkpoint holds: format, step, configuration, parameters and norms\n"
    "  export         write a checkpoint's weights as an llm.c GPT-2 checkpoint\n"
    "\n"
    "'shardtrain <command> --help' lists a command's options.\n";

int run_data(const Runtime& rt, const std::vector<std::string>& args) {
  if (args.empty() || (args[0] != "synth" && args[0] != "encode"))
    throw UsageError("'shardtrain data' needs 'synth' or 'encode'; see 'shardtrain --help'");
  const bool synth = args[0] == "synth";
  std::string out_dir = "inputs/data", input, output;
  uint64_t seed = 1;
  size_t train_bytes = 4 << 20, val_bytes = 256 << 10;
  double val_fraction = 0.05;
  po::options_description desc(synth ? "data synth options" : "data encode options");
  desc.add_options()("help,h", "print the options");
  if (synth) {
    desc.add_options()("out-dir", po::value(&out_dir)->default_value(out_dir), "folder for synth_train.bin and synth_val.bin")(
        "seed", po::value(&seed)->default_value(seed), "corpus seed")(
        "train-bytes", po::value(&train_bytes)->default_value(train_bytes), "tokens in the training file")(
        "val-bytes", po::value(&val_bytes)->default_value(val_bytes), "tokens in the validation file");
  } else {
    desc.add_options()("input", po::value(&input)->required(), "text file to encode")(
        "output", po::value(&output)->required(), "token file to write (the training part)")(
        "val-fraction", po::value(&val_fraction)->default_value(val_fraction),
        "fraction of the text, from its end, written as the validation file");
  }
  po::variables_map vm;
  try {
    std::vector<std::string> rest(args.begin() + 1, args.end());
    po::store(po::command_line_parser(rest).options(desc).run(), vm);
    if (vm.count("help")) {
      if (rt.is_root()) std::cout << desc << "\n";
      return EXIT_CODE_OK;
    }
    po::notify(vm);
  } catch (const po::error& e) {
    throw UsageError(std::string(e.what()) + "; see 'shardtrain data " + args[0] + " --help'");
  }
  if (rt.is_root()) {  // one writer; the other ranks (if any) just wait
    if (synth)
      data_synth(out_dir, seed, train_bytes, val_bytes);
    else
      data_encode(input, output, val_fraction);
  }
  return EXIT_CODE_OK;
}

// `inspect FILE` and `export --checkpoint FILE --output FILE`: serial tools, run by rank 0.
void run_checkpoint_tool(const Runtime& rt, const std::vector<std::string>& args) {
  const bool inspect = args[0] == "inspect";
  std::string checkpoint, output;
  po::options_description desc(inspect ? "usage: shardtrain inspect FILE" : "export options");
  desc.add_options()("help,h", "print the options")("checkpoint", po::value(&checkpoint)->required(),
                                                    "shardtrain checkpoint (.h5), either layout");
  if (!inspect) desc.add_options()("output", po::value(&output)->required(), "llm.c checkpoint file to write");
  po::positional_options_description positional;
  positional.add("checkpoint", 1);
  po::variables_map vm;
  try {
    std::vector<std::string> rest(args.begin() + 1, args.end());
    po::store(po::command_line_parser(rest).options(desc).positional(positional).run(), vm);
    if (vm.count("help")) {
      if (rt.is_root()) std::cout << desc << "\n";
      return;
    }
    po::notify(vm);
  } catch (const po::error& e) {
    throw UsageError(std::string(e.what()) + "; see 'shardtrain " + args[0] + " --help'");
  }
  if (!rt.is_root()) return;
  if (inspect)
    inspect_checkpoint(checkpoint);
  else
    export_llmc(checkpoint, output);
}

int run_command(const Runtime& rt, const std::vector<std::string>& args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    if (rt.is_root()) std::fputs(USAGE, stdout);
    if (args.empty()) throw UsageError("no command given; see 'shardtrain --help'");
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
    return run_training(rt, parsed.config);
  }
  if (args[0] == "data") {
    int code = EXIT_CODE_OK;
    rt.agree_on([&] { code = run_data(rt, rest); });
    return code;
  }
  if (args[0] == "plan") {
    rt.agree_on([&] { run_planner(rt, rest); });
    return EXIT_CODE_OK;
  }
  if (args[0] == "inspect" || args[0] == "export") {
    rt.agree_on([&] { run_checkpoint_tool(rt, args); });
    return EXIT_CODE_OK;
  }
  throw UsageError("unknown command '" + args[0] + "'; commands: train, plan, data synth, data encode, inspect, export");
}

}  // namespace

int main(int argc, char** argv) {
  Runtime rt(&argc, &argv);
  std::vector<std::string> args(argv + 1, argv + argc);
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
