// llm.c token files: a 1024-byte header of 256 little-endian int32 (magic, version, token count,
// the rest zero) followed by exactly that many tokens, in one of llm.c's two formats
// (dev/data/data_common.py): magic 20240520 / version 1 with uint16 tokens ("gpt-2"), and
// magic 20240801 / version 7 with uint32 tokens ("llama-3", for vocabularies beyond 65,536).
// ShardTrain's one extension: header int 3 holds flags, and flag 1 (TOKEN_FILE_LOSS_MASK) says that
// a loss mask follows the tokens, one bit per token (token i: bit i % 8 of byte i / 8), set where the
// token is trained as a target (an assistant's or a completion's token; docs/data.md, "Chat and
// instruction data"). llm.c's files have 0 there.
// TokenFile maps a file read-only (never loads it whole) and validates the header and the exact
// size on open; every problem is a DataError whose one line names the file, what is wrong and how
// to fix it. This layer knows nothing about MPI: callers agree on the outcome across ranks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace shardtrain {

constexpr int32_t TOKEN_FILE_MAGIC = 20240520;  // uint16 tokens
constexpr int32_t TOKEN_FILE_VERSION = 1;
constexpr int32_t TOKEN_FILE_MAGIC_32 = 20240801;  // uint32 tokens
constexpr int32_t TOKEN_FILE_VERSION_32 = 7;
constexpr size_t TOKEN_FILE_HEADER_INTS = 256;
constexpr size_t TOKEN_FILE_HEADER_BYTES = TOKEN_FILE_HEADER_INTS * sizeof(int32_t);  // 1024
constexpr int32_t TOKEN_FILE_LOSS_MASK = 1;  // header int 3's flag
// Ids up to this many fit the 16-bit format; a larger vocabulary needs the 32-bit one.
constexpr uint64_t TOKEN_FILE_16BIT_VOCAB = 65536;
// The largest model.vocab_size the trainer takes (options, checkpoints): 2^24 ids, far beyond the
// tokenizers in use (Llama 3: 128,256; Gemma: 262,144), and a bound that keeps a damaged
// checkpoint from describing an absurd embedding.
constexpr int MAX_VOCAB_SIZE = 1 << 24;

class TokenFile {
 public:
  // Opens and validates `path`; throws DataError on any problem.
  explicit TokenFile(const std::string& path);
  ~TokenFile();
  TokenFile(TokenFile&& other) noexcept;
  TokenFile& operator=(TokenFile&& other) noexcept;
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

  const std::string& path() const { return path_; }
  size_t num_tokens() const { return num_tokens_; }
  size_t token_bytes() const { return token_bytes_; }  // 2 or 4
  size_t file_bytes() const { return map_bytes_; }
  uint32_t token(size_t i) const {
    return token_bytes_ == 2 ? static_cast<const uint16_t*>(tokens_)[i] : static_cast<const uint32_t*>(tokens_)[i];
  }
  bool has_loss_mask() const { return mask_ != nullptr; }
  // Whether token i is trained as a target: its mask bit, or true in a file without a mask.
  bool trained(size_t i) const { return !mask_ || (mask_[i / 8] >> (i % 8) & 1); }
  // Copies tokens [begin, begin + count) to `out` as int; the caller has checked them against the
  // vocabulary (ids below 2^31).
  void copy_tokens(size_t begin, size_t count, int* out) const;

  // Largest token in [begin, end) (0 for an empty range); ranks scan disjoint parts.
  uint32_t max_token_in(size_t begin, size_t end) const;

 private:
  void unmap();

  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  size_t num_tokens_ = 0;
  size_t token_bytes_ = 2;
  const void* tokens_ = nullptr;
  const uint8_t* mask_ = nullptr;  // the loss mask's bits, when the file has one
};

// Checks part `part` of `num_parts` (contiguous, near-equal) of the file for tokens >= vocab_size.
// Returns "" or one line naming the file, the first offending token of this part, its index and
// the vocab size.
std::string check_token_range(const TokenFile& file, int vocab_size, int part, int num_parts);

// Writes a token file atomically: path + ".tmp", flushed and synced, then renamed over path.
// token_bytes 2 writes the 16-bit format (every token must be below 65536), 4 the 32-bit one.
// Throws DataError naming the file on any I/O failure or if there are more than INT32_MAX tokens.
// `trained` (count entries, 0 or 1; nullptr for none) adds the loss mask.
void write_token_file(const std::string& path, const uint32_t* tokens, size_t count, size_t token_bytes,
                      const uint8_t* trained = nullptr);
void write_token_file(const std::string& path, const std::vector<uint16_t>& tokens);  // the 16-bit format

// 2 when every id of a vocabulary of `vocab_size` fits the 16-bit format, else 4.
inline size_t token_bytes_for_vocab(uint64_t vocab_size) { return vocab_size <= TOKEN_FILE_16BIT_VOCAB ? 2 : 4; }

}  // namespace shardtrain
