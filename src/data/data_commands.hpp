// The bodies of `shardtrain data synth` and `shardtrain data encode` (app/main.cpp parses their
// options and calls these on one rank). Both write byte-level token files: token = byte value,
// so the files need model.vocab_size >= 256. Errors throw DataError/UsageError naming the file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace shardtrain {

// Writes out_dir/synth_train.bin (synth_corpus(seed, train_bytes)) and out_dir/synth_val.bin
// (synth_corpus(~seed, val_bytes): a different seed, so validation text is unseen), creating
// out_dir if needed, and prints one line per file (path, tokens). val_bytes == 0 skips the val file.
// Needs train_bytes in [1, SYNTH_MAX_BYTES] and val_bytes <= SYNTH_MAX_BYTES (see synth.hpp).
void data_synth(const std::string& out_dir, uint64_t seed, size_t train_bytes, size_t val_bytes);

// Encodes every byte of text_path. With val_fraction in (0, 1) the last
// floor(bytes * val_fraction) bytes go to the validation file val_path_for(out_path) and the rest
// to out_path; with 0 everything goes to out_path. Prints one line per file written.
void data_encode(const std::string& text_path, const std::string& out_path, double val_fraction);

// The validation file named after the training file: "x_train.bin" -> "x_val.bin",
// "x.bin" -> "x_val.bin", anything else -> "x" + "_val.bin".
std::string val_path_for(const std::string& out_path);

}  // namespace shardtrain
