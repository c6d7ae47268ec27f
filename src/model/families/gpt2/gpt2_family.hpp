// The GPT-2 family (model/family.hpp): learned positions, LayerNorm with bias, a GELU MLP of 4 C,
// biases everywhere, the LM head tied to the token embedding; llm.c's parameter names, transformers'
// GPT2LMHeadModel files.
#pragma once

#include "model/family.hpp"

namespace shardtrain {

// Positions of the parameters inside a block unit (the same for every block) and the root unit.
enum Gpt2BlockParam {
  BLOCK_LN1_W, BLOCK_LN1_B, BLOCK_QKV_W, BLOCK_QKV_B, BLOCK_ATTPROJ_W, BLOCK_ATTPROJ_B,
  BLOCK_LN2_W, BLOCK_LN2_B, BLOCK_FC_W, BLOCK_FC_B, BLOCK_FCPROJ_W, BLOCK_FCPROJ_B, BLOCK_PARAM_COUNT,
};
enum Gpt2RootParam { ROOT_WTE, ROOT_WPE, ROOT_LNF_W, ROOT_LNF_B, ROOT_PARAM_COUNT };

const ModelFamily& gpt2_family();

}  // namespace shardtrain
