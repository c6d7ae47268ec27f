// Hugging Face BPE tokenizers (tokenizer.json), encoding text token for token as the Python
// `tokenizers` package's Tokenizer.encode(text).ids does: byte-level files (GPT-2, Llama 3, Qwen 2)
// and SentencePiece-style ones (Llama 2, TinyLlama, Mistral: BPE on Unicode characters with byte
// fallback). Supported (anything else is a DataError naming the component): normalizers NFC, NFKC,
// Prepend, Replace of a literal, or a Sequence of these; pre-tokenizer ByteLevel, a Sequence of
// Split(Regex or String, Isolated) ending in ByteLevel, none, or Metaspace; model BPE (merges as
// "a b" strings or [a, b] pairs, ignore_merges, unk_token, fuse_unk, byte_fallback); added and
// special tokens (single_word, lstrip, rstrip, normalized) matched as the reference matches them;
// post-processor null, ByteLevel, TemplateProcessing, RobertaProcessing, BertProcessing or a
// Sequence of these. Regexes run on PCRE2 (UTF + UCP, JIT), NFC and NFKC are utf8proc's.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace shardtrain {

class Tokenizer {
 public:
  // Loads and checks `path`; throws DataError naming the file and the JSON position (line and
  // column for syntax, a JSON pointer such as /model/merges/7 for content) of any problem.
  explicit Tokenizer(const std::string& path);
  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // Appends the ids of `text` (valid UTF-8) to `out`: the reference's encode(text,
  // add_special_tokens).ids: with the post-processor's special tokens by default, without them for a
  // piece of a chat template's text (which writes its own, as transformers' apply_chat_template).
  void encode(std::string_view text, std::vector<uint32_t>& out, bool add_special_tokens = true);

  // One more than the largest id of the vocabulary, the added tokens and the post-processor.
  uint32_t vocab_size() const;
  // Whether encode() adds special tokens of its own (a BOS/EOS template) around every text.
  bool adds_special_tokens() const;
  // The id of an added token or vocabulary entry, written as in the file.
  std::optional<uint32_t> token_id(const std::string& content) const;
  // Whether `content` is an added token marked special.
  bool is_special(const std::string& content) const;

  // The text of `ids` as the reference's decode(ids, skip_special_tokens=False) gives it: each
  // token's string (added tokens as written), through the ByteLevel decoder (a token whose every
  // character stands for a byte becomes those bytes, any other its own UTF-8) or a SentencePiece-style
  // file's decoder chain (Replace, ByteFallback, Fuse, Strip, Metaspace), the whole as UTF-8 with
  // invalid sequences replaced by U+FFFD. Throws DataError for an id the tokenizer does not have, or
  // a decoder it cannot run.
  std::string decode(const std::vector<uint32_t>& ids) const;
  // One token's part of decode(): its bytes before the UTF-8 check (a character may continue in
  // the next token); for a SentencePiece-style file the decoder's replacements and byte fallback,
  // not its strips (which act on a text's start). Throws as decode() does.
  std::string token_bytes(uint32_t id) const;
  // The ids the post-processor appends to every text (a template's EOS, e.g. "$A </s>"); empty
  // for most byte-level tokenizers.
  const std::vector<uint32_t>& appended_ids() const;
  // The ids it puts before every text (a template's BOS, e.g. "<|begin_of_text|> $A").
  const std::vector<uint32_t>& prepended_ids() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// `bytes` decoded as UTF-8 with every invalid sequence replaced by U+FFFD, one per maximal invalid
// subpart: Python's bytes.decode("utf-8", errors="replace").
std::string utf8_with_replacements(std::string_view bytes);

// Where a trailing, still incomplete UTF-8 sequence of `bytes` starts (a lead byte and the valid
// continuation bytes it has so far), else bytes.size(). Text written in pieces cut there decodes, piece
// by piece through utf8_with_replacements, to the same text as the whole: a generator writes the
// prefix and holds the rest until the next token completes (or breaks) it.
size_t utf8_complete_prefix(std::string_view bytes);

// A JSON library parse error's message without its "[json.exception.parse_error.N] " tag.
std::string json_error_text(const char* what);

}  // namespace shardtrain
