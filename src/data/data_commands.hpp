// The bodies of `shardtrain data synth` and `shardtrain data encode` (app/main.cpp parses their
// options and calls these on one rank). Without a tokenizer both write byte-level token files:
// token = byte value, so the files need model.vocab_size >= 256. Errors throw DataError/UsageError naming the file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace shardtrain {

class Tokenizer;

// Writes out_dir/synth_train.bin (synth_corpus(seed, train_bytes)) and out_dir/synth_val.bin
// (synth_corpus(~seed, val_bytes): a different seed, so validation text is unseen), creating
// out_dir if needed, and prints one line per file (path, tokens). val_bytes == 0 skips the val file.
// Needs train_bytes in [1, SYNTH_MAX_BYTES] and val_bytes <= SYNTH_MAX_BYTES (see synth.hpp).
void data_synth(const std::string& out_dir, uint64_t seed, size_t train_bytes, size_t val_bytes);
// Writes the synthetic corpus of `bytes` bytes (synth_corpus(seed, bytes)) as JSON Lines, one
// {"text": ...} record per line of the corpus (a one-line story), the cut-off last line left out:
// documents to try the tokenizer-to-training recipe on (README.md).
void data_synth_jsonl(const std::string& path, uint64_t seed, size_t bytes);

// Encodes every byte of text_path. With val_fraction in (0, 1) the last
// floor(bytes * val_fraction) bytes go to the validation file val_path_for(out_path) and the rest
// to out_path; with 0 everything goes to out_path. Prints one line per file written.
void data_encode(const std::string& text_path, const std::string& out_path, double val_fraction);

// How `data encode --tokenizer` lays out its output.
struct EncodeLayout {
  // The last floor(documents * val_fraction) whole documents go to the validation file
  // val_path_for(out_path); 0: none.
  double val_fraction = 0.05;
  // 0: the training tokens in out_path. Else in files of shard_tokens tokens each (the last holds the
  // rest), shard_path(out_path, 0), shard_path(out_path, 1), ...
  uint64_t shard_tokens = 0;
  // With shard_tokens and val_fraction 0: the last shard is the validation file val_path_for(out_path).
  bool val_last_shard = false;
};

// `data encode --tokenizer`: encodes documents with a Hugging Face tokenizer.json (tokenizer.hpp).
// `input` is a text file (one document), a .jsonl file (one document per line, its "text" field) or
// a folder (every file under it, sorted by path, each read as one of the two by its name; names
// starting with '.' skipped). Invalid UTF-8 becomes U+FFFD first. Every document is the reference's
// encode(text).ids; unless the tokenizer's template already adds special tokens to each, the
// separator token goes before each document, as llm.c's data scripts put <|endoftext|>: `separator`
// names it ("none": no separator; "": the first of DOCUMENT_SEPARATORS the tokenizer has). Files
// hold 16-bit tokens when every id of the tokenizer fits, else 32-bit ones (token_file.hpp). The
// output is the same bytes whatever the machine: the encoder is sequential.
// A .jsonl line may instead hold {"segments": [{"text", "train"}, ...]}, a chat or instruction record
// rendered by its chat template (tools/chat_template.py): each segment is encoded on its own without
// the post-processor's special tokens (the template writes them), and with `loss_on_completions` the
// segments marked "train": false (and the separator before such a record) are left out of the loss:
// the file gets a loss mask (token_file.hpp) when any token is.
extern const char* const DOCUMENT_SEPARATORS[7];
void data_encode_tokenized(const std::string& input, const std::string& tokenizer_path, const std::string& out_path,
                           const EncodeLayout& layout, const std::string& separator, bool loss_on_completions = true);

// The ids a text ends at, in this order: the template's appended ids, then the special tokens among
// DOCUMENT_SEPARATORS and the chat-turn ends (<|eot_id|>, <|im_end|>) that the tokenizer has.
// generate stops at them; an exported folder's generation_config.json lists them.
std::vector<uint32_t> end_of_text_ids(const Tokenizer& tokenizer);
// The token every document starts with in `data encode`'s output: the first id the tokenizer's
// template puts before every text, else the separator (the first of DOCUMENT_SEPARATORS it has);
// none when it has neither. data.documents finds the documents of packed sequences by it.
std::optional<uint32_t> document_start_token(const Tokenizer& tokenizer);
// DOCUMENT_SEPARATORS and the chat-turn ends: the special tokens known by name.
std::vector<const char*> known_special_tokens();
// The tokenizer's beginning-of-text token (<|begin_of_text|>, <s>, <bos>), if it has one.
std::optional<uint32_t> begin_of_text_id(const Tokenizer& tokenizer);

// Shard `index` of out_path: "x_train.bin" -> "x_train_000003.bin", "x" -> "x_000003".
std::string shard_path(const std::string& out_path, size_t index);

// `data decode`: tokens [first, first + count) of a token file (count 0: to its end) back to text,
// written to `out_path` ("-": standard output). With a tokenizer.json, as the reference's
// decode(ids) (Tokenizer::decode); without, byte-level: each token is its byte, a token above 255 is
// a DataError. Invalid UTF-8 becomes U+FFFD either way.
void data_decode(const std::string& token_path, const std::string& tokenizer_path, const std::string& out_path,
                 uint64_t first, uint64_t count);

// The validation file named after the training file: "x_train.bin" -> "x_val.bin",
// "x.bin" -> "x_val.bin", anything else -> "x" + "_val.bin".
std::string val_path_for(const std::string& out_path);

}  // namespace shardtrain
