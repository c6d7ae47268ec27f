// The FLUX families' model (model/families/flux), FLUX.1 and FLUX.2 alike: central finite
// differences in double of the whole forward/backward (every parameter tensor), float against
// double, activation checkpointing against keeping everything, the allocation against its plan,
// and the parameter tables against FLUX.1-dev's and FLUX.2-dev's published sizes. The equations
// against an independent reference: tests/e2e/test_flux.py.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "app/sample.hpp"
#include "model/families/flux/flux_family.hpp"
#include "model/family.hpp"
#include "model/model.hpp"
#include "support/model_fixtures.hpp"

using namespace shardtrain;
using namespace shardtrain::testing;

namespace {

constexpr int B = 2, ROWS = 2, COLS = 3, N = ROWS * COLS;

template <typename Real>
double loss_and_grads(TransformerModel<Real>& model, const ParamTable& table, std::vector<std::vector<Real>>& units,
                      std::vector<std::vector<Real>>* grads, const Batch& batch, Real dloss) {
  std::vector<const Real*> u;
  std::vector<Real*> g;
  std::vector<std::vector<Real>> scratch, &out = grads ? *grads : scratch;
  out.clear();
  for (auto& unit : units) {
    out.emplace_back(unit.size(), Real(0));
    u.push_back(unit.data());
    g.push_back(out.back().data());
  }
  return forward_backward_unsharded(model, table, u, g, batch, dloss);
}

template <typename Real>
double forward_loss(TransformerModel<Real>& model, const ParamTable& table, const std::vector<std::vector<Real>>& units,
                    const Batch& batch) {
  model.embed_forward(units[ROOT_UNIT].data(), batch);
  for (int l = 0; l < table.block_count(); l++) model.block_forward(l, units[block_unit(l)].data());
  return model.host_head_forward(units[ROOT_UNIT].data(), batch);
}

// The adapters' gradients of a model of `table` (random units of `seed`, a batch of `salt`) against
// central differences of the loss, at three elements of each adapter tensor; and the base, frozen,
// gets no gradient.
void check_adapter_gradients(const ParamTable& table, uint64_t seed, uint64_t salt) {
  const ModelConfig& config = table.config();
  auto model = make_model<double>(table, B, N, false, cpu_layer_ops<double>());
  auto units = random_units<double>(table, 0.3, seed);
  std::vector<std::vector<double>> grads;
  const Batch batch = make_flux_batch(config, B, ROWS, COLS, salt);
  const double dloss = 1.0 / (B * N * config.in_channels);
  loss_and_grads(*model, table, units, &grads, batch, dloss);
  for (const ParamInfo& p : table.params()) {
    if (!p.adapter) continue;
    for (size_t i : {size_t(0), p.numel / 2, p.numel - 1}) {
      double& x = units[p.unit][p.offset + i];
      const double numeric = central_difference(x, [&] { return forward_loss(*model, table, units, batch) * dloss; });
      EXPECT_NEAR(grads[p.unit][p.offset + i], numeric, 1e-9 + 1e-6 * std::fabs(numeric))
          << config.arch << " " << adapter_type_name(table.adapter().type) << " " << p.name << "[" << i << "]";
    }
  }
  for (const ParamInfo& p : table.params()) {
    if (p.adapter) continue;
    for (size_t i = 0; i < p.numel; i++) ASSERT_EQ(grads[p.unit][p.offset + i], 0.0) << p.name;
  }
}

}  // namespace

// h = 1e-5 in double: truncation ~1e-10, rounding ~1e-11 (as the decoders' test).
// Also Kontext's shape (condition tokens after the target's, outside the loss) and schnell's (no
// guidance embedder).
TEST(Flux, GradientMatchesCentralFiniteDifferencesForEveryTensor) {
  for (int variant = 0; variant < 4; variant++) {
    const bool guidance = variant % 2 == 0;
    ModelConfig config = variant < 2 ? tiny_flux_config() : tiny_flux2_config();
    config.guidance_embeds = guidance;
    config.condition_len = guidance ? 0 : 3;
    const ParamTable table(config);
    auto model = make_model<double>(table, B, N, false, cpu_layer_ops<double>());
    auto units = random_units<double>(table, 0.3, 17);
    std::vector<std::vector<double>> grads;
    const Batch batch = make_flux_batch(config, B, ROWS, COLS, 5);
    const double dloss = 1.0 / (B * N * config.in_channels);
    loss_and_grads(*model, table, units, &grads, batch, dloss);
    const double h = 1e-5, atol = 1e-9, rtol = 1e-6;
    for (const ParamInfo& p : table.params())
      for (size_t i : {size_t(0), p.numel / 3, p.numel / 2 + 1, p.numel - 1}) {
        if (i >= p.numel) continue;
        double& x = units[p.unit][p.offset + i];
        const double saved = x;
        x = saved + h;
        const double up = forward_loss(*model, table, units, batch) * dloss;
        x = saved - h;
        const double down = forward_loss(*model, table, units, batch) * dloss;
        x = saved;
        const double numeric = (up - down) / (2 * h), analytic = grads[p.unit][p.offset + i];
        EXPECT_NEAR(analytic, numeric, atol + rtol * std::fabs(numeric)) << config.arch << " " << p.name << "[" << i << "]";
      }
  }
}

TEST(Flux, FloatAgreesWithDouble) {
  for (const ModelConfig& config : {tiny_flux_config(), tiny_flux2_config()}) {
  const ParamTable table(config);
  auto m64 = make_model<double>(table, B, N, false, cpu_layer_ops<double>());
  auto m32 = make_model<float>(table, B, N, false, cpu_layer_ops<float>());
  auto u64 = random_units<double>(table, 0.3, 17);
  auto u32 = random_units<float>(table, 0.3, 17);
  std::vector<std::vector<double>> g64;
  std::vector<std::vector<float>> g32;
  const Batch batch = make_flux_batch(config, B, ROWS, COLS, 5);
  const double l64 = loss_and_grads(*m64, table, u64, &g64, batch, 1.0);
  const double l32 = loss_and_grads(*m32, table, u32, &g32, batch, 1.0f);
  EXPECT_NEAR(l32, l64, 1e-5 * std::fabs(l64));
  for (const ParamInfo& p : table.params()) {
    double scale = 0;
    for (size_t i = 0; i < p.numel; i++) scale = std::max(scale, std::fabs(g64[p.unit][p.offset + i]));
    for (size_t i = 0; i < p.numel; i++)
      ASSERT_NEAR(g32[p.unit][p.offset + i], g64[p.unit][p.offset + i], 1e-4 * scale + 1e-9) << p.name << "[" << i << "]";
  }
  }
}

// Recomputing each block from its input gives the same bits as keeping its activations.
TEST(Flux, ActivationCheckpointingChangesNoBits) {
  for (const ModelConfig& config : {tiny_flux_config(), tiny_flux2_config()}) {
  const ParamTable table(config);
  auto units = random_units<float>(table, 0.3, 17);
  const Batch batch = make_flux_batch(config, B, ROWS, COLS, 5);
  std::vector<std::vector<float>> kept, recomputed;
  auto plain = make_model<float>(table, B, N, false, cpu_layer_ops<float>());
  auto checkpointed = make_model<float>(table, B, N, true, cpu_layer_ops<float>());
  const double l1 = loss_and_grads(*plain, table, units, &kept, batch, 0.5f);
  const double l2 = loss_and_grads(*checkpointed, table, units, &recomputed, batch, 0.5f);
  EXPECT_EQ(l1, l2);
  EXPECT_EQ(kept, recomputed);
  EXPECT_LT(checkpointed->activation_bytes(), plain->activation_bytes());
  }
}

// fsdp.checkpoint_blocks: only the first k blocks recompute (the double blocks, then the single):
// the same bits as keeping everything, in fp32 and 16 bits; the allocation is the plan; less is
// held from the first recomputed block in 16 bits and once two share the working set in fp32, and
// k = every block is what recomputing every block holds.
TEST(Flux, RecomputingTheFirstBlocksChangesNoBits) {
  for (const ModelConfig& config : {tiny_flux_config(), tiny_flux2_config()}) {
    const ParamTable table(config);
    const int blocks = config.n_layer + config.n_single_layer;
    ASSERT_EQ(config.n_layer, 2);
    auto units = random_units<float>(table, 0.3, 17);
    const Batch batch = make_flux_batch(config, B, ROWS, COLS, 5);
    Device& dev = cpu_layer_ops<float>().device();
    for (DType dtype : {DTYPE_FP32, DTYPE_BF16}) {
      auto plain = make_model<float>(table, B, N, false, cpu_layer_ops<float>(), dtype);
      std::vector<std::vector<float>> want;
      const double loss = loss_and_grads(*plain, table, units, &want, batch, 0.5f);
      for (int k = 1; k <= blocks; k++) {
        SCOPED_TRACE(::testing::Message() << config.arch << " " << dtype_name(dtype) << " first " << k);
        const Checkpointing first = Checkpointing::first(k);
        const size_t before = dev.live_bytes();
        auto model = make_model<float>(table, B, N, first, cpu_layer_ops<float>(), dtype);
        EXPECT_EQ(dev.live_bytes() - before, plan_activation_bytes(table, B, N, first, sizeof(float), dtype));
        std::vector<std::vector<float>> got;
        EXPECT_EQ(loss_and_grads(*model, table, units, &got, batch, 0.5f), loss);
        EXPECT_EQ(got, want);
        // A recomputing block keeps no region of its own: in 16 bits its copies are freed from the
        // first; in fp32 its kept tensors move into the working set, which grows by as much.
        if (k >= 2 || dtype != DTYPE_FP32) EXPECT_LT(model->activation_bytes(), plain->activation_bytes());
        if (k == blocks)
          EXPECT_EQ(model->activation_bytes(), plan_activation_bytes(table, B, N, true, sizeof(float), dtype));
      }
    }
  }
}

// fsdp.activation_dtype=bf16 | fp16: the block inputs and the tensors each block's backward reads
// in 16 bits, rounded where they are made. Checkpointing's recompute rounds them the same way in
// place (no bits change here either: its working set is what the widened copies give), and the
// gradients stay fp32's to the format's precision -- a backward from values its forward did not
// compute would miss by far more.
TEST(Flux, HalfActivationsRecomputeTheSameBitsAndStayNearFp32) {
  for (const ModelConfig& config : {tiny_flux_config(), tiny_flux2_config()}) {
    const ParamTable table(config);
    auto units = random_units<float>(table, 0.3, 17);
    const Batch batch = make_flux_batch(config, B, ROWS, COLS, 5);
    std::vector<std::vector<float>> g32, kept, recomputed;
    auto fp32 = make_model<float>(table, B, N, false, cpu_layer_ops<float>());
    const double l32 = loss_and_grads(*fp32, table, units, &g32, batch, 1.0f);
    for (DType dtype : {DTYPE_BF16, DTYPE_FP16}) {
      SCOPED_TRACE(config.arch + " " + dtype_name(dtype));
      auto plain = make_model<float>(table, B, N, false, cpu_layer_ops<float>(), dtype);
      auto checkpointed = make_model<float>(table, B, N, true, cpu_layer_ops<float>(), dtype);
      const double l1 = loss_and_grads(*plain, table, units, &kept, batch, 1.0f);
      const double l2 = loss_and_grads(*checkpointed, table, units, &recomputed, batch, 1.0f);
      EXPECT_EQ(l1, l2);
      EXPECT_EQ(kept, recomputed);
      // 8 and 11 significant bits: measured at most 4.2e-2 and 1.3e-2 of a tensor's largest gradient
      // (FLUX.2's fp16 gains less than 8x on bf16: its activations here reach 600, where rounding
      // errors pass through softmaxes with large logits).
      const double tolerance = dtype == DTYPE_BF16 ? 8e-2 : 3e-2;
      EXPECT_NE(l1, l32);
      EXPECT_NEAR(l1, l32, tolerance * std::fabs(l32));
      double worst = 0;
      std::string worst_name;
      for (const ParamInfo& p : table.params()) {
        double scale = 1e-9;
        for (size_t i = 0; i < p.numel; i++) scale = std::max(scale, std::fabs(double(g32[p.unit][p.offset + i])));
        for (size_t i = 0; i < p.numel; i++) {
          const double off = std::fabs(double(kept[p.unit][p.offset + i]) - g32[p.unit][p.offset + i]) / scale;
          if (off > worst) worst = off, worst_name = p.name;
        }
      }
      std::printf("[ %s %s ] loss %.2g relative, gradients %.2g of their tensor's largest (%s)\n", config.arch.c_str(),
                  dtype_name(dtype), std::fabs(l1 - l32) / std::fabs(l32), worst, worst_name.c_str());
      EXPECT_LT(worst, tolerance) << worst_name;
    }
  }
}

// What the model allocates, counted by the device, is what the planner says, with and without
// checkpointing, with activations in fp32 and 16 bits (what 16 bits saves: the next test); and the
// loss is the flow-matching mean squared error's sum.
TEST(Flux, AllocationEqualsThePlan) {
  for (const ModelConfig& config : {tiny_flux_config(), tiny_flux2_config()}) {
  const ParamTable table(config);
  Device& dev = cpu_layer_ops<float>().device();
  ModelConfig kontext = config;
  kontext.condition_len = 5;
  const ParamTable kontext_table(kontext);
  for (bool ckpt : {false, true}) {
    const size_t before = dev.live_bytes();
    auto model = make_model<float>(kontext_table, B, N, ckpt, cpu_layer_ops<float>());
    EXPECT_EQ(dev.live_bytes() - before, model->activation_bytes());
    EXPECT_EQ(model->activation_bytes(), plan_activation_bytes(kontext_table, B, N, ckpt));
    EXPECT_EQ(model->output_rows(), B * N);  // the target tokens alone
  }
  for (bool ckpt : {false, true}) {
    size_t fp32_bytes = 0;
    for (DType dtype : {DTYPE_FP32, DTYPE_BF16, DTYPE_FP16}) {
      SCOPED_TRACE(config.arch + " " + dtype_name(dtype) + (ckpt ? " checkpointing" : ""));
      const size_t before = dev.live_bytes();
      auto model = make_model<float>(table, B, N, ckpt, cpu_layer_ops<float>(), dtype);
      EXPECT_EQ(dev.live_bytes() - before, model->activation_bytes());
      EXPECT_EQ(model->activation_bytes(), plan_activation_bytes(table, B, N, ckpt, sizeof(float), dtype));
      EXPECT_EQ(model->output_rows(), B * N);
      EXPECT_EQ(model->loss().units_per_row(model->output_width()), config.in_channels);
      if (dtype == DTYPE_FP32) {
        fp32_bytes = model->activation_bytes();
      } else if (!ckpt) {  // (with checkpointing two block inputs are kept in fp32 anyway: no less here)
        EXPECT_LT(model->activation_bytes(), fp32_bytes);
      }
    }
  }
  }
}

// FLUX.1-dev (19 double, 38 single, C = 3072, 24 heads, 64 channels, T5 4096, CLIP 768, guidance):
// 11,901,408,320 parameters, the count of diffusers' FluxTransformer2DModel.
static ModelConfig flux1_dev_config() {
  ModelConfig c;
  c.arch = "flux", c.n_layer = 19, c.n_single_layer = 38, c.n_embd = 3072, c.n_head = 24, c.max_seq_len = 4096;
  return c;
}

TEST(Flux, Flux1DevHasItsPublishedParameterCount) {
  ModelConfig c = flux1_dev_config();
  EXPECT_EQ(family_of(c).config_defect(c), "");
  const ParamTable table(c);
  EXPECT_EQ(table.total_params(), 11901408320u);
  EXPECT_EQ(table.block_count(), 57);
  EXPECT_EQ(table.units()[1].kind, "double");
  EXPECT_EQ(table.units()[20].kind, "single");
  c.guidance_embeds = false;  // schnell
  EXPECT_EQ(ParamTable(c).total_params(), 11901408320u - (256u * 3072 + 3072 + 3072u * 3072 + 3072));
}

// FLUX.2-dev (8 double, 48 single, C = 6144, 48 heads, MLP 3 x, 128 channels, 15360-wide text,
// guidance): 32,223,281,152 parameters, the count of diffusers' Flux2Transformer2DModel (0.42.1,
// its defaults); 32,183,959,552 without the guidance embedder.
static ModelConfig flux2_dev_config() {
  ModelConfig c;
  c.arch = "flux2", c.n_layer = 8, c.n_single_layer = 48, c.n_embd = 6144, c.n_head = 48, c.max_seq_len = 4096;
  c.in_channels = 128, c.context_dim = 15360, c.pooled_dim = 0, c.intermediate_size = 18432;
  c.rope_axes = "32,32,32,32", c.rope_theta = 2000, c.norm_eps = 1e-6;
  return c;
}

TEST(Flux, Flux2DevHasItsPublishedParameterCount) {
  ModelConfig c = flux2_dev_config();
  EXPECT_EQ(family_of(c).config_defect(c), "");
  const ParamTable table(c);
  EXPECT_EQ(table.total_params(), 32223281152u);
  EXPECT_EQ(table.block_count(), 56);
  EXPECT_EQ(table.param(ROOT_UNIT, FLUX2_MOD_SINGLE_W).name, "single_stream_modulation.linear.weight");
  EXPECT_EQ(table.param(block_unit(0), FLUX2_D_STREAM_PARAMS + FLUX2_D_FF_OUT_W).name,
            "transformer_blocks.0.ff_context.linear_out.weight");
  EXPECT_EQ(table.param(block_unit(8), FLUX2_S_OUT_W).name, "single_transformer_blocks.0.attn.to_out.weight");
  c.guidance_embeds = false;
  EXPECT_EQ(ParamTable(c).total_params(), 32183959552u);
  c.pooled_dim = 768;  // FLUX.2 has no pooled vector: a config that names one is refused
  EXPECT_NE(family_of(c).config_defect(c).find("model.pooled_dim=0"), std::string::npos);
  // A width diffusers' mlp_ratio cannot carry (int(3584 * (3603 / 3584)) is 3602) is refused.
  c.pooled_dim = 0, c.n_embd = 3584, c.n_head = 28, c.intermediate_size = 3603;
  EXPECT_NE(family_of(c).config_defect(c).find("mlp_ratio = 3603 / 3584, which gives back 3602"), std::string::npos)
      << family_of(c).config_defect(c);
  c.intermediate_size = 3 * 3584;
  EXPECT_EQ(family_of(c).config_defect(c), "");
}

// fsdp.activation_dtype=bf16 without checkpointing, by the equations: every tensor a block's
// backward reads (per row of a double block's stream: its normed inputs, q and k before their
// norms, the output product, the gated sum, the second normed input, the MLP's first and last
// products: 7C + FH; per joint row: [q; k; v] after the rotary turn and the attention output, 4C;
// per row of a single block: its normed input, q, k, [q; k; v], the attention output, the MLP's
// input product and the output product: 8C + FH) is kept in 2 bytes instead of 4, while the one
// working set shared by every block grows by a double block's kept tensors in fp32; the block
// inputs save as the test above. Statistics stay fp32; the MLP's activation is made again. FLUX.1-dev
// and FLUX.2-dev at 1024 x 1024 (4096 image tokens), to the arrays' 256-byte alignment.
TEST(Flux, SixteenBitActivationsHalveWhatTheBackwardReads) {
  for (const ModelConfig& c : {flux1_dev_config(), flux2_dev_config()}) {
    SCOPED_TRACE(c.arch);
    const ParamTable table(c);
    const int Bt = 1, T = 4096;
    const double C = c.n_embd, F = flux_mlp_width(c), FH = is_flux2(c) ? 2 * F : F, D = c.n_layer,
                 J = c.n_single_layer, L = c.context_len, S = T + L;
    const double double_kept = Bt * S * (11 * C + FH), single_kept = Bt * S * (8 * C + FH);
    const double working_set_growth = 4 * double_kept;
    // k block inputs of n elements: k fp32 arrays become two and 16-bit copies of all but the last
    auto input_saving = [](double k, double n) { return k * n * 4 - (std::min(k, 2.0) * n * 4 + (k - 1) * n * 2); };
    const double inputs = input_saving(D + 1, Bt * T * C) + input_saving(D + 1, Bt * L * C) +
                          input_saving(J + 1, Bt * S * C);
    const double kept_saving = 2 * (D * double_kept + J * single_kept);
    const double expected = kept_saving - working_set_growth + inputs;
    const double fp32 = static_cast<double>(plan_activation_bytes(table, Bt, T, false, sizeof(float), DTYPE_FP32));
    const double bf16 = static_cast<double>(plan_activation_bytes(table, Bt, T, false, sizeof(float), DTYPE_BF16));
    std::printf("[ %s ] activations fp32 %.2f GiB, bf16 %.2f GiB\n", c.arch.c_str(), fp32 / (1 << 30), bf16 / (1 << 30));
    EXPECT_NEAR(fp32 - bf16, expected, 2e-5 * fp32);  // the alignment: 256 bytes per array at most
  }
}

// Adapters on every kind of linear layer -- the streams' q/k/v and outputs, the MLPs, the
// modulations, the single blocks' proj_mlp and proj_out -- against central differences of the
// adapters' parameters (the base frozen), for the low-rank, Hadamard, Kronecker and rotation
// methods. (DoRA's gradient detaches its weight norm, as PEFT's does, so plain differences do not
// apply; its arithmetic is the shared adapter layer's, checked on the decoders in test_lora.cpp.)
TEST(Flux, AdapterGradientsMatchCentralFiniteDifferences) {
  const ModelConfig config = tiny_flux_config();
  for (AdapterType type : {ADAPTER_LORA, ADAPTER_LOHA, ADAPTER_LOKR, ADAPTER_OFT}) {
    AdapterConfig a;
    a.type = type, a.rank = 2, a.alpha = 3, a.block_size = 4;
    a.targets = {"attn.to_q", "add_k_proj", "to_add_out", "ff.net.2", "ff_context.net.0.proj", "norm1.linear",
                 "norm.linear", "proj_mlp", "single_transformer_blocks.1.proj_out"};
    const ParamTable table(config, {}, a);
    size_t adapted = 0;
    for (const ParamInfo& p : table.params()) adapted += p.adapter;
    ASSERT_GT(adapted, 0u);
    check_adapter_gradients(table, 23, 7);
  }
}

// FLUX.2's adapter sites -- all 14 of diffusers' module names: the streams' q/k/v and outputs, the
// SwiGLU MLPs' linear_in and linear_out, the single blocks' fused to_qkv_mlp_proj and to_out --
// against central differences, for the low-rank, Hadamard, Kronecker and rotation methods.
TEST(Flux, Flux2AdapterGradientsMatchCentralFiniteDifferences) {
  const ModelConfig config = tiny_flux2_config();
  for (AdapterType type : {ADAPTER_LORA, ADAPTER_LOHA, ADAPTER_LOKR, ADAPTER_OFT}) {
    AdapterConfig a;
    a.type = type, a.rank = 2, a.alpha = 3, a.block_size = 4;
    a.targets = {"attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                 "attn.add_v_proj", "attn.to_add_out", "ff.linear_in", "ff.linear_out", "ff_context.linear_in",
                 "ff_context.linear_out", "attn.to_qkv_mlp_proj", "attn.to_out"};
    const ParamTable table(config, {}, a);
    std::set<std::string> adapted;  // the adapted modules: the names before the method's suffix
    for (const ParamInfo& p : table.params())
      for (const char* suffix : {".lora_", ".hada_", ".lokr_", ".oft_"})
        if (p.adapter && p.name.find(suffix) != std::string::npos) adapted.insert(p.name.substr(0, p.name.find(suffix)));
    EXPECT_EQ(adapted.size(), 2u * 12 + 2 * 2) << adapter_type_name(type) << ": every layer of both kinds of block";
    check_adapter_gradients(table, 29, 9);
  }
}

// The family has neither key/value-cache decoding nor a vocabulary head.
TEST(Flux, GenerateAndDistillationRefuseIt) {
  EXPECT_THROW(require_capability(tiny_flux_config(), "generate", "checkpoint 'x'"), UsageError);
  EXPECT_THROW(require_capability(tiny_flux_config(), "distillation", "distill.teacher"), UsageError);
}

// The sampler's noise levels against diffusers' FlowMatchEulerDiscreteScheduler (0.42.1), given the
// shift its pipelines compute: FluxPipeline's calculate_shift (linear mu) and Flux2Pipeline's
// compute_empirical_mu, with use_dynamic_shifting and the exponential time shift. Printed by
// scheduler.set_timesteps(N, sigmas=np.linspace(1, 1/N, N), mu=mu); scheduler.sigmas (fp32).
TEST(FluxSampling, SigmasAreTheDiffusersPipelines) {
  struct Case {
    bool flux2;
    int tokens, steps;
    std::vector<double> sigmas;
  };
  const Case cases[] = {
      {true, 6, 3, {1.0, 0.93370837, 0.77882057, 0.0}},
      {true, 5000, 4, {1.0, 0.91695148, 0.7863422, 0.55092388, 0.0}},  // past 4300 tokens: the 200-step line
      {true, 4096, 50, {}},
      {false, 1024, 4, {1.0, 0.84923482, 0.65248942, 0.38494474, 0.0}},
  };
  ModelConfig flux2 = tiny_flux_config(), flux1 = tiny_flux_config();
  flux2.arch = "flux2";
  for (const Case& c : cases) {
    const std::vector<double> got = flow_sigmas(c.steps, auto_sampling_shift(c.flux2 ? flux2 : flux1, c.tokens, c.steps));
    ASSERT_EQ(got.size(), static_cast<size_t>(c.steps + 1));
    for (size_t i = 0; i < c.sigmas.size(); i++) EXPECT_NEAR(got[i], c.sigmas[i], 1e-7) << c.tokens << " tokens, " << i;
  }
  // 4096 tokens in 50 steps: the pipeline's mu of 2.02335, its 49th level 0.13371895.
  EXPECT_NEAR(std::log(flux2_empirical_shift(4096, 50)), 2.0233511571292637, 1e-12);
  EXPECT_NEAR(flow_sigmas(50, flux2_empirical_shift(4096, 50))[49], 0.13371895, 1e-7);
  // FLUX.1's shift does not depend on the steps; FLUX.2's does below 4300 tokens.
  EXPECT_EQ(auto_sampling_shift(flux1, 1024, 4), auto_sampling_shift(flux1, 1024, 28));
  EXPECT_NE(auto_sampling_shift(flux2, 1024, 4), auto_sampling_shift(flux2, 1024, 28));
}
