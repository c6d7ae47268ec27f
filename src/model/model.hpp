// A transformer's forward and backward on explicit buffers, one micro-batch (model/batch.hpp) at a
// time: the interface the FSDP engine drives, implemented by each model family's model
// (model/families/: GptModel, LlamaModel) and made through its descriptor (model/family.hpp).
//
// A model owns only activations and backward scratch; parameters and their gradients come in
// as flat unit buffers laid out by the ParamTable, so the FSDP engine decides when a unit is
// gathered. The pieces are called in this order for one training micro-batch:
//   embed_forward, block_forward(0..L-1), head_forward  -> the summed loss (model/loss.hpp)
//   head_backward, block_backward(L-1..0), embed_backward
// with the root unit's parameters valid from embed_forward to embed_backward. Gradients are
// accumulated (+=) into the unit gradient buffers. With activation checkpointing only each
// recomputing block's input is kept (every block's, or the first N's: model/checkpointing.hpp);
// block_backward recomputes such a block's forward into one set of buffers the recomputing blocks
// share first (deterministically: the same bits as without). Templated on float (training) and
// double (finite-difference checks); forward_backward_unsharded runs the whole sequence with every
// unit present, the oracle for the sharded engine. Every buffer lives on the device of `ops` (host
// for the CPU backend, the GPU for the CUDA one); the micro-batch comes from host memory.
#pragma once

#include <memory>
#include <vector>

#include "backend/layer_ops.hpp"
#include "core/error.hpp"
#include "model/batch.hpp"
#include "model/checkpointing.hpp"
#include "model/loss.hpp"
#include "model/param_table.hpp"

namespace shardtrain {

// Optional capabilities of a family's model (TransformerModel::kv_decoder, token_logits,
// predictor; the family says beforehand whether its models have them: ModelFamily::kv_decoding,
// token_logits, samples_images).

// Generation: incremental decoding of one sequence with a key/value cache. begin_decode(max_len,
// max_chunk) allocates every layer's cache for max_len positions and the buffers of a step of up
// to max_chunk tokens -- decode_bytes() in all, plan_decode_bytes() -- and empties the cache
// (again on every call). A step feeds the next n tokens (host memory) at positions pos..pos+n-1,
// pos = decode_position() the tokens fed so far, pos + n <= max_len:
//   decode_embed(root, tokens, n), decode_block(0..L-1), decode_head(root, logits) (may be left out)
// with the parameters of a forward. decode_block appends the n positions' k and v (llama: after
// rope) to its layer's cache and attends each of them over the cached positions up to its own;
// decode_head writes the V logits of the step's last token to `logits` (host memory). Whatever
// the steps' sizes, the logits are the ones a full forward over the sequence gives at that
// position, up to rounding (tests/unit/test_generation.cpp). end_decode frees it all.
template <typename Real>
class KvDecoder {
 public:
  virtual ~KvDecoder() = default;
  virtual void begin_decode(int max_len, int max_chunk) = 0;
  virtual void end_decode() = 0;
  virtual size_t decode_bytes() const = 0;
  virtual int decode_position() const = 0;
  virtual void decode_embed(const Real* root, const int* tokens, int n) = 0;
  virtual void decode_block(int layer, const Real* block) = 0;
  virtual void decode_head(const Real* root, Real* logits) = 0;
};

// A vocabulary head: the logits of every position, which a distillation teacher gives and a
// distilled student is trained against.
template <typename Real>
class TokenLogits {
 public:
  virtual ~TokenLogits() = default;
  // The forward's logits without a loss (a teacher's): B*T x V in the device's memory, valid until
  // the next forward.
  virtual const Real* head_logits(const Real* root) = 0;
  // The softmax probabilities head_forward's cross-entropy left for row r = b*T + t (V values),
  // copied to host memory: the full-recompute reference of the tests (valid until head_backward
  // overwrites them).
  virtual void copy_head_probs(int row, Real* host) const = 0;
};

// A regression head: the forward's output without a loss (a diffusion transformer's predicted
// velocity), which a sampler steps with.
template <typename Real>
class Predictor {
 public:
  virtual ~Predictor() = default;
  // output_rows x output_width in the device's memory, valid until the next forward.
  virtual const Real* predict(const Real* root) = 0;
  // The loss per output row of the last head_forward (output_rows values, a sample's rows
  // contiguous), in the device's memory until the next forward: the trainer's loss by noise level.
  virtual const Real* row_losses() const = 0;
};

// A language model's residual stream as a text encoder gives it (app/text_encoder.hpp), numbered as
// Hugging Face's output_hidden_states: 0 the embeddings' output, l the input of block l (the output
// of block l - 1), n_layer the final norm's output.
template <typename Real>
class HiddenStates {
 public:
  virtual ~HiddenStates() = default;
  // After a forward through the embedding and the first min(index, n_layer) blocks: B*T x n_embd in
  // the device's memory, valid until the next forward. `root`: the gathered root (the final norm's).
  virtual const Real* hidden_state(int index, const Real* root) = 0;
};

template <typename Real>
class TransformerModel {
 public:
  virtual ~TransformerModel() = default;

  // The loss head_forward computes (kept by the caller), or null for the family's own (a language
  // model's cross-entropy).
  void set_loss(Loss<Real>* loss) { loss_ = loss ? loss : &own_loss(); }
  Loss<Real>& loss() { return loss_ ? *loss_ : own_loss(); }

  virtual int batch() const = 0;
  virtual int seq_len() const = 0;
  // Bytes of activations and backward scratch it holds: plan_activation_bytes of its dimensions.
  virtual size_t activation_bytes() const = 0;
  // The rows and width of the output its loss reads, per micro-batch (a language model: B*T x V).
  virtual int output_rows() const = 0;
  virtual int output_width() const = 0;

  // The micro-batch (host memory) as the family's data source filled it.
  virtual void embed_forward(const Real* root, const Batch& batch) = 0;
  virtual void block_forward(int layer, const Real* block) = 0;
  // Adds the micro-batch's summed loss (loss(): each output row's, summed over its units) to
  // *loss_total, one double in the device's memory (the host does not wait for it); leaves what
  // head_backward turns into the output's gradient.
  virtual void head_forward(const Real* root, const Batch& batch, double* loss_total) = 0;
  // The same loss returned, for a model computing in host memory only (the tests' references).
  double host_head_forward(const Real* root, const Batch& batch) {
    double loss = 0;
    head_forward(root, batch, &loss);
    return loss;
  }

  // dloss: the gradient of the optimised loss w.r.t. each row's summed loss (1 / the step's
  // normaliser, Loss::units_per_row).
  virtual void head_backward(Real* root_grad, const Real* root, Real dloss) = 0;
  virtual void block_backward(int layer, Real* block_grad, const Real* block) = 0;
  virtual void embed_backward(Real* root_grad) = 0;

  // Training rows' dropout keys for the micro-batches that follow (output rows, host memory; the
  // adapters' dropout, model/lora.hpp), or null for none (evaluation). Without dropout, nothing to do.
  virtual void set_dropout_keys(const uint64_t* keys) = 0;

  // The optional capabilities, or null.
  virtual KvDecoder<Real>* kv_decoder() { return nullptr; }
  virtual TokenLogits<Real>* token_logits() { return nullptr; }
  virtual Predictor<Real>* predictor() { return nullptr; }
  virtual HiddenStates<Real>* hidden_states() { return nullptr; }

 protected:
  virtual Loss<Real>& own_loss() = 0;

 private:
  Loss<Real>* loss_ = nullptr;
};

// Where an incremental decode stands (KvDecoder::begin_decode): the cache's length and the
// largest step, the current step's first position and token count, and the tokens fed so far.
struct DecodeCursor {
  int max_len = 0, max_chunk = 0;
  int start = 0, n = 0, pos = 0;
  // Starts a step of `tokens` tokens at the next position; it must fit the cache and the step buffers.
  void advance(int tokens) {
    SHARD_CHECK(max_len > 0 && tokens >= 1 && tokens <= max_chunk && pos + tokens <= max_len,
                "decode_embed of %d tokens at position %d (max_len %d, max_chunk %d)", tokens, pos, max_len,
                max_chunk);
    start = pos, n = tokens, pos += tokens;
  }
};

// The model of the table's family. activation_dtype: how its blocks store the tensors their
// backward reads (fsdp.activation_dtype; model/saved_activations.hpp).
template <typename Real>
std::unique_ptr<TransformerModel<Real>> make_model(const ParamTable& table, int batch, int seq_len,
                                                   Checkpointing activation_checkpointing, const LayerOps<Real>& ops,
                                                   DType activation_dtype = DTYPE_FP32);

// Elements of each of a layer's saved tensors for the config's architecture (the models'
// saved_tensor_elements; model/saved_activations.hpp).
std::vector<size_t> plan_saved_tensor_elements(const ModelConfig& config, int batch, int seq_len);

// Bytes of activations and backward scratch for these dimensions, without allocating: the one
// source for the models' own accounting and the planner.
size_t plan_activation_bytes(const ParamTable& table, int batch, int seq_len, Checkpointing activation_checkpointing,
                             size_t real_bytes = sizeof(float), DType activation_dtype = DTYPE_FP32);

// Bytes of a decode state (KvDecoder::begin_decode): the key/value cache, L x 2 x max_len x
// n_kv_head x head_size elements, and the buffers of a step of max_chunk tokens (the adapters' too).
size_t plan_decode_bytes(const ParamTable& table, int max_len, int max_chunk, size_t real_bytes = sizeof(float));

// Forward and backward of one micro-batch with every unit present (no sharding). units[u] and
// unit_grads[u] are flat unit buffers; gradients are accumulated. Returns the summed loss.
template <typename Real>
double forward_backward_unsharded(TransformerModel<Real>& model, const ParamTable& table,
                                  const std::vector<const Real*>& units, const std::vector<Real*>& unit_grads,
                                  const Batch& batch, Real dloss);

}  // namespace shardtrain
