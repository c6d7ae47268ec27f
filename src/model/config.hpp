// The model's architecture and shape: the numbers that fix every parameter's shape and the
// model's arithmetic (docs/architecture.md, docs/llama.md).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shardtrain {

struct ModelConfig {
  // The model family's name (model/family.hpp): gpt2, llama, qwen2, qwen3, smollm3, phi3, flux, flux2.
  std::string arch = "gpt2";
  int n_layer = 2;
  int n_embd = 32;
  int n_head = 4;
  int vocab_size = 256;
  int max_seq_len = 64;  // gpt2: rows of the position table; llama: the longest sequence it takes
  // The keys of some families only (ModelFamily::config_keys); gpt2 keeps these defaults: n_kv_head
  // = n_head, an MLP of 4 n_embd, LayerNorm eps 1e-5, a tied head.
  int n_kv_head = 0;          // key/value heads; 0 = n_head (plain multi-head attention)
  int intermediate_size = 0;  // SwiGLU width; 0 = 4 n_embd
  int head_dim = 0;           // llama: attention head size; 0 = n_embd / n_head
  double rope_theta = 10000.0;
  std::string rope_scaling;  // llama: scaled rotary frequencies, "" for none (model/rope_scaling.hpp)
  std::string nope_layers;   // smollm3: the blocks without rotary embeddings ("3,7,11"), "" for none
  // llama families: each query sees itself and the sliding_window - 1 positions before it, in every
  // block (Mistral 7B v0.1's 4096); 0 = every earlier position.
  int sliding_window = 0;
  double norm_eps = 1e-5;
  bool tie_embeddings = true;  // LM head = token embedding; false: its own lm_head.weight
  // flux's (model/families/flux): n_layer double-stream blocks then n_single_layer single-stream
  // ones; n_embd = n_head x head size; max_seq_len bounds the image tokens per sample.
  int n_single_layer = 0;
  int in_channels = 64;    // packed latent channels (16 VAE channels x 2 x 2 patches)
  int context_dim = 4096;  // text-encoder (T5) width
  int context_len = 512;   // text tokens per sample
  int condition_len = 0;   // Kontext: condition-image tokens per sample after the target's (0: none)
  int pooled_dim = 768;    // pooled text vector (CLIP) width
  int pixel_patch = 0;     // > 0: a pixel-space model, each token a pixel_patch^2 RGB patch (data/pixel_image.hpp)
  bool guidance_embeds = true;  // a guidance embedder (dev, Kontext); schnell has none
  std::string rope_axes = "16,56,56";  // widths of the rotary axes (position ids' three coordinates)

  int head_size() const { return head_dim > 0 ? head_dim : n_embd / n_head; }
  // Whether the sliding window masks anything in sequences of seq_len tokens.
  bool window_within(int seq_len) const { return sliding_window > 0 && sliding_window < seq_len; }
  // Width of the query projection and of the attention's output: n_head x head size (n_embd unless
  // head_dim sets the head size apart, as Mistral-Nemo's 32 heads of 128 on a width of 5120).
  int attn_size() const { return n_head * head_size(); }
  int kv_heads() const { return n_kv_head > 0 ? n_kv_head : n_head; }
  int mlp_size() const { return intermediate_size > 0 ? intermediate_size : 4 * n_embd; }
  // Width of the fused q|k|v projection's output: query heads plus key and value heads.
  int qkv_size() const { return (n_head + 2 * kv_heads()) * head_size(); }
};

// The bounds every shape must keep, wherever it comes from (options, a checkpoint's attributes, a
// Hugging Face config.json): "" when usable, else what is wrong ("model.n_layer=... is not in
// ..."). Taken as 64-bit so a file's raw numbers are checked before they are narrowed; the
// parameter count is capped at 10^13 so that no size computed from the shape wraps around and a
// plan of an absurd shape answers at once instead of building a table for a minute.
// The one spelling of equal models, so that options, checkpoints and config.json compare by value:
// head_dim 0 for the usual head size, rope_scaling in its exact text form, nope_layers ascending
// (where they parse; a defect is left for the family's check to name), sliding_window 0 when
// max_seq_len does not exceed it.
void canonicalize(ModelConfig& m);

// model.nope_layers' text: block indices in [0, n_layer), comma-separated, each once. *without[l]
// is whether block l has no rotary embeddings; on a defect returns false with *error naming it.
bool parse_nope_layers(const std::string& text, int n_layer, std::vector<bool>* without, std::string* error);
// The text of such a list, ascending ("" for none).
std::string nope_layers_text(const std::vector<bool>& without);

std::string model_shape_defect(int64_t n_layer, int64_t n_embd, int64_t n_head, int64_t vocab_size,
                               int64_t max_seq_len, int64_t intermediate_size = 0);

}  // namespace shardtrain
