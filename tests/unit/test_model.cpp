// The models as a whole, GPT-2 and Llama (tied and untied, grouped-query): central finite
// differences in double of the full forward/backward (every parameter tensor, the tied embedding
// included), float against double, recomputation, the FLOP count, and the parameter tables
// against the published sizes of real models.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/random.hpp"
#include "model/families/gpt2/gpt2_family.hpp"
#include "model/families/llama/llama_family.hpp"
#include "model/model.hpp"
#include "support/model_fixtures.hpp"

using namespace shardtrain;
using namespace shardtrain::testing;

namespace {

// Tied, one key/value head for all query heads.
ModelConfig tiny_llama_tied_config() {
  ModelConfig c = tiny_llama_config();
  c.n_kv_head = 1, c.tie_embeddings = true;
  return c;
}

// Heads of their own size (head_dim 6, not 16 / 4), scaled llama3 rotary frequencies: the
// attention 24 wide on a width of 16, q_proj (24, 16) and o_proj (16, 24).
ModelConfig tiny_llama_head_dim_config() {
  ModelConfig c = tiny_llama_config();
  c.head_dim = 6;
  c.rope_scaling = "llama3:factor=4,low_freq_factor=1,high_freq_factor=4,original_max_position_embeddings=16";
  return c;
}

// Mistral's sliding window, shortened to 3 so that every test's sequences reach it: each query
// sees itself and the 2 keys before it (and, with packed documents, none before its document).
ModelConfig tiny_mistral_window_config() {
  ModelConfig c = tiny_llama_config();
  c.sliding_window = 3;
  return c;
}

struct ArchCase {
  const char* name;
  ModelConfig (*config)();
};
const ArchCase ARCH_CASES[] = {{"gpt2", tiny_gpt2_config},
                               {"llama", tiny_llama_config},
                               {"llama_tied", tiny_llama_tied_config},
                               {"llama_head_dim", tiny_llama_head_dim_config},
                               {"mistral_window", tiny_mistral_window_config},
                               {"qwen2", tiny_qwen2_config},
                               {"qwen3", tiny_qwen3_config},
                               {"smollm3", tiny_smollm3_config}};

class ModelArchTest : public ::testing::TestWithParam<ArchCase> {};
std::string arch_case_name(const ::testing::TestParamInfo<ArchCase>& info) { return info.param.name; }

template <typename Real>
double forward_loss(TransformerModel<Real>& model, const ParamTable& table, const std::vector<std::vector<Real>>& units,
                    const Batch& batch) {
  model.embed_forward(units[ROOT_UNIT].data(), batch);
  for (int l = 0; l < table.config().n_layer; l++) model.block_forward(l, units[block_unit(l)].data());
  return model.host_head_forward(units[ROOT_UNIT].data(), batch);
}

template <typename Real>
double loss_and_grads(TransformerModel<Real>& model, const ParamTable& table, std::vector<std::vector<Real>>& units,
                      std::vector<std::vector<Real>>& grads, const Batch& batch, Real dloss) {
  std::vector<const Real*> u;
  std::vector<Real*> g;
  grads.clear();
  for (auto& unit : units) {
    grads.emplace_back(unit.size(), Real(0));
    u.push_back(unit.data());
    g.push_back(grads.back().data());
  }
  return forward_backward_unsharded(model, table, u, g, batch, dloss);
}

}  // namespace

// Error model: central differences with h = 1e-5 in double have truncation error ~h^2 |L'''| ~ 1e-10
// and rounding error ~ 1e-16 |L| / h ~ 1e-11; the thresholds leave 100x margin.
TEST_P(ModelArchTest, GradientMatchesCentralFiniteDifferencesForEveryTensor) {
  ParamTable table(GetParam().config());
  const int B = 2, T = 5;
  auto model_ptr = make_model<double>(table, B, T, false, cpu_layer_ops<double>());
  TransformerModel<double>& model = *model_ptr;
  auto units = random_units<double>(table, 0.3, 99);
  std::vector<std::vector<double>> grads;
  Batch batch = make_batch(B, T, table.config().vocab_size);
  const double dloss = 1.0 / (B * T);
  loss_and_grads(model, table, units, grads, batch, dloss);
  const double h = 1e-5, atol = 1e-8, rtol = 1e-6;
  for (const ParamInfo& p : table.params()) {
    // First, last and a few interior elements of every tensor.
    for (size_t i : {size_t(0), p.numel / 3, p.numel / 2 + 1, p.numel - 1}) {
      if (i >= p.numel) continue;
      double& x = units[p.unit][p.offset + i];
      const double saved = x;
      x = saved + h;
      double up = forward_loss(model, table, units, batch) * dloss;
      x = saved - h;
      double down = forward_loss(model, table, units, batch) * dloss;
      x = saved;
      const double numeric = (up - down) / (2 * h), analytic = grads[p.unit][p.offset + i];
      EXPECT_NEAR(analytic, numeric, atol + rtol * std::fabs(numeric)) << p.name << "[" << i << "]";
    }
  }
}

// fp32 against fp64 on the same parameters: a forward of depth ~10 layers with C=12 keeps the
// relative loss error near 1e-6; gradients within 1e-4 relative to the tensor's largest element.
TEST_P(ModelArchTest, FloatAgreesWithDouble) {
  ParamTable table(GetParam().config());
  const int B = 2, T = 7;
  auto model64 = make_model<double>(table, B, T, false, cpu_layer_ops<double>());
  auto model32 = make_model<float>(table, B, T, false, cpu_layer_ops<float>());
  auto units64 = random_units<double>(table, 0.3, 99);
  auto units32 = random_units<float>(table, 0.3, 99);
  std::vector<std::vector<double>> grads64;
  std::vector<std::vector<float>> grads32;
  Batch batch = make_batch(B, T, table.config().vocab_size);
  double l64 = loss_and_grads(*model64, table, units64, grads64, batch, 1.0 / (B * T));
  double l32 = loss_and_grads(*model32, table, units32, grads32, batch, 1.0f / (B * T));
  EXPECT_NEAR(l32, l64, 1e-5 * std::fabs(l64));
  for (const ParamInfo& p : table.params()) {
    double scale = 0;
    for (size_t i = 0; i < p.numel; i++) scale = std::max(scale, std::fabs(grads64[p.unit][p.offset + i]));
    for (size_t i = 0; i < p.numel; i++)
      ASSERT_NEAR(grads32[p.unit][p.offset + i], grads64[p.unit][p.offset + i], 1e-4 * scale + 1e-9) << p.name << "[" << i << "]";
  }
}

TEST(ParamTable, Gpt2SmallHasTheKnownParameterCount) {
  ModelConfig c;
  c.n_layer = 12, c.n_embd = 768, c.n_head = 12, c.vocab_size = 50257, c.max_seq_len = 1024;
  ParamTable table(c);
  EXPECT_EQ(table.total_params(), 124439808u);  // GPT-2 small with the tied head (llm.c: 124M)
  EXPECT_EQ(table.units().size(), 13u);
  EXPECT_EQ(table.params().size(), 4u + 12u * 12u);
  // Offsets are contiguous within each unit and cover it exactly.
  for (const UnitInfo& u : table.units()) {
    size_t next = 0;
    for (int id : u.params) {
      EXPECT_EQ(table.params()[id].offset, next) << table.params()[id].name;
      next += table.params()[id].numel;
    }
    EXPECT_EQ(next, u.numel) << u.name;
  }
}

TEST(ParamTable, ShippedShapesHaveTheirNominalSizes) {
  auto count = [](int L, int C, int H) {
    ModelConfig c;
    c.n_layer = L, c.n_embd = C, c.n_head = H, c.vocab_size = 50257, c.max_seq_len = 1024;
    return ParamTable(c).total_params();
  };
  EXPECT_NEAR(count(12, 640, 10) / 1e6, 92.0, 1.0);
  EXPECT_NEAR(count(20, 1024, 16) / 1e6, 304.0, 1.5);
}

// Hugging Face's published parameter counts: SmolLM-135M and Llama-3.2-1B (tied), Mistral-Nemo-12B,
// TinyLlama-1.1B and Mistral-7B-v0.1 (untied).
TEST(ParamTable, LlamaShapesHaveTheParameterCountsOfTheRealModels) {
  ModelConfig smol;
  smol.arch = "llama", smol.n_layer = 30, smol.n_embd = 576, smol.n_head = 9, smol.n_kv_head = 3;
  smol.intermediate_size = 1536, smol.vocab_size = 49152, smol.max_seq_len = 2048, smol.tie_embeddings = true;
  EXPECT_EQ(ParamTable(smol).total_params(), 134515008u);
  ModelConfig llama32 = smol;
  llama32.n_layer = 16, llama32.n_embd = 2048, llama32.n_head = 32, llama32.n_kv_head = 8;
  llama32.intermediate_size = 8192, llama32.vocab_size = 128256, llama32.max_seq_len = 131072;
  llama32.rope_theta = 500000, llama32.rope_scaling = "llama3:factor=32,low_freq_factor=1,high_freq_factor=4,"
                                                      "original_max_position_embeddings=8192";
  EXPECT_EQ(ParamTable(llama32).total_params(), 1235814400u);
  ModelConfig nemo = llama32;  // Mistral-Nemo-12B: 32 heads of 128 on a width of 5120, untied
  nemo.n_layer = 40, nemo.n_embd = 5120, nemo.n_head = 32, nemo.n_kv_head = 8, nemo.head_dim = 128;
  nemo.intermediate_size = 14336, nemo.vocab_size = 131072, nemo.tie_embeddings = false, nemo.rope_scaling = "";
  EXPECT_EQ(ParamTable(nemo).total_params(), 12247782400u);
  ModelConfig tiny = smol;
  tiny.n_layer = 22, tiny.n_embd = 2048, tiny.n_head = 32, tiny.n_kv_head = 4, tiny.intermediate_size = 5632;
  tiny.vocab_size = 32000, tiny.tie_embeddings = false;
  const ParamTable table(tiny);
  EXPECT_EQ(table.total_params(), 1100048384u);
  ModelConfig mistral = tiny;  // Mistral-7B-v0.1 (inputs/mistral-7b.ini): its window adds no parameter
  mistral.n_layer = 32, mistral.n_embd = 4096, mistral.n_head = 32, mistral.n_kv_head = 8;
  mistral.intermediate_size = 14336, mistral.max_seq_len = 32768, mistral.sliding_window = 4096;
  EXPECT_EQ(ParamTable(mistral).total_params(), 7241732096u);
  // Hugging Face's names less "model.", q|k|v and gate|up adjacent in that order.
  const auto& p = table.params();
  EXPECT_EQ(p[table.units()[ROOT_UNIT].params[LLAMA_LM_HEAD]].name, "lm_head.weight");
  const std::vector<int>& block = table.units()[block_unit(21)].params;
  ASSERT_EQ(block.size(), static_cast<size_t>(LLAMA_BLOCK_PARAM_COUNT));
  EXPECT_EQ(p[block[LLAMA_K_W]].name, "layers.21.self_attn.k_proj.weight");
  EXPECT_EQ(p[block[LLAMA_K_W]].shape, (std::vector<int>{256, 2048}));
  EXPECT_EQ(p[block[LLAMA_DOWN_W]].name, "layers.21.mlp.down_proj.weight");
  EXPECT_EQ(p[block[LLAMA_K_W]].offset, p[block[LLAMA_Q_W]].offset + p[block[LLAMA_Q_W]].numel);
  EXPECT_EQ(p[block[LLAMA_V_W]].offset, p[block[LLAMA_K_W]].offset + p[block[LLAMA_K_W]].numel);
  EXPECT_EQ(p[block[LLAMA_UP_W]].offset, p[block[LLAMA_GATE_W]].offset + p[block[LLAMA_GATE_W]].numel);
}

// Qwen2.5-0.5B's published count (tied, q/k/v biases): its biases are adjacent after the weights,
// so q|k|v's bias is one vector too.
TEST(ParamTable, Qwen2ShapeHasTheParameterCountOfTheRealModel) {
  ModelConfig q;
  q.arch = "qwen2", q.n_layer = 24, q.n_embd = 896, q.n_head = 14, q.n_kv_head = 2, q.intermediate_size = 4864;
  q.vocab_size = 151936, q.max_seq_len = 32768, q.rope_theta = 1e6, q.norm_eps = 1e-6, q.tie_embeddings = true;
  const ParamTable table(q);
  EXPECT_EQ(table.total_params(), 494032768u);
  const auto& p = table.params();
  const std::vector<int>& block = table.units()[block_unit(3)].params;
  ASSERT_EQ(block.size(), static_cast<size_t>(LLAMA_V_B + 1));
  EXPECT_EQ(p[block[LLAMA_Q_B]].name, "layers.3.self_attn.q_proj.bias");
  EXPECT_EQ(p[block[LLAMA_V_B]].shape, (std::vector<int>{128}));
  EXPECT_EQ(p[block[LLAMA_K_B]].offset, p[block[LLAMA_Q_B]].offset + 896);
  EXPECT_EQ(p[block[LLAMA_V_B]].offset, p[block[LLAMA_K_B]].offset + 128);
}

// Qwen3-0.6B's count (tied; heads of 128 on a width of 1024): 0.44 B outside the embedding, as
// published, with one q_norm and one k_norm of 128 per block after the weights.
TEST(ParamTable, Qwen3ShapeHasTheParameterCountOfTheRealModel) {
  ModelConfig q;
  q.arch = "qwen3", q.n_layer = 28, q.n_embd = 1024, q.n_head = 16, q.n_kv_head = 8, q.head_dim = 128;
  q.intermediate_size = 3072, q.vocab_size = 151936, q.max_seq_len = 40960, q.rope_theta = 1e6, q.norm_eps = 1e-6;
  q.tie_embeddings = true;
  const ParamTable table(q);
  EXPECT_EQ(table.total_params(), 596049920u);
  EXPECT_EQ(table.total_params() - 151936u * 1024, 440467456u);
  const auto& p = table.params();
  const std::vector<int>& block = table.units()[block_unit(5)].params;
  ASSERT_EQ(block.size(), static_cast<size_t>(LLAMA_BLOCK_PARAM_COUNT + 2));
  const LlamaVariant qwen3{false, true};
  EXPECT_EQ(p[block[qwen3.q_norm_param()]].name, "layers.5.self_attn.q_norm.weight");
  EXPECT_EQ(p[block[qwen3.k_norm_param()]].name, "layers.5.self_attn.k_norm.weight");
  EXPECT_EQ(p[block[qwen3.k_norm_param()]].shape, (std::vector<int>{128}));
  EXPECT_EQ(p[block[LLAMA_Q_W]].shape, (std::vector<int>{2048, 1024}));
}

// Phi-3-mini-4k's count (untied, 32 heads of 96, no grouping), and where the Hugging Face file keeps
// each projection: q, k and v as rows of qkv_proj, gate and up as halves of gate_up_proj -- checked
// on Phi-3-medium's grouped heads (40 of 128 on 10), whose k and v are narrower than q.
TEST(ParamTable, Phi3ShapesHaveTheirParameterCountsAndFusedRows) {
  ModelConfig m;
  m.arch = "phi3", m.n_layer = 32, m.n_embd = 3072, m.n_head = 32, m.n_kv_head = 32, m.intermediate_size = 8192;
  m.vocab_size = 32064, m.max_seq_len = 4096, m.norm_eps = 1e-5, m.tie_embeddings = false, m.sliding_window = 2047;
  EXPECT_EQ(ParamTable(m).total_params(), 3821079552u);
  ModelConfig medium = m;
  medium.n_layer = 40, medium.n_embd = 5120, medium.n_head = 40, medium.n_kv_head = 10, medium.intermediate_size = 17920;
  const ParamTable table(medium);
  EXPECT_EQ(table.total_params(), 13960238080u);
  const auto& p = table.params();
  const std::vector<int>& block = table.units()[block_unit(7)].params;
  const ModelFamily& family = family_of(medium);
  struct Want {
    int param;
    const char* name;
    int64_t stored_rows, first, rows;
  } wants[] = {{LLAMA_Q_W, "model.layers.7.self_attn.qkv_proj.weight", 7680, 0, 5120},
               {LLAMA_K_W, "model.layers.7.self_attn.qkv_proj.weight", 7680, 5120, 1280},
               {LLAMA_V_W, "model.layers.7.self_attn.qkv_proj.weight", 7680, 6400, 1280},
               {LLAMA_GATE_W, "model.layers.7.mlp.gate_up_proj.weight", 35840, 0, 17920},
               {LLAMA_UP_W, "model.layers.7.mlp.gate_up_proj.weight", 35840, 17920, 17920}};
  for (const Want& w : wants) {
    const HfTensor t = family.hf_tensor(medium, p[block[w.param]]);
    EXPECT_EQ(t.name, w.name);
    EXPECT_EQ(t.shape, (std::vector<int64_t>{w.stored_rows, 5120}));
    EXPECT_EQ(t.rows, (std::vector<std::pair<int64_t, int64_t>>{{w.first, w.rows}})) << w.name;
  }
  const HfTensor down = family.hf_tensor(medium, p[block[LLAMA_DOWN_W]]);
  EXPECT_EQ(down.name, "model.layers.7.mlp.down_proj.weight");
  EXPECT_TRUE(down.rows.empty());
}

// SmolLM3-3B's count (tied, 16 heads of 128 on 4): its NoPE blocks have the same parameters.
TEST(ParamTable, SmolLM3ShapeHasTheParameterCountOfTheRealModel) {
  ModelConfig s;
  s.arch = "smollm3", s.n_layer = 36, s.n_embd = 2048, s.n_head = 16, s.n_kv_head = 4, s.intermediate_size = 11008;
  s.vocab_size = 128256, s.max_seq_len = 65536, s.rope_theta = 5e6, s.norm_eps = 1e-6, s.tie_embeddings = true;
  s.nope_layers = "3,7,11,15,19,23,27,31,35";
  EXPECT_EQ(ParamTable(s).total_params(), 3075098624u);
  EXPECT_EQ(family_of(s).config_defect(s), "");
  s.nope_layers = "3,36";
  EXPECT_NE(family_of(s).config_defect(s).find("'36' is not a block index in [0, 36)"), std::string::npos);
  s.nope_layers = "3,3";
  EXPECT_NE(family_of(s).config_defect(s).find("block 3 is given twice"), std::string::npos);
  s.nope_layers = "35,3,7", canonicalize(s);
  EXPECT_EQ(s.nope_layers, "3,7,35");
  for (const char* spelled : {"3, 7", "+3", "3,", ",3", "3x"}) {
    s.nope_layers = spelled;
    EXPECT_NE(family_of(s).config_defect(s), "") << spelled;
  }
}

// The NoPE block takes its q and k unturned: the same weights give another loss than with every
// block rotary, and with none listed exactly Llama's.
TEST(SmolLM3, NopeBlocksSkipTheRotaryTurn) {
  ModelConfig nope = tiny_smollm3_config(), plain = nope, llama = nope;
  plain.nope_layers = "";
  llama.arch = "llama", llama.nope_layers = "";
  const Batch batch = make_batch(2, 6, nope.vocab_size);
  auto loss_of = [&](const ModelConfig& c) {
    const ParamTable table(c);
    auto model = make_model<double>(table, 2, 6, false, cpu_layer_ops<double>());
    return forward_loss(*model, table, random_units<double>(table, 0.3, 7), batch);
  };
  EXPECT_EQ(loss_of(plain), loss_of(llama));
  EXPECT_GT(std::fabs(loss_of(nope) - loss_of(plain)), 1e-6);
}

namespace {

// The CPU's operations, counting the multiply-adds of the forward pass in the cost model that
// MFU uses: one per parameter element per token where a parameter is applied (GEMM weights and
// biases, LayerNorm gains and shifts; the embedding lookups apply none), and attention's QK^T and
// AV over the whole context. Counted from the shapes the model actually runs.
class CountingOps : public LayerOps<double> {
 public:
  double multiply_adds() const { return macs_; }
  Device& device() const override { return cpu().device(); }
  void encoder_forward(double* out, const int* tokens, const double* wte, const double* wpe, int B, int T, int C,
                       const int* positions) const override {
    cpu().encoder_forward(out, tokens, wte, wpe, B, T, C, positions);
  }
  void layernorm_forward(double* out, double* mean, double* rstd, const double* inp, const double* weight,
                         const double* bias, int N, int C) const override {
    macs_ += 2.0 * N * C;
    cpu().layernorm_forward(out, mean, rstd, inp, weight, bias, N, C);
  }
  void rmsnorm_forward(double* out, double* rstd, const double* inp, const double* weight, double eps, int N,
                       int C) const override {
    macs_ += 1.0 * N * C;  // the gain only
    cpu().rmsnorm_forward(out, rstd, inp, weight, eps, N, C);
  }
  void matmul_forward(double* out, const double* inp, const double* weight, const double* bias, int N, int C,
                      int OC) const override {
    macs_ += static_cast<double>(N) * C * OC + (bias ? static_cast<double>(N) * OC : 0.0);
    cpu().matmul_forward(out, inp, weight, bias, N, C, OC);
  }
  void attention_forward(double* out, double* lse, const double* qkv, int B, int T, int NH, int KV, int HS,
                         const int* doc_start) const override {
    // Per query head: T x span scores of HS, then T x HS outputs of span keys, the span the most keys
    // a row may see (its first key: doc_start, here only a sliding window's), counted whole.
    int span = T;
    if (doc_start) {
      span = 0;
      for (int t = 0; t < T; t++) span = std::max(span, t - doc_start[t] + 1);
    }
    macs_ += 2.0 * B * T * span * NH * HS;
    cpu().attention_forward(out, lse, qkv, B, T, NH, KV, HS, doc_start);
  }
  void rope_forward(double* qkv, const double* cos, const double* sin, int B, int T, int NH, int KV, int HS,
                    const int* positions) const override {
    cpu().rope_forward(qkv, cos, sin, B, T, NH, KV, HS, positions);
  }
  void gelu_forward(double* out, const double* inp, size_t n) const override { cpu().gelu_forward(out, inp, n); }
  void swiglu_forward(double* out, const double* gate_up, int N, int I) const override {
    cpu().swiglu_forward(out, gate_up, N, I);
  }
  void residual_forward(double* out, const double* a, const double* b, size_t n) const override {
    cpu().residual_forward(out, a, b, n);
  }
  void copy_rows(double* dst, int ld_dst, const double* src, int ld_src, int rows, int cols) const override {
    cpu().copy_rows(dst, ld_dst, src, ld_src, rows, cols);
  }
  void row_norms(double* out, const double* x, int rows, int cols) const override {
    cpu().row_norms(out, x, rows, cols);
  }
  void column_affine(double* y, int ld, int rows, int cols, const double* scale, const double* shift) const override {
    macs_ += static_cast<double>(rows) * cols;
    cpu().column_affine(y, ld, rows, cols, scale, shift);
  }
  void scale_rows(double* y, int rows, int cols, const double* scale, double offset) const override {
    cpu().scale_rows(y, rows, cols, scale, offset);  // a weight's rows: per layer, not per token
  }
  void column_dot_accumulate(double* out, const double* a, int lda, const double* b, int ldb, int rows, int cols,
                             const double* divisor) const override {
    cpu().column_dot_accumulate(out, a, lda, b, ldb, rows, cols, divisor);
  }
  void divide(double* out, const double* a, const double* b, size_t n) const override { cpu().divide(out, a, b, n); }
  // LoHa's and LoKr's weight deltas: once per step, not per token, so no multiply-adds counted.
  void multiply(double* out, const double* a, const double* b, size_t n, double s) const override {
    cpu().multiply(out, a, b, n, s);
  }
  void kron(double* out, const double* A, int p, int q, const double* B, int r, int t, double s) const override {
    cpu().kron(out, A, p, q, B, r, t, s);
  }
  void gemm(bool ta, bool tb, int M, int N, int K, double alpha, const double* A, int lda, const double* B, int ldb,
            double beta, double* C, int ldc) const override {
    macs_ += static_cast<double>(M) * N * K;
    cpu().gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  }
  void round_to_half(double* values, uint16_t* half, size_t n, DType type) const override {
    cpu().round_to_half(values, half, n, type);
  }
  void widen_half(double* values, const uint16_t* half, size_t n, DType type) const override {
    cpu().widen_half(values, half, n, type);
  }
  void dropout(double* out, const double* inp, const uint64_t* row_keys, uint64_t site, int N, int C,
               float p) const override {
    cpu().dropout(out, inp, row_keys, site, N, C, p);  // no multiply-adds
  }
  void softmax_crossentropy_forward(double* losses, double* logits_to_probs, const int* targets, int N,
                                    int V) const override {
    cpu().softmax_crossentropy_forward(losses, logits_to_probs, targets, N, V);
  }
  void distill_loss_forward(double* losses, double* student_to_grad, const double* teacher, const int* targets,
                            int N, int V, double alpha, double temperature) const override {
    cpu().distill_loss_forward(losses, student_to_grad, teacher, targets, N, V, alpha, temperature);  // no parameters
  }
  double sum(const double* x, size_t n) const override { return cpu().sum(x, n); }
  void accumulate_sum(double* total, const double* x, size_t n) const override { cpu().accumulate_sum(total, x, n); }

  // Not used by a forward pass.
  void encoder_backward(double*, double*, const double*, const int*, int, int, int, const int*) const override {
    unused();
  }
  void layernorm_backward(double*, double*, double*, const double*, const double*, const double*, const double*,
                          const double*, int, int) const override {
    unused();
  }
  void rmsnorm_backward(double*, double*, const double*, const double*, const double*, const double*, int,
                        int) const override {
    unused();
  }
  void matmul_backward(double*, double*, double*, const double*, const double*, const double*, int, int,
                       int) const override {
    unused();
  }
  void attention_backward(double*, const double*, const double*, const double*, const double*, int, int, int, int,
                          int, const int*) const override {
    unused();
  }
  void rope_backward(double*, const double*, const double*, int, int, int, int, int, const int*) const override {
    unused();
  }
  void attention_decode(double*, double*, double*, double*, const double*, int, int, int, int, int, int) const override {
    unused();
  }
  void gelu_backward(double*, const double*, const double*, size_t) const override { unused(); }
  void swiglu_backward(double*, const double*, const double*, int, int) const override { unused(); }
  void softmax_crossentropy_backward(double*, const int*, double, int, int) const override { unused(); }
  void kron_backward(double*, double*, const double*, const double*, int, int, const double*, int, int,
                     double) const override {
    unused();
  }
  double sum_squares(const double*, size_t) const override { return unused(), 0; }
  void accumulate_sum_squares(double*, const double*, size_t) const override { unused(); }
  size_t count_nonfinite(const double*, size_t) const override { return unused(), 0; }
  void scale(double*, size_t, double) const override { unused(); }

 private:
  static const LayerOps<double>& cpu() { return cpu_layer_ops<double>(); }
  static void unused() { ADD_FAILURE() << "a training forward pass called a backward or decode operation"; }
  mutable double macs_ = 0;
};

}  // namespace

// Training costs three forward passes' worth (the backward two) of two FLOPs per multiply-add.
TEST_P(ModelArchTest, FlopsPerTokenCountsTheMultiplyAddsTheModelRuns) {
  for (int seq_len : {16, 5}) {
    ModelConfig c = GetParam().config();
    c.max_seq_len = 16;
    ParamTable table(c);
    const int B = 2;
    CountingOps counting;
    auto model = make_model<double>(table, B, seq_len, false, counting);
    forward_loss(*model, table, random_units<double>(table, 0.3, 99), make_batch(B, seq_len, c.vocab_size));
    const double per_token = 2 * 3 * counting.multiply_adds() / (B * seq_len);
    EXPECT_DOUBLE_EQ(table.flops_per_token(seq_len), per_token) << "seq_len " << seq_len;
  }
}

// Packed documents (BATCH_DOC_STARTS, data.documents): one sequence holds documents [0, 4) and [4, 9).
constexpr int kPackedT = 9, kSecondDocument = 4;
Batch packed_batch(const std::vector<int>& tokens, const std::vector<int>& targets, bool documents,
                   bool restart_positions = false) {
  Batch batch = token_batch(tokens, targets, 1, kPackedT);
  if (documents) {
    int* starts = batch.put<int>(BATCH_DOC_STARTS, {1, kPackedT});
    for (int t = 0; t < kPackedT; t++) starts[t] = t < kSecondDocument ? 0 : kSecondDocument;
  }
  if (restart_positions) {
    int* positions = batch.put<int>(BATCH_POSITIONS, {1, kPackedT});
    for (int t = 0; t < kPackedT; t++) positions[t] = t < kSecondDocument ? t : t - kSecondDocument;
  }
  return batch;
}

// A sliding window of W over L blocks: position t's prediction reads tokens t - L(W-1) .. t and no
// earlier one. Changing token 0 of 9 (W = 3, L = 2: a reach of 5) leaves positions 5.. bit for bit
// and changes position 4; without the window it changes them all (the test can tell).
TEST(ModelWindowTest, ASlidingWindowBoundsWhatEachPositionReads) {
  constexpr int T = 9, kReach = 5;
  for (int window : {3, 0}) {
    ModelConfig c = tiny_mistral_window_config();
    c.max_seq_len = T, c.sliding_window = window;
    ParamTable table(c);
    const int V = c.vocab_size;
    auto model = make_model<double>(table, 1, T, false, cpu_layer_ops<double>());
    const auto units = random_units<double>(table, 0.3, 101);
    std::vector<int> tokens(T), targets(T);
    for (int t = 0; t < T; t++) tokens[t] = (t * 5 + 3) % V, targets[t] = (t * 7 + 1) % V;
    std::vector<std::vector<double>> probs;
    for (int first : {tokens[0], (tokens[0] + 1) % V}) {
      tokens[0] = first;
      forward_loss(*model, table, units, token_batch(tokens, targets, 1, T));
      probs.emplace_back(static_cast<size_t>(T) * V);
      for (int t = 0; t < T; t++) model->token_logits()->copy_head_probs(t, probs.back().data() + size_t(t) * V);
    }
    auto changed = [&](int t) {
      double largest = 0;
      for (int v = 0; v < V; v++) largest = std::max(largest, std::fabs(probs[0][t * V + v] - probs[1][t * V + v]));
      return largest;
    };
    EXPECT_GT(changed(kReach - 1), 1e-9) << "window " << window << ": position " << kReach - 1 << " reads token 0";
    for (int t = kReach; t < T; t++) {
      if (window)
        EXPECT_EQ(changed(t), 0.0) << "position " << t << " read token 0 through a window of " << window;
      else
        EXPECT_GT(changed(t), 1e-9) << "without a window position " << t << " should read token 0";
    }
  }
}

// The second document's predictions do not depend on the first document's tokens with documents
// (and do without them: the test can tell), for every family.
TEST_P(ModelArchTest, PackedDocumentsDoNotSeeEachOther) {
  ModelConfig c = GetParam().config();
  c.max_seq_len = kPackedT;
  ParamTable table(c);
  const int V = table.config().vocab_size;
  auto model = make_model<double>(table, 1, kPackedT, false, cpu_layer_ops<double>());
  const auto units = random_units<double>(table, 0.3, 99);
  std::vector<int> tokens(kPackedT), other(kPackedT), targets(kPackedT);
  for (int t = 0; t < kPackedT; t++) tokens[t] = (t * 5 + 3) % V, targets[t] = (t * 7 + 1) % V;
  other = tokens;
  for (int t = 0; t < kSecondDocument; t++) other[t] = (tokens[t] + 1) % V;
  for (bool documents : {true, false}) {
    std::vector<std::vector<double>> probs;
    for (const auto* first : {&tokens, &other}) {
      forward_loss(*model, table, units, packed_batch(*first, targets, documents));
      probs.emplace_back(static_cast<size_t>(kPackedT - kSecondDocument) * V);
      for (int t = kSecondDocument; t < kPackedT; t++)
        model->token_logits()->copy_head_probs(t, probs.back().data() + static_cast<size_t>(t - kSecondDocument) * V);
    }
    double largest = 0;
    for (size_t i = 0; i < probs[0].size(); i++) largest = std::max(largest, std::fabs(probs[0][i] - probs[1][i]));
    if (documents)
      EXPECT_EQ(largest, 0.0) << "the second document saw the first";
    else
      EXPECT_GT(largest, 1e-6) << "without documents the first document should matter";
  }
}

// Each packed document gets what it gets alone: the packed sequence's summed loss and its gradients
// are its two documents' run on their own, added. With positions restarting per document that holds
// for every family up to rounding; without, for the rotary families (Llama, Qwen 2), whose attention
// sees only relative positions, up to the rotary tables' fp32 angles (as transformers computes them:
// position t's rotation is not exactly position 0's turned by t steps, a relative 1e-7 or so).
void check_documents_alone(ModelConfig c, bool restart_positions, double tolerance) {
  c.max_seq_len = kPackedT;
  ParamTable table(c);
  const int V = table.config().vocab_size;
  auto units = random_units<double>(table, 0.3, 99);
  std::vector<int> tokens(kPackedT), targets(kPackedT);
  for (int t = 0; t < kPackedT; t++) tokens[t] = (t * 5 + 3) % V, targets[t] = (t * 7 + 1) % V;
  auto packed = make_model<double>(table, 1, kPackedT, false, cpu_layer_ops<double>());
  std::vector<std::vector<double>> grads, grads_first, grads_second;
  const double loss =
      loss_and_grads(*packed, table, units, grads, packed_batch(tokens, targets, true, restart_positions), 1.0);
  const auto part = [&](int begin, int end, std::vector<std::vector<double>>& g) {
    auto model = make_model<double>(table, 1, end - begin, false, cpu_layer_ops<double>());
    const std::vector<int> t(tokens.begin() + begin, tokens.begin() + end),
        y(targets.begin() + begin, targets.begin() + end);
    return loss_and_grads(*model, table, units, g, token_batch(t, y, 1, end - begin), 1.0);
  };
  const double alone = part(0, kSecondDocument, grads_first) + part(kSecondDocument, kPackedT, grads_second);
  EXPECT_NEAR(loss, alone, tolerance * std::fabs(alone)) << c.arch;
  for (const ParamInfo& p : table.params()) {
    double scale = 0;
    for (size_t i = 0; i < p.numel; i++) scale = std::max(scale, std::fabs(grads[p.unit][p.offset + i]));
    for (size_t i = 0; i < p.numel; i++) {
      const size_t at = p.offset + i;
      ASSERT_NEAR(grads[p.unit][at], grads_first[p.unit][at] + grads_second[p.unit][at], tolerance * scale + 1e-15)
          << c.arch << " " << p.name << "[" << i << "]";
    }
  }
}

TEST(PackedDocuments, RotaryModelsGiveEachDocumentWhatItGetsAlone) {
  for (ModelConfig (*config)() :
       {tiny_llama_config, tiny_llama_tied_config, tiny_qwen2_config, tiny_qwen3_config, tiny_smollm3_config})
    check_documents_alone(config(), false, 1e-6);
}

TEST_P(ModelArchTest, RestartedPositionsGiveEachDocumentWhatItGetsAlone) {
  check_documents_alone(GetParam().config(), true, 1e-12);
}

// Activation checkpointing recomputes each block's forward in backward: the same operations on
// the same inputs, so the gradients are bit-identical, and the model holds fewer activations.
TEST_P(ModelArchTest, RecomputationGivesIdenticalGradients) {
  ParamTable table(GetParam().config());
  const int B = 2, T = 6;
  auto plain = make_model<double>(table, B, T, false, cpu_layer_ops<double>());
  auto recomputing = make_model<double>(table, B, T, true, cpu_layer_ops<double>());
  auto units = random_units<double>(table, 0.3, 99);
  std::vector<std::vector<double>> g1, g2;
  Batch batch = make_batch(B, T, table.config().vocab_size);
  double l1 = loss_and_grads(*plain, table, units, g1, batch, 1.0 / (B * T));
  double l2 = loss_and_grads(*recomputing, table, units, g2, batch, 1.0 / (B * T));
  EXPECT_EQ(l1, l2);
  EXPECT_EQ(g1, g2);
  EXPECT_LT(recomputing->activation_bytes(), plain->activation_bytes());
}

// fsdp.checkpoint_blocks: only the first k blocks recompute. The gradients are those of keeping
// everything, bit for bit, in fp64 and in 16-bit storage; the allocation is the plan; and each
// recomputed block past the first frees one block's activations: with L blocks,
// none - every = (L - 1) x a block's, none - first k = (k - 1) x a block's.
TEST_P(ModelArchTest, RecomputingTheFirstBlocksKeepsTheBitsAndFreesABlockEach) {
  ModelConfig config = GetParam().config();
  config.n_layer = 4;
  const ParamTable table(config);
  const int B = 2, T = 6, L = config.n_layer;
  const Batch batch = make_batch(B, T, config.vocab_size);
  auto units = random_units<double>(table, 0.3, 99);
  auto plain = make_model<double>(table, B, T, false, cpu_layer_ops<double>());
  std::vector<std::vector<double>> want;
  const double loss = loss_and_grads(*plain, table, units, want, batch, 1.0 / (B * T));
  const long none = static_cast<long>(plan_activation_bytes(table, B, T, false));
  const long every = static_cast<long>(plan_activation_bytes(table, B, T, true));
  ASSERT_GT(none, every);
  ASSERT_EQ((none - every) % (L - 1), 0);
  const long block = (none - every) / (L - 1);
  auto units32 = random_units<float>(table, 0.3, 99);
  auto plain16 = make_model<float>(table, B, T, false, cpu_layer_ops<float>(), DTYPE_BF16);
  std::vector<std::vector<float>> want16;
  const double loss16 = loss_and_grads(*plain16, table, units32, want16, batch, 1.0f / (B * T));
  for (int k = 1; k <= L; k++) {
    SCOPED_TRACE(::testing::Message() << "first " << k << " blocks");
    const Checkpointing first = Checkpointing::first(k);
    auto model = make_model<double>(table, B, T, first, cpu_layer_ops<double>());
    std::vector<std::vector<double>> got;
    EXPECT_EQ(loss_and_grads(*model, table, units, got, batch, 1.0 / (B * T)), loss);
    EXPECT_EQ(got, want);
    const size_t before = host_device().live_bytes();
    auto model16 = make_model<float>(table, B, T, first, cpu_layer_ops<float>(), DTYPE_BF16);
    EXPECT_EQ(host_device().live_bytes() - before,
              plan_activation_bytes(table, B, T, first, sizeof(float), DTYPE_BF16));
    std::vector<std::vector<float>> got16;
    EXPECT_EQ(loss_and_grads(*model16, table, units32, got16, batch, 1.0f / (B * T)), loss16);
    EXPECT_EQ(got16, want16);
    model16.reset();
    const size_t before32 = host_device().live_bytes();
    auto model32 = make_model<float>(table, B, T, first, cpu_layer_ops<float>());
    EXPECT_EQ(none - static_cast<long>(host_device().live_bytes() - before32), (k - 1) * block);
  }
}

// 16-bit activation storage (fsdp.activation_dtype, model/saved_activations.hpp). Backward widens
// the saved copies where checkpointing recomputes them: both see the same 16-bit values, so the
// gradients are bit-identical here too.
TEST_P(ModelArchTest, SixteenBitActivationsRecomputeBitForBit) {
  ParamTable table(GetParam().config());
  const int B = 2, T = 6;
  auto units = random_units<float>(table, 0.3, 99);
  Batch batch = make_batch(B, T, table.config().vocab_size);
  for (DType dtype : {DTYPE_BF16, DTYPE_FP16}) {
    SCOPED_TRACE(dtype_name(dtype));
    auto plain = make_model<float>(table, B, T, false, cpu_layer_ops<float>(), dtype);
    auto recomputing = make_model<float>(table, B, T, true, cpu_layer_ops<float>(), dtype);
    std::vector<std::vector<float>> g1, g2;
    EXPECT_EQ(loss_and_grads(*plain, table, units, g1, batch, 1.0f / (B * T)),
              loss_and_grads(*recomputing, table, units, g2, batch, 1.0f / (B * T)));
    EXPECT_EQ(g1, g2);
  }
}

// Against fp32 storage: every saved tensor rounded (bf16: 8 significant bits, 2^-9 relative) moves
// the loss and the gradient (relative to its norm) by the format's precision -- measured with
// these seeds, bf16: loss up to 1.5e-3, gradient 2.3e-2 (llama); fp16: 1.1e-4 and 2.9e-3 -- and it
// does move: the rounding happens.
TEST_P(ModelArchTest, SixteenBitActivationsStayCloseToFp32) {
  constexpr double LOSS_BOUND[] = {0, 4e-3, 1e-3}, GRAD_BOUND[] = {0, 8e-2, 1e-2};  // by DType: -, bf16, fp16
  ParamTable table(GetParam().config());
  const int B = 2, T = 6;
  auto units = random_units<float>(table, 0.3, 99);
  Batch batch = make_batch(B, T, table.config().vocab_size);
  auto reference = make_model<float>(table, B, T, false, cpu_layer_ops<float>());
  std::vector<std::vector<float>> want;
  const double loss32 = loss_and_grads(*reference, table, units, want, batch, 1.0f / (B * T));
  for (DType dtype : {DTYPE_BF16, DTYPE_FP16}) {
    SCOPED_TRACE(dtype_name(dtype));
    auto model = make_model<float>(table, B, T, false, cpu_layer_ops<float>(), dtype);
    std::vector<std::vector<float>> got;
    const double loss = loss_and_grads(*model, table, units, got, batch, 1.0f / (B * T));
    double diff2 = 0, norm2 = 0;
    for (size_t u = 0; u < got.size(); u++)
      for (size_t i = 0; i < got[u].size(); i++)
        diff2 += std::pow(double(got[u][i]) - want[u][i], 2), norm2 += std::pow(double(want[u][i]), 2);
    const double loss_error = std::abs(loss - loss32) / loss32, grad_error = std::sqrt(diff2 / norm2);
    std::printf("[ %s %s ] loss %.3g, gradient %.3g relative\n", GetParam().name, dtype_name(dtype), loss_error,
                grad_error);
    EXPECT_GT(loss_error, 0.0);
    EXPECT_LT(loss_error, LOSS_BOUND[dtype]);
    EXPECT_LT(grad_error, GRAD_BOUND[dtype]);
  }
}

// The bytes a model reports are the bytes it allocates (counted by the host device), for each
// storage type, with and without checkpointing; 16-bit storage trades the K layers' fp32 saved
// tensors (S elements each) for one fp32 working set and K 16-bit copies: S (4 + 2K - 4K) bytes.
TEST_P(ModelArchTest, ActivationBytesAreTheAllocatedBytes) {
  ParamTable table(GetParam().config());
  const ModelConfig& c = table.config();
  const int B = 2, T = 6;
  size_t S = 0;
  for (size_t n : plan_saved_tensor_elements(c, B, T)) S += n;
  const int qk_norm_input = c.arch == "qwen3" ? (c.n_head + c.kv_heads()) * c.head_size() : 0;
  EXPECT_EQ(S, static_cast<size_t>(B) * T *
                   (c.arch != "gpt2" ? 2 * c.n_embd + c.attn_size() + c.qkv_size() + 3 * c.mlp_size() + qk_norm_input
                                     : 14 * c.n_embd));
  for (bool checkpointing : {false, true}) {
    const long K = checkpointing ? 1 : c.n_layer;
    long fp32_bytes = 0;
    for (DType dtype : {DTYPE_FP32, DTYPE_BF16, DTYPE_FP16}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << (checkpointing ? " checkpointing" : ""));
      const size_t before = host_device().live_bytes();
      auto model = make_model<float>(table, B, T, checkpointing, cpu_layer_ops<float>(), dtype);
      const size_t allocated = host_device().live_bytes() - before;
      EXPECT_EQ(allocated, model->activation_bytes());
      EXPECT_EQ(allocated, plan_activation_bytes(table, B, T, checkpointing, sizeof(float), dtype));
      if (dtype == DTYPE_FP32) {
        fp32_bytes = static_cast<long>(allocated);
      } else {
        EXPECT_EQ(static_cast<long>(allocated) - fp32_bytes, static_cast<long>(S) * (4 - 2 * K));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Archs, ModelArchTest, ::testing::ValuesIn(ARCH_CASES), arch_case_name);
