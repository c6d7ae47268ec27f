// The FLUX families' descriptor (flux_family.hpp), FLUX.1 and FLUX.2 alike. Units: the root (the
// embedders, the conditioning MLPs, FLUX.2's shared modulations and the output layers, resident
// from the forward's start to the backward's end), then the double-stream blocks ("double") and
// the single-stream blocks ("single") in forward order.
#include "model/families/flux/flux_family.hpp"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "backend/gpu_memory.hpp"
#include "core/error.hpp"
#include "model/families/flux/flux_bfl.hpp"
#include "model/families/flux/flux_model.hpp"
#include "model/param_table.hpp"

namespace shardtrain {

std::string parse_rope_axes(const std::string& text, int count, std::vector<int>* axes) {
  const std::string want = count == 3 ? "three even widths >= 2, comma-separated (FLUX.1: 16,56,56)"
                                      : "four even widths >= 2, comma-separated (FLUX.2: 32,32,32,32)";
  std::stringstream in(text);
  std::string part;
  axes->clear();
  while (std::getline(in, part, ',')) {
    char* end = nullptr;
    const long v = std::strtol(part.c_str(), &end, 10);
    if (static_cast<int>(axes->size()) == count || part.empty() || *end != '\0' || v < 2 || v > (1 << 16) || v % 2)
      return "model.rope_axes='" + text + "' must be " + want;
    axes->push_back(static_cast<int>(v));
  }
  if (static_cast<int>(axes->size()) != count) return "model.rope_axes='" + text + "' must be " + want;
  return "";
}

bool is_flux2(const ModelConfig& c) { return c.arch == "flux2"; }
int flux_mlp_width(const ModelConfig& c) {
  return !is_flux2(c) ? 4 * c.n_embd : c.intermediate_size > 0 ? c.intermediate_size : 3 * c.n_embd;
}
int flux_id_axes(const ModelConfig& c) { return is_flux2(c) ? 4 : 3; }

void fill_flux_ids(const ModelConfig& c, float* img_ids, float* txt_ids, int N, int cols,
                   const std::vector<PackedGrid>& conditions) {
  const int A = flux_id_axes(c);
  auto fill_grid = [&](float t, int first, int count, int width) {
    for (int k = 0; k < count; k++) {
      float* id = img_ids + static_cast<size_t>(A) * (first + k);
      std::fill(id, id + A, 0.0f);
      id[0] = t, id[1] = static_cast<float>(k / width), id[2] = static_cast<float>(k % width);
    }
  };
  fill_grid(0.0f, 0, N, cols);
  int first = N;
  for (size_t k = 0; k < conditions.size(); k++) {
    fill_grid(is_flux2(c) ? 10.0f * (k + 1) : 1.0f, first, conditions[k].tokens(), conditions[k].cols);
    first += conditions[k].tokens();
  }
  for (int l = 0; l < c.context_len; l++) {
    float* id = txt_ids + static_cast<size_t>(A) * l;
    std::fill(id, id + A, 0.0f);
    if (A == 4) id[3] = static_cast<float>(l);
  }
}

void check_condition_image_count(const ModelConfig& c, size_t images, const std::string& where) {
  if (images > 1 && !is_flux2(c))
    throw DataError(strprintf("%s holds %zu condition images per sample; FLUX.1 Kontext edits one (several reference "
                              "images are FLUX.2's, model.arch=flux2): give one",
                              where.c_str(), images));
}

FluxLayout flux_layout(const ModelConfig& c) {
  FluxLayout L;
  if (is_flux2(c)) {  // the positions of flux2's add_params
    L.x_embed.weight = FLUX2_X_EMBED_W, L.ctx_embed.weight = FLUX2_CTX_EMBED_W;
    L.time1.weight = FLUX2_TIME_1_W, L.time2.weight = FLUX2_TIME_2_W;
    L.shared_mod[0].weight = FLUX2_MOD_IMG_W, L.shared_mod[1].weight = FLUX2_MOD_TXT_W;
    L.shared_mod[2].weight = FLUX2_MOD_SINGLE_W;
    L.norm_out.weight = FLUX2_NORM_OUT_W, L.proj_out.weight = FLUX2_PROJ_OUT_W;
    if (c.guidance_embeds) L.guidance1.weight = FLUX2_GUIDANCE_1_W, L.guidance2.weight = FLUX2_GUIDANCE_2_W;
    for (int s = 0; s < 2; s++) {
      FluxLayout::Stream& t = L.stream[s];
      const int p = s * FLUX2_D_STREAM_PARAMS;
      t.q.weight = p + FLUX2_D_Q_W, t.k.weight = p + FLUX2_D_K_W, t.v.weight = p + FLUX2_D_V_W;
      t.norm_q = p + FLUX2_D_NORM_Q, t.norm_k = p + FLUX2_D_NORM_K, t.out.weight = p + FLUX2_D_OUT_W;
      t.ff1.weight = p + FLUX2_D_FF_IN_W, t.ff2.weight = p + FLUX2_D_FF_OUT_W;
    }
    L.s_qkv_mlp.weight = FLUX2_S_QKV_MLP_W, L.s_norm_q = FLUX2_S_NORM_Q, L.s_norm_k = FLUX2_S_NORM_K;
    L.s_out.weight = FLUX2_S_OUT_W;
    return L;
  }
  auto biased = [](int weight) { return FluxLinear{weight, weight + 1}; };
  L.x_embed = biased(FLUX_X_EMBED_W), L.ctx_embed = biased(FLUX_CTX_EMBED_W);
  L.time1 = biased(FLUX_TIME_1_W), L.time2 = biased(FLUX_TIME_2_W);
  L.text1 = biased(FLUX_TEXT_1_W), L.text2 = biased(FLUX_TEXT_2_W);
  L.norm_out = biased(FLUX_NORM_OUT_W), L.proj_out = biased(FLUX_PROJ_OUT_W);
  if (c.guidance_embeds) L.guidance1 = biased(FLUX_GUIDANCE_1_W), L.guidance2 = biased(FLUX_GUIDANCE_2_W);
  for (int s = 0; s < 2; s++) {
    FluxLayout::Stream& t = L.stream[s];
    const int p = s * FLUX_D_STREAM_PARAMS;
    t.mod = biased(p + FLUX_D_MOD_W), t.q = biased(p + FLUX_D_Q_W), t.k = biased(p + FLUX_D_K_W);
    t.v = biased(p + FLUX_D_V_W), t.norm_q = p + FLUX_D_NORM_Q, t.norm_k = p + FLUX_D_NORM_K;
    t.out = biased(p + FLUX_D_OUT_W), t.ff1 = biased(p + FLUX_D_FF1_W), t.ff2 = biased(p + FLUX_D_FF2_W);
  }
  L.s_mod = biased(FLUX_S_MOD_W), L.s_q = biased(FLUX_S_Q_W), L.s_k = biased(FLUX_S_K_W), L.s_v = biased(FLUX_S_V_W);
  L.s_norm_q = FLUX_S_NORM_Q, L.s_norm_k = FLUX_S_NORM_K;
  L.s_mlp = biased(FLUX_S_MLP_W), L.s_out = biased(FLUX_S_OUT_W);
  return L;
}

namespace {

class FluxFamily final : public ModelFamily {
 public:
  explicit FluxFamily(bool flux2) : flux2_(flux2) {}
  const char* name() const override { return flux2_ ? "flux2" : "flux"; }
  const char* description() const override {
    return flux2_ ? "FLUX.2 diffusion transformer (no biases, shared modulations, SwiGLU; diffusers' names)"
                  : "FLUX.1 diffusion transformer (double- then single-stream blocks, flow matching; diffusers' names)";
  }
  std::string summary(const ModelConfig& c) const override {
    if (flux2_)
      return strprintf("FLUX.2 double=%d single=%d C=%d H=%d mlp=%d in=%d text=%dx%d %s rope=%s theta=%g eps=%g",
                       c.n_layer, c.n_single_layer, c.n_embd, c.n_head, flux_mlp_width(c), c.in_channels,
                       c.context_len, c.context_dim, c.guidance_embeds ? "guidance" : "no-guidance",
                       c.rope_axes.c_str(), c.rope_theta, c.norm_eps);
    return strprintf("FLUX double=%d single=%d C=%d H=%d in=%d%s text=%dx%d pooled=%d %s rope=%s theta=%g eps=%g",
                     c.n_layer, c.n_single_layer, c.n_embd, c.n_head, c.in_channels,
                     c.pixel_patch ? strprintf(" (pixels, %dx%d patches)", c.pixel_patch, c.pixel_patch).c_str() : "",
                     c.context_len, c.context_dim, c.pooled_dim, c.guidance_embeds ? "guidance" : "no-guidance",
                     c.rope_axes.c_str(), c.rope_theta, c.norm_eps);
  }
  std::vector<std::string> config_keys() const override {
    std::vector<std::string> keys = {"model.n_single_layer", "model.in_channels", "model.context_dim",
                                     "model.context_len",    "model.pooled_dim",  "model.guidance_embeds",
                                     "model.rope_axes",      "model.rope_theta",  "model.norm_eps",
                                     "model.condition_len"};
    keys.push_back(flux2_ ? "model.intermediate_size" : "model.pixel_patch");
    return keys;
  }
  std::string config_defect(const ModelConfig& m) const override {
    std::vector<int> axes;
    const std::string bad_axes = parse_rope_axes(m.rope_axes, flux_id_axes(m), &axes);
    if (!bad_axes.empty()) return bad_axes;
    int covered = 0;
    for (int a : axes) covered += a;
    if (covered != m.head_size())
      return strprintf("model.rope_axes='%s' covers %d dimensions, the head has model.n_embd / model.n_head = %d: the "
                       "axes must add up to the head size",
                       m.rope_axes.c_str(), covered, m.head_size());
    if (flux2_ && m.pooled_dim != 0)
      return strprintf("model.pooled_dim=%d: FLUX.2 reads no pooled text vector; set model.pooled_dim=0", m.pooled_dim);
    if (flux2_ && m.pixel_patch != 0)
      return strprintf("model.pixel_patch=%d: FLUX.2 takes latents; pixel-space models are model.arch=flux",
                       m.pixel_patch);
    const std::pair<const char*, int> widths[] = {{"model.in_channels", m.in_channels},
                                                  {"model.context_dim", m.context_dim},
                                                  {"model.context_len", m.context_len},
                                                  {"model.pooled_dim", flux2_ ? 1 : m.pooled_dim},
                                                  {"model.intermediate_size", flux_mlp_width(m)}};
    for (const auto& [key, v] : widths)
      if (v < 1 || v > (1 << 20)) return strprintf("%s=%d is not in [1, 2^20]", key, v);
    if (m.pixel_patch < 0 || m.pixel_patch > 64) return strprintf("model.pixel_patch=%d is not in [0, 64]", m.pixel_patch);
    if (m.pixel_patch > 0 && m.in_channels != 3 * m.pixel_patch * m.pixel_patch)
      return strprintf("model.pixel_patch=%d makes tokens of 3 x %d x %d = %d channels, model.in_channels=%d: set "
                       "model.in_channels=%d",
                       m.pixel_patch, m.pixel_patch, m.pixel_patch, 3 * m.pixel_patch * m.pixel_patch, m.in_channels,
                       3 * m.pixel_patch * m.pixel_patch);
    if (m.condition_len < 0 || m.condition_len > (1 << 20))
      return strprintf("model.condition_len=%d is not in [0, 2^20]", m.condition_len);
    if (m.n_single_layer < 0 || m.n_single_layer > 4096)
      return strprintf("model.n_single_layer=%d is not in [0, 4096]", m.n_single_layer);
    if (m.n_kv_head != 0 && m.n_kv_head != m.n_head)
      return strprintf("model.n_kv_head=%d: FLUX attends with as many key/value heads as query heads", m.n_kv_head);
    if (!flux2_ && m.intermediate_size != 0 && m.intermediate_size != 4 * m.n_embd)
      return strprintf("model.intermediate_size=%d: FLUX.1's MLPs are 4 x model.n_embd wide", m.intermediate_size);
    // diffusers stores FLUX.2's width as mlp_ratio = F / C and makes int(C * mlp_ratio) of it again.
    if (flux2_ && static_cast<int>(m.n_embd * (static_cast<double>(flux_mlp_width(m)) / m.n_embd)) != flux_mlp_width(m))
      return strprintf("model.intermediate_size=%d: diffusers keeps it as mlp_ratio = %d / %d, which gives back %d; "
                       "choose a width that survives that (a multiple of model.n_embd does)",
                       flux_mlp_width(m), flux_mlp_width(m), m.n_embd,
                       static_cast<int>(m.n_embd * (static_cast<double>(flux_mlp_width(m)) / m.n_embd)));
    if (!(m.rope_theta > 0) || !std::isfinite(m.rope_theta))
      return strprintf("model.rope_theta=%g must be > 0", m.rope_theta);
    if (!(m.norm_eps > 0) || !std::isfinite(m.norm_eps)) return strprintf("model.norm_eps=%g must be > 0", m.norm_eps);
    const double C = m.n_embd, F = flux_mlp_width(m);
    const double params = m.n_layer * (8 * C * C + 6 * C * F) + m.n_single_layer * (4 * C * C + 3 * C * F);
    if (params > 1e13) return "model.n_layer, model.n_single_layer and model.n_embd make more than 10^13 parameters";
    return "";
  }

  void add_params(ParamTable& t) const override {
    if (flux2_) return add_flux2_params(t);
    const ModelConfig& c = t.config();
    const int C = c.n_embd, D = c.head_size(), F = 4 * C;
    auto linear = [&](int unit, const std::string& name, int out, int in, InitRule init = INIT_NORMAL) {
      t.add_param(unit, name + ".weight", {out, in}, init, true);
      t.add_param(unit, name + ".bias", {out}, INIT_ZEROS, false);
    };
    // Order must match enum FluxRootParam.
    linear(ROOT_UNIT, "x_embedder", C, c.in_channels);
    linear(ROOT_UNIT, "context_embedder", C, c.context_dim);
    linear(ROOT_UNIT, "time_text_embed.timestep_embedder.linear_1", C, FLUX_TIME_CHANNELS);
    linear(ROOT_UNIT, "time_text_embed.timestep_embedder.linear_2", C, C);
    linear(ROOT_UNIT, "time_text_embed.text_embedder.linear_1", C, c.pooled_dim);
    linear(ROOT_UNIT, "time_text_embed.text_embedder.linear_2", C, C);
    linear(ROOT_UNIT, "norm_out.linear", 2 * C, C);
    linear(ROOT_UNIT, "proj_out", c.in_channels, C);
    if (c.guidance_embeds) {
      linear(ROOT_UNIT, "time_text_embed.guidance_embedder.linear_1", C, FLUX_TIME_CHANNELS);
      linear(ROOT_UNIT, "time_text_embed.guidance_embedder.linear_2", C, C);
    }
    for (int l = 0; l < c.n_layer; l++) {
      const std::string h = "transformer_blocks." + std::to_string(l);
      const int u = t.add_unit(h, "double");
      // Order must match enum FluxDoubleParam, the image stream's, then the text stream's.
      const char* names[2][8] = {
          {"norm1.linear", "attn.to_q", "attn.to_k", "attn.to_v", "attn.norm_q", "attn.norm_k", "attn.to_out.0", "ff"},
          {"norm1_context.linear", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.norm_added_q",
           "attn.norm_added_k", "attn.to_add_out", "ff_context"}};
      for (const auto& n : names) {
        linear(u, h + "." + n[0], 6 * C, C);
        for (int i = 1; i <= 3; i++) linear(u, h + "." + n[i], C, C);
        t.add_param(u, h + "." + n[4] + ".weight", {D}, INIT_ONES, false);
        t.add_param(u, h + "." + n[5] + ".weight", {D}, INIT_ONES, false);
        linear(u, h + "." + n[6], C, C, INIT_NORMAL_RESIDUAL);
        linear(u, h + "." + n[7] + ".net.0.proj", F, C);
        linear(u, h + "." + n[7] + ".net.2", C, F, INIT_NORMAL_RESIDUAL);
      }
    }
    for (int l = 0; l < c.n_single_layer; l++) {
      const std::string h = "single_transformer_blocks." + std::to_string(l);
      const int u = t.add_unit(h, "single");
      // Order must match enum FluxSingleParam.
      linear(u, h + ".norm.linear", 3 * C, C);
      for (const char* n : {"attn.to_q", "attn.to_k", "attn.to_v"}) linear(u, h + "." + n, C, C);
      t.add_param(u, h + ".attn.norm_q.weight", {D}, INIT_ONES, false);
      t.add_param(u, h + ".attn.norm_k.weight", {D}, INIT_ONES, false);
      linear(u, h + ".proj_mlp", F, C);
      linear(u, h + ".proj_out", C, C + F, INIT_NORMAL_RESIDUAL);
    }
  }
  // FLUX.2's (order must match enum Flux2RootParam, Flux2DoubleParam, Flux2SingleParam): no bias
  // anywhere, the modulations in the root.
  void add_flux2_params(ParamTable& t) const {
    const ModelConfig& c = t.config();
    const int C = c.n_embd, D = c.head_size(), F = flux_mlp_width(c);
    auto linear = [&](int unit, const std::string& name, int out, int in, InitRule init = INIT_NORMAL) {
      t.add_param(unit, name + ".weight", {out, in}, init, true);
    };
    auto norm = [&](int unit, const std::string& name) { t.add_param(unit, name + ".weight", {D}, INIT_ONES, false); };
    linear(ROOT_UNIT, "x_embedder", C, c.in_channels);
    linear(ROOT_UNIT, "context_embedder", C, c.context_dim);
    linear(ROOT_UNIT, "time_guidance_embed.timestep_embedder.linear_1", C, FLUX_TIME_CHANNELS);
    linear(ROOT_UNIT, "time_guidance_embed.timestep_embedder.linear_2", C, C);
    linear(ROOT_UNIT, "double_stream_modulation_img.linear", 6 * C, C);
    linear(ROOT_UNIT, "double_stream_modulation_txt.linear", 6 * C, C);
    linear(ROOT_UNIT, "single_stream_modulation.linear", 3 * C, C);
    linear(ROOT_UNIT, "norm_out.linear", 2 * C, C);
    linear(ROOT_UNIT, "proj_out", c.in_channels, C);
    if (c.guidance_embeds) {
      linear(ROOT_UNIT, "time_guidance_embed.guidance_embedder.linear_1", C, FLUX_TIME_CHANNELS);
      linear(ROOT_UNIT, "time_guidance_embed.guidance_embedder.linear_2", C, C);
    }
    for (int l = 0; l < c.n_layer; l++) {
      const std::string h = "transformer_blocks." + std::to_string(l) + ".";
      const int u = t.add_unit(h.substr(0, h.size() - 1), "double");
      const char* names[2][7] = {{"attn.to_q", "attn.to_k", "attn.to_v", "attn.norm_q", "attn.norm_k", "attn.to_out.0",
                                  "ff"},
                                 {"attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.norm_added_q",
                                  "attn.norm_added_k", "attn.to_add_out", "ff_context"}};
      for (const auto& n : names) {
        for (int i = 0; i < 3; i++) linear(u, h + n[i], C, C);
        norm(u, h + n[3]), norm(u, h + n[4]);
        linear(u, h + n[5], C, C, INIT_NORMAL_RESIDUAL);
        linear(u, h + n[6] + ".linear_in", 2 * F, C);
        linear(u, h + n[6] + ".linear_out", C, F, INIT_NORMAL_RESIDUAL);
      }
    }
    for (int l = 0; l < c.n_single_layer; l++) {
      const std::string h = "single_transformer_blocks." + std::to_string(l) + ".";
      const int u = t.add_unit(h.substr(0, h.size() - 1), "single");
      linear(u, h + "attn.to_qkv_mlp_proj", 3 * C + 2 * F, C);
      norm(u, h + "attn.norm_q"), norm(u, h + "attn.norm_k");
      linear(u, h + "attn.to_out", C, C + F, INIT_NORMAL_RESIDUAL);
    }
  }
  // The conditioning reaches every block (the modulations) and the embedders take the inputs: all
  // of the root but the output layers needs the blocks' gradients.
  std::vector<int> input_params() const override {
    std::vector<int> p;
    if (flux2_) {
      for (int i = FLUX2_X_EMBED_W; i <= FLUX2_GUIDANCE_2_W; i++)
        if (i != FLUX2_NORM_OUT_W && i != FLUX2_PROJ_OUT_W) p.push_back(i);
      return p;
    }
    for (int i = FLUX_X_EMBED_W; i <= FLUX_GUIDANCE_2_B; i++)
      if (i < FLUX_NORM_OUT_W || i > FLUX_PROJ_OUT_B) p.push_back(i);
    return p;
  }
  // Per predicted image token of a sample: 6 x the multiply-adds of every linear layer (per token
  // of its stream -- Kontext's condition tokens too --, per sample for the modulations and the
  // conditioning) + 12 S^2 C per block for the joint attention's scores and weighted sums (both
  // counted in full: no mask), over N.
  // FLUX.2: the same with its widths: per token 4 C^2 + 3 C F per stream of a double block and
  // C (3C + 2F) + (C + F) C per single block; per sample its three shared modulations (15 C^2).
  double flops_per_token(const ParamTable& t, int seq_len) const override {
    const ModelConfig& c = t.config();
    const double C = c.n_embd, N = seq_len, M = N + c.condition_len, L = c.context_len, S = M + L;
    if (flux2_) {
      const double F = flux_mlp_width(c);
      const double per_sample2 = M * c.in_channels * C + L * c.context_dim * C + N * C * c.in_channels +
                                 FLUX_TIME_CHANNELS * C * (c.guidance_embeds ? 2 : 1) +
                                 C * C * (c.guidance_embeds ? 2 : 1) + 15 * C * C + 2 * C * C +
                                 c.n_layer * (4 * C * C + 3 * C * F) * S +
                                 c.n_single_layer * (4 * C * C + 3 * C * F) * S;
      const double attention2 = 2.0 * (c.n_layer + c.n_single_layer) * S * S * C;
      return (6.0 * per_sample2 + 6.0 * attention2) / N;
    }
    const double per_sample = M * c.in_channels * C + L * c.context_dim * C + N * C * c.in_channels +  // in, out
                              FLUX_TIME_CHANNELS * C * (c.guidance_embeds ? 2 : 1) + c.pooled_dim * C +
                              C * C * (c.guidance_embeds ? 3 : 2) + 2 * C * C +  // conditioning, norm_out
                              c.n_layer * (12 * C * C * S + 12 * C * C) +        // double: per token, modulations
                              c.n_single_layer * (12 * C * C * S + 3 * C * C);   // single: q,k,v, mlp, proj_out
    const double attention = 2.0 * (c.n_layer + c.n_single_layer) * S * S * C;
    return (6.0 * per_sample + 6.0 * attention) / N;
  }

  std::unique_ptr<TransformerModel<float>> make_model(const ParamTable& table, int batch, int seq_len,
                                                      Checkpointing ckpt, const LayerOps<float>& ops,
                                                      DType act) const override {
    return std::make_unique<FluxModel<float>>(table, batch, seq_len, ckpt, ops, act);
  }
  std::unique_ptr<TransformerModel<double>> make_model(const ParamTable& table, int batch, int seq_len,
                                                       Checkpointing ckpt, const LayerOps<double>& ops,
                                                       DType act) const override {
    return std::make_unique<FluxModel<double>>(table, batch, seq_len, ckpt, ops, act);
  }
  std::vector<size_t> activation_arrays(const ModelConfig& c, int batch, int seq_len, Checkpointing ckpt,
                                        DType act) const override {
    return FluxModel<float>::buffer_elements(c, batch, seq_len, ckpt, act);
  }
  std::vector<size_t> saved_tensor_elements(const ModelConfig&, int, int) const override { return {}; }
  size_t plan_decode_elements(const ModelConfig&, int, int) const override { return 0; }
  std::vector<LinearShape> gemm_shapes(const ModelConfig& c) const override {
    const int C = c.n_embd, F = flux_mlp_width(c);
    if (flux2_)
      return {{C, 6 * C}, {C, 3 * C}, {C, C}, {C, 2 * F}, {F, C}, {C, 3 * C + 2 * F}, {C + F, C}, {c.in_channels, C},
              {c.context_dim, C}, {FLUX_TIME_CHANNELS, C}, {C, 2 * C}, {C, c.in_channels}};
    return {{C, 6 * C}, {C, C}, {C, F}, {F, C}, {C, 3 * C}, {C + F, C}, {c.in_channels, C}, {c.context_dim, C},
            {FLUX_TIME_CHANNELS, C}, {c.pooled_dim, C}, {C, 2 * C}, {C, c.in_channels}};
  }
  NormKind norm_kind() const override { return NORM_LAYER; }
  int attention_tokens(const ModelConfig& c, int seq_len) const override {
    return c.context_len + seq_len + c.condition_len;
  }
  // Its kernels meet rows of three kinds per sample -- N image, L text, S = L + N joint tokens -- and
  // the column sums' chunking does not grow steadily with the rows (gpu_memory.hpp's column_chunks),
  // so each kind asks. The biased products: at most 4 x n_embd wide on tokens (the embedders too),
  // 6 x n_embd on the samples (the modulations).
  std::vector<KernelWorkspace> kernel_workspaces(const ModelConfig& c, int batch, int seq_len) const override {
    const int S = attention_tokens(c, seq_len), H = c.n_head, D = c.head_size(), C = c.n_embd;
    std::vector<KernelWorkspace> w = {
        {gpu::attention_backward_workspace_bytes(batch, S, H, H, D), "joint attention backward"}};
    if (!flux2_) w.push_back({gpu::matmul_backward_workspace_bytes(batch, 6 * C), "matmul backward (bias)"});
    for (int rows : {seq_len + c.condition_len, c.context_len, S}) {
      w.push_back({gpu::rmsnorm_backward_workspace_bytes(batch * rows * H, D), "q/k RMSNorm backward"});
      w.push_back({gpu::modulate_backward_workspace_bytes(rows, C), "adaptive LayerNorm backward"});
      w.push_back({gpu::gate_backward_workspace_bytes(rows, C), "gated residual backward"});
      if (!flux2_)  // FLUX.2 has no bias
        w.push_back({gpu::matmul_backward_workspace_bytes(batch * rows, flux_mlp_width(c)), "matmul backward (bias)"});
    }
    return w;
  }
  bool samples_images() const override { return true; }
  // The modulation (AdaLayerNormZero's linear of each block) stays full precision, as the FLUX
  // QLoRA recipes keep it: few parameters, and every token's shift, scale and gate come from it.
  bool quantizable(const LinearSite& site) const override { return std::string(site.module).find("norm") == std::string::npos; }
  // (FLUX.2's modulations are the root's, never quantized: only the blocks' linear layers are.)
  bool token_data() const override { return false; }
  bool fp16_activations() const override { return false; }
  bool fixes_max_seq_len() const override { return false; }

  // Adapters: every linear layer of the blocks, by diffusers' module names.
  std::vector<LinearSite> linear_sites(const ModelConfig& c, const std::string& kind) const override {
    const int C = c.n_embd, F = flux_mlp_width(c);
    std::vector<LinearSite> sites;
    auto site = [&](const char* module, int weight, int product, int in, int out) {
      sites.push_back({module, weight, flux2_ ? -1 : weight + 1, product, in, out, 0, out});
    };
    if (flux2_ && kind == "double") {  // the modulations are the root's: no site
      const char* names[2][6] = {
          {"attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.linear_in", "ff.linear_out"},
          {"attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out", "ff_context.linear_in",
           "ff_context.linear_out"}};
      for (int s = 0; s < 2; s++) {
        const int p = s * FLUX2_D_STREAM_PARAMS, q = s * FLUX_D_PRODUCTS;
        site(names[s][0], p + FLUX2_D_Q_W, q + FLUX_P_Q, C, C);
        site(names[s][1], p + FLUX2_D_K_W, q + FLUX_P_K, C, C);
        site(names[s][2], p + FLUX2_D_V_W, q + FLUX_P_V, C, C);
        site(names[s][3], p + FLUX2_D_OUT_W, q + FLUX_P_OUT, C, C);
        site(names[s][4], p + FLUX2_D_FF_IN_W, q + FLUX_P_FF1, C, 2 * F);
        site(names[s][5], p + FLUX2_D_FF_OUT_W, q + FLUX_P_FF2, F, C);
      }
      return sites;
    }
    if (flux2_) {
      site("attn.to_qkv_mlp_proj", FLUX2_S_QKV_MLP_W, FLUX_SP_QKV_MLP, C, 3 * C + 2 * F);
      site("attn.to_out", FLUX2_S_OUT_W, FLUX_SP_OUT, C + F, C);
      return sites;
    }
    if (kind == "double") {
      const char* names[2][7] = {
          {"norm1.linear", "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2"},
          {"norm1_context.linear", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
           "ff_context.net.0.proj", "ff_context.net.2"}};
      for (int s = 0; s < 2; s++) {
        const int p = s * FLUX_D_STREAM_PARAMS, q = s * FLUX_D_PRODUCTS;
        site(names[s][0], p + FLUX_D_MOD_W, q + FLUX_P_MOD, C, 6 * C);
        site(names[s][1], p + FLUX_D_Q_W, q + FLUX_P_Q, C, C);
        site(names[s][2], p + FLUX_D_K_W, q + FLUX_P_K, C, C);
        site(names[s][3], p + FLUX_D_V_W, q + FLUX_P_V, C, C);
        site(names[s][4], p + FLUX_D_OUT_W, q + FLUX_P_OUT, C, C);
        site(names[s][5], p + FLUX_D_FF1_W, q + FLUX_P_FF1, C, F);
        site(names[s][6], p + FLUX_D_FF2_W, q + FLUX_P_FF2, F, C);
      }
      return sites;
    }
    site("norm.linear", FLUX_S_MOD_W, FLUX_SP_MOD, C, 3 * C);
    site("attn.to_q", FLUX_S_Q_W, FLUX_SP_Q, C, C);
    site("attn.to_k", FLUX_S_K_W, FLUX_SP_K, C, C);
    site("attn.to_v", FLUX_S_V_W, FLUX_SP_V, C, C);
    site("proj_mlp", FLUX_S_MLP_W, FLUX_SP_MLP, C, F);
    site("proj_out", FLUX_S_OUT_W, FLUX_SP_OUT, C + F, C);
    return sites;
  }
  std::string module_path(const ModelConfig& c, int block, const LinearSite& site) const override {
    return block < c.n_layer ? "transformer_blocks." + std::to_string(block) + "." + site.module
                             : "single_transformer_blocks." + std::to_string(block - c.n_layer) + "." + site.module;
  }
  int product_rows(const ModelConfig& c, int batch, int seq_len) const override {
    return batch * attention_tokens(c, seq_len);
  }
  int adapter_key_rows(const ModelConfig& c, int batch, int seq_len) const override {
    return FluxModel<float>::dropout_key_rows(c, batch, seq_len);
  }

  // diffusers' transformer folder: config.json (_class_name FluxTransformer2DModel) and
  // diffusion_pytorch_model*.safetensors, our names and layouts as they are.
  const char* hf_class() const override { return flux2_ ? "Flux2Transformer2DModel" : "FluxTransformer2DModel"; }
  bool reads_model_type(const std::string&) const override { return false; }
  bool reads_hf_folder(const HfConfig& j) const override { return j.text("_class_name", "") == hf_class(); }
  const char* hf_weights() const override { return "diffusion_pytorch_model"; }
  bool hf_torch_dtype() const override { return false; }
  bool peft_folder() const override { return false; }
  // diffusers' config.json of either variant, with diffusers 0.42.1's defaults
  // (FluxTransformer2DModel's, Flux2Transformer2DModel's).
  ModelConfig read_hf_config(const HfConfig& j) const override {
    ModelConfig m;
    m.arch = name();
    if (j.whole("patch_size", 1) != 1)
      j.fail("patch_size " + j["patch_size"].dump() + ": only 1 is implemented (" + (flux2_ ? "FLUX.2" : "FLUX.1") +
             " packs 2 x 2 patches into the channels before the transformer)");
    m.n_layer = j.whole("num_layers", flux2_ ? 8 : 19);
    m.n_single_layer = j.whole("num_single_layers", flux2_ ? 48 : 38);
    m.n_head = j.whole("num_attention_heads", flux2_ ? 48 : 24);
    m.n_embd = m.n_head * j.whole("attention_head_dim", 128);
    m.in_channels = j.whole("in_channels", flux2_ ? 128 : 64);
    if (j.has("out_channels") && j.whole("out_channels") != m.in_channels)
      j.fail("out_channels " + j["out_channels"].dump() + " differs from in_channels: not implemented");
    m.context_dim = j.whole("joint_attention_dim", flux2_ ? 15360 : 4096);
    m.guidance_embeds = j.flag("guidance_embeds", flux2_);  // FLUX.1's default is schnell's
    m.rope_axes = read_rope_axes(j, flux2_ ? 4 : 3, flux2_ ? "32,32,32,32" : m.rope_axes);
    m.max_seq_len = 4096;  // no position table: a bound on a run's image tokens (1024 x 1024 pixels)
    if (!flux2_) {
      m.pooled_dim = j.whole("pooled_projection_dim", 768);
      m.norm_eps = 1e-6, m.rope_theta = 10000;
      return m;
    }
    if (j.whole("timestep_guidance_channels", FLUX_TIME_CHANNELS) != FLUX_TIME_CHANNELS)
      j.fail("timestep_guidance_channels " + j["timestep_guidance_channels"].dump() + ": only 256 is implemented");
    m.intermediate_size = static_cast<int>(m.n_embd * j.positive("mlp_ratio", 3.0));  // diffusers' int(dim * ratio)
    m.pooled_dim = 0;
    m.rope_theta = j.positive("rope_theta", 2000.0);
    m.norm_eps = j.positive("eps", 1e-6);
    return m;
  }
  // axes_dims_rope as model.rope_axes: `count` whole numbers (their values are checked with the
  // shape), or `fallback` when absent.
  static std::string read_rope_axes(const HfConfig& j, size_t count, const std::string& fallback) {
    const nlohmann::json& axes = j["axes_dims_rope"];
    if (axes.is_null()) return fallback;
    const std::string want = count == 3 ? "three" : "four";
    if (!axes.is_array() || axes.size() != count)
      j.fail("axes_dims_rope " + axes.dump() + " is not " + want + " widths");
    std::string text;
    for (const nlohmann::json& a : axes) {
      if (!a.is_number_integer()) j.fail("axes_dims_rope " + axes.dump() + " is not " + want + " whole numbers");
      text += (text.empty() ? "" : ",") + std::to_string(a.get<int64_t>());
    }
    return text;
  }
  void write_hf_config(const ModelConfig& c, nlohmann::ordered_json& j) const override {
    std::vector<int> axes;
    parse_rope_axes(c.rope_axes, flux_id_axes(c), &axes);
    if (flux2_) {
      j["_class_name"] = hf_class();
      j["_diffusers_version"] = "0.42.1";
      j["attention_head_dim"] = c.head_size();
      j["axes_dims_rope"] = axes;
      j["eps"] = c.norm_eps;
      j["guidance_embeds"] = c.guidance_embeds;
      j["in_channels"] = c.in_channels;
      j["joint_attention_dim"] = c.context_dim;
      j["mlp_ratio"] = static_cast<double>(flux_mlp_width(c)) / c.n_embd;
      j["num_attention_heads"] = c.n_head;
      j["num_layers"] = c.n_layer;
      j["num_single_layers"] = c.n_single_layer;
      j["out_channels"] = nullptr;
      j["patch_size"] = 1;
      j["rope_theta"] = c.rope_theta;
      j["timestep_guidance_channels"] = FLUX_TIME_CHANNELS;
      return;
    }
    j["_class_name"] = hf_class();
    j["_diffusers_version"] = "0.42.1";  // the version the export was checked against
    j["attention_head_dim"] = c.head_size();
    j["axes_dims_rope"] = axes;
    j["guidance_embeds"] = c.guidance_embeds;
    j["in_channels"] = c.in_channels;
    j["joint_attention_dim"] = c.context_dim;
    j["num_attention_heads"] = c.n_head;
    j["num_layers"] = c.n_layer;
    j["num_single_layers"] = c.n_single_layer;
    j["out_channels"] = nullptr;
    j["patch_size"] = 1;
    j["pooled_projection_dim"] = c.pooled_dim;
  }
  const char* hf_prefix() const override { return ""; }
  HfTensor hf_tensor(const ModelConfig&, const ParamInfo& param) const override {
    return {param.name, false, std::vector<int64_t>(param.shape.begin(), param.shape.end()), {}};
  }
  bool hf_ignorable(const std::string&) const override { return false; }
  // Black Forest Labs' single files (flux_bfl.hpp).
  const char* single_file_layout() const override {
    return flux2_ ? "Black Forest Labs' FLUX.2" : "Black Forest Labs' FLUX.1";
  }
  bool reads_single_file(const TensorShapes& tensors) const override { return is_bfl_flux_file(tensors, flux2_); }
  ModelConfig read_single_file_config(const TensorShapes& tensors, const std::string& path) const override {
    return bfl_flux_config(tensors, path, flux2_);
  }
  HfTensor single_file_tensor(const ModelConfig& config, const ParamInfo& param) const override {
    return bfl_flux_tensor(config, param);
  }

 private:
  bool flux2_;
};

}  // namespace

const ModelFamily& flux_family() {
  static const FluxFamily family(false);
  return family;
}

const ModelFamily& flux2_family() {
  static const FluxFamily family(true);
  return family;
}

}  // namespace shardtrain
