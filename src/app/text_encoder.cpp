// See text_encoder.hpp.
#include "app/text_encoder.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <filesystem>

#include "app/frozen_model.hpp"
#include "app/hf_export.hpp"
#include "ckpt/checkpoint_io.hpp"
#include "ckpt/hf_model.hpp"
#include "core/error.hpp"
#include "core/format.hpp"
#include "model/families/flux/flux_family.hpp"
#include "model/family.hpp"

namespace shardtrain {

namespace {

std::string source_text(const TextEncoderOptions& o) { return "text_encoder.source='" + o.source + "'"; }

}  // namespace

std::vector<int> parse_hidden_layers(const std::string& text, int n_layer) {
  std::vector<int> layers;
  for (const std::string& item : split_comma_list(text)) {
    char* end = nullptr;
    errno = 0;
    const long v = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || errno != 0)
      throw UsageError("text_encoder.layers='" + text + "': '" + item +
                       "' is not an integer; give hidden-state indices such as -1 or 10,20,30");
    const long index = v < 0 ? v + n_layer + 1 : v;
    if (index < 0 || index > n_layer)
      throw UsageError(strprintf("text_encoder.layers='%s': %ld is out of range for a text encoder of %d layers: its "
                                 "hidden states are 0 (the embeddings) to %d (the final norm's output), or -1 to -%d",
                                 text.c_str(), v, n_layer, n_layer, n_layer + 1));
    layers.push_back(static_cast<int>(index));
  }
  if (layers.empty())
    throw UsageError("text_encoder.layers is empty: give the hidden states to condition on, e.g. -1 (the last)");
  return layers;
}

ParamTable text_encoder_param_table(const TextEncoderOptions& o, QuantConfig quant) {
  return frozen_model_table(o.source, "text_encoder.source", quant);
}

std::shared_ptr<const CaptionTokenizer> text_encoder_tokenizer(const TextEncoderOptions& o, int tokens) {
  std::string path = o.tokenizer;
  if (path.empty() && is_hf_model(o.source)) {
    const std::string file = (std::filesystem::path(o.source) / "tokenizer.json").string();
    if (std::filesystem::exists(file)) path = file;
  } else if (path.empty() && is_hdf5_file(o.source)) {
    path = recorded_tokenizer(read_checkpoint_state(o.source));
  }
  if (path.empty())
    throw UsageError(source_text(o) + " comes with no tokenizer (no tokenizer.json beside it, no data.tokenizer "
                                      "recorded): set text_encoder.tokenizer to its tokenizer.json");
  try {
    return std::make_shared<const CaptionTokenizer>(path, tokens);
  } catch (const DataError& e) {
    throw UsageError(std::string("text_encoder.tokenizer: ") + e.what());
  }
}

TextEncoder::TextEncoder(const Runtime& rt, Comm& world, Comm& shard, Comm& replica, const ComputeBackend& compute,
                         const EngineOptions& denoiser_options, const TextEncoderOptions& options,
                         const QuantConfig& quant, std::shared_ptr<const CaptionTokenizer> tokenizer, const ModelConfig& denoiser, int batch,
                         Watchdog* watchdog)
    : tokenizer_(std::move(tokenizer)), batch_(batch), tokens_(denoiser.context_len),
      device_(compute.backend().device) {
  std::unique_ptr<ParamTable> table;
  rt.agree_on([&] {
    table = std::make_unique<ParamTable>(text_encoder_param_table(options, quant));
    const ModelConfig& c = table->config();
    require_capability(c, "text encoder", source_text(options));
    layers_ = parse_hidden_layers(options.layers, c.n_layer);
    const int K = static_cast<int>(layers_.size()), D = K * c.n_embd;
    if (denoiser.context_dim != D || (denoiser.pooled_dim != 0 && denoiser.pooled_dim != D))
      throw UsageError(strprintf(
          "%s gives hidden states of %d values (n_embd) for each of text_encoder.layers='%s' (%d): the model takes "
          "model.context_dim=%d and model.pooled_dim=%d; set both to %d (the layers side by side, and their mean over "
          "the caption; a model without a pooled vector keeps model.pooled_dim=0)",
          source_text(options).c_str(), c.n_embd, options.layers.c_str(), K, denoiser.context_dim,
          denoiser.pooled_dim, D));
    pooled_ = denoiser.pooled_dim > 0;
    if (c.max_seq_len < tokens_)
      throw UsageError(strprintf("%s takes at most %d tokens, model.context_len=%d: lower model.context_len",
                                 source_text(options).c_str(), c.max_seq_len, tokens_));
    if (tokenizer_->vocab_size() > static_cast<uint32_t>(c.vocab_size))
      throw UsageError(strprintf("text_encoder.tokenizer '%s' has ids up to %u, beyond the encoder's vocabulary of %d: "
                                 "give the tokenizer the encoder was trained with",
                                 tokenizer_->path().c_str(), tokenizer_->vocab_size() - 1, c.vocab_size));
  });
  frozen_ = std::make_unique<FrozenModel>(rt, world, shard, replica, compute, denoiser_options, std::move(*table),
                                          options.source, batch_, tokens_, watchdog);
  hidden_.resize(static_cast<size_t>(batch_) * tokens_ * config().n_embd);
}

void TextEncoder::encode(Batch& batch) {
  const int rows = static_cast<int>(batch.shape(FLUX_CAPTION_LENGTHS)[0]), L = tokens_;
  const int D = static_cast<int>(layers_.size()) * config().n_embd;
  encode(batch.get<int32_t>(FLUX_CAPTION_IDS, static_cast<size_t>(rows) * L),
         batch.get<int32_t>(FLUX_CAPTION_LENGTHS, rows), rows,
         batch.at<float>(FLUX_ENCODER_HIDDEN_STATES, static_cast<size_t>(rows) * L * D),
         pooled_ ? batch.at<float>(FLUX_POOLED, static_cast<size_t>(rows) * D) : nullptr);
}

void TextEncoder::encode(const int32_t* ids, const int32_t* lengths, int count, float* context, float* pooled) {
  const int L = tokens_, C = config().n_embd, K = static_cast<int>(layers_.size()), D = K * C;
  const int deepest = std::min(*std::max_element(layers_.begin(), layers_.end()), config().n_layer);
  for (int first = 0; first < count; first += batch_) {
    const int rows = std::min(batch_, count - first);
    int32_t* tokens = tokens_batch_.put<int32_t>(BATCH_TOKENS, {batch_, L});
    for (int b = 0; b < batch_; b++)  // a short last micro-batch repeats its last caption
      std::copy_n(ids + static_cast<size_t>(first + std::min(b, rows - 1)) * L, L, tokens + static_cast<size_t>(b) * L);
    TransformerModel<float>& model = frozen_->model();
    const float* root = frozen_->engine().forward_hidden(model, tokens_batch_, deepest);
    for (int k = 0; k < K; k++) {
      device_->copy_to_host(hidden_.data(), model.hidden_states()->hidden_state(layers_[k], root),
                            hidden_.size() * sizeof(float));
      for (int b = 0; b < rows; b++) {
        const int length = lengths[first + b];
        for (int t = 0; t < L; t++) {
          float* dst = context + (static_cast<size_t>(first + b) * L + t) * D + static_cast<size_t>(k) * C;
          if (t < length)  // the pads after the caption: zero (a causal encoder's real tokens never saw them)
            std::copy_n(hidden_.data() + (static_cast<size_t>(b) * L + t) * C, C, dst);
          else
            std::fill(dst, dst + C, 0.0f);
        }
      }
    }
    for (int b = 0; b < rows && pooled; b++) {  // the pooled vector: the mean over the caption's tokens
      const int length = lengths[first + b];
      float* p = pooled + static_cast<size_t>(first + b) * D;
      std::fill(p, p + D, 0.0f);
      for (int t = 0; t < length; t++) {
        const float* row = context + (static_cast<size_t>(first + b) * L + t) * D;
        for (int j = 0; j < D; j++) p[j] += row[j];
      }
      if (length > 0)
        for (int j = 0; j < D; j++) p[j] /= static_cast<float>(length);
    }
  }
}

Prompts TextEncoder::encode_captions(const std::vector<std::string>& captions, const std::string& where) {
  const int L = tokens_, D = static_cast<int>(layers_.size()) * config().n_embd;
  const int count = static_cast<int>(captions.size());
  std::vector<int32_t> ids(static_cast<size_t>(count) * L), lengths(count);
  for (int i = 0; i < count; i++)
    lengths[i] = tokenizer_->tokenize(captions[i], ids.data() + static_cast<size_t>(i) * L,
                                      strprintf("%s: caption %d", where.c_str(), i));
  Prompts p;
  p.count = count, p.tokens = L;
  p.text.resize(static_cast<size_t>(count) * L * D);
  p.pooled.resize(static_cast<size_t>(count) * D);
  encode(ids.data(), lengths.data(), count, p.text.data(), p.pooled.data());
  return p;
}

}  // namespace shardtrain
