// A frozen text encoder in the same job as the diffusion transformer it conditions
// (docs/images.md, "A text encoder in the job"): a decoder language model (Llama, Qwen2, GPT-2 --
// a ShardTrain checkpoint or a Hugging Face folder) sharded beside the trained model over the same
// shard and replica groups, as its own units, with no gradients and no optimizer state (an
// inference FsdpEngine, as a distillation teacher's), gathered block by block for its forward only.
// Per micro-batch it turns the captions' token ids into the model's text conditioning: the hidden
// states of the chosen layers (Hugging Face's output_hidden_states numbering) side by side, zero at
// the padded positions after each caption, as encoder_hidden_states (B, L, K x n_embd), and their
// mean over the caption's tokens as pooled_projections. Qwen-Image conditions on Qwen2.5-VL's last
// hidden state this way, FLUX.2 on three of Mistral's layers.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "app/compute_backend.hpp"
#include "app/frozen_model.hpp"
#include "app/options.hpp"
#include "app/sample.hpp"
#include "comm/runtime.hpp"
#include "data/caption_tokens.hpp"
#include "model/batch.hpp"
#include "model/model.hpp"
#include "shard/fsdp_engine.hpp"
#include "shard/memory.hpp"

namespace shardtrain {

// text_encoder.layers for a model of n_layer blocks: hidden-state indices in [0, n_layer], negative
// ones counted from the end as Python indexes output_hidden_states (-1: the final norm's output).
// Throws UsageError for an empty list, a non-integer or an index out of range.
std::vector<int> parse_hidden_layers(const std::string& text, int n_layer);

// The encoder's model configuration from its source, read on every rank (call under agree_on).
// Throws UsageError naming the source when it is neither a checkpoint nor a folder, or holds
// adapters alone.
ParamTable text_encoder_param_table(const TextEncoderOptions& options, QuantConfig quant);
// Its tokenizer: text_encoder.tokenizer, or the folder's tokenizer.json, or the checkpoint's
// recorded data.tokenizer; UsageError when none is found. Captions cut at `tokens` ids (model.context_len).
std::shared_ptr<const CaptionTokenizer> text_encoder_tokenizer(const TextEncoderOptions& options, int tokens);
class TextEncoder {
 public:
  // Loads options.source for micro-batches of `batch` captions of denoiser.context_len ids and
  // checks it against the denoiser: its context_dim must be the layers' widths side by side and its
  // pooled_dim the same (or 0: a model without a pooled vector, FLUX.2). Collective over `world` and the groups; UsageError (agreed) when they do not fit.
  TextEncoder(const Runtime& rt, Comm& world, Comm& shard, Comm& replica, const ComputeBackend& compute,
              const EngineOptions& denoiser_options, const TextEncoderOptions& options, const QuantConfig& quant,
              std::shared_ptr<const CaptionTokenizer> tokenizer, const ModelConfig& denoiser, int batch,
              Watchdog* watchdog);

  // Fills the batch's encoder_hidden_states and pooled_projections from its caption ids and lengths
  // (data/latent_dataset.hpp). Collective over the groups.
  void encode(Batch& batch);
  // The same for `count` captions' ids (count x L) and lengths into context (count x L x
  // context_dim) and pooled (count x context_dim; null: none), host memory, in micro-batches.
  void encode(const int32_t* ids, const int32_t* lengths, int count, float* context, float* pooled);
  // Prompts for the sampler from caption texts (`where` names them in a DataError).
  Prompts encode_captions(const std::vector<std::string>& captions, const std::string& where);

  const ModelConfig& config() const { return frozen_->config(); }
  const ParamTable& table() const { return frozen_->table(); }
  const std::vector<int>& layers() const { return layers_; }
  const CaptionTokenizer& tokenizer() const { return *tokenizer_; }
  // Its weights' identity (base_model_checksum), recorded in the denoiser's checkpoints.
  uint64_t checksum() const { return frozen_->checksum(); }
  // Its bytes on this rank by category (FrozenModel::memory).
  const MemoryTracker& memory() const { return frozen_->memory(); }

 private:
  std::shared_ptr<const CaptionTokenizer> tokenizer_;
  std::vector<int> layers_;
  bool pooled_ = true;  // whether the denoiser reads a pooled vector
  int batch_, tokens_;
  std::unique_ptr<FrozenModel> frozen_;
  Batch tokens_batch_;         // the encoder's micro-batch: token ids
  std::vector<float> hidden_;  // one hidden state of a micro-batch, on the host
  Device* device_ = nullptr;
};

}  // namespace shardtrain
