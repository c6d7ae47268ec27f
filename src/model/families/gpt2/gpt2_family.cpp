// The GPT-2 family's descriptor (gpt2_family.hpp): its parameter table, sizes, adapter sites and
// Hugging Face GPT2LMHeadModel files. Our names are llm.c's:
//   ours                     Hugging Face
//   wte, wpe, ln_f.*         wte.weight, wpe.weight, ln_f.*
//   h.N.ln_1.*, h.N.ln_2.*   the same names
//   h.N.attn.qkv.*           h.N.attn.c_attn.*   Conv1D: weights stored (in, out), ours (out, in)
//   h.N.attn.proj.*          h.N.attn.c_proj.*   Conv1D
//   h.N.mlp.fc.*             h.N.mlp.c_fc.*      Conv1D
//   h.N.mlp.proj.*           h.N.mlp.c_proj.*    Conv1D
// The LM head is tied to wte (lm_head.weight is absent, or ignored); the causal-mask buffers of
// older files (attn.bias, attn.masked_bias) are ignored.
#include "model/families/gpt2/gpt2_family.hpp"

#include <cmath>

#include "core/error.hpp"
#include "model/families/gpt2/gpt2_model.hpp"
#include "model/param_table.hpp"

namespace shardtrain {
namespace {

// Layer-norm epsilon of our GPT-2 kernels (backend/cpu/layernorm.cpp, kernels/layernorm.cu).
constexpr double OUR_LAYER_NORM_EPS = 1e-5;

bool ends_with(const std::string& name, const std::string& suffix) {
  return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
}

class Gpt2Family final : public ModelFamily {
 public:
  const char* name() const override { return "gpt2"; }
  const char* description() const override {
    return "GPT-2 (learned positions, LayerNorm, GELU, biases, tied head)";
  }
  std::string summary(const ModelConfig& c) const override {
    return strprintf("GPT-2 L=%d C=%d H=%d V=%d max_seq_len=%d", c.n_layer, c.n_embd, c.n_head, c.vocab_size,
                     c.max_seq_len);
  }
  std::vector<std::string> config_keys() const override { return {}; }
  // Checkpoints store gpt2's fixed values (n_kv_head = n_head, an MLP of 4 C, tied); options leave
  // the defaults (0): both mean the same.
  std::string config_defect(const ModelConfig& m) const override {
    const ModelConfig d;
    if ((m.n_kv_head != 0 && m.n_kv_head != m.n_head) ||
        (m.intermediate_size != 0 && m.intermediate_size != 4 * m.n_embd) || !m.tie_embeddings ||
        m.rope_theta != d.rope_theta || m.norm_eps != d.norm_eps)
      return "model.arch=gpt2 with options it does not take (n_kv_head, intermediate_size, rope_theta, norm_eps, "
             "tie_embeddings)";
    return "";
  }

  void add_params(ParamTable& t) const override {
    const ModelConfig& c = t.config();
    const int C = c.n_embd;
    t.add_param(ROOT_UNIT, "wte", {c.vocab_size, C}, INIT_NORMAL, true);
    t.add_param(ROOT_UNIT, "wpe", {c.max_seq_len, C}, INIT_NORMAL, true);
    t.add_param(ROOT_UNIT, "ln_f.weight", {C}, INIT_ONES, false);
    t.add_param(ROOT_UNIT, "ln_f.bias", {C}, INIT_ZEROS, false);
    for (int l = 0; l < c.n_layer; l++) {
      const std::string h = "h." + std::to_string(l);
      const int u = t.add_unit(h);
      // Order must match enum Gpt2BlockParam.
      t.add_param(u, h + ".ln_1.weight", {C}, INIT_ONES, false);
      t.add_param(u, h + ".ln_1.bias", {C}, INIT_ZEROS, false);
      t.add_param(u, h + ".attn.qkv.weight", {3 * C, C}, INIT_NORMAL, true);
      t.add_param(u, h + ".attn.qkv.bias", {3 * C}, INIT_ZEROS, false);
      t.add_param(u, h + ".attn.proj.weight", {C, C}, INIT_NORMAL_RESIDUAL, true);
      t.add_param(u, h + ".attn.proj.bias", {C}, INIT_ZEROS, false);
      t.add_param(u, h + ".ln_2.weight", {C}, INIT_ONES, false);
      t.add_param(u, h + ".ln_2.bias", {C}, INIT_ZEROS, false);
      t.add_param(u, h + ".mlp.fc.weight", {4 * C, C}, INIT_NORMAL, true);
      t.add_param(u, h + ".mlp.fc.bias", {4 * C}, INIT_ZEROS, false);
      t.add_param(u, h + ".mlp.proj.weight", {C, 4 * C}, INIT_NORMAL_RESIDUAL, true);
      t.add_param(u, h + ".mlp.proj.bias", {C}, INIT_ZEROS, false);
    }
  }
  // The token embedding and the position table take the input gradient.
  std::vector<int> input_params() const override { return {ROOT_WTE, ROOT_WPE}; }
  // 6 x (parameters outside the embedding tables + V x C for the tied LM head) + 12 L T C for
  // attention's scores and weighted sums.
  double flops_per_token(const ParamTable& t, int seq_len) const override {
    const ModelConfig& c = t.config();
    const double positions = static_cast<double>(c.max_seq_len) * c.n_embd;
    return 6.0 * (static_cast<double>(t.total_params()) - positions) + 12.0 * c.n_layer * seq_len * c.n_embd;
  }

  std::unique_ptr<TransformerModel<float>> make_model(const ParamTable& table, int batch, int seq_len,
                                                      Checkpointing ckpt, const LayerOps<float>& ops,
                                                      DType act) const override {
    return std::make_unique<GptModel<float>>(table, batch, seq_len, ckpt, ops, act);
  }
  std::unique_ptr<TransformerModel<double>> make_model(const ParamTable& table, int batch, int seq_len,
                                                       Checkpointing ckpt, const LayerOps<double>& ops,
                                                       DType act) const override {
    return std::make_unique<GptModel<double>>(table, batch, seq_len, ckpt, ops, act);
  }
  // GptModel's constructor's arrays, in its order.
  std::vector<size_t> activation_arrays(const ModelConfig& c, int batch, int seq_len, Checkpointing checkpointing,
                                        DType /*in SavedActivations*/) const override {
    const size_t BT = static_cast<size_t>(batch) * seq_len, C = c.n_embd, NH = c.n_head, V = c.vocab_size;
    std::vector<size_t> a(c.n_layer + 1, BT * C);  // the residual stream
    for (int l = 0; l < checkpointing.run(0, c.n_layer).sets(); l++)  // ln1's mean and rstd, lse, resid2, ln2's
      a.insert(a.end(), {BT, BT, BT * NH, BT * C, BT, BT});
    a.insert(a.end(), {BT * C, BT, BT, BT * V, BT});                 // lnf, its mean and rstd, probs, losses
    a.insert(a.end(), {BT * C, BT * C, BT * 3 * C, BT * 4 * C});  // dresid, dln, dqkv, dfch
    return a;
  }
  std::vector<size_t> saved_tensor_elements(const ModelConfig& c, int batch, int seq_len) const override {
    return GptModel<float>::saved_tensor_elements(c, batch, seq_len);
  }
  size_t plan_decode_elements(const ModelConfig& c, int max_len, int max_chunk) const override {
    return GptModel<float>::plan_decode_elements(c, max_len, max_chunk);
  }
  std::vector<LinearShape> gemm_shapes(const ModelConfig& c) const override {
    const int C = c.n_embd;
    return {{C, 3 * C}, {C, C}, {C, 4 * C}, {4 * C, C}, {C, c.vocab_size}};
  }
  NormKind norm_kind() const override { return NORM_LAYER; }
  bool kv_decoding() const override { return true; }
  size_t id_bytes(const ModelConfig&, int batch, int seq_len) const override {
    return decoder_lm_id_bytes(batch, seq_len);
  }
  bool token_logits() const override { return true; }
  bool hidden_states() const override { return true; }

  std::vector<LinearSite> linear_sites(const ModelConfig& c, const std::string&) const override {
    const int C = c.n_embd;
    return {{"attn.c_attn", BLOCK_QKV_W, BLOCK_QKV_B, PRODUCT_QKV, C, 3 * C, 0, 3 * C},
            {"attn.c_proj", BLOCK_ATTPROJ_W, BLOCK_ATTPROJ_B, PRODUCT_ATTN_OUT, C, C, 0, C},
            {"mlp.c_fc", BLOCK_FC_W, BLOCK_FC_B, PRODUCT_MLP_UP, C, 4 * C, 0, 4 * C},
            {"mlp.c_proj", BLOCK_FCPROJ_W, BLOCK_FCPROJ_B, PRODUCT_MLP_DOWN, 4 * C, C, 0, C}};
  }
  std::string module_path(const ModelConfig&, int layer, const LinearSite& site) const override {
    return "transformer.h." + std::to_string(layer) + "." + site.module;
  }

  const char* hf_class() const override { return "GPT2LMHeadModel"; }
  bool reads_model_type(const std::string& type) const override { return type == "gpt2"; }
  ModelConfig read_hf_config(const HfConfig& j) const override {
    ModelConfig m;
    m.n_layer = j.whole("n_layer");
    m.n_embd = j.whole("n_embd");
    m.n_head = j.whole("n_head");
    m.vocab_size = j.whole("vocab_size");
    m.max_seq_len = j.has("n_positions") || !j.has("n_ctx") ? j.whole("n_positions") : j.whole("n_ctx");
    const std::string act = j.text("activation_function", "gelu_new");
    if (act != "gelu_new" && act != "gelu_pytorch_tanh")
      j.fail("activation_function '" + act + "' is not implemented; ShardTrain's GPT-2 uses the tanh GELU (gelu_new)");
    if (j.has("n_inner") && j["n_inner"] != 4 * m.n_embd)
      j.fail("n_inner " + j["n_inner"].dump() + " is not implemented; ShardTrain's MLP is 4 x n_embd");
    if (!j.flag("tie_word_embeddings", true))
      j.fail("tie_word_embeddings false is not implemented; ShardTrain ties the LM head to wte");
    if (std::fabs(j.positive("layer_norm_epsilon", OUR_LAYER_NORM_EPS) - OUR_LAYER_NORM_EPS) > 1e-12)
      j.fail("layer_norm_epsilon " + j["layer_norm_epsilon"].dump() + " is not implemented; ShardTrain uses 1e-05");
    for (const char* key : {"scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"})
      if (j.flag(key, false)) j.fail(std::string(key) + " true is not implemented");
    if (!j.flag("scale_attn_weights", true)) j.fail("scale_attn_weights false is not implemented");
    if (m.n_embd % m.n_head != 0) j.fail("n_embd is not a multiple of n_head");
    return m;
  }
  void write_hf_config(const ModelConfig& m, nlohmann::ordered_json& j) const override {
    j["architectures"] = {hf_class()};
    j["model_type"] = "gpt2";
    j["n_layer"] = m.n_layer;
    j["n_embd"] = m.n_embd;
    j["n_head"] = m.n_head;
    j["vocab_size"] = m.vocab_size;
    j["n_positions"] = m.max_seq_len;
    j["n_ctx"] = m.max_seq_len;
    j["n_inner"] = nullptr;
    j["activation_function"] = "gelu_new";
    j["layer_norm_epsilon"] = OUR_LAYER_NORM_EPS;
    j["tie_word_embeddings"] = true;
    j["scale_attn_weights"] = true;
    j["resid_pdrop"] = 0.0;
    j["embd_pdrop"] = 0.0;
    j["attn_pdrop"] = 0.0;
  }
  const char* hf_prefix() const override { return "transformer."; }
  HfTensor hf_tensor(const ModelConfig&, const ParamInfo& p) const override {
    HfTensor t;
    for (int d : p.shape) t.shape.push_back(d);
    static const std::pair<const char*, const char*> renames[] = {
        {".attn.qkv.", ".attn.c_attn."}, {".attn.proj.", ".attn.c_proj."}, {".mlp.fc.", ".mlp.c_fc."},
        {".mlp.proj.", ".mlp.c_proj."}};
    t.name = p.name == "wte" || p.name == "wpe" ? p.name + ".weight" : p.name;
    for (const auto& [ours, theirs] : renames) {
      const size_t at = t.name.find(ours);
      if (at == std::string::npos) continue;
      t.name.replace(at, std::string(ours).size(), theirs);
      t.transposed = p.shape.size() == 2;  // Conv1D weights; biases are vectors either way
    }
    if (t.transposed) std::swap(t.shape[0], t.shape[1]);
    t.name = hf_prefix() + t.name;
    return t;
  }
  // The tied head and the causal-mask buffers of older files.
  bool hf_ignorable(const std::string& key) const override {
    return key == "lm_head.weight" || ends_with(key, ".attn.bias") || ends_with(key, ".attn.masked_bias");
  }
  bool hf_conv1d() const override { return true; }
  bool llmc_files() const override { return true; }
};

}  // namespace

const ModelFamily& gpt2_family() {
  static const Gpt2Family family;
  return family;
}

}  // namespace shardtrain
