// The Qwen2 family (Qwen2 and Qwen2.5 decoders; transformers' Qwen2ForCausalLM): Llama's block
// with biases on q_proj, k_proj and v_proj, rope_theta 1e6 and tied embeddings at the small sizes
// coming from config.json. Built on the Llama family's descriptor and model.
#pragma once

#include "model/family.hpp"

namespace shardtrain {

const ModelFamily& qwen2_family();

}  // namespace shardtrain
