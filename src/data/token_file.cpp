// Reading (mmap) and writing (temp file + rename) of llm.c token files. The header is copied out
// of the mapping with memcpy, not read through a cast pointer; tokens are used in place, which is
// safe because the 1024-byte header keeps them 2-byte aligned in the page-aligned mapping.
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
    if (header[0] != TOKEN_FILE_MAGIC)
      throw_data_error(path, strprintf("bad magic %d (expected %d: not an llm.c token file; %s)", header[0],
                                       TOKEN_FILE_MAGIC, RECREATE_HINT));
    if (header[1] != TOKEN_FILE_VERSION)
      throw_data_error(path, strprintf("unsupported version %d (expected %d; re-encode it with 'shardtrain data "
                                       "encode')",
                                       header[1], TOKEN_FILE_VERSION));
    if (header[2] < 0)
      throw_data_error(path, strprintf("negative token count %d in the header (corrupt file; %s)", header[2],
                                       RECREATE_HINT));
    const size_t count = static_cast<size_t>(header[2]);
    const size_t expected = TOKEN_FILE_HEADER_BYTES + count * sizeof(uint16_t);
    if (file_bytes != expected)
      throw_data_error(path, strprintf("%zu bytes but the header says %zu tokens, which needs %zu + 2*%zu = %zu bytes "
                                       "(%s; re-create the file)",
                                       file_bytes, count, TOKEN_FILE_HEADER_BYTES, count, expected,
                                       file_bytes < expected ? "truncated" : "trailing bytes after the tokens"));
    num_tokens_ = count;
    tokens_ = reinterpret_cast<const uint16_t*>(static_cast<const char*>(map_) + TOKEN_FILE_HEADER_BYTES);
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
      tokens_(std::exchange(other.tokens_, nullptr)) {}

TokenFile& TokenFile::operator=(TokenFile&& other) noexcept {
  if (this != &other) {
    unmap();
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    num_tokens_ = std::exchange(other.num_tokens_, 0);
    tokens_ = std::exchange(other.tokens_, nullptr);
  }
  return *this;
}

void TokenFile::unmap() {
  if (map_) ::munmap(map_, map_bytes_);
  map_ = nullptr;
  map_bytes_ = 0;
  tokens_ = nullptr;
  num_tokens_ = 0;
}

uint16_t TokenFile::max_token_in(size_t begin, size_t end) const {
  SHARD_CHECK(begin <= end && end <= num_tokens_, "range [%zu, %zu) outside the %zu tokens of '%s'", begin, end,
              num_tokens_, path_.c_str());
  uint16_t best = 0;
  for (size_t i = begin; i < end; i++) best = std::max(best, tokens_[i]);  // vectorises; memory-bound anyway
  return best;
}

std::string check_token_range(const TokenFile& file, int vocab_size, int part, int num_parts) {
  SHARD_CHECK(vocab_size > 0 && vocab_size <= 65536, "vocab_size %d outside (0, 65536]", vocab_size);
  SHARD_CHECK(num_parts > 0 && part >= 0 && part < num_parts, "part %d of %d", part, num_parts);
  const size_t n = file.num_tokens();
  // n < 2^31 (int32 header) and num_parts < 2^31 keep n * part within 64 bits.
  const size_t begin = n * static_cast<size_t>(part) / static_cast<size_t>(num_parts);
  const size_t end = n * static_cast<size_t>(part + 1) / static_cast<size_t>(num_parts);
  if (file.max_token_in(begin, end) < vocab_size) return "";
  // Rare error path: find the first offender in this part for the message.
  for (size_t i = begin; i < end; i++) {
    if (file.tokens()[i] >= vocab_size)
      return strprintf("data file '%s': token %u at index %zu is >= model.vocab_size=%d (the file was encoded for a "
                       "larger vocabulary; raise model.vocab_size or re-encode the data)",
                       file.path().c_str(), static_cast<unsigned>(file.tokens()[i]), i, vocab_size);
  }
  return "";  // unreachable: max_token_in found one
}

void write_token_file(const std::string& path, const std::vector<uint16_t>& tokens) {
  if (tokens.size() > static_cast<size_t>(INT32_MAX))
    throw DataError(strprintf("data file '%s': %zu tokens exceed the format's limit of %d; split the input", path.c_str(),
                              tokens.size(), INT32_MAX));
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
  header[0] = TOKEN_FILE_MAGIC;
  header[1] = TOKEN_FILE_VERSION;
  header[2] = static_cast<int32_t>(tokens.size());
  bool ok = std::fwrite(header, sizeof header, 1, f) == 1;
  if (ok && !tokens.empty()) ok = std::fwrite(tokens.data(), sizeof(uint16_t), tokens.size(), f) == tokens.size();
  ok = ok && std::fflush(f) == 0 && ::fsync(::fileno(f)) == 0;  // data on disk before the rename makes it visible
  const int write_errno = errno;
  const bool closed = std::fclose(f) == 0;
  if (!ok) errno = write_errno;  // report the write's reason, not fclose's
  if (!ok || !closed) fail("write");
  if (std::rename(tmp.c_str(), path.c_str()) != 0) fail("rename into place");
}

}  // namespace shardtrain
