// A block's large activations -- the tensors its backward reads again -- kept per layer, in fp32
// or, with fsdp.activation_dtype = bf16 | fp16, in 16 bits.
//
// fp32: each layer that keeps its activations has its own buffers, the layers that recompute
// theirs (activation checkpointing) share one set, and at(layer, t) is the layer's set's.
// 16 bits: the block computes in one fp32 working set shared by every layer, and each layer keeps
// only 16-bit copies. A tensor is rounded where it is produced (produced(): LayerOps::round_to_half,
// so the working values become exactly the stored ones and the forward goes on from the numbers
// backward will see -- what a network in 16 bits computes); block_backward widens the layer's
// copies back first (restore()). The working buffers are bound to the current layer's copies
// (LayerOps::bind_half_copy), so a GEMM reading them multiplies the copy: each activation is
// rounded once. Row statistics, attention's lse and the residual stream stay in fp32 (the models
// keep them), as the loss's softmax does.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "backend/device.hpp"
#include "backend/dtype.hpp"
#include "backend/layer_ops.hpp"
#include "model/checkpointing.hpp"

namespace shardtrain {

template <typename Real>
class SavedActivations {
 public:
  // `sizes`: each tensor's elements in one layer; `layers`: which recompute (their set is shared,
  // each recompute fills it) and which keep their own.
  SavedActivations(const LayerOps<Real>& ops, DType dtype, const CheckpointedRun& layers,
                   const std::vector<size_t>& sizes);
  ~SavedActivations();
  SavedActivations(const SavedActivations&) = delete;
  SavedActivations& operator=(const SavedActivations&) = delete;

  // The arrays the constructor allocates for `sets` sets (CheckpointedRun::sets), in bytes each, in
  // its order; and their sum.
  static std::vector<size_t> plan_allocations(DType dtype, int sets, const std::vector<size_t>& sizes,
                                              size_t real_bytes);
  static size_t plan_bytes(DType dtype, int sets, const std::vector<size_t>& sizes, size_t real_bytes);

  DType dtype() const { return dtype_; }
  // Tensor t of layer l, where its producer writes and its readers read.
  Real* at(int layer, int t) { return dtype_ == DTYPE_FP32 ? fp32_[slot(layer)][t].data() : work_[t].data(); }
  // Tensor t of layer l has been written: with 16 bits, round it and keep its copy. A no-op in fp32.
  void produced(int layer, int t);
  // Before layer l's backward (unless its forward was just recomputed): with 16 bits, its tensors
  // widened back into the working set. A no-op in fp32.
  void restore(int layer);

 private:
  int slot(int layer) const { return layers_.set(layer); }
  void bind(int layer, int t);

  const LayerOps<Real>& ops_;
  DType dtype_;
  CheckpointedRun layers_;
  std::vector<std::vector<DeviceArray<Real>>> fp32_;     // fp32: [layer][tensor]
  std::vector<DeviceArray<Real>> work_;                  // 16 bits: the shared working set
  std::vector<std::vector<DeviceArray<uint16_t>>> half_;  // 16 bits: [layer][tensor]
};

}  // namespace shardtrain
