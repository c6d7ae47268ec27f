// data.train_file / data.val_file for a diffusion transformer (model.arch=flux): latent shards,
// HDF5 files of records made by tools/encode_images.py (docs/flux.md, "Latent datasets"):
//   latents                float32 (R, N, in_channels)   packed VAE latents, scaled and shifted
//   encoder_hidden_states  float32 (R, L, context_dim)   the text encoder's (T5) embeddings
//   pooled_projections     float32 (R, pooled_dim)       the pooled text vector (CLIP)
//   attributes grid_rows, grid_cols                      the packed latent grid, rows x cols = N
//   condition_latents      float32 (R, M, in_channels)   Kontext's condition image (model.condition_len = M)
//   attributes condition_grid_rows, condition_grid_cols  its packed grid, rows x cols = M
// With a text encoder in the job (a CaptionTokenizer given), a file holds the captions instead of
// their embeddings:
//   captions               strings (R)                   UTF-8 text (fixed or variable length)
// and a micro-batch row carries the caption's token ids, which the encoder turns into the embeddings.
// One option value names one file or several (a comma-separated list of paths and globs, as token
// files); their records are numbered file after file. A micro-batch row is record r made into a
// flow-matching sample (flow_matching.hpp): the noisy latent, the noise level, the target.
#pragma once

#include <hdf5.h>

#include <memory>
#include <string_view>
#include <string>
#include <vector>

#include "data/caption_tokens.hpp"
#include "data/data_source.hpp"
#include "data/flow_matching.hpp"
#include "model/config.hpp"
#include "model/families/flux/flux_family.hpp"

namespace shardtrain {

// The packed grids of `tokens` tokens that an open HDF5 file's attributes PREFIXgrid_rows and
// PREFIXgrid_cols give (prefix "" for the target latents, "condition_" for the condition images):
// scalars for one image, or arrays of one (rows, cols) per image, their tokens concatenated;
// DataError starting with `where` (naming `what`) when they are missing, or do not add up to `tokens`.
std::vector<PackedGrid> packed_grids(hid_t file, const std::string& path, const std::string& where, const char* prefix,
                                     int tokens, const char* what);
// The condition images' grids (prefix "condition_"), DataError unless the family takes that many
// (check_condition_image_count).
std::vector<PackedGrid> packed_condition_grids(hid_t file, const std::string& path, const std::string& where,
                                               const ModelConfig& model, int tokens);
// The target latents' one grid's width.
int packed_grid_cols(hid_t file, const std::string& path, const std::string& where, int tokens);

class LatentDataset final : public DataSource {
 public:
  // Opens and checks every file against the model and train.seq_len = image_tokens; throws
  // DataError naming the file and what does not fit.
  // captions: the text encoder's tokenizer, or null for files of cached embeddings.
  LatentDataset(const std::string& option, const std::string& value, const ModelConfig& model, int image_tokens,
                uint64_t seed, const FlowOptions& flow, std::shared_ptr<const CaptionTokenizer> captions = nullptr);
  ~LatentDataset() override;

  uint64_t records() const override { return first_record_.back(); }
  void begin(Batch& batch, int rows) const override;
  void fill(Batch& batch, int row, uint64_t record, uint64_t sample, bool validation) const override;
  void require_records(uint64_t needed, const std::string& purpose, const std::string& fix) const override;
  std::string check(int part, int num_parts) const override;
  std::string skipped_warning() const override;
  std::string identity() const override;
  std::string describe() const override;
  std::pair<int, int> image_grid() const override { return {N_ / grid_cols_, grid_cols_}; }

 private:
  struct File;
  // Reads record `local` of file `f`'s dataset `set` (named `name` in messages; numel floats) into dst.
  void read(const File& f, hid_t set, const char* name, uint64_t local, float* dst, size_t numel) const;

  std::string option_, value_;
  ModelConfig model_;
  int N_, grid_cols_ = 0;
  std::vector<PackedGrid> condition_grids_;  // the condition images', in order (none: text to image)
  uint64_t seed_;
  FlowOptions flow_;
  std::shared_ptr<const CaptionTokenizer> captions_;
  std::vector<std::unique_ptr<File>> files_;
  std::vector<uint64_t> first_record_;  // file f's records are [first_record_[f], first_record_[f + 1])
};

}  // namespace shardtrain
