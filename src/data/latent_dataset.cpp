// See latent_dataset.hpp. Each rank reads the records of its own micro-batches with serial HDF5
// (one hyperslab per tensor and record); files stay open for the run.
#include "data/latent_dataset.hpp"

#include <hdf5.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <tuple>

#include "ckpt/h5.hpp"
#include "core/counted.hpp"
#include "core/error.hpp"
#include "core/format.hpp"
#include "core/random.hpp"
#include "data/dataset.hpp"
#include "model/families/flux/flux_family.hpp"

namespace shardtrain {

struct LatentDataset::File {
  std::string path;
  uint64_t bytes = 0, records = 0;
  H5Id file, latents, text, pooled, condition;  // condition: Kontext's (model.condition_len > 0)
  H5Id captions;                                // with a text encoder, in place of text and pooled
};

std::vector<PackedGrid> packed_grids(hid_t file, const std::string& path, const std::string& where, const char* prefix,
                                     int tokens, const char* what) {
  std::vector<int64_t> grid[2];
  const std::string names[2] = {std::string(prefix) + "grid_rows", std::string(prefix) + "grid_cols"};
  for (int k = 0; k < 2; k++) {
    if (!h5_has_attr(file, names[k].c_str()))
      throw DataError(where + " has no attribute '" + names[k] + "' (the packed " + what + " grid's size)");
    grid[k] = h5_read_attr_i64s(file, names[k].c_str(), path);
  }
  if (grid[0].empty() || grid[0].size() != grid[1].size())
    throw DataError(strprintf("%s: %s holds %zu values, %s %zu: one (rows, cols) pair per image", where.c_str(),
                              names[0].c_str(), grid[0].size(), names[1].c_str(), grid[1].size()));
  std::vector<PackedGrid> grids;
  int64_t total = 0;
  std::string listed;
  for (size_t i = 0; i < grid[0].size(); i++) {
    const int64_t rows = grid[0][i], cols = grid[1][i];
    if (rows < 1 || cols < 1 || rows > (1 << 15) || cols > (1 << 15))
      throw DataError(strprintf("%s: %s x %s = %lld x %lld is no grid", where.c_str(), names[0].c_str(),
                                names[1].c_str(), static_cast<long long>(rows), static_cast<long long>(cols)));
    grids.push_back({static_cast<int>(rows), static_cast<int>(cols)});
    total += rows * cols;
    listed += strprintf("%s%lld x %lld", i ? " + " : "", static_cast<long long>(rows), static_cast<long long>(cols));
  }
  if (total != tokens)
    throw DataError(strprintf("%s: %s x %s = %s is not the %d tokens of its %s", where.c_str(), names[0].c_str(),
                              names[1].c_str(), listed.c_str(), tokens, what));
  return grids;
}

std::vector<PackedGrid> packed_condition_grids(hid_t file, const std::string& path, const std::string& where,
                                               const ModelConfig& model, int tokens) {
  std::vector<PackedGrid> grids = packed_grids(file, path, where, "condition_", tokens, "condition latents");
  check_condition_image_count(model, grids.size(), where);
  return grids;
}

int packed_grid_cols(hid_t file, const std::string& path, const std::string& where, int tokens) {
  const std::vector<PackedGrid> grids = packed_grids(file, path, where, "", tokens, "latents");
  if (grids.size() != 1)
    throw DataError(strprintf("%s: grid_rows and grid_cols name %zu grids; the target latents are one image",
                              where.c_str(), grids.size()));
  return grids[0].cols;
}

LatentDataset::LatentDataset(const std::string& option, const std::string& value, const ModelConfig& model,
                             int image_tokens, uint64_t seed, const FlowOptions& flow,
                             std::shared_ptr<const CaptionTokenizer> captions)
    : option_(option), value_(value), model_(model), N_(image_tokens), seed_(seed), flow_(flow),
      captions_(std::move(captions)) {
  H5QuietErrors quiet;
  first_record_.push_back(0);
  // The tensors of a record: the dataset's name, its shape after the record axis, where File keeps it.
  struct Field {
    const char* name;
    std::vector<hsize_t> shape;
    H5Id File::*set;
  };
  std::vector<Field> fields = {{"latents", {hsize_t(N_), hsize_t(model.in_channels)}, &File::latents}};
  if (!captions_) {
    fields.push_back(
        {"encoder_hidden_states", {hsize_t(model.context_len), hsize_t(model.context_dim)}, &File::text});
    if (model.pooled_dim > 0)  // FLUX.2 reads none
      fields.push_back({"pooled_projections", {hsize_t(model.pooled_dim)}, &File::pooled});
  }
  if (model.condition_len > 0)
    fields.push_back(
        {"condition_latents", {hsize_t(model.condition_len), hsize_t(model.in_channels)}, &File::condition});
  for (const std::string& path : expand_data_files(option, value)) {
    auto f = std::make_unique<File>();
    f->path = path;
    const std::string where = option + ": '" + path + "'";
    std::error_code ec;
    f->bytes = std::filesystem::file_size(path, ec);
    if (ec) throw DataError(where + ": cannot read it (" + ec.message() + ")");
    f->file = H5Id(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
    if (f->file.get() < 0)
      throw DataError(where + " is not an HDF5 file of latents (tools/encode_images.py writes them; docs/flux.md)");
    for (size_t i = 0; i < fields.size(); i++) {
      const Field& field = fields[i];
      H5Id* set = &((*f).*field.set);
      if (H5Lexists(f->file, field.name, H5P_DEFAULT) <= 0)
        throw DataError(where + " has no dataset '" + field.name + "' (docs/flux.md lists a latent file's datasets)");
      *set = H5Id(H5Dopen2(f->file, field.name, H5P_DEFAULT), H5Dclose);
      if (set->get() < 0) throw DataError(where + ": cannot open its dataset '" + field.name + "'");
      H5Id type(H5Dget_type(*set), H5Tclose);
      if (type.get() < 0 || H5Tget_class(type) != H5T_FLOAT || H5Tget_size(type) != 4)
        throw DataError(where + ": dataset '" + field.name + "' is not float32; write it as float32");
      H5Id space(H5Dget_space(*set), H5Sclose);
      const int rank = space.get() < 0 ? -1 : H5Sget_simple_extent_ndims(space);
      std::vector<hsize_t> dims(std::max(rank, 0));
      if (rank > 0) H5Sget_simple_extent_dims(space, dims.data(), nullptr);
      std::vector<hsize_t> expected = {dims.empty() ? 0 : dims[0]};
      expected.insert(expected.end(), field.shape.begin(), field.shape.end());
      if (rank < 1 || dims != expected) {
        std::string got, want;
        for (hsize_t d : dims) got += (got.empty() ? "" : ", ") + std::to_string(d);
        for (size_t k = 1; k < expected.size(); k++) want += ", " + std::to_string(expected[k]);
        throw DataError(strprintf("%s: dataset '%s' has shape (%s), the model and train.seq_len=%d take (records%s): "
                                  "encode the images at the model's shape (model.in_channels, model.context_len, "
                                  "model.context_dim, model.pooled_dim, model.condition_len) and set train.seq_len to "
                                  "the image tokens",
                                  where.c_str(), field.name, got.c_str(), N_, want.c_str()));
      }
      if (i == 0) f->records = dims[0];
      if (dims[0] != f->records)
        throw DataError(strprintf("%s: dataset '%s' holds %llu records, 'latents' %llu: every dataset holds one per "
                                  "record",
                                  where.c_str(), field.name, static_cast<unsigned long long>(dims[0]),
                                  static_cast<unsigned long long>(f->records)));
    }
    if (captions_) {
      if (H5Lexists(f->file, "captions", H5P_DEFAULT) <= 0)
        throw DataError(where + " has no dataset 'captions' (the text encoder in the job, text_encoder.source, reads "
                                "each record's caption): write the captions, or train on cached embeddings without "
                                "text_encoder.source");
      f->captions = H5Id(H5Dopen2(f->file, "captions", H5P_DEFAULT), H5Dclose);
      const std::string set_where = where + ": dataset 'captions'";
      if (f->captions.get() < 0) throw DataError(set_where + " cannot be opened");
      h5_read_strings(f->captions, 0, 0, set_where);  // a dataset of strings
      const std::vector<hsize_t> dims = h5_dataset_dims(f->captions, path);
      if (dims.size() != 1 || dims[0] != f->records)
        throw DataError(strprintf("%s holds %llu captions, 'latents' %llu records: one caption per record",
                                  set_where.c_str(), static_cast<unsigned long long>(dims.empty() ? 0 : dims[0]),
                                  static_cast<unsigned long long>(f->records)));
    }
    // The packed grids (the position ids): the target's, and Kontext's condition image's.
    const int cols = packed_grid_cols(f->file, path, where, N_);
    // Pixel patches or VAE latents: the model must be trained on what the file holds.
    const int64_t patch = h5_has_attr(f->file, "pixel_patch") ? h5_read_attr_i64(f->file, "pixel_patch", path) : 0;
    if (patch != model.pixel_patch)
      throw DataError(patch > 0 ? strprintf("%s holds images as %lldx%lld pixel patches, the model takes VAE latents: "
                                            "set model.pixel_patch=%lld (a pixel-space model)",
                                            where.c_str(), static_cast<long long>(patch), static_cast<long long>(patch),
                                            static_cast<long long>(patch))
                                : strprintf("%s holds VAE latents, the model is pixel-space (model.pixel_patch=%d): give "
                                            "a file of pixel patches (shardtrain data synth-images) or set "
                                            "model.pixel_patch=0",
                                            where.c_str(), model.pixel_patch));
    const std::vector<PackedGrid> conditions =
        model.condition_len > 0 ? packed_condition_grids(f->file, path, where, model, model.condition_len)
                                : std::vector<PackedGrid>{};
    if (grid_cols_ && (cols != grid_cols_ || conditions != condition_grids_))
      throw DataError(strprintf("%s: its packed grids (the target's %d tokens wide, the condition images') differ "
                                "from the first file's: one run trains one image size (encode the images at one "
                                "resolution)",
                                where.c_str(), cols));
    grid_cols_ = cols, condition_grids_ = conditions;
    first_record_.push_back(first_record_.back() + f->records);
    files_.push_back(std::move(f));
  }
}

LatentDataset::~LatentDataset() {
  H5QuietErrors quiet;
  files_.clear();
}

void LatentDataset::begin(Batch& b, int rows) const {
  const int IN = model_.in_channels, L = model_.context_len, M = model_.condition_len;
  b.put<float>(FLUX_HIDDEN_STATES, {rows, N_ + M, IN});
  b.put<float>(FLUX_TARGET, {rows, N_, IN});
  b.put<float>(FLUX_ENCODER_HIDDEN_STATES, {rows, L, model_.context_dim});
  b.put<float>(FLUX_POOLED, {rows, model_.pooled_dim});
  if (captions_) {  // the text encoder fills the two above from these
    b.put<int32_t>(FLUX_CAPTION_IDS, {rows, L});
    b.put<int32_t>(FLUX_CAPTION_LENGTHS, {rows});
  }
  b.put<float>(FLUX_TIMESTEP, {rows});
  b.put<float>(FLUX_GUIDANCE, {rows});
  const int A = flux_id_axes(model_);
  fill_flux_ids(model_, b.put<float>(FLUX_IMG_IDS, {N_ + M, A}), b.put<float>(FLUX_TXT_IDS, {L, A}), N_, grid_cols_,
                condition_grids_);
}

void LatentDataset::read(const File& f, hid_t set, const char* name, uint64_t local, float* dst, size_t numel) const {
  H5Id space(H5Dget_space(set), H5Sclose);
  const int rank = H5Sget_simple_extent_ndims(space);
  std::vector<hsize_t> start(rank, 0), count(rank);
  H5Sget_simple_extent_dims(space, count.data(), nullptr);
  start[0] = local, count[0] = 1;
  H5Id memory(H5Screate_simple(1, std::vector<hsize_t>{numel}.data(), nullptr), H5Sclose);
  if (H5Sselect_hyperslab(space, H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr) < 0 ||
      H5Dread(set, H5T_NATIVE_FLOAT, memory, space, H5P_DEFAULT, dst) < 0)
    throw DataError(strprintf("%s: '%s': cannot read record %llu of dataset '%s'; the file is damaged",
                              option_.c_str(), f.path.c_str(), static_cast<unsigned long long>(local), name));
}

void LatentDataset::fill(Batch& b, int row, uint64_t record, uint64_t sample, bool validation) const {
  H5QuietErrors quiet;
  const size_t file = std::upper_bound(first_record_.begin(), first_record_.end(), record) - first_record_.begin() - 1;
  const File& f = *files_[file];
  const uint64_t local = record - first_record_[file];
  const int IN = model_.in_channels, L = model_.context_len, M = model_.condition_len;
  const size_t image = static_cast<size_t>(N_) * IN, all = static_cast<size_t>(N_ + M) * IN;
  const std::vector<int64_t>& shape = b.shape(FLUX_HIDDEN_STATES);
  const size_t rows = static_cast<size_t>(shape[0]);
  float* hidden = b.at<float>(FLUX_HIDDEN_STATES, rows * all) + row * all;
  float* target = b.at<float>(FLUX_TARGET, rows * image) + row * image;
  float* text = b.at<float>(FLUX_ENCODER_HIDDEN_STATES, rows * L * model_.context_dim) +
                static_cast<size_t>(row) * L * model_.context_dim;
  float* pooled = b.at<float>(FLUX_POOLED, rows * model_.pooled_dim) + static_cast<size_t>(row) * model_.pooled_dim;
  read(f, f.latents, "latents", local, hidden, image);
  if (!captions_) {
    read(f, f.text, "encoder_hidden_states", local, text, static_cast<size_t>(L) * model_.context_dim);
    if (model_.pooled_dim > 0) read(f, f.pooled, "pooled_projections", local, pooled, model_.pooled_dim);
  }
  if (M > 0) read(f, f.condition, "condition_latents", local, hidden + image, static_cast<size_t>(M) * IN);  // clean
  // The flow-matching sample: x_sigma = (1 - sigma) x0 + sigma e, target e - x0 (fp32, as trainers do).
  const uint64_t key = flow_sample_key(seed_, sample, validation), noise = flow_noise_key(key);
  const float sigma = static_cast<float>(draw_sigma(flow_, key, N_, sample, validation));
  for (size_t i = 0; i < image; i++) {
    const float x0 = hidden[i], e = static_cast<float>(counter_normal(noise, i));
    hidden[i] = (1.0f - sigma) * x0 + sigma * e;
    target[i] = e - x0;
  }
  // Caption dropout: the empty caption, which classifier-free guidance samples against -- zeros, or
  // with a text encoder what it makes of "".
  const bool dropped = !validation && flow_.caption_dropout > 0 &&
                       counter_uniform(key, FLOW_CAPTION_DROPOUT_COUNTER) < flow_.caption_dropout;
  if (captions_) {
    const std::string where = strprintf("%s: '%s': caption %llu", option_.c_str(), f.path.c_str(),
                                        static_cast<unsigned long long>(local));
    const std::string caption = dropped ? "" : h5_read_strings(f.captions, local, 1, where)[0];
    b.at<int32_t>(FLUX_CAPTION_LENGTHS, rows)[row] =
        captions_->tokenize(caption, b.at<int32_t>(FLUX_CAPTION_IDS, rows * L) + static_cast<size_t>(row) * L, where);
  } else if (dropped) {
    std::fill(text, text + static_cast<size_t>(L) * model_.context_dim, 0.0f);
    std::fill(pooled, pooled + model_.pooled_dim, 0.0f);
  }
  b.at<float>(FLUX_TIMESTEP, rows)[row] = sigma;
  b.at<float>(FLUX_GUIDANCE, rows)[row] = static_cast<float>(flow_.guidance);
}

void LatentDataset::require_records(uint64_t needed, const std::string& purpose, const std::string& fix) const {
  if (records() >= needed) return;
  throw DataError(strprintf("%s='%s' holds %llu latent records, fewer than %s: %s", option_.c_str(), value_.c_str(),
                            static_cast<unsigned long long>(records()), purpose.c_str(), fix.c_str()));
}

// Every value of this part's records finite: a NaN latent would poison the first step's gradients.
std::string LatentDataset::check(int part, int num_parts) const {
  H5QuietErrors quiet;
  const uint64_t begin = records() * part / num_parts, end = records() * (part + 1) / num_parts;
  std::vector<float> values;
  for (uint64_t r = begin; r < end; r++) {
    const size_t file = std::upper_bound(first_record_.begin(), first_record_.end(), r) - first_record_.begin() - 1;
    const File& f = *files_[file];
    const uint64_t local = r - first_record_[file];
    const std::tuple<hid_t, const char*, size_t> fields[4] = {
        {f.latents, "latents", static_cast<size_t>(N_) * model_.in_channels},
        {f.text, "encoder_hidden_states", captions_ ? 0 : static_cast<size_t>(model_.context_len) * model_.context_dim},
        {f.pooled, "pooled_projections", captions_ ? 0 : static_cast<size_t>(model_.pooled_dim)},
        {f.condition, "condition_latents", static_cast<size_t>(model_.condition_len) * model_.in_channels}};
    if (captions_) {  // valid UTF-8 that the tokenizer takes
      std::vector<int32_t> ids(model_.context_len);
      const std::string where = strprintf("%s: '%s': caption %llu", option_.c_str(), f.path.c_str(),
                                          static_cast<unsigned long long>(local));
      try {
        captions_->tokenize(h5_read_strings(f.captions, local, 1, where)[0], ids.data(), where);
      } catch (const DataError& e) {
        return e.what();
      }
    }
    for (const auto& [set, name, numel] : fields) {
      if (numel == 0) continue;
      values.resize(numel);
      read(f, set, name, local, values.data(), numel);
      for (float v : values)
        if (!std::isfinite(v))
          return strprintf("%s: '%s': record %llu of dataset '%s' holds a non-finite value; re-encode that image",
                           option_.c_str(), f.path.c_str(), static_cast<unsigned long long>(local), name);
    }
  }
  return "";
}

std::string LatentDataset::skipped_warning() const {
  std::string empty;
  for (const auto& f : files_)
    if (f->records == 0) empty += (empty.empty() ? "" : ", ") + f->path;
  return empty.empty() ? "" : option_ + ": no records in " + empty;
}

std::string LatentDataset::identity() const {
  std::string s;
  for (const auto& f : files_) s += std::to_string(f->bytes) + " " + f->path + "\n";
  return s;
}

std::string LatentDataset::describe() const {
  const std::string shape =
      strprintf("%d image tokens, %s%d text tokens%s", N_,
                model_.condition_len ? strprintf("%d condition tokens, ", model_.condition_len).c_str() : "",
                model_.context_len, captions_ ? " from captions" : "");
  if (files_.size() == 1)
    return strprintf("%s (%s latents, %s)", files_[0]->path.c_str(), counted(records(), "record").c_str(),
                     shape.c_str());
  return strprintf("%zu files of '%s' (%s, %s)", files_.size(), value_.c_str(), counted(records(), "record").c_str(),
                   shape.c_str());
}

}  // namespace shardtrain
