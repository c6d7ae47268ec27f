// Hugging Face PEFT adapter folders (peft 0.21.2): adapter_config.json and adapter_model.safetensors,
// read into and written from the adapters of a ParamTable (model/adapter.hpp). PEFT's tensor names
// are "base_model.model.<Hugging Face module path>.lora_A.weight" and ".lora_B.weight", in
// nn.Linear's layout -- also for GPT-2's Conv1D layers, for which the config says fan_in_fan_out.
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
std::vector<PeftTensor> peft_tensors(const ParamTable& table);

// adapter_config.json of the table's adapters.
std::string peft_adapter_config_json(const ParamTable& table);

// DoRA: each magnitude set to the row norms of the base weight it adapts (PEFT's initialisation,
// ||W + s B A|| with B = 0), once the base is in place. Collective over `world` (every rank, host
// memory): each rank sums the squares of the weight elements it owns, row by row, and one
// all-reduce per block completes the norms -- no weight is gathered.
void init_dora_magnitudes(FsdpEngine& engine, Comm& world);

// Fills this rank's shards of the adapter parameters from a PEFT folder, reading only its own
// elements. The folder's adapter must be the configured one (type, rank, alpha, the same layers):
// throws CheckpointError (UsageError for a mismatch of settings) naming the file and the key or
// tensor; call it under Runtime::agree_on.
void load_peft_adapter(const std::string& folder, FsdpEngine& engine);

}  // namespace shardtrain
