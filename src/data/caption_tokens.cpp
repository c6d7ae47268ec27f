// See caption_tokens.hpp.
#include "data/caption_tokens.hpp"

#include <algorithm>
#include <vector>

#include "core/error.hpp"
#include "data/tokenizer.hpp"

namespace shardtrain {

CaptionTokenizer::CaptionTokenizer(const std::string& path, int max_tokens)
    : path_(path), max_tokens_(max_tokens), tokenizer_(std::make_unique<Tokenizer>(path)) {}

CaptionTokenizer::~CaptionTokenizer() = default;

uint32_t CaptionTokenizer::vocab_size() const { return tokenizer_->vocab_size(); }

int CaptionTokenizer::tokenize(std::string_view caption, int32_t* ids, const std::string& where) const {
  if (utf8_with_replacements(caption) != caption)
    throw DataError(where + ": the caption is not valid UTF-8; write the captions as UTF-8 text");
  std::vector<uint32_t> encoded;
  tokenizer_->encode(caption, encoded);
  const int length = static_cast<int>(std::min<size_t>(encoded.size(), max_tokens_));
  std::fill(ids, ids + max_tokens_, 0);
  for (int i = 0; i < length; i++) ids[i] = static_cast<int32_t>(encoded[i]);
  return length;
}

}  // namespace shardtrain
