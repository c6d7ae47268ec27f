// See h5.hpp.
#include "ckpt/h5.hpp"

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "core/format.hpp"

namespace shardtrain {

H5QuietErrors::H5QuietErrors() {
  H5Eget_auto2(H5E_DEFAULT, &handler_, &data_);
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
}

H5QuietErrors::~H5QuietErrors() { H5Eset_auto2(H5E_DEFAULT, handler_, data_); }

hid_t h5_check_id(hid_t id, const std::string& file, const char* what) {
  if (id < 0) throw CheckpointError("checkpoint '" + file + "': " + what + " failed");
  return id;
}

void h5_check(herr_t status, const std::string& file, const char* what) {
  if (status < 0) throw CheckpointError("checkpoint '" + file + "': " + what + " failed");
}

static void write_attr(hid_t obj, const char* name, hid_t type, const void* value, const std::string& file) {
  H5Id space(h5_check_id(H5Screate(H5S_SCALAR), file, "H5Screate"), H5Sclose);
  H5Id attr(h5_check_id(H5Acreate2(obj, name, type, space, H5P_DEFAULT, H5P_DEFAULT), file, name), H5Aclose);
  h5_check(H5Awrite(attr, type, value), file, name);
}

void h5_write_attr_i64(hid_t obj, const char* name, int64_t value, const std::string& file) {
  write_attr(obj, name, H5T_NATIVE_INT64, &value, file);
}

void h5_write_attr_u64(hid_t obj, const char* name, uint64_t value, const std::string& file) {
  write_attr(obj, name, H5T_NATIVE_UINT64, &value, file);
}

void h5_write_attr_f64(hid_t obj, const char* name, double value, const std::string& file) {
  write_attr(obj, name, H5T_NATIVE_DOUBLE, &value, file);
}

void h5_write_attr_str(hid_t obj, const char* name, const std::string& value, const std::string& file) {
  H5Id type(h5_check_id(H5Tcopy(H5T_C_S1), file, "H5Tcopy"), H5Tclose);
  h5_check(H5Tset_size(type, value.empty() ? 1 : value.size()), file, "H5Tset_size");
  h5_check(H5Tset_strpad(type, H5T_STR_NULLPAD), file, "H5Tset_strpad");
  write_attr(obj, name, type, value.empty() ? "" : value.data(), file);
}

bool h5_has_attr(hid_t obj, const char* name) { return H5Aexists(obj, name) > 0; }

static H5Id open_attr(hid_t obj, const char* name, const std::string& file) {
  if (!h5_has_attr(obj, name)) throw CheckpointError("checkpoint '" + file + "': attribute '" + name + "' is missing");
  return H5Id(h5_check_id(H5Aopen(obj, name, H5P_DEFAULT), file, name), H5Aclose);
}

static size_t attr_values(hid_t attr, const char* name, const std::string& file) {
  H5Id space(h5_check_id(H5Aget_space(attr), file, name), H5Sclose);
  const hssize_t n = H5Sget_simple_extent_npoints(space);
  if (n < 0) throw CheckpointError("'" + file + "': attribute '" + name + "' has an unreadable dataspace");
  return static_cast<size_t>(n);
}

// One number: an attribute of more values (an array) would overrun it, so it is refused.
template <typename T>
static T read_number_attr(hid_t obj, const char* name, const std::string& file, hid_t memory_type) {
  H5Id attr = open_attr(obj, name, file);
  const size_t n = attr_values(attr, name, file);
  if (n != 1)
    throw CheckpointError(strprintf("'%s': attribute '%s' holds %zu values where one number belongs", file.c_str(),
                                    name, n));
  T value = 0;
  h5_check(H5Aread(attr, memory_type, &value), file, name);
  return value;
}

int64_t h5_read_attr_i64(hid_t obj, const char* name, const std::string& file) {
  return read_number_attr<int64_t>(obj, name, file, H5T_NATIVE_INT64);
}

uint64_t h5_read_attr_u64(hid_t obj, const char* name, const std::string& file) {
  return read_number_attr<uint64_t>(obj, name, file, H5T_NATIVE_UINT64);
}

double h5_read_attr_f64(hid_t obj, const char* name, const std::string& file) {
  return read_number_attr<double>(obj, name, file, H5T_NATIVE_DOUBLE);
}

std::vector<int64_t> h5_read_attr_i64s(hid_t obj, const char* name, const std::string& file) {
  H5Id attr = open_attr(obj, name, file);
  std::vector<int64_t> values(attr_values(attr, name, file));
  if (!values.empty()) h5_check(H5Aread(attr, H5T_NATIVE_INT64, values.data()), file, name);
  return values;
}

std::string h5_read_attr_str(hid_t obj, const char* name, const std::string& file) {
  H5Id attr = open_attr(obj, name, file);
  H5Id type(h5_check_id(H5Aget_type(attr), file, name), H5Tclose);
  if (H5Tget_class(type) != H5T_STRING || H5Tis_variable_str(type) > 0)
    throw CheckpointError("checkpoint '" + file + "': attribute '" + name + "' is not a fixed-length string");
  std::vector<char> buffer(H5Tget_size(type) + 1, '\0');
  h5_check(H5Aread(attr, type, buffer.data()), file, name);
  return std::string(buffer.data());
}

std::vector<hsize_t> h5_dataset_dims(hid_t dataset, const std::string& file) {
  H5Id space(h5_check_id(H5Dget_space(dataset), file, "H5Dget_space"), H5Sclose);
  int rank = H5Sget_simple_extent_ndims(space);
  if (rank < 0) throw CheckpointError("checkpoint '" + file + "': unreadable dataspace");
  std::vector<hsize_t> dims(rank);
  H5Sget_simple_extent_dims(space, dims.data(), nullptr);
  return dims;
}

namespace {

// A serial file opened to read; DataError telling a missing file from one that is not HDF5.
H5Id open_serial_file(const std::string& path, const std::string& hint) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) throw DataError("'" + path + "' does not exist" + hint);
  H5Id file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  if (file.get() < 0) throw DataError("'" + path + "' is not an HDF5 file" + hint);
  return file;
}

template <typename T>
std::vector<T> read_whole(const std::string& path, const char* name, std::vector<hsize_t>* dims, hid_t memory_type,
                          const char* type_name, const std::string& hint) {
  H5QuietErrors quiet;
  H5Id file = open_serial_file(path, hint);
  if (H5Lexists(file, name, H5P_DEFAULT) <= 0) throw DataError("'" + path + "' has no dataset '" + name + "'");
  H5Id set(H5Dopen2(file, name, H5P_DEFAULT), H5Dclose);
  H5Id space(H5Dget_space(set), H5Sclose);
  const int rank = space.get() < 0 ? -1 : H5Sget_simple_extent_ndims(space);
  dims->assign(std::max(rank, 0), 0);
  if (rank > 0) H5Sget_simple_extent_dims(space, dims->data(), nullptr);
  size_t n = 1;
  for (hsize_t d : *dims) n *= d;
  std::vector<T> values(n);
  if (rank < 1 || H5Dread(set, memory_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()) < 0)
    throw DataError("'" + path + "': cannot read dataset '" + name + "' as " + type_name);
  return values;
}

}  // namespace

std::vector<float> h5_read_floats(const std::string& path, const char* name, std::vector<hsize_t>* dims,
                                  const std::string& hint) {
  return read_whole<float>(path, name, dims, H5T_NATIVE_FLOAT, "float32", hint);
}

std::vector<int32_t> h5_read_ints(const std::string& path, const char* name, std::vector<hsize_t>* dims,
                                  const std::string& hint) {
  return read_whole<int32_t>(path, name, dims, H5T_NATIVE_INT32, "int32", hint);
}

std::vector<std::string> h5_read_strings(hid_t set, uint64_t first, uint64_t count, const std::string& where) {
  H5QuietErrors quiet;
  H5Id type(H5Dget_type(set), H5Tclose), space(H5Dget_space(set), H5Sclose);
  if (type.get() < 0 || space.get() < 0 || H5Tget_class(type) != H5T_STRING || H5Sget_simple_extent_ndims(space) != 1)
    throw DataError(where + " is not a one-dimensional dataset of strings");
  hsize_t records = 0;
  H5Sget_simple_extent_dims(space, &records, nullptr);
  if (first + count > records)
    throw DataError(strprintf("%s holds %llu strings, not record %llu", where.c_str(),
                              static_cast<unsigned long long>(records), static_cast<unsigned long long>(first + count - 1)));
  std::vector<std::string> out(count);
  if (count == 0) return out;
  const hsize_t start = first, n = count;
  H5Id memory_space(H5Screate_simple(1, &n, nullptr), H5Sclose);
  if (H5Sselect_hyperslab(space, H5S_SELECT_SET, &start, nullptr, &n, nullptr) < 0)
    throw DataError(where + ": cannot select its records");
  const bool variable = H5Tis_variable_str(type) > 0;
  H5Id memory_type(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_cset(memory_type, H5Tget_cset(type));
  if (variable) {
    H5Tset_size(memory_type, H5T_VARIABLE);
    std::vector<char*> pointers(count, nullptr);
    if (H5Dread(set, memory_type, memory_space, space, H5P_DEFAULT, pointers.data()) < 0)
      throw DataError(where + ": cannot read its strings; the file is damaged");
    for (size_t i = 0; i < count; i++) out[i] = pointers[i] ? pointers[i] : "";
    H5Dvlen_reclaim(memory_type, memory_space, H5P_DEFAULT, pointers.data());
  } else {
    const size_t width = H5Tget_size(type);
    H5Tset_size(memory_type, width);
    H5Tset_strpad(memory_type, H5T_STR_NULLPAD);
    std::vector<char> bytes(width * count, '\0');
    if (H5Dread(set, memory_type, memory_space, space, H5P_DEFAULT, bytes.data()) < 0)
      throw DataError(where + ": cannot read its strings; the file is damaged");
    for (size_t i = 0; i < count; i++) {
      const char* text = bytes.data() + i * width;
      out[i].assign(text, strnlen(text, width));
    }
  }
  return out;
}

std::vector<std::string> h5_read_strings(const std::string& path, const char* name, const std::string& hint) {
  H5QuietErrors quiet;
  H5Id file = open_serial_file(path, hint);
  if (H5Lexists(file, name, H5P_DEFAULT) <= 0) throw DataError("'" + path + "' has no dataset '" + name + "'" + hint);
  H5Id set(H5Dopen2(file, name, H5P_DEFAULT), H5Dclose);
  const std::string where = "'" + path + "': dataset '" + name + "'";
  if (set.get() < 0) throw DataError(where + " cannot be opened");
  H5Id space(H5Dget_space(set), H5Sclose);
  hsize_t records = 0;
  if (space.get() >= 0 && H5Sget_simple_extent_ndims(space) == 1) H5Sget_simple_extent_dims(space, &records, nullptr);
  return h5_read_strings(set, 0, records, where);
}

void h5_write_dataset(hid_t file, const char* name, hid_t file_type, hid_t memory_type, const std::vector<hsize_t>& dims,
                      const void* data, const std::string& path) {
  H5Id space(h5_check_id(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), path, "H5Screate_simple"),
             H5Sclose);
  H5Id set(h5_check_id(H5Dcreate2(file, name, file_type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), path, name),
           H5Dclose);
  h5_check(H5Dwrite(set, memory_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data), path, name);
}

}  // namespace shardtrain
