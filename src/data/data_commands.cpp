// See data_commands.hpp.
#include "data/data_commands.hpp"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

#include "core/error.hpp"
#include "data/synth.hpp"
#include "data/token_file.hpp"

namespace shardtrain {
namespace {

std::vector<uint16_t> bytes_to_tokens(const std::string& bytes) {
  std::vector<uint16_t> tokens(bytes.size());
  for (size_t i = 0; i < bytes.size(); i++) tokens[i] = static_cast<unsigned char>(bytes[i]);
  return tokens;
}

void write_and_report(const std::string& path, const std::string& bytes) {
  write_token_file(path, bytes_to_tokens(bytes));
  std::printf("wrote %s (%zu tokens, vocab 256)\n", path.c_str(), bytes.size());
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

void data_synth(const std::string& out_dir, uint64_t seed, size_t train_bytes, size_t val_bytes) {
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec) throw UsageError("cannot create --out-dir '" + out_dir + "': " + ec.message());
  write_and_report(out_dir + "/synth_train.bin", synth_corpus(seed, train_bytes));
  write_and_report(out_dir + "/synth_val.bin", synth_corpus(seed + 1000003, val_bytes));
}

std::string val_path_for(const std::string& out_path) {
  if (ends_with(out_path, "_train.bin")) return out_path.substr(0, out_path.size() - 10) + "_val.bin";
  if (ends_with(out_path, ".bin")) return out_path.substr(0, out_path.size() - 4) + "_val.bin";
  return out_path + "_val.bin";
}

void data_encode(const std::string& text_path, const std::string& out_path, double val_fraction) {
  if (val_fraction < 0 || val_fraction >= 1) throw UsageError("--val-fraction must be in [0, 1)");
  std::ifstream in(text_path, std::ios::binary);
  if (!in) throw UsageError("cannot read --input '" + text_path + "' (check the path)");
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (bytes.empty()) throw DataError("--input '" + text_path + "' is empty: nothing to encode");
  const size_t val_bytes = static_cast<size_t>(bytes.size() * val_fraction);
  write_and_report(out_path, bytes.substr(0, bytes.size() - val_bytes));
  if (val_bytes > 0) write_and_report(val_path_for(out_path), bytes.substr(bytes.size() - val_bytes));
}

}  // namespace shardtrain
