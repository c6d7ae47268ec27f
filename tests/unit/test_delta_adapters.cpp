// LoHa, LoKr and OFT (model/delta_adapters.hpp, model/oft.hpp) against independent oracles, in double:
// - the parameter table: PEFT's names and shapes, LoKr's factorization, the refusals;
// - OFT's rotations: the series as written out, the exact transform orthogonal and solving
//   R (I + Q) = I - Q, and their gradients against central finite differences;
// - the whole model with adapters against the base model with merged weights W + dW, dW built by
//   naive loops from PEFT's formulas, which must give the same loss;
// - every adapter tensor's gradient against central finite differences, the base's untouched.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "backend/layer_ops.hpp"
#include "core/error.hpp"
#include "model/delta_adapters.hpp"
#include "model/model.hpp"
#include "model/oft.hpp"
#include "support/model_fixtures.hpp"

using namespace shardtrain;
using namespace shardtrain::testing;

namespace {

using Units = std::vector<std::vector<double>>;

AdapterConfig method(AdapterType type, std::vector<std::string> targets, int rank = 2, double alpha = 3) {
  AdapterConfig a;
  a.type = type, a.targets = std::move(targets), a.rank = rank, a.alpha = alpha;
  a.block_size = 4;  // divides every layer's inputs of both tiny models (12, 16, 20, 48)
  return a;
}

double loss_of(const ParamTable& table, Units& units, Units* grads, int B, int T) {
  auto model = make_model<double>(table, B, T, false, cpu_layer_ops<double>());
  std::vector<const double*> u;
  std::vector<double*> g;
  Units scratch, &out = grads ? *grads : scratch;
  out.clear();
  for (auto& unit : units) out.emplace_back(unit.size(), 0.0), u.push_back(unit.data()), g.push_back(out.back().data());
  const Batch batch = make_batch(B, T, table.config().vocab_size);
  return forward_backward_unsharded(*model, table, u, g, batch, 1.0 / (B * T));
}

// Row-major (m, k) x (k, n).
std::vector<double> product(const double* a, const double* b, int m, int k, int n) {
  std::vector<double> c(static_cast<size_t>(m) * n, 0.0);
  for (int i = 0; i < m; i++)
    for (int j = 0; j < n; j++)
      for (int q = 0; q < k; q++) c[i * n + j] += a[i * k + q] * b[q * n + j];
  return c;
}

// PEFT's dW (out, in) of one adapted layer, by loops. p: the layer's adapter parameters in order.
std::vector<double> naive_delta(const AdapterConfig& a, const LinearSite& site, const std::vector<const double*>& p,
                                const double* W) {
  const int in = site.in, out = site.out, r = a.rank;
  const double s = a.scaling();
  std::vector<double> delta(static_cast<size_t>(out) * in, 0.0);
  if (a.type == ADAPTER_LOHA) {
    const std::vector<double> p1 = product(p[0], p[1], out, r, in), p2 = product(p[2], p[3], out, r, in);
    for (size_t e = 0; e < delta.size(); e++) delta[e] = s * p1[e] * p2[e];
  } else if (a.type == ADAPTER_LOKR) {
    const LokrShape k = lokr_shape(a, in, out);
    size_t next = 0;
    std::vector<double> w1 = k.w1_low_rank ? product(p[0], p[1], k.a, r, k.c) : std::vector<double>(p[0], p[0] + k.a * k.c);
    next = k.w1_low_rank ? 2 : 1;
    std::vector<double> w2 =
        k.w2_low_rank ? product(p[next], p[next + 1], k.b, r, k.d) : std::vector<double>(p[next], p[next] + k.b * k.d);
    for (int i = 0; i < k.a; i++)
      for (int j = 0; j < k.c; j++)
        for (int m = 0; m < k.b; m++)
          for (int n = 0; n < k.d; n++) delta[(i * k.b + m) * in + j * k.d + n] = s * w1[i * k.c + j] * w2[m * k.d + n];
  } else {  // OFT: W blockdiag(R)^T - W
    const int b = a.block_size, nv = b * (b - 1) / 2;
    std::vector<double> R(b * b);
    for (int j = 0; j < in / b; j++) {
      OftRotation{b, a.cayley_neumann, a.neumann_terms}.forward(p[0] + (a.block_share ? 0 : j) * nv, R.data());
      for (int o = 0; o < out; o++)
        for (int c = 0; c < b; c++) {
          double rotated = 0;
          for (int e = 0; e < b; e++) rotated += W[o * in + j * b + e] * R[c * b + e];
          delta[o * in + j * b + c] = rotated - W[o * in + j * b + c];
        }
    }
  }
  return delta;
}

// The base table's units (the base's values, which `units` holds in the adapted table's layout),
// every adapted weight merged, W + dW, where `merge`.
Units base_units(const ParamTable& table, const ParamTable& base, const Units& units, bool merge = true) {
  Units merged;
  for (const UnitInfo& u : base.units()) merged.emplace_back(u.numel);
  for (size_t id = 0; id < base.params().size(); id++) {
    const ParamInfo &p = table.params()[id], &q = base.params()[id];
    std::copy_n(units[p.unit].data() + p.offset, p.numel, merged[q.unit].data() + q.offset);
  }
  const std::vector<LinearSite> sites = table.block_sites(0);
  for (int l = 0; l < table.config().n_layer && merge; l++)
    for (size_t k = 0; k < sites.size(); k++) {
      const int first = table.adapter_param(l, static_cast<int>(k));
      if (first < 0) continue;
      const int u = block_unit(l);
      std::string prefix = table.param(u, sites[k].weight).name;  // "<weight less .weight>."
      prefix.resize(prefix.size() - std::string("weight").size());
      std::vector<const double*> p;
      for (size_t i = first; i < table.units()[u].params.size(); i++) {
        const ParamInfo& info = table.param(u, static_cast<int>(i));
        if (!info.adapter || info.name.compare(0, prefix.size(), prefix) != 0) break;
        p.push_back(units[u].data() + info.offset);
      }
      double* W = merged[u].data() + base.offset(u, sites[k].weight);
      const std::vector<double> delta = naive_delta(table.adapter(), sites[k], p, W);
      for (size_t e = 0; e < delta.size(); e++) W[e] += delta[e];
    }
  return merged;
}

std::string usage_error(const ModelConfig& c, const AdapterConfig& a) {
  try {
    ParamTable table(c, {}, a);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

std::vector<std::string> adapter_names(const ParamTable& table, int layer) {
  std::vector<std::string> names;
  for (const ParamInfo& p : table.params())
    if (p.adapter && p.unit == block_unit(layer)) names.push_back(p.name + " " + std::to_string(p.shape[0]) + "x" +
                                                                  std::to_string(p.shape.size() > 1 ? p.shape[1] : 1));
  return names;
}

// The methods and settings the model tests cover: every factor layout of LoKr, both rotations.
std::vector<AdapterConfig> methods(std::vector<std::string> targets) {
  std::vector<AdapterConfig> out{method(ADAPTER_LOHA, targets), method(ADAPTER_LOKR, targets, 4),
                                 method(ADAPTER_LOKR, targets, 1), method(ADAPTER_OFT, targets)};
  out[2].decompose_both = true;  // rank 1: every factor low-rank
  out.push_back(out.back()), out.back().cayley_neumann = false;
  out.push_back(out.back()), out.back().block_share = true, out.back().cayley_neumann = true, out.back().neumann_terms = 3;
  return out;
}

std::string label(const AdapterConfig& a) {
  return std::string(adapter_type_name(a.type)) + " rank " + std::to_string(a.rank) +
         (a.decompose_both ? " both" : "") + (a.cayley_neumann ? "" : " exact") + (a.block_share ? " shared" : "");
}

}  // namespace

TEST(DeltaAdapters, LokrFactorizesAsPeft) {
  EXPECT_EQ(lokr_factorization(16, -1), std::make_pair(4, 4));
  EXPECT_EQ(lokr_factorization(32, -1), std::make_pair(4, 8));
  EXPECT_EQ(lokr_factorization(64, -1), std::make_pair(8, 8));
  EXPECT_EQ(lokr_factorization(96, -1), std::make_pair(8, 12));
  EXPECT_EQ(lokr_factorization(128, -1), std::make_pair(8, 16));
  EXPECT_EQ(lokr_factorization(7, -1), std::make_pair(1, 7));
  EXPECT_EQ(lokr_factorization(128, 32), std::make_pair(32, 4));  // a dividing factor: as given
  EXPECT_EQ(lokr_factorization(96, 5), std::make_pair(4, 24));    // otherwise the largest divisor <= 5
  AdapterConfig a = method(ADAPTER_LOKR, {"x"}, 4);
  const LokrShape full = lokr_shape(a, 32, 16);  // out 16 = 4 x 4, in 32 = 4 x 8; 4 >= 8 / 2: full
  EXPECT_EQ(std::vector<int>({full.a, full.b, full.c, full.d}), std::vector<int>({4, 4, 4, 8}));
  EXPECT_FALSE(full.w1_low_rank);
  EXPECT_FALSE(full.w2_low_rank);
  a.rank = 3;
  EXPECT_TRUE(lokr_shape(a, 32, 16).w2_low_rank);
  EXPECT_FALSE(lokr_shape(a, 32, 16).w1_low_rank);  // only with decompose_both
  a.decompose_both = true, a.rank = 1;
  EXPECT_TRUE(lokr_shape(a, 32, 16).w1_low_rank);
}

TEST(DeltaAdapters, TableHasPeftsNamesAndShapes) {
  const ModelConfig c = tiny_llama_config();  // q_proj 16 -> 16, down_proj 20 -> 16
  EXPECT_EQ(adapter_names(ParamTable(c, {}, method(ADAPTER_LOHA, {"layers.0.mlp.down_proj"})), 0),
            (std::vector<std::string>{"layers.0.mlp.down_proj.hada_w1_a 16x2", "layers.0.mlp.down_proj.hada_w1_b 2x20",
                                      "layers.0.mlp.down_proj.hada_w2_a 16x2",
                                      "layers.0.mlp.down_proj.hada_w2_b 2x20"}));
  EXPECT_EQ(adapter_names(ParamTable(c, {}, method(ADAPTER_LOKR, {"layers.0.mlp.down_proj"}, 4)), 0),
            (std::vector<std::string>{"layers.0.mlp.down_proj.lokr_w1 4x4", "layers.0.mlp.down_proj.lokr_w2 4x5"}));
  AdapterConfig both = method(ADAPTER_LOKR, {"layers.0.mlp.down_proj"}, 1);
  both.decompose_both = true;
  EXPECT_EQ(adapter_names(ParamTable(c, {}, both), 0),
            (std::vector<std::string>{"layers.0.mlp.down_proj.lokr_w1_a 4x1", "layers.0.mlp.down_proj.lokr_w1_b 1x4",
                                      "layers.0.mlp.down_proj.lokr_w2_a 4x1", "layers.0.mlp.down_proj.lokr_w2_b 1x5"}));
  EXPECT_EQ(adapter_names(ParamTable(c, {}, method(ADAPTER_OFT, {"layers.0.mlp.down_proj"})), 0),
            (std::vector<std::string>{"layers.0.mlp.down_proj.oft_R.weight 5x6"}));
  AdapterConfig shared = method(ADAPTER_OFT, {"layers.0.mlp.down_proj"});
  shared.block_share = true;
  EXPECT_EQ(adapter_names(ParamTable(c, {}, shared), 0),
            (std::vector<std::string>{"layers.0.mlp.down_proj.oft_R.weight 1x6"}));
  // Every method freezes the whole base.
  for (const AdapterConfig& a : methods({"self_attn.q_proj"})) {
    const ParamTable table(c, {}, a);
    for (const ParamInfo& p : table.params()) EXPECT_EQ(p.frozen, !p.adapter) << p.name;
  }
}

TEST(DeltaAdapters, RefusesBlocksThatDoNotTileALayerAndRanksAboveIt) {
  AdapterConfig oft = method(ADAPTER_OFT, {"mlp.down_proj"});
  oft.block_size = 8;  // down_proj has 20 inputs
  const std::string error = usage_error(tiny_llama_config(), oft);
  EXPECT_NE(error.find("adapter.block_size=8 does not divide the 20 inputs of model.layers.0.mlp.down_proj"),
            std::string::npos) << error;
  EXPECT_NE(error.find("such as 5 or 10"), std::string::npos) << error;
  EXPECT_NE(usage_error(tiny_llama_config(), method(ADAPTER_LOHA, {"self_attn.k_proj"}, 9)).find("adapter.rank=9"),
            std::string::npos);
  EXPECT_EQ(usage_error(tiny_llama_config(), method(ADAPTER_LOKR, {"self_attn.k_proj"}, 9)), "");  // LoKr: full factors
}

// R written out: I + 2Q + 2Q^2 + 2Q^3 + Q^4 (T = 5), I + 2Q + 2Q^2 + Q^3 (T = 3 and 4), I + 2Q
// (T = 2); the exact transform orthogonal with R (I + Q) = I - Q.
TEST(DeltaAdapters, OftRotationsAreTheSeriesAndTheCayleyTransform) {
  const int b = 5, nv = b * (b - 1) / 2;
  std::vector<double> v(nv), Q(b * b, 0.0), I(b * b, 0.0);
  for (int i = 0; i < nv; i++) v[i] = 0.3 * counter_normal(5, i);
  for (int i = 0, at = 0; i < b; i++) {
    I[i * b + i] = 1;
    for (int j = i + 1; j < b; j++, at++) Q[i * b + j] = v[at], Q[j * b + i] = -v[at];
  }
  const std::vector<double> Q2 = product(Q.data(), Q.data(), b, b, b), Q3 = product(Q2.data(), Q.data(), b, b, b),
                            Q4 = product(Q3.data(), Q.data(), b, b, b);
  const std::vector<std::pair<int, std::vector<double>>> series = {
      {5, {1, 2, 2, 2, 1}}, {4, {1, 2, 2, 1, 0}}, {3, {1, 2, 2, 1, 0}}, {2, {1, 2, 0, 0, 0}}, {1, {1, 0, 0, 0, 0}}};
  for (const auto& [terms, c] : series) {
    std::vector<double> R(b * b);
    OftRotation{b, true, terms}.forward(v.data(), R.data());
    for (int e = 0; e < b * b; e++)
      EXPECT_NEAR(R[e], c[0] * I[e] + c[1] * Q[e] + c[2] * Q2[e] + c[3] * Q3[e] + c[4] * Q4[e], 1e-14) << terms;
  }
  std::vector<double> R(b * b), IplusQ(b * b), IminusQ(b * b);
  OftRotation{b, false, 5}.forward(v.data(), R.data());
  for (int e = 0; e < b * b; e++) IplusQ[e] = I[e] + Q[e], IminusQ[e] = I[e] - Q[e];
  const std::vector<double> lhs = product(R.data(), IplusQ.data(), b, b, b);
  std::vector<double> Rt(b * b);
  for (int i = 0; i < b; i++)
    for (int j = 0; j < b; j++) Rt[j * b + i] = R[i * b + j];
  const std::vector<double> RtR = product(Rt.data(), R.data(), b, b, b);
  for (int e = 0; e < b * b; e++) {
    EXPECT_NEAR(lhs[e], IminusQ[e], 1e-14);
    EXPECT_NEAR(RtR[e], I[e], 1e-14);
  }
}

TEST(DeltaAdapters, OftRotationGradientsMatchFiniteDifferences) {
  const int b = 4, nv = b * (b - 1) / 2;
  std::vector<double> v(nv), G(b * b);
  for (int i = 0; i < nv; i++) v[i] = 0.4 * counter_normal(6, i);
  for (int i = 0; i < b * b; i++) G[i] = counter_normal(7, i);
  for (const OftRotation rotation : {OftRotation{b, true, 5}, OftRotation{b, true, 3}, OftRotation{b, true, 2},
                                     OftRotation{b, false, 5}}) {
    auto loss = [&](const std::vector<double>& x) {  // <G, R(x)>
      std::vector<double> R(b * b);
      rotation.forward(x.data(), R.data());
      double sum = 0;
      for (int e = 0; e < b * b; e++) sum += G[e] * R[e];
      return sum;
    };
    std::vector<double> dv(nv, 0.5);  // accumulates onto what is there
    rotation.backward(v.data(), G.data(), dv.data());
    for (int i = 0; i < nv; i++) {
      std::vector<double> up = v, down = v;
      up[i] += 1e-6, down[i] -= 1e-6;
      EXPECT_NEAR(dv[i] - 0.5, (loss(up) - loss(down)) / 2e-6, 1e-8)
          << (rotation.cayley_neumann ? "series " + std::to_string(rotation.neumann_terms) : "exact") << " " << i;
    }
  }
}

TEST(DeltaAdapters, ModelEqualsTheBaseWithMergedWeights) {
  const std::vector<std::pair<ModelConfig, std::vector<std::string>>> cases = {
      {tiny_gpt2_config(), {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"}},
      {tiny_llama_config(), {"self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.up_proj", "down_proj"}},
      {tiny_qwen2_config(), {"self_attn.q_proj", "self_attn.k_proj", "mlp.up_proj"}},
  };
  const int B = 2, T = 5;
  for (const auto& [config, targets] : cases)
    for (const AdapterConfig& a : methods(targets)) {
      const ParamTable table(config, {}, a), base(config);
      Units units = random_units<double>(table, 0.3, 17);
      Units merged = base_units(table, base, units);
      const double adapted = loss_of(table, units, nullptr, B, T), reference = loss_of(base, merged, nullptr, B, T);
      EXPECT_NEAR(adapted, reference, 1e-11 * std::fabs(reference)) << config.arch << " " << label(a);
      // And the adapters matter.
      Units unmerged = base_units(table, base, units, false);
      EXPECT_GT(std::fabs(adapted - loss_of(base, unmerged, nullptr, B, T)), 1e-4) << label(a);
    }
}

// Central differences (h = 1e-5, double), as the LoRA test.
TEST(DeltaAdapters, AdapterGradientsMatchFiniteDifferencesAndTheBaseGetsNone) {
  const std::vector<std::pair<ModelConfig, std::vector<std::string>>> cases = {
      {tiny_gpt2_config(), {"attn.c_attn", "mlp.c_proj"}},
      {tiny_llama_config(), {"self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "o_proj"}},
  };
  const int B = 2, T = 5;
  for (const auto& [config, targets] : cases)
    for (const AdapterConfig& a : methods(targets)) {
      const ParamTable table(config, {}, a);
      Units units = random_units<double>(table, 0.3, 17), grads;
      loss_of(table, units, &grads, B, T);
      for (const ParamInfo& p : table.params()) {
        if (!p.adapter) {
          for (size_t i = 0; i < p.numel; i++) ASSERT_EQ(grads[p.unit][p.offset + i], 0.0) << p.name;
          continue;
        }
        for (size_t i : {size_t(0), p.numel / 2, p.numel - 1}) {
          const double numeric =
              central_difference(units[p.unit][p.offset + i], [&] { return loss_of(table, units, nullptr, B, T); }) /
              (B * T);
          const double analytic = grads[p.unit][p.offset + i];
          EXPECT_NEAR(analytic, numeric, 1e-8 + 1e-6 * std::fabs(numeric)) << label(a) << " " << p.name << "[" << i << "]";
        }
      }
    }
}
