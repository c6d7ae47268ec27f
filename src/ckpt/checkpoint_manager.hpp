// The checkpoint folder: atomic commit, the `latest` pointer, retention, and the list of
// candidates for `checkpoint.resume = auto`.
//
// A save writes ckpt-<step>.h5.tmp collectively; only after every rank has finished and the file
// is flushed and closed does rank 0 fsync it, rename it to ckpt-<step>.h5, fsync the folder, and
// replace `latest` (tmp + rename). Older checkpoints are removed only after that, keeping
// checkpoint.keep. A failed save leaves every earlier checkpoint untouched.
#pragma once

#include <string>
#include <vector>

#include "ckpt/checkpoint_io.hpp"
#include "comm/comm.hpp"
#include "comm/runtime.hpp"

namespace shardtrain {

class CheckpointManager {
 public:
  CheckpointManager(const Runtime& rt, Comm& comm, std::string dir, int keep);

  const std::string& dir() const { return dir_; }
  // Collective. Returns the committed path. Throws InputError (agreed by all ranks) on failure.
  std::string save(const CheckpointState& state, FsdpEngine& engine, AdamW& optimizer);
  // Collective. Complete checkpoints in the folder, newest first (`latest`'s target leads).
  std::vector<std::string> candidates();

  static std::string file_name(int64_t step);

 private:
  const Runtime& rt_;
  Comm& comm_;
  std::string dir_;
  int keep_;
};

}  // namespace shardtrain
