// Seconds on a monotonic clock: step, save and run times, the watchdog's deadlines, host-side
// timing of ops and phases.
#pragma once

#include <chrono>

namespace shardtrain {

inline double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace shardtrain
