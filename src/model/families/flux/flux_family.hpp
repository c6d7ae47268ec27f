// The FLUX families (model/family.hpp): the FLUX.1 rectified-flow transformer (dev, schnell,
// Kontext) as diffusers' FluxTransformer2DModel computes it -- n_layer double-stream blocks (text
// and image with their own weights, joint attention over [text; image]) then n_single_layer
// single-stream blocks on the joined sequence, modulated by a conditioning vector made of the
// noise level, the guidance value and a pooled text vector; rotary positions on three axes from
// per-token ids, rotating interleaved pairs. Parameter names are diffusers'. docs/flux.md.
// And FLUX.2 (model.arch=flux2) as diffusers' Flux2Transformer2DModel: no biases, no pooled text
// vector, one modulation per block kind shared by all its blocks (in the root), SwiGLU MLPs
// (model.intermediate_size wide, 3 x n_embd in FLUX.2-dev), single blocks with one fused
// q|k|v|MLP product, rotary positions on four axes.
#pragma once

#include <string>
#include <vector>

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

// FLUX.2's, in the same spirit (no biases: one position per linear layer).
enum Flux2RootParam {
  FLUX2_X_EMBED_W, FLUX2_CTX_EMBED_W, FLUX2_TIME_1_W, FLUX2_TIME_2_W,
  FLUX2_MOD_IMG_W, FLUX2_MOD_TXT_W, FLUX2_MOD_SINGLE_W,  // double_stream_modulation_img/_txt, single_stream_modulation
  FLUX2_NORM_OUT_W, FLUX2_PROJ_OUT_W,
  FLUX2_GUIDANCE_1_W, FLUX2_GUIDANCE_2_W,  // with guidance_embeds only
};
enum Flux2DoubleParam {
  FLUX2_D_Q_W, FLUX2_D_K_W, FLUX2_D_V_W, FLUX2_D_NORM_Q, FLUX2_D_NORM_K, FLUX2_D_OUT_W,
  FLUX2_D_FF_IN_W, FLUX2_D_FF_OUT_W,  // ff.linear_in (gate | up), ff.linear_out
  FLUX2_D_STREAM_PARAMS,
};
enum Flux2SingleParam { FLUX2_S_QKV_MLP_W, FLUX2_S_NORM_Q, FLUX2_S_NORM_K, FLUX2_S_OUT_W };

// Where the model finds each layer of either variant: the positions of a linear layer's weight
// and bias in its unit (-1: the variant has none).
struct FluxLinear {
  int weight = -1, bias = -1;
};
struct FluxLayout {
  FluxLinear x_embed, ctx_embed, time1, time2, guidance1, guidance2, text1, text2, norm_out, proj_out;
  FluxLinear shared_mod[3];  // FLUX.2: the double blocks' image and text modulation, the single blocks'
  struct Stream {
    FluxLinear mod, q, k, v, out, ff1, ff2;
    int norm_q = -1, norm_k = -1;
  } stream[2];  // a double block's image stream, then its text stream
  FluxLinear s_mod, s_q, s_k, s_v, s_mlp, s_qkv_mlp, s_out;  // a single block's
  int s_norm_q = -1, s_norm_k = -1;
};
FluxLayout flux_layout(const ModelConfig& c);
// Whether c is FLUX.2 (model.arch=flux2); its MLPs' hidden width (FLUX.1: 4 n_embd).
bool is_flux2(const ModelConfig& c);
int flux_mlp_width(const ModelConfig& c);

// The linear layers of a block, each its own product (model/adapter.hpp's BlockProduct), in the
// order of the parameters: a double block's image stream's, then its text stream's (+
// FLUX_D_PRODUCTS); a single block's.
enum FluxDoubleProduct { FLUX_P_MOD, FLUX_P_Q, FLUX_P_K, FLUX_P_V, FLUX_P_OUT, FLUX_P_FF1, FLUX_P_FF2, FLUX_D_PRODUCTS };
enum FluxSingleProduct { FLUX_SP_MOD, FLUX_SP_Q, FLUX_SP_K, FLUX_SP_V, FLUX_SP_MLP, FLUX_SP_OUT, FLUX_SP_QKV_MLP };
// (FLUX.2's double blocks have the same products but the modulations; its single blocks two:
// FLUX_SP_QKV_MLP, the fused q|k|v|MLP input product, and FLUX_SP_OUT.)

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

// Coordinates per position id: FLUX.1's three (t, row, col), FLUX.2's four (t, row, col, l).
int flux_id_axes(const ModelConfig& c);
// A packed latent grid: rows x cols tokens, row-major.
struct PackedGrid {
  int rows = 0, cols = 0;
  int tokens() const { return rows * cols; }
  bool operator==(const PackedGrid& o) const { return rows == o.rows && cols == o.cols; }
};
// The position ids of a sample's tokens: img_ids (N + M, axes) -- the N target tokens' (0, row, col)
// on a grid `cols` wide, then the condition images' tokens, each image k on its own grid with t = 1
// (FLUX.1 Kontext's one image) or 10 + 10 k (FLUX.2's reference images) -- and txt_ids (L, axes):
// zeros in FLUX.1, (0, 0, 0, l) in FLUX.2, as diffusers' pipelines make them.
void fill_flux_ids(const ModelConfig& c, float* img_ids, float* txt_ids, int N, int cols,
                   const std::vector<PackedGrid>& conditions);
// DataError starting with `where` unless the family takes that many condition images (FLUX.1
// Kontext one, FLUX.2 any number).
void check_condition_image_count(const ModelConfig& c, size_t images, const std::string& where);

// Width of the timestep and guidance sinusoids.
inline constexpr int FLUX_TIME_CHANNELS = 256;

// model.rope_axes parsed: the widths of the `count` rotary axes, or "" and the message.
std::string parse_rope_axes(const std::string& text, int count, std::vector<int>* axes);

const ModelFamily& flux_family();
const ModelFamily& flux2_family();

}  // namespace shardtrain
