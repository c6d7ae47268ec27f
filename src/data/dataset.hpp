// data.train_file / data.val_file: one token file, or several (shards) read as one stream of
// windows. The option's value is a comma-separated list of entries, each a path or a glob(3)
// pattern (an entry holding *, ? or [), a pattern's matches taken in byte order of their paths.
//
// Window numbering: file after file in the listed order, and within a file by position. A file of
// n tokens holds (n - 1) / seq_len windows, window i covering tokens [i * seq_len, i * seq_len +
// seq_len] (inputs and targets shifted by one), so a window never crosses from one file into the
// next; a file shorter than seq_len + 1 tokens holds none and is skipped. The sampler
// (sampler.hpp) permutes the stream's window numbers; one file gives the windows it always had.
//
// This layer knows nothing about MPI: callers agree on the outcome across ranks.
#pragma once

#include "data/data_source.hpp"

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "data/token_file.hpp"

namespace shardtrain {

// The files `value` names, in stream order (see above); entries are trimmed of blanks and a file
// may be named twice (its windows then come twice). Throws DataError naming `option` for an empty
// list or entry, a pattern that matches no file, and a path holding a newline.
std::vector<std::string> expand_data_files(const std::string& option, const std::string& value);

class TokenDataset final : public DataSource {
 public:
  // Expands `value` (expand_data_files) and opens every file; throws DataError naming the first
  // that fails. Holding too few windows is not an error here: see require_windows.
  TokenDataset(const std::string& option, const std::string& value, int seq_len);

  const std::vector<TokenFile>& files() const { return files_; }
  int seq_len() const { return seq_len_; }
  size_t num_tokens() const;  // in all the files, skipped ones included
  uint64_t windows() const { return first_window_.back(); }
  // The file and the first token of window `window` (< windows()).
  std::pair<size_t, size_t> locate(uint64_t window) const;
  // Copies seq_len inputs and the seq_len targets (shifted by one) of the window, as int; a target
  // the file's loss mask leaves out is IGNORED_TARGET.
  void fill(uint64_t window, int* inputs, int* targets) const;

  // As a DataSource (data_source.hpp): a record is a window; a micro-batch holds B x T "tokens"
  // and "targets" (model/batch.hpp), nothing drawn at random.
  uint64_t records() const override { return windows(); }
  void begin(Batch& batch, int rows) const override;
  void fill(Batch& batch, int row, uint64_t record, uint64_t sample, bool validation) const override;
  bool masks_targets() const override;
  uint64_t trained_targets(uint64_t window) const override;

  // "" or one line naming the files that hold no window (shorter than seq_len + 1 tokens).
  std::string skipped_warning() const override;
  // Throws DataError unless the data hold at least `needed` windows; `purpose` says for what
  // ("one batch of train.global_batch=24 sequences"), `fix` what to change.
  void require_windows(uint64_t needed, const std::string& purpose, const std::string& fix) const;
  void require_records(uint64_t needed, const std::string& purpose, const std::string& fix) const override {
    require_windows(needed, purpose, fix);
  }
  // check_token_range on part `part` of `num_parts` of every file that holds a window: "" or the
  // first problem. check() is this against the vocabulary set_vocab_size gave.
  std::string check_tokens(int vocab_size, int part, int num_parts) const;
  std::string check(int part, int num_parts) const override;
  void set_vocab_size(int vocab_size) { vocab_size_ = vocab_size; }
  // Packed documents (data.documents): a micro-batch then holds BATCH_DOC_STARTS, each position's
  // document starting at the last occurrence of `token` at or before it in the window (or at the
  // window's start), so that attention stays within a document; with `restart_positions` also
  // BATCH_POSITIONS, each position counted from its document's start. -1: off.
  void set_document_start(int64_t token, bool restart_positions = false) {
    document_start_ = token, restart_positions_ = restart_positions;
  }
  // What a checkpoint records of the data: one line "<bytes> <path>" per file, in stream order.
  std::string identity() const override;
  // For the start-up line: "path (N tokens)", or "K files of 'value' (N tokens, W windows)".
  std::string describe() const override;

 private:
  std::string option_, value_;
  int seq_len_;
  int vocab_size_ = 0;
  int64_t document_start_ = -1;
  bool restart_positions_ = false;
  std::vector<TokenFile> files_;
  std::vector<uint64_t> first_window_;  // file f's windows are [first_window_[f], first_window_[f + 1])
};

// "" when two identities (TokenDataset::identity) list the same file names (the last path
// component: a folder may move) with the same sizes in the same order; else the first difference,
// e.g. "file 2 of 3 was 'b.bin' (2048 bytes), now 'c.bin' (2048 bytes)".
std::string dataset_difference(const std::string& recorded, const std::string& current);

}  // namespace shardtrain
