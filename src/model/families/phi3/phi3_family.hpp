// The Phi-3 family (Phi-3 and Phi-4 decoders; transformers' Phi3ForCausalLM): Llama's block, whose
// Hugging Face files fuse q_proj, k_proj and v_proj into one qkv_proj and gate_proj and up_proj into
// one gate_up_proj (the halves: gate, then up), with Phi3Config's keys and defaults and an optional
// sliding window over every layer. LongRoPE scaling and a partial rotary factor (Phi-3.5, Phi-4-mini)
// are refused. Built on the Llama family's descriptor and model.
#pragma once

#include "model/family.hpp"

namespace shardtrain {

const ModelFamily& phi3_family();

}  // namespace shardtrain
