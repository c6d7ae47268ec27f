// Reading (mmap) and writing (temp file + rename) of llm.c token files. The header is copied out
// of the mapping with memcpy, not read through a cast pointer; tokens are used in place, which is
// safe because the 1024-byte header keeps them 4-byte aligned in the page-aligned mapping.
#include "data/token_file.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <utility>

#include "core/error.hpp"

namespace shardtrain {

namespace {

const char* const RECREATE_HINT = "create one with 'shardtrain data encode' or 'shardtrain data synth'";

[[noreturn]] void throw_data_error(const std::string& path, const std::string& what) {
  throw DataError(strprintf("data file '%s': %s", path.c_str(), what.c_str()));
}

// Closes a descriptor on every path out of the constructor.
struct FdGuard {
  int fd;
  ~FdGuard() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

TokenFile::TokenFile(const std::string& path) : path_(path) {
  FdGuard guard{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (guard.fd < 0)
    throw_data_error(path, strprintf("cannot open (%s); check the path, or %s", std::strerror(errno), RECREATE_HINT));
  struct stat st {};
  if (::fstat(guard.fd, &st) != 0) throw_data_error(path, strprintf("cannot stat (%s)", std::strerror(errno)));
  if (!S_ISREG(st.st_mode)) throw_data_error(path, "not a regular file; give the path of a token file");
  const size_t file_bytes = static_cast<size_t>(st.st_size);
  if (file_bytes < TOKEN_FILE_HEADER_BYTES)
    throw_data_error(path, strprintf("%zu bytes, shorter than the %zu-byte header (truncated, or not an llm.c token "
                                     "file; %s)",
                                     file_bytes, TOKEN_FILE_HEADER_BYTES, RECREATE_HINT));

  void* map = ::mmap(nullptr, file_bytes, PROT_READ, MAP_PRIVATE, guard.fd, 0);
  if (map == MAP_FAILED) throw_data_error(path, strprintf("cannot mmap (%s)", std::strerror(errno)));
  map_ = map;
  map_bytes_ = file_bytes;
  // From here on an exception must unmap: the destructor does not run for a throwing constructor.
  try {
    int32_t header[TOKEN_FILE_HEADER_INTS];
    std::memcpy(header, map_, sizeof header);
    if (header[0] != TOKEN_FILE_MAGIC && header[0] != TOKEN_FILE_MAGIC_32)
      throw_data_error(path, strprintf("bad magic %d (expected %d for 16-bit or %d for 32-bit tokens: not an llm.c "
                                       "token file; %s)",
                                       header[0], TOKEN_FILE_MAGIC, TOKEN_FILE_MAGIC_32, RECREATE_HINT));
    const bool wide = header[0] == TOKEN_FILE_MAGIC_32;
    const int32_t version = wide ? TOKEN_FILE_VERSION_32 : TOKEN_FILE_VERSION;
    if (header[1] != version)
      throw_data_error(path, strprintf("unsupported version %d (expected %d with magic %d; re-encode it with "
                                       "'shardtrain data encode')",
                                       header[1], version, header[0]));
    if (header[2] < 0)
      throw_data_error(path, strprintf("negative token count %d in the header (corrupt file; %s)", header[2],
                                       RECREATE_HINT));
    if (header[3] & ~TOKEN_FILE_LOSS_MASK)
      throw_data_error(path, strprintf("unknown flags %d in the header (written by a newer ShardTrain?); re-encode it "
                                       "with this one's 'shardtrain data encode'",
                                       header[3]));
    const bool masked = header[3] & TOKEN_FILE_LOSS_MASK;
    const size_t count = static_cast<size_t>(header[2]);
    const size_t width = wide ? 4 : 2;
    const size_t mask_bytes = masked ? (count + 7) / 8 : 0;
    const size_t expected = TOKEN_FILE_HEADER_BYTES + count * width + mask_bytes;
    if (file_bytes != expected)
      throw_data_error(path, strprintf("%zu bytes but the header says %zu tokens%s, which needs %zu + %zu*%zu%s = %zu "
                                       "bytes (%s; re-create the file)",
                                       file_bytes, count, masked ? " and a loss mask" : "", TOKEN_FILE_HEADER_BYTES,
                                       width, count, masked ? strprintf(" + %zu", mask_bytes).c_str() : "", expected,
                                       file_bytes < expected ? "truncated" : "trailing bytes after the tokens"));
    num_tokens_ = count;
    token_bytes_ = width;
    tokens_ = static_cast<const char*>(map_) + TOKEN_FILE_HEADER_BYTES;
    if (masked) mask_ = static_cast<const uint8_t*>(tokens_) + count * width;
  } catch (...) {
    unmap();
    throw;
  }
}

TokenFile::~TokenFile() { unmap(); }

TokenFile::TokenFile(TokenFile&& other) noexcept
    : path_(std::move(other.path_)),
      map_(std::exchange(other.map_, nullptr)),
      map_bytes_(std::exchange(other.map_bytes_, 0)),
      num_tokens_(std::exchange(other.num_tokens_, 0)),
      token_bytes_(other.token_bytes_),
      tokens_(std::exchange(other.tokens_, nullptr)),
      mask_(std::exchange(other.mask_, nullptr)) {}

TokenFile& TokenFile::operator=(TokenFile&& other) noexcept {
  if (this != &other) {
    unmap();
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    num_tokens_ = std::exchange(other.num_tokens_, 0);
    token_bytes_ = other.token_bytes_;
    tokens_ = std::exchange(other.tokens_, nullptr);
    mask_ = std::exchange(other.mask_, nullptr);
  }
  return *this;
}

void TokenFile::unmap() {
  if (map_) ::munmap(map_, map_bytes_);
  map_ = nullptr;
  map_bytes_ = 0;
  tokens_ = nullptr;
  mask_ = nullptr;
  num_tokens_ = 0;
}

void TokenFile::copy_tokens(size_t begin, size_t count, int* out) const {
  SHARD_CHECK(begin <= num_tokens_ && count <= num_tokens_ - begin, "tokens [%zu, +%zu) outside the %zu of '%s'", begin,
              count, num_tokens_, path_.c_str());
  if (token_bytes_ == 2) {
    const uint16_t* in = static_cast<const uint16_t*>(tokens_) + begin;
    for (size_t i = 0; i < count; i++) out[i] = in[i];
  } else {
    const uint32_t* in = static_cast<const uint32_t*>(tokens_) + begin;
    for (size_t i = 0; i < count; i++) out[i] = static_cast<int>(in[i]);
  }
}

namespace {

template <class Token>
uint32_t max_of(const void* tokens, size_t begin, size_t end) {
  const Token* t = static_cast<const Token*>(tokens);
  Token best = 0;
  for (size_t i = begin; i < end; i++) best = std::max(best, t[i]);  // vectorises; memory-bound anyway
  return best;
}

}  // namespace

uint32_t TokenFile::max_token_in(size_t begin, size_t end) const {
  SHARD_CHECK(begin <= end && end <= num_tokens_, "range [%zu, %zu) outside the %zu tokens of '%s'", begin, end,
              num_tokens_, path_.c_str());
  return token_bytes_ == 2 ? max_of<uint16_t>(tokens_, begin, end) : max_of<uint32_t>(tokens_, begin, end);
}

std::string check_token_range(const TokenFile& file, int vocab_size, int part, int num_parts) {
  SHARD_CHECK(vocab_size > 0, "vocab_size %d", vocab_size);
  SHARD_CHECK(num_parts > 0 && part >= 0 && part < num_parts, "part %d of %d", part, num_parts);
  const size_t n = file.num_tokens();
  // n < 2^31 (int32 header) and num_parts < 2^31 keep n * part within 64 bits.
  const size_t begin = n * static_cast<size_t>(part) / static_cast<size_t>(num_parts);
  const size_t end = n * static_cast<size_t>(part + 1) / static_cast<size_t>(num_parts);
  const uint32_t vocab = static_cast<uint32_t>(vocab_size);
  if (file.max_token_in(begin, end) < vocab) return "";
  // Rare error path: find the first offender in this part for the message.
  for (size_t i = begin; i < end; i++) {
    if (file.token(i) >= vocab)
      return strprintf("data file '%s': token %u at index %zu is >= model.vocab_size=%d (the file was encoded for a "
                       "larger vocabulary; raise model.vocab_size or re-encode the data)",
                       file.path().c_str(), file.token(i), i, vocab_size);
  }
  return "";  // unreachable: max_token_in found one
}

namespace {

// Writes the header and then `body(f)` (which returns false on a write error) to path + ".tmp",
// syncs it and renames it over `path`.
template <class Body>
void write_atomically(const std::string& path, size_t count, size_t token_bytes, bool masked, Body&& body) {
  SHARD_CHECK(token_bytes == 2 || token_bytes == 4, "token width %zu", token_bytes);
  if (count > static_cast<size_t>(INT32_MAX))
    throw DataError(strprintf("data file '%s': %zu tokens exceed the format's limit of %d; write shards", path.c_str(),
                              count, INT32_MAX));
  const std::string tmp = path + ".tmp";
  auto fail = [&](const char* what) {
    const std::string reason = std::strerror(errno);
    std::remove(tmp.c_str());
    throw DataError(strprintf("data file '%s': cannot %s '%s' (%s); check that the folder exists and is writable",
                              path.c_str(), what, tmp.c_str(), reason.c_str()));
  };
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) fail("create");
  int32_t header[TOKEN_FILE_HEADER_INTS] = {};
  header[0] = token_bytes == 2 ? TOKEN_FILE_MAGIC : TOKEN_FILE_MAGIC_32;
  header[1] = token_bytes == 2 ? TOKEN_FILE_VERSION : TOKEN_FILE_VERSION_32;
  header[2] = static_cast<int32_t>(count);
  header[3] = masked ? TOKEN_FILE_LOSS_MASK : 0;
  bool ok = std::fwrite(header, sizeof header, 1, f) == 1 && body(f);
  ok = ok && std::fflush(f) == 0 && ::fsync(::fileno(f)) == 0;  // data on disk before the rename makes it visible
  const int write_errno = errno;
  const bool closed = std::fclose(f) == 0;
  if (!ok) errno = write_errno;  // report the write's reason, not fclose's
  if (!ok || !closed) fail("write");
  if (std::rename(tmp.c_str(), path.c_str()) != 0) fail("rename into place");
}

}  // namespace

void write_token_file(const std::string& path, const uint32_t* tokens, size_t count, size_t token_bytes,
                      const uint8_t* trained) {
  write_atomically(path, count, token_bytes, trained != nullptr, [&](std::FILE* f) {
    if (token_bytes == 4) {
      if (count > 0 && std::fwrite(tokens, sizeof(uint32_t), count, f) != count) return false;
    } else {
      std::vector<uint16_t> narrow;  // in pieces: a copy of the whole part would double its memory
      for (size_t begin = 0; begin < count; begin += narrow.size()) {
        narrow.resize(std::min<size_t>(count - begin, size_t(1) << 16));
        for (size_t i = 0; i < narrow.size(); i++) {
          SHARD_CHECK(tokens[begin + i] < TOKEN_FILE_16BIT_VOCAB, "token %u in a 16-bit file", tokens[begin + i]);
          narrow[i] = static_cast<uint16_t>(tokens[begin + i]);
        }
        if (std::fwrite(narrow.data(), sizeof(uint16_t), narrow.size(), f) != narrow.size()) return false;
      }
    }
    if (!trained) return true;
    std::vector<uint8_t> bits((count + 7) / 8, 0);
    for (size_t i = 0; i < count; i++)
      if (trained[i]) bits[i / 8] |= static_cast<uint8_t>(1u << (i % 8));
    return bits.empty() || std::fwrite(bits.data(), 1, bits.size(), f) == bits.size();
  });
}

void write_token_file(const std::string& path, const std::vector<uint16_t>& tokens) {
  write_atomically(path, tokens.size(), 2, false, [&](std::FILE* f) {
    return tokens.empty() || std::fwrite(tokens.data(), sizeof(uint16_t), tokens.size(), f) == tokens.size();
  });
}

}  // namespace shardtrain
