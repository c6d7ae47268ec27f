// The bodies of `shardtrain data synth` and `shardtrain data encode`: byte-level token files
// (token = byte value, model.vocab_size 256) from the built-in corpus or from any file.
#pragma once

#include <cstdint>
#include <string>

namespace shardtrain {

// Writes out_dir/synth_train.bin and out_dir/synth_val.bin (different seeds), creating out_dir.
void data_synth(const std::string& out_dir, uint64_t seed, size_t train_bytes, size_t val_bytes);

// Encodes text_path byte by byte into out_path; when val_fraction > 0 the last fraction of the
// bytes goes to a validation file named after out_path: "x_train.bin" -> "x_val.bin", otherwise
// "x.bin" -> "x_val.bin".
void data_encode(const std::string& text_path, const std::string& out_path, double val_fraction);

// The validation file name data_encode derives from out_path.
std::string val_path_for(const std::string& out_path);

}  // namespace shardtrain
