// LoRA (model/lora.hpp) against independent oracles, in double:
// - the layer's products against naive loops, for a slice of a fused product (Llama's q and v
//   columns of q|k|v);
// - the whole model with adapters against the base model with merged weights W + s B A (PEFT's
//   merge), which must give the same loss;
// - every adapter tensor's gradient against central finite differences, the base's untouched;
// - the parameter table: names, shapes, the base frozen, the refusals.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "backend/layer_ops.hpp"
#include "core/error.hpp"
#include "core/random.hpp"
#include "model/lora.hpp"
#include "model/model.hpp"
#include "support/model_fixtures.hpp"

using namespace shardtrain;
using namespace shardtrain::testing;

namespace {

// Every parameter random, B too, so that every path carries signal.
std::vector<std::vector<double>> adapter_units(const ParamTable& table) { return random_units<double>(table, 0.3, 17); }

AdapterConfig lora(std::vector<std::string> targets, int rank = 3, double alpha = 5) {
  AdapterConfig a;
  a.type = ADAPTER_LORA, a.targets = std::move(targets), a.rank = rank, a.alpha = alpha;
  return a;
}

// The loss (and gradients) of one micro-batch; `keys`: the rows' dropout keys (null: no dropout).
double loss_and_grads(const ParamTable& table, std::vector<std::vector<double>>& units,
                      std::vector<std::vector<double>>* grads, const Batch& batch, int B, int T,
                      const uint64_t* keys = nullptr) {
  auto model = make_model<double>(table, B, T, false, cpu_layer_ops<double>());
  model->set_dropout_keys(keys);
  std::vector<const double*> u;
  std::vector<double*> g;
  std::vector<std::vector<double>> scratch;
  std::vector<std::vector<double>>& out = grads ? *grads : scratch;
  out.clear();
  for (auto& unit : units) out.emplace_back(unit.size(), 0.0), u.push_back(unit.data()), g.push_back(out.back().data());
  return forward_backward_unsharded(*model, table, u, g, batch, 1.0 / (B * T));
}

}  // namespace

TEST(Lora, TableAddsAdaptersAfterEachBlockAndFreezesTheBase) {
  const ParamTable table(tiny_llama_config(), {}, lora({"self_attn.q_proj", "layers.1.mlp.down_proj"}));
  const ParamTable base(tiny_llama_config());
  std::vector<std::string> adapters;
  for (const ParamInfo& p : table.params()) {
    EXPECT_EQ(p.frozen, !p.adapter) << p.name;
    if (p.adapter) adapters.push_back(p.name);
  }
  EXPECT_EQ(adapters, (std::vector<std::string>{
                          "layers.0.self_attn.q_proj.lora_A.weight", "layers.0.self_attn.q_proj.lora_B.weight",
                          "layers.1.self_attn.q_proj.lora_A.weight", "layers.1.self_attn.q_proj.lora_B.weight",
                          "layers.1.mlp.down_proj.lora_A.weight", "layers.1.mlp.down_proj.lora_B.weight"}));
  const int down = table.adapter_param(1, 6);
  ASSERT_GE(down, 0);
  EXPECT_EQ(table.param(block_unit(1), down).shape, (std::vector<int>{3, 20}));      // A: (r, in)
  EXPECT_EQ(table.param(block_unit(1), down + 1).shape, (std::vector<int>{16, 3}));  // B: (out, r)
  EXPECT_EQ(table.adapter_param(0, 6), -1);
  // The base keeps its ids, names and declaration order; the adapters come after it.
  for (size_t id = 0; id < base.params().size(); id++) {
    EXPECT_EQ(table.params()[id].name, base.params()[id].name);
    EXPECT_EQ(table.params()[id].file_offset, base.params()[id].offset);
  }
  EXPECT_EQ(table.trainable_params(), 2 * (3 * 16 + 16 * 3) + (3 * 20 + 16 * 3));
}

TEST(Lora, RefusesTargetsThatMatchNothingAndRanksAboveTheLayer) {
  auto error = [](const ModelConfig& c, const AdapterConfig& a) -> std::string {
    try {
      ParamTable table(c, {}, a);
    } catch (const UsageError& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(error(tiny_gpt2_config(), lora({"attn.c_attn", "c_atn"})).find("'c_atn' matches no linear layer"),
            std::string::npos);
  EXPECT_NE(error(tiny_gpt2_config(), lora({"q_proj"})).find("matches no linear layer"), std::string::npos);
  EXPECT_NE(error(tiny_gpt2_config(), lora({})).find("adapts nothing"), std::string::npos);
  EXPECT_NE(error(tiny_llama_config(), lora({"self_attn.k_proj"}, 9)).find("adapter.rank=9 is larger than"),
            std::string::npos);  // k_proj has 8 outputs
  // GPT-2's c_proj names two layers: a full path picks one, the bare name both (PEFT's rule).
  const ParamTable one(tiny_gpt2_config(), {}, lora({"mlp.c_proj"})), both(tiny_gpt2_config(), {}, lora({"c_proj"}));
  const size_t attn_c_proj = 2 * (3 * 12 + 12 * 3);  // two blocks of A (3, 12) and B (12, 3)
  EXPECT_EQ(both.trainable_params(), one.trainable_params() + attn_c_proj);
  EXPECT_LT(one.trainable_params(), both.trainable_params());
  EXPECT_EQ(one.adapter_param(0, 1), -1);  // attn.c_proj is not adapted
  EXPECT_GE(both.adapter_param(0, 1), 0);
}

// The products of one adapted layer against naive loops: u = x A^T, y[:, slice] += s u B^T, and
// the backward's dB, dA and dx (accumulated onto what is there).
TEST(Lora, LayerMatchesNaiveLoopsOnASliceOfAFusedProduct) {
  const ModelConfig c = tiny_llama_config();
  const ParamTable table(c, {}, lora({"self_attn.v_proj"}, 3, 5));
  const std::vector<LinearSite> sites = table.block_sites(0);
  const LinearSite& v = sites[2];
  ASSERT_EQ(std::string(v.module), "self_attn.v_proj");
  const int n = 7, r = 3, unit = block_unit(1);
  const double s = 5.0 / 3;
  std::vector<std::vector<double>> units = adapter_units(table);
  const double* w = units[unit].data();
  const int a = table.adapter_param(1, 2);
  const double* A = w + table.offset(unit, a);
  const double* Bm = w + table.offset(unit, a + 1);
  std::vector<double> x(n * v.in), y(n * v.width), dy(n * v.width), dx(n * v.in);
  for (size_t i = 0; i < x.size(); i++) x[i] = counter_normal(1, i);
  for (size_t i = 0; i < y.size(); i++) y[i] = counter_normal(2, i), dy[i] = counter_normal(3, i);
  for (size_t i = 0; i < dx.size(); i++) dx[i] = counter_normal(4, i);
  const std::vector<double> y0 = y, dx0 = dx;
  std::vector<double> grads(units[unit].size(), 0.0);
  LoraLayers<double> layers(table, n, cpu_layer_ops<double>(), n);
  layers.forward(1, PRODUCT_QKV, x.data(), y.data(), n, w);
  layers.backward(1, PRODUCT_QKV, x.data(), dy.data(), dx.data(), n, w, grads.data());
  const double* dA = grads.data() + table.offset(unit, a);
  const double* dB = grads.data() + table.offset(unit, a + 1);
  std::vector<double> u(n * r, 0.0), du(n * r, 0.0);
  for (int i = 0; i < n; i++)
    for (int k = 0; k < r; k++) {
      for (int j = 0; j < v.in; j++) u[i * r + k] += x[i * v.in + j] * A[k * v.in + j];
      for (int o = 0; o < v.out; o++) du[i * r + k] += s * dy[i * v.width + v.column + o] * Bm[o * r + k];
    }
  for (int i = 0; i < n; i++)
    for (int col = 0; col < v.width; col++) {
      double expected = y0[i * v.width + col];
      if (col >= v.column && col < v.column + v.out)
        for (int k = 0; k < r; k++) expected += s * u[i * r + k] * Bm[(col - v.column) * r + k];
      EXPECT_NEAR(y[i * v.width + col], expected, 1e-12) << i << "," << col;
    }
  for (int o = 0; o < v.out; o++)
    for (int k = 0; k < r; k++) {
      double expected = 0;
      for (int i = 0; i < n; i++) expected += s * dy[i * v.width + v.column + o] * u[i * r + k];
      EXPECT_NEAR(dB[o * r + k], expected, 1e-12);
    }
  for (int k = 0; k < r; k++)
    for (int j = 0; j < v.in; j++) {
      double expected = 0;
      for (int i = 0; i < n; i++) expected += du[i * r + k] * x[i * v.in + j];
      EXPECT_NEAR(dA[k * v.in + j], expected, 1e-12);
    }
  for (int i = 0; i < n; i++)
    for (int j = 0; j < v.in; j++) {
      double expected = dx0[i * v.in + j];
      for (int k = 0; k < r; k++) expected += du[i * r + k] * A[k * v.in + j];
      EXPECT_NEAR(dx[i * v.in + j], expected, 1e-12);
    }
}

// PEFT's merge: the adapted model is the base model with W <- W + s B A.
TEST(Lora, ModelEqualsTheBaseWithMergedWeights) {
  const std::vector<std::pair<ModelConfig, std::vector<std::string>>> cases = {
      {tiny_gpt2_config(), {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"}},
      {tiny_llama_config(), {"self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.up_proj", "down_proj"}},
      {tiny_qwen2_config(), {"self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj"}},
      {tiny_qwen3_config(), {"self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj"}},  // before the q/k norms
  };
  const int B = 2, T = 5;
  for (const auto& [config, targets] : cases) {
    const ParamTable table(config, {}, lora(targets)), base(config);
    std::vector<std::vector<double>> units = adapter_units(table), merged;
    for (const UnitInfo& u : base.units()) merged.emplace_back(u.numel);
    for (size_t id = 0; id < base.params().size(); id++) {
      const ParamInfo &p = table.params()[id], &q = base.params()[id];
      std::copy_n(units[p.unit].data() + p.offset, p.numel, merged[q.unit].data() + q.offset);
    }
    const double s = table.adapter().scaling();
    const std::vector<LinearSite> sites = table.block_sites(0);
    for (int l = 0; l < config.n_layer; l++)
      for (size_t k = 0; k < sites.size(); k++) {
        const int a = table.adapter_param(l, static_cast<int>(k));
        if (a < 0) continue;
        const int u = block_unit(l), r = table.adapter().rank, in = sites[k].in;
        const double* A = units[u].data() + table.offset(u, a);
        const double* Bm = units[u].data() + table.offset(u, a + 1);
        double* W = merged[u].data() + base.offset(u, sites[k].weight);
        for (int o = 0; o < sites[k].out; o++)
          for (int j = 0; j < in; j++)
            for (int m = 0; m < r; m++) W[o * in + j] += s * Bm[o * r + m] * A[m * in + j];
      }
    const Batch batch = make_batch(B, T, config.vocab_size);
    const double adapted = loss_and_grads(table, units, nullptr, batch, B, T);
    const double reference = loss_and_grads(base, merged, nullptr, batch, B, T);
    EXPECT_NEAR(adapted, reference, 1e-11 * std::fabs(reference)) << config.arch;
    // And the adapters matter: the base's own weights give another loss.
    std::vector<std::vector<double>> unmerged;
    for (const UnitInfo& u : base.units()) unmerged.emplace_back(u.numel);
    for (size_t id = 0; id < base.params().size(); id++) {
      const ParamInfo &p = table.params()[id], &q = base.params()[id];
      std::copy_n(units[p.unit].data() + p.offset, p.numel, unmerged[q.unit].data() + q.offset);
    }
    EXPECT_GT(std::fabs(adapted - loss_and_grads(base, unmerged, nullptr, batch, B, T)), 1e-3);
  }
}

// Central differences (h = 1e-5, double): truncation ~1e-10, rounding ~1e-11.
TEST(Lora, AdapterGradientsMatchFiniteDifferencesAndTheBaseGetsNone) {
  const std::vector<std::pair<ModelConfig, std::vector<std::string>>> cases = {
      {tiny_gpt2_config(), {"attn.c_attn", "mlp.c_proj"}},
      {tiny_llama_config(), {"self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "o_proj"}},
  };
  const int B = 2, T = 5;
  for (const auto& [config, targets] : cases) {
    const ParamTable table(config, {}, lora(targets, 2, 3));
    std::vector<std::vector<double>> units = adapter_units(table), grads;
    const Batch batch = make_batch(B, T, config.vocab_size);
    loss_and_grads(table, units, &grads, batch, B, T);
    for (const ParamInfo& p : table.params()) {
      if (!p.adapter) {
        for (size_t i = 0; i < p.numel; i++) ASSERT_EQ(grads[p.unit][p.offset + i], 0.0) << p.name;
        continue;
      }
      for (size_t i : {size_t(0), p.numel / 2, p.numel - 1}) {
        // The summed loss; the gradients are of its mean.
        const double numeric = central_difference(units[p.unit][p.offset + i], [&] {
                                 return loss_and_grads(table, units, nullptr, batch, B, T);
                               }) / (B * T);
        const double analytic = grads[p.unit][p.offset + i];
        EXPECT_NEAR(analytic, numeric, 1e-8 + 1e-6 * std::fabs(numeric)) << p.name << "[" << i << "]";
      }
    }
  }
}

// Dropout on the adapter's input (adapter.dropout): the layer equals the naive loops run on the
// input masked by the documented stream -- element (r, c) of adapted layer k of block l kept iff
// counter_keep(dropout_row_key(key_r, 1 + l * sites + k), c, dropout_threshold24(p)), kept ones
// divided by 1 - p -- and its gradients match finite differences (the mask is a pure function of
// the keys, so the loss is differentiable in the parameters). Without keys: no dropout.
TEST(Lora, DropoutFollowsTheCounterStreamAndKeepsGradientsExact) {
  const ModelConfig c = tiny_gpt2_config();
  AdapterConfig a = lora({"attn.c_attn", "mlp.c_proj"}, 2, 3);
  a.dropout = 0.3;
  const ParamTable table(c, {}, a);
  const int B = 2, T = 5, n = B * T;
  std::vector<uint64_t> keys(n);
  for (int r = 0; r < n; r++) keys[r] = dropout_token_key(42, 7, r / T, r % T);
  std::vector<std::vector<double>> units = adapter_units(table);
  // The layer: c_attn of block 1 (site 0), against loops over the masked input.
  const std::vector<LinearSite> sites = table.block_sites(0);
  const LinearSite& site = sites[0];
  const int unit = block_unit(1), ap = table.adapter_param(1, 0), r = 2;
  const double s = 1.5, p = 0.3;
  const double* A = units[unit].data() + table.offset(unit, ap);
  const double* Bm = units[unit].data() + table.offset(unit, ap + 1);
  std::vector<double> x(n * site.in), y(n * site.width, 0.0), xd(x.size());
  for (size_t i = 0; i < x.size(); i++) x[i] = counter_normal(9, i);
  size_t dropped = 0;
  for (int row = 0; row < n; row++)
    for (int col = 0; col < site.in; col++) {
      const bool keep = counter_keep(dropout_row_key(keys[row], 1 + 1 * sites.size() + 0), col, dropout_threshold24(p));
      // p reaches the layer as a float (LayerOps::dropout), 0.3f.
      xd[row * site.in + col] = keep ? x[row * site.in + col] / (1 - static_cast<double>(static_cast<float>(p))) : 0.0;
      dropped += !keep;
    }
  EXPECT_GT(dropped, x.size() / 5);
  EXPECT_LT(dropped, x.size() * 2 / 5);
  LoraLayers<double> layers(table, n, cpu_layer_ops<double>(), n);
  layers.set_row_keys(keys.data());
  layers.forward(1, PRODUCT_QKV, x.data(), y.data(), n, units[unit].data());
  for (int row = 0; row < n; row++)
    for (int o = 0; o < site.out; o++) {
      double expected = 0;
      for (int k = 0; k < r; k++) {
        double u = 0;
        for (int j = 0; j < site.in; j++) u += xd[row * site.in + j] * A[k * site.in + j];
        expected += s * u * Bm[o * r + k];
      }
      ASSERT_NEAR(y[row * site.width + o], expected, 1e-12);
    }
  // The whole model: finite differences of the adapters with dropout on; and the loss differs
  // from the loss without it.
  auto loss_with_keys = [&](std::vector<std::vector<double>>& v, std::vector<std::vector<double>>* g,
                            const uint64_t* k) {
    auto model = make_model<double>(table, B, T, false, cpu_layer_ops<double>());
    model->set_dropout_keys(k);
    std::vector<const double*> vp;
    std::vector<double*> gp;
    std::vector<std::vector<double>> scratch, &out = g ? *g : scratch;
    out.clear();
    for (auto& unit_values : v) out.emplace_back(unit_values.size(), 0.0), vp.push_back(unit_values.data()),
        gp.push_back(out.back().data());
    const Batch batch = make_batch(B, T, c.vocab_size);
    return forward_backward_unsharded(*model, table, vp, gp, batch, 1.0 / n);
  };
  std::vector<std::vector<double>> grads;
  const double with = loss_with_keys(units, &grads, keys.data());
  EXPECT_GT(std::fabs(with - loss_with_keys(units, nullptr, nullptr)), 1e-6);
  for (const ParamInfo& q : table.params()) {
    if (!q.adapter) continue;
    for (size_t i : {size_t(0), q.numel - 1}) {
      const double numeric =
          central_difference(units[q.unit][q.offset + i], [&] { return loss_with_keys(units, nullptr, keys.data()); }) / n;
      const double analytic = grads[q.unit][q.offset + i];
      EXPECT_NEAR(analytic, numeric, 1e-8 + 1e-6 * std::fabs(numeric)) << q.name << "[" << i << "]";
    }
  }
}

namespace {

// DoRA's merge (PEFT): W <- (m / ||W + s B A||_row) (W + s B A), on the base table's weights; the
// biases stay. `units` in the adapted table's layout; returns the base table's units.
std::vector<std::vector<double>> dora_merged(const ParamTable& table, const ParamTable& base,
                                             const std::vector<std::vector<double>>& units) {
  std::vector<std::vector<double>> merged;
  for (const UnitInfo& u : base.units()) merged.emplace_back(u.numel);
  for (size_t id = 0; id < base.params().size(); id++) {
    const ParamInfo &p = table.params()[id], &q = base.params()[id];
    std::copy_n(units[p.unit].data() + p.offset, p.numel, merged[q.unit].data() + q.offset);
  }
  const double s = table.adapter().scaling();
  const int r = table.adapter().rank;
  const std::vector<LinearSite> sites = table.block_sites(0);
  for (int l = 0; l < table.config().n_layer; l++)
    for (size_t k = 0; k < sites.size(); k++) {
      const int a = table.adapter_param(l, static_cast<int>(k));
      if (a < 0) continue;
      const int u = block_unit(l), in = sites[k].in;
      const double* A = units[u].data() + table.offset(u, a);
      const double* Bm = units[u].data() + table.offset(u, a + 1);
      const double* m = units[u].data() + table.offset(u, a + 2);
      double* W = merged[u].data() + base.offset(u, sites[k].weight);
      for (int o = 0; o < sites[k].out; o++) {
        double norm = 0;
        for (int j = 0; j < in; j++) {
          for (int q = 0; q < r; q++) W[o * in + j] += s * Bm[o * r + q] * A[q * in + j];
          norm += W[o * in + j] * W[o * in + j];
        }
        for (int j = 0; j < in; j++) W[o * in + j] *= m[o] / std::sqrt(norm);
      }
    }
  return merged;
}

AdapterConfig dora(std::vector<std::string> targets) {
  AdapterConfig a = lora(std::move(targets), 2, 3);
  a.type = ADAPTER_DORA;
  return a;
}

}  // namespace

TEST(Dora, ModelEqualsTheBaseWithPeftsMergedWeights) {
  const std::vector<std::pair<ModelConfig, std::vector<std::string>>> cases = {
      {tiny_gpt2_config(), {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"}},  // biases: not rescaled
      {tiny_llama_config(), {"self_attn.q_proj", "self_attn.v_proj", "o_proj", "gate_proj", "mlp.down_proj"}},
      {tiny_qwen2_config(), {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}},  // biases: not rescaled
  };
  const int B = 2, T = 5;
  for (const auto& [config, targets] : cases) {
    const ParamTable table(config, {}, dora(targets)), base(config);
    std::vector<std::vector<double>> units = adapter_units(table);
    const Batch batch = make_batch(B, T, config.vocab_size);
    std::vector<std::vector<double>> merged = dora_merged(table, base, units);
    const double adapted = loss_and_grads(table, units, nullptr, batch, B, T);
    EXPECT_NEAR(adapted, loss_and_grads(base, merged, nullptr, batch, B, T), 1e-11 * std::fabs(adapted))
        << config.arch;
  }
}

// Finite differences of the detached-norm formulation: moving A or B moves ||W + s B A|| too, which
// DoRA's gradient ignores, so the numeric side keeps every gain m / n fixed by moving m with n.
// Without dropout and with it (PEFT's other formula; the mask is a pure function of the row keys,
// so the loss stays differentiable in the parameters).
namespace {

void check_dora_gradients(double dropout) {
  const std::vector<std::pair<ModelConfig, std::vector<std::string>>> cases = {
      {tiny_gpt2_config(), {"attn.c_attn", "mlp.c_proj"}},
      {tiny_llama_config(), {"self_attn.k_proj", "self_attn.v_proj", "mlp.up_proj"}},
      {tiny_qwen2_config(), {"self_attn.q_proj", "self_attn.v_proj"}},
  };
  const int B = 2, T = 5;
  for (const auto& [config, targets] : cases) {
    AdapterConfig a = dora(targets);
    a.dropout = dropout;
    const ParamTable table(config, {}, a), base(config);
    std::vector<std::vector<double>> units = adapter_units(table), grads;
    const Batch batch = make_batch(B, T, config.vocab_size);
    std::vector<uint64_t> row_keys(B * T);
    for (int i = 0; i < B * T; i++) row_keys[i] = dropout_token_key(42, 7, i / T, i % T);
    const uint64_t* keys = dropout > 0 ? row_keys.data() : nullptr;
    const double loss = loss_and_grads(table, units, &grads, batch, B, T, keys);
    if (keys) {
      EXPECT_GT(std::fabs(loss - loss_and_grads(table, units, nullptr, batch, B, T)), 1e-6) << config.arch;
    }
    const std::vector<LinearSite> sites = table.block_sites(0);
    // The row norms n = ||W + s B A|| of every adapted weight, in adapter order.
    auto norms = [&](const std::vector<std::vector<double>>& v) {
      std::vector<std::vector<double>> out;
      for (int l = 0; l < config.n_layer; l++)
        for (size_t k = 0; k < sites.size(); k++) {
          const int a = table.adapter_param(l, static_cast<int>(k));
          if (a < 0) continue;
          const int u = block_unit(l), in = sites[k].in;
          std::vector<double> n(sites[k].out);
          for (int o = 0; o < sites[k].out; o++) {
            double sq = 0;
            for (int j = 0; j < in; j++) {
              double w = v[u][table.offset(u, sites[k].weight) + o * in + j];
              for (int q = 0; q < table.adapter().rank; q++)
                w += table.adapter().scaling() * v[u][table.offset(u, a + 1) + o * table.adapter().rank + q] *
                     v[u][table.offset(u, a) + q * in + j];
              sq += w * w;
            }
            n[o] = std::sqrt(sq);
          }
          out.push_back(n);
        }
      return out;
    };
    // The loss with every gain m / n held at its value for the unperturbed parameters.
    const std::vector<std::vector<double>> n0 = norms(units);
    auto detached_loss = [&](std::vector<std::vector<double>> v) {
      const std::vector<std::vector<double>> n1 = norms(v);
      size_t i = 0;
      for (int l = 0; l < config.n_layer; l++)
        for (size_t k = 0; k < sites.size(); k++) {
          const int a = table.adapter_param(l, static_cast<int>(k));
          if (a < 0) continue;
          double* m = v[block_unit(l)].data() + table.offset(block_unit(l), a + 2);
          for (size_t o = 0; o < n1[i].size(); o++) m[o] *= n1[i][o] / n0[i][o];
          i++;
        }
      return loss_and_grads(table, v, nullptr, batch, B, T, keys);
    };
    for (const ParamInfo& p : table.params()) {
      if (!p.adapter) continue;
      for (size_t i : {size_t(0), p.numel - 1}) {
        const double h = 1e-5;
        std::vector<std::vector<double>> up = units, down = units;
        up[p.unit][p.offset + i] += h, down[p.unit][p.offset + i] -= h;
        // The magnitude's own perturbation is not compensated: only A and B move the norm.
        const double numeric =
            (p.shape.size() == 1 ? loss_and_grads(table, up, nullptr, batch, B, T, keys) -
                                       loss_and_grads(table, down, nullptr, batch, B, T, keys)
                                 : detached_loss(up) - detached_loss(down)) /
            (2 * h) / (B * T);
        EXPECT_NEAR(grads[p.unit][p.offset + i], numeric, 1e-8 + 1e-6 * std::fabs(numeric))
            << p.name << "[" << i << "] dropout " << dropout;
      }
    }
  }
}

}  // namespace

TEST(Dora, GradientsMatchFiniteDifferencesWithTheNormDetached) {
  for (double dropout : {0.0, 0.3}) check_dora_gradients(dropout);
}

// DoRA with dropout is PEFT's DoraLinearLayer given a dropout module: the base layer keeps x W^T + b
// and the adapter adds (g - 1) (x) x~ W^T + g (x) s x~ A^T B^T, x~ the dropped-out input and
// g = m / ||W + s B A|| (detached). The layer's output, the base layer's output gradient (dy
// itself), m's, A's and B's gradients and the input gradient (through x~'s mask) against naive
// loops of that formula, on Qwen2's q and v columns of q|k|v (biases, two slices).
TEST(Dora, DropoutIsPeftsFormulaOnTheDroppedInput) {
  AdapterConfig a = dora({"self_attn.q_proj", "self_attn.v_proj"});
  a.dropout = 0.3;
  const ParamTable table(tiny_qwen2_config(), {}, a);
  const int B = 2, T = 5, n = B * T, layer = 1, unit = block_unit(layer), r = a.rank;
  const double s = table.adapter().scaling();
  const double kept = 1 - static_cast<double>(static_cast<float>(a.dropout));  // p reaches the op as a float
  std::vector<uint64_t> keys(n);
  for (int i = 0; i < n; i++) keys[i] = dropout_token_key(42, 7, i / T, i % T);
  std::vector<std::vector<double>> units = adapter_units(table);
  const double* w = units[unit].data();
  const std::vector<LinearSite> sites = table.block_sites(layer);
  const int in = sites[0].in, width = sites[0].width;  // q|k|v's input and width
  std::vector<double> x(n * in), y(n * width), dy(n * width), dx(n * in);
  for (size_t i = 0; i < x.size(); i++) x[i] = counter_normal(1, i), dx[i] = counter_normal(4, i);
  for (size_t i = 0; i < y.size(); i++) y[i] = counter_normal(2, i), dy[i] = counter_normal(3, i);
  std::vector<double> expected_y = y, expected_dx = dx, grads(units[unit].size(), 0.0);
  LoraLayers<double> layers(table, n, cpu_layer_ops<double>(), n);
  layers.set_row_keys(keys.data());
  layers.forward(layer, PRODUCT_QKV, x.data(), y.data(), n, w);
  const double* base_dy = layers.output_grad(layer, PRODUCT_QKV, x.data(), dy.data(), n, w, grads.data());
  EXPECT_EQ(base_dy, dy.data()) << "the base layer's output gradient is dy itself";
  layers.backward(layer, PRODUCT_QKV, x.data(), base_dy, dx.data(), n, w, grads.data());
  int adapted = 0;
  for (size_t k = 0; k < sites.size(); k++) {
    const int ap = table.adapter_param(layer, static_cast<int>(k));
    if (ap < 0 || sites[k].product != PRODUCT_QKV) continue;
    adapted++;
    const LinearSite& site = sites[k];
    const int out = site.out;
    const double* W = w + table.offset(unit, site.weight);
    const double* A = w + table.offset(unit, ap);
    const double* Bm = w + table.offset(unit, ap + 1);
    const double* m = w + table.offset(unit, ap + 2);
    std::vector<double> scale(n * in), xd(n * in), norm(out), g(out), u(n * r, 0.0), gdy(n * out), du(n * r, 0.0);
    size_t dropped = 0;
    for (int i = 0; i < n; i++)
      for (int j = 0; j < in; j++) {
        const bool keep = counter_keep(dropout_row_key(keys[i], 1 + layer * sites.size() + k), j,
                                       dropout_threshold24(static_cast<float>(a.dropout)));
        scale[i * in + j] = keep ? 1 / kept : 0.0, dropped += !keep;
        xd[i * in + j] = keep ? x[i * in + j] / kept : 0.0;
      }
    EXPECT_GT(dropped, xd.size() / 6);
    for (int o = 0; o < out; o++) {
      double sq = 0;
      for (int j = 0; j < in; j++) {
        double v = W[o * in + j];
        for (int q = 0; q < r; q++) v += s * Bm[o * r + q] * A[q * in + j];
        sq += v * v;
      }
      norm[o] = std::sqrt(sq), g[o] = m[o] / norm[o];
    }
    for (int i = 0; i < n; i++)
      for (int q = 0; q < r; q++)
        for (int j = 0; j < in; j++) u[i * r + q] += xd[i * in + j] * A[q * in + j];
    std::vector<double> dm(out, 0.0), dA(r * in, 0.0), dB(out * r, 0.0);
    for (int i = 0; i < n; i++)
      for (int o = 0; o < out; o++) {
        double xw = 0, lora = 0;
        for (int j = 0; j < in; j++) xw += xd[i * in + j] * W[o * in + j];
        for (int q = 0; q < r; q++) lora += s * u[i * r + q] * Bm[o * r + q];
        expected_y[i * width + site.column + o] += (g[o] - 1) * xw + g[o] * lora;
        const double d = dy[i * width + site.column + o];
        dm[o] += d * (xw + lora) / norm[o];
        gdy[i * out + o] = g[o] * d;
      }
    for (int o = 0; o < out; o++)
      for (int q = 0; q < r; q++)
        for (int i = 0; i < n; i++) dB[o * r + q] += s * gdy[i * out + o] * u[i * r + q];
    for (int i = 0; i < n; i++)
      for (int q = 0; q < r; q++)
        for (int o = 0; o < out; o++) du[i * r + q] += s * gdy[i * out + o] * Bm[o * r + q];
    for (int q = 0; q < r; q++)
      for (int j = 0; j < in; j++)
        for (int i = 0; i < n; i++) dA[q * in + j] += du[i * r + q] * xd[i * in + j];
    for (int i = 0; i < n; i++)
      for (int j = 0; j < in; j++) {
        double dxd = 0;  // the gradient of x~: (g - 1) (x) dy through W, plus du through A
        for (int o = 0; o < out; o++) dxd += (g[o] - 1) * dy[i * width + site.column + o] * W[o * in + j];
        for (int q = 0; q < r; q++) dxd += du[i * r + q] * A[q * in + j];
        expected_dx[i * in + j] += scale[i * in + j] * dxd;
      }
    const auto expect_grads = [&](int param, const std::vector<double>& expected, const char* what) {
      const double* got = grads.data() + table.offset(unit, param);
      for (size_t i = 0; i < expected.size(); i++)
        ASSERT_NEAR(got[i], expected[i], 1e-12 * (1 + std::fabs(expected[i]))) << what << "[" << i << "] site " << k;
    };
    expect_grads(ap, dA, "dA");
    expect_grads(ap + 1, dB, "dB");
    expect_grads(ap + 2, dm, "dm");
  }
  EXPECT_EQ(adapted, 2);
  for (size_t i = 0; i < y.size(); i++) ASSERT_NEAR(y[i], expected_y[i], 1e-12 * (1 + std::fabs(expected_y[i]))) << i;
  for (size_t i = 0; i < dx.size(); i++)
    ASSERT_NEAR(dx[i], expected_dx[i], 1e-12 * (1 + std::fabs(expected_dx[i]))) << i;
}

// Generation with adapters: the decode path (key/value cache, steps of a few tokens) gives the
// probabilities of a full forward at the last position, with LoRA and with DoRA.
TEST(Lora, DecodingWithAdaptersGivesTheFullForwardsProbabilities) {
  const int T = 6;
  for (AdapterType type : {ADAPTER_LORA, ADAPTER_DORA})
    for (const ModelConfig& config : {tiny_gpt2_config(), tiny_llama_config()}) {
      AdapterConfig a = lora(config.arch == "gpt2" ? std::vector<std::string>{"c_attn", "mlp.c_proj"}
                                                      : std::vector<std::string>{"q_proj", "v_proj", "up_proj"});
      a.type = type;
      const ParamTable table(config, {}, a);
      std::vector<std::vector<double>> units = adapter_units(table);
      const Batch batch = make_batch(1, T, config.vocab_size);
      auto full = make_model<double>(table, 1, T, false, cpu_layer_ops<double>());
      full->embed_forward(units[ROOT_UNIT].data(), batch);
      for (int l = 0; l < config.n_layer; l++) full->block_forward(l, units[block_unit(l)].data());
      full->host_head_forward(units[ROOT_UNIT].data(), batch);
      std::vector<double> probs(config.vocab_size), logits(config.vocab_size);
      full->token_logits()->copy_head_probs(T - 1, probs.data());
      auto step = make_model<double>(table, 1, 1, false, cpu_layer_ops<double>());
      step->kv_decoder()->begin_decode(T, 4);
      for (int start = 0; start < T; start += 4) {  // 4 tokens, then 2
        const int n = std::min(4, T - start);
        step->kv_decoder()->decode_embed(units[ROOT_UNIT].data(), batch.get<int>(BATCH_TOKENS, T) + start, n);
        for (int l = 0; l < config.n_layer; l++) step->kv_decoder()->decode_block(l, units[block_unit(l)].data());
      }
      step->kv_decoder()->decode_head(units[ROOT_UNIT].data(), logits.data());
      double max = logits[0], sum = 0;
      for (double x : logits) max = std::max(max, x);
      for (double x : logits) sum += std::exp(x - max);
      for (int v = 0; v < config.vocab_size; v++)
        EXPECT_NEAR(std::exp(logits[v] - max) / sum, probs[v], 1e-12)
            << adapter_type_name(type) << " " << config.arch << " " << v;
    }
}
