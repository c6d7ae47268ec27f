// The model-family layer (model/family.hpp): the registry, and a table of blocks of two kinds --
// the shape of a FLUX-style model (double- then single-stream blocks) -- declared by a family of
// the test's own: each kind its own parameters and adapter sites, adapters placed on the blocks
// whose kind has the targeted layer, the engine's block list in declaration order.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/error.hpp"
#include "model/families/llama/llama_family.hpp"
#include "model/family.hpp"
#include "model/param_table.hpp"

using namespace shardtrain;

namespace {

// Root: an embedding. Blocks: `n_layer` "double" blocks (two linear layers, img and txt), then
// `n_layer` "single" blocks (one linear layer, proj). What it does not declare it inherits from Llama
// (never called here).
class TwoKindFamily final : public LlamaFamily {
 public:
  const char* name() const override { return "two_kinds"; }
  bool kv_decoding() const override { return false; }
  bool token_logits() const override { return false; }
  void add_params(ParamTable& t) const override {
    const ModelConfig& c = t.config();
    const int C = c.n_embd;
    t.add_param(ROOT_UNIT, "embed.weight", {c.vocab_size, C}, INIT_NORMAL, true);
    for (int l = 0; l < c.n_layer; l++) {
      const std::string h = "double_blocks." + std::to_string(l);
      const int u = t.add_unit(h, "double");
      t.add_param(u, h + ".img.weight", {C, C}, INIT_NORMAL, true);
      t.add_param(u, h + ".txt.weight", {2 * C, C}, INIT_NORMAL, true);
    }
    for (int l = 0; l < c.n_layer; l++) {
      const std::string h = "single_blocks." + std::to_string(l);
      const int u = t.add_unit(h, "single");
      t.add_param(u, h + ".norm.weight", {C}, INIT_ONES, false);
      t.add_param(u, h + ".proj.weight", {3 * C, C}, INIT_NORMAL, true);
    }
  }
  std::vector<FusedGroup> fused_groups(const ModelConfig&, const std::string&) const override { return {}; }
  std::vector<LinearSite> linear_sites(const ModelConfig& c, const std::string& kind) const override {
    const int C = c.n_embd;
    if (kind == "double") return {{"img", 0, -1, 0, C, C, 0, C}, {"txt", 1, -1, 1, C, 2 * C, 0, 2 * C}};
    return {{"proj", 1, -1, 0, C, 3 * C, 0, 3 * C}};
  }
  std::string module_path(const ModelConfig&, int block, const LinearSite& site) const override {
    return block < 2 ? "double_blocks." + std::to_string(block) + "." + site.module
                     : "single_blocks." + std::to_string(block - 2) + "." + site.module;
  }
};

const TwoKindFamily& two_kinds() {
  static const TwoKindFamily family;
  static const bool registered = (register_model_family(family), true);
  (void)registered;
  return family;
}

ModelConfig two_kind_config() {
  two_kinds();
  ModelConfig c;
  c.arch = "two_kinds", c.n_layer = 2, c.n_embd = 8, c.n_head = 2, c.vocab_size = 16;
  return c;
}

}  // namespace

TEST(ModelFamilies, TheRegistryNamesEachFamilyOnce) {
  EXPECT_EQ(model_family_names().substr(0, 25), "gpt2, llama, qwen2, qwen3");
  for (const ModelFamily* f : model_families()) EXPECT_EQ(find_model_family(f->name()), f);
  EXPECT_EQ(find_model_family("mamba"), nullptr);
  ModelConfig c;
  for (const char* arch : {"gpt2", "llama", "qwen2", "qwen3", "smollm3"}) {
    c.arch = arch;
    EXPECT_STREQ(family_of(c).name(), arch);
  }
}

// generate and distillation ask the family first and refuse one without the capability they use,
// naming it and the families that have it (UsageError: exit 2 on every rank).
TEST(ModelFamilies, GenerateAndDistillationRefuseAFamilyWithoutTheirCapability) {
  const ModelConfig two = two_kind_config();
  for (const char* use : {"generate", "distillation"}) {
    try {
      require_capability(two, use, "checkpoint 'x.h5'");
      ADD_FAILURE() << use << " accepted a family without its capability";
    } catch (const UsageError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("checkpoint 'x.h5' is a 'two_kinds' model"), std::string::npos) << what;
      EXPECT_NE(what.find("(gpt2, llama, qwen2, qwen3, smollm3, phi3)"), std::string::npos) << what;
    }
    ModelConfig llama;
    llama.arch = "llama";
    EXPECT_NO_THROW(require_capability(llama, use, "distill.teacher"));
  }
}

TEST(ModelFamilies, BlocksOfSeveralKindsKeepTheirOrderSitesAndAdapters) {
  AdapterConfig lora;
  lora.type = ADAPTER_LORA, lora.targets = {"txt", "single_blocks.1.proj"}, lora.rank = 2;
  const ParamTable table(two_kind_config(), {}, lora);
  ASSERT_EQ(table.block_count(), 4);
  const std::vector<std::string> kinds = {"double", "double", "single", "single"};
  for (int b = 0; b < 4; b++) {
    EXPECT_EQ(table.units()[block_unit(b)].kind, kinds[b]) << b;
    EXPECT_EQ(table.block_sites(b).size(), b < 2 ? 2u : 1u) << b;
  }
  EXPECT_EQ(table.units()[ROOT_UNIT].kind, "root");
  EXPECT_EQ(table.all_sites().size(), 3u);  // each kind's once
  // txt of both double blocks, proj of the second single block; nothing else.
  for (int b = 0; b < 4; b++)
    for (int k = 0; k < static_cast<int>(table.block_sites(b).size()); k++) {
      const bool adapted = (b < 2 && k == 1) || b == 3;
      ASSERT_EQ(table.adapter_param(b, k) >= 0, adapted) << b << " " << k;
      if (!adapted) continue;
      const ParamInfo& a = table.param(block_unit(b), table.adapter_param(b, k));
      const int in = table.block_sites(b)[k].in;
      EXPECT_EQ(a.shape, (std::vector<int>{2, in})) << a.name;  // lora_A (rank, in)
      EXPECT_EQ(a.name, b < 2 ? "double_blocks." + std::to_string(b) + ".txt.lora_A.weight"
                              : "single_blocks.1.proj.lora_A.weight");
    }
  // A target no kind has is named with every kind's layers.
  lora.targets = {"to_q"};
  try {
    ParamTable bad(two_kind_config(), {}, lora);
    FAIL() << "no error";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("img, txt, proj"), std::string::npos) << e.what();
  }
}
