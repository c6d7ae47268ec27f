// Memory accounting by category. Every long-lived buffer of the engine, optimizer and model is
// registered here with its byte count, so a rank knows its current and peak use per category
// (printed in the start summary and written per step to the metrics file).
#pragma once

#include <array>
#include <cstddef>

namespace shardtrain {

enum MemCategory {
  MEM_SHARDED_PARAMS,
  MEM_GATHERED_UNITS,
  MEM_GRADIENTS,
  MEM_OPTIMIZER_STATE,
  MEM_ACTIVATIONS,
  MEM_COMM_BUFFERS,
  MEM_WORKSPACE,
  MEM_CATEGORY_COUNT,
};

// One planned device allocation: its category and bytes (the planner's lists, and the allocator's
// rounding of each). `mapped`: the backed head of a gathered fp32 buffer whose quantized tail has
// no memory (Device::allocate_backed_prefix), which CUDA maps in the driver's granularity rather
// than taking from the caching allocator.
struct PlannedAllocation {
  MemCategory category;
  size_t bytes;
  bool mapped = false;
};

inline const char* mem_category_name(MemCategory c) {
  static const char* names[MEM_CATEGORY_COUNT] = {"sharded_params", "gathered_units", "gradients", "optimizer_state",
                                                  "activations",    "comm_buffers",   "workspace"};
  return names[c];
}

class MemoryTracker {
 public:
  void add(MemCategory c, size_t bytes) {
    current_[c] += bytes;
    if (current_[c] > peak_[c]) peak_[c] = current_[c];
    size_t total = total_current();
    if (total > peak_total_) peak_total_ = total;
  }
  void sub(MemCategory c, size_t bytes) { current_[c] -= bytes; }
  size_t current(MemCategory c) const { return current_[c]; }
  size_t peak(MemCategory c) const { return peak_[c]; }
  size_t total_current() const {
    size_t t = 0;
    for (size_t b : current_) t += b;
    return t;
  }
  size_t total_peak() const { return peak_total_; }

 private:
  std::array<size_t, MEM_CATEGORY_COUNT> current_{}, peak_{};
  size_t peak_total_ = 0;
};

}  // namespace shardtrain
