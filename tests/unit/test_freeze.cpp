// train.freeze in the parameter table and the model (docs/freezing.md): the layout (trainable
// parameters first, declaration order kept for checkpoints), the refusals, where the backward can
// stop, and the model's gradients with frozen parameters against the unfrozen model's.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "backend/layer_ops.hpp"
#include "core/error.hpp"
#include "core/random.hpp"
#include "model/families/gpt2/gpt2_family.hpp"
#include "model/families/llama/llama_family.hpp"
#include "model/model.hpp"
#include "support/model_fixtures.hpp"

using namespace shardtrain;
using namespace shardtrain::testing;

namespace {

// Three blocks, so that the backward can stop at each height.
ModelConfig gpt2_config() {
  ModelConfig c = tiny_gpt2_config();
  c.n_layer = 3;
  return c;
}

ModelConfig llama_config(bool tied) {
  ModelConfig c = tiny_llama_config();
  c.n_layer = 3, c.tie_embeddings = tied;
  return c;
}

std::string usage_error(const ModelConfig& c, const std::vector<std::string>& freeze) {
  try {
    ParamTable table(c, freeze);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Freeze, PatternsSplitOnCommasAndIgnoreBlanks) {
  EXPECT_EQ(split_comma_list(" wte, h.[0-5].* ,,wpe"), (std::vector<std::string>{"wte", "h.[0-5].*", "wpe"}));
  EXPECT_TRUE(split_comma_list("").empty());
}

TEST(Freeze, TrainableParametersComeFirstAndFilesKeepDeclarationOrder) {
  const ModelConfig c = gpt2_config();
  const ParamTable whole(c), table(c, {"wpe", "h.1.ln_?.*", "h.2.*"});
  for (size_t u = 0; u < table.units().size(); u++) {
    const UnitInfo& unit = table.units()[u];
    size_t next = 0, trainable = 0;
    for (bool frozen : {false, true})  // each group contiguous, in declaration order
      for (int id : unit.params)
        if (table.params()[id].frozen == frozen) {
          EXPECT_EQ(table.params()[id].offset, next) << table.params()[id].name;
          next += table.params()[id].numel;
          trainable += frozen ? 0 : table.params()[id].numel;
        }
    EXPECT_EQ(next, unit.numel);
    EXPECT_EQ(unit.trainable_numel, trainable) << unit.name;
    EXPECT_EQ(unit.numel, whole.units()[u].numel);
  }
  for (size_t id = 0; id < table.params().size(); id++) {
    EXPECT_EQ(table.params()[id].file_offset, whole.params()[id].offset);
    EXPECT_EQ(table.params()[id].name, whole.params()[id].name);
  }
  // Exactly what the patterns say: wpe, h.1's four norm tensors, all of h.2.
  size_t frozen = 0;
  for (const ParamInfo& p : table.params()) frozen += p.frozen;
  EXPECT_EQ(frozen, 1u + 4u + 12u);
  EXPECT_TRUE(table.frozen(ROOT_UNIT, ROOT_WPE) && !table.frozen(ROOT_UNIT, ROOT_WTE));
  EXPECT_TRUE(table.frozen(block_unit(1), BLOCK_LN2_B) && !table.frozen(block_unit(1), BLOCK_QKV_W));
  EXPECT_EQ(table.units()[block_unit(2)].trainable_numel, 0u);
  EXPECT_EQ(whole.trainable_params(), whole.total_params());
  EXPECT_FALSE(whole.any_frozen());
}

TEST(Freeze, RefusesPatternsThatMatchNothingFreezeEverythingOrSplitAFusedGroup) {
  EXPECT_NE(usage_error(gpt2_config(), {"h.0.*", "h.9.*"}).find("pattern 'h.9.*' matches no parameter"),
            std::string::npos);
  EXPECT_NE(usage_error(gpt2_config(), {"*"}).find("freezes every parameter"), std::string::npos);
  EXPECT_NE(usage_error(gpt2_config(), {"wte", "wpe", "ln_f.*", "h.*"}).find("freezes every parameter"),
            std::string::npos);
  const std::string split = usage_error(llama_config(false), {"layers.1.self_attn.k_proj.weight"});
  EXPECT_NE(split.find("layers.1's q_proj|k_proj|v_proj"), std::string::npos) << split;
  EXPECT_NE(usage_error(llama_config(false), {"layers.0.mlp.up_proj.weight"}).find("gate_proj|up_proj"),
            std::string::npos);
  EXPECT_EQ(usage_error(llama_config(false), {"layers.0.self_attn.[qkv]_proj.weight", "layers.2.mlp.*"}), "");
}

TEST(Freeze, TheBackwardStopsBelowEverythingTrainable) {
  const ModelConfig c = gpt2_config();
  EXPECT_EQ(ParamTable(c).backward_floor(), 0);
  EXPECT_EQ(ParamTable(c, {"h.0.*"}).backward_floor(), 0);         // the embeddings still train
  EXPECT_EQ(ParamTable(c, {"wte", "h.0.*"}).backward_floor(), 0);  // wpe does
  EXPECT_EQ(ParamTable(c, {"wte", "wpe", "h.0.*"}).backward_floor(), 1);
  EXPECT_EQ(ParamTable(c, {"wte", "wpe", "h.[01].*"}).backward_floor(), 2);
  EXPECT_EQ(ParamTable(c, {"wte", "wpe", "h.*"}).backward_floor(), 3);  // ln_f alone trains
  EXPECT_EQ(ParamTable(c, {"wte", "wpe", "h.0.ln_1.weight"}).backward_floor(), 0);
  EXPECT_EQ(ParamTable(llama_config(true), {"embed_tokens.weight", "layers.0.*"}).backward_floor(), 1);
}

// Oracle: the same values through the unfrozen model. Frozen parameters only skip their own
// gradient products, so every other gradient has the same bits (the same operations in the same
// order), and frozen ones get nothing.
TEST(Freeze, TrainableGradientsAreTheUnfrozenModelsAndFrozenOnesUntouched) {
  const std::vector<std::pair<ModelConfig, std::vector<std::string>>> cases = {
      {gpt2_config(), {"wte", "h.0.ln_1.*", "h.1.attn.qkv.*", "h.2.mlp.proj.bias"}},
      {llama_config(false), {"lm_head.weight", "layers.0.self_attn.[qkv]_proj.weight", "layers.1.*"}},
      {llama_config(true), {"embed_tokens.weight", "norm.weight", "layers.2.mlp.down_proj.weight"}},
  };
  const int B = 2, T = 5;
  for (const auto& [config, freeze] : cases) {
    const ParamTable whole(config), table(config, freeze);
    std::vector<std::vector<double>> values_whole, values, grads_whole, grads;
    for (size_t u = 0; u < table.units().size(); u++) {
      values_whole.emplace_back(table.units()[u].numel), values.emplace_back(table.units()[u].numel);
      grads_whole.emplace_back(table.units()[u].numel, 0.0);
      grads.emplace_back(table.units()[u].numel, -7.0);  // frozen parts must keep this
    }
    for (size_t id = 0; id < table.params().size(); id++)
      for (size_t i = 0; i < table.params()[id].numel; i++) {
        const double x = 0.3 * counter_normal(id + 5, i) + (table.params()[id].init == INIT_ONES ? 1.0 : 0.0);
        values_whole[whole.params()[id].unit][whole.params()[id].offset + i] = x;
        values[table.params()[id].unit][table.params()[id].offset + i] = x;
      }
    for (size_t u = 0; u < table.units().size(); u++)  // trainable gradients start at zero
      std::fill_n(grads[u].begin(), table.units()[u].trainable_numel, 0.0);
    std::vector<int> tokens(B * T), targets(B * T);
    for (int i = 0; i < B * T; i++) tokens[i] = (i * 5 + 3) % config.vocab_size, targets[i] = (i * 7 + 1) % config.vocab_size;
    auto run = [&](const ParamTable& t, std::vector<std::vector<double>>& v, std::vector<std::vector<double>>& g) {
      auto model = make_model<double>(t, B, T, false, cpu_layer_ops<double>());
      std::vector<const double*> vp;
      std::vector<double*> gp;
      for (size_t u = 0; u < v.size(); u++) vp.push_back(v[u].data()), gp.push_back(g[u].data());
      return forward_backward_unsharded(*model, t, vp, gp, token_batch(tokens, targets, B, T), 1.0 / (B * T));
    };
    EXPECT_EQ(run(whole, values_whole, grads_whole), run(table, values, grads));
    for (size_t id = 0; id < table.params().size(); id++) {
      const ParamInfo &p = table.params()[id], &q = whole.params()[id];
      for (size_t i = 0; i < p.numel; i++) {
        const double got = grads[p.unit][p.offset + i];
        if (p.frozen)
          ASSERT_EQ(got, -7.0) << p.name << "[" << i << "] was written";
        else
          ASSERT_EQ(got, grads_whole[q.unit][q.offset + i]) << p.name << "[" << i << "]";
      }
    }
  }
}
