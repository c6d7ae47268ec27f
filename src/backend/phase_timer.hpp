// Where a training step's time goes: forward, backward, the gradients' reduction and the optimizer,
// as the compute device saw it. On a GPU each boundary is a timing event on the compute stream (the
// host runs ahead, so host clocks would time the launches, not the work); on the host, where work
// runs in program order, a clock read. The spans are read after the step's one wait, when every
// event has been reached, so timing adds no host synchronization. Each span holds what the device
// did between two boundaries, waits included: a forward that waits for a gathered unit counts
// that wait as forward.
#pragma once

#include <array>
#include <vector>

#include "backend/device.hpp"
#include "core/clock.hpp"

namespace shardtrain {

enum StepPhase { PHASE_FORWARD, PHASE_BACKWARD, PHASE_GRAD_SYNC, PHASE_OPTIMIZER, PHASE_COUNT };
inline const char* step_phase_name(StepPhase phase) {
  static const char* const names[PHASE_COUNT] = {"forward", "backward", "grad_sync", "optimizer"};
  return names[phase];
}

class PhaseTimer {
 public:
  explicit PhaseTimer(Device& device) : device_(device) {}
  ~PhaseTimer() {
    for (DeviceEvent* event : events_) device_.destroy_event(event);
  }
  PhaseTimer(const PhaseTimer&) = delete;
  PhaseTimer& operator=(const PhaseTimer&) = delete;

  // The step starts here; the spans of the last step are forgotten.
  void begin_step() {
    phases_.clear();
    boundary(PHASE_COUNT);
  }
  // The work queued since the previous boundary belongs to `phase` (added to it: micro-batches).
  void end(StepPhase phase) {
    if (!phases_.empty()) boundary(phase);
  }
  // Seconds per phase since begin_step; every event recorded must have been reached (the step's
  // wait) -- a GPU's elapsed time of an unreached event would wait for it.
  std::array<double, PHASE_COUNT> seconds() const {
    std::array<double, PHASE_COUNT> spans{};
    for (size_t i = 1; i < phases_.size(); i++)
      spans[phases_[i]] += device_.is_host() ? host_times_[i] - host_times_[i - 1]
                                             : device_.elapsed_seconds(events_[i - 1], events_[i]);
    return spans;
  }

 private:
  void boundary(int phase) {
    const size_t i = phases_.size();
    phases_.push_back(phase);
    if (device_.is_host()) {
      host_times_.resize(i + 1);
      host_times_[i] = now_seconds();
      return;
    }
    if (i == events_.size()) events_.push_back(device_.create_timing_event());  // kept for later steps
    device_.record(events_[i], device_.compute_stream());
  }

  Device& device_;
  std::vector<int> phases_;  // per boundary: the phase of the span it ends (the first ends none)
  std::vector<double> host_times_;
  std::vector<DeviceEvent*> events_;
};

}  // namespace shardtrain
