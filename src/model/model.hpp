// A transformer's forward and backward on explicit buffers, one micro-batch of B sequences of T
// tokens: the interface the FSDP engine drives, implemented by GptModel (model/gpt.hpp) and
// LlamaModel (model/llama.hpp).
//
// A model owns only activations and backward scratch; parameters and their gradients come in
// as flat unit buffers laid out by the ParamTable, so the FSDP engine decides when a unit is
// gathered. The pieces are called in this order for one training micro-batch:
//   embed_forward, block_forward(0..L-1), head_forward  -> sum of token losses
//   head_backward, block_backward(L-1..0), embed_backward
// with the root unit's parameters valid from embed_forward to embed_backward. Gradients are
// accumulated (+=) into the unit gradient buffers. With activation checkpointing only each
// block's input is kept; block_backward recomputes the block's forward into one shared set of
// buffers first (deterministically: the same bits as without). Templated on float (training) and
// double (finite-difference checks); forward_backward_unsharded runs the whole sequence with every
// unit present, the oracle for the sharded engine. Every buffer lives on the device of `ops` (host
// for the CPU backend, the GPU for the CUDA one); tokens and targets come from host memory.
#pragma once

#include <memory>
#include <vector>

#include "backend/layer_ops.hpp"
#include "model/param_table.hpp"

namespace shardtrain {

template <typename Real>
class TransformerModel {
 public:
  virtual ~TransformerModel() = default;

  virtual int batch() const = 0;
  virtual int seq_len() const = 0;
  // Bytes of activations and backward scratch it holds: plan_activation_bytes of its dimensions.
  virtual size_t activation_bytes() const = 0;

  virtual void embed_forward(const Real* root, const int* tokens) = 0;
  virtual void block_forward(int layer, const Real* block) = 0;
  // Returns the sum over the B*T tokens of -log p(target); leaves probabilities for head_backward.
  virtual double head_forward(const Real* root, const int* targets) = 0;

  // dloss: the gradient of the optimised loss w.r.t. each token's loss (1 / tokens in the batch).
  virtual void head_backward(Real* root_grad, const Real* root, Real dloss) = 0;
  virtual void block_backward(int layer, Real* block_grad, const Real* block) = 0;
  virtual void embed_backward(Real* root_grad) = 0;
};

// The model of the table's architecture.
template <typename Real>
std::unique_ptr<TransformerModel<Real>> make_model(const ParamTable& table, int batch, int seq_len,
                                                   bool activation_checkpointing, const LayerOps<Real>& ops);

// Bytes of activations and backward scratch for these dimensions, without allocating: the one
// source for the models' own accounting and the planner.
size_t plan_activation_bytes(const ModelConfig& config, int batch, int seq_len, bool activation_checkpointing,
                             size_t real_bytes = sizeof(float));

// Forward and backward of one micro-batch with every unit present (no sharding). units[u] and
// unit_grads[u] are flat unit buffers; gradients are accumulated. Returns the summed token loss.
template <typename Real>
double forward_backward_unsharded(TransformerModel<Real>& model, const ParamTable& table,
                                  const std::vector<const Real*>& units, const std::vector<Real*>& unit_grads,
                                  const int* tokens, const int* targets, Real dloss);

}  // namespace shardtrain
