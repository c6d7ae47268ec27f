// The built-in synthetic corpus: deterministic, learnable, English-like ASCII (every byte < 128)
// from a small probabilistic grammar — descriptions with subject-verb agreement, arithmetic in
// words and digits, counting, and little stories whose later sentences repeat earlier names and
// numbers (so in-context copying pays off). A pure function of the seed through the counter RNG
// of core/random.hpp (never std:: distributions, whose output differs between library versions).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace shardtrain {

// The largest corpus `data synth` writes: it is built in memory (about 3 bytes per token).
constexpr size_t SYNTH_MAX_BYTES = size_t{1} << 30;

// Exactly num_bytes bytes of corpus text for `seed`.
std::string synth_corpus(uint64_t seed, size_t num_bytes);

// Entropy of the generating process in nats per byte over the first num_bytes: the sum of
// -log p of every random choice made, divided by the bytes. An upper bound on the text's entropy
// rate (different choices can spell the same text), i.e. on the loss a perfect model needs.
double synth_corpus_entropy(uint64_t seed, size_t num_bytes);

}  // namespace shardtrain
