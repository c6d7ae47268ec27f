// The SmolLM3 family (transformers' SmolLM3ForCausalLM, Hugging Face's SmolLM3-3B): Llama's block
// with no rotary embeddings in some blocks (NoPE: every fourth in the released model,
// model.nope_layers), a tied head and rope_theta 5e6 coming from config.json. Built on the Llama
// family's descriptor and model.
#pragma once

#include "model/family.hpp"

namespace shardtrain {

const ModelFamily& smollm3_family();

}  // namespace shardtrain
