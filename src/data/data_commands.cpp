// `data synth` and `data encode`: turn bytes into uint16 tokens one for one (or text into a
// tokenizer.json's tokens) and write them with write_token_file (atomic rename). Input problems are
// found before anything is written, so a failed command leaves no half-made output behind.
#include "data/data_commands.hpp"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <nlohmann/json.hpp>
#include <system_error>
#include <vector>

#include "core/counted.hpp"
#include "core/error.hpp"
#include "data/synth.hpp"
#include "data/token_file.hpp"
#include "data/tokenizer.hpp"

namespace shardtrain {

namespace {

std::vector<uint16_t> bytes_to_tokens(const std::string& bytes, size_t begin, size_t end) {
  std::vector<uint16_t> tokens(end - begin);
  for (size_t i = begin; i < end; i++) tokens[i - begin] = static_cast<unsigned char>(bytes[i]);
  return tokens;
}

void write_and_report(const std::string& path, const std::vector<uint16_t>& tokens) {
  write_token_file(path, tokens);
  std::printf("wrote %s: %zu token%s (byte-level, vocab 256)\n", path.c_str(), tokens.size(),
              tokens.size() == 1 ? "" : "s");
  std::fflush(stdout);
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string read_whole_file(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec))
    throw DataError(strprintf("input file '%s': does not exist; check the --input path", path.c_str()));
  if (!std::filesystem::is_regular_file(path, ec))
    throw DataError(strprintf("input file '%s': not a regular file; give a text file to encode", path.c_str()));
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw DataError(strprintf("input file '%s': cannot open (%s); check its permissions", path.c_str(),
                              std::strerror(errno)));
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw DataError(strprintf("input file '%s': read error", path.c_str()));
  return bytes;
}

bool is_jsonl(const std::string& path) { return ends_with(path, ".jsonl"); }

// The files a --input names: itself, or every regular file under a folder sorted by path.
std::vector<std::string> input_files(const std::string& input) {
  std::error_code ec;
  if (!std::filesystem::is_directory(input, ec)) return {input};
  std::vector<std::string> files;
  for (auto it = std::filesystem::recursive_directory_iterator(input, ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!name.empty() && name[0] == '.') {
      if (it->is_directory(ec)) it.disable_recursion_pending();
      continue;
    }
    if (it->is_regular_file(ec)) files.push_back(it->path().string());
  }
  if (ec) throw DataError(strprintf("input folder '%s': cannot list (%s)", input.c_str(), ec.message().c_str()));
  if (files.empty())
    throw DataError(strprintf("input folder '%s': holds no files; give text or .jsonl files", input.c_str()));
  std::sort(files.begin(), files.end());
  return files;
}

// A piece of a document, trained as targets or not (a chat template's prompt parts are not).
struct Segment {
  std::string text;
  bool trained = true;
};

// The segments of a {"segments": [{"text", "train"}, ...]} record (tools/chat_template.py).
std::vector<Segment> record_segments(const nlohmann::json& list, const std::string& path, size_t line_no) {
  const auto bad = [&](const std::string& what) {
    return DataError(strprintf("input file '%s' line %zu: %s; each segment is {\"text\": \"...\", \"train\": true|false}",
                               path.c_str(), line_no, what.c_str()));
  };
  if (!list.is_array() || list.empty()) throw bad("\"segments\" is not a non-empty list");
  std::vector<Segment> segments;
  for (size_t i = 0; i < list.size(); i++) {
    const nlohmann::json& s = list[i];
    const auto text = s.is_object() ? s.find("text") : s.end();
    const auto train = s.is_object() ? s.find("train") : s.end();
    if (text == s.end() || !text->is_string() || train == s.end() || !train->is_boolean())
      throw bad(strprintf("segment %zu has no \"text\" string or no \"train\" boolean", i));
    segments.push_back({text->get<std::string>(), train->get<bool>()});
  }
  return segments;
}

// A chat record's tokens are its whole text's, as transformers' apply_chat_template encodes it
// (without the post-processor's special tokens: the template writes them). Segment i's tokens
// are those after the tokens its predecessors' text alone encodes to, as far as the whole's tokens
// begin with them: a token that spans a boundary (a merge across it) belongs to the later segment.
void encode_segments(Tokenizer& tokenizer, const std::vector<Segment>& segments, bool loss_on_completions,
                     std::vector<uint32_t>& ids, std::vector<uint8_t>& trained) {
  std::string whole;
  for (const Segment& segment : segments) whole += segment.text;
  std::vector<uint32_t> all, prefix;
  tokenizer.encode(whole, all, /*add_special_tokens=*/false);
  size_t first = 0, end_of_text = 0;
  for (size_t i = 0; i < segments.size(); i++) {
    end_of_text += segments[i].text.size();
    size_t last = all.size();
    if (i + 1 < segments.size()) {
      prefix.clear();
      tokenizer.encode(std::string_view(whole).substr(0, end_of_text), prefix, false);
      const size_t n = std::min(prefix.size(), all.size());
      last = static_cast<size_t>(std::mismatch(prefix.begin(), prefix.begin() + n, all.begin()).first - prefix.begin());
      last = std::max(last, first);
    }
    ids.insert(ids.end(), all.begin() + first, all.begin() + last);
    trained.resize(ids.size(), segments[i].trained || !loss_on_completions);
    first = last;
  }
}

// Calls doc(segments, chat) for each document of one file (valid UTF-8 after replacement): a plain
// document is one trained segment (chat false), a "segments" record its segments (chat true).
template <class Doc>
void for_each_document(const std::string& path, Doc&& doc) {
  const std::string text = utf8_with_replacements(read_whole_file(path));
  if (!is_jsonl(path)) {
    doc(std::vector<Segment>{{text, true}}, false);
    return;
  }
  size_t line_no = 0;
  for (size_t begin = 0; begin < text.size();) {
    size_t end = text.find('\n', begin);
    if (end == std::string::npos) end = text.size();
    const std::string_view line(text.data() + begin, end - begin);
    line_no++;
    begin = end + 1;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;  // blank lines hold no document
    nlohmann::json record;
    try {
      record = nlohmann::json::parse(line);
    } catch (const nlohmann::json::parse_error& e) {
      throw DataError(strprintf("input file '%s' line %zu: malformed JSON (%s); write one JSON object per line",
                                path.c_str(), line_no, json_error_text(e.what()).c_str()));
    }
    if (record.is_object() && record.contains("segments")) {
      doc(record_segments(record["segments"], path, line_no), true);
      continue;
    }
    for (const char* chat : {"messages", "prompt", "completion"})
      if (record.is_object() && record.contains(chat))
        throw DataError(strprintf("input file '%s' line %zu: a chat or instruction record (\"%s\"): render it with the "
                                  "model's chat template first: python3 tools/chat_template.py --model MODEL_FOLDER "
                                  "--input '%s' --output chats.segments.jsonl, then encode that (docs/data.md)",
                                  path.c_str(), line_no, chat, path.c_str()));
    auto it = record.is_object() ? record.find("text") : record.end();
    if (it == record.end() || !it->is_string())
      throw DataError(strprintf("input file '%s' line %zu: no \"text\" string field; each line needs {\"text\": \"...\"} "
                                "(or \"segments\", docs/data.md)",
                                path.c_str(), line_no));
    doc(std::vector<Segment>{{it->get<std::string>(), true}}, false);
  }
}

// The first of DOCUMENT_SEPARATORS the tokenizer has as a special token, or nullptr.
const char* first_separator(const Tokenizer& tokenizer) {
  for (const char* candidate : DOCUMENT_SEPARATORS)
    if (tokenizer.is_special(candidate)) return candidate;
  return nullptr;
}

// The token put before each document, or none.
std::optional<uint32_t> document_separator(const Tokenizer& tokenizer, const std::string& separator,
                                           const std::string& tokenizer_path, std::string& name) {
  if (separator == "none") return std::nullopt;
  if (!separator.empty()) {
    name = separator;
    if (auto id = tokenizer.token_id(separator)) return id;
    throw UsageError(strprintf("--separator '%s' is not a token of '%s'", separator.c_str(), tokenizer_path.c_str()));
  }
  if (tokenizer.adds_special_tokens()) return std::nullopt;  // its template already marks every document
  if (const char* candidate = first_separator(tokenizer)) {
    name = candidate;
    return tokenizer.token_id(candidate);
  }
  throw DataError(strprintf("tokenizer file '%s': has none of the special tokens <|endoftext|>, <|end_of_text|>, </s>, "
                            "<eos>, <|begin_of_text|>, <s>, <bos> to put between documents; name one with --separator "
                            "TOKEN or give --separator none",
                            tokenizer_path.c_str()));
}

}  // namespace

const char* const DOCUMENT_SEPARATORS[7] = {"<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>",
                                            "<|begin_of_text|>", "<s>", "<bos>"};

namespace {
// Special tokens that end a chat turn (Llama 3, Qwen 2).
const char* const CHAT_TURN_ENDS[] = {"<|eot_id|>", "<|im_end|>"};
}  // namespace

std::optional<uint32_t> document_start_token(const Tokenizer& tokenizer) {
  if (tokenizer.adds_special_tokens())
    return tokenizer.prepended_ids().empty() ? std::nullopt : std::optional<uint32_t>(tokenizer.prepended_ids()[0]);
  const char* separator = first_separator(tokenizer);
  return separator ? tokenizer.token_id(separator) : std::nullopt;
}

std::vector<const char*> known_special_tokens() {
  std::vector<const char*> names(std::begin(DOCUMENT_SEPARATORS), std::end(DOCUMENT_SEPARATORS));
  names.insert(names.end(), std::begin(CHAT_TURN_ENDS), std::end(CHAT_TURN_ENDS));
  return names;
}

std::vector<uint32_t> end_of_text_ids(const Tokenizer& tokenizer) {
  std::vector<uint32_t> ids;
  auto add = [&](uint32_t id) {
    if (std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
  };
  for (uint32_t id : tokenizer.appended_ids()) add(id);
  for (const char* name : known_special_tokens())
    if (tokenizer.is_special(name)) add(*tokenizer.token_id(name));
  return ids;
}

std::optional<uint32_t> begin_of_text_id(const Tokenizer& tokenizer) {
  for (const char* name : {"<|begin_of_text|>", "<s>", "<bos>"})
    if (tokenizer.is_special(name)) return tokenizer.token_id(name);
  return std::nullopt;
}

void data_synth(const std::string& out_dir, uint64_t seed, size_t train_bytes, size_t val_bytes) {
  SHARD_CHECK(train_bytes >= 1 && train_bytes <= SYNTH_MAX_BYTES && val_bytes <= SYNTH_MAX_BYTES,
              "data_synth(train_bytes=%zu, val_bytes=%zu): the caller checks the bounds", train_bytes, val_bytes);
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec)
    throw DataError(strprintf("output folder '%s': cannot create (%s); choose another --out-dir", out_dir.c_str(),
                              ec.message().c_str()));
  const std::string train = synth_corpus(seed, train_bytes);
  write_and_report(out_dir + "/synth_train.bin", bytes_to_tokens(train, 0, train.size()));
  if (val_bytes > 0) {
    const std::string val = synth_corpus(~seed, val_bytes);
    write_and_report(out_dir + "/synth_val.bin", bytes_to_tokens(val, 0, val.size()));
  }
}

void data_synth_jsonl(const std::string& path, uint64_t seed, size_t bytes) {
  const std::string corpus = synth_corpus(seed, bytes);
  std::string out;
  size_t documents = 0;
  for (size_t begin = 0, end; (end = corpus.find('\n', begin)) != std::string::npos; begin = end + 1, documents++)
    out += nlohmann::json{{"text", corpus.substr(begin, end - begin)}}.dump() + "\n";
  std::ofstream file(path, std::ios::binary);
  file << out;
  file.close();
  if (!file)
    throw DataError(strprintf("cannot write '%s': %s; choose another path", path.c_str(), std::strerror(errno)));
  std::printf("wrote %s: %zu documents (%zu bytes of the synthetic corpus, one line each)\n", path.c_str(), documents,
              bytes);
}

std::string val_path_for(const std::string& out_path) {
  if (ends_with(out_path, "_train.bin")) return out_path.substr(0, out_path.size() - 10) + "_val.bin";
  if (ends_with(out_path, ".bin")) return out_path.substr(0, out_path.size() - 4) + "_val.bin";
  return out_path + "_val.bin";
}

// The output's folder, made before the encoding (a missing one failed only after it).
void make_output_folder(const std::string& out_path) {
  const std::filesystem::path folder = std::filesystem::path(out_path).parent_path();
  std::error_code ec;
  if (folder.empty() || std::filesystem::is_directory(folder, ec)) return;
  std::filesystem::create_directories(folder, ec);
  if (ec)
    throw DataError(strprintf("--output '%s': cannot create its folder '%s' (%s); choose another path",
                              out_path.c_str(), folder.c_str(), ec.message().c_str()));
}

void data_encode(const std::string& text_path, const std::string& out_path, double val_fraction) {
  if (!(val_fraction >= 0 && val_fraction < 1))  // also rejects NaN
    throw UsageError(strprintf("--val-fraction=%g must be in [0, 1)", val_fraction));
  make_output_folder(out_path);
  const std::string bytes = read_whole_file(text_path);
  if (bytes.empty()) throw DataError(strprintf("input file '%s': is empty; nothing to encode", text_path.c_str()));
  const size_t val_bytes = static_cast<size_t>(static_cast<double>(bytes.size()) * val_fraction);
  if (val_fraction > 0 && val_bytes == 0)
    throw DataError(strprintf("input file '%s': too small (%zu byte%s) for a --val-fraction=%g validation part; use "
                              "a larger file, a larger fraction, or 0 for no validation file",
                              text_path.c_str(), bytes.size(), bytes.size() == 1 ? "" : "s", val_fraction));
  const size_t train_bytes = bytes.size() - val_bytes;
  if (train_bytes == 0)  // only when rounding makes bytes * val_fraction == bytes
    throw UsageError(strprintf("--val-fraction=%g leaves no training bytes of input file '%s'", val_fraction,
                               text_path.c_str()));
  write_and_report(out_path, bytes_to_tokens(bytes, 0, train_bytes));
  if (val_bytes > 0) write_and_report(val_path_for(out_path), bytes_to_tokens(bytes, train_bytes, bytes.size()));
}

std::string shard_path(const std::string& out_path, size_t index) {
  const std::string number = strprintf("_%06zu", index);
  if (ends_with(out_path, ".bin")) return out_path.substr(0, out_path.size() - 4) + number + ".bin";
  return out_path + number;
}

void data_encode_tokenized(const std::string& input, const std::string& tokenizer_path, const std::string& out_path,
                           const EncodeLayout& layout, const std::string& separator, bool loss_on_completions) {
  const double val_fraction = layout.val_fraction;
  if (!(val_fraction >= 0 && val_fraction < 1))  // also rejects NaN
    throw UsageError(strprintf("--val-fraction=%g must be in [0, 1)", val_fraction));
  make_output_folder(out_path);
  if (layout.val_last_shard && (layout.shard_tokens == 0 || val_fraction > 0))
    throw UsageError("--val-shard needs --shard-tokens and no --val-fraction: the last shard is the validation file");
  if (layout.shard_tokens > static_cast<uint64_t>(INT32_MAX))
    throw UsageError(strprintf("--shard-tokens=%llu is more than a token file holds (%d)",
                               static_cast<unsigned long long>(layout.shard_tokens), INT32_MAX));
  Tokenizer tokenizer(tokenizer_path);
  const size_t token_bytes = token_bytes_for_vocab(tokenizer.vocab_size());
  std::string separator_name;
  const std::optional<uint32_t> sep = document_separator(tokenizer, separator, tokenizer_path, separator_name);
  const std::vector<std::string> files = input_files(input);

  const auto start = std::chrono::steady_clock::now();
  std::vector<uint32_t> ids;
  std::vector<uint8_t> trained;  // per token: a target the loss counts
  std::vector<size_t> doc_starts;  // each document's first token
  size_t bytes = 0;
  for (const std::string& file : files)
    for_each_document(file, [&](const std::vector<Segment>& segments, bool chat) {
      doc_starts.push_back(ids.size());
      // Between chat records the separator is a boundary, not something to learn to say.
      if (sep) ids.push_back(*sep), trained.push_back(!chat || !loss_on_completions);
      if (!chat) {
        tokenizer.encode(segments[0].text, ids);
        trained.resize(ids.size(), 1);
        bytes += segments[0].text.size();
        return;
      }
      encode_segments(tokenizer, segments, loss_on_completions, ids, trained);
      for (const Segment& segment : segments) bytes += segment.text.size();
    });
  const size_t documents = doc_starts.size();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (ids.empty()) throw DataError(strprintf("input '%s': holds no text; nothing to encode", input.c_str()));

  // The validation part: the last floor(documents * fraction) documents (with fewer documents than
  // that makes one, e.g. one text file: the last floor(tokens * fraction) tokens), or the last shard.
  size_t train_count = ids.size();
  if (val_fraction > 0) {
    const size_t val_documents = static_cast<size_t>(static_cast<double>(documents) * val_fraction);
    const size_t val_tokens = static_cast<size_t>(static_cast<double>(ids.size()) * val_fraction);
    train_count = val_documents > 0 ? doc_starts[documents - val_documents] : ids.size() - val_tokens;
    if (train_count == ids.size())
      throw DataError(strprintf("input '%s': too small (%s, %zu tokens) for a --val-fraction=%g validation part; use "
                                "more text, a larger fraction, or 0 for no validation file",
                                input.c_str(), counted(static_cast<long long>(documents), "document").c_str(),
                                ids.size(), val_fraction));
  } else if (layout.val_last_shard) {
    if (ids.size() <= layout.shard_tokens)
      throw DataError(strprintf("input '%s': %zu tokens make one shard of --shard-tokens=%llu, none left for "
                                "training beside the validation shard; use smaller shards",
                                input.c_str(), ids.size(), static_cast<unsigned long long>(layout.shard_tokens)));
    train_count = (ids.size() - 1) / layout.shard_tokens * layout.shard_tokens;
  }
  if (train_count == 0)
    throw DataError(strprintf("input '%s': the training part holds no tokens; use a smaller --val-fraction",
                              input.c_str()));
  std::printf("encoded %s (%zu bytes) in %.2f s (%.1f MB/s), %s\n",
              counted(static_cast<long long>(documents), "document").c_str(), bytes, seconds,
              seconds > 0 ? static_cast<double>(bytes) / seconds / 1e6 : 0.0,
              sep ? strprintf("%s (id %u) before each", separator_name.c_str(), *sep).c_str()
                  : tokenizer.adds_special_tokens() ? "the tokenizer's template marks each" : "no separator");
  // A loss mask only where some token is left out: otherwise the file is llm.c's own format.
  const bool masked = std::find(trained.begin(), trained.end(), 0) != trained.end();
  const auto write_part = [&](const std::string& path, size_t begin, size_t end) {
    write_token_file(path, ids.data() + begin, end - begin, token_bytes, masked ? trained.data() + begin : nullptr);
    const size_t kept = static_cast<size_t>(std::count(trained.begin() + begin, trained.begin() + end, 1));
    std::printf("wrote %s: %s%s (tokenizer %s, vocab %u: needs model.vocab_size >= %u; %d-bit tokens)\n", path.c_str(),
                counted(static_cast<long long>(end - begin), "token").c_str(),
                masked ? strprintf(", %zu trained (loss mask)", kept).c_str() : "", tokenizer_path.c_str(),
                tokenizer.vocab_size(), tokenizer.vocab_size(), static_cast<int>(8 * token_bytes));
    std::fflush(stdout);
  };
  if (layout.shard_tokens == 0) {
    write_part(out_path, 0, train_count);
  } else {
    for (size_t begin = 0, index = 0; begin < train_count; begin += layout.shard_tokens, index++)
      write_part(shard_path(out_path, index), begin, std::min<size_t>(train_count, begin + layout.shard_tokens));
  }
  if (train_count < ids.size()) write_part(val_path_for(out_path), train_count, ids.size());
}

void data_decode(const std::string& token_path, const std::string& tokenizer_path, const std::string& out_path,
                 uint64_t first, uint64_t count) {
  TokenFile file(token_path);
  if (first > file.num_tokens())
    throw UsageError(strprintf("--first=%llu is past the %zu tokens of '%s'", static_cast<unsigned long long>(first),
                               file.num_tokens(), token_path.c_str()));
  const uint64_t end = count == 0 ? file.num_tokens() : std::min<uint64_t>(file.num_tokens(), first + count);
  std::string text;
  if (tokenizer_path.empty()) {
    std::string bytes;
    for (uint64_t i = first; i < end; i++) {
      if (file.token(i) > 255)
        throw DataError(strprintf("data file '%s': token %u at index %llu is not a byte; decode it with --tokenizer "
                                  "(the tokenizer.json it was encoded with)",
                                  token_path.c_str(), file.token(i), static_cast<unsigned long long>(i)));
      bytes += static_cast<char>(file.token(i));
    }
    text = utf8_with_replacements(bytes);
  } else {
    const Tokenizer tokenizer(tokenizer_path);
    std::vector<uint32_t> ids(end - first);
    for (uint64_t i = first; i < end; i++) ids[i - first] = file.token(i);
    text = tokenizer.decode(ids);
  }
  if (out_path == "-") {
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
    return;
  }
  std::ofstream out(out_path, std::ios::binary);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  out.close();
  if (!out) throw UsageError(strprintf("cannot write '%s': %s", out_path.c_str(), std::strerror(errno)));
}

}  // namespace shardtrain
