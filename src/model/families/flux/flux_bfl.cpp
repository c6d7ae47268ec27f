// See flux_bfl.hpp.
#include "model/families/flux/flux_bfl.hpp"

#include <set>

#include "core/error.hpp"
#include "model/families/flux/flux_family.hpp"
#include "model/param_table.hpp"

namespace shardtrain {
namespace {

// The root's modules: diffusers' name -> BFL's.
const std::pair<const char*, const char*> ROOT_MODULES[] = {
    {"x_embedder", "img_in"},
    {"context_embedder", "txt_in"},
    {"time_text_embed.timestep_embedder.linear_1", "time_in.in_layer"},
    {"time_text_embed.timestep_embedder.linear_2", "time_in.out_layer"},
    {"time_text_embed.text_embedder.linear_1", "vector_in.in_layer"},
    {"time_text_embed.text_embedder.linear_2", "vector_in.out_layer"},
    {"time_text_embed.guidance_embedder.linear_1", "guidance_in.in_layer"},
    {"time_text_embed.guidance_embedder.linear_2", "guidance_in.out_layer"},
    {"norm_out.linear", "final_layer.adaLN_modulation.1"},
    {"proj_out", "final_layer.linear"},
};

// A double block's modules of one stream: diffusers' (image, text) -> BFL's (img_, txt_ prefix),
// and the q, k, v projections, which BFL fuses.
const std::pair<const char*, const char*> DOUBLE_MODULES[][2] = {
    {{"norm1.linear", "mod.lin"}, {"norm1_context.linear", "mod.lin"}},
    {{"attn.to_out.0", "attn.proj"}, {"attn.to_add_out", "attn.proj"}},
    {{"ff.net.0.proj", "mlp.0"}, {"ff_context.net.0.proj", "mlp.0"}},
    {{"ff.net.2", "mlp.2"}, {"ff_context.net.2", "mlp.2"}},
    {{"attn.norm_q", "attn.norm.query_norm"}, {"attn.norm_added_q", "attn.norm.query_norm"}},
    {{"attn.norm_k", "attn.norm.key_norm"}, {"attn.norm_added_k", "attn.norm.key_norm"}},
};
// A single block's modules stored whole (q, k, v and proj_mlp are linear1's rows).
const std::pair<const char*, const char*> SINGLE_MODULES[] = {
    {"norm.linear", "modulation.lin"},
    {"attn.norm_q", "norm.query_norm"},
    {"attn.norm_k", "norm.key_norm"},
    {"proj_out", "linear2"},
};
const char* const DOUBLE_QKV[2][3] = {{"attn.to_q", "attn.to_k", "attn.to_v"},
                                      {"attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"}};

// FLUX.2's: the root's modules (the shared modulations among them), a double block's per stream,
// a single block's (its fused q | k | v | MLP in is one tensor in both layouts).
const std::pair<const char*, const char*> FLUX2_ROOT_MODULES[] = {
    {"x_embedder", "img_in"},
    {"context_embedder", "txt_in"},
    {"time_guidance_embed.timestep_embedder.linear_1", "time_in.in_layer"},
    {"time_guidance_embed.timestep_embedder.linear_2", "time_in.out_layer"},
    {"time_guidance_embed.guidance_embedder.linear_1", "guidance_in.in_layer"},
    {"time_guidance_embed.guidance_embedder.linear_2", "guidance_in.out_layer"},
    {"double_stream_modulation_img.linear", "double_stream_modulation_img.lin"},
    {"double_stream_modulation_txt.linear", "double_stream_modulation_txt.lin"},
    {"single_stream_modulation.linear", "single_stream_modulation.lin"},
    {"norm_out.linear", "final_layer.adaLN_modulation.1"},
    {"proj_out", "final_layer.linear"},
};
const std::pair<const char*, const char*> FLUX2_DOUBLE_MODULES[][2] = {
    {{"attn.to_out.0", "attn.proj"}, {"attn.to_add_out", "attn.proj"}},
    {{"ff.linear_in", "mlp.0"}, {"ff_context.linear_in", "mlp.0"}},
    {{"ff.linear_out", "mlp.2"}, {"ff_context.linear_out", "mlp.2"}},
    {{"attn.norm_q", "attn.norm.query_norm"}, {"attn.norm_added_q", "attn.norm.query_norm"}},
    {{"attn.norm_k", "attn.norm.key_norm"}, {"attn.norm_added_k", "attn.norm.key_norm"}},
};
const std::pair<const char*, const char*> FLUX2_SINGLE_MODULES[] = {
    {"attn.to_qkv_mlp_proj", "linear1"},
    {"attn.to_out", "linear2"},
    {"attn.norm_q", "norm.query_norm"},
    {"attn.norm_k", "norm.key_norm"},
};

// BFL's name of our module `ours` in a table of (ours, BFL's); null when it has none.
template <size_t N>
const char* renamed(const std::pair<const char*, const char*> (&table)[N], const std::string& ours) {
  for (const auto& [diffusers, bfl] : table)
    if (ours == diffusers) return bfl;
  return nullptr;
}
// And in a table of a double block's modules by stream (0 image, 1 text).
template <size_t N>
const char* renamed(const std::pair<const char*, const char*> (&table)[N][2], int stream, const std::string& ours) {
  for (const auto& modules : table)
    if (ours == modules[stream].first) return modules[stream].second;
  return nullptr;
}

std::vector<int64_t> shape_of(const TensorShapes& t, const std::string& name) {
  auto it = t.find(name);
  return it == t.end() ? std::vector<int64_t>{} : it->second;
}

// The blocks "<kind>.N." count: one more than the largest N, every N below it present.
int count_blocks(const TensorShapes& t, const std::string& kind, const std::string& path) {
  std::set<long> seen;
  for (const auto& [name, shape] : t) {
    if (name.rfind(kind + ".", 0) != 0) continue;
    char* end = nullptr;
    const long block = std::strtol(name.c_str() + kind.size() + 1, &end, 10);
    if (end == name.c_str() + kind.size() + 1 || *end != '.' || block < 0)
      throw CheckpointError("safetensors file '" + path + "': tensor '" + name + "' names no " + kind + " number");
    seen.insert(block);
  }
  if (!seen.empty() && (*seen.begin() != 0 || *seen.rbegin() + 1 != static_cast<long>(seen.size())))
    throw CheckpointError("safetensors file '" + path + "': the " + kind + " are not numbered 0.." +
                          std::to_string(seen.size() - 1));
  return static_cast<int>(seen.size());
}

}  // namespace

bool is_bfl_flux_file(const TensorShapes& tensors, bool flux2) {
  // FLUX.2's file is told by its shared modulations.
  return tensors.count("img_in.weight") && tensors.count("final_layer.adaLN_modulation.1.weight") &&
         flux2 == (tensors.count("double_stream_modulation_img.lin.weight") > 0);
}

ModelConfig bfl_flux_config(const TensorShapes& t, const std::string& path, bool flux2) {
  auto need = [&](const std::string& name, size_t rank) {
    const std::vector<int64_t> s = shape_of(t, name);
    if (s.size() != rank)
      throw CheckpointError("safetensors file '" + path + "': Black Forest Labs' " + (flux2 ? "FLUX.2" : "FLUX") +
                            " layout without a " + std::to_string(rank) + "-dimensional '" + name + "'");
    return s;
  };
  ModelConfig m;
  m.arch = flux2 ? "flux2" : "flux";
  const std::vector<int64_t> img_in = need("img_in.weight", 2);
  m.n_embd = static_cast<int>(img_in[0]), m.in_channels = static_cast<int>(img_in[1]);
  m.context_dim = static_cast<int>(need("txt_in.weight", 2)[1]);
  m.pooled_dim = flux2 ? 0 : static_cast<int>(need("vector_in.in_layer.weight", 2)[1]);
  m.guidance_embeds = t.count("guidance_in.in_layer.weight") > 0;
  m.n_layer = count_blocks(t, "double_blocks", path);
  m.n_single_layer = count_blocks(t, "single_blocks", path);
  const std::string norm = m.n_layer ? "double_blocks.0.img_attn.norm.query_norm.scale"
                                     : "single_blocks.0.norm.query_norm.scale";
  const int64_t head = need(norm, 1)[0];
  if (head <= 0 || m.n_embd % head != 0)
    throw CheckpointError(strprintf("safetensors file '%s': heads of %lld dimensions ('%s') do not divide the width %d",
                                    path.c_str(), static_cast<long long>(head), norm.c_str(), m.n_embd));
  m.n_head = static_cast<int>(m.n_embd / head);
  if (head != 128)
    throw CheckpointError(strprintf("safetensors file '%s': heads of %lld dimensions; Black Forest Labs' files hold "
                                    "heads of 128, whose rotary axes (FLUX.1's 16, 56, 56, FLUX.2's 32, 32, 32, 32) "
                                    "are all ShardTrain knows for them: convert the model to a diffusers folder, "
                                    "whose config.json names its axes_dims_rope",
                                    path.c_str(), static_cast<long long>(head)));
  m.norm_eps = 1e-6;
  if (flux2) {  // Flux2Transformer2DModel's rotary axes and theta; the MLP's width from its input product
    m.rope_axes = "32,32,32,32", m.rope_theta = 2000;
    const int64_t two_f = m.n_layer ? need("double_blocks.0.img_mlp.0.weight", 2)[0]
                                    : need("single_blocks.0.linear1.weight", 2)[0] - 3 * int64_t{m.n_embd};
    if (two_f <= 0 || two_f % 2)
      throw CheckpointError(strprintf("safetensors file '%s': an MLP input product of %lld rows is no SwiGLU's 2 x "
                                      "its width",
                                      path.c_str(), static_cast<long long>(two_f)));
    m.intermediate_size = static_cast<int>(two_f / 2);
  } else {
    m.rope_axes = "16,56,56", m.rope_theta = 10000;
  }
  m.max_seq_len = 4096;  // as a diffusers folder: a bound on a run's image tokens
  return m;
}

HfTensor bfl_flux_tensor(const ModelConfig& c, const ParamInfo& p) {
  const int64_t C = c.n_embd, F = flux_mlp_width(c);
  const bool flux2 = is_flux2(c);
  // The module and the parameter's own suffix: "x_embedder" + ".weight".
  const size_t dot = p.name.rfind('.');
  const std::string module = p.name.substr(0, dot), suffix = p.name.substr(dot);
  const std::vector<int64_t> ours(p.shape.begin(), p.shape.end());
  // BFL's q/k norms (RMSNorm modules "query_norm", "key_norm") call their weight "scale".
  auto whole = [&](const std::string& name) {
    const bool norm = name.size() > 5 && name.compare(name.size() - 5, 5, "_norm") == 0;
    return HfTensor{name + (norm ? ".scale" : suffix), false, ours, {}};
  };
  // Rows [first, first + ours[0]) of a fused tensor of `rows` rows.
  auto part_of = [&](const std::string& name, int64_t rows, int64_t first) {
    std::vector<int64_t> stored = ours;
    stored[0] = rows;
    return HfTensor{name + suffix, false, stored, {{first, ours[0]}}};
  };
  if (const char* bfl = flux2 ? renamed(FLUX2_ROOT_MODULES, module) : renamed(ROOT_MODULES, module)) {
    if (module != "norm_out.linear") return whole(bfl);
    // (shift, scale) stored, (scale, shift) ours.
    return HfTensor{std::string(bfl) + suffix, false, ours, {{C, C}, {0, C}}};
  }
  // A block's module: "transformer_blocks.3.attn.to_q" -> ("double_blocks.3.", "attn.to_q").
  auto in_block = [&](const std::string& prefix, const char* bfl_kind, std::string* block, std::string* rest) {
    if (module.rfind(prefix, 0) != 0) return false;
    const size_t at = module.find('.', prefix.size());
    *block = std::string(bfl_kind) + "." + module.substr(prefix.size(), at - prefix.size()) + ".";
    *rest = module.substr(at + 1);
    return true;
  };
  std::string block, rest;
  if (in_block("transformer_blocks.", "double_blocks", &block, &rest)) {
    for (int s = 0; s < 2; s++) {
      const std::string stream = block + (s == 0 ? "img_" : "txt_");
      if (const char* bfl = flux2 ? renamed(FLUX2_DOUBLE_MODULES, s, rest) : renamed(DOUBLE_MODULES, s, rest))
        return whole(stream + bfl);
      for (int i = 0; i < 3; i++)
        if (rest == DOUBLE_QKV[s][i]) return part_of(stream + "attn.qkv", 3 * C, i * C);
    }
  } else if (in_block("single_transformer_blocks.", "single_blocks", &block, &rest)) {
    if (const char* bfl = flux2 ? renamed(FLUX2_SINGLE_MODULES, rest) : renamed(SINGLE_MODULES, rest))
      return whole(block + bfl);
    if (!flux2) {
      const char* const fused[] = {"attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"};
      for (int i = 0; i < 4; i++)
        if (rest == fused[i]) return part_of(block + "linear1", 3 * C + F, i * C);
    }
  }
  fatal_internal(__FILE__, __LINE__, __func__, "FLUX parameter '" + p.name + "' has no Black Forest Labs name");
}

}  // namespace shardtrain
