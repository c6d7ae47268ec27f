// A text encoder's captions as token ids (app/text_encoder.hpp): each caption encoded by the
// encoder's tokenizer (data/tokenizer.hpp, with its special tokens, as a pipeline's tokenizer call
// does), cut at max_tokens, then padded on the right with id 0. The encoder is causal, so the pads
// change nothing before them; its context is zero at the pad positions (the caption's length says
// where they start).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace shardtrain {

class Tokenizer;

class CaptionTokenizer {
 public:
  // Throws DataError naming `path` when the tokenizer cannot be loaded.
  CaptionTokenizer(const std::string& path, int max_tokens);
  ~CaptionTokenizer();
  // Writes max_tokens ids (the caption's, then zeros) and returns how many are the caption's. Throws
  // DataError (naming `where`) for text that is not valid UTF-8.
  int tokenize(std::string_view caption, int32_t* ids, const std::string& where) const;
  int max_tokens() const { return max_tokens_; }
  uint32_t vocab_size() const;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int max_tokens_;
  std::unique_ptr<Tokenizer> tokenizer_;
};

}  // namespace shardtrain
