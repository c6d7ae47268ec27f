// The Qwen3 family (dense Qwen3 decoders; transformers' Qwen3ForCausalLM): Llama's block with an
// RMSNorm over each query and key head (q_norm, k_norm: one weight of head_dim each, applied
// before the rotary turn), heads of 128 unless config.json says otherwise, tied embeddings at the
// small sizes coming from config.json. Built on the Llama family's descriptor and model.
#pragma once

#include "model/family.hpp"

namespace shardtrain {

const ModelFamily& qwen3_family();

}  // namespace shardtrain
