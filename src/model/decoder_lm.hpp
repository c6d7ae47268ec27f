// The half of a decoder language model that GPT-2 and the Llama family share (model/model.hpp's
// interface): tokens in, a residual stream through L blocks, a final norm and a vocabulary head,
// the cross-entropy (or distillation) loss over B*T positions. A family's model derives from it and
// writes its embedding, blocks, final norm and decode path; the buffers below are allocated by the
// derived constructor from the family's list (ModelFamily::activation_arrays, which the planner
// sums: activation_list()), except the saved tensors, tokens, targets, document starts and
// positions, which this constructor makes (decoder_lm_id_bytes).
#pragma once

#include <algorithm>
#include <vector>

#include "core/error.hpp"
#include "model/adapter_layers.hpp"
#include "model/family.hpp"
#include "model/model.hpp"
#include "model/saved_activations.hpp"

namespace shardtrain {

template <typename Real>
class DecoderLM : public TransformerModel<Real>,
                  public KvDecoder<Real>,
                  public TokenLogits<Real>,
                  public HiddenStates<Real> {
 public:
  int batch() const override { return B_; }
  int seq_len() const override { return T_; }
  size_t activation_bytes() const override {
    return plan_activation_bytes(table_, B_, T_, checkpointing_, sizeof(Real), saved_.dtype());
  }
  int output_rows() const override { return B_ * T_; }
  int output_width() const override { return cfg_.vocab_size; }
  // The targets to the device, the head's logits (head_logits), the loss per position and its sum.
  void head_forward(const Real* root, const Batch& batch, double* loss_total) override {
    const int N = B_ * T_, V = cfg_.vocab_size;
    ops_.device().copy_to_device(targets_.data(), batch.get<int>(BATCH_TARGETS, N), targets_.bytes());
    this->head_logits(root);
    this->loss().forward(ops_, losses_.data(), probs_.data(), loss_targets(), N, V);
    ops_.accumulate_sum(loss_total, losses_.data(), losses_.size());
  }
  void copy_head_probs(int row, Real* host) const override {
    SHARD_CHECK(row >= 0 && row < B_ * T_, "row %d of %d", row, B_ * T_);
    const size_t V = cfg_.vocab_size;
    ops_.device().copy_to_host(host, probs_.data() + row * V, V * sizeof(Real));
  }
  void set_dropout_keys(const uint64_t* keys) override { adapters_.set_dropout_keys(keys); }
  KvDecoder<Real>* kv_decoder() override { return this; }
  TokenLogits<Real>* token_logits() override { return this; }
  HiddenStates<Real>* hidden_states() override { return this; }
  const Real* hidden_state(int index, const Real* root) override {
    SHARD_CHECK(index >= 0 && index <= cfg_.n_layer, "hidden state %d of a %d-layer model", index, cfg_.n_layer);
    return index < cfg_.n_layer ? resid_[index].data() : final_norm(root);
  }

 protected:
  using Array = DeviceArray<Real>;
  // saved_sizes: the family's saved tensors per layer (SavedActivations), a set for each layer that
  // keeps its own and one shared by the recomputing layers (model/checkpointing.hpp).
  DecoderLM(const ParamTable& table, int batch, int seq_len, Checkpointing activation_checkpointing,
            const LayerOps<Real>& ops, DType activation_dtype, const std::vector<size_t>& saved_sizes)
      : table_(table), ops_(ops), adapters_(table, batch * seq_len, ops), cfg_(table.config()), B_(batch),
        T_(seq_len), checkpointing_(activation_checkpointing),
        recompute_(activation_checkpointing.run(0, table.config().n_layer)),
        saved_(ops, activation_dtype, recompute_, saved_sizes) {
    SHARD_CHECK(seq_len <= cfg_.max_seq_len, "seq_len %d > max_seq_len %d", seq_len, cfg_.max_seq_len);
    const size_t BT = static_cast<size_t>(B_) * T_;
    tokens_ = DeviceArray<int>(ops.device(), BT);
    targets_ = DeviceArray<int>(ops.device(), BT);
    doc_starts_ = DeviceArray<int>(ops.device(), BT);
    positions_ = DeviceArray<int>(ops.device(), BT);
  }

  // The family's activation arrays handed out in their order: a constructor takes each buffer as
  // the next of the list the planner counts, so the list is the allocation (llm.c's act_sizes).
  // take(n) names the elements the model will use there and stops at once where the list
  // disagrees (an entry out of order would otherwise be a buffer of another size); done() checks
  // that it took them all.
  class ActivationList {
   public:
    ActivationList(Device& dev, std::vector<size_t> sizes) : dev_(dev), sizes_(std::move(sizes)) {}
    Array take(size_t elements) {
      SHARD_CHECK(next_ < sizes_.size(), "the model takes more arrays than its family lists (%zu)", sizes_.size());
      SHARD_CHECK(sizes_[next_] == elements, "array %zu of the family's activation list has %zu elements, the model "
                  "uses %zu", next_, sizes_[next_], elements);
      return Array(dev_, sizes_[next_++]);
    }
    void done() const {
      SHARD_CHECK(next_ == sizes_.size(), "the model took %zu of the %zu arrays its family lists", next_,
                  sizes_.size());
    }

   private:
    Device& dev_;
    std::vector<size_t> sizes_;
    size_t next_ = 0;
  };
  ActivationList activation_list() const {
    return ActivationList(ops_.device(),
                          family_of(cfg_).activation_arrays(cfg_, B_, T_, checkpointing_, saved_.dtype()));
  }

  Loss<Real>& own_loss() override { return cross_entropy_; }
  // The final norm of the last block's output into lnf_ (the head's input), returned.
  virtual const Real* final_norm(const Real* root) = 0;
  // The micro-batch's tokens, and its documents if it packs several per row, to the device
  // (embed_forward); doc_start() is then what the attention reads. A sliding window that the
  // sequence reaches is masked the same way: row t's first visible key is t - window + 1, or its
  // document's start if later (the attention kernels take any first keys that never move back).
  // The window's alone are the same for every micro-batch: uploaded once, so the ops keep what they
  // derive from them (cuDNN's score bias).
  void upload_tokens(const Batch& batch) {
    ops_.device().copy_to_device(tokens_.data(), batch.get<int>(BATCH_TOKENS, tokens_.size()), tokens_.bytes());
    const bool documents = batch.has(BATCH_DOC_STARTS), window = cfg_.window_within(T_);
    masked_ = documents || window;
    if (masked_ && (documents || !window_alone_uploaded_)) {
      const int* starts = documents ? batch.get<int>(BATCH_DOC_STARTS, doc_starts_.size()) : nullptr;
      if (window) {
        window_starts_.resize(doc_starts_.size());
        for (size_t i = 0; i < window_starts_.size(); i++)
          window_starts_[i] = std::max(starts ? starts[i] : 0, static_cast<int>(i % T_) - cfg_.sliding_window + 1);
        starts = window_starts_.data();
      }
      ops_.device().copy_to_device(doc_starts_.data(), starts, doc_starts_.bytes());
      ops_.documents_changed(doc_starts_.data());
      window_alone_uploaded_ = !documents;
    }
    restarted_ = batch.has(BATCH_POSITIONS);
    if (restarted_)
      ops_.device().copy_to_device(positions_.data(), batch.get<int>(BATCH_POSITIONS, positions_.size()),
                                   positions_.bytes());
  }
  const int* doc_start() const { return masked_ ? doc_starts_.data() : nullptr; }
  // The position of each token when they restart per document (the position table's row, the rope
  // angle's); nullptr: its place in the sequence.
  const int* positions() const { return restarted_ ? positions_.data() : nullptr; }
  LossTargets<Real> loss_targets() const { return {targets_.data(), nullptr}; }
  // The head's backward up to the logits: the loss's gradient in place of the probabilities.
  void loss_backward(Real dloss) {
    this->loss().backward(ops_, probs_.data(), loss_targets(), dloss, B_ * T_, cfg_.vocab_size);
  }

  const ParamTable& table_;
  const LayerOps<Real>& ops_;
  ModelAdapters<Real> adapters_;  // the adapters around the block products (model/adapter_layers.hpp)
  ModelConfig cfg_;
  int B_, T_;
  Checkpointing checkpointing_;
  CheckpointedRun recompute_;  // which layers recompute and where each keeps its saved tensors
  CrossEntropyLoss<Real> cross_entropy_;
  DeviceArray<int> tokens_, targets_, doc_starts_, positions_;
  bool masked_ = false;     // doc_starts_ holds each row's first key: documents, a sliding window or both
  std::vector<int> window_starts_;  // the host's first keys under the sliding window
  bool window_alone_uploaded_ = false;  // doc_starts_ holds the window's first keys without documents
  bool restarted_ = false;  // and its positions restart with each (positions_)
  std::vector<Array> resid_;      // resid_[l]: input of block l; resid_[L]: output of the last
  SavedActivations<Real> saved_;  // a set per layer that keeps its own, one for the recomputing layers
  Array lnf_, probs_, losses_;    // the final norm's output, the logits then probabilities, the losses
  Array dresid_, dln_;            // backward scratch shared by all layers: the residual's gradient, a norm's
};

}  // namespace shardtrain
