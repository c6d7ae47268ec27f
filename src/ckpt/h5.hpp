// Thin RAII and checking over the HDF5 C API, for the checkpoint reader and writer.
//
// Every failing HDF5 call becomes a CheckpointError naming the file and the call, never a crash;
// HDF5's own error-stack printing is switched off while our calls run (H5QuietErrors) so the user
// sees one line. Versioned names (H5Dopen2, H5Acreate2, ...) throughout: Debian builds HDF5 with
// the 1.8 API as default.
#pragma once

#include <hdf5.h>

#include <string>
#include <vector>

#include "core/error.hpp"

namespace shardtrain {

// For its lifetime, HDF5 prints no error stack (our checks report each failure as one line);
// then the handler that was set before is back. HDF5's handler is process-wide (per thread in
// thread-safe builds), so every entry point into our HDF5 code holds one.
class H5QuietErrors {
 public:
  H5QuietErrors();
  ~H5QuietErrors();
  H5QuietErrors(const H5QuietErrors&) = delete;
  H5QuietErrors& operator=(const H5QuietErrors&) = delete;

 private:
  H5E_auto2_t handler_ = nullptr;
  void* data_ = nullptr;
};

// Owns one HDF5 identifier and closes it with the matching H5?close.
class H5Id {
 public:
  using Closer = herr_t (*)(hid_t);
  H5Id() = default;
  H5Id(hid_t id, Closer closer) : id_(id), closer_(closer) {}
  ~H5Id() { reset(); }
  H5Id(H5Id&& o) noexcept : id_(o.id_), closer_(o.closer_) { o.id_ = H5I_INVALID_HID; }
  H5Id& operator=(H5Id&& o) noexcept {
    if (this != &o) reset(), id_ = o.id_, closer_ = o.closer_, o.id_ = H5I_INVALID_HID;
    return *this;
  }
  H5Id(const H5Id&) = delete;
  H5Id& operator=(const H5Id&) = delete;
  hid_t get() const { return id_; }
  operator hid_t() const { return id_; }
  void reset() {
    if (id_ >= 0 && closer_) closer_(id_);
    id_ = H5I_INVALID_HID;
  }
  // Gives up ownership, for a close whose result matters (H5Fclose of a written file).
  hid_t release() {
    hid_t id = id_;
    id_ = H5I_INVALID_HID;
    return id;
  }

 private:
  hid_t id_ = H5I_INVALID_HID;
  Closer closer_ = nullptr;
};

// Throws CheckpointError("checkpoint 'file': what failed") when id < 0 / status < 0.
hid_t h5_check_id(hid_t id, const std::string& file, const char* what);
void h5_check(herr_t status, const std::string& file, const char* what);

// Scalar and string attributes (collective in parallel files: every rank writes the same value).
void h5_write_attr_i64(hid_t obj, const char* name, int64_t value, const std::string& file);
void h5_write_attr_u64(hid_t obj, const char* name, uint64_t value, const std::string& file);
void h5_write_attr_f64(hid_t obj, const char* name, double value, const std::string& file);
void h5_write_attr_str(hid_t obj, const char* name, const std::string& value, const std::string& file);
bool h5_has_attr(hid_t obj, const char* name);
int64_t h5_read_attr_i64(hid_t obj, const char* name, const std::string& file);
// A scalar or an array attribute's values, as int64.
std::vector<int64_t> h5_read_attr_i64s(hid_t obj, const char* name, const std::string& file);
uint64_t h5_read_attr_u64(hid_t obj, const char* name, const std::string& file);
double h5_read_attr_f64(hid_t obj, const char* name, const std::string& file);
std::string h5_read_attr_str(hid_t obj, const char* name, const std::string& file);

// Dimensions of a dataset's dataspace.
std::vector<hsize_t> h5_dataset_dims(hid_t dataset, const std::string& file);

// A serial file's dataset `name`, read whole as float32 or int32 (HDF5 converts): its values, and
// its dims into `dims`. DataError naming the file and the dataset (`hint` appended to "not an HDF5
// file") when it cannot.
std::vector<float> h5_read_floats(const std::string& path, const char* name, std::vector<hsize_t>* dims,
                                  const std::string& hint);
std::vector<int32_t> h5_read_ints(const std::string& path, const char* name, std::vector<hsize_t>* dims,
                                  const std::string& hint);
// Records [first, first + count) of an open one-dimensional dataset of strings, fixed-length or
// variable-length (h5py's str), as UTF-8 text; DataError starting with `where` when it is not such
// a dataset or cannot be read.
std::vector<std::string> h5_read_strings(hid_t dataset, uint64_t first, uint64_t count, const std::string& where);
// A serial file's string dataset `name` read whole, as h5_read_floats reads floats.
std::vector<std::string> h5_read_strings(const std::string& path, const char* name, const std::string& hint);
// Writes `data` (native floats, int32s or fixed-length strings of `type`) as a new dataset of
// shape `dims` in an open serial file.
void h5_write_dataset(hid_t file, const char* name, hid_t file_type, hid_t memory_type, const std::vector<hsize_t>& dims,
                      const void* data, const std::string& path);

}  // namespace shardtrain
