// See checkpoint_io.hpp. The plan (plan_pieces) lists, for one layout, every dataset with its
// shape and the contiguous run of its flat elements that this rank holds; writer and reader both
// walk that one plan, so the two layouts share all the I/O code.
#include "ckpt/checkpoint_io.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <cstring>
#include <map>
#include <sstream>

#include "ckpt/h5.hpp"
#include "comm/runtime.hpp"
#include "comm/watchdog.hpp"
#include "core/format.hpp"
#include "core/random.hpp"
#include "data/token_file.hpp"

namespace shardtrain {
namespace {

// One run of one dataset (DatasetSpec below) and this rank's part of it: flat elements
// [first, first + count) of the dataset at data are transferred; [check_first, check_first +
// check_count) at check_data, a subrange owned by this rank alone among its replicas, enter the
// dataset's checksum (each element counted once). A save transfers only the owned part; a load
// reads the rank's whole shard. Every rank has the same pieces (some empty): one collective
// transfer each.
struct Piece {
  size_t spec = 0;  // the dataset
  uint64_t first = 0, count = 0;
  float* data = nullptr;
  uint64_t check_first = 0, check_count = 0;
  float* check_data = nullptr;
};

// HDF5 reads and writes host memory. Parameters pass through each unit's HostShard (in place for
// shards on the host without a quantized space; else a host copy, and quantized by upload());
// moments on the host are used in place, on a GPU through host copies. Frozen parameters have no
// moments: their moment datasets are written as zeros and, on load, read (for the checksum) into
// a scratch buffer and dropped. Without an optimizer (a weights-only save or load) there are no
// moments at all: at() and buffer() give null for them. The quantized spaces are never
// dequantized here: a save writes their records (records(), host copies when on a GPU), a load
// dequantizes the file's records into the host copy, which upload() quantizes.
class HostShards {
 public:
  // download: a save's (the moments and records brought to the host).
  HostShards(FsdpEngine& engine, AdamW* optimizer, bool download) {
    size_t frozen_shard = 0;
    for (size_t u = 0; u < engine.shards().size(); u++) {
      params_.push_back(engine.host_shard(static_cast<int>(u), false));
      const DeviceArray<uint8_t>& packed = engine.shards()[u].packed;
      record_copies_.emplace_back(download && !packed.on_host() ? packed.size() : 0);
      if (!record_copies_.back().empty())
        packed.device()->copy_to_host(record_copies_.back().data(), packed.data(), packed.bytes());
      records_.push_back(packed.on_host() ? packed.data() : record_copies_.back().data());
      DeviceArray<float>* moments[2] = {optimizer ? &optimizer->m()[u] : nullptr, optimizer ? &optimizer->v()[u] : nullptr};
      for (DeviceArray<float>* a : moments) {
        moments_.push_back(a);
        copies_.emplace_back(!a || a->on_host() ? 0 : a->size());
        if (download && a && !a->on_host()) a->device()->copy_to_host(copies_.back().data(), a->data(), a->bytes());
      }
      const UnitLayout& l = engine.shards()[u].layout;
      frozen_shard = std::max({frozen_shard, l.frozen.shard_numel, l.quantized.shard_numel});
    }
    if (optimizer) frozen_moments_.assign(frozen_shard, 0.0f);
  }
  bool has_moments() const { return moments_.empty() || moments_[0]; }
  // The rank's records of unit u's quantized space (UnitShard::packed) on the host (a save's).
  const uint8_t* records(size_t unit) const { return records_[unit]; }
  // A save's: a quantized weight's offset and group scales under double quantization, from its
  // unit's nested table (after the records in UnitShard::packed).
  std::vector<float> nested_values(FsdpEngine& engine, int param) const {
    const ParamInfo& p = engine.table().params()[param];
    const UnitLayout& l = engine.shards()[p.unit].layout;
    const NestedScales n = l.nested_view(records_[p.unit], l.shard_records(), 0);
    size_t w = 0;
    for (int id : engine.table().units()[p.unit].params) {
      if (id == param) break;
      w += engine.table().params()[id].quantized;
    }
    SHARD_CHECK(w < n.count, "%s has no nested table", p.name.c_str());
    const NestedWeight& x = n.weights[w];
    std::vector<float> values{x.offset};
    values.insert(values.end(), n.group_scale + x.first_group, n.group_scale + x.first_group + nested_groups(x.records));
    return values;
  }
  // k: 0 parameters, 1 first moment, 2 second moment. Element `index` of the unit's shard buffer
  // (UnitLayout::local_part), in `space`.
  float* at(size_t unit, int k, const UnitLayout& layout, const SpaceLayout& space, size_t index) {
    if (k > 0 && !has_moments()) return nullptr;
    if (k > 0 && &space != &layout.trainable) return frozen_moments_.data() + (index - space.local);
    return buffer(unit, k) + index;
  }
  float* buffer(size_t unit, int k) {
    if (k == 0) return params_[unit].data();
    const size_t i = 2 * unit + k - 1;
    if (!moments_[i]) return nullptr;
    return moments_[i]->on_host() ? moments_[i]->data() : copies_[i].data();
  }
  void zero() {
    for (HostShard& p : params_) std::fill(p.data(), p.data() + p.size(), 0.0f);
    for (size_t i = 0; i < moments_.size(); i++)
      if (float* values = buffer(i / 2, 1 + i % 2)) std::fill(values, values + moments_[i]->size(), 0.0f);
  }
  // with_quantized false: the quantized spaces were not read (an adapter-only file) and keep their
  // records. nested_given: per unit, HostShard::upload's (null: none).
  void upload(bool with_quantized, const std::vector<std::vector<std::vector<float>>>* nested_given = nullptr) {
    for (size_t u = 0; u < params_.size(); u++)
      params_[u].upload(with_quantized, nested_given ? &(*nested_given)[u] : nullptr);
    for (size_t i = 0; i < moments_.size(); i++)
      if (moments_[i] && !moments_[i]->on_host())
        moments_[i]->device()->copy_to_device(moments_[i]->data(), copies_[i].data(), moments_[i]->bytes());
  }

 private:
  std::vector<HostShard> params_;
  std::vector<DeviceArray<float>*> moments_;  // per unit: first moment, second moment (null: none)
  std::vector<std::vector<float>> copies_;
  std::vector<float> frozen_moments_;
  std::vector<const uint8_t*> records_;
  std::vector<std::vector<uint8_t>> record_copies_;
};

const char* TENSOR_PARTS[3] = {"params", "exp_avg", "exp_avg_sq"};
// The fourth kind of dataset: a quantized weight's records, /quantized/<param> in either layout;
// the fifth, under double quantization, its offset and group scales: /quantized_nested/<param>,
// float32 (1 + groups), the same on every rank (rank 0 writes it, every rank reads all of it).
constexpr int TENSOR_RECORDS = 3, TENSOR_NESTED = 4;
const char* RECORDS_GROUP = "/quantized/";
const char* NESTED_GROUP = "/quantized_nested/";
const char* TENSOR_PREFIXES[3] = {"/model/", "/optim/exp_avg/", "/optim/exp_avg_sq/"};

// Where one tensor (0 parameters, 1 first moment, 2 second moment) of a parameter lives.
std::string dataset_name(const std::string& layout, const std::string& unit_name, const std::string& param_name,
                         int tensor) {
  if (layout == "sharded") return "/shards/" + unit_name + "/" + TENSOR_PARTS[tensor];
  return TENSOR_PREFIXES[tensor] + param_name;
}

// Elements [first, first + numel) of a dataset that are unit elements [unit_begin, unit_begin +
// numel) of the run's table, all in one of the unit's spaces.
struct DatasetRun {
  uint64_t first = 0;
  size_t unit_begin = 0, numel = 0;
};

// What a save of this run writes: records of every quantized weight unless the file holds the
// adapters alone.
CheckpointContent content_of_run(const ParamTable& table, bool adapters_only) {
  CheckpointContent c;
  c.adapters_only = adapters_only;
  if (adapters_only || table.quant().type == QUANT_NONE) return c;
  c.quant = table.quant().type, c.block = table.quant().block, c.nested = table.quant().nested;
  c.records.resize(table.params().size());
  for (const ParamInfo& p : table.params()) c.records[p.id] = p.quantized;
  return c;
}

// Where a parameter starts in its unit's flat dataset (sharded layout): the unit's stored
// parameters laid end to end in declaration order. All stored: ParamInfo::file_offset.
size_t stored_offset(const ParamTable& table, const ParamInfo& p, const CheckpointContent& content) {
  if (!content.adapters_only && content.records.empty()) return p.file_offset;
  size_t at = 0;
  for (int id : table.units()[p.unit].params) {
    if (id == p.id) break;
    if (content.stored(table.params()[id])) at += table.params()[id].numel;
  }
  return at;
}

// One dataset a checkpoint of this layout and model must hold: the plan of writer, loader and
// validator alike. Datasets are in declaration order (ParamInfo::file_offset), whatever the run
// froze; `runs` map them onto the run's unit coordinates. The file's table is the run's, or (a base
// model loaded under adapters) the run's without its adapters: the same parameters by id, the
// adapters' coming after all of them. An adapter-only file holds the adapters alone: gathered,
// their datasets; sharded, one flat dataset per unit that has adapters, its adapters end to end.
struct DatasetSpec {
  std::string path;
  std::vector<hsize_t> dims;  // gathered: the parameter's shape; sharded: {numel} (the file's is padded);
                              // records: {blocks, record bytes}
  uint64_t numel = 0;         // elements (records: blocks) under the checksum
  size_t unit = 0;
  int tensor = 0;
  std::vector<DatasetRun> runs;
  int param = -1;  // records and nested tables: the parameter's id
};

std::vector<DatasetSpec> dataset_specs(const ParamTable& table, const ParamTable& run, const std::string& layout,
                                       const CheckpointContent& content) {
  SHARD_CHECK(table.params().size() <= run.params().size(), "a checkpoint with more parameters than the run");
  std::vector<DatasetSpec> specs;
  for (size_t u = 0; u < table.units().size(); u++) {
    const UnitInfo& unit = table.units()[u];
    size_t unit_numel = 0;  // the elements of the unit that the file holds
    for (int id : unit.params) unit_numel += content.stored(table.params()[id]) ? table.params()[id].numel : 0;
    for (int k = 0; k < 3 && unit_numel > 0; k++) {  // (an adapter-only file: units without adapters have none)
      if (layout == "sharded") {
        // The unit's stored parameters in declaration order; neighbours in one space (trainable,
        // frozen, quantized) that are neighbours in the unit too are one run.
        DatasetSpec d{dataset_name(layout, unit.name, "", k), {unit_numel}, unit_numel, u, k, {}};
        int last_space = 0;
        for (int id : unit.params) {
          const ParamInfo& p = table.params()[id];
          if (!content.stored(p)) continue;
          const ParamInfo& q = run.params()[id];
          const size_t first = stored_offset(table, p, content);
          DatasetRun* last = d.runs.empty() ? nullptr : &d.runs.back();
          const int space = q.frozen + q.quantized;
          if (last && space == last_space && last->unit_begin + last->numel == q.offset &&
              last->first + last->numel == first)
            last->numel += p.numel;
          else
            d.runs.push_back({first, q.offset, p.numel});
          last_space = space;
        }
        specs.push_back(std::move(d));
        continue;
      }
      for (int id : unit.params) {
        const ParamInfo& p = table.params()[id];
        if (!content.stored(p)) continue;
        std::vector<hsize_t> dims(p.shape.begin(), p.shape.end());
        specs.push_back(
            {dataset_name(layout, unit.name, p.name, k), dims, p.numel, u, k, {{0, run.params()[id].offset, p.numel}}});
      }
    }
    for (int id : unit.params) {
      const ParamInfo& p = table.params()[id];
      if (!content.in_records(p)) continue;
      const DatasetRun whole{0, run.params()[id].offset, p.numel};
      if (content.nested)  // before the records, which a load dequantizes with it
        specs.push_back({NESTED_GROUP + p.name, {1 + content.groups(p)}, 1 + content.groups(p), u, TENSOR_NESTED,
                         {whole}, id});
      specs.push_back({RECORDS_GROUP + p.name, {content.blocks(p), content.record_bytes()}, content.blocks(p), u,
                       TENSOR_RECORDS, {whole}, id});
    }
  }
  return specs;
}

std::vector<Piece> plan_pieces(const std::vector<DatasetSpec>& specs, FsdpEngine& engine, HostShards& host,
                               bool for_save) {
  std::vector<Piece> pieces;
  for (size_t i = 0; i < specs.size(); i++) {
    const DatasetSpec& d = specs[i];
    if (d.tensor >= TENSOR_RECORDS) continue;  // records and nested tables: their own transfers
    const UnitLayout& shard = engine.shards()[d.unit].layout;
    for (const DatasetRun& run : d.runs) {
      const FlatRange range{run.unit_begin, run.unit_begin + run.numel};
      const SpaceLayout& space = shard.space_of(run.unit_begin);
      const UnitLayout::Local io = shard.local_part(range, for_save), check = shard.local_part(range, true);
      Piece p;
      p.spec = i;
      if (!io.range.empty())
        p.first = run.first + (io.range.begin - run.unit_begin), p.count = io.range.size(),
        p.data = host.at(d.unit, d.tensor, shard, space, io.index);
      if (!check.range.empty())
        p.check_first = run.first + (check.range.begin - run.unit_begin), p.check_count = check.range.size(),
        p.check_data = host.at(d.unit, d.tensor, shard, space, check.index);
      pieces.push_back(p);
    }
  }
  return pieces;
}

bool is_moment(const DatasetSpec& d) { return d.tensor == 1 || d.tensor == 2; }

// The dataset's shape in a new file: a sharded unit's flat buffer padded to a multiple of the
// rank count (the format's promise; readers accept any padding below it).
std::vector<hsize_t> file_dims(const DatasetSpec& d, const std::string& layout, int world) {
  if (layout != "sharded" || d.tensor >= TENSOR_RECORDS) return d.dims;
  const hsize_t w = static_cast<hsize_t>(world);
  return {(d.numel + w - 1) / w * w};
}

// The checksum of `count` records of `bytes` bytes from record `first`: a wrapping sum over records
// of a hash of (index, FNV-1a of its bytes), independent of the rank count as the elements' is.
uint64_t records_checksum(const uint8_t* records, uint64_t count, uint64_t first, size_t bytes) {
  uint64_t sum = 0;
  for (uint64_t r = 0; r < count; r++) {
    uint64_t h = 14695981039346656037ull;
    for (size_t i = 0; i < bytes; i++) h = (h ^ records[r * bytes + i]) * 1099511628211ull;
    sum += mix64((first + r) * 0x9E3779B97F4A7C15ull + h);
  }
  return sum;
}

// The rows of a /quantized dataset (blocks of one weight, spec run `run`) this rank transfers: on
// a load, those covering its part of the weight; `owned` (a save's writes, and the checksums),
// those whose first element it owns -- one rank among replicas, however the run cuts the weight
// (a run holding it quantized cuts on blocks, an fp32 run anywhere).
struct RecordRows {
  uint64_t first = 0, count = 0;
};
RecordRows record_rows(const UnitLayout& layout, const DatasetRun& run, size_t block, bool owned) {
  const FlatRange part = layout.local_part({run.unit_begin, run.unit_begin + run.numel}, owned).range;
  if (part.empty()) return {};
  const uint64_t a = part.begin - run.unit_begin, b = part.end - run.unit_begin;
  const uint64_t first = owned ? (a + block - 1) / block : a / block, end = (b + block - 1) / block;
  return {first, end > first ? end - first : 0};
}

// Where the rank's records (UnitShard::packed on the host) hold the block that starts at unit
// coordinate x of the quantized space.
const uint8_t* shard_record(const UnitLayout& layout, size_t x, const uint8_t* records) {
  const size_t at = layout.quantized.local_index(x) - layout.quantized.local;
  SHARD_CHECK(at % layout.block == 0, "a record at element %zu of a quantized shard in blocks of %zu", at, layout.block);
  return records + at / layout.block * layout.record_bytes();
}

// Collectively writes or reads rows [first, first + count) of a 2-D uint8 dataset of `row_bytes`
// columns (count 0: takes part, transferring nothing).
herr_t transfer_rows(hid_t dataset, bool write, const RecordRows& rows, size_t row_bytes, uint8_t* data, hid_t dxpl,
                     const std::string& path) {
  H5Id space(h5_check_id(H5Dget_space(dataset), path, "H5Dget_space"), H5Sclose);
  hsize_t start[2] = {rows.first, 0}, n[2] = {rows.count, row_bytes};
  if (rows.count == 0)
    h5_check(H5Sselect_none(space), path, "H5Sselect_none");
  else
    h5_check(H5Sselect_hyperslab(space, H5S_SELECT_SET, start, nullptr, n, nullptr), path, "H5Sselect_hyperslab");
  hsize_t mem_n = std::max<uint64_t>(rows.count * row_bytes, 1);
  H5Id memspace(h5_check_id(H5Screate_simple(1, &mem_n, nullptr), path, "H5Screate_simple"), H5Sclose);
  if (rows.count == 0) h5_check(H5Sselect_none(memspace), path, "H5Sselect_none");
  uint8_t scratch = 0;
  uint8_t* buffer = rows.count ? data : &scratch;
  return write ? H5Dwrite(dataset, H5T_NATIVE_UINT8, memspace, space, dxpl, buffer)
               : H5Dread(dataset, H5T_NATIVE_UINT8, memspace, space, dxpl, buffer);
}

uint64_t element_hash(uint64_t index, float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return mix64(index * 0x9E3779B97F4A7C15ull + bits);
}

// The element checksum of `count` zeros from flat index `first`: the moments of a weights-only
// save, which are never held in memory.
uint64_t checksum_of_zeros(size_t count, uint64_t first) {
  uint64_t sum = 0;
#pragma omp parallel for reduction(+ : sum) schedule(static)
  for (size_t i = 0; i < count; i++) sum += element_hash(first + i, 0.0f);
  return sum;
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

// values[i] = their sum over the ranks, wrapping (the checksums' arithmetic). Comm sums floating
// point only: each value travels as four 16-bit digits in doubles, whose sums over up to 2^37
// ranks are exact, and the carries are put back here.
void sum_over_ranks(std::vector<uint64_t>& values, Comm& comm) {
  std::vector<double> digits(4 * values.size());
  for (size_t i = 0; i < values.size(); i++)
    for (int k = 0; k < 4; k++) digits[4 * i + k] = static_cast<double>((values[i] >> (16 * k)) & 0xFFFF);
  comm.all_reduce_sum(Span<double>(digits), "all_reduce(checkpoint checksums)");
  for (size_t i = 0; i < values.size(); i++) {
    values[i] = 0;
    for (int k = 0; k < 4; k++) values[i] += static_cast<uint64_t>(digits[4 * i + k]) << (16 * k);
  }
}

// "name offset numel shape" per stored parameter: the map from parameters to a unit's flat offsets.
std::string unit_index(const ParamTable& table, size_t unit, const CheckpointContent& content) {
  std::ostringstream s;
  for (int id : table.units()[unit].params) {
    const ParamInfo& p = table.params()[id];
    if (!content.stored(p)) continue;
    s << p.name << " " << stored_offset(table, p, content) << " " << p.numel << " ";
    for (size_t d = 0; d < p.shape.size(); d++) s << (d ? "x" : "") << p.shape[d];
    s << "\n";
  }
  return s.str();
}

const char* MODEL_DIMS[5] = {"model.n_layer", "model.n_embd", "model.n_head", "model.vocab_size", "model.max_seq_len"};

std::array<int64_t, 5> model_dims(const ModelConfig& c) {
  return {c.n_layer, c.n_embd, c.n_head, c.vocab_size, c.max_seq_len};
}

// Version 2's architecture attributes, after the five dimensions. Written resolved (n_kv_head and
// intermediate_size never 0), for gpt2 too; a version-1 file is gpt2 with gpt2's values.
const char* MODEL_ARCH = "model.arch";
const char* MODEL_ARCH_INTS[3] = {"model.n_kv_head", "model.intermediate_size", "model.tie_embeddings"};
const char* MODEL_ARCH_REALS[2] = {"model.rope_theta", "model.norm_eps"};

std::array<int64_t, 3> model_arch_ints(const ModelConfig& c) { return {c.kv_heads(), c.mlp_size(), c.tie_embeddings}; }
std::array<double, 2> model_arch_reals(const ModelConfig& c) { return {c.rope_theta, c.norm_eps}; }
std::string real_text(double v) { return strprintf("%.17g", v); }  // exact, for the checksum and messages

// FNV-1a (64 bit) over "name\0value\0" of each root attribute, in the order written; integers in
// decimal. Writer and reader feed it the same sequence: META_ATTRS's.
class MetaChecksum {
 public:
  void add(const char* name, const std::string& value) {
    bytes(name, std::strlen(name) + 1);
    bytes(value.c_str(), value.size() + 1);
  }
  uint64_t value() const { return hash_; }

 private:
  void bytes(const char* p, size_t n) {
    for (size_t i = 0; i < n; i++) hash_ = (hash_ ^ static_cast<unsigned char>(p[i])) * 0x100000001B3ull;
  }
  uint64_t hash_ = 0xCBF29CE484222325ull;
};

const char* META_CHECKSUM = "meta_checksum";
// The adapter's settings (version 3) and LoKr's and OFT's (version 5), as adapter_mismatch names them.
const char* ADAPTER_TYPE = "adapter.type";
const char* ADAPTER_TARGETS = "adapter.targets";
const char* ADAPTER_RANK = "adapter.rank";
const char* ADAPTER_METHOD_INTS[6] = {"adapter.decompose_both", "adapter.decompose_factor", "adapter.block_size",
                                      "adapter.cayley_neumann", "adapter.neumann_terms", "adapter.block_share"};

// Version 6: the model keys of the families beyond the decoders (FLUX's), each written when the
// config's family reads it (ModelFamily::config_keys): META_ATTRS's rows with a `family_int`.
const char* FAMILY_GUIDANCE = "model.guidance_embeds";
const char* FAMILY_ROPE_AXES = "model.rope_axes";
const char* FAMILY_ROPE_SCALING = "model.rope_scaling";
const char* FAMILY_NOPE_LAYERS = "model.nope_layers";

std::array<int64_t, 6> adapter_method_ints(const AdapterConfig& a) {
  return {a.decompose_both, a.decompose_factor, a.block_size, a.cayley_neumann, a.neumann_terms, a.block_share};
}

std::string join_targets(const std::vector<std::string>& targets) {
  std::string s;
  for (const std::string& t : targets) s += (s.empty() ? "" : ",") + t;
  return s;
}

// One root attribute's value, in the member of its type.
struct MetaValue {
  std::string text;
  int64_t i = 0;
  uint64_t u = 0;
  double f = 0;
};
enum class AttrType { STR, I64, U64, F64 };
// When a file of the attribute's version or later holds it: always; when the model's family reads
// the key (FAMILY), or reads it and the value is not 0 or empty (FAMILY_NONZERO: a key added after
// files without it); or with its group -- the data's identity (written by every save), a text encoder
// in the job, a quantized base's records (written when the state has them) -- which a reader reads
// when the group's first attribute is in the file.
enum class Presence { ALWAYS, FAMILY, FAMILY_NONZERO, DATASET, TEXT_ENCODER, RECORDS, RECORDS_NONZERO };

// The root attributes (docs/checkpoint-format.md), in the order written, which is the metadata
// checksum's: name, HDF5 type, the format version that added it, when a file holds it, and its
// value in the state a save writes (the model resolved as version 2 writes it). The writer and the
// reader walk this one list; read_state turns what it read back into the state's fields and checks
// them (a new attribute: its row here, its CheckpointState field, its line there). A family's integer
// key names its ModelConfig field instead (`family_int`, read back through it) and whether it is
// the weights' shape (`compared`: a model of another value is another model) or, like the text
// tokens per sample, the run's (recorded, not compared).
struct MetaAttr {
  const char* name;
  AttrType type;
  int since;
  Presence presence;
  MetaValue (*get)(const CheckpointState&);
  int ModelConfig::*family_int = nullptr;
  bool compared = false;
  MetaValue value(const CheckpointState& s) const { return family_int ? MetaValue{"", s.model.*family_int, 0, 0} : get(s); }
};
MetaValue text_value(const std::string& v) { return {v, 0, 0, 0}; }
MetaValue int_value(int64_t v) { return {"", v, 0, 0}; }
MetaValue u64_value(uint64_t v) { return {"", 0, v, 0}; }
MetaValue real_value(double v) { return {"", 0, 0, v}; }
using S = const CheckpointState&;
using AT = AttrType;
using P = Presence;
const MetaAttr META_ATTRS[] = {
    {"format", AT::STR, 1, P::ALWAYS, [](S) { return text_value(CKPT_FORMAT_NAME); }},
    {"version", AT::I64, 1, P::ALWAYS, [](S) { return int_value(CKPT_FORMAT_VERSION); }},
    {"layout", AT::STR, 1, P::ALWAYS, [](S s) { return text_value(s.layout); }},
    {"step", AT::I64, 1, P::ALWAYS, [](S s) { return int_value(s.step); }},
    {"tokens_seen", AT::I64, 1, P::ALWAYS, [](S s) { return int_value(s.tokens_seen); }},
    {"seed", AT::U64, 1, P::ALWAYS, [](S s) { return u64_value(s.seed); }},
    {"sampler_step", AT::I64, 1, P::ALWAYS, [](S s) { return int_value(s.sampler_step); }},
    {"world_size", AT::I64, 1, P::ALWAYS, [](S s) { return int_value(s.world_size); }},
    {"strategy", AT::STR, 1, P::ALWAYS, [](S s) { return text_value(s.strategy); }},
    {"config", AT::STR, 1, P::ALWAYS, [](S s) { return text_value(s.config_ini); }},
    {"loss_scale_log2", AT::I64, 1, P::ALWAYS, [](S s) { return int_value(s.loss_scale_log2); }},
    {"loss_scale_good_steps", AT::I64, 1, P::ALWAYS, [](S s) { return int_value(s.loss_scale_good_steps); }},
    {"model.n_layer", AT::I64, 1, P::ALWAYS, [](S s) { return int_value(s.model.n_layer); }},
    {"model.n_embd", AT::I64, 1, P::ALWAYS, [](S s) { return int_value(s.model.n_embd); }},
    {"model.n_head", AT::I64, 1, P::ALWAYS, [](S s) { return int_value(s.model.n_head); }},
    {"model.vocab_size", AT::I64, 1, P::ALWAYS, [](S s) { return int_value(s.model.vocab_size); }},
    {"model.max_seq_len", AT::I64, 1, P::ALWAYS, [](S s) { return int_value(s.model.max_seq_len); }},
    {"model.arch", AT::STR, 2, P::ALWAYS, [](S s) { return text_value(s.model.arch); }},
    {"model.n_kv_head", AT::I64, 2, P::ALWAYS, [](S s) { return int_value(s.model.kv_heads()); }},
    {"model.intermediate_size", AT::I64, 2, P::ALWAYS, [](S s) { return int_value(s.model.mlp_size()); }},
    {"model.tie_embeddings", AT::I64, 2, P::ALWAYS, [](S s) { return int_value(s.model.tie_embeddings); }},
    {"model.rope_theta", AT::F64, 2, P::ALWAYS, [](S s) { return real_value(s.model.rope_theta); }},
    {"model.norm_eps", AT::F64, 2, P::ALWAYS, [](S s) { return real_value(s.model.norm_eps); }},
    {"dataset.train", AT::STR, 1, P::DATASET, [](S s) { return text_value(s.dataset_train); }},
    {"dataset.val", AT::STR, 1, P::DATASET, [](S s) { return text_value(s.dataset_val); }},
    {"adapter.type", AT::STR, 3, P::ALWAYS, [](S s) { return text_value(adapter_type_name(s.adapter.type)); }},
    {"adapter.targets", AT::STR, 3, P::ALWAYS, [](S s) { return text_value(join_targets(s.adapter.targets)); }},
    {"adapter.rank", AT::I64, 3, P::ALWAYS, [](S s) { return int_value(s.adapter.rank); }},
    {"adapter.alpha", AT::F64, 3, P::ALWAYS, [](S s) { return real_value(s.adapter.alpha); }},
    {"adapter.dropout", AT::F64, 3, P::ALWAYS, [](S s) { return real_value(s.adapter.dropout); }},
    {"adapters_only", AT::I64, 4, P::ALWAYS, [](S s) { return int_value(s.adapters_only); }},
    {"base_checksum", AT::U64, 4, P::ALWAYS, [](S s) { return u64_value(s.base_checksum); }},
    {"adapter.decompose_both", AT::I64, 5, P::ALWAYS, [](S s) { return int_value(s.adapter.decompose_both); }},
    {"adapter.decompose_factor", AT::I64, 5, P::ALWAYS, [](S s) { return int_value(s.adapter.decompose_factor); }},
    {"adapter.block_size", AT::I64, 5, P::ALWAYS, [](S s) { return int_value(s.adapter.block_size); }},
    {"adapter.cayley_neumann", AT::I64, 5, P::ALWAYS, [](S s) { return int_value(s.adapter.cayley_neumann); }},
    {"adapter.neumann_terms", AT::I64, 5, P::ALWAYS, [](S s) { return int_value(s.adapter.neumann_terms); }},
    {"adapter.block_share", AT::I64, 5, P::ALWAYS, [](S s) { return int_value(s.adapter.block_share); }},
    {"distill.teacher_checksum", AT::U64, 5, P::ALWAYS, [](S s) { return u64_value(s.teacher_checksum); }},
    {"model.n_single_layer", AT::I64, 6, P::FAMILY, nullptr, &ModelConfig::n_single_layer, true},
    {"model.in_channels", AT::I64, 6, P::FAMILY, nullptr, &ModelConfig::in_channels, true},
    {"model.context_dim", AT::I64, 6, P::FAMILY, nullptr, &ModelConfig::context_dim, true},
    {"model.context_len", AT::I64, 6, P::FAMILY, nullptr, &ModelConfig::context_len, false},
    {"model.condition_len", AT::I64, 6, P::FAMILY, nullptr, &ModelConfig::condition_len, false},
    {"model.pooled_dim", AT::I64, 6, P::FAMILY, nullptr, &ModelConfig::pooled_dim, true},
    {"model.pixel_patch", AT::I64, 6, P::FAMILY_NONZERO, nullptr, &ModelConfig::pixel_patch, true},
    {"model.guidance_embeds", AT::I64, 6, P::FAMILY, [](S s) { return int_value(s.model.guidance_embeds); }},
    {"model.rope_axes", AT::STR, 6, P::FAMILY, [](S s) { return text_value(s.model.rope_axes); }},
    {"model.rope_scaling", AT::STR, 8, P::FAMILY_NONZERO, [](S s) { return text_value(s.model.rope_scaling); }},
    {"model.head_dim", AT::I64, 8, P::FAMILY_NONZERO, nullptr, &ModelConfig::head_dim, true},
    {"model.nope_layers", AT::STR, 8, P::FAMILY_NONZERO, [](S s) { return text_value(s.model.nope_layers); }},
    {"model.sliding_window", AT::I64, 10, P::FAMILY_NONZERO, nullptr, &ModelConfig::sliding_window, true},
    {"text_encoder.source", AT::STR, 1, P::TEXT_ENCODER, [](S s) { return text_value(s.text_encoder); }},
    {"text_encoder.layers", AT::STR, 1, P::TEXT_ENCODER, [](S s) { return text_value(s.text_encoder_layers); }},
    {"text_encoder.tokenizer", AT::STR, 1, P::TEXT_ENCODER, [](S s) { return text_value(s.text_encoder_tokenizer); }},
    {"text_encoder.dtype", AT::STR, 1, P::TEXT_ENCODER, [](S s) { return text_value(s.text_encoder_dtype); }},
    {"text_encoder.quant_block", AT::I64, 1, P::TEXT_ENCODER, [](S s) { return int_value(s.text_encoder_quant_block); }},
    {"text_encoder.quantize_all_linear", AT::I64, 1, P::TEXT_ENCODER,
     [](S s) { return int_value(s.text_encoder_all_linear); }},
    {"text_encoder.checksum", AT::U64, 1, P::TEXT_ENCODER, [](S s) { return u64_value(s.text_encoder_checksum); }},
    {"quantized.dtype", AT::STR, 7, P::RECORDS, [](S s) { return text_value(s.quantized_dtype); }},
    {"quantized.block", AT::I64, 7, P::RECORDS, [](S s) { return int_value(s.quantized_block); }},
    {"quantized.double_quant", AT::I64, 9, P::RECORDS_NONZERO, [](S s) { return int_value(s.quantized_double_quant); }},
};

// The attribute whose presence says whether a file holds a group.
const char* group_leader(Presence p) {
  return p == P::DATASET ? "dataset.train" : p == P::TEXT_ENCODER ? "text_encoder.source" : "quantized.dtype";
}

// The value's text in the metadata checksum: strings as stored, integers in decimal, reals %.17g.
std::string checksum_text_of(const MetaValue& v, AttrType type) {
  switch (type) {
    case AT::STR: return v.text;
    case AT::I64: return std::to_string(v.i);
    case AT::U64: return std::to_string(v.u);
    case AT::F64: return real_text(v.f);
  }
  return "";
}

// `state` with the model, adapters and base checksum of the run that saves it.
void write_state(hid_t file, const CheckpointState& state, const ModelConfig& model, const AdapterConfig& adapter,
                 uint64_t base_checksum, const std::string& path) {
  CheckpointState s = state;
  s.model = model, s.adapter = adapter, s.base_checksum = base_checksum;
  const ModelFamily& family = family_of(model);
  MetaChecksum sum;
  for (const MetaAttr& a : META_ATTRS) {
    const MetaValue v = a.value(s);
    bool written = true;
    switch (a.presence) {
      case P::ALWAYS: case P::DATASET: break;
      case P::FAMILY: written = family.reads_key(a.name); break;
      case P::FAMILY_NONZERO: written = family.reads_key(a.name) && (a.type == AT::STR ? !v.text.empty() : v.i != 0); break;
      case P::TEXT_ENCODER: written = !s.text_encoder.empty(); break;
      case P::RECORDS: written = !s.quantized_dtype.empty(); break;
      case P::RECORDS_NONZERO: written = !s.quantized_dtype.empty() && v.i != 0; break;
    }
    if (!written) continue;
    switch (a.type) {
      case AT::STR: h5_write_attr_str(file, a.name, v.text, path); break;
      case AT::I64: h5_write_attr_i64(file, a.name, v.i, path); break;
      case AT::U64: h5_write_attr_u64(file, a.name, v.u, path); break;
      case AT::F64: h5_write_attr_f64(file, a.name, v.f, path); break;
    }
    sum.add(a.name, checksum_text_of(v, a.type));
  }
  h5_write_attr_u64(file, META_CHECKSUM, sum.value(), path);
}

// The same for the architecture attributes of version 2, given plausible dimensions: written
// resolved (never 0), and a shape the family builds.
std::string model_arch_defect(const ModelConfig& m) {
  if (m.n_kv_head < 1 || m.intermediate_size < 1)
    return strprintf("model.n_kv_head=%d or model.intermediate_size=%d is below 1", m.n_kv_head, m.intermediate_size);
  return family_of(m).config_defect(m);
}

// Values no save writes: the sign of a damaged or hand-edited file. "" when all are plausible.
std::string state_defect(const CheckpointState& s) {
  const std::pair<const char*, int64_t> non_negative[4] = {
      {"step", s.step}, {"tokens_seen", s.tokens_seen}, {"sampler_step", s.sampler_step},
      {"loss_scale_good_steps", s.loss_scale_good_steps}};
  for (const auto& [name, value] : non_negative)
    if (value < 0) return strprintf("%s=%lld is negative", name, static_cast<long long>(value));
  if (s.world_size < 1) return strprintf("world_size=%lld is not >= 1", static_cast<long long>(s.world_size));
  if (s.loss_scale_log2 < -1000 || s.loss_scale_log2 > 1000)
    return strprintf("loss_scale_log2=%lld is not in [-1000, 1000]", static_cast<long long>(s.loss_scale_log2));
  return "";
}

CheckpointState read_state(hid_t file, const std::string& path) {
  if (!h5_has_attr(file, "format") || h5_read_attr_str(file, "format", path) != CKPT_FORMAT_NAME)
    throw CheckpointError("checkpoint '" + path + "': not a " + CKPT_FORMAT_NAME + " file (no 'format' attribute '" +
                          CKPT_FORMAT_NAME + "')");
  const int64_t version = h5_read_attr_i64(file, "version", path);
  if (version < 1 || version > CKPT_FORMAT_VERSION)
    throw CheckpointError(strprintf("checkpoint '%s': format version %lld, this build reads versions 1 to %lld",
                                    path.c_str(), static_cast<long long>(version),
                                    static_cast<long long>(CKPT_FORMAT_VERSION)));
  // The walk: every attribute the writer of this version wrote, into the checksum as it hashed it.
  std::map<std::string, MetaValue> read;
  MetaChecksum sum;
  const ModelFamily* family = nullptr;  // known once model.arch is read (version 2; gpt2 before)
  for (const MetaAttr& a : META_ATTRS) {
    if (version < a.since) continue;
    bool present = true;
    switch (a.presence) {
      case P::ALWAYS: break;
      case P::FAMILY: present = family && family->reads_key(a.name); break;
      case P::FAMILY_NONZERO: present = family && family->reads_key(a.name) && h5_has_attr(file, a.name); break;
      case P::RECORDS_NONZERO:
        present = h5_has_attr(file, group_leader(P::RECORDS)) && h5_has_attr(file, a.name);
        break;
      default: present = h5_has_attr(file, group_leader(a.presence));
    }
    if (!present) continue;
    MetaValue v;
    switch (a.type) {
      case AT::STR: v.text = h5_read_attr_str(file, a.name, path); break;
      case AT::I64: v.i = h5_read_attr_i64(file, a.name, path); break;
      case AT::U64: v.u = h5_read_attr_u64(file, a.name, path); break;
      case AT::F64: v.f = h5_read_attr_f64(file, a.name, path); break;
    }
    sum.add(a.name, checksum_text_of(v, a.type));
    read[a.name] = v;
    if (std::strcmp(a.name, MODEL_ARCH) == 0) family = find_model_family(v.text);
  }
  const std::string where = "checkpoint '" + path + "': ";

  // What was read, back into a state, each group checked for values no save writes.
  auto has = [&](const char* name) { return read.count(name) > 0; };
  auto str = [&](const char* name) { return read.at(name).text; };
  auto i64 = [&](const char* name) { return read.at(name).i; };
  auto f64 = [&](const char* name) { return read.at(name).f; };
  CheckpointState s;
  s.version = version;
  s.layout = str("layout");
  s.step = i64("step");
  s.tokens_seen = i64("tokens_seen");
  s.seed = read.at("seed").u;
  s.sampler_step = i64("sampler_step");
  s.world_size = i64("world_size");
  s.strategy = str("strategy");
  s.config_ini = str("config");
  s.loss_scale_log2 = i64("loss_scale_log2");
  s.loss_scale_good_steps = i64("loss_scale_good_steps");
  s.has_dataset = has("dataset.train");
  if (s.has_dataset) s.dataset_train = str("dataset.train"), s.dataset_val = str("dataset.val");
  if (version >= 3) {
    AdapterConfig& a = s.adapter;
    const std::string type = str(ADAPTER_TYPE);
    const int64_t rank = i64(ADAPTER_RANK);
    const double alpha = f64("adapter.alpha"), dropout = f64("adapter.dropout");
    if (!parse_adapter_type(type, &a.type) || rank < 1 || rank > (1 << 20) || !(alpha > 0) ||
        !(dropout >= 0 && dropout < 1))
      throw CheckpointError(where + "attributes adapter.* hold no valid adapter (type '" + type +
                            "'); the file is damaged");
    a.targets = split_comma_list(str(ADAPTER_TARGETS));  // as join_targets wrote them
    a.rank = static_cast<int>(rank), a.alpha = alpha, a.dropout = dropout;
  }
  const int64_t adapters_only = version >= 4 ? i64("adapters_only") : 0;
  if (version >= 4) {
    s.base_checksum = read.at("base_checksum").u;
    s.has_base_checksum = true;
    s.adapters_only = adapters_only == 1;
  }
  if (version >= 5) {
    std::array<int64_t, 6> v;
    for (int i = 0; i < 6; i++) v[i] = i64(ADAPTER_METHOD_INTS[i]);
    AdapterConfig& a = s.adapter;
    auto flag = [](int64_t x) { return x == 0 || x == 1; };
    if (!flag(v[0]) || !(v[1] == -1 || (v[1] >= 1 && v[1] <= (1 << 20))) || v[2] < 2 || v[2] > (1 << 20) ||
        !flag(v[3]) || v[4] < 1 || v[4] > 1000 || !flag(v[5]))
      throw CheckpointError(where + "attributes adapter.decompose_both ... adapter.block_share hold no valid "
                                    "settings; the file is damaged");
    a.decompose_both = v[0], a.decompose_factor = static_cast<int>(v[1]), a.block_size = static_cast<int>(v[2]);
    a.cayley_neumann = v[3], a.neumann_terms = static_cast<int>(v[4]), a.block_share = v[5];
    s.teacher_checksum = read.at("distill.teacher_checksum").u;
  }
  if (has("text_encoder.source")) {
    s.text_encoder = str("text_encoder.source"), s.text_encoder_layers = str("text_encoder.layers");
    s.text_encoder_tokenizer = str("text_encoder.tokenizer"), s.text_encoder_dtype = str("text_encoder.dtype");
    s.text_encoder_quant_block = i64("text_encoder.quant_block");
    s.text_encoder_all_linear = i64("text_encoder.quantize_all_linear");
    s.text_encoder_checksum = read.at("text_encoder.checksum").u;
    QuantType type;
    if (!parse_quant_type(s.text_encoder_dtype, &type) || s.text_encoder_quant_block > 4096 ||
        !quant_block_ok(static_cast<int>(s.text_encoder_quant_block)) ||
        (s.text_encoder_all_linear != 0 && s.text_encoder_all_linear != 1))
      throw CheckpointError(where + "attributes text_encoder.dtype, text_encoder.quant_block and "
                            "text_encoder.quantize_all_linear hold no valid format; the file is damaged");
  }
  if (has("quantized.dtype")) {
    s.quantized_dtype = str("quantized.dtype");
    s.quantized_block = i64("quantized.block");
    s.quantized_double_quant = has("quantized.double_quant") ? i64("quantized.double_quant") : 0;
    QuantType type;
    if (!parse_quant_type(s.quantized_dtype, &type) || type == QUANT_NONE || s.quantized_block > 4096 ||
        !quant_block_ok(static_cast<int>(s.quantized_block)) || s.quantized_double_quant < 0 ||
        s.quantized_double_quant > 1 || (s.quantized_double_quant == 1 && !quant_nestable(type)))
      throw CheckpointError(where + "attributes quantized.dtype, quantized.block and quantized.double_quant hold no "
                            "valid format; the file is damaged");
  }
  // The groups' own checks first, then the checksum, then the values that build the model.
  if (!h5_has_attr(file, META_CHECKSUM))
    s.warning = where + "no metadata checksum (written by an older build): its attributes are not verified";
  else if (h5_read_attr_u64(file, META_CHECKSUM, path) != sum.value())
    throw CheckpointError(where + "the metadata (root attributes or the stored config) fail their checksum: edited "
                                  "or corrupted; use another checkpoint");
  if (s.layout != "sharded" && s.layout != "gathered")
    throw CheckpointError(where + "unknown layout '" + s.layout + "'");
  if (adapters_only != 0 && adapters_only != 1)
    throw CheckpointError(where + strprintf("attribute adapters_only=%lld is neither 0 nor 1; the file is damaged",
                                            static_cast<long long>(adapters_only)));
  if (s.adapters_only && s.adapter.type == ADAPTER_NONE)
    throw CheckpointError(where + "attribute adapters_only=1 but adapter.type=none: no adapters to hold; the file is "
                                  "damaged");
  // model_shape_defect's bounds keep a damaged file from making the reader build an absurd table.
  std::array<int64_t, 5> dims;
  for (int i = 0; i < 5; i++) dims[i] = i64(MODEL_DIMS[i]);
  std::string defect = model_shape_defect(dims[0], dims[1], dims[2], dims[3], dims[4]);
  if (defect.empty()) defect = state_defect(s);
  if (!defect.empty()) throw CheckpointError(where + "attribute " + defect + "; the file is damaged");
  ModelConfig& m = s.model;
  m.n_layer = static_cast<int>(dims[0]), m.n_embd = static_cast<int>(dims[1]);
  m.n_head = static_cast<int>(dims[2]), m.vocab_size = static_cast<int>(dims[3]);
  m.max_seq_len = static_cast<int>(dims[4]);
  const std::string arch = version >= 2 ? str(MODEL_ARCH) : "gpt2";
  if (!find_model_family(arch))
    throw CheckpointError(where + "attribute model.arch='" + arch + "' is not a model family this build knows (" +
                          model_family_names() + ")");
  m.arch = arch;
  std::array<int64_t, 3> arch_ints = model_arch_ints(m);  // a version-1 file: gpt2's own values
  if (version >= 2) {
    for (int i = 0; i < 3; i++) arch_ints[i] = i64(MODEL_ARCH_INTS[i]);
    m.rope_theta = f64(MODEL_ARCH_REALS[0]), m.norm_eps = f64(MODEL_ARCH_REALS[1]);
  }
  for (int i = 0; i < 3; i++)
    if (arch_ints[i] < 0 || arch_ints[i] > (1 << 24))
      throw CheckpointError(where + "attribute " + MODEL_ARCH_INTS[i] + " is out of range; the file is damaged");
  m.n_kv_head = static_cast<int>(arch_ints[0]), m.intermediate_size = static_cast<int>(arch_ints[1]);
  m.tie_embeddings = arch_ints[2] != 0;
  for (const MetaAttr& attr : META_ATTRS) {
    if (!attr.family_int || !has(attr.name)) continue;
    const int64_t value = i64(attr.name);
    if (value < 0 || value > (1 << 24))  // a family's own bounds follow (model_arch_defect)
      throw CheckpointError(where + "attribute " + attr.name + " is out of range; the file is damaged");
    m.*attr.family_int = static_cast<int>(value);
  }
  const int64_t guidance = has(FAMILY_GUIDANCE) ? i64(FAMILY_GUIDANCE) : 1;
  if (guidance != 0 && guidance != 1)
    throw CheckpointError(where + "attribute " + FAMILY_GUIDANCE + " is neither 0 nor 1; the file is damaged");
  m.guidance_embeds = guidance == 1;
  if (has(FAMILY_ROPE_AXES)) m.rope_axes = str(FAMILY_ROPE_AXES);
  if (has(FAMILY_ROPE_SCALING)) m.rope_scaling = str(FAMILY_ROPE_SCALING);
  if (has(FAMILY_NOPE_LAYERS)) m.nope_layers = str(FAMILY_NOPE_LAYERS);
  canonicalize(m);  // a head_dim of the usual size (saves never write one)
  defect = model_arch_defect(m);
  if (!defect.empty()) throw CheckpointError(where + "attribute " + defect + "; the file is damaged");
  return s;
}

herr_t collect_link(hid_t, const char* name, const H5L_info_t*, void* names) {
  static_cast<std::vector<std::string>*>(names)->push_back(std::string("/") + name);
  return 0;
}

// The file must hold exactly the datasets of `specs` and the groups above them: a missing dataset
// or an unknown object means a damaged file or one of another model. Collective reads only.
void check_objects(hid_t file, const std::vector<DatasetSpec>& specs, const std::string& path) {
  std::vector<std::string> found;
  h5_check(H5Lvisit(file, H5_INDEX_NAME, H5_ITER_NATIVE, collect_link, &found), path, "H5Lvisit");
  std::vector<std::string> expected;
  for (const DatasetSpec& d : specs)
    for (size_t slash = d.path.find('/', 1); slash != std::string::npos; slash = d.path.find('/', slash + 1))
      expected.push_back(d.path.substr(0, slash));
  for (const DatasetSpec& d : specs) expected.push_back(d.path);
  std::sort(found.begin(), found.end());
  std::sort(expected.begin(), expected.end());
  expected.erase(std::unique(expected.begin(), expected.end()), expected.end());
  for (const DatasetSpec& d : specs)
    if (!std::binary_search(found.begin(), found.end(), d.path))
      throw CheckpointError("checkpoint '" + path + "': dataset " + d.path + " is missing");
  for (const std::string& name : found)
    if (!std::binary_search(expected.begin(), expected.end(), name))
      throw CheckpointError("checkpoint '" + path + "': unexpected object " + name +
                            " (not part of this model's checkpoint): the file is damaged or edited");
}

// What the file holds: its quantized weights are the datasets under /quantized, each a base
// parameter of `table`, in the format of its root attributes (without them a /quantized group is
// an unexpected object to check_objects).
CheckpointContent file_content(hid_t file, const ParamTable& table, const CheckpointState& s, const std::string& path) {
  CheckpointContent c;
  c.adapters_only = s.adapters_only;
  if (s.quantized_dtype.empty()) return c;
  if (s.adapters_only)
    throw CheckpointError("checkpoint '" + path + "' holds adapters alone and quantized base weights; the file is "
                          "damaged");
  SHARD_CHECK(parse_quant_type(s.quantized_dtype, &c.quant), "quantized.dtype %s", s.quantized_dtype.c_str());
  c.block = static_cast<size_t>(s.quantized_block);
  c.nested = s.quantized_double_quant == 1;
  c.records.assign(table.params().size(), false);
  std::vector<std::string> found;
  h5_check(H5Lvisit(file, H5_INDEX_NAME, H5_ITER_NATIVE, collect_link, &found), path, "H5Lvisit");
  const std::string group = RECORDS_GROUP;
  for (const std::string& name : found) {
    if (name.rfind(group, 0) != 0) continue;
    const std::string param = name.substr(group.size());
    auto it = std::find_if(table.params().begin(), table.params().end(),
                           [&](const ParamInfo& p) { return p.name == param && !p.adapter; });
    if (it == table.params().end())
      throw CheckpointError("checkpoint '" + path + "': unexpected object " + name +
                            " (not a weight of this model's base): the file is damaged or edited");
    c.records[it->id] = true;
  }
  return c;
}

// Checks one dataset against its spec (type, shape, `numel`) and returns its dims and stored checksum.
std::pair<std::vector<hsize_t>, uint64_t> check_dataset(hid_t dataset, const DatasetSpec& d, const CheckpointState& s,
                                                        const std::string& path) {
  std::vector<hsize_t> dims = h5_dataset_dims(dataset, path);
  H5Id type(h5_check_id(H5Dget_type(dataset), path, "H5Dget_type"), H5Tclose);
  const bool has_attrs = h5_has_attr(dataset, "numel") && h5_has_attr(dataset, "checksum");
  const int64_t numel = has_attrs ? h5_read_attr_i64(dataset, "numel", path) : -1;
  // A sharded unit was padded for the rank count at save time (less than one element per rank).
  const uint64_t world = static_cast<uint64_t>(s.world_size);
  const bool records = d.tensor == TENSOR_RECORDS;
  const bool flat = s.layout == "sharded" && d.tensor < TENSOR_RECORDS;
  bool shape_ok = flat ? dims.size() == 1 && dims[0] >= d.numel && dims[0] - d.numel < world : dims == d.dims;
  std::string got;
  for (size_t i = 0; i < dims.size(); i++) got += (i ? "x" : "") + std::to_string(dims[i]);
  const std::string where = "checkpoint '" + path + "': dataset " + d.path;
  if (records && (H5Tget_class(type) != H5T_INTEGER || H5Tget_size(type) != 1))
    throw CheckpointError(where + " is not uint8 (a quantized weight's records)");
  if (!records && (H5Tget_class(type) != H5T_FLOAT || H5Tget_size(type) != 4))
    throw CheckpointError(where + " is not float32");
  if (!shape_ok) throw CheckpointError(where + " has shape " + got + ", which does not fit the model");
  if (numel != static_cast<int64_t>(d.numel))
    throw CheckpointError(where + (has_attrs ? " has numel " + std::to_string(numel) : " lacks its numel/checksum") +
                          ", expected " + std::to_string(d.numel) + (records ? " records" : " elements"));
  return {dims, h5_read_attr_u64(dataset, "checksum", path)};
}

std::string checksum_failure(const std::string& path, const std::string& dataset) {
  return "checkpoint '" + path + "': dataset " + dataset +
         " fails its checksum (corrupted data); use another checkpoint";
}

// Reads or writes flat elements [first, first + count) of a dataset (collectively when dxpl says
// so; count 0: takes part, transferring nothing).
herr_t transfer_flat(hid_t dataset, bool write, const std::vector<hsize_t>& dims, uint64_t first, uint64_t count,
                     float* data, hid_t dxpl, const std::string& path) {
  H5Id space(h5_check_id(H5Dget_space(dataset), path, "H5Dget_space"), H5Sclose);
  select_flat_range(space, dims, first, count, path);
  hsize_t mem_n = std::max<uint64_t>(count, 1);
  H5Id memspace(h5_check_id(H5Screate_simple(1, &mem_n, nullptr), path, "H5Screate_simple"), H5Sclose);
  if (count == 0) h5_check(H5Sselect_none(memspace), path, "H5Sselect_none");
  float scratch = 0;
  float* buffer = count ? data : &scratch;
  return write ? H5Dwrite(dataset, H5T_NATIVE_FLOAT, memspace, space, dxpl, buffer)
               : H5Dread(dataset, H5T_NATIVE_FLOAT, memspace, space, dxpl, buffer);
}
herr_t read_flat(hid_t dataset, const std::vector<hsize_t>& dims, uint64_t first, uint64_t count, float* out,
                 hid_t dxpl, const std::string& path) {
  return transfer_flat(dataset, false, dims, first, count, out, dxpl, path);
}

std::string folder_of(const std::string& path) {
  size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
}

double free_bytes(const std::string& folder) {
  struct statvfs fs {};
  return statvfs(folder.c_str(), &fs) == 0 ? static_cast<double>(fs.f_bavail) * fs.f_frsize : 0;
}

// Why a write failed: errno from the MPI-IO layer when it names the cause. A rank whose collective
// write failed because another rank's I/O did may see no errno: then a (nearly) full disk is the cause.
// `folder_option`: the setting that chose the folder, named in the advice.
std::string write_failure(int error, const std::string& what, const std::string& path, const char* folder_option) {
  if (error != ENOSPC && error != EDQUOT && free_bytes(folder_of(path)) < (64 << 10)) error = ENOSPC;
  const bool space = error == ENOSPC || error == EDQUOT;
  return (space ? std::string(std::strerror(error)) + ": " : std::string()) + "writing " + what + " to '" + path +
         "' failed" + (space ? "; free space in '" + folder_of(path) + "' or put " + folder_option + " on another disk"
                             : " (" + (error ? std::string(std::strerror(error)) : "I/O error") + ")");
}

bool preallocate() {
  const char* v = std::getenv("SHARDTRAIN_CHECKPOINT_PREALLOCATE");
  return !v || std::strcmp(v, "0") != 0;
}

// Rank 0 reserves the file's blocks, so that no write of the save can fail for want of space: HDF5
// cannot close a file whose metadata write failed on one rank only (the ranks then wait in
// different barriers). KEEP_SIZE: the file looks empty to HDF5. "" when reserved, or when the file
// system cannot reserve (then a failed write is still agreed on, as below).
std::string reserve_space(const std::string& path, uint64_t bytes, const char* folder_option) {
  int fd = open(path.c_str(), O_WRONLY | O_CREAT, 0644);
  if (fd < 0) return "";  // HDF5's create names the problem
  int rc = fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, static_cast<off_t>(bytes)), error = errno;
  close(fd);
  if (rc == 0 || (error != ENOSPC && error != EDQUOT)) return "";
  return std::string(std::strerror(error)) + ": checkpoint '" + path + "' needs " + human_bytes(bytes) + ", '" +
         folder_of(path) + "' has " + human_bytes(free_bytes(folder_of(path))) +
         " free; free space or put " + folder_option + " on another disk";
}

// Gives back the reserved blocks past the file's end (HDF5 left it at its real size).
void release_reserve(const std::string& path, uint64_t bytes) {
  int fd = open(path.c_str(), O_WRONLY);
  if (fd < 0) return;
  struct stat st {};
  if (fstat(fd, &st) == 0 && static_cast<uint64_t>(st.st_size) < bytes)
    fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, st.st_size, static_cast<off_t>(bytes) - st.st_size);
  close(fd);
}

// An upper bound of the file's size: the data plus generous room for HDF5's metadata (object
// headers, the attributes, the group B-trees and heaps).
uint64_t file_size_bound(const std::vector<DatasetSpec>& specs, const std::string& layout, int world,
                         const std::string& config) {
  uint64_t bytes = 64 << 10;
  for (const DatasetSpec& d : specs) {
    uint64_t n = d.tensor == TENSOR_RECORDS ? 1 : 4;
    for (hsize_t dim : file_dims(d, layout, world)) n *= dim;
    bytes += n + 2048 + 2 * d.path.size();
  }
  return bytes + 2 * config.size();
}

}  // namespace

std::string adapter_mismatch(const std::string& path, const AdapterConfig& stored, const AdapterConfig& configured) {
  std::string differences;
  auto differ = [&](const char* key, const std::string& a, const std::string& b) {
    if (a != b) differences += (differences.empty() ? "" : ", ") + std::string(key) + "=" + a + " (configured " + b + ")";
  };
  differ(ADAPTER_TYPE, adapter_type_name(stored.type), adapter_type_name(configured.type));
  if (stored.type != ADAPTER_NONE && configured.type != ADAPTER_NONE) {
    differ(ADAPTER_TARGETS, join_targets(stored.targets), join_targets(configured.targets));
    differ(ADAPTER_RANK, std::to_string(stored.rank), std::to_string(configured.rank));
    const std::array<int64_t, 6> a = adapter_method_ints(stored), b = adapter_method_ints(configured);
    if (stored.type == configured.type && stored.type == ADAPTER_LOKR)
      for (int i = 0; i < 2; i++) differ(ADAPTER_METHOD_INTS[i], std::to_string(a[i]), std::to_string(b[i]));
    if (stored.type == configured.type && stored.type == ADAPTER_OFT)
      for (int i = 2; i < 6; i++) differ(ADAPTER_METHOD_INTS[i], std::to_string(a[i]), std::to_string(b[i]));
  }
  if (differences.empty()) return "";
  return "checkpoint '" + path + "' holds other adapters: " + differences + "; set adapter.* to match" +
         (stored.type != ADAPTER_NONE && configured.type == ADAPTER_NONE
              ? ", or fold them into the model with `shardtrain export --merge`"
              : "");
}

std::string model_mismatch(const std::string& path, const ModelConfig& stored, const ModelConfig& configured) {
  std::string differences;
  auto differ = [&](const char* key, const std::string& a, const std::string& b) {
    if (a != b) differences += (differences.empty() ? "" : ", ") + std::string(key) + "=" + a + " (configured " + b + ")";
  };
  differ(MODEL_ARCH, stored.arch, configured.arch);
  auto a = model_dims(stored), b = model_dims(configured);
  const bool positions = family_of(stored).fixes_max_seq_len();  // else a bound of the run, not the model's
  for (int i = 0; i < 5; i++)
    if (i != 4 || positions) differ(MODEL_DIMS[i], std::to_string(a[i]), std::to_string(b[i]));
  auto ai = model_arch_ints(stored), bi = model_arch_ints(configured);
  for (int i = 0; i < 3; i++) differ(MODEL_ARCH_INTS[i], std::to_string(ai[i]), std::to_string(bi[i]));
  auto ar = model_arch_reals(stored), br = model_arch_reals(configured);
  for (int i = 0; i < 2; i++) differ(MODEL_ARCH_REALS[i], strprintf("%g", ar[i]), strprintf("%g", br[i]));
  for (const MetaAttr& a : META_ATTRS)
    if (a.family_int && a.compared)
      differ(a.name, std::to_string(stored.*a.family_int), std::to_string(configured.*a.family_int));
  differ(FAMILY_GUIDANCE, stored.guidance_embeds ? "true" : "false", configured.guidance_embeds ? "true" : "false");
  differ(FAMILY_ROPE_AXES, stored.rope_axes, configured.rope_axes);
  differ(FAMILY_ROPE_SCALING, stored.rope_scaling, configured.rope_scaling);
  differ(FAMILY_NOPE_LAYERS, stored.nope_layers, configured.nope_layers);
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

// This rank's share of base_model_checksum: the base elements it owns (one rank among replicas),
// each hashed at its index in the base model laid end to end -- unit by unit, each unit's base
// parameters in declaration order. unit_params(u): the rank's shard buffer of unit u, on the host.
template <typename F>
static uint64_t local_base_checksum(FsdpEngine& engine, F&& unit_params) {
  const ParamTable& table = engine.table();
  uint64_t sum = 0, at = 0;
  for (size_t u = 0; u < table.units().size(); u++) {
    const UnitLayout& layout = engine.shards()[u].layout;
    const float* values = nullptr;
    for (int id : table.units()[u].params) {
      const ParamInfo& p = table.params()[id];
      if (p.adapter) continue;
      const UnitLayout::Local own = layout.local_part(p.range(), true);
      if (!own.range.empty()) {
        if (!values) values = unit_params(u);
        sum += checksum_elements(values + own.index, own.range.size(), at + (own.range.begin - p.offset));
      }
      at += p.numel;
    }
  }
  return sum;
}

// local_base_checksum with each unit's shard brought to the host (dequantized) in turn.
static uint64_t local_base_checksum_by_unit(FsdpEngine& engine) {
  std::optional<HostShard> shard;
  return local_base_checksum(engine, [&](size_t u) -> const float* {
    shard.emplace(engine.host_shard(static_cast<int>(u)));
    return shard->data();
  });
}

uint64_t base_model_checksum(FsdpEngine& engine, Comm& comm) {
  std::vector<uint64_t> sum = {local_base_checksum_by_unit(engine)};
  sum_over_ranks(sum, comm);
  return sum[0];
}

std::string checksum_text(uint64_t checksum) {
  return strprintf("0x%016llx", static_cast<unsigned long long>(checksum));
}

std::string base_mismatch(const std::string& path, uint64_t stored, uint64_t loaded, const std::string& base_from) {
  return "checkpoint '" + path + "' holds adapters trained on another base model: its base checksum is " +
         checksum_text(stored) + ", the base loaded here (" + base_from + ") has " + checksum_text(loaded) +
         "; give the base it was trained on as checkpoint.init_from";
}

// save_checkpoint, or with optimizer null save_checkpoint_weights: the moments' datasets are then
// created but never written, and read as zeros (HDF5 writes no fill value to a dataset of the
// default fill value, and a file's unwritten bytes are zeros).
static void save_checkpoint_impl(const std::string& path, const CheckpointState& state, FsdpEngine& engine,
                                 AdamW* optimizer, const CheckpointComm& ranks) {
  H5QuietErrors quiet;
  Comm& comm = ranks.comm;
  const ParamTable& table = engine.table();
  SHARD_CHECK(!state.adapters_only || table.adapter().type != ADAPTER_NONE,
              "an adapter-only checkpoint of a run without adapters");
  const CheckpointContent content = content_of_run(table, state.adapters_only);
  CheckpointState written = state;
  written.quantized_dtype = content.quant == QUANT_NONE ? "" : quant_type_name(content.quant);
  written.quantized_block = static_cast<int64_t>(content.block);
  written.quantized_double_quant = content.nested;
  HostShards host(engine, optimizer, true);
  const std::vector<DatasetSpec> specs = dataset_specs(table, table, state.layout, content);
  std::vector<Piece> pieces = plan_pieces(specs, engine, host, true);
  // The records this rank writes: the quantized weights' blocks it owns, from its shard's records.
  std::vector<std::pair<RecordRows, const uint8_t*>> record_parts(specs.size());
  for (size_t i = 0; i < specs.size(); i++) {
    const DatasetSpec& d = specs[i];
    if (d.tensor != TENSOR_RECORDS) continue;
    const UnitLayout& layout = engine.shards()[d.unit].layout;
    const RecordRows rows = record_rows(layout, d.runs[0], content.block, true);
    record_parts[i] = {rows, rows.count ? shard_record(layout, d.runs[0].unit_begin + rows.first * content.block,
                                                      host.records(d.unit))
                                        : nullptr};
  }
  // The datasets' checksums and, last, the base model's: one all-reduce.
  std::vector<uint64_t> sums(specs.size() + 1);
  for (const Piece& p : pieces)
    sums[p.spec] += p.check_data ? checksum_elements(p.check_data, p.check_count, p.check_first)
                                 : checksum_of_zeros(p.check_count, p.check_first);
  for (size_t i = 0; i < specs.size(); i++)
    if (record_parts[i].second)
      sums[i] += records_checksum(record_parts[i].second, record_parts[i].first.count, record_parts[i].first.first,
                                  content.record_bytes());
  // The nested tables, replicated: rank 0's are written and summed.
  std::vector<std::vector<float>> nested_parts(specs.size());
  for (size_t i = 0; i < specs.size(); i++) {
    if (specs[i].tensor != TENSOR_NESTED) continue;
    nested_parts[i] = host.nested_values(engine, specs[i].param);
    if (comm.rank() == 0) sums[i] += checksum_elements(nested_parts[i].data(), nested_parts[i].size(), 0);
  }
  // The host shards lack the quantized spaces' values: the base checksum dequantizes one unit at a time.
  sums.back() = state.adapters_only || table.quant().type != QUANT_NONE
                    ? local_base_checksum_by_unit(engine)
                    : local_base_checksum(engine, [&](size_t u) -> const float* { return host.buffer(u, 0); });
  sum_over_ranks(sums, comm);
  const uint64_t base_checksum = sums.back();
  sums.pop_back();
  const bool reserve = comm.rank() == 0 && preallocate();
  const uint64_t bytes = file_size_bound(specs, state.layout, comm.size(), state.config_ini);

  // Every phase runs on all ranks or on none, and ends agreeing on its outcome: a rank that failed
  // (often alone: a write error may reach only the rank that did the I/O) never skips a collective
  // that the others enter. The watchdog times each phase's HDF5 collectives as one (`what`), or
  // each write on its own (what == nullptr).
  std::string error = agreed_error(reserve ? reserve_space(path, bytes, ranks.folder_option) : "", comm);
  auto phase = [&](const char* what, auto&& body) {
    if (!error.empty()) return;
    try {
      Watchdog::Scope scope(what ? ranks.watchdog : nullptr, what);
      body();
    } catch (const CheckpointError& e) {
      error = e.what();
    }
    error = agreed_error(error, comm);
  };
  H5Id file, lcpl, dxpl;
  std::vector<H5Id> datasets, groups;
  phase("checkpoint save: H5Fcreate", [&] {
    file = open_parallel(path, ranks.file_comm, true);
    if (reserve) {  // H5Fcreate truncated the file: reserve again
      std::string e = reserve_space(path, bytes, ranks.folder_option);
      if (!e.empty()) throw CheckpointError(e);
    }
  });
  // All metadata first, written while the file is small; then the data; so the final close has
  // (almost) nothing left to write.
  phase("checkpoint save: metadata", [&] {
    write_state(file, written, table.config(), table.adapter(), base_checksum, path);
    lcpl = H5Id(h5_check_id(H5Pcreate(H5P_LINK_CREATE), path, "H5Pcreate"), H5Pclose);
    h5_check(H5Pset_create_intermediate_group(lcpl, 1), path, "H5Pset_create_intermediate_group");
    for (size_t i = 0; i < specs.size(); i++) {
      const DatasetSpec& d = specs[i];
      const std::vector<hsize_t> dims = file_dims(d, state.layout, comm.size());
      H5Id space(
          h5_check_id(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), path, "H5Screate_simple"),
          H5Sclose);
      const hid_t type = d.tensor == TENSOR_RECORDS ? H5T_STD_U8LE : H5T_IEEE_F32LE;
      datasets.emplace_back(
          h5_check_id(H5Dcreate2(file, d.path.c_str(), type, space, lcpl, H5P_DEFAULT, H5P_DEFAULT), path, "H5Dcreate2"),
          H5Dclose);
      h5_write_attr_u64(datasets.back(), "checksum", sums[i], path);
      h5_write_attr_i64(datasets.back(), "numel", static_cast<int64_t>(d.numel), path);
    }
    if (state.layout == "sharded") {
      for (size_t i = 0; i < specs.size(); i++) {
        if (specs[i].tensor != 0) continue;  // one index per unit that has datasets
        const size_t u = specs[i].unit;
        groups.emplace_back(h5_check_id(H5Gopen2(file, ("/shards/" + table.units()[u].name).c_str(), H5P_DEFAULT),
                                        path, "H5Gopen2"), H5Gclose);
        h5_write_attr_str(groups.back(), "index", unit_index(table, u, content), path);
      }
    }
  });
  phase("checkpoint save: H5Fflush(metadata)",
        [&] { h5_check(H5Fflush(file, H5F_SCOPE_GLOBAL), path, "H5Fflush(metadata)"); });
  phase(nullptr, [&] {
    dxpl = collective_transfer(path);
    std::string local;
    for (const Piece& p : pieces) {
      const DatasetSpec& d = specs[p.spec];
      if (is_moment(d) && !optimizer) continue;  // the same on every rank: no collective is skipped by one alone
      // A failure may be this rank's alone: note it and go on taking part in the collective writes.
      errno = 0;
      Watchdog::Scope scope(ranks.watchdog, "checkpoint save: H5Dwrite");
      if (transfer_flat(datasets[p.spec], true, file_dims(d, state.layout, comm.size()), p.first, p.count, p.data, dxpl,
                        path) < 0 && local.empty())
        local = write_failure(errno, d.path, path, ranks.folder_option);
    }
    for (size_t i = 0; i < specs.size(); i++) {
      if (specs[i].tensor < TENSOR_RECORDS) continue;
      errno = 0;
      Watchdog::Scope scope(ranks.watchdog, "checkpoint save: H5Dwrite");
      const bool failed =
          specs[i].tensor == TENSOR_RECORDS
              ? transfer_rows(datasets[i], true, record_parts[i].first, content.record_bytes(),
                              const_cast<uint8_t*>(record_parts[i].second), dxpl, path) < 0
              : transfer_flat(datasets[i], true, specs[i].dims, 0, comm.rank() == 0 ? specs[i].numel : 0,
                              nested_parts[i].data(), dxpl, path) < 0;  // the same on every rank: rank 0's
      if (failed && local.empty()) local = write_failure(errno, specs[i].path, path, ranks.folder_option);
    }
    if (!local.empty()) throw CheckpointError(local);
  });
  phase("checkpoint save: H5Fflush(data)", [&] {
    errno = 0;
    if (H5Fflush(file, H5F_SCOPE_GLOBAL) < 0) throw CheckpointError(write_failure(errno, "the data", path, ranks.folder_option));
  });
  if (!error.empty() && comm.rank() == 0 && file >= 0) {
    // The file is discarded: free its space now, so that closing it cannot fail for want of it.
    [[maybe_unused]] int rc = truncate(path.c_str(), 0);
  }
  comm.barrier("barrier(checkpoint close)");
  if (file >= 0) {
    Watchdog::Scope scope(ranks.watchdog, "checkpoint save: H5Fclose");
    datasets.clear(), groups.clear(), lcpl.reset(), dxpl.reset();
    errno = 0;
    std::string closing = H5Fclose(file.release()) < 0 ? write_failure(errno, "the metadata", path, ranks.folder_option) : "";
    closing = agreed_error(closing, comm);
    if (error.empty()) error = closing;
  }
  if (!error.empty()) throw CheckpointError(error);
  if (reserve) release_reserve(path, bytes);
}

void save_checkpoint(const std::string& path, const CheckpointState& state, FsdpEngine& engine, AdamW& optimizer,
                     const CheckpointComm& ranks) {
  save_checkpoint_impl(path, state, engine, &optimizer, ranks);
}

void save_checkpoint_weights(const std::string& path, const CheckpointState& state, FsdpEngine& engine,
                             const CheckpointComm& ranks) {
  SHARD_CHECK(state.step == 0, "a weights-only checkpoint at step %lld: its zero moments are a fresh optimizer's only",
              static_cast<long long>(state.step));
  save_checkpoint_impl(path, state, engine, nullptr, ranks);
}

// load_checkpoint, or with optimizer null load_checkpoint_weights: the moments' datasets are
// checked (type, shape, numel) but not read, so their checksums are not verified.
static CheckpointState load_checkpoint_impl(const std::string& path, FsdpEngine& engine, AdamW* optimizer,
                                            const CheckpointComm& ranks, bool base_model_ok) {
  H5QuietErrors quiet;
  Comm& comm = ranks.comm;
  const ParamTable& table = engine.table();
  H5Id file;
  CheckpointState state;
  std::vector<DatasetSpec> specs;
  std::unique_ptr<ParamTable> file_table;
  CheckpointContent content;
  {
    Watchdog::Scope scope(ranks.watchdog, "checkpoint load: H5Fopen and metadata");
    file = open_parallel(path, ranks.file_comm, false);
    state = read_state(file, path);
    std::string mismatch = model_mismatch(path, state.model, table.config());
    // A base model under adapters: its parameters, the adapters keep theirs.
    const bool base_only = state.adapter.type == ADAPTER_NONE && table.adapter().type != ADAPTER_NONE && base_model_ok;
    if (mismatch.empty() && !base_only) mismatch = adapter_mismatch(path, state.adapter, table.adapter());
    if (!mismatch.empty()) throw CheckpointError(mismatch);
    if (state.adapters_only && base_model_ok)
      throw CheckpointError("checkpoint '" + path + "' holds adapters alone (checkpoint.adapters_only), no base model "
                            "to start from: give the base model as checkpoint.init_from, and this file as "
                            "checkpoint.resume");
    if (comm.rank() == 0 && !state.warning.empty()) std::fprintf(stderr, "warning: %s\n", state.warning.c_str());
    // Metadata reads are collective (rank 0 reads and broadcasts): these verdicts are the same on
    // every rank without an agreement.
    file_table = std::make_unique<ParamTable>(state.model, std::vector<std::string>{}, state.adapter);
    content = file_content(file, *file_table, state, path);
    specs = dataset_specs(*file_table, table, state.layout, content);
    check_objects(file, specs, path);
  }
  if (state.adapters_only) {  // the adapters go onto the base the engine holds: it must be theirs
    const uint64_t base = base_model_checksum(engine, comm);
    if (base != state.base_checksum)  // (training checks this first, naming checkpoint.init_from)
      throw CheckpointError("checkpoint '" + path + "' holds adapters alone (checkpoint.adapters_only), for the base "
                            "model of checksum " + checksum_text(state.base_checksum) + ", not the model here (" +
                            checksum_text(base) + "): a training run resumes it with that base as "
                            "checkpoint.init_from; export --adapter writes its adapters");
  }

  // Shards are overwritten entirely -- padding and the parts outside the file stay zero -- unless
  // the file lacks some (the adapters of a base-only load, the base of an adapter-only one), which
  // keep their values.
  HostShards host(engine, optimizer, false);
  if (!state.adapters_only && file_table->params().size() == table.params().size()) host.zero();
  std::vector<Piece> pieces = plan_pieces(specs, engine, host, false);
  std::vector<uint64_t> stored(specs.size()), computed(specs.size());
  std::vector<std::vector<float>> nested_of(table.params().size());  // by parameter: the file's nested tables
  std::string local_error;
  H5Id dxpl = collective_transfer(path);
  size_t next = 0;  // pieces are in the order of their datasets
  for (size_t i = 0; i < specs.size(); i++) {
    Watchdog::Scope scope(ranks.watchdog, "checkpoint load: H5Dread");
    H5Id dataset(h5_check_id(H5Dopen2(file, specs[i].path.c_str(), H5P_DEFAULT), path, "H5Dopen2"), H5Dclose);
    auto [dims, checksum] = check_dataset(dataset, specs[i], state, path);
    stored[i] = checksum;
    if (specs[i].tensor == TENSOR_NESTED) {  // all of it on every rank, summed on rank 0
      std::vector<float>& values = nested_of[specs[i].param];
      values.resize(specs[i].numel);
      if (read_flat(dataset, dims, 0, values.size(), values.data(), dxpl, path) < 0 && local_error.empty())
        local_error = "checkpoint '" + path + "': reading " + specs[i].path + " failed (damaged data)";
      if (comm.rank() == 0) computed[i] += checksum_elements(values.data(), values.size(), 0);
      continue;
    }
    if (specs[i].tensor == TENSOR_RECORDS) {
      // The blocks covering this rank's part of the weight, dequantized into its host shard.
      const DatasetSpec& d = specs[i];
      const UnitLayout& layout = engine.shards()[d.unit].layout;
      const DatasetRun& run = d.runs[0];
      const size_t block = content.block, bytes = content.record_bytes();
      const RecordRows rows = record_rows(layout, run, block, false), owned = record_rows(layout, run, block, true);
      std::vector<uint8_t> records(rows.count * bytes);
      if (transfer_rows(dataset, false, rows, bytes, records.data(), dxpl, path) < 0 && local_error.empty())
        local_error = "checkpoint '" + path + "': reading " + d.path + " failed (damaged data)";
      if (owned.count)
        computed[i] += records_checksum(records.data() + (owned.first - rows.first) * bytes, owned.count, owned.first, bytes);
      const UnitLayout::Local part = layout.local_part({run.unit_begin, run.unit_begin + run.numel}, false);
      if (part.range.empty()) continue;
      float* out = host.at(d.unit, 0, layout, layout.space_of(run.unit_begin), part.index);
      const std::vector<uint8_t> table =
          content.nested ? lone_weight_nested_table(nested_of[d.param], d.numel) : std::vector<uint8_t>{};
      const NestedScales nested = content.nested ? nested_scales(table.data(), 1, rows.first) : NestedScales{};
      for (size_t x = part.range.begin; x < part.range.end; x++) {
        const size_t e = x - run.unit_begin;
        const uint8_t* record = records.data() + (e / block - rows.first) * bytes;
        const float scale = record_scale(content.quant, record, block, nested, e / block - rows.first);
        out[x - part.range.begin] = dequantize_code(content.quant, record, e % block, scale);
      }
      continue;
    }
    const bool skip = is_moment(specs[i]) && !optimizer;  // the same on every rank
    for (; next < pieces.size() && pieces[next].spec == i; next++) {
      if (skip) continue;
      const Piece& p = pieces[next];
      // A failure here may be this rank's alone (a damaged block only it reads): note it and keep
      // taking part in the collective reads, so that no rank waits for one that has left. The
      // checksum is taken at once: frozen moments share one scratch buffer.
      if (read_flat(dataset, dims, p.first, p.count, p.data, dxpl, path) < 0 && local_error.empty())
        local_error = "checkpoint '" + path + "': reading " + specs[i].path + " failed (damaged data)";
      computed[i] += checksum_elements(p.check_data, p.check_count, p.check_first);
    }
  }
  std::string error = agreed_error(local_error, comm);
  if (!error.empty()) throw CheckpointError(error);
  sum_over_ranks(computed, comm);
  for (size_t i = 0; i < specs.size(); i++)
    if (computed[i] != stored[i] && (optimizer || !is_moment(specs[i])))
      throw CheckpointError(checksum_failure(path, specs[i].path));
  {
    Watchdog::Scope scope(ranks.watchdog, "checkpoint load: H5Fclose");
    dxpl.reset(), file.reset();
  }
  // A run that double-quantizes as the file did codes the file's absmax under the file's offsets
  // and group scales: it holds the values it saved (a resume is exact).
  std::vector<std::vector<std::vector<float>>> given(engine.shards().size());
  const bool same = table.quant().nested && content.nested && table.quant().type == content.quant &&
                    table.quant().block == content.block;
  for (size_t u = 0; u < given.size() && same; u++)
    for (int id : table.units()[u].params)
      if (table.params()[id].quantized) given[u].push_back(nested_of[id]);
  host.upload(!state.adapters_only, same ? &given : nullptr);
  return state;
}

CheckpointState load_checkpoint(const std::string& path, FsdpEngine& engine, AdamW& optimizer,
                                const CheckpointComm& ranks, bool base_model_ok) {
  return load_checkpoint_impl(path, engine, &optimizer, ranks, base_model_ok);
}

CheckpointState load_checkpoint_weights(const std::string& path, FsdpEngine& engine, const CheckpointComm& ranks,
                                        bool base_model_ok) {
  return load_checkpoint_impl(path, engine, nullptr, ranks, base_model_ok);
}

static H5Id open_serial(const std::string& path) {
  H5Id fapl(h5_check_id(H5Pcreate(H5P_FILE_ACCESS), path, "H5Pcreate"), H5Pclose);
  h5_check(H5Pset_file_locking(fapl, false, true), path, "H5Pset_file_locking");
  hid_t id = H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl);
  if (id < 0)
    throw CheckpointError("checkpoint '" + path + "': cannot open as HDF5 (missing, truncated or not a checkpoint)");
  return H5Id(id, H5Fclose);
}

bool is_hdf5_file(const std::string& path) {
  static const char SIGNATURE[8] = {'\x89', 'H', 'D', 'F', '\r', '\n', '\x1a', '\n'};
  char head[8] = {};
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return false;
  const bool ok = std::fread(head, 1, sizeof head, f) == sizeof head && std::memcmp(head, SIGNATURE, 8) == 0;
  std::fclose(f);
  return ok;
}

CheckpointState read_checkpoint_state(const std::string& path) {
  H5QuietErrors quiet;
  H5Id file = open_serial(path);
  return read_state(file, path);
}

CheckpointReader::CheckpointReader(const std::string& path) : path_(path) {
  H5QuietErrors quiet;
  H5Id file = open_serial(path);
  state_ = read_state(file, path);
  table_ = std::make_unique<ParamTable>(state_.model, std::vector<std::string>{}, state_.adapter);
  content_ = file_content(file, *table_, state_, path);
  std::vector<DatasetSpec> specs = dataset_specs(*table_, *table_, state_.layout, content_);
  check_objects(file, specs, path);
  std::vector<float> chunk;
  std::vector<uint8_t> records;
  for (const DatasetSpec& d : specs) {
    H5Id dataset(h5_check_id(H5Dopen2(file, d.path.c_str(), H5P_DEFAULT), path, "H5Dopen2"), H5Dclose);
    auto [dims, stored] = check_dataset(dataset, d, state_, path);
    uint64_t sum = 0;
    if (d.tensor == TENSOR_RECORDS) {
      const size_t bytes = content_.record_bytes();
      const uint64_t step = std::max<uint64_t>(1, (16u << 20) / bytes);
      for (uint64_t first = 0; first < d.numel; first += step) {
        const RecordRows rows{first, std::min(step, d.numel - first)};
        records.resize(rows.count * bytes);
        h5_check(transfer_rows(dataset, false, rows, bytes, records.data(), H5P_DEFAULT, path), path,
                 ("reading " + d.path).c_str());
        sum += records_checksum(records.data(), rows.count, rows.first, bytes);
      }
      if (sum != stored) throw CheckpointError(checksum_failure(path, d.path));
      continue;
    }
    const uint64_t step = 1 << 22;  // 16 MiB at a time
    for (uint64_t first = 0; first < d.numel; first += step) {
      const uint64_t n = std::min(step, d.numel - first);
      chunk.resize(n);
      h5_check(read_flat(dataset, dims, first, n, chunk.data(), H5P_DEFAULT, path), path,
               ("reading " + d.path).c_str());
      sum += checksum_elements(chunk.data(), n, first);
    }
    if (sum != stored) throw CheckpointError(checksum_failure(path, d.path));
  }
  file_ = H5Freopen(file);
  h5_check_id(file_, path, "H5Freopen");
}

CheckpointReader::~CheckpointReader() {
  if (file_ >= 0) H5Fclose(file_);
}

std::string CheckpointReader::dataset_path(const ParamInfo& param, const std::string& unit_name, Tensor tensor) const {
  if (content_.in_records(table_->params()[param.id])) return RECORDS_GROUP + param.name;
  return dataset_name(state_.layout, unit_name, param.name, tensor);
}

bool CheckpointReader::holds(const ParamInfo& param) const {
  SHARD_CHECK(param.id >= 0 && static_cast<size_t>(param.id) < table_->params().size() &&
                  table_->params()[param.id].name == param.name,
              "parameter %s is not checkpoint '%s''s", param.name.c_str(), path_.c_str());
  return content_.holds(table_->params()[param.id]);
}

std::vector<float> CheckpointReader::nested_table(const ParamInfo& param) const {
  H5QuietErrors quiet;
  if (!content_.nested || !content_.in_records(table_->params()[param.id])) return {};
  const std::string name = NESTED_GROUP + param.name;
  H5Id d(h5_check_id(H5Dopen2(file_, name.c_str(), H5P_DEFAULT), path_, "H5Dopen2"), H5Dclose);
  std::vector<float> stored(1 + content_.groups(param));
  h5_check(read_flat(d, {stored.size()}, 0, stored.size(), stored.data(), H5P_DEFAULT, path_), path_,
           ("reading " + name).c_str());
  return stored;
}

std::vector<float> CheckpointReader::read(const ParamInfo& param, const std::string& unit_name, Tensor tensor) const {
  H5QuietErrors quiet;
  if (!holds(param))
    throw CheckpointError("checkpoint '" + path_ + "' holds adapters alone (checkpoint.adapters_only), not " +
                          param.name + " of the base model");
  const std::string where = dataset_path(param, unit_name, tensor);
  if (content_.in_records(table_->params()[param.id])) {
    std::vector<float> values(param.numel, 0.0f);  // a quantized weight has no moments
    if (tensor != TENSOR_PARAMS) return values;
    H5Id dataset(h5_check_id(H5Dopen2(file_, where.c_str(), H5P_DEFAULT), path_, "H5Dopen2"), H5Dclose);
    const size_t block = content_.block, bytes = content_.record_bytes();
    std::vector<uint8_t> records(content_.blocks(param) * bytes);
    h5_check(transfer_rows(dataset, false, {0, content_.blocks(param)}, bytes, records.data(), H5P_DEFAULT, path_),
             path_, ("reading " + where).c_str());
    const std::vector<uint8_t> table =
        content_.nested ? lone_weight_nested_table(nested_table(param), content_.blocks(param)) : std::vector<uint8_t>{};
    const NestedScales nested = content_.nested ? nested_scales(table.data(), 1) : NestedScales{};
    for (size_t e = 0; e < param.numel; e++) {
      const uint8_t* record = records.data() + e / block * bytes;
      values[e] = dequantize_code(content_.quant, record, e % block,
                                  record_scale(content_.quant, record, block, nested, e / block));
    }
    return values;
  }
  H5Id dataset(h5_check_id(H5Dopen2(file_, where.c_str(), H5P_DEFAULT), path_, "H5Dopen2"), H5Dclose);
  // Gathered: the whole dataset; sharded: the parameter's run of the unit's flat buffer (the
  // constructor checked both shapes).
  const uint64_t first =
      state_.layout == "sharded" ? stored_offset(*table_, table_->params()[param.id], content_) : 0;
  std::vector<float> values(param.numel);
  h5_check(read_flat(dataset, h5_dataset_dims(dataset, path_), first, param.numel, values.data(), H5P_DEFAULT, path_),
           path_, ("reading " + where).c_str());
  return values;
}

}  // namespace shardtrain
