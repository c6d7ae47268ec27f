// `shardtrain export --format hf`: a shardtrain checkpoint (either layout) as a Hugging Face folder
// -- config.json and model.safetensors -- that the transformers library loads: GPT2LMHeadModel or
// LlamaForCausalLM, after the checkpoint's architecture.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/dtype.hpp"
#include "ckpt/checkpoint_io.hpp"
#include "ckpt/hf_model.hpp"
#include "comm/runtime.hpp"

namespace shardtrain {

// Collective. The ranks share the parameters round-robin; each reads its parameters from the
// checkpoint and writes their bytes into files laid out identically by all, which rank 0 then
// renames into place (a reader never sees a partial file). Above `max_file_bytes` (0 = no limit)
// the weights are split into several files with an index. Throws InputError, agreed.
// A checkpoint with adapters needs `merge`: each adapted weight is exported as PEFT's merge makes
// it (merge_and_unload), computed on the host in double: LoRA W + (alpha / rank) B A, DoRA that
// rescaled per row to its magnitude, LoHa and LoKr W + dW, OFT W blockdiag(R)^T
// (model/delta_adapters.hpp).
// `quant` (export --quantize): the blocks' linear weights as bitsandbytes 4-bit tensors, with
// config.json's quantization_config, as transformers saves a model loaded in 4 bits (a family
// whose linear weights are all nn.Linear: ModelFamily::hf_bnb_4bit); the rest in `dtype`.
void export_hf_folder(const Runtime& rt, const std::string& checkpoint, const std::string& out_dir, DType dtype,
                      uint64_t max_file_bytes, bool merge = false, const HfQuantizedExport& quant = {});

using SafetensorsWriters = std::vector<std::unique_ptr<SafetensorsWriter>>;

// Collective. Writes the Hugging Face folder of `model` laid out as `plan` (hf_export_plan):
// rank 0 creates it whole as <out_dir>.partial with the plan's files at their full size (disk space
// reserved); every rank opens them and write_tensors(writers) writes its own ranges; after all have
// synced, rank 0 writes the index (several files) and config.json, keeps the other files of an
// existing out_dir (a tokenizer), and commits the folder by one rename or atomic exchange, so a
// reader (or a kill) never sees files of two models. Throws InputError, agreed; the partial folder
// is removed. `tokenizer` (the run's data.tokenizer, "" = none) goes with the model: its
// tokenizer.json (and the tokenizer_config.json and special_tokens_map.json beside it, else a
// tokenizer_config.json for transformers' PreTrainedTokenizerFast), its end-of-text ids in
// config.json and generation_config.json (every id generate stops at), so that AutoTokenizer loads
// the folder and transformers' generate stops where ours does. A recorded tokenizer that is gone
// is a warning, not an error.
void write_hf_folder(const Runtime& rt, const ModelConfig& model, const std::string& out_dir, DType dtype,
                     const HfExportPlan& plan, const std::function<void(SafetensorsWriters&)>& write_tensors,
                     const std::string& tokenizer = "");
// Collective. The same for a model's single file (single_file_export_plan): written whole as
// <path>.partial, committed by one rename.
void write_model_file(const Runtime& rt, const std::string& path, const HfExportPlan& plan,
                      const std::function<void(SafetensorsWriters&)>& write_tensors);

// The run's data.tokenizer as a checkpoint records it ("" = none).
std::string recorded_tokenizer(const CheckpointState& state);

// Collective. `shardtrain export --adapter`: the checkpoint's adapters as a PEFT folder
// (adapter_config.json, adapter_model.safetensors; ckpt/peft.hpp), written by rank 0 through
// temporary names renamed into place. Throws InputError, agreed; UsageError for LoHa, LoKr or OFT
// on GPT-2, which PEFT 0.21.2 cannot load (it applies them to no transformers Conv1D layer).
void export_peft_folder(const Runtime& rt, const std::string& checkpoint, const std::string& out_dir, DType dtype);

}  // namespace shardtrain
