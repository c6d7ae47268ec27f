// See format.hpp.
#include "core/format.hpp"

#include "core/error.hpp"

namespace shardtrain {

std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  while (bytes >= 1024 && u < 6) bytes /= 1024, u++;
  return strprintf(u == 0 ? "%.0f %s" : "%.1f %s", bytes, units[u]);
}

}  // namespace shardtrain
