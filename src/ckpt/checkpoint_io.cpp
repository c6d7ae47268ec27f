// See checkpoint_io.hpp. The plan (plan_pieces) lists, for one layout, every dataset with its
// shape and the contiguous run of its flat elements that this rank holds; writer and reader both
// walk that one plan, so the two layouts share all the I/O code.
#include "ckpt/checkpoint_io.hpp"

#include <array>
#include <cstring>
#include <sstream>

#include "backend/math.hpp"
#include "ckpt/h5.hpp"
#include "comm/runtime.hpp"

namespace shardtrain {
namespace {

// One dataset and this rank's part of it: flat elements [first, first + count) at data are
// transferred; [check_first, check_first + check_count) at check_data, a subrange owned by this
// rank alone among its replicas, enter the checksum (each element counted once). A save transfers
// only the owned part; a load reads the rank's whole shard.
struct Piece {
  std::string path;
  std::vector<hsize_t> dims;
  uint64_t checked_numel;  // elements covered by the checksum (the unpadded ones)
  uint64_t first = 0, count = 0;
  float* data = nullptr;
  uint64_t check_first = 0, check_count = 0;
  float* check_data = nullptr;
};

const char* MOMENT_NAMES[2] = {"exp_avg", "exp_avg_sq"};

// The part of flat range [lo, hi) (unit coordinates) that falls in [p_lo, p_hi), in p's coordinates.
struct Run {
  uint64_t first = 0, count = 0, unit_from = 0;
};
Run clip(uint64_t lo, uint64_t hi, uint64_t p_lo, uint64_t p_hi) {
  const uint64_t from = std::max(lo, p_lo), to = std::min(hi, p_hi);
  return from < to ? Run{from - p_lo, to - from, from} : Run{};
}

// HDF5 reads and writes host memory. Shards on the host are used in place; shards on a GPU pass
// through host copies of the rank's parameters and moments (as large as the shards themselves).
class HostShards {
 public:
  HostShards(FsdpEngine& engine, AdamW& optimizer, bool download) {
    for (size_t u = 0; u < engine.shards().size(); u++) {
      DeviceArray<float>* arrays[3] = {&engine.shards()[u].params, &optimizer.m()[u], &optimizer.v()[u]};
      for (DeviceArray<float>* a : arrays) {
        arrays_.push_back(a);
        copies_.emplace_back(a->on_host() ? 0 : a->size());
        if (download && !a->on_host()) a->device()->copy(copies_.back().data(), a->data(), a->bytes());
      }
    }
  }
  // k: 0 parameters, 1 first moment, 2 second moment.
  float* buffer(size_t unit, int k) {
    const size_t i = 3 * unit + k;
    return arrays_[i]->on_host() ? arrays_[i]->data() : copies_[i].data();
  }
  void zero() {
    for (size_t i = 0; i < arrays_.size(); i++) {
      float* values = buffer(i / 3, i % 3);
      std::fill(values, values + arrays_[i]->size(), 0.0f);
    }
  }
  void upload() {
    for (size_t i = 0; i < arrays_.size(); i++)
      if (!arrays_[i]->on_host())
        arrays_[i]->device()->copy(arrays_[i]->data(), copies_[i].data(), arrays_[i]->bytes());
  }

 private:
  std::vector<DeviceArray<float>*> arrays_;
  std::vector<std::vector<float>> copies_;
};

std::vector<Piece> plan_pieces(const std::string& layout, FsdpEngine& engine, HostShards& host, bool for_save) {
  const ParamTable& table = engine.table();
  std::vector<Piece> pieces;
  for (size_t u = 0; u < table.units().size(); u++) {
    UnitShard& shard = engine.shards()[u];
    float* buffers[3] = {host.buffer(u, 0), host.buffer(u, 1), host.buffer(u, 2)};
    const std::string prefixes[3] = {"/model/", "/optim/exp_avg/", "/optim/exp_avg_sq/"};
    const uint64_t own_lo = shard.begin + shard.owned_begin, own_hi = own_lo + shard.owned_count;
    const uint64_t io_lo = for_save ? own_lo : shard.begin, io_hi = for_save ? own_hi : shard.begin + shard.shard_numel;
    const UnitInfo& unit = table.units()[u];
    for (int k = 0; k < 3; k++) {
      auto add = [&](std::string path, std::vector<hsize_t> dims, uint64_t p_lo, uint64_t numel) {
        Piece p;
        p.path = std::move(path);
        p.dims = std::move(dims);
        p.checked_numel = numel;
        Run io = clip(io_lo, io_hi, p_lo, p_lo + numel), check = clip(own_lo, own_hi, p_lo, p_lo + numel);
        p.first = io.first, p.count = io.count, p.data = buffers[k] + (io.unit_from - shard.begin);
        p.check_first = check.first, p.check_count = check.count;
        p.check_data = buffers[k] + (check.unit_from - shard.begin);
        if (!io.count) p.data = nullptr;
        if (!check.count) p.check_data = nullptr;
        pieces.push_back(std::move(p));
      };
      if (layout == "sharded") {
        add("/shards/" + unit.name + "/" + (k == 0 ? "params" : MOMENT_NAMES[k - 1]), {shard.padded_numel}, 0,
            unit.numel);
      } else {
        for (int id : unit.params) {
          const ParamInfo& param = table.params()[id];
          add(prefixes[k] + param.name, std::vector<hsize_t>(param.shape.begin(), param.shape.end()), param.offset,
              param.numel);
        }
      }
    }
  }
  return pieces;
}

uint64_t element_hash(uint64_t index, float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return mix64(index * 0x9E3779B97F4A7C15ull + bits);
}

// Selects flat elements [first, first+count) of a 1-D or 2-D dataspace: at most three blocks
// (a partial first row, whole middle rows, a partial last row).
void select_flat_range(hid_t space, const std::vector<hsize_t>& dims, uint64_t first, uint64_t count,
                       const std::string& file) {
  if (count == 0) {
    h5_check(H5Sselect_none(space), file, "H5Sselect_none");
    return;
  }
  if (dims.size() == 1) {
    hsize_t start = first, n = count;
    h5_check(H5Sselect_hyperslab(space, H5S_SELECT_SET, &start, nullptr, &n, nullptr), file, "H5Sselect_hyperslab");
    return;
  }
  SHARD_CHECK(dims.size() == 2, "dataset of rank %zu", dims.size());
  const uint64_t cols = dims[1], last = first + count - 1;
  const uint64_t r0 = first / cols, c0 = first % cols, r1 = last / cols, c1 = last % cols;
  H5S_seloper_t op = H5S_SELECT_SET;
  auto block = [&](uint64_t row, uint64_t col, uint64_t rows, uint64_t cols_n) {
    hsize_t start[2] = {row, col}, n[2] = {rows, cols_n};
    h5_check(H5Sselect_hyperslab(space, op, start, nullptr, n, nullptr), file, "H5Sselect_hyperslab");
    op = H5S_SELECT_OR;
  };
  if (r0 == r1) {
    block(r0, c0, 1, c1 - c0 + 1);
    return;
  }
  block(r0, c0, 1, cols - c0);
  if (r1 > r0 + 1) block(r0 + 1, 0, r1 - r0 - 1, cols);
  block(r1, 0, 1, c1 + 1);
}

H5Id open_parallel(const std::string& path, MPI_Comm comm, bool create) {
  h5_quiet();
  H5Id fapl(h5_check_id(H5Pcreate(H5P_FILE_ACCESS), path, "H5Pcreate"), H5Pclose);
  h5_check(H5Pset_fapl_mpio(fapl, comm, MPI_INFO_NULL), path, "H5Pset_fapl_mpio");
  // One rank reads metadata and broadcasts; metadata is written in one collective operation.
  h5_check(H5Pset_all_coll_metadata_ops(fapl, true), path, "H5Pset_all_coll_metadata_ops");
  h5_check(H5Pset_coll_metadata_write(fapl, true), path, "H5Pset_coll_metadata_write");
  // flock fails on Lustre/NFS and an MPI-IO writer takes no lock anyway (atomic rename instead).
  h5_check(H5Pset_file_locking(fapl, false, true), path, "H5Pset_file_locking");
  hid_t id = create ? H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl)
                    : H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl);
  if (id < 0)
    throw CheckpointError("checkpoint '" + path + "': cannot " + (create ? "create" : "open") +
                          (create ? " (is the folder writable and the disk not full?)"
                                  : " as HDF5 (missing, truncated or not a checkpoint)"));
  return H5Id(id, H5Fclose);
}

H5Id collective_transfer(const std::string& file) {
  H5Id dxpl(h5_check_id(H5Pcreate(H5P_DATASET_XFER), file, "H5Pcreate"), H5Pclose);
  h5_check(H5Pset_dxpl_mpio(dxpl, H5FD_MPIO_COLLECTIVE), file, "H5Pset_dxpl_mpio");
  return dxpl;
}

void allreduce_sum(std::vector<uint64_t>& values, MPI_Comm comm) {
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, values.data(), static_cast<int>(values.size()), MPI_UINT64_T, MPI_SUM, comm));
}

// "name offset numel shape" per parameter: the map from parameters to a unit's flat offsets.
std::string unit_index(const ParamTable& table, size_t unit) {
  std::ostringstream s;
  for (int id : table.units()[unit].params) {
    const ParamInfo& p = table.params()[id];
    s << p.name << " " << p.offset << " " << p.numel << " ";
    for (size_t d = 0; d < p.shape.size(); d++) s << (d ? "x" : "") << p.shape[d];
    s << "\n";
  }
  return s.str();
}

const char* MODEL_DIMS[5] = {"model.n_layer", "model.n_embd", "model.n_head", "model.vocab_size", "model.max_seq_len"};

std::array<int64_t, 5> model_dims(const ModelConfig& c) {
  return {c.n_layer, c.n_embd, c.n_head, c.vocab_size, c.max_seq_len};
}

void write_state(hid_t file, const CheckpointState& s, const ModelConfig& model, const std::string& path) {
  h5_write_attr_str(file, "format", CKPT_FORMAT_NAME, path);
  h5_write_attr_i64(file, "version", CKPT_FORMAT_VERSION, path);
  h5_write_attr_str(file, "layout", s.layout, path);
  h5_write_attr_i64(file, "step", s.step, path);
  h5_write_attr_i64(file, "tokens_seen", s.tokens_seen, path);
  h5_write_attr_u64(file, "seed", s.seed, path);
  h5_write_attr_i64(file, "sampler_step", s.sampler_step, path);
  h5_write_attr_i64(file, "world_size", s.world_size, path);
  h5_write_attr_str(file, "strategy", s.strategy, path);
  h5_write_attr_str(file, "config", s.config_ini, path);
  h5_write_attr_i64(file, "loss_scale_log2", s.loss_scale_log2, path);
  h5_write_attr_i64(file, "loss_scale_good_steps", s.loss_scale_good_steps, path);
  auto dims = model_dims(model);
  for (int i = 0; i < 5; i++) h5_write_attr_i64(file, MODEL_DIMS[i], dims[i], path);
}

CheckpointState read_state(hid_t file, const std::string& path) {
  if (!h5_has_attr(file, "format") || h5_read_attr_str(file, "format", path) != CKPT_FORMAT_NAME)
    throw CheckpointError("checkpoint '" + path + "': not a " + CKPT_FORMAT_NAME + " file (no 'format' attribute '" +
                          CKPT_FORMAT_NAME + "')");
  int64_t version = h5_read_attr_i64(file, "version", path);
  if (version != CKPT_FORMAT_VERSION)
    throw CheckpointError(strprintf("checkpoint '%s': format version %lld, this build reads version %lld",
                                    path.c_str(), static_cast<long long>(version),
                                    static_cast<long long>(CKPT_FORMAT_VERSION)));
  CheckpointState s;
  s.layout = h5_read_attr_str(file, "layout", path);
  if (s.layout != "sharded" && s.layout != "gathered")
    throw CheckpointError("checkpoint '" + path + "': unknown layout '" + s.layout + "'");
  s.step = h5_read_attr_i64(file, "step", path);
  s.tokens_seen = h5_read_attr_i64(file, "tokens_seen", path);
  s.seed = h5_read_attr_u64(file, "seed", path);
  s.sampler_step = h5_read_attr_i64(file, "sampler_step", path);
  s.world_size = h5_read_attr_i64(file, "world_size", path);
  s.strategy = h5_read_attr_str(file, "strategy", path);
  s.config_ini = h5_read_attr_str(file, "config", path);
  s.loss_scale_log2 = h5_read_attr_i64(file, "loss_scale_log2", path);
  s.loss_scale_good_steps = h5_read_attr_i64(file, "loss_scale_good_steps", path);
  int64_t dims[5];
  for (int i = 0; i < 5; i++) dims[i] = h5_read_attr_i64(file, MODEL_DIMS[i], path);
  s.model.n_layer = static_cast<int>(dims[0]), s.model.n_embd = static_cast<int>(dims[1]);
  s.model.n_head = static_cast<int>(dims[2]), s.model.vocab_size = static_cast<int>(dims[3]);
  s.model.max_seq_len = static_cast<int>(dims[4]);
  return s;
}

}  // namespace

std::string model_mismatch(const std::string& path, const ModelConfig& stored, const ModelConfig& configured) {
  auto a = model_dims(stored), b = model_dims(configured);
  std::string differences;
  for (int i = 0; i < 5; i++)
    if (a[i] != b[i])
      differences += strprintf("%s%s=%lld (configured %lld)", differences.empty() ? "" : ", ", MODEL_DIMS[i],
                               static_cast<long long>(a[i]), static_cast<long long>(b[i]));
  if (differences.empty()) return "";
  return "checkpoint '" + path + "' holds another model: " + differences +
         "; set model.* to match, or use another checkpoint.dir";
}

uint64_t checksum_elements(const float* values, size_t count, uint64_t first_index) {
  uint64_t sum = 0;
#pragma omp parallel for reduction(+ : sum) schedule(static)
  for (size_t i = 0; i < count; i++) sum += element_hash(first_index + i, values[i]);
  return sum;
}

void save_checkpoint(const std::string& path, const CheckpointState& state, FsdpEngine& engine, AdamW& optimizer,
                     MPI_Comm comm) {
  const ParamTable& table = engine.table();
  HostShards host(engine, optimizer, true);
  std::vector<Piece> pieces = plan_pieces(state.layout, engine, host, true);
  std::vector<uint64_t> sums(pieces.size());
  for (size_t i = 0; i < pieces.size(); i++)
    sums[i] = checksum_elements(pieces[i].check_data, pieces[i].check_count, pieces[i].check_first);
  allreduce_sum(sums, comm);

  H5Id file = open_parallel(path, comm, true);
  std::string local_error;
  write_state(file, state, table.config(), path);
  H5Id lcpl(h5_check_id(H5Pcreate(H5P_LINK_CREATE), path, "H5Pcreate"), H5Pclose);
  h5_check(H5Pset_create_intermediate_group(lcpl, 1), path, "H5Pset_create_intermediate_group");
  H5Id dxpl = collective_transfer(path);
  for (size_t i = 0; i < pieces.size(); i++) {
    const Piece& p = pieces[i];
    H5Id space(h5_check_id(H5Screate_simple(static_cast<int>(p.dims.size()), p.dims.data(), nullptr), path,
                           "H5Screate_simple"), H5Sclose);
    H5Id dataset(h5_check_id(H5Dcreate2(file, p.path.c_str(), H5T_IEEE_F32LE, space, lcpl, H5P_DEFAULT, H5P_DEFAULT),
                             path, "H5Dcreate2"), H5Dclose);
    select_flat_range(space, p.dims, p.first, p.count, path);
    hsize_t mem_n = std::max<uint64_t>(p.count, 1);
    H5Id memspace(h5_check_id(H5Screate_simple(1, &mem_n, nullptr), path, "H5Screate_simple"), H5Sclose);
    if (p.count == 0) h5_check(H5Sselect_none(memspace), path, "H5Sselect_none");
    // A failure here may be this rank's alone: note it and keep taking part in the collectives.
    if (H5Dwrite(dataset, H5T_NATIVE_FLOAT, memspace, space, dxpl, p.data) < 0 && local_error.empty())
      local_error = "checkpoint '" + path + "': writing " + p.path + " failed (disk full or not writable?)";
    h5_write_attr_u64(dataset, "checksum", sums[i], path);
    h5_write_attr_i64(dataset, "numel", static_cast<int64_t>(p.checked_numel), path);
  }
  if (state.layout == "sharded") {
    for (size_t u = 0; u < table.units().size(); u++) {
      H5Id group(h5_check_id(H5Gopen2(file, ("/shards/" + table.units()[u].name).c_str(), H5P_DEFAULT), path,
                             "H5Gopen2"), H5Gclose);
      h5_write_attr_str(group, "index", unit_index(table, u), path);
    }
  }
  std::string error = agreed_error(local_error, comm);
  if (!error.empty()) throw CheckpointError(error);
  h5_check(H5Fflush(file, H5F_SCOPE_GLOBAL), path, "H5Fflush");  // MPI_File_sync: data on disk
}

CheckpointState load_checkpoint(const std::string& path, FsdpEngine& engine, AdamW& optimizer, MPI_Comm comm) {
  const ParamTable& table = engine.table();
  H5Id file = open_parallel(path, comm, false);
  CheckpointState state = read_state(file, path);
  std::string mismatch = model_mismatch(path, state.model, table.config());
  if (!mismatch.empty()) throw CheckpointError(mismatch);

  // Shards are overwritten entirely: padding and the parts outside the file stay zero.
  HostShards host(engine, optimizer, false);
  host.zero();
  std::vector<Piece> pieces = plan_pieces(state.layout, engine, host, false);
  std::vector<uint64_t> stored(pieces.size()), computed(pieces.size());
  std::string local_error;
  H5Id dxpl = collective_transfer(path);
  for (size_t i = 0; i < pieces.size(); i++) {
    Piece& p = pieces[i];
    if (H5Lexists(file, p.path.c_str(), H5P_DEFAULT) <= 0)
      throw CheckpointError("checkpoint '" + path + "': dataset " + p.path + " is missing");
    H5Id dataset(h5_check_id(H5Dopen2(file, p.path.c_str(), H5P_DEFAULT), path, "H5Dopen2"), H5Dclose);
    std::vector<hsize_t> dims = h5_dataset_dims(dataset, path);
    const int64_t numel = h5_read_attr_i64(dataset, "numel", path);
    // A sharded unit was padded for the rank count at save time: only its numel must agree.
    bool shape_ok = state.layout == "sharded" ? (dims.size() == 1 && dims[0] >= p.checked_numel &&
                                                 numel == static_cast<int64_t>(p.checked_numel))
                                              : dims == p.dims;
    if (!shape_ok) {
      std::string got;
      for (size_t d = 0; d < dims.size(); d++) got += (d ? "x" : "") + std::to_string(dims[d]);
      throw CheckpointError("checkpoint '" + path + "': dataset " + p.path + " has shape " + got +
                            ", which does not fit the model");
    }
    H5Id space(h5_check_id(H5Dget_space(dataset), path, "H5Dget_space"), H5Sclose);
    select_flat_range(space, dims, p.first, p.count, path);
    hsize_t mem_n = std::max<uint64_t>(p.count, 1);
    H5Id memspace(h5_check_id(H5Screate_simple(1, &mem_n, nullptr), path, "H5Screate_simple"), H5Sclose);
    if (p.count == 0) h5_check(H5Sselect_none(memspace), path, "H5Sselect_none");
    float scratch = 0;
    // A failure here may be this rank's alone (a damaged block only it reads): note it and keep
    // taking part in the collective reads, so that no rank waits for one that has left.
    if (H5Dread(dataset, H5T_NATIVE_FLOAT, memspace, space, dxpl, p.count ? p.data : &scratch) < 0 &&
        local_error.empty())
      local_error = "checkpoint '" + path + "': reading " + p.path + " failed (damaged data)";
    stored[i] = h5_read_attr_u64(dataset, "checksum", path);
    computed[i] = checksum_elements(p.check_data, p.check_count, p.check_first);
  }
  std::string error = agreed_error(local_error, comm);
  if (!error.empty()) throw CheckpointError(error);
  allreduce_sum(computed, comm);
  for (size_t i = 0; i < pieces.size(); i++)
    if (computed[i] != stored[i])
      throw CheckpointError("checkpoint '" + path + "': dataset " + pieces[i].path +
                            " fails its checksum (corrupted data); use another checkpoint");
  host.upload();
  return state;
}

static H5Id open_serial(const std::string& path) {
  h5_quiet();
  H5Id fapl(h5_check_id(H5Pcreate(H5P_FILE_ACCESS), path, "H5Pcreate"), H5Pclose);
  h5_check(H5Pset_file_locking(fapl, false, true), path, "H5Pset_file_locking");
  hid_t id = H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl);
  if (id < 0) throw CheckpointError("checkpoint '" + path + "': cannot open as HDF5 (missing, truncated or not a checkpoint)");
  return H5Id(id, H5Fclose);
}

CheckpointState read_checkpoint_state(const std::string& path) {
  H5Id file = open_serial(path);
  return read_state(file, path);
}

CheckpointReader::CheckpointReader(const std::string& path) : path_(path) {
  H5Id file = open_serial(path);
  state_ = read_state(file, path);
  file_ = H5Freopen(file);
  h5_check_id(file_, path, "H5Freopen");
}

CheckpointReader::~CheckpointReader() {
  if (file_ >= 0) H5Fclose(file_);
}

std::string CheckpointReader::dataset_path(const ParamInfo& param, const std::string& unit_name, Tensor tensor) const {
  if (state_.layout == "sharded")
    return "/shards/" + unit_name + "/" + (tensor == TENSOR_PARAMS ? "params" : MOMENT_NAMES[tensor - 1]);
  const char* prefix[3] = {"/model/", "/optim/exp_avg/", "/optim/exp_avg_sq/"};
  return prefix[tensor] + param.name;
}

std::vector<float> CheckpointReader::read(const ParamInfo& param, const std::string& unit_name, Tensor tensor) const {
  const std::string where = dataset_path(param, unit_name, tensor);
  if (H5Lexists(file_, where.c_str(), H5P_DEFAULT) <= 0)
    throw CheckpointError("checkpoint '" + path_ + "': dataset " + where + " is missing");
  H5Id dataset(h5_check_id(H5Dopen2(file_, where.c_str(), H5P_DEFAULT), path_, "H5Dopen2"), H5Dclose);
  std::vector<hsize_t> dims = h5_dataset_dims(dataset, path_);
  // Gathered: the whole dataset; sharded: the parameter's run of the unit's flat buffer.
  const uint64_t first = state_.layout == "sharded" ? param.offset : 0;
  uint64_t total = 1;
  for (hsize_t d : dims) total *= d;
  if (dims.size() > 2 || total < first + param.numel)
    throw CheckpointError("checkpoint '" + path_ + "': dataset " + where + " is too small for " + param.name);
  H5Id space(h5_check_id(H5Dget_space(dataset), path_, "H5Dget_space"), H5Sclose);
  select_flat_range(space, dims, first, param.numel, path_);
  hsize_t n = param.numel;
  H5Id memspace(h5_check_id(H5Screate_simple(1, &n, nullptr), path_, "H5Screate_simple"), H5Sclose);
  std::vector<float> values(param.numel);
  h5_check(H5Dread(dataset, H5T_NATIVE_FLOAT, memspace, space, H5P_DEFAULT, values.data()), path_,
           ("reading " + where).c_str());
  return values;
}

}  // namespace shardtrain
