// The ZeRO-3 (FULL_SHARD) engine: flat units, their gather -> compute -> free life cycle, and the
// reduce-scatter of gradients.
//
// Each unit of the ParamTable is one flat buffer padded to a multiple of the rank count; rank r
// keeps only elements [r*S, (r+1)*S) of it (S = padded / ranks) as fp32 master parameters and
// gradients. For a micro-batch: the root unit (embeddings, final norm, tied head) is gathered
// once and kept until the end of backward; each block is gathered before its forward, released,
// gathered again before its backward, and its full gradient is reduce-scattered and added to the
// local gradient shard. All ranks issue the same collectives in the same order.
#pragma once

#include <cstdint>
#include <vector>

#include "comm/comm.hpp"
#include "model/gpt.hpp"
#include "model/param_table.hpp"
#include "shard/memory.hpp"

namespace shardtrain {

struct UnitShard {
  size_t padded_numel = 0;  // the unit's flat size rounded up to a multiple of the rank count
  size_t shard_numel = 0;   // padded_numel / ranks
  size_t begin = 0;         // this rank's first element in the unit's flat buffer
  std::vector<float> params, grads;
};

class FsdpEngine {
 public:
  FsdpEngine(const ParamTable& table, Comm& comm, MemoryTracker& memory);
  ~FsdpEngine();

  const ParamTable& table() const { return table_; }
  Comm& comm() { return comm_; }
  std::vector<UnitShard>& shards() { return shards_; }
  const std::vector<UnitShard>& shards() const { return shards_; }
  size_t local_param_count() const;  // elements of this rank's shards, padding included

  // Each rank initializes only its own slice; element values depend on (seed, parameter, index)
  // alone, so the model is the same for any rank count.
  void init_parameters(uint64_t seed);
  void zero_grads();

  // Forward and backward of one micro-batch; gradients end up summed over ranks in the local
  // gradient shards (+=). Returns the summed loss of this rank's tokens.
  double train_micro_batch(GptModel<float>& model, const int* tokens, const int* targets, float dloss);
  // Forward only (evaluation): the summed loss of this rank's tokens.
  double eval_micro_batch(GptModel<float>& model, const int* tokens, const int* targets);

  // The full (unpadded) values of one unit, gathered on every rank: for tests and export.
  std::vector<float> gather_unit(int unit, bool gradients);

 private:
  void gather_params(int unit, std::vector<float>& full);
  void reduce_scatter_grads(int unit, const std::vector<float>& full_grad);

  const ParamTable& table_;
  Comm& comm_;
  MemoryTracker& memory_;
  std::vector<UnitShard> shards_;
  size_t max_block_padded_ = 0;
  // Unsharded working buffers: the root unit and one block, parameters and gradients.
  std::vector<float> root_full_, root_grad_full_, block_full_, block_grad_full_, shard_scratch_;
};

}  // namespace shardtrain
