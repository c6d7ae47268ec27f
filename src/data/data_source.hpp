// What the trainer reads its micro-batches from: a family's data source (token files for the
// language models, latent shards for the diffusion transformers). Records are numbered
// 0..records()-1 across all of its files; the sampler (sampler.hpp) decides which record each
// sample of a step reads, and the source fills the micro-batch (model/batch.hpp) from it.
//
// This layer knows nothing about MPI: callers agree on the outcome across ranks.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "model/batch.hpp"

namespace shardtrain {

class DataSource {
 public:
  virtual ~DataSource() = default;
  virtual uint64_t records() const = 0;
  // Shapes `batch` for micro-batches of `rows` samples (the tensors the family's model reads).
  virtual void begin(Batch& batch, int rows) const = 0;
  // Row `row` from record `record`. `sample` numbers the draw -- the run's global sample (step x
  // global_batch + its place in the step) in training, the validation sample's index when
  // `validation` -- and keys what a source draws at random (a diffusion model's noise level and
  // noise), so that the draws do not depend on the rank count and a resumed run repeats them.
  virtual void fill(Batch& batch, int row, uint64_t record, uint64_t sample, bool validation) const = 0;

  // Whether targets can be IGNORED_TARGET (a loss mask: chat and instruction data). The loss of a
  // step then averages over the trained targets of all its records, counted before the step on
  // every rank and summed, so it does not depend on the rank count or the micro-batch split.
  virtual bool masks_targets() const { return false; }
  // The targets of `record` the loss counts (a source that masks none: not called).
  virtual uint64_t trained_targets(uint64_t) const { return 0; }

  // Throws DataError unless the data hold at least `needed` records; `purpose` says for what
  // ("one batch of train.global_batch=24 sequences"), `fix` what to change.
  virtual void require_records(uint64_t needed, const std::string& purpose, const std::string& fix) const = 0;
  // "" or the first problem of part `part` of `num_parts` of the data (each rank checks its own).
  virtual std::string check(int part, int num_parts) const = 0;
  // "" or one line naming files that hold no record.
  virtual std::string skipped_warning() const = 0;
  // What a checkpoint records of the data: one line "<bytes> <path>" per file, in stream order.
  virtual std::string identity() const = 0;
  // For the start-up line.
  virtual std::string describe() const = 0;
  // The packed latent grid (rows, cols) of an image source's records; (0, 0) for tokens.
  virtual std::pair<int, int> image_grid() const { return {0, 0}; }
};

}  // namespace shardtrain
