// Where the layers' time goes, op by op (`train.op_times`): a LayerOps that times every call of
// the one it wraps and forwards it unchanged. On a GPU a call's time is the span between two timing
// events recorded around it on the compute stream (the host runs ahead; Nsight Compute slows a
// training run some 500-fold, docs/gpu.md); on the host, the clock around the call. Calls are
// grouped by name, and GEMMs by shape ("matmul_forward 256x768->2304"). The spans are read after
// the step's one wait (read_step), so timing adds no host synchronization, only the events' own
// recording. Not timed: what does not go through these ops -- the engine's collectives, the
// reductions and the optimizer (phase_timer.hpp's phases hold those).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backend/layer_ops.hpp"
#include "core/clock.hpp"

namespace shardtrain {

class OpTimer {
 public:
  explicit OpTimer(Device& device) : device_(device) {}
  ~OpTimer();
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;

  // Marks a call's start and end (its span belongs to `name`).
  void begin(const std::string& name);
  void end();
  // Adds the spans recorded since the last read to the totals (after the step's wait: every event
  // reached) and forgets them; `count` false drops them instead (a warm-up step).
  void read_step(bool count);
  struct Total {
    double seconds = 0;
    long calls = 0;
  };
  const std::map<std::string, Total>& totals() const { return totals_; }
  int steps() const { return steps_; }

 private:
  Device& device_;
  std::vector<std::string> names_;       // per recorded call
  std::vector<double> host_spans_;       // per call, on the host: end - start
  std::vector<DeviceEvent*> events_;     // on a device: two per call, kept for later steps
  size_t calls_ = 0;                     // calls recorded since the last read
  double host_start_ = 0;
  std::map<std::string, Total> totals_;
  int steps_ = 0;
};

// The wrapped ops, each call timed by `timer`. Both must outlive it.
std::unique_ptr<LayerOps<float>> make_timed_layer_ops(const LayerOps<float>& inner, OpTimer& timer);

// The totals as a table, largest first, per step: name, calls, milliseconds, share of the timed
// total; at most `rows` rows, the rest summed in one.
std::string op_time_table(const OpTimer& timer, int rows);

}  // namespace shardtrain
