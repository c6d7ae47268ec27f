// The machine-readable record of a run: JSON Lines written by rank 0 to train.metrics_file, one
// object per optimizer step ("kind":"step") and per evaluation ("kind":"eval"); see docs/monitoring.md.
// The file is opened once and flushed per line, so a killed run leaves whole lines only.
#pragma once

#include <cstdio>
#include <string>

namespace shardtrain {

class MetricsWriter {
 public:
  // Opens `path` when non-empty and `enabled` (rank 0); otherwise writes nothing. A fresh run
  // (resume_step < 0) truncates the file; a resumed one keeps the records up to resume_step and
  // appends after them, so the file reads as one run.
  MetricsWriter(const std::string& path, bool enabled, long resume_step);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  // Writes and flushes one record; a failed write (a full disk) is remembered for check().
  void write_line(const std::string& json_object);
  // Throws InputError naming the file and the OS error when a write has failed.
  void check() const;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
  std::string error_;
};

}  // namespace shardtrain
