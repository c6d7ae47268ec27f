// Shared fixtures of the model tests: small shapes of each model family, parameters with values
// away from degenerate points, and a deterministic batch.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/random.hpp"
#include "model/batch.hpp"
#include "model/param_table.hpp"

namespace shardtrain::testing {

// GPT-2: L=2, C=12, H=3, V=11, max_seq_len 7.
inline ModelConfig tiny_gpt2_config() {
  ModelConfig c;
  c.n_layer = 2, c.n_embd = 12, c.n_head = 3, c.vocab_size = 11, c.max_seq_len = 7;
  return c;
}

// Llama with 4 query heads on 2 key/value heads (head size 4), an MLP that is not 4 C, an untied
// head, and a theta that turns every pair noticeably within a few positions.
inline ModelConfig tiny_llama_config() {
  ModelConfig c = tiny_gpt2_config();
  c.arch = "llama";
  c.n_embd = 16, c.n_head = 4, c.n_kv_head = 2, c.intermediate_size = 20;
  c.rope_theta = 100.0, c.norm_eps = 1e-5, c.tie_embeddings = false;
  return c;
}

// Qwen2: the Llama shape above with q/k/v biases, tied.
inline ModelConfig tiny_qwen2_config() {
  ModelConfig c = tiny_llama_config();
  c.arch = "qwen2";
  c.tie_embeddings = true;
  return c;
}

// Qwen3: the Llama shape above with q/k norms on heads of their own size (6, not 16 / 4).
inline ModelConfig tiny_qwen3_config() {
  ModelConfig c = tiny_llama_config();
  c.arch = "qwen3";
  c.head_dim = 6;
  return c;
}

// SmolLM3: the Llama shape above, block 1 without rotary embeddings (NoPE), tied.
inline ModelConfig tiny_smollm3_config() {
  ModelConfig c = tiny_llama_config();
  c.arch = "smollm3";
  c.nope_layers = "1";
  c.tie_embeddings = true;
  return c;
}

// Every parameter ~ N(0, scale) from the counter stream keyed by salt + its id (norm gains 1 +- it),
// in the table's unit layout.
template <typename Real>
std::vector<std::vector<Real>> random_units(const ParamTable& table, double scale, uint64_t salt) {
  std::vector<std::vector<Real>> units;
  for (const UnitInfo& u : table.units()) units.emplace_back(u.numel);
  for (const ParamInfo& p : table.params())
    for (size_t i = 0; i < p.numel; i++) {
      const double z = scale * counter_normal(salt + p.id, i);
      units[p.unit][p.offset + i] = static_cast<Real>(p.init == INIT_ONES ? 1.0 + z : z);
    }
  return units;
}

// The central difference (f(x + h) - f(x - h)) / 2h of f = loss() in x, h = 1e-5 (double: truncation
// ~1e-10, rounding ~1e-11 for the tests' losses); x is restored.
template <typename Loss>
double central_difference(double& x, Loss loss) {
  const double saved = x, h = 1e-5;
  x = saved + h;
  const double up = loss();
  x = saved - h;
  const double down = loss();
  x = saved;
  return (up - down) / (2 * h);
}

// FLUX: 2 double- and 2 single-stream blocks, C=16, H=2 (head 8 = rotary axes 2+2+4), 4 latent
// channels, 3 text tokens of 6, a pooled vector of 5, guidance; image tokens up to 16.
inline ModelConfig tiny_flux_config() {
  ModelConfig c;
  c.arch = "flux", c.n_layer = 2, c.n_single_layer = 2, c.n_embd = 16, c.n_head = 2, c.max_seq_len = 16;
  c.in_channels = 4, c.context_dim = 6, c.context_len = 3, c.pooled_dim = 5, c.rope_axes = "2,2,4";
  c.norm_eps = 1e-6;
  return c;
}

// FLUX.2's tiny shape: MLPs 1.5 x n_embd wide (FLUX.2-dev: 3 x), four rotary axes, no pooled vector.
inline ModelConfig tiny_flux2_config() {
  ModelConfig c = tiny_flux_config();
  c.arch = "flux2", c.intermediate_size = 24, c.pooled_dim = 0, c.rope_axes = "2,2,2,2", c.rope_theta = 2000;
  return c;
}

// A language model's micro-batch of B sequences of T tokens (model/batch.hpp) from host vectors.
inline Batch token_batch(const std::vector<int>& tokens, const std::vector<int>& targets, int B, int T) {
  Batch b;
  std::copy(tokens.begin(), tokens.end(), b.put<int>(BATCH_TOKENS, {B, T}));
  std::copy(targets.begin(), targets.end(), b.put<int>(BATCH_TARGETS, {B, T}));
  return b;
}

// B sequences of T tokens below V, and their targets: fixed arithmetic patterns.
inline Batch make_batch(int B, int T, int V) {
  std::vector<int> tokens(B * T), targets(B * T);
  for (int i = 0; i < B * T; i++) tokens[i] = (i * 5 + 3) % V, targets[i] = (i * 7 + 1) % V;
  return token_batch(tokens, targets, B, T);
}

// A FLUX micro-batch (model/families/flux/flux_family.hpp's tensors) of B samples of a rows x cols
// latent grid: values from the counter stream keyed by `salt`, sigma in (0, 1), guidance 3.5, image
// ids (0, row, col), text ids 0.
// With c.condition_len > 0, Kontext's condition tokens follow the target's (ids (1, 0, i)).
// FLUX.2 (four axes): image ids (0, row, col, 0), condition ids (10, 0, i, 0), text ids (0, 0, 0, l).
inline Batch make_flux_batch(const ModelConfig& c, int B, int rows, int cols, uint64_t salt) {
  Batch b;
  const int N = rows * cols, L = c.context_len, M = c.condition_len;
  auto fill = [&](const char* name, std::vector<int64_t> shape, double scale, uint64_t key) {
    float* x = b.put<float>(name, shape);
    size_t n = 1;
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    for (size_t i = 0; i < n; i++) x[i] = static_cast<float>(scale * counter_normal(salt + key, i));
  };
  fill("hidden_states", {B, N + M, c.in_channels}, 1.0, 1);
  fill("encoder_hidden_states", {B, L, c.context_dim}, 1.0, 2);
  fill("pooled_projections", {B, c.pooled_dim}, 1.0, 3);
  fill("target", {B, N, c.in_channels}, 1.0, 4);
  float* sigma = b.put<float>("timestep", {B});
  float* guidance = b.put<float>("guidance", {B});
  for (int i = 0; i < B; i++) sigma[i] = 0.1f + 0.8f * static_cast<float>(i + 1) / (B + 1), guidance[i] = 3.5f;
  const int A = c.arch == "flux2" ? 4 : 3;
  float* img = b.put<float>("img_ids", {N + M, A});
  for (int i = 0; i < N; i++) img[A * i + 1] = static_cast<float>(i / cols), img[A * i + 2] = static_cast<float>(i % cols);
  for (int i = 0; i < M; i++) img[A * (N + i)] = A == 4 ? 10 : 1, img[A * (N + i) + 2] = static_cast<float>(i);
  float* txt = b.put<float>("txt_ids", {L, A});
  for (int l = 0; l < L && A == 4; l++) txt[A * l + 3] = static_cast<float>(l);
  return b;
}

}  // namespace shardtrain::testing
