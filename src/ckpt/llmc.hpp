// Weights to and from llm.c's GPT-2 checkpoint format (train_gpt2.c): a header of 256 int32
// (magic 20240326, version 3 = fp32, max_seq_len, vocab_size, n_layer, n_head, n_embd,
// padded_vocab_size) followed by the fp32 tensors in llm.c's order -- wte (Vp,C), wpe, then each
// block tensor stacked over layers (ln1w (L,C), ln1b, qkvw (L,3C,C), ..., fcprojb (L,C)), then
// lnfw, lnfb. Shapes are the same as ours (linear weights (out, in)); only the order differs.
#pragma once

#include <string>

#include "shard/fsdp_engine.hpp"

namespace shardtrain {

constexpr int LLMC_MAGIC = 20240326;
constexpr int LLMC_VERSION_FP32 = 3;

// Writes the weights of a shardtrain checkpoint (either layout) as an llm.c fp32 checkpoint,
// after validating it as training would (CheckpointReader). Serial; reads one parameter at a
// time. Throws CheckpointError / UsageError.
void export_llmc(const std::string& checkpoint_path, const std::string& out_path);

// Fills this rank's parameter shards from an llm.c checkpoint, reading only its own slices.
// Throws CheckpointError naming the file (bad header, other model shape, short file) and, for a
// NaN or infinite weight in this rank's slices, the tensor: call it under Runtime::agree_on.
void load_llmc_shards(const std::string& path, FsdpEngine& engine);

// Element offset of the parameter's first element in the llm.c tensor area.
size_t llmc_element_offset(const ParamTable& table, const ParamInfo& param);
int llmc_padded_vocab(int vocab_size);

}  // namespace shardtrain
