// `shardtrain generate`: text from a checkpoint (docs/generate.md). Every rank loads its shards of
// the checkpoint into an FSDP engine (any rank count), and every rank runs the same incremental
// forward -- the model's decode path with a key/value cache (model/model.hpp), the parameters
// gathered block by block as in training (FsdpEngine::decode_step). Rank 0 samples each token from
// the logits, writes its text at once (streamed; an incomplete UTF-8 character held for the next
// token) and broadcasts it with whether it ends the output (the tokenizer's end-of-text tokens, a
// --stop text). The prompt is encoded, and the output decoded, with the tokenizer the run recorded
// (data.tokenizer) or --tokenizer; bytes by default.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/runtime.hpp"

namespace shardtrain {

// How rank 0 picks a token from the logits.
struct SamplingOptions {
  double temperature = 1.0;  // 0 = greedy (the argmax, the lowest id among equals)
  int top_k = 0;             // keep the k most likely tokens; 0 = all
  double top_p = 1.0;        // keep the fewest most likely tokens whose probability reaches p; 1 = all
  uint64_t seed = 1337;
};

// The token drawn from logits[0, allowed) for draw number `draw` (0 for the first generated token,
// 1 for the next, ...): softmax(logits / temperature) cut to top_k and then to top_p, renormalised,
// sampled with counter_uniform(seed key, draw) -- a pure function of its arguments, so a seed
// gives the same text on any rank count. Candidates are ordered by logit, then by id.
int sample_token(const float* logits, int allowed, const SamplingOptions& options, uint64_t draw);

// The `generate` command: parses `args` (after the word "generate"), loads, generates, prints.
// Collective; returns the exit code. Throws InputError (agreed by every rank) on bad input.
int run_generate(Runtime& rt, const std::vector<std::string>& args);

}  // namespace shardtrain
