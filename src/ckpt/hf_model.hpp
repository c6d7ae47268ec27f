// Hugging Face model folders (config.json + model.safetensors, or shards listed by
// model.safetensors.index.json) to and from our parameters.
//
// Each model family names its tensors and reads and writes its config.json (model/family.hpp,
// model/families/): GPT-2's Conv1D weights are stored transposed, Llama's and Qwen2's are not.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backend/dtype.hpp"
#include "backend/quant.hpp"
#include "ckpt/safetensors.hpp"
#include "model/config.hpp"
#include "shard/fsdp_engine.hpp"

namespace shardtrain {

// Whether `path` is a Hugging Face model: a folder holding a config.json, or a model's single
// .safetensors file in its authors' layout (ModelFamily::reads_single_file: Black Forest Labs'
// FLUX.1 files), which the functions below read as they read a folder.
bool is_hf_model(const std::string& path);

// The model config.json describes (architecture and shape). Throws CheckpointError naming the file
// and the key for what ShardTrain does not implement (another model_type; gpt2: activation_function
// not gelu_new, an untied head, n_inner not 4 x n_embd, layer_norm_epsilon not 1e-5, ...; llama:
// rope_scaling other than linear, dynamic, llama3 and yarn, attention or MLP biases, hidden_act
// not silu, a sliding window, ...) or a malformed file. A single file's config comes from its
// tensors' shapes.
ModelConfig read_hf_model_config(const std::string& path);

// Our parameter's Hugging Face tensor (ModelFamily::hf_tensor of the config's family).
HfTensor hf_tensor_of(const ModelConfig& config, const ParamInfo& param);

// Fills this rank's parameter shards from a Hugging Face folder, reading only the elements of its
// own shards (byte ranges of the safetensors files) straight into them (a transposed weight through
// a bounded buffer; shards on a GPU through a host copy of a unit's). Every tensor must be present with its shape
// and a floating-point dtype (F32, BF16, F16); nothing unexpected may be left over. Throws
// CheckpointError naming the file and the tensor: call it under Runtime::agree_on.
void load_hf_shards(const std::string& path, FsdpEngine& engine);

// The tokenizer's ids transformers reads from config.json and generation_config.json: the end of
// a text (several: every id generate stops at) and, where the tokenizer has one, the beginning.
struct HfSpecialIds {
  std::vector<uint32_t> eos;
  std::optional<uint32_t> bos;
};

// config.json for a model of this shape: GPT2LMHeadModel (tied head) or LlamaForCausalLM; with
// `ids` (a tokenizer goes with the model) its bos_token_id and eos_token_id (the first end).
std::string hf_config_json(const ModelConfig& model, DType dtype, const HfSpecialIds* ids = nullptr);

// The files of an exported model: every parameter in table order, in `dtype`, with the metadata
// Hugging Face requires ("format": "pt"). One model.safetensors when the tensors fit in
// `max_file_bytes` (0 = no limit), else model-0000k-of-0000n.safetensors, each holding whole
// tensors up to the limit (a larger tensor gets a file of its own), plus the index.
struct HfExportFile {
  std::string name;
  SafetensorsLayout layout;
};
// `export --quantize`: the blocks' linear weights stored as bitsandbytes 4-bit tensors
// (ckpt/bnb_tensor.hpp), as transformers' save_pretrained writes a model loaded with
// BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=type, bnb_4bit_use_double_quant=...).
struct HfQuantizedExport {
  QuantType type = QUANT_NONE;  // none: every weight in the export's dtype
  size_t block = 64;
  bool double_quant = false;
};

struct HfExportPlan {
  std::vector<HfExportFile> files;
  std::vector<std::pair<size_t, size_t>> where;  // by parameter id: (file, entry in the file)
  // by parameter id: a bitsandbytes 4-bit weight's entries in its file -- the packed codes (where's),
  // absmax, quant_map, (nested_absmax, nested_quant_map,) quant_state -- or empty. Each file lists
  // its 4-byte entries first, then the 2-byte, then the bytes, as safetensors' own writer orders
  // them, so that every tensor starts aligned to its element.
  std::vector<std::vector<size_t>> quantized;
  HfQuantizedExport quant;
  // config.json's quantization_config (JSON text), "" for none
  std::string quantization_config;
  // by parameter id: its rows as pieces of the entry's (HfTensor::rows; a single file's fused
  // tensors), empty where it is the whole entry
  std::vector<std::vector<std::pair<int64_t, int64_t>>> rows;
  uint64_t tensor_bytes = 0;                     // the index's metadata.total_size
  std::string index_name;                        // <weights>.safetensors.index.json (ModelFamily::hf_weights)
  // The index's text, or "" for one file.
  std::string index_json() const;
  // The tensors of all files (a 4-bit weight is several).
  size_t tensor_count() const {
    size_t n = 0;
    for (const HfExportFile& f : files) n += f.layout.entries().size();
    return n;
  }
  // The file a reader opens first: the one weight file, or the index.
  const std::string& entry_name() const { return files.size() == 1 ? files[0].name : index_name; }
};
HfExportPlan hf_export_plan(const ParamTable& table, DType dtype, uint64_t max_file_bytes,
                            const HfQuantizedExport& quant = {});
// The family's single file (ModelFamily::single_file_tensor: Black Forest Labs' FLUX.1 layout),
// `name`: one entry per stored tensor, several parameters writing their rows of a fused one.
HfExportPlan single_file_export_plan(const ParamTable& table, DType dtype, const std::string& name);
// Writes the part of this rank's parameter shards that it owns (one rank among replicas, padding
// left out) into the files of `plan`, opened in `writers` (one per file): every element of the
// model is written by exactly one rank. A transposed weight goes through a bounded buffer (16 MiB),
// a run per row of the file; nothing else is copied (shards on a GPU: one host copy of a unit's).
void write_hf_shards(FsdpEngine& engine, const HfExportPlan& plan,
                     std::vector<std::unique_ptr<SafetensorsWriter>>& writers);
// Our parameter's values (row-major, ours) in the file's order (the transposed ones transposed).
std::vector<float> to_hf_order(const ModelConfig& config, const ParamInfo& param, const std::vector<float>& values);

}  // namespace shardtrain
