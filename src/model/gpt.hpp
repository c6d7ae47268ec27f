// GPT-2 forward and backward on explicit buffers, one micro-batch of B sequences of T tokens.
//
// The model owns only activations and backward scratch; parameters and their gradients come in
// as flat unit buffers laid out by the ParamTable, so the FSDP engine decides when a unit is
// gathered. The pieces are called in this order for one training micro-batch:
//   embed_forward, block_forward(0..L-1), head_forward  -> sum of token losses
//   head_backward, block_backward(L-1..0), embed_backward
// with the root unit's parameters valid from embed_forward to embed_backward. Gradients are
// accumulated (+=) into the unit gradient buffers. With activation checkpointing only each
// block's input is kept; block_backward recomputes the block's forward into one shared set of
// buffers first (deterministically: the same bits as without). Templated on float (training) and double
// (finite-difference checks); forward_backward_unsharded runs the whole sequence with every unit
// present, the oracle for the sharded engine. Every buffer lives on the device of `ops` (host for
// the CPU backend, the GPU for the CUDA one); tokens and targets come from host memory.
#pragma once

#include <vector>

#include "backend/layer_ops.hpp"
#include "model/param_table.hpp"

namespace shardtrain {

template <typename Real>
class GptModel {
 public:
  GptModel(const ParamTable& table, int batch, int seq_len, bool activation_checkpointing, const LayerOps<Real>& ops);

  // Bytes of activations and backward scratch for these dimensions, without allocating: the one
  // source for the model's own accounting and the planner.
  static size_t plan_activation_bytes(const ModelConfig& config, int batch, int seq_len, bool activation_checkpointing);

  int batch() const { return B_; }
  int seq_len() const { return T_; }
  size_t activation_bytes() const { return plan_activation_bytes(cfg_, B_, T_, checkpointing_); }

  void embed_forward(const Real* root, const int* tokens);
  void block_forward(int layer, const Real* block);
  // Returns the sum over the B*T tokens of -log p(target); leaves probabilities for head_backward.
  double head_forward(const Real* root, const int* targets);

  // dloss: the gradient of the optimised loss w.r.t. each token's loss (1 / tokens in the batch).
  void head_backward(Real* root_grad, const Real* root, Real dloss);
  void block_backward(int layer, Real* block_grad, const Real* block);
  void embed_backward(Real* root_grad);

 private:
  using Array = DeviceArray<Real>;
  struct Layer {
    Array ln1, ln1_mean, ln1_rstd, qkv, att, atty, resid2, ln2, ln2_mean, ln2_rstd, fch, fch_gelu;
  };
  Layer& layer(int l) { return layers_[checkpointing_ ? 0 : l]; }

  const ParamTable& table_;
  const LayerOps<Real>& ops_;
  ModelConfig cfg_;
  int B_, T_;
  bool checkpointing_;
  DeviceArray<int> tokens_, targets_;
  std::vector<Array> resid_;  // resid_[l]: input of block l; resid_[L]: output of the last
  std::vector<Layer> layers_;  // one per block, or a single shared one when checkpointing
  Array lnf_, lnf_mean_, lnf_rstd_, probs_, losses_;
  // Backward scratch, shared by all layers.
  Array dresid_, dln_, dqkv_, dfch_, datt_;
};

// Forward and backward of one micro-batch with every unit present (no sharding). units[u] and
// unit_grads[u] are flat unit buffers; gradients are accumulated. Returns the summed token loss.
template <typename Real>
double forward_backward_unsharded(GptModel<Real>& model, const ParamTable& table, const std::vector<const Real*>& units,
                                  const std::vector<Real*>& unit_grads, const int* tokens, const int* targets,
                                  Real dloss);

}  // namespace shardtrain
