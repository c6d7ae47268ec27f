// Hugging Face safetensors files: an 8-byte little-endian header length N, N bytes of JSON
// ({"name": {"dtype", "shape", "data_offsets": [begin, end]}, ..., "__metadata__": {str: str}}),
// then the tensors' bytes, row-major, offsets relative to the end of the header.
//
// The reader checks the whole header before any tensor is read (length within the file, JSON, every
// dtype/shape/offset consistent, ranges tiling the data area exactly, as the reference library
// requires) and then reads byte ranges with pread: a rank reads only the elements it asks for.
// The writer lays a file out identically on every rank from the same list of tensors, so several
// processes can each write their own elements into one file; committing (sync, rename) is the
// caller's, which knows the ranks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "backend/dtype.hpp"

namespace shardtrain {

struct SafetensorsTensor {
  std::string name;
  std::string dtype;           // as in the file: F32, BF16, F16, I64, ...
  std::vector<int64_t> shape;  // row-major
  uint64_t numel = 0;
  uint64_t begin = 0, end = 0;  // absolute byte offsets in the file
};

class SafetensorsReader {
 public:
  // Opens and validates the header; throws CheckpointError naming the file and the defect.
  explicit SafetensorsReader(const std::string& path);
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The tensor of that name, or null.
  const SafetensorsTensor* find(const std::string& name) const;
  // Elements [first, first + count) of an F32, BF16 or F16 tensor, widened to fp32. Throws
  // CheckpointError for another dtype, a range outside the tensor, or a short read.
  void read_fp32(const SafetensorsTensor& tensor, uint64_t first, uint64_t count, float* out) const;
  // Elements [first, first + count) of a tensor of the given dtype ("U8", "F32", ...) as stored
  // (little-endian bytes): a quantized tensor's codes and scales. Throws CheckpointError for
  // another dtype or a range outside the tensor.
  void read_raw(const SafetensorsTensor& tensor, const std::string& dtype, uint64_t first, uint64_t count,
                void* out) const;

 private:
  std::string path_;
  int fd_ = -1;
  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, std::string> metadata_;
};

// One tensor of a file to write: its name, element type and shape. `bytes`: a U8 tensor written
// as it is (SafetensorsWriter::write_bytes; `dtype` unused) -- a quantized weight's codes.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DTYPE_FP32;
  std::vector<int64_t> shape;
  bool bytes = false;
};

// The byte layout of a file: header text and each entry's absolute offset. A pure function of the
// entries and metadata, so every rank computes the same one.
class SafetensorsLayout {
 public:
  SafetensorsLayout(const std::vector<SafetensorsEntry>& entries, const std::map<std::string, std::string>& metadata);
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  // The 8-byte length and the JSON header, padded with spaces to a multiple of 8 bytes.
  const std::string& header() const { return header_; }
  uint64_t offset(size_t entry) const { return offsets_[entry]; }
  uint64_t file_bytes() const { return file_bytes_; }

 private:
  std::vector<SafetensorsEntry> entries_;
  std::vector<uint64_t> offsets_;
  std::string header_;
  uint64_t file_bytes_ = 0;
};

// The name safetensors gives our element types: F32, BF16, F16.
const char* safetensors_dtype_name(DType dtype);

// Writes into an existing file laid out as `layout` (see create_safetensors_file): elements
// [first, first + count) of entry `entry`, rounded from fp32 to the entry's dtype. Throws
// CheckpointError naming the file on an I/O error.
class SafetensorsWriter {
 public:
  SafetensorsWriter(const std::string& path, const SafetensorsLayout& layout);
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  void write_fp32(size_t entry, uint64_t first, uint64_t count, const float* values);
  // Bytes [first, first + count) of a U8 entry (SafetensorsEntry::bytes).
  void write_bytes(size_t entry, uint64_t first, uint64_t count, const void* bytes);
  // fsync and close; throws CheckpointError when the data may not be on disk.
  void finish();

 private:
  std::string path_;
  const SafetensorsLayout& layout_;
  int fd_ = -1;
};

// Creates (or truncates) `path` at its full size with the header written; the tensors' bytes are
// zero until written. Throws CheckpointError naming the file (e.g. disk full).
void create_safetensors_file(const std::string& path, const SafetensorsLayout& layout);

}  // namespace shardtrain
