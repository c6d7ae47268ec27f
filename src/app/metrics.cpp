// See metrics.hpp.
#include "app/metrics.hpp"

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "core/error.hpp"

namespace shardtrain {

// The "step" field of a metrics record, or -1.
static long record_step(const std::string& line) {
  size_t at = line.find("\"step\":");
  return at == std::string::npos ? -1 : std::atol(line.c_str() + at + 7);
}

MetricsWriter::MetricsWriter(const std::string& path, bool enabled, long resume_step) {
  if (path.empty() || !enabled) return;
  std::string kept;
  if (resume_step >= 0) {
    std::ifstream old(path);
    for (std::string line; std::getline(old, line);)
      // A run killed mid-write leaves a partial last line: keep whole records only.
      if (!line.empty() && line.back() == '}' && record_step(line) >= 0 && record_step(line) <= resume_step)
        kept += line + "\n";
  }
  path_ = path;
  file_ = std::fopen(path.c_str(), "w");
  if (file_ && (std::fputs(kept.c_str(), file_) < 0 || std::fflush(file_) != 0))
    throw UsageError("cannot write train.metrics_file '" + path + "': " + std::strerror(errno));
  if (!file_)
    throw UsageError("cannot write train.metrics_file '" + path + "': " + std::strerror(errno) +
                     " (check that the directory exists and is writable)");
}

MetricsWriter::~MetricsWriter() {
  if (file_) std::fclose(file_);
}

void MetricsWriter::write_line(const std::string& json_object) {
  if (!file_ || !error_.empty()) return;
  // One buffered string, flushed in one write: a kill leaves whole lines and at most one partial one.
  if (std::fputs((json_object + "\n").c_str(), file_) < 0 || std::fflush(file_) != 0)
    error_ = "cannot write train.metrics_file '" + path_ + "': " + std::strerror(errno);
}

void MetricsWriter::check() const {
  if (!error_.empty()) throw UsageError(error_);
}

}  // namespace shardtrain
