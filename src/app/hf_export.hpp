// `shardtrain export --format hf`: a shardtrain checkpoint (either layout) as a Hugging Face folder
// -- config.json and model.safetensors -- that the transformers library loads: GPT2LMHeadModel or
// LlamaForCausalLM, after the checkpoint's architecture.
#pragma once

#include <cstdint>
#include <string>

#include "backend/dtype.hpp"
#include "comm/runtime.hpp"

namespace shardtrain {

// Collective. The ranks share the parameters round-robin; each reads its parameters from the
// checkpoint and writes their bytes into files laid out identically by all, which rank 0 then
// renames into place (a reader never sees a partial file). Above `max_file_bytes` (0 = no limit)
// the weights are split into several files with an index. Throws InputError, agreed.
void export_hf_folder(const Runtime& rt, const std::string& checkpoint, const std::string& out_dir, DType dtype,
                      uint64_t max_file_bytes);

}  // namespace shardtrain
