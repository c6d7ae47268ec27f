// The FLUX family's descriptor (flux_family.hpp). Units: the root (the embedders, the conditioning
// MLPs and the output layers, resident from the forward's start to the backward's end), then the
// double-stream blocks ("double") and the single-stream blocks ("single") in forward order.
#include "model/families/flux/flux_family.hpp"

#include <cmath>
#include <sstream>

#include "backend/gpu_memory.hpp"
#include "core/error.hpp"
#include "model/families/flux/flux_bfl.hpp"
#include "model/families/flux/flux_model.hpp"
#include "model/param_table.hpp"

namespace shardtrain {

std::string parse_rope_axes(const std::string& text, std::array<int, 3>* axes) {
  std::stringstream in(text);
  std::string part;
  int n = 0;
  while (std::getline(in, part, ',')) {
    char* end = nullptr;
    const long v = std::strtol(part.c_str(), &end, 10);
    if (n == 3 || part.empty() || *end != '\0' || v < 2 || v > (1 << 16) || v % 2)
      return "model.rope_axes='" + text + "' must be three even widths >= 2, comma-separated (FLUX.1: 16,56,56)";
    (*axes)[n++] = static_cast<int>(v);
  }
  if (n != 3) return "model.rope_axes='" + text + "' must be three even widths, comma-separated (FLUX.1: 16,56,56)";
  return "";
}

namespace {

class FluxFamily final : public ModelFamily {
 public:
  const char* name() const override { return "flux"; }
  const char* description() const override {
    return "FLUX.1 diffusion transformer (double- then single-stream blocks, flow matching; diffusers' names)";
  }
  std::string summary(const ModelConfig& c) const override {
    return strprintf("FLUX double=%d single=%d C=%d H=%d in=%d%s text=%dx%d pooled=%d %s rope=%s theta=%g eps=%g",
                     c.n_layer, c.n_single_layer, c.n_embd, c.n_head, c.in_channels,
                     c.pixel_patch ? strprintf(" (pixels, %dx%d patches)", c.pixel_patch, c.pixel_patch).c_str() : "",
                     c.context_len, c.context_dim, c.pooled_dim, c.guidance_embeds ? "guidance" : "no-guidance",
                     c.rope_axes.c_str(), c.rope_theta, c.norm_eps);
  }
  std::vector<std::string> config_keys() const override {
    return {"model.n_single_layer", "model.in_channels", "model.context_dim", "model.context_len", "model.pooled_dim",
            "model.guidance_embeds", "model.rope_axes", "model.rope_theta", "model.norm_eps", "model.condition_len",
            "model.pixel_patch"};
  }
  std::string config_defect(const ModelConfig& m) const override {
    std::array<int, 3> axes{};
    const std::string bad_axes = parse_rope_axes(m.rope_axes, &axes);
    if (!bad_axes.empty()) return bad_axes;
    if (axes[0] + axes[1] + axes[2] != m.head_size())
      return strprintf("model.rope_axes='%s' covers %d dimensions, the head has model.n_embd / model.n_head = %d: the "
                       "axes must add up to the head size",
                       m.rope_axes.c_str(), axes[0] + axes[1] + axes[2], m.head_size());
    const std::pair<const char*, int> widths[] = {{"model.in_channels", m.in_channels},
                                                  {"model.context_dim", m.context_dim},
                                                  {"model.context_len", m.context_len},
                                                  {"model.pooled_dim", m.pooled_dim}};
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
    if (m.intermediate_size != 0 && m.intermediate_size != 4 * m.n_embd)
      return strprintf("model.intermediate_size=%d: FLUX's MLPs are 4 x model.n_embd wide", m.intermediate_size);
    if (!(m.rope_theta > 0) || !std::isfinite(m.rope_theta))
      return strprintf("model.rope_theta=%g must be > 0", m.rope_theta);
    if (!(m.norm_eps > 0) || !std::isfinite(m.norm_eps)) return strprintf("model.norm_eps=%g must be > 0", m.norm_eps);
    const double params = static_cast<double>(m.n_layer) * 24 * m.n_embd * m.n_embd +
                          static_cast<double>(m.n_single_layer) * 12 * m.n_embd * m.n_embd;
    if (params > 1e13) return "model.n_layer, model.n_single_layer and model.n_embd make more than 10^13 parameters";
    return "";
  }

  void add_params(ParamTable& t) const override {
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
  // The conditioning reaches every block (the modulations) and the embedders take the inputs: all
  // of the root but the output layers needs the blocks' gradients.
  std::vector<int> input_params() const override {
    std::vector<int> p;
    for (int i = FLUX_X_EMBED_W; i <= FLUX_GUIDANCE_2_B; i++)
      if (i < FLUX_NORM_OUT_W || i > FLUX_PROJ_OUT_B) p.push_back(i);
    return p;
  }
  // Per predicted image token of a sample: 6 x the multiply-adds of every linear layer (per token
  // of its stream -- Kontext's condition tokens too --, per sample for the modulations and the
  // conditioning) + 12 S^2 C per block for the joint attention's scores and weighted sums (both
  // counted in full: no mask), over N.
  double flops_per_token(const ParamTable& t, int seq_len) const override {
    const ModelConfig& c = t.config();
    const double C = c.n_embd, N = seq_len, M = N + c.condition_len, L = c.context_len, S = M + L;
    const double per_sample = M * c.in_channels * C + L * c.context_dim * C + N * C * c.in_channels +  // in, out
                              FLUX_TIME_CHANNELS * C * (c.guidance_embeds ? 2 : 1) + c.pooled_dim * C +
                              C * C * (c.guidance_embeds ? 3 : 2) + 2 * C * C +  // conditioning, norm_out
                              c.n_layer * (12 * C * C * S + 12 * C * C) +        // double: per token, modulations
                              c.n_single_layer * (12 * C * C * S + 3 * C * C);   // single: q,k,v, mlp, proj_out
    const double attention = 2.0 * (c.n_layer + c.n_single_layer) * S * S * C;
    return (6.0 * per_sample + 6.0 * attention) / N;
  }

  std::unique_ptr<TransformerModel<float>> make_model(const ParamTable& table, int batch, int seq_len, bool ckpt,
                                                      const LayerOps<float>& ops, DType act) const override {
    check_activation_dtype(act);
    return std::make_unique<FluxModel<float>>(table, batch, seq_len, ckpt, ops);
  }
  std::unique_ptr<TransformerModel<double>> make_model(const ParamTable& table, int batch, int seq_len, bool ckpt,
                                                       const LayerOps<double>& ops, DType act) const override {
    check_activation_dtype(act);
    return std::make_unique<FluxModel<double>>(table, batch, seq_len, ckpt, ops);
  }
  std::vector<size_t> activation_arrays(const ModelConfig& c, int batch, int seq_len, bool ckpt) const override {
    return FluxModel<float>::buffer_elements(c, batch, seq_len, ckpt);
  }
  std::vector<size_t> saved_tensor_elements(const ModelConfig&, int, int) const override { return {}; }
  size_t plan_decode_elements(const ModelConfig&, int, int) const override { return 0; }
  std::vector<LinearShape> gemm_shapes(const ModelConfig& c) const override {
    const int C = c.n_embd, F = 4 * C;
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
        {gpu::attention_backward_workspace_bytes(batch, S, H, H, D), "joint attention backward"},
        {gpu::matmul_backward_workspace_bytes(batch, 6 * C), "matmul backward (bias)"}};
    for (int rows : {seq_len + c.condition_len, c.context_len, S}) {
      w.push_back({gpu::rmsnorm_backward_workspace_bytes(batch * rows * H, D), "q/k RMSNorm backward"});
      w.push_back({gpu::modulate_backward_workspace_bytes(rows, C), "adaptive LayerNorm backward"});
      w.push_back({gpu::gate_backward_workspace_bytes(rows, C), "gated residual backward"});
      w.push_back({gpu::matmul_backward_workspace_bytes(batch * rows, 4 * C), "matmul backward (bias)"});
    }
    return w;
  }
  bool samples_images() const override { return true; }
  // The modulation (AdaLayerNormZero's linear of each block) stays full precision, as the FLUX
  // QLoRA recipes keep it: few parameters, and every token's shift, scale and gate come from it.
  bool quantizable(const LinearSite& site) const override { return std::string(site.module).find("norm") == std::string::npos; }
  bool token_data() const override { return false; }
  bool half_saved_activations() const override { return false; }
  bool fixes_max_seq_len() const override { return false; }

  // Adapters: every linear layer of the blocks, by diffusers' module names.
  std::vector<LinearSite> linear_sites(const ModelConfig& c, const std::string& kind) const override {
    const int C = c.n_embd, F = 4 * C;
    std::vector<LinearSite> sites;
    auto site = [&](const char* module, int weight, int product, int in, int out) {
      sites.push_back({module, weight, weight + 1, product, in, out, 0, out});
    };
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
  const char* hf_class() const override { return "FluxTransformer2DModel"; }
  bool reads_model_type(const std::string&) const override { return false; }
  bool reads_hf_folder(const HfConfig& j) const override {
    return j.text("_class_name", "") == "FluxTransformer2DModel";
  }
  const char* hf_weights() const override { return "diffusion_pytorch_model"; }
  bool hf_torch_dtype() const override { return false; }
  bool peft_folder() const override { return false; }
  ModelConfig read_hf_config(const HfConfig& j) const override {
    ModelConfig m;
    m.arch = name();
    if (j.whole("patch_size", 1) != 1)
      j.fail("patch_size " + j["patch_size"].dump() + ": only 1 is implemented (FLUX.1 packs 2 x 2 patches into "
             "the channels before the transformer)");
    m.n_layer = j.whole("num_layers", 19);
    m.n_single_layer = j.whole("num_single_layers", 38);
    m.n_head = j.whole("num_attention_heads", 24);
    m.n_embd = m.n_head * j.whole("attention_head_dim", 128);
    m.in_channels = j.whole("in_channels", 64);
    if (j.has("out_channels") && j.whole("out_channels") != m.in_channels)
      j.fail("out_channels " + j["out_channels"].dump() + " differs from in_channels: not implemented");
    m.context_dim = j.whole("joint_attention_dim", 4096);
    m.pooled_dim = j.whole("pooled_projection_dim", 768);
    m.guidance_embeds = j.flag("guidance_embeds", false);  // diffusers' default (schnell)
    const nlohmann::json& axes = j["axes_dims_rope"];
    if (!axes.is_null()) {
      if (!axes.is_array() || axes.size() != 3) j.fail("axes_dims_rope " + axes.dump() + " is not three widths");
      std::string text;
      for (const nlohmann::json& a : axes) {
        if (!a.is_number_integer()) j.fail("axes_dims_rope " + axes.dump() + " is not three whole numbers");
        text += (text.empty() ? "" : ",") + std::to_string(a.get<int64_t>());
      }
      m.rope_axes = text;
    }
    m.norm_eps = 1e-6, m.rope_theta = 10000;
    m.max_seq_len = 4096;  // no position table: a bound on a run's image tokens (1024 x 1024 pixels)
    return m;
  }
  void write_hf_config(const ModelConfig& c, nlohmann::ordered_json& j) const override {
    std::array<int, 3> axes{};
    parse_rope_axes(c.rope_axes, &axes);
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
  HfTensor hf_tensor(const ParamInfo& param) const override {
    return {param.name, false, std::vector<int64_t>(param.shape.begin(), param.shape.end()), {}};
  }
  bool hf_ignorable(const std::string&) const override { return false; }
  // Black Forest Labs' single files (flux_bfl.hpp).
  const char* single_file_layout() const override { return "Black Forest Labs' FLUX.1"; }
  bool reads_single_file(const TensorShapes& tensors) const override { return is_bfl_flux_file(tensors); }
  ModelConfig read_single_file_config(const TensorShapes& tensors, const std::string& path) const override {
    return bfl_flux_config(tensors, path);
  }
  HfTensor single_file_tensor(const ModelConfig& config, const ParamInfo& param) const override {
    return bfl_flux_tensor(config, param);
  }

 private:
  static void check_activation_dtype(DType act) {
    if (act != DTYPE_FP32)
      throw UsageError("model.arch=flux keeps its activations in fp32: remove fsdp.activation_dtype");
  }
};

}  // namespace

const ModelFamily& flux_family() {
  static const FluxFamily family;
  return family;
}

}  // namespace shardtrain
