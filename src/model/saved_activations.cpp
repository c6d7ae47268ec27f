#include "model/saved_activations.hpp"

#include "core/error.hpp"

namespace shardtrain {

template <typename Real>
SavedActivations<Real>::SavedActivations(const LayerOps<Real>& ops, DType dtype, const CheckpointedRun& layers,
                                         const std::vector<size_t>& sizes)
    : ops_(ops), dtype_(dtype), layers_(layers) {
  const int sets = layers.sets();
  SHARD_CHECK(sets >= 1, "SavedActivations for %d layers", layers.blocks);
  Device& dev = ops.device();
  if (dtype == DTYPE_FP32) {
    fp32_.resize(sets);
    for (auto& layer : fp32_)
      for (size_t n : sizes) layer.emplace_back(dev, n);
    return;
  }
  for (size_t n : sizes) work_.emplace_back(dev, n);
  half_.resize(sets);
  for (auto& layer : half_)
    for (size_t n : sizes) layer.emplace_back(dev, n);
}

template <typename Real>
SavedActivations<Real>::~SavedActivations() {
  for (const auto& w : work_) ops_.unbind_half_copy(w.data());
}

template <typename Real>
std::vector<size_t> SavedActivations<Real>::plan_allocations(DType dtype, int sets, const std::vector<size_t>& sizes,
                                                             size_t real_bytes) {
  std::vector<size_t> bytes;
  if (dtype == DTYPE_FP32) {
    for (int l = 0; l < sets; l++)
      for (size_t n : sizes) bytes.push_back(n * real_bytes);
    return bytes;
  }
  for (size_t n : sizes) bytes.push_back(n * real_bytes);  // the working set
  for (int l = 0; l < sets; l++)
    for (size_t n : sizes) bytes.push_back(n * dtype_bytes(dtype));
  return bytes;
}

template <typename Real>
size_t SavedActivations<Real>::plan_bytes(DType dtype, int sets, const std::vector<size_t>& sizes,
                                          size_t real_bytes) {
  size_t total = 0;
  for (size_t b : plan_allocations(dtype, sets, sizes, real_bytes)) total += b;
  return total;
}

template <typename Real>
void SavedActivations<Real>::produced(int layer, int t) {
  if (dtype_ == DTYPE_FP32) return;
  DeviceArray<uint16_t>& copy = half_[slot(layer)][t];
  ops_.round_to_half(work_[t].data(), copy.data(), copy.size(), dtype_);
  bind(layer, t);
}

template <typename Real>
void SavedActivations<Real>::restore(int layer) {
  if (dtype_ == DTYPE_FP32) return;
  for (size_t t = 0; t < work_.size(); t++) {
    const DeviceArray<uint16_t>& copy = half_[slot(layer)][t];
    ops_.widen_half(work_[t].data(), copy.data(), copy.size(), dtype_);
    bind(layer, static_cast<int>(t));
  }
}

template <typename Real>
void SavedActivations<Real>::bind(int layer, int t) {
  const DeviceArray<uint16_t>& copy = half_[slot(layer)][t];
  ops_.bind_half_copy(work_[t].data(), copy.data(), copy.size(), dtype_);
}

template class SavedActivations<float>;
template class SavedActivations<double>;

}  // namespace shardtrain
