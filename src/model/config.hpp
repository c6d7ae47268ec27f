// The model's architecture and shape: the numbers that fix every parameter's shape and the
// model's arithmetic (docs/architecture.md, docs/llama.md).
#pragma once

namespace shardtrain {

enum ModelArch {
  ARCH_GPT2,   // learned positions, LayerNorm with bias, GELU MLP of 4 C, biases, tied LM head
  ARCH_LLAMA,  // rotary positions, RMSNorm, SwiGLU MLP, grouped-query attention, no biases
};
inline const char* model_arch_name(ModelArch a) { return a == ARCH_LLAMA ? "llama" : "gpt2"; }

struct ModelConfig {
  ModelArch arch = ARCH_GPT2;
  int n_layer = 2;
  int n_embd = 32;
  int n_head = 4;
  int vocab_size = 256;
  int max_seq_len = 64;  // gpt2: rows of the position table; llama: the longest sequence it takes
  // Llama only; gpt2 has n_kv_head = n_head, an MLP of 4 n_embd, LayerNorm eps 1e-5, a tied head.
  int n_kv_head = 0;          // key/value heads; 0 = n_head (plain multi-head attention)
  int intermediate_size = 0;  // SwiGLU width; 0 = 4 n_embd
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;
  bool tie_embeddings = true;  // LM head = token embedding; false: its own lm_head.weight

  int head_size() const { return n_embd / n_head; }
  int kv_heads() const { return n_kv_head > 0 ? n_kv_head : n_head; }
  int mlp_size() const { return intermediate_size > 0 ? intermediate_size : 4 * n_embd; }
  // Width of the fused q|k|v projection's output: query heads plus key and value heads.
  int qkv_size() const { return (n_head + 2 * kv_heads()) * head_size(); }
  bool tied() const { return arch == ARCH_GPT2 || tie_embeddings; }
};

}  // namespace shardtrain
