// See dataset.hpp. Windows are located by a binary search over the files' first window numbers.
#include "data/dataset.hpp"

#include <glob.h>

#include <algorithm>
#include <cstdlib>
#include <sstream>

#include "core/counted.hpp"
#include "core/error.hpp"

namespace shardtrain {

namespace {

std::string trimmed(const std::string& s) {
  const size_t begin = s.find_first_not_of(" \t");
  if (begin == std::string::npos) return "";
  return s.substr(begin, s.find_last_not_of(" \t") - begin + 1);
}

// The paths a glob pattern matches, in byte order.
std::vector<std::string> glob_matches(const std::string& option, const std::string& pattern) {
  glob_t found{};
  const int rc = ::glob(pattern.c_str(), GLOB_NOSORT, nullptr, &found);
  std::vector<std::string> paths;
  if (rc == 0)
    for (size_t i = 0; i < found.gl_pathc; i++) paths.emplace_back(found.gl_pathv[i]);
  ::globfree(&found);
  if (rc == GLOB_NOSPACE) throw DataError(strprintf("%s: pattern '%s': out of memory", option.c_str(), pattern.c_str()));
  if (rc != 0 && rc != GLOB_NOMATCH)
    throw DataError(strprintf("%s: pattern '%s': cannot read a folder it names", option.c_str(), pattern.c_str()));
  if (paths.empty())
    throw DataError(strprintf("%s: pattern '%s' matches no file; check the path (a literal *, ? or [ is written \\*, "
                              "\\? or \\[)",
                              option.c_str(), pattern.c_str()));
  std::sort(paths.begin(), paths.end());  // byte order, whatever the locale
  return paths;
}

struct IdentityEntry {
  unsigned long long bytes = 0;
  std::string path;
};

std::vector<IdentityEntry> parse_identity(const std::string& identity) {
  std::vector<IdentityEntry> entries;
  std::istringstream in(identity);
  for (std::string line; std::getline(in, line);) {
    const size_t space = line.find(' ');
    IdentityEntry e;
    e.bytes = std::strtoull(line.substr(0, space).c_str(), nullptr, 10);
    e.path = space == std::string::npos ? "" : line.substr(space + 1);
    entries.push_back(std::move(e));
  }
  return entries;
}

std::string file_name(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

std::string described(const IdentityEntry& e) { return strprintf("'%s' (%llu bytes)", e.path.c_str(), e.bytes); }

}  // namespace

std::vector<std::string> expand_data_files(const std::string& option, const std::string& value) {
  std::vector<std::string> paths;
  size_t begin = 0;
  while (true) {
    const size_t comma = value.find(',', begin);
    const std::string entry = trimmed(value.substr(begin, comma == std::string::npos ? std::string::npos : comma - begin));
    if (entry.empty())
      throw DataError(strprintf("%s='%s' has an empty entry; give token files or patterns separated by commas",
                                option.c_str(), value.c_str()));
    if (entry.find_first_of("*?[") == std::string::npos) {
      paths.push_back(entry);
    } else {
      for (std::string& path : glob_matches(option, entry)) paths.push_back(std::move(path));
    }
    if (comma == std::string::npos) break;
    begin = comma + 1;
  }
  for (const std::string& path : paths)
    if (path.find('\n') != std::string::npos)
      throw DataError(strprintf("%s: the file name '%s' holds a line break; rename the file", option.c_str(),
                                path.c_str()));
  return paths;
}

TokenDataset::TokenDataset(const std::string& option, const std::string& value, int seq_len)
    : option_(option), value_(value), seq_len_(seq_len) {
  if (seq_len <= 0) throw UsageError(strprintf("train.seq_len=%d must be positive", seq_len));
  first_window_.push_back(0);
  for (const std::string& path : expand_data_files(option, value)) {
    files_.emplace_back(path);
    const size_t n = files_.back().num_tokens();
    first_window_.push_back(first_window_.back() + (n > 0 ? (n - 1) / static_cast<size_t>(seq_len) : 0));
  }
}

size_t TokenDataset::num_tokens() const {
  size_t total = 0;
  for (const TokenFile& f : files_) total += f.num_tokens();
  return total;
}

std::pair<size_t, size_t> TokenDataset::locate(uint64_t window) const {
  SHARD_CHECK(window < windows(), "window %llu of %llu", static_cast<unsigned long long>(window),
              static_cast<unsigned long long>(windows()));
  // The last file whose first window is <= window: never one without windows (its successor
  // starts at the same number).
  const size_t f = static_cast<size_t>(std::upper_bound(first_window_.begin(), first_window_.end(), window) -
                                       first_window_.begin()) - 1;
  return {f, static_cast<size_t>(window - first_window_[f]) * static_cast<size_t>(seq_len_)};
}

void TokenDataset::fill(uint64_t window, int* inputs, int* targets) const {
  const auto [f, start] = locate(window);
  files_[f].copy_tokens(start, static_cast<size_t>(seq_len_), inputs);
  files_[f].copy_tokens(start + 1, static_cast<size_t>(seq_len_), targets);
  if (files_[f].has_loss_mask())
    for (size_t t = 0; t < static_cast<size_t>(seq_len_); t++)
      if (!files_[f].trained(start + 1 + t)) targets[t] = IGNORED_TARGET;
}

bool TokenDataset::masks_targets() const {
  return std::any_of(files_.begin(), files_.end(), [](const TokenFile& f) { return f.has_loss_mask(); });
}

uint64_t TokenDataset::trained_targets(uint64_t window) const {
  const auto [f, start] = locate(window);
  uint64_t trained = 0;
  for (size_t t = 1; t <= static_cast<size_t>(seq_len_); t++) trained += files_[f].trained(start + t);
  return trained;
}

std::string TokenDataset::skipped_warning() const {
  std::string names;
  size_t skipped = 0;
  for (size_t f = 0; f < files_.size(); f++)
    if (first_window_[f + 1] == first_window_[f]) {
      names += strprintf("%s'%s' (%s)", skipped ? ", " : "", files_[f].path().c_str(),
                         counted(static_cast<long long>(files_[f].num_tokens()), "token").c_str());
      skipped++;
    }
  if (skipped == 0) return "";
  return strprintf("%s: skipping %zu of %s shorter than one window of train.seq_len=%d + 1 tokens: %s", option_.c_str(),
                   skipped, counted(static_cast<long long>(files_.size()), "file").c_str(), seq_len_, names.c_str());
}

void TokenDataset::require_windows(uint64_t needed, const std::string& purpose, const std::string& fix) const {
  if (windows() >= needed) return;
  const std::string made = strprintf("%s make %s of train.seq_len=%d (+1 target)",
                                     counted(static_cast<long long>(num_tokens()), "token").c_str(),
                                     counted(static_cast<long long>(windows()), "window").c_str(), seq_len_);
  if (files_.size() == 1)
    throw DataError(strprintf("data file '%s': %s, too short for %s (needs at least %llu tokens); %s",
                              files_[0].path().c_str(), made.c_str(), purpose.c_str(),
                              static_cast<unsigned long long>(needed) * static_cast<unsigned>(seq_len_) + 1,
                              fix.c_str()));
  throw DataError(strprintf("%s='%s': %s in %s (a window never crosses from one file into the next), too short for "
                            "%s; %s",
                            option_.c_str(), value_.c_str(), made.c_str(),
                            counted(static_cast<long long>(files_.size()), "file").c_str(), purpose.c_str(),
                            fix.c_str()));
}

std::string TokenDataset::check_tokens(int vocab_size, int part, int num_parts) const {
  for (size_t f = 0; f < files_.size(); f++) {
    if (first_window_[f + 1] == first_window_[f]) continue;  // skipped: never read
    std::string problem = check_token_range(files_[f], vocab_size, part, num_parts);
    if (!problem.empty()) return problem;
  }
  return "";
}

std::string TokenDataset::check(int part, int num_parts) const {
  SHARD_CHECK(vocab_size_ > 0, "TokenDataset::check before set_vocab_size");
  return check_tokens(vocab_size_, part, num_parts);
}

void TokenDataset::begin(Batch& batch, int rows) const {
  batch.put<int>(BATCH_TOKENS, {rows, seq_len_});
  batch.put<int>(BATCH_TARGETS, {rows, seq_len_});
  if (document_start_ >= 0) batch.put<int>(BATCH_DOC_STARTS, {rows, seq_len_});
  if (document_start_ >= 0 && restart_positions_) batch.put<int>(BATCH_POSITIONS, {rows, seq_len_});
}

void TokenDataset::fill(Batch& batch, int row, uint64_t record, uint64_t, bool) const {
  const size_t rows = static_cast<size_t>(batch.shape(BATCH_TOKENS)[0]), T = static_cast<size_t>(seq_len_);
  int* inputs = batch.at<int>(BATCH_TOKENS, rows * T) + row * T;
  fill(record, inputs, batch.at<int>(BATCH_TARGETS, rows * T) + row * T);
  if (document_start_ < 0) return;
  int* starts = batch.at<int>(BATCH_DOC_STARTS, rows * T) + row * T;
  int* positions = restart_positions_ ? batch.at<int>(BATCH_POSITIONS, rows * T) + row * T : nullptr;
  int start = 0;
  for (size_t t = 0; t < T; t++) {
    if (inputs[t] == document_start_) start = static_cast<int>(t);
    starts[t] = start;
    if (positions) positions[t] = static_cast<int>(t) - start;
  }
}

std::string TokenDataset::identity() const {
  std::string lines;
  for (const TokenFile& f : files_) lines += strprintf("%zu %s\n", f.file_bytes(), f.path().c_str());
  return lines;
}

std::string TokenDataset::describe() const {
  if (files_.size() == 1) return strprintf("%s (%zu tokens)", files_[0].path().c_str(), files_[0].num_tokens());
  return strprintf("%zu files of '%s' (%zu tokens, %llu windows)", files_.size(), value_.c_str(), num_tokens(),
                   static_cast<unsigned long long>(windows()));
}

std::string dataset_difference(const std::string& recorded, const std::string& current) {
  const std::vector<IdentityEntry> before = parse_identity(recorded), now = parse_identity(current);
  const size_t n = std::max(before.size(), now.size());
  for (size_t i = 0; i < n; i++) {
    const std::string which = strprintf("file %zu of %zu", i + 1, now.size());
    if (i >= now.size())
      return strprintf("%s was recorded, %s now", described(before[i]).c_str(),
                       counted(static_cast<long long>(now.size()), "file").c_str());
    if (i >= before.size())
      return strprintf("%s %s is new (%s recorded)", which.c_str(), described(now[i]).c_str(),
                       counted(static_cast<long long>(before.size()), "file").c_str());
    if (file_name(before[i].path) != file_name(now[i].path) || before[i].bytes != now[i].bytes)
      return strprintf("%s was %s, now %s", which.c_str(), described(before[i]).c_str(), described(now[i]).c_str());
  }
  return "";
}

}  // namespace shardtrain
