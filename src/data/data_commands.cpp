// `data synth` and `data encode`: turn bytes into uint16 tokens one for one and write them with
// write_token_file (atomic rename). Input problems are found before anything is written, so a
// failed command leaves no half-made output behind.
#include "data/data_commands.hpp"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <system_error>
#include <vector>

#include "core/error.hpp"
#include "data/synth.hpp"
#include "data/token_file.hpp"

namespace shardtrain {

namespace {

std::vector<uint16_t> bytes_to_tokens(const std::string& bytes, size_t begin, size_t end) {
  std::vector<uint16_t> tokens(end - begin);
  for (size_t i = begin; i < end; i++) tokens[i - begin] = static_cast<unsigned char>(bytes[i]);
  return tokens;
}

void write_and_report(const std::string& path, const std::vector<uint16_t>& tokens) {
  write_token_file(path, tokens);
  std::printf("wrote %s: %zu token%s (byte-level, vocab 256)\n", path.c_str(), tokens.size(),
              tokens.size() == 1 ? "" : "s");
  std::fflush(stdout);
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string read_whole_file(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec))
    throw DataError(strprintf("input file '%s': does not exist; check the --input path", path.c_str()));
  if (!std::filesystem::is_regular_file(path, ec))
    throw DataError(strprintf("input file '%s': not a regular file; give a text file to encode", path.c_str()));
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw DataError(strprintf("input file '%s': cannot open (%s); check its permissions", path.c_str(),
                              std::strerror(errno)));
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw DataError(strprintf("input file '%s': read error", path.c_str()));
  return bytes;
}

}  // namespace

void data_synth(const std::string& out_dir, uint64_t seed, size_t train_bytes, size_t val_bytes) {
  SHARD_CHECK(train_bytes >= 1 && train_bytes <= SYNTH_MAX_BYTES && val_bytes <= SYNTH_MAX_BYTES,
              "data_synth(train_bytes=%zu, val_bytes=%zu): the caller checks the bounds", train_bytes, val_bytes);
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec)
    throw DataError(strprintf("output folder '%s': cannot create (%s); choose another --out-dir", out_dir.c_str(),
                              ec.message().c_str()));
  const std::string train = synth_corpus(seed, train_bytes);
  write_and_report(out_dir + "/synth_train.bin", bytes_to_tokens(train, 0, train.size()));
  if (val_bytes > 0) {
    const std::string val = synth_corpus(~seed, val_bytes);
    write_and_report(out_dir + "/synth_val.bin", bytes_to_tokens(val, 0, val.size()));
  }
}

std::string val_path_for(const std::string& out_path) {
  if (ends_with(out_path, "_train.bin")) return out_path.substr(0, out_path.size() - 10) + "_val.bin";
  if (ends_with(out_path, ".bin")) return out_path.substr(0, out_path.size() - 4) + "_val.bin";
  return out_path + "_val.bin";
}

void data_encode(const std::string& text_path, const std::string& out_path, double val_fraction) {
  if (!(val_fraction >= 0 && val_fraction < 1))  // also rejects NaN
    throw UsageError(strprintf("--val-fraction=%g must be in [0, 1)", val_fraction));
  const std::string bytes = read_whole_file(text_path);
  if (bytes.empty()) throw DataError(strprintf("input file '%s': is empty; nothing to encode", text_path.c_str()));
  const size_t val_bytes = static_cast<size_t>(static_cast<double>(bytes.size()) * val_fraction);
  if (val_fraction > 0 && val_bytes == 0)
    throw DataError(strprintf("input file '%s': too small (%zu byte%s) for a --val-fraction=%g validation part; use "
                              "a larger file, a larger fraction, or 0 for no validation file",
                              text_path.c_str(), bytes.size(), bytes.size() == 1 ? "" : "s", val_fraction));
  const size_t train_bytes = bytes.size() - val_bytes;
  if (train_bytes == 0)  // only when rounding makes bytes * val_fraction == bytes
    throw UsageError(strprintf("--val-fraction=%g leaves no training bytes of input file '%s'", val_fraction,
                               text_path.c_str()));
  write_and_report(out_path, bytes_to_tokens(bytes, 0, train_bytes));
  if (val_bytes > 0) write_and_report(val_path_for(out_path), bytes_to_tokens(bytes, train_bytes, bytes.size()));
}

}  // namespace shardtrain
