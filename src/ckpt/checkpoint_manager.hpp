// The checkpoint folder: atomic commit, the `latest` pointer, retention, and the list of
// candidates for `checkpoint.resume = auto`.
//
// A save writes ckpt-<step>.h5.tmp collectively; only after every rank has finished and the file
// is flushed and closed does rank 0 fsync it, rename it to ckpt-<step>.h5, fsync the folder, and
// replace `latest` (tmp + rename). Older checkpoints are removed only after that, keeping
// checkpoint.keep and the one `best` names (checkpoint.keep_best: "<file> <validation loss>").
// A failed save leaves every earlier checkpoint untouched.
#pragma once

#include <string>
#include <vector>

#include "ckpt/checkpoint_io.hpp"
#include "comm/comm.hpp"
#include "comm/runtime.hpp"

namespace shardtrain {

class CheckpointManager {
 public:
  // `comm`: all ranks, on host memory. `watchdog` (may be null) times HDF5's collective calls.
  CheckpointManager(const Runtime& rt, Comm& comm, std::string dir, int keep, Watchdog* watchdog = nullptr);

  const std::string& dir() const { return dir_; }
  // Collective. Throws InputError (agreed) when checkpoint.dir cannot be a folder: it, or a
  // folder above it, is a file. Call before training starts (candidates() calls it too).
  void check_dir();
  // Collective. Returns the committed path. Throws InputError (agreed by all ranks) on failure.
  std::string save(const CheckpointState& state, FsdpEngine& engine, AdamW& optimizer);
  // Collective. load_checkpoint of `path` over this manager's ranks.
  CheckpointState load(const std::string& path, FsdpEngine& engine, AdamW& optimizer, bool base_model_ok = false);
  // Collective. The parameters alone (load_checkpoint_weights), for an engine without an optimizer:
  // generate and the distillation teacher hold no moments.
  CheckpointState load_weights(const std::string& path, FsdpEngine& engine, bool base_model_ok = false);
  // Collective. Complete checkpoints in the folder, newest first (`latest`'s target leads).
  std::vector<std::string> candidates();
  // Collective. Names the checkpoint of `step` (saved) in `best` with its validation loss; retention
  // keeps it beside the `keep` newest from then on, and drops the one it names no more. Throws
  // InputError (agreed) when `best` cannot be written.
  void mark_best(int64_t step, double val_loss);
  // The validation loss `best` records (its checkpoint still there), or +inf. Rank 0's view: call
  // on every rank, the result is broadcast.
  double best_val_loss();

  static std::string file_name(int64_t step);
  // Writes `text` to `path` and fsyncs it; "" or why it failed (disk full, ...). For small files
  // that others rely on: `latest`, and the trainer's STOPPED marker.
  static std::string write_file_synced(const std::string& path, const std::string& text);
  // fsync of a file or folder (after a rename, the folder); "" or why it failed.
  static std::string fsync_path(const std::string& path);
  // Commits a written file under its name: fsync `tmp`, rename it to `final_path`, fsync the folder
  // `dir` holding both. A crash at any point leaves either no file or the complete one. "" or why
  // it failed (`tmp` is left in place then).
  static std::string commit_synced(const std::string& tmp, const std::string& final_path, const std::string& dir);

 private:
  CheckpointComm ranks() const { return CheckpointComm{comm_, rt_.world_comm(), watchdog_}; }
  // Rank 0: removes the complete checkpoints beyond the `keep` newest, older than `newest_step`,
  // except the one `best` names.
  void prune(int64_t newest_step);
  // Rank 0: the file `best` names ("" when none) and its validation loss.
  std::pair<std::string, double> read_best() const;

  const Runtime& rt_;
  Comm& comm_;
  std::string dir_;
  int keep_;
  Watchdog* watchdog_;
};

}  // namespace shardtrain
