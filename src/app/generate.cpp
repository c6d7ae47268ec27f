// See generate.hpp. The collectives, identical on every rank: the option and input agreements, the
// checkpoint's list and load, the prompt's broadcast from rank 0, then per step the engine's gathers
// (FsdpEngine::decode_step) and the broadcast of the token rank 0 drew.
#include "app/generate.hpp"

#include <boost/program_options.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <numeric>

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
#include "core/random.hpp"
#include "data/data_commands.hpp"
#include "data/tokenizer.hpp"
#include "model/family.hpp"
#include "model/model.hpp"
#include "shard/fsdp_engine.hpp"

namespace po = boost::program_options;

namespace shardtrain {

int sample_token(const float* logits, int allowed, const SamplingOptions& o, uint64_t draw) {
  SHARD_CHECK(allowed >= 1, "sample_token over %d tokens", allowed);
  if (o.temperature == 0) {
    int best = 0;
    for (int i = 1; i < allowed; i++)
      if (logits[i] > logits[best]) best = i;
    return best;
  }
  // Candidates by logit (then id), cut to the k most likely.
  std::vector<int> ids(allowed);
  std::iota(ids.begin(), ids.end(), 0);
  auto before = [&](int a, int b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  const size_t keep = o.top_k > 0 ? std::min<size_t>(o.top_k, ids.size()) : ids.size();
  std::partial_sort(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(keep), ids.end(), before);
  ids.resize(keep);
  // Softmax of logits / temperature over them, in double.
  std::vector<double> p(keep);
  double total = 0;
  for (size_t j = 0; j < keep; j++) {
    p[j] = std::exp((static_cast<double>(logits[ids[j]]) - logits[ids[0]]) / o.temperature);
    total += p[j];
  }
  // The nucleus: the fewest leading candidates whose probability reaches top_p.
  if (o.top_p < 1) {
    double mass = 0;
    size_t n = 0;
    while (n < keep && (n == 0 || mass < o.top_p * total)) mass += p[n++];
    p.resize(n), ids.resize(n), total = mass;
  }
  const double u = counter_uniform(mix64(o.seed ^ 0x67656E6572617465ull), draw) * total;  // "generate"
  double cumulative = 0;
  for (size_t j = 0; j < p.size(); j++) {
    cumulative += p[j];
    if (u < cumulative) return ids[j];
  }
  return ids.back();  // u within rounding of the total
}

namespace {

constexpr int PREFILL_CHUNK = 64;  // prompt tokens per prefill step (docs/generate.md)

struct GenerateOptions {
  std::string checkpoint, prompt, tokenizer, base;
  bool tokenizer_given = false;
  std::vector<std::string> stops;  // --stop: texts that end the output
  bool ignore_eos = false;
  int max_tokens = 64;
  SamplingOptions sampling;
  std::string device = "cpu";
  int threads = 0;
  double comm_timeout = 300;
};

const char* USAGE_LINE = "shardtrain generate --checkpoint PATH --prompt TEXT [--max-tokens N] [options]";


// Returns false when --help was asked for (the text printed by rank 0).
bool parse_generate_args(const Runtime& rt, const std::vector<std::string>& raw_args, GenerateOptions& o) {
  // "--key=" (an empty value: --tokenizer= for bytes) becomes "--key" "", which Boost accepts.
  std::vector<std::string> args;
  for (const std::string& a : raw_args) {
    if (a.size() > 3 && a.compare(0, 2, "--") == 0 && a.back() == '=' && a.find('=') == a.size() - 1) {
      args.push_back(a.substr(0, a.size() - 1));
      args.emplace_back();
    } else {
      args.push_back(a);
    }
  }
  std::string max_tokens = "64", temperature = "1", top_k = "0", top_p = "1", seed = "1337", threads = "0",
              timeout = "300";
  po::options_description desc(std::string("usage: ") + USAGE_LINE + "\n\ngenerate options");
  desc.add_options()  // one option per line
      ("help,h", "print the options")
      ("checkpoint", po::value(&o.checkpoint)->required(),
       "checkpoint (.h5) to generate from, either layout, saved on any rank count; or a run folder (its newest "
       "checkpoint)")
      ("prompt", po::value(&o.prompt)->required(), "the text to continue (at least one token)")
      ("base", po::value(&o.base), BASE_HELP)
      ("max-tokens", po::value(&max_tokens)->default_value(max_tokens),
       "tokens to generate at most; fewer when prompt and output reach model.max_seq_len")
      ("temperature", po::value(&temperature)->default_value(temperature),
       "divides the logits before the softmax; 0 = greedy (the most likely token every time)")
      ("top-k", po::value(&top_k)->default_value(top_k), "sample among the k most likely tokens only; 0 = all")
      ("top-p", po::value(&top_p)->default_value(top_p),
       "sample among the fewest most likely tokens whose probabilities reach p (nucleus sampling); 1 = all")
      ("seed", po::value(&seed)->default_value(seed),
       "sampling seed: a seed, checkpoint and options give the same text on any rank count")
      ("stop", po::value(&o.stops)->composing(),
       "stop when the output contains this text (not written); repeat for several")
      ("ignore-eos", po::bool_switch(&o.ignore_eos),
       "go on past the tokenizer's end-of-text token (written as its text) instead of stopping there")
      ("tokenizer", po::value(&o.tokenizer),
       "Hugging Face tokenizer.json for the prompt and the output; default: the run's data.tokenizer, recorded in "
       "the checkpoint, else bytes; --tokenizer= (empty) = bytes")
      ("device", po::value(&o.device)->default_value(o.device),
       "cpu, or cuda (one GPU per rank by node-local rank; needs a make CUDA=1 build)")
      ("threads", po::value(&threads)->default_value(threads), "threads per rank; 0 = the cores available to the rank")
      ("comm-timeout", po::value(&timeout)->default_value(timeout),
       "seconds before a stuck collective aborts every rank; 0 = off");
  po::variables_map vm;
  if (!parse_command_options(rt, args, desc, "generate", vm)) return false;
  o.tokenizer_given = vm.count("tokenizer") > 0;
  o.max_tokens = static_cast<int>(parse_whole_number(max_tokens, "--max-tokens", 1, 1 << 30));
  o.sampling.temperature =
      parse_real(temperature, "temperature", "give a number >= 0 (0 = greedy)", 0, 1e6, true, "generate");
  o.sampling.top_k = static_cast<int>(parse_whole_number(top_k, "--top-k", 0, 1 << 30));
  o.sampling.top_p = parse_real(top_p, "top-p", "give a number in (0, 1] (1 = no cut)", 0, 1, false, "generate");
  o.sampling.seed = parse_whole_number(seed, "--seed", 0, UINT64_MAX);
  o.threads = static_cast<int>(parse_whole_number(threads, "--threads", 0, 4096));
  o.comm_timeout = parse_real(timeout, "comm-timeout", "give seconds >= 0 (0 = off)", 0, 1e9, true, "generate");
  if (o.device != "cpu" && o.device != "cuda")
    throw UsageError("--device='" + printable_text(o.device) + "' is not allowed; allowed: cpu, cuda");
  if (o.prompt.empty())
    throw UsageError("--prompt is empty: give the text to continue (at least one token)");
  for (const std::string& stop : o.stops)
    if (stop.empty()) throw UsageError("--stop is empty: give the text that ends the output");
  return true;
}

// Broadcasts a vector of ints from rank 0 (its size first).
void broadcast_ints(Comm& comm, std::vector<int>& values, const char* what) {
  uint64_t n = values.size();
  comm.broadcast(Span<char>(reinterpret_cast<char*>(&n), sizeof n), 0, what);
  values.resize(n);
  comm.broadcast(Span<char>(reinterpret_cast<char*>(values.data()), n * sizeof(int)), 0, what);
}

// Rank 0's standard output: the prompt, then each token's text as it comes, flushed. Bytes that
// end in an incomplete UTF-8 character wait for the next token, and text that may be the start of
// a --stop text waits until it is not, so what is written is the prompt and the whole output's
// decode (tokenizer.hpp: utf8_complete_prefix), cut before the first stop text.
class TextStream {
 public:
  explicit TextStream(const std::vector<std::string>& stops) : stops_(stops) {}

  void write_prompt(const std::string& prompt) { write(prompt); }
  // The stop text add() found.
  const std::string& matched() const { return *matched_; }

  // Adds one token's bytes; true when the output now holds a stop text (the text before it written).
  bool add(const std::string& bytes) {
    pending_bytes_ += bytes;
    const size_t complete = utf8_complete_prefix(pending_bytes_);
    held_ += utf8_with_replacements(std::string_view(pending_bytes_).substr(0, complete));
    pending_bytes_.erase(0, complete);
    size_t first = std::string::npos;
    for (const std::string& stop : stops_) {
      const size_t at = held_.find(stop);
      if (at < first) first = at, matched_ = &stop;
    }
    if (first != std::string::npos) {
      write(std::string_view(held_).substr(0, first));
      held_.clear();
      return true;
    }
    // Hold the longest end of the text that begins a stop text.
    size_t hold = 0;
    for (const std::string& stop : stops_)
      for (size_t k = std::min(stop.size() - 1, held_.size()); k > hold; k--)
        if (held_.compare(held_.size() - k, k, stop, 0, k) == 0) {
          hold = k;
          break;
        }
    write(std::string_view(held_).substr(0, held_.size() - hold));
    held_.erase(0, held_.size() - hold);
    return false;
  }

  // Writes what is held (an incomplete character as U+FFFD) and a final newline if the text has none.
  void finish() {
    write(held_ + utf8_with_replacements(pending_bytes_));
    if (last_ != '\n') write("\n");
  }

 private:
  void write(std::string_view text) {
    if (text.empty()) return;
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
    last_ = text.back();
  }

  const std::vector<std::string>& stops_;
  std::string pending_bytes_;  // the start of a UTF-8 character
  std::string held_;           // text that may begin a stop text
  const std::string* matched_ = nullptr;
  char last_ = '\n';
};

// A path for a message: relative to the working folder when it lies below it (train records
// data.tokenizer absolute), else as it is.
std::string shown_path(const std::string& path) {
  const std::filesystem::path relative = std::filesystem::path(path).lexically_relative(std::filesystem::current_path());
  return relative.empty() || *relative.begin() == ".." ? path : relative.string();
}

class Generator {
 public:
  Generator(const Runtime& rt, const GenerateOptions& o)
      : rt_(rt),
        o_(o),
        watchdog_(o.comm_timeout, "--comm-timeout"),
        compute_(ComputeOptions{o.device}, rt),
        comm_(make_mpi_comm(rt.world_comm(), &watchdog_)) {
    threads_ = o.threads > 0 ? o.threads : default_threads_per_rank(rt.local_size());
    set_compute_threads(threads_);
  }

  int run();

 private:
  void encode_prompt(const CheckpointState& state);
  std::string bytes_of(int id) const;
  std::string stops_summary() const;
  void find_stop_tokens();

  const Runtime& rt_;
  const GenerateOptions& o_;
  int threads_ = 1;
  Watchdog watchdog_;
  ComputeBackend compute_;
  std::unique_ptr<Comm> comm_;  // MPI on host memory: agreements, the prompt and the tokens
  std::string tokenizer_path_;  // "" = bytes
  std::unique_ptr<Tokenizer> tokenizer_;  // rank 0's
  int allowed_ = 256;  // ids the tokenizer can write: rank 0 samples among these
  std::vector<int> prompt_;
  std::map<int, std::string> stop_tokens_;  // id -> its text, unless --ignore-eos (rank 0's)
};

// Rank 0 encodes the prompt and everyone receives its ids; the verdicts are agreed.
void Generator::encode_prompt(const CheckpointState& state) {
  const ModelConfig& m = state.model;
  if (o_.tokenizer_given) {
    tokenizer_path_ = o_.tokenizer;
  } else {
    const auto recorded = ini_option_values(state.config_ini);
    auto it = recorded.find("data.tokenizer");
    if (it != recorded.end()) tokenizer_path_ = it->second;
  }
  rt_.agree_on([&] {
    if (!rt_.is_root()) return;
    if (tokenizer_path_.empty()) {
      if (m.vocab_size > 256)
        std::fprintf(stderr, "warning: the run recorded no tokenizer (data.tokenizer) and its model has %d token ids: "
                     "the prompt is read, and the output written, as bytes; give the tokenizer.json the data was "
                     "encoded with as --tokenizer\n", m.vocab_size);
      allowed_ = std::min(256, m.vocab_size);
      for (unsigned char c : o_.prompt) prompt_.push_back(c);
    } else {
      if (!std::filesystem::exists(tokenizer_path_))
        throw UsageError("tokenizer '" + printable_text(tokenizer_path_) + "' " +
                         (o_.tokenizer_given ? "(--tokenizer)" : "(the run's data.tokenizer, recorded in the checkpoint)") +
                         " does not exist; name the tokenizer.json with --tokenizer, or --tokenizer= for bytes");
      tokenizer_ = std::make_unique<Tokenizer>(tokenizer_path_);
      allowed_ = static_cast<int>(std::min<uint32_t>(tokenizer_->vocab_size(), m.vocab_size));
      std::vector<uint32_t> ids;
      tokenizer_->encode(utf8_with_replacements(o_.prompt), ids);
      // A text to continue has no end: without the template's appended ids (its EOS).
      const std::vector<uint32_t>& appended = tokenizer_->appended_ids();
      if (!appended.empty() && ids.size() >= appended.size() &&
          std::equal(appended.begin(), appended.end(), ids.end() - static_cast<std::ptrdiff_t>(appended.size())))
        ids.resize(ids.size() - appended.size());
      prompt_.assign(ids.begin(), ids.end());
      find_stop_tokens();
    }
    if (prompt_.empty()) throw UsageError("--prompt encodes to no tokens: give the text to continue");
    for (int id : prompt_)
      if (id >= m.vocab_size)
        throw UsageError(strprintf("--prompt has token id %d, past the model's model.vocab_size=%d: the tokenizer "
                                   "'%s' is not the model's",
                                   id, m.vocab_size, printable_text(tokenizer_path_).c_str()));
    if (static_cast<int>(prompt_.size()) >= m.max_seq_len)
      throw UsageError(strprintf("--prompt is %s, and model.max_seq_len=%d leaves no room to generate; give a "
                                 "shorter prompt",
                                 counted(static_cast<long long>(prompt_.size()), "token").c_str(), m.max_seq_len));
  });
  broadcast_ints(*comm_, prompt_, "broadcast(prompt)");
}

std::string Generator::bytes_of(int id) const {
  return tokenizer_ ? tokenizer_->token_bytes(static_cast<uint32_t>(id)) : std::string(1, static_cast<char>(id));
}

// For the start line: what ends the output before the length limits.
std::string Generator::stops_summary() const {
  std::string text;
  for (const auto& [id, name] : stop_tokens_) text += (text.empty() ? "" : ", ") + strprintf("%s (id %d)", printable_text(name).c_str(), id);
  for (const std::string& stop : o_.stops) text += (text.empty() ? "" : ", ") + ("--stop '" + printable_text(stop) + "'");
  return text.empty() ? "--max-tokens or model.max_seq_len only" : text;
}

// The tokenizer's end-of-text tokens: the post-processor's appended ids, and the special tokens that
// `data encode` puts between documents or that end a chat turn. A model trained on encoded
// documents writes one where a document ends. Bytes have none.
void Generator::find_stop_tokens() {
  if (!tokenizer_ || o_.ignore_eos) return;
  for (uint32_t id : end_of_text_ids(*tokenizer_)) stop_tokens_[static_cast<int>(id)] = tokenizer_->decode({id});
}

int Generator::run() {
  const std::string path = checkpoint_file_or_newest(rt_, *comm_, o_.checkpoint, "--checkpoint", &watchdog_);
  CheckpointState state;
  rt_.agree_on([&] {
    state = read_checkpoint_state(path);
    require_capability(state.model, "generate", "checkpoint '" + path + "'");
  });
  encode_prompt(state);
  const ModelConfig& m = state.model;
  const int P = static_cast<int>(prompt_.size());

  const ParamTable table(m, {}, state.adapter);  // a model trained with adapters: with them
  InferenceWeights weights(rt_, compute_, *comm_, watchdog_, table, path, o_.base);
  FsdpEngine& engine = weights.engine;
  MemoryTracker& memory = weights.memory;

  // Positions fed: the prompt and every generated token but the last, within max_seq_len.
  const int total_limit = std::min<long long>(m.max_seq_len, static_cast<long long>(P) + o_.max_tokens);
  const int max_len = std::max(P, total_limit - 1);
  auto model = make_model<float>(table, 1, 1, false, *compute_.backend().ops);
  KvDecoder<float>& decoder = *model->kv_decoder();  // the family has it (require_capability)
  decoder.begin_decode(max_len, std::min(P, PREFILL_CHUNK));
  memory.add(MEM_ACTIVATIONS, model->activation_bytes() + decoder.decode_bytes());
  if (rt_.is_root())
    std::fprintf(stderr,
                 "generate: %s (step %lld) | %s | %s x %s, %s | tokenizer %s | prompt %s | stops at %s | memory per "
                 "rank %s (key/value cache and buffers %s)\n",
                 path.c_str(), static_cast<long long>(state.step), model_summary(m).c_str(),
                 counted(rt_.world(), "rank").c_str(), counted(threads_, "thread").c_str(), compute_.describe().c_str(),
                 tokenizer_path_.empty() ? "bytes" : shown_path(tokenizer_path_).c_str(), counted(P, "token").c_str(),
                 stops_summary().c_str(),
                 human_bytes(static_cast<double>(memory.total_current())).c_str(),
                 human_bytes(static_cast<double>(decoder.decode_bytes())).c_str());

  std::vector<float> logits(rt_.is_root() ? m.vocab_size : 0);
  float* my_logits = rt_.is_root() ? logits.data() : nullptr;  // only rank 0 samples
  comm_->barrier("barrier(generate start)");
  const double t0 = now_seconds();
  // Prefill: the prompt in steps of up to PREFILL_CHUNK tokens; the last step's logits predict the
  // first new token.
  for (int begin = 0; begin < P; begin += PREFILL_CHUNK) {
    const int n = std::min(PREFILL_CHUNK, P - begin);
    engine.decode_step(*model, prompt_.data() + begin, n, begin + n == P ? my_logits : nullptr, begin == 0);
  }
  const double t1 = now_seconds();
  // Rank 0 draws each token, writes its text and decides whether it ends the output; every rank
  // receives the token and the verdict.
  enum Verdict : int { GO_ON, STOP_TOKEN, STOP_TEXT, BAD_TOKEN };
  TextStream stream(o_.stops);
  if (rt_.is_root()) stream.write_prompt(o_.prompt);
  std::string bad_token;  // rank 0's: why a token could not be written
  int generated = 0, verdict = GO_ON, last_token = -1;
  for (;;) {
    int message[2] = {0, GO_ON};  // the token, the verdict
    if (rt_.is_root()) {
      message[0] = sample_token(logits.data(), allowed_, o_.sampling, generated);
      if (stop_tokens_.count(message[0])) {
        message[1] = STOP_TOKEN;
      } else {
        try {
          if (stream.add(bytes_of(message[0]))) message[1] = STOP_TEXT;
        } catch (const InputError& e) {
          bad_token = e.what();
          message[1] = BAD_TOKEN;
        }
      }
    }
    comm_->broadcast(Span<char>(reinterpret_cast<char*>(message), sizeof message), 0, "broadcast(token)");
    generated++, last_token = message[0], verdict = message[1];
    if (verdict != GO_ON || P + generated >= total_limit) break;
    engine.decode_step(*model, &message[0], 1, my_logits, false);
  }
  const double t2 = now_seconds();
  decoder.end_decode();

  const int G = generated;
  rt_.agree_on([&] {
    if (!rt_.is_root()) return;
    if (!bad_token.empty()) throw DataError(bad_token);
    stream.finish();
    if (verdict == STOP_TOKEN)
      std::fprintf(stderr, "generate: stopped after %s at the end-of-text token %s (id %d), not written (--ignore-eos goes on)\n",
                   counted(G, "token").c_str(), printable_text(stop_tokens_.at(last_token)).c_str(), last_token);
    else if (verdict == STOP_TEXT)
      std::fprintf(stderr, "generate: stopped after %s at --stop '%s', not written\n", counted(G, "token").c_str(),
                   printable_text(stream.matched()).c_str());
    else if (G < o_.max_tokens)
      std::fprintf(stderr,
                   "generate: stopped after %s: the prompt's %s and the output reached model.max_seq_len=%d, the "
                   "longest sequence this model takes (--max-tokens=%d not reached)\n",
                   counted(G, "token").c_str(), counted(P, "token").c_str(), m.max_seq_len, o_.max_tokens);
    // The first token comes from the prefill's logits: G - 1 decode steps.
    std::fprintf(stderr, "generate: %s in %.2f s: prefill %.0f tokens/s (%d in %.3f s), generation %.1f tokens/s\n",
                 counted(G, "token").c_str(), t2 - t0, P / std::max(t1 - t0, 1e-9), P, t1 - t0,
                 G > 1 ? (G - 1) / std::max(t2 - t1, 1e-9) : 0.0);
  });
  return EXIT_CODE_OK;
}

}  // namespace

int run_generate(Runtime& rt, const std::vector<std::string>& args) {
  GenerateOptions options;
  bool go = true;
  rt.agree_on([&] { go = parse_generate_args(rt, args, options); });
  if (!go) return EXIT_CODE_OK;
  rt.set_collective_timeout({options.comm_timeout, "--comm-timeout"});
  Generator generator(rt, options);
  return generator.run();
}

}  // namespace shardtrain
