// See metrics.hpp.
#include "app/metrics.hpp"

#include <cerrno>
#include <cstring>

#include "core/error.hpp"

namespace shardtrain {

MetricsWriter::MetricsWriter(const std::string& path, bool enabled) {
  if (path.empty() || !enabled) return;
  file_ = std::fopen(path.c_str(), "w");
  if (!file_)
    throw UsageError("cannot write train.metrics_file '" + path + "': " + std::strerror(errno) +
                     " (check that the directory exists and is writable)");
}

MetricsWriter::~MetricsWriter() {
  if (file_) std::fclose(file_);
}

void MetricsWriter::write_line(const std::string& json_object) {
  if (!file_) return;
  std::fputs(json_object.c_str(), file_);
  std::fputc('\n', file_);
  std::fflush(file_);
}

}  // namespace shardtrain
