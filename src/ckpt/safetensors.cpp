// See safetensors.hpp.
#include "ckpt/safetensors.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/format.hpp"

namespace shardtrain {
namespace {

// The reference implementation refuses larger headers; so do we (a corrupt length must not
// make us allocate gigabytes).
constexpr uint64_t MAX_HEADER_BYTES = 100ull << 20;
// Elements converted per pread, so a reader or writer holds a bounded buffer.
constexpr uint64_t CHUNK_ELEMENTS = 1 << 20;

size_t dtype_size(const std::string& dtype) {
  static const std::map<std::string, size_t> sizes = {
      {"BOOL", 1}, {"U8", 1}, {"I8", 1}, {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"I16", 2}, {"U16", 2}, {"F16", 2},
      {"BF16", 2}, {"I32", 4}, {"U32", 4}, {"F32", 4}, {"F64", 8}, {"I64", 8}, {"U64", 8}};
  auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

// Reads exactly `bytes` at `offset`; false on EOF or error (errno set, 0 for EOF).
bool pread_all(int fd, void* buffer, size_t bytes, uint64_t offset) {
  char* at = static_cast<char*>(buffer);
  while (bytes > 0) {
    const ssize_t n = ::pread(fd, at, bytes, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (n == 0) errno = 0;
      return false;
    }
    at += n, bytes -= static_cast<size_t>(n), offset += static_cast<uint64_t>(n);
  }
  return true;
}

bool pwrite_all(int fd, const void* buffer, size_t bytes, uint64_t offset) {
  const char* at = static_cast<const char*>(buffer);
  while (bytes > 0) {
    const ssize_t n = ::pwrite(fd, at, bytes, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    at += n, bytes -= static_cast<size_t>(n), offset += static_cast<uint64_t>(n);
  }
  return true;
}

std::string io_reason() { return errno ? std::strerror(errno) : "unexpected end of file (truncated?)"; }

}  // namespace

const char* safetensors_dtype_name(DType dtype) {
  return dtype == DTYPE_FP32 ? "F32" : dtype == DTYPE_BF16 ? "BF16" : "F16";
}

SafetensorsReader::SafetensorsReader(const std::string& path) : path_(path) {
  auto fail = [&](const std::string& why) {
    throw CheckpointError("safetensors file '" + path + "': " + why);
  };
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) fail(std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd_, &st) != 0) fail(std::string("cannot stat: ") + std::strerror(errno));
  if (S_ISDIR(st.st_mode)) fail("is a folder, not a file");
  if (!S_ISREG(st.st_mode)) fail("is not a regular file");
  const uint64_t file_bytes = static_cast<uint64_t>(st.st_size);
  unsigned char length_bytes[8];
  if (file_bytes < 8 || !pread_all(fd_, length_bytes, 8, 0)) fail("shorter than the 8-byte header length");
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; i--) header_bytes = header_bytes << 8 | length_bytes[i];  // little-endian
  if (header_bytes > MAX_HEADER_BYTES || header_bytes > file_bytes - 8)
    fail(strprintf("header length %llu exceeds the file (%llu bytes) or the 100 MiB limit: not a safetensors file, "
                   "or truncated", static_cast<unsigned long long>(header_bytes),
                   static_cast<unsigned long long>(file_bytes)));
  std::string text(header_bytes, '\0');
  if (!pread_all(fd_, text.data(), header_bytes, 8)) fail("cannot read the header: " + io_reason());
  if (text.empty() || text[0] != '{') fail("the header does not start with '{': not a safetensors file");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail(std::string("malformed JSON header: ") + e.what());
  }
  if (!header.is_object()) fail("the header is not a JSON object");
  const uint64_t data_start = 8 + header_bytes, data_bytes = file_bytes - data_start;
  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") {
      if (!info.is_object()) fail("__metadata__ is not an object of strings");
      for (const auto& [key, value] : info.items()) {
        if (!value.is_string()) fail("__metadata__ value of '" + printable_text(key) + "' is not a string");
        metadata_[key] = value.get<std::string>();
      }
      continue;
    }
    auto bad = [&](const std::string& why) { fail("tensor '" + printable_text(name) + "': " + why); };
    if (!info.is_object() || !info.contains("dtype") || !info.contains("shape") || !info.contains("data_offsets"))
      bad("needs dtype, shape and data_offsets");
    SafetensorsTensor t;
    t.name = name;
    if (!info["dtype"].is_string()) bad("dtype is not a string");
    t.dtype = info["dtype"].get<std::string>();
    const size_t element = dtype_size(t.dtype);
    if (element == 0) bad("unknown dtype '" + t.dtype + "'");
    if (!info["shape"].is_array()) bad("shape is not an array");
    t.numel = 1;
    for (const auto& d : info["shape"]) {
      if (!d.is_number_unsigned()) bad("shape holds something other than non-negative integers");
      const uint64_t size = d.get<uint64_t>();
      if (size != 0 && t.numel > UINT64_MAX / size) bad("shape overflows");
      t.shape.push_back(static_cast<int64_t>(size));
      t.numel *= size;
    }
    const auto& offsets = info["data_offsets"];
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
        !offsets[1].is_number_unsigned())
      bad("data_offsets is not [begin, end]");
    const uint64_t begin = offsets[0].get<uint64_t>(), end = offsets[1].get<uint64_t>();
    if (begin > end)
      bad(strprintf("data_offsets [%llu, %llu] end before they begin", static_cast<unsigned long long>(begin),
                    static_cast<unsigned long long>(end)));
    if (end > data_bytes)
      bad(strprintf("data_offsets [%llu, %llu] outside the %llu data bytes (truncated file?)",
                    static_cast<unsigned long long>(begin), static_cast<unsigned long long>(end),
                    static_cast<unsigned long long>(data_bytes)));
    if (t.numel > UINT64_MAX / element || t.numel * element != end - begin)
      bad(strprintf("%llu bytes do not hold its shape's %llu elements of %s",
                    static_cast<unsigned long long>(end - begin), static_cast<unsigned long long>(t.numel),
                    t.dtype.c_str()));
    t.begin = data_start + begin, t.end = data_start + end;
    tensors_.push_back(std::move(t));
  }
  // The data area is the tensors' ranges, back to back: no overlap, no hole, nothing after.
  std::vector<const SafetensorsTensor*> by_offset;
  for (const SafetensorsTensor& t : tensors_) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(), [](auto* a, auto* b) { return a->begin < b->begin; });
  uint64_t expected = data_start;
  for (const SafetensorsTensor* t : by_offset) {
    if (t->begin != expected)
      fail("tensor '" + printable_text(t->name) + "': its bytes " + (t->begin < expected ? "overlap another tensor's" : "leave a gap"));
    expected = t->end;
  }
  if (expected != file_bytes)
    fail(strprintf("%llu bytes after the last tensor", static_cast<unsigned long long>(file_bytes - expected)));
}

SafetensorsReader::~SafetensorsReader() {
  if (fd_ >= 0) ::close(fd_);
}

const SafetensorsTensor* SafetensorsReader::find(const std::string& name) const {
  for (const SafetensorsTensor& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

void SafetensorsReader::read_fp32(const SafetensorsTensor& t, uint64_t first, uint64_t count, float* out) const {
  auto fail = [&](const std::string& why) {
    throw CheckpointError("safetensors file '" + path_ + "', tensor '" + printable_text(t.name) + "': " + why);
  };
  if (t.dtype != "F32" && t.dtype != "BF16" && t.dtype != "F16")
    fail("dtype " + t.dtype + " is not a floating-point type ShardTrain reads (F32, BF16, F16)");
  if (first > t.numel || count > t.numel - first) fail("elements requested beyond the tensor");
  const size_t element = dtype_size(t.dtype);
  std::vector<uint16_t> halves;
  for (uint64_t done = 0; done < count;) {
    const uint64_t n = std::min(CHUNK_ELEMENTS, count - done);
    const uint64_t at = t.begin + (first + done) * element;
    if (element == 4) {
      if (!pread_all(fd_, out + done, n * 4, at)) fail("cannot read: " + io_reason());
    } else {
      halves.resize(n);
      if (!pread_all(fd_, halves.data(), n * 2, at)) fail("cannot read: " + io_reason());
      const DType type = t.dtype == "BF16" ? DTYPE_BF16 : DTYPE_FP16;
      for (uint64_t i = 0; i < n; i++) out[done + i] = half_to_float(halves[i], type);
    }
    done += n;
  }
}

void SafetensorsReader::read_raw(const SafetensorsTensor& t, const std::string& dtype, uint64_t first, uint64_t count,
                                 void* out) const {
  auto fail = [&](const std::string& why) {
    throw CheckpointError("safetensors file '" + path_ + "', tensor '" + printable_text(t.name) + "': " + why);
  };
  if (t.dtype != dtype) fail("dtype " + t.dtype + " where " + dtype + " is expected");
  if (first > t.numel || count > t.numel - first) fail("elements requested beyond the tensor");
  const size_t element = dtype_size(t.dtype);
  if (!pread_all(fd_, out, count * element, t.begin + first * element)) fail("cannot read: " + io_reason());
}

SafetensorsLayout::SafetensorsLayout(const std::vector<SafetensorsEntry>& entries,
                                     const std::map<std::string, std::string>& metadata)
    : entries_(entries) {
  nlohmann::ordered_json header;
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t at = 0;
  for (const SafetensorsEntry& e : entries_) {
    uint64_t numel = 1;
    for (int64_t d : e.shape) numel *= static_cast<uint64_t>(d);
    const uint64_t bytes = numel * (e.bytes ? 1 : dtype_bytes(e.dtype));
    header[e.name] = {{"dtype", e.bytes ? "U8" : safetensors_dtype_name(e.dtype)},
                      {"shape", e.shape},
                      {"data_offsets", {at, at + bytes}}};
    offsets_.push_back(at);
    at += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data area starts 8-byte aligned
  header_.resize(8);
  for (int i = 0; i < 8; i++) header_[i] = static_cast<char>(static_cast<uint64_t>(text.size()) >> (8 * i) & 0xff);
  header_ += text;
  for (uint64_t& offset : offsets_) offset += header_.size();
  file_bytes_ = header_.size() + at;
}

void create_safetensors_file(const std::string& path, const SafetensorsLayout& layout) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw CheckpointError("cannot create '" + path + "': " + std::strerror(errno));
  // Reserve the blocks now, so a full disk is reported before any rank writes.
  int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(layout.file_bytes()));
  if (rc == EOPNOTSUPP || rc == EINVAL) rc = ::ftruncate(fd, static_cast<off_t>(layout.file_bytes())) ? errno : 0;
  const bool ok = rc == 0 && pwrite_all(fd, layout.header().data(), layout.header().size(), 0);
  const int saved = rc ? rc : errno;
  ::close(fd);
  if (!ok) {
    ::unlink(path.c_str());
    throw CheckpointError("cannot write '" + path + "': " + std::strerror(saved) + " (disk full?)");
  }
}

SafetensorsWriter::SafetensorsWriter(const std::string& path, const SafetensorsLayout& layout)
    : path_(path), layout_(layout) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd_ < 0) throw CheckpointError("cannot open '" + path + "' for writing: " + std::strerror(errno));
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void SafetensorsWriter::write_bytes(size_t entry, uint64_t first, uint64_t count, const void* bytes) {
  SHARD_CHECK(layout_.entries()[entry].bytes, "write_bytes into %s, which is not U8", layout_.entries()[entry].name.c_str());
  if (!pwrite_all(fd_, bytes, count, layout_.offset(entry) + first))
    throw CheckpointError("cannot write '" + path_ + "': " + std::strerror(errno) + " (disk full?)");
}

void SafetensorsWriter::write_fp32(size_t entry, uint64_t first, uint64_t count, const float* values) {
  SHARD_CHECK(!layout_.entries()[entry].bytes, "write_fp32 into U8 tensor %s", layout_.entries()[entry].name.c_str());
  const DType type = layout_.entries()[entry].dtype;
  const size_t element = dtype_bytes(type);
  std::vector<uint16_t> halves;
  for (uint64_t done = 0; done < count;) {
    const uint64_t n = std::min(CHUNK_ELEMENTS, count - done);
    const uint64_t at = layout_.offset(entry) + (first + done) * element;
    bool ok;
    if (type == DTYPE_FP32) {
      ok = pwrite_all(fd_, values + done, n * 4, at);
    } else {
      halves.resize(n);
      for (uint64_t i = 0; i < n; i++) halves[i] = float_to_half(values[done + i], type);
      ok = pwrite_all(fd_, halves.data(), n * 2, at);
    }
    if (!ok) throw CheckpointError("cannot write '" + path_ + "': " + std::strerror(errno) + " (disk full?)");
    done += n;
  }
}

void SafetensorsWriter::finish() {
  const bool ok = ::fsync(fd_) == 0;
  const int saved = errno;
  const bool closed = ::close(fd_) == 0;
  fd_ = -1;
  if (!ok || !closed) throw CheckpointError("cannot write '" + path_ + "': " + std::strerror(saved));
}

}  // namespace shardtrain
