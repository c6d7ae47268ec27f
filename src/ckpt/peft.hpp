// Hugging Face PEFT adapter folders (peft 0.21.2): adapter_config.json and adapter_model.safetensors,
// read into and written from the adapters of a ParamTable (model/adapter.hpp). PEFT's tensor names
// are "base_model.model.<Hugging Face module path>." followed by the method's own: lora_A.weight,
// lora_B.weight (DoRA also lora_magnitude_vector), hada_w1_a ... hada_w2_b, lokr_w1 or lokr_w1_a
// and lokr_w1_b then lokr_w2 or lokr_w2_a and lokr_w2_b, oft_R.weight -- the suffixes the table's
// names carry. All in nn.Linear's layout, also for GPT-2's Conv1D layers, for which a LoRA config
// says fan_in_fan_out (PEFT 0.21.2 applies LoHa, LoKr and OFT to no Conv1D layer: no such folder
// exists for GPT-2).
#pragma once

#include <string>
#include <vector>

#include "shard/fsdp_engine.hpp"

namespace shardtrain {

// One adapter tensor of the table and its name in PEFT's files.
struct PeftTensor {
  int id;  // the parameter
  std::string name;
};
// Every adapter parameter of the table, in table order, with PEFT's name.
// `prefix`: PEFT's "base_model.model." (a PeftModel's), or diffusers' "transformer." (a pipeline's component).
std::vector<PeftTensor> peft_tensors(const ParamTable& table, const std::string& prefix = "base_model.model.");

// PEFT's peft_type of an adapter type: LORA (lora and dora), LOHA, LOKR, OFT; "" for none.
const char* peft_type_name(AdapterType type);

// adapter_config.json of the table's adapters: the keys PEFT 0.21.2 saves for the method.
// `base`: the base model's folder for base_model_name_or_path (AutoPeftModel* loads it); "" = null.
std::string peft_adapter_config_json(const ParamTable& table, const std::string& base = "");

// DoRA: each magnitude set to the row norms of the base weight it adapts (PEFT's initialisation,
// ||W + s B A|| with B = 0), once the base is in place. Collective over `world` (every rank, host
// memory): each rank sums the squares of the weight elements it owns, row by row, and one
// all-reduce per block completes the norms -- no weight is gathered.
void init_dora_magnitudes(FsdpEngine& engine, Comm& world);

// Fills this rank's shards of the adapter parameters from a PEFT folder, reading only its own
// elements. The folder's adapter must be the configured one (type, the method's settings -- rank and
// alpha, LoKr's decompositions, OFT's block size, rotation and sharing --, the same layers):
// throws CheckpointError (UsageError for a mismatch of settings) naming the file and the key or
// tensor; call it under Runtime::agree_on.
// A family whose adapters are diffusers' (ModelFamily::peft_folder false) reads a diffusers LoRA
// file instead -- `folder` itself or its pytorch_lora_weights.safetensors --, LoRA only, rank and
// alpha from its lora_adapter_metadata (else alpha = rank, as diffusers assumes); or kohya-ss's
// LoRA file (names "lora_unet_..." after the model's single-file layout, FLUX.1's Black Forest
// Labs names: a fused q|k|v's adapter read into each of q, k and v), its per-module alpha folded
// into lora_B against adapter.alpha.
void load_peft_adapter(const std::string& folder, FsdpEngine& engine);

}  // namespace shardtrain
