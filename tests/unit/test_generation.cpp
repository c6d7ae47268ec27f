// Generation: the models' decode path with a key/value cache (model/model.hpp) against a naive
// full recompute -- the training forward over the whole prefix, its last position's probabilities
// -- at every step of a greedy generation, for GPT-2 and Llama (tied and untied, grouped-query and
// multi-query), in double (to 1e-12) and float; prompts fed in chunks of any size; the decode
// state's memory equal to its plan; FsdpEngine::decode_step on one rank; and the sampler
// (temperature, top-k, top-p, the seed).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <vector>

#include "app/generate.hpp"
#include "comm/comm.hpp"
#include "core/random.hpp"
#include "model/model.hpp"
#include "support/model_fixtures.hpp"
#include "shard/fsdp_engine.hpp"

using namespace shardtrain;
using namespace shardtrain::testing;

namespace {

ModelConfig gpt_config() {
  ModelConfig c;
  c.n_layer = 2, c.n_embd = 12, c.n_head = 3, c.vocab_size = 23, c.max_seq_len = 14;
  return c;
}

// 4 query heads on 2 key/value heads, an MLP that is not 4 C, untied, rope turning fast.
ModelConfig llama_config() {
  ModelConfig c = gpt_config();
  c.arch = "llama";
  c.n_embd = 16, c.n_head = 4, c.n_kv_head = 2, c.intermediate_size = 20;
  c.rope_theta = 100.0, c.tie_embeddings = false;
  return c;
}

// Tied, one key/value head for all query heads (multi-query).
ModelConfig llama_tied_mqa_config() {
  ModelConfig c = llama_config();
  c.n_kv_head = 1, c.tie_embeddings = true;
  return c;
}

struct ArchCase {
  const char* name;
  ModelConfig (*config)();
};
// Qwen2: q/k/v biases (the cache holds keys with their bias, after rope).
ModelConfig qwen2_config() {
  ModelConfig c = llama_config();
  c.arch = "qwen2";
  return c;
}

// Qwen3: q/k norms on heads of their own size (the cache holds normed keys, after rope).
ModelConfig qwen3_config() {
  ModelConfig c = llama_config();
  c.arch = "qwen3";
  c.head_dim = 6;
  return c;
}

// SmolLM3: block 1 without rotary embeddings (its cached keys unturned).
ModelConfig smollm3_config() {
  ModelConfig c = llama_config();
  c.arch = "smollm3";
  c.nope_layers = "1";
  return c;
}

// Heads of their own size (6, not 16 / 4) and llama3-scaled rotary frequencies: the cache and the
// attention output 24 wide on a width of 16.
ModelConfig llama_head_dim_config() {
  ModelConfig c = llama_config();
  c.head_dim = 6;
  c.rope_scaling = "llama3:factor=4,low_freq_factor=1,high_freq_factor=4,original_max_position_embeddings=8";
  return c;
}

// Mistral's sliding window, shortened to 4 so that it slides from the fifth token on: the prompt's
// rows (decoded together) and every later token see only the last 4 cache rows.
ModelConfig mistral_window_config() {
  ModelConfig c = llama_config();
  c.sliding_window = 4;
  return c;
}

const ArchCase ARCH_CASES[] = {{"gpt2", gpt_config},
                               {"llama_gqa_untied", llama_config},
                               {"llama_head_dim", llama_head_dim_config},
                               {"llama_mqa_tied", llama_tied_mqa_config},
                               {"mistral_window", mistral_window_config},
                               {"qwen2_gqa_untied", qwen2_config},
                               {"qwen3_head_dim", qwen3_config},
                               {"smollm3_nope", smollm3_config}};

class GenerationTest : public ::testing::TestWithParam<ArchCase> {};
std::string arch_case_name(const ::testing::TestParamInfo<ArchCase>& info) { return info.param.name; }

// The naive reference: a fresh training model over the whole sequence, the softmax probabilities
// of its last position.
template <typename Real>
std::vector<Real> full_recompute_probs(const ParamTable& table, const std::vector<std::vector<Real>>& units,
                                       const std::vector<int>& tokens) {
  const int T = static_cast<int>(tokens.size());
  auto model = make_model<Real>(table, 1, T, false, cpu_layer_ops<Real>());
  const Batch batch = token_batch(tokens, std::vector<int>(T, 0), 1, T);
  model->embed_forward(units[ROOT_UNIT].data(), batch);
  for (int l = 0; l < table.config().n_layer; l++) model->block_forward(l, units[block_unit(l)].data());
  model->host_head_forward(units[ROOT_UNIT].data(), batch);
  std::vector<Real> probs(table.config().vocab_size);
  model->token_logits()->copy_head_probs(T - 1, probs.data());
  return probs;
}

template <typename Real>
std::vector<double> softmax(const std::vector<Real>& logits) {
  const double max = *std::max_element(logits.begin(), logits.end());
  std::vector<double> p(logits.size());
  double sum = 0;
  for (size_t i = 0; i < p.size(); i++) sum += p[i] = std::exp(logits[i] - max);
  for (double& x : p) x /= sum;
  return p;
}

template <typename V>
int argmax(const V& v) {
  return static_cast<int>(std::max_element(v.begin(), v.end()) - v.begin());
}

// One decode step of n tokens with every unit present; returns the step's logits.
template <typename Real>
std::vector<Real> decode(TransformerModel<Real>& model, const ParamTable& table,
                         const std::vector<std::vector<Real>>& units, const int* tokens, int n) {
  model.kv_decoder()->decode_embed(units[ROOT_UNIT].data(), tokens, n);
  for (int l = 0; l < table.config().n_layer; l++) model.kv_decoder()->decode_block(l, units[block_unit(l)].data());
  std::vector<Real> logits(table.config().vocab_size);
  model.kv_decoder()->decode_head(units[ROOT_UNIT].data(), logits.data());
  return logits;
}

// Greedy generation from a 3-token prompt to max_seq_len: at every step the decode path's argmax
// is the full recompute's, and its probabilities agree to `tol`.
template <typename Real>
void check_greedy_against_full_recompute(const ModelConfig& config, double tol) {
  const ParamTable table(config);
  const auto units = random_units<Real>(table, 0.5, 7000);
  const int M = config.max_seq_len;
  auto model = make_model<Real>(table, 1, 1, false, cpu_layer_ops<Real>());
  model->kv_decoder()->begin_decode(M, 3);
  std::vector<int> sequence = {5, 17, 2};
  std::vector<Real> logits = decode(*model, table, units, sequence.data(), 3);
  std::map<int, int> distinct;
  while (true) {
    const std::vector<Real> reference = full_recompute_probs(table, units, sequence);
    const std::vector<double> probs = softmax(logits);
    const int t = static_cast<int>(sequence.size());
    ASSERT_EQ(argmax(logits), argmax(reference)) << "greedy token after " << t << " tokens";
    for (size_t v = 0; v < probs.size(); v++)
      ASSERT_NEAR(probs[v], reference[v], tol) << "token " << v << " after " << t << " tokens";
    const int next = argmax(logits);
    distinct[next]++;
    if (t == M) break;
    sequence.push_back(next);
    ASSERT_EQ(model->kv_decoder()->decode_position(), t);
    logits = decode(*model, table, units, &next, 1);
  }
  EXPECT_EQ(model->kv_decoder()->decode_position(), M);
  // Not a degenerate test: the greedy path visits several tokens.
  EXPECT_GE(distinct.size(), 2u);
}

}  // namespace

TEST_P(GenerationTest, GreedyDecodeEqualsFullRecomputeAtEveryStepInDouble) {
  check_greedy_against_full_recompute<double>(GetParam().config(), 1e-12);
}

TEST_P(GenerationTest, GreedyDecodeEqualsFullRecomputeAtEveryStepInFloat) {
  check_greedy_against_full_recompute<float>(GetParam().config(), 2e-5);
}

// Prompts fed one token at a time, in uneven chunks or whole give the same logits (to rounding:
// matrix products of other row counts), and begin_decode empties the cache for the next sequence.
TEST_P(GenerationTest, ChunkedPrefillGivesTheLogitsOfOneTokenSteps) {
  const ModelConfig config = GetParam().config();
  const ParamTable table(config);
  const auto units = random_units<double>(table, 0.5, 11000);
  const std::vector<int> tokens = {3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8};
  const int n = static_cast<int>(tokens.size());
  auto model = make_model<double>(table, 1, 1, false, cpu_layer_ops<double>());
  model->kv_decoder()->begin_decode(n, 1);
  std::vector<std::vector<double>> single;  // logits after each token
  for (int i = 0; i < n; i++) single.push_back(decode(*model, table, units, &tokens[i], 1));
  for (const std::vector<int>& chunks : std::vector<std::vector<int>>{{12}, {5, 7}, {3, 4, 5}, {1, 10, 1}}) {
    model->kv_decoder()->begin_decode(n, *std::max_element(chunks.begin(), chunks.end()));
    int fed = 0;
    for (int size : chunks) {
      const std::vector<double> logits = decode(*model, table, units, tokens.data() + fed, size);
      fed += size;
      for (size_t v = 0; v < logits.size(); v++)
        ASSERT_NEAR(logits[v], single[fed - 1][v], 1e-12) << "chunk ending at " << fed << ", token " << v;
    }
  }
}

// What begin_decode allocates is what plan_decode_bytes says, and the cache is L x 2 x max_len x
// n_kv_head x head_size elements: one more position costs exactly that (plus its score slots and,
// for the rotary families, its rope row).
TEST_P(GenerationTest, DecodeMemoryEqualsItsPlan) {
  const ModelConfig c = GetParam().config();
  const ParamTable table(c);
  auto model = make_model<float>(table, 1, 1, false, cpu_layer_ops<float>());
  Device& dev = cpu_layer_ops<float>().device();
  const size_t before = dev.live_bytes();
  model->kv_decoder()->begin_decode(10, 4);
  EXPECT_EQ(dev.live_bytes() - before, model->kv_decoder()->decode_bytes());
  EXPECT_EQ(model->kv_decoder()->decode_bytes(), plan_decode_bytes(table, 10, 4));
  const size_t per_position = 2 * c.n_layer * c.kv_heads() * c.head_size() + 4 * c.n_head +
                              (c.arch != "gpt2" ? c.head_size() : 0);
  EXPECT_EQ(plan_decode_bytes(table, 11, 4) - plan_decode_bytes(table, 10, 4), per_position * sizeof(float));
  model->kv_decoder()->begin_decode(5, 2);  // again: the old state is freed first
  EXPECT_EQ(dev.live_bytes() - before, plan_decode_bytes(table, 5, 2));
  model->kv_decoder()->end_decode();
  EXPECT_EQ(dev.live_bytes(), before);
  EXPECT_EQ(model->kv_decoder()->decode_bytes(), 0u);
}

// The engine's inference entry point on one rank (the shard is the whole unit) gives the model's
// own decode of the engine's parameters, over several steps that keep the root gathered. An
// inference engine holds no gradients, and plans none.
TEST_P(GenerationTest, EngineDecodeStepEqualsTheModelsDecode) {
  const ParamTable table(GetParam().config());
  auto shard = make_mpi_comm(MPI_COMM_SELF, nullptr), replica = make_mpi_comm(MPI_COMM_SELF, nullptr);
  MemoryTracker memory;
  EngineOptions options;
  options.inference = true;
  const size_t before = cpu_backend().device->live_bytes();
  FsdpEngine engine(table, *shard, *replica, memory, options, cpu_backend());
  EXPECT_EQ(memory.current(MEM_GRADIENTS), 0u);
  EXPECT_EQ(cpu_backend().device->live_bytes() - before, memory.total_current());
  EXPECT_EQ(memory.total_current(), table.total_params() * sizeof(float));  // the parameters alone
  engine.init_parameters(3);
  std::vector<std::vector<float>> units;
  for (size_t u = 0; u < table.units().size(); u++) units.push_back(engine.gather_unit(static_cast<int>(u), false));
  auto direct = make_model<float>(table, 1, 1, false, cpu_layer_ops<float>());
  auto through_engine = make_model<float>(table, 1, 1, false, cpu_layer_ops<float>());
  direct->kv_decoder()->begin_decode(8, 3);
  through_engine->kv_decoder()->begin_decode(8, 3);
  const std::vector<int> tokens = {1, 2, 3, 4, 5, 6};
  std::vector<float> logits(table.config().vocab_size);
  engine.decode_step(*through_engine, tokens.data(), 3, logits.data(), true);
  EXPECT_EQ(decode(*direct, table, units, tokens.data(), 3), logits) << "the prompt";
  for (int i = 3; i < 6; i++) {
    const bool head = i != 4;  // step 4 leaves the head out, as ranks that do not sample do
    engine.decode_step(*through_engine, &tokens[i], 1, head ? logits.data() : nullptr, false);
    const std::vector<float> expected = decode(*direct, table, units, &tokens[i], 1);
    if (head) {
      EXPECT_EQ(expected, logits) << "step " << i;
    }
  }
  EXPECT_EQ(through_engine->kv_decoder()->decode_position(), 6);
}

INSTANTIATE_TEST_SUITE_P(Archs, GenerationTest, ::testing::ValuesIn(ARCH_CASES), arch_case_name);

// ---- sampling ------------------------------------------------------------------------------------

TEST(Sampling, GreedyTakesTheArgmaxAndTheLowestIdAmongEquals) {
  const std::vector<float> logits = {0.5f, 2.0f, -1.0f, 2.0f, 1.9f};
  SamplingOptions greedy;
  greedy.temperature = 0;
  for (uint64_t draw = 0; draw < 5; draw++) EXPECT_EQ(sample_token(logits.data(), 5, greedy, draw), 1);
  EXPECT_EQ(sample_token(logits.data(), 1, greedy, 0), 0);  // only the allowed ids
  // top_k = 1 and a tiny top_p are greedy at any temperature and seed.
  for (uint64_t seed = 0; seed < 20; seed++) {
    SamplingOptions k1, p0;
    k1.top_k = 1, k1.seed = seed, k1.temperature = 5;
    p0.top_p = 1e-9, p0.seed = seed, p0.temperature = 5;
    EXPECT_EQ(sample_token(logits.data(), 5, k1, seed), 1);
    EXPECT_EQ(sample_token(logits.data(), 5, p0, seed), 1);
  }
}

// Frequencies over many draws follow softmax(logits / T) after the cuts (binomial standard errors
// are below 0.004 at 20000 draws; the bound is 0.015).
TEST(Sampling, FrequenciesFollowTheCutAndTemperedSoftmax) {
  const std::vector<float> logits = {std::log(0.1f), std::log(0.4f), std::log(0.2f), std::log(0.3f)};
  auto frequencies = [&](const SamplingOptions& o, int allowed) {
    std::vector<double> f(logits.size());
    const int draws = 20000;
    for (int d = 0; d < draws; d++) f[sample_token(logits.data(), allowed, o, d)] += 1.0 / draws;
    return f;
  };
  auto expect = [](const std::vector<double>& got, const std::vector<double>& want, const char* what) {
    for (size_t i = 0; i < want.size(); i++) EXPECT_NEAR(got[i], want[i], 0.015) << what << " token " << i;
  };
  SamplingOptions plain;
  expect(frequencies(plain, 4), {0.1, 0.4, 0.2, 0.3}, "T=1");
  SamplingOptions hot;
  hot.temperature = 2;  // p^(1/2), renormalised
  const double z = std::sqrt(0.1) + std::sqrt(0.4) + std::sqrt(0.2) + std::sqrt(0.3);
  expect(frequencies(hot, 4), {std::sqrt(0.1) / z, std::sqrt(0.4) / z, std::sqrt(0.2) / z, std::sqrt(0.3) / z}, "T=2");
  SamplingOptions k2;
  k2.top_k = 2;  // 0.4 and 0.3
  expect(frequencies(k2, 4), {0, 0.4 / 0.7, 0, 0.3 / 0.7}, "top_k=2");
  SamplingOptions p;
  p.top_p = 0.75;  // 0.4 + 0.3 = 0.7 < 0.75: 0.2 joins
  expect(frequencies(p, 4), {0, 0.4 / 0.9, 0.2 / 0.9, 0.3 / 0.9}, "top_p=0.75");
  expect(frequencies(plain, 3), {0.1 / 0.7, 0.4 / 0.7, 0.2 / 0.7, 0}, "allowed=3");
}

// A pure function of (logits, options, draw): the same seed repeats, another seed differs.
TEST(Sampling, TheSeedFixesTheDraws) {
  std::vector<float> logits(50);
  for (int i = 0; i < 50; i++) logits[i] = static_cast<float>(std::sin(i * 0.7));
  SamplingOptions a, b;
  a.seed = 1, b.seed = 2;
  std::vector<int> first, again, other;
  for (uint64_t d = 0; d < 40; d++) {
    first.push_back(sample_token(logits.data(), 50, a, d));
    again.push_back(sample_token(logits.data(), 50, a, d));
    other.push_back(sample_token(logits.data(), 50, b, d));
  }
  EXPECT_EQ(first, again);
  EXPECT_NE(first, other);
}
