// `shardtrain encode-text`: a text encoder's conditioning for the captions of an HDF5 file, computed
// on N ranks by the same sharded encoder that text_encoder.source runs in a training job
// (app/text_encoder.hpp), and written as cached embeddings -- practitioners' "cache the text
// encoder outputs": the encoder is then not held while the denoiser trains. The output is the input
// file with its encoder_hidden_states and pooled_projections replaced (every other dataset and
// attribute copied), so a latent file becomes a data file and a prompts file a --prompts file.
// Each rank encodes a slice of the captions; rank 0 writes.
#pragma once

#include <string>
#include <vector>

#include "comm/runtime.hpp"

namespace shardtrain {

int run_encode_text(Runtime& rt, const std::vector<std::string>& args);

}  // namespace shardtrain
