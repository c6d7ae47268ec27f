// The ZeRO-3 (FULL_SHARD) engine: flat units, their gather -> compute -> free life cycle, and the
// reduce-scatter of gradients.
//
// Each unit of the ParamTable is one flat buffer padded to a multiple of the rank count; rank r
// keeps only elements [r*S, (r+1)*S) of it (S = padded / ranks) as fp32 master parameters and
// gradients. For a micro-batch: the root unit (embeddings, final norm, tied head) is gathered
// once and kept until the end of backward; each block is gathered before its forward, released,
// gathered again before its backward, and its full gradient is reduce-scattered and added to the
// local gradient shard. All ranks issue the same collectives in the same order.
// On one rank the shard is the whole unit: compute then reads and accumulates into the shard
// buffers directly, with no gather copies, no unsharded gradient buffers and no extra pass
// (as PyTorch FSDP falls back to NO_SHARD on a world of one).
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
  // The unit's full parameters: gathered into `buffer`, or the shard itself on one rank.
  const float* gather_params(int unit, std::vector<float>& buffer);
  // Where the unit's backward accumulates its full gradient: `buffer` zeroed, or the shard.
  float* gradient_target(int unit, std::vector<float>& buffer);
  // Adds the reduce-scattered `buffer` to the gradient shard (nothing to do on one rank).
  void reduce_scatter_grads(int unit, const std::vector<float>& buffer);

  const ParamTable& table_;
  Comm& comm_;
  MemoryTracker& memory_;
  std::vector<UnitShard> shards_;
  size_t max_block_padded_ = 0;
  // Unsharded working buffers (empty on one rank): the root unit and one block, parameters and
  // gradients.
  std::vector<float> root_full_, root_grad_full_, block_full_, block_grad_full_;
  size_t unsharded_bytes_ = 0, comm_bytes_ = 0;
};

}  // namespace shardtrain
