// See evaluate.hpp.
#include "app/evaluate.hpp"

#include <boost/program_options.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>

#include "app/compute_backend.hpp"
#include "app/inference.hpp"
#include "app/options.hpp"
#include "app/perf.hpp"
#include "ckpt/checkpoint_io.hpp"
#include "ckpt/checkpoint_manager.hpp"
#include "comm/comm.hpp"
#include "comm/watchdog.hpp"
#include "core/clock.hpp"
#include "core/counted.hpp"
#include "core/format.hpp"
#include "data/data_commands.hpp"
#include "data/dataset.hpp"
#include "data/tokenizer.hpp"
#include "model/family.hpp"
#include "model/model.hpp"
#include "shard/fsdp_engine.hpp"

namespace po = boost::program_options;

namespace shardtrain {
namespace {

const char* USAGE_LINE = "shardtrain eval --checkpoint PATH [--data FILES] [--batches N|all] [options]";

struct EvalOptions {
  std::string checkpoint, data, device = "cpu", base;
  // Text until the checkpoint says what the run used: "" = the run's own.
  std::string batches, global_batch, micro_batch, seq_len;
  int threads = 0;
  double comm_timeout = 300;
};

// Returns false when --help was asked for (the text printed by rank 0).
bool parse_eval_args(const Runtime& rt, const std::vector<std::string>& args, EvalOptions& o) {
  std::string threads = "0", timeout = "300";
  po::options_description desc(std::string("usage: ") + USAGE_LINE + "\n\neval options");
  desc.add_options()  // one option per line
      ("help,h", "print the options")
      ("checkpoint", po::value(&o.checkpoint)->required(),
       "checkpoint (.h5) of a language model, either layout, saved on any rank count; or a run folder (its newest "
       "checkpoint)")
      ("base", po::value(&o.base), BASE_HELP)
      ("data", po::value(&o.data),
       "token files to evaluate on (one, a glob or a comma-separated list, as data.val_file); default: the run's "
       "data.val_file")
      ("batches", po::value(&o.batches),
       "global batches to evaluate; 'all' = every whole batch of the data; default: the run's train.eval_batches")
      ("global-batch", po::value(&o.global_batch), "sequences per batch; default: the run's train.global_batch")
      ("micro-batch", po::value(&o.micro_batch),
       "sequences per rank per forward; default: the run's train.micro_batch (the loss does not depend on it)")
      ("seq-len", po::value(&o.seq_len), "tokens per sequence; default: the run's train.seq_len")
      ("device", po::value(&o.device)->default_value(o.device),
       "cpu, or cuda (one GPU per rank by node-local rank; needs a make CUDA=1 build)")
      ("threads", po::value(&threads)->default_value(threads), "threads per rank; 0 = the cores available to the rank")
      ("comm-timeout", po::value(&timeout)->default_value(timeout),
       "seconds before a stuck collective aborts every rank; 0 = off");
  po::variables_map vm;
  if (!parse_command_options(rt, args, desc, "eval", vm)) return false;
  o.threads = static_cast<int>(parse_whole_number(threads, "--threads", 0, 4096));
  o.comm_timeout = parse_real(timeout, "comm-timeout", "give seconds >= 0 (0 = off)", 0, 1e9, true, "eval");
  if (o.device != "cpu" && o.device != "cuda")
    throw UsageError("--device='" + printable_text(o.device) + "' is not allowed; allowed: cpu, cuda");
  return true;
}

// `text` (an option) when given, else the run's recorded `key`, as a whole number in [min, max].
int64_t option_or_recorded(const std::string& text, const char* option, const std::map<std::string, std::string>& run,
                           const char* key, int64_t min, int64_t max) {
  if (!text.empty()) return static_cast<int64_t>(parse_whole_number(text, option, min, max));
  auto it = run.find(key);
  if (it == run.end())
    throw UsageError(strprintf("the checkpoint does not record %s; give %s", key, option));
  return static_cast<int64_t>(parse_whole_number(it->second, key, min, max));
}

// A run trained on packed documents (data.documents) is scored as it trained: the token its
// documents start with, given or its data.tokenizer's; -1 for a run without.
int64_t recorded_document_start(const std::map<std::string, std::string>& run) {
  const auto documents = run.find("data.documents");
  if (documents == run.end() || documents->second != "true") return -1;
  const auto given = run.find("data.document_start");
  if (given != run.end() && std::atoll(given->second.c_str()) >= 0) return std::atoll(given->second.c_str());
  const auto tokenizer = run.find("data.tokenizer");
  if (tokenizer == run.end() || tokenizer->second.empty())
    throw UsageError("the run trained on packed documents (data.documents) but recorded no data.document_start "
                     "or data.tokenizer");
  const std::optional<uint32_t> start = document_start_token(Tokenizer(tokenizer->second));
  if (!start) throw UsageError("data.tokenizer='" + tokenizer->second + "' puts no token before its documents");
  return *start;
}

}  // namespace

int run_eval(Runtime& rt, const std::vector<std::string>& args) {
  EvalOptions o;
  bool go = false;
  rt.agree_on([&] { go = parse_eval_args(rt, args, o); });
  if (!go) return EXIT_CODE_OK;
  rt.set_collective_timeout({o.comm_timeout, "--comm-timeout"});
  Watchdog watchdog(o.comm_timeout, "--comm-timeout");
  ComputeBackend compute(ComputeOptions{o.device}, rt);
  set_compute_threads(o.threads > 0 ? o.threads : default_threads_per_rank(rt.local_size()));
  auto comm = make_mpi_comm(rt.world_comm(), &watchdog);

  const std::string path = checkpoint_file_or_newest(rt, *comm, o.checkpoint, "--checkpoint", &watchdog);
  CheckpointState state;
  int64_t G = 0, B = 0, T = 0, batches = 0;
  std::unique_ptr<TokenDataset> data;
  std::string data_files = o.data;
  rt.agree_on([&] {
    state = read_checkpoint_state(path);
    if (!family_of(state.model).token_data())
      throw UsageError("checkpoint '" + path + "' holds a " + state.model.arch +
                       " model: eval scores language models on token files (a diffusion run's validation loss is in "
                       "its metrics)");
    const auto run = ini_option_values(state.config_ini);
    if (data_files.empty()) {
      auto it = run.find("data.val_file");
      if (it == run.end() || it->second.empty())
        throw UsageError("the run of checkpoint '" + path + "' had no data.val_file: give --data");
      data_files = it->second;
    }
    G = option_or_recorded(o.global_batch, "--global-batch", run, "train.global_batch", 1, 1 << 24);
    B = option_or_recorded(o.micro_batch, "--micro-batch", run, "train.micro_batch", 1, 1 << 20);
    T = option_or_recorded(o.seq_len, "--seq-len", run, "train.seq_len", 1, state.model.max_seq_len);
    if (G % (B * rt.world()) != 0)
      throw UsageError(strprintf("a batch of %lld sequences does not split into micro-batches of %lld on %s; choose "
                                 "--global-batch a multiple of --micro-batch x ranks",
                                 static_cast<long long>(G), static_cast<long long>(B),
                                 counted(rt.world(), "rank").c_str()));
    data = std::make_unique<TokenDataset>("--data", data_files, static_cast<int>(T));
    data->set_vocab_size(state.model.vocab_size);
    const auto restart = run.find("data.restart_positions");
    data->set_document_start(recorded_document_start(run), restart != run.end() && restart->second == "true");
    if (o.batches == "all") {
      data->require_records(static_cast<uint64_t>(G), strprintf("one batch of %lld sequences", static_cast<long long>(G)),
                            "use more data, or a smaller --global-batch or --seq-len");
      batches = static_cast<int64_t>(data->records() / static_cast<uint64_t>(G));
    } else {
      batches = option_or_recorded(o.batches, "--batches", run, "train.eval_batches", 1, 1 << 30);
      data->require_records(1, "one sequence", "use more data or a smaller --seq-len");
    }
  });
  rt.agree(data->check(rt.rank(), rt.world()));

  const ParamTable table(state.model, {}, state.adapter);  // a model trained with adapters: with them
  InferenceWeights weights(rt, compute, *comm, watchdog, table, path, o.base);
  FsdpEngine& engine = weights.engine;
  MemoryTracker& memory = weights.memory;
  auto model = make_model<float>(table, static_cast<int>(B), static_cast<int>(T), false, *compute.backend().ops);
  memory.add(MEM_ACTIVATIONS, model->activation_bytes());
  DeviceArray<double> sum(*compute.backend().device, 1);
  sum.zero();

  // As Trainer::evaluate: sequence seq of the evaluation reads window seq mod W.
  const int64_t accum = G / (B * rt.world());
  const uint64_t windows = data->records();
  Batch batch;
  comm->barrier("barrier(eval start)");
  const double t0 = now_seconds();
  const bool masked = data->masks_targets();
  double sums[3] = {0, 0, 0};  // the loss, the trained targets under a loss mask, the targets predicted
  // Token accuracy: a target counts when it is the most likely token (the first of equals, as
  // torch.argmax), read from the head's probabilities, which a forward without backward leaves.
  TokenLogits<float>* head = model->token_logits();
  std::vector<float> probs(static_cast<size_t>(state.model.vocab_size));
  for (int64_t k = 0; k < batches; k++)
    for (int64_t micro = 0; micro < accum; micro++) {
      data->begin(batch, static_cast<int>(B));
      for (int64_t b = 0; b < B; b++) {
        const uint64_t seq = static_cast<uint64_t>(k * G + (micro * rt.world() + rt.rank()) * B + b);
        data->fill(batch, static_cast<int>(b), seq % windows, seq, true);
        if (masked) sums[1] += static_cast<double>(data->trained_targets(seq % windows));
      }
      engine.eval_micro_batch(*model, batch, sum.data());
      const int* targets = batch.get<int>(BATCH_TARGETS, static_cast<size_t>(B * T));
      for (int r = 0; r < B * T; r++) {
        if (targets[r] < 0) continue;  // left out by the loss mask
        head->copy_head_probs(r, probs.data());
        sums[2] += std::max_element(probs.begin(), probs.end()) - probs.begin() == targets[r];
      }
    }
  compute.backend().device->copy_to_host(&sums[0], sum.data(), sizeof sums[0]);
  comm->all_reduce_sum(Span<double>(sums, 3), "all_reduce(eval loss)");
  const double seconds = now_seconds() - t0;
  // Under a loss mask the loss averages over the trained targets only (the tokens/s count all).
  const double tokens = static_cast<double>(batches) * G * model->output_rows() / B;
  const double scored = masked ? std::max(sums[1], 1.0) : tokens;
  const double loss = sums[0] / scored;
  rt.info("eval: %s (step %lld) | %s | %s | %s of %lld sequences of %lld tokens (%.0f tokens, %llu windows in the "
          "data) | loss %.6f | perplexity %.4f | token accuracy %.4f | %s, %.0f tokens/s | memory per rank %s",
          path.c_str(), static_cast<long long>(state.step), model_summary(state.model).c_str(),
          data->describe().c_str(), counted(batches, "batch", "batches").c_str(), static_cast<long long>(G),
          static_cast<long long>(T), tokens, static_cast<unsigned long long>(windows), loss, std::exp(loss),
          sums[2] / scored,
          counted(rt.world(), "rank").c_str(), tokens / seconds,
          human_bytes(static_cast<double>(memory.total_current())).c_str());
  return EXIT_CODE_OK;
}

}  // namespace shardtrain
