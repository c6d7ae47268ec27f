// The 16-bit copies bound to a LayerOps object (LayerOps::bind_half_copy): fp32 buffers whose
// values are, whenever the ops read them, exactly the widening of a 16-bit copy beside them -- the
// engine's gathered units with a 16-bit param_dtype. A GEMM that finds its weight here multiplies
// the copy instead of rounding the weight again. A handful of buffers (the root and the block
// slots of each engine), so a linear search.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "backend/dtype.hpp"

namespace shardtrain {

class HalfCopies {
 public:
  void bind(const float* values, const uint16_t* half, size_t n, DType type) {
    unbind(values);
    bindings_.push_back({address(values), half, n, type});
  }
  void unbind(const float* values) {
    const uintptr_t at = address(values);
    bindings_.erase(std::remove_if(bindings_.begin(), bindings_.end(), [at](const Binding& b) { return b.values == at; }),
                    bindings_.end());
  }
  // The copy of [p, p + n) in `type`, or null when no bound buffer of that type holds all of it.
  const uint16_t* find(const float* p, size_t n, DType type) const {
    const uintptr_t begin = address(p);
    for (const Binding& b : bindings_)
      if (b.type == type && begin >= b.values && (begin - b.values) / sizeof(float) + n <= b.n &&
          (begin - b.values) % sizeof(float) == 0)
        return b.half + (begin - b.values) / sizeof(float);
    return nullptr;
  }
  bool empty() const { return bindings_.empty(); }

 private:
  // Addresses as integers: buffers of different allocations are compared, which pointer
  // comparison leaves unspecified.
  static uintptr_t address(const float* p) { return reinterpret_cast<uintptr_t>(p); }
  struct Binding {
    uintptr_t values;
    const uint16_t* half;
    size_t n;
    DType type;
  };
  std::vector<Binding> bindings_;
};

}  // namespace shardtrain
