// llm.c token files: a 1024-byte header of 256 little-endian int32 (magic 20240520, version 1,
// token count, the rest zero) followed by exactly that many uint16 tokens. TokenFile maps a file
// read-only (never loads it whole) and validates the header and the exact size on open; every
// problem is a DataError whose one line names the file, what is wrong and how to fix it.
// This layer knows nothing about MPI: callers agree on the outcome across ranks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace shardtrain {

constexpr int32_t TOKEN_FILE_MAGIC = 20240520;
constexpr int32_t TOKEN_FILE_VERSION = 1;
constexpr size_t TOKEN_FILE_HEADER_INTS = 256;
constexpr size_t TOKEN_FILE_HEADER_BYTES = TOKEN_FILE_HEADER_INTS * sizeof(int32_t);  // 1024

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
  const uint16_t* tokens() const { return tokens_; }

  // Largest token in [begin, end) (0 for an empty range); ranks scan disjoint parts.
  uint16_t max_token_in(size_t begin, size_t end) const;

 private:
  void unmap();

  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  size_t num_tokens_ = 0;
  const uint16_t* tokens_ = nullptr;
};

// Checks part `part` of `num_parts` (contiguous, near-equal) of the file for tokens >= vocab_size.
// Returns "" or one line naming the file, the first offending token of this part, its index and
// the vocab size.
std::string check_token_range(const TokenFile& file, int vocab_size, int part, int num_parts);

// Writes a token file atomically: path + ".tmp", flushed and synced, then renamed over path.
// Throws DataError naming the file on any I/O failure or if there are more than INT32_MAX tokens.
void write_token_file(const std::string& path, const std::vector<uint16_t>& tokens);

}  // namespace shardtrain
