// The FLUX family (model/family.hpp): the FLUX.1 rectified-flow transformer (dev, schnell,
// Kontext) as diffusers' FluxTransformer2DModel computes it -- n_layer double-stream blocks (text
// and image with their own weights, joint attention over [text; image]) then n_single_layer
// single-stream blocks on the joined sequence, modulated by a conditioning vector made of the
// noise level, the guidance value and a pooled text vector; rotary positions on three axes from
// per-token ids, rotating interleaved pairs. Parameter names are diffusers'. docs/flux.md.
#pragma once

#include <array>
#include <string>

#include "model/batch.hpp"
#include "model/family.hpp"

namespace shardtrain {

// Positions of the parameters inside the units (weight, then bias, for each linear layer).
enum FluxRootParam {
  FLUX_X_EMBED_W, FLUX_X_EMBED_B, FLUX_CTX_EMBED_W, FLUX_CTX_EMBED_B,
  FLUX_TIME_1_W, FLUX_TIME_1_B, FLUX_TIME_2_W, FLUX_TIME_2_B,
  FLUX_TEXT_1_W, FLUX_TEXT_1_B, FLUX_TEXT_2_W, FLUX_TEXT_2_B,
  FLUX_NORM_OUT_W, FLUX_NORM_OUT_B, FLUX_PROJ_OUT_W, FLUX_PROJ_OUT_B,
  FLUX_GUIDANCE_1_W, FLUX_GUIDANCE_1_B, FLUX_GUIDANCE_2_W, FLUX_GUIDANCE_2_B,  // with guidance_embeds only
};
// A double-stream block: the image stream's layers, then the text stream's ("context", diffusers'
// add_* and *_context), in the same order, so that stream s's parameter is FLUX_D_... + s * offset.
enum FluxDoubleParam {
  FLUX_D_MOD_W, FLUX_D_MOD_B,  // norm1.linear: shift, scale, gate (attention), shift, scale, gate (MLP)
  FLUX_D_Q_W, FLUX_D_Q_B, FLUX_D_K_W, FLUX_D_K_B, FLUX_D_V_W, FLUX_D_V_B,
  FLUX_D_NORM_Q, FLUX_D_NORM_K,
  FLUX_D_OUT_W, FLUX_D_OUT_B,
  FLUX_D_FF1_W, FLUX_D_FF1_B, FLUX_D_FF2_W, FLUX_D_FF2_B,
  FLUX_D_STREAM_PARAMS,  // the text stream's follow
};
enum FluxSingleParam {
  FLUX_S_MOD_W, FLUX_S_MOD_B,  // norm.linear: shift, scale, gate
  FLUX_S_Q_W, FLUX_S_Q_B, FLUX_S_K_W, FLUX_S_K_B, FLUX_S_V_W, FLUX_S_V_B,
  FLUX_S_NORM_Q, FLUX_S_NORM_K,
  FLUX_S_MLP_W, FLUX_S_MLP_B,  // proj_mlp
  FLUX_S_OUT_W, FLUX_S_OUT_B,  // proj_out over [attention | MLP]
};

// The linear layers of a block, each its own product (model/adapter.hpp's BlockProduct), in the
// order of the parameters: a double block's image stream's, then its text stream's (+
// FLUX_D_PRODUCTS); a single block's.
enum FluxDoubleProduct { FLUX_P_MOD, FLUX_P_Q, FLUX_P_K, FLUX_P_V, FLUX_P_OUT, FLUX_P_FF1, FLUX_P_FF2, FLUX_D_PRODUCTS };
enum FluxSingleProduct { FLUX_SP_MOD, FLUX_SP_Q, FLUX_SP_K, FLUX_SP_V, FLUX_SP_MLP, FLUX_SP_OUT };

// The micro-batch's tensors (model/batch.hpp), named as diffusers' forward names its arguments:
// packed latents (B, N + M, in_channels) -- the N noisy target tokens, then Kontext's M clean
// condition tokens (model.condition_len) --, text embeddings (B, L, context_dim), the pooled
// vector (B, pooled_dim), the noise level sigma in [0, 1] (B), the guidance value (B; with
// guidance_embeds), position ids (N + M, 3) and (L, 3), and the regression target of the N
// target tokens (B, N, in_channels).
inline constexpr const char* FLUX_HIDDEN_STATES = "hidden_states";
inline constexpr const char* FLUX_ENCODER_HIDDEN_STATES = "encoder_hidden_states";
inline constexpr const char* FLUX_POOLED = "pooled_projections";
inline constexpr const char* FLUX_TIMESTEP = BATCH_NOISE_LEVEL;
inline constexpr const char* FLUX_GUIDANCE = "guidance";
inline constexpr const char* FLUX_IMG_IDS = "img_ids";
inline constexpr const char* FLUX_TXT_IDS = "txt_ids";
inline constexpr const char* FLUX_TARGET = "target";
// With a text encoder in the job (text_encoder.source): the captions' token ids (B, L), zero after
// each caption's length (B), from which the encoder computes encoder_hidden_states and
// pooled_projections before the model reads them.
inline constexpr const char* FLUX_CAPTION_IDS = "caption_ids";
inline constexpr const char* FLUX_CAPTION_LENGTHS = "caption_lengths";

// The image tokens' position ids (N + M, 3): the target's (0, row, col) on a grid `cols` wide, then
// Kontext's M condition tokens' (1, row, col) on their own grid `condition_cols` wide.
inline void fill_flux_image_ids(float* ids, int N, int cols, int M, int condition_cols) {
  for (int i = 0; i < N + M; i++) {
    const bool condition = i >= N;
    const int k = condition ? i - N : i, w = condition ? condition_cols : cols;
    ids[3 * i] = condition ? 1.0f : 0.0f, ids[3 * i + 1] = static_cast<float>(k / w), ids[3 * i + 2] = static_cast<float>(k % w);
  }
}

// Width of the timestep and guidance sinusoids.
inline constexpr int FLUX_TIME_CHANNELS = 256;

// model.rope_axes parsed: the widths of the three rotary axes, or "" and the message.
std::string parse_rope_axes(const std::string& text, std::array<int, 3>* axes);

const ModelFamily& flux_family();

}  // namespace shardtrain
