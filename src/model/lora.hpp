// LoRA on a block's linear layers (PEFT 0.21.2, docs/adapters.md). An adapted layer y = x W^T + b
// (W frozen) adds
//   y += s dropout(x) A^T B^T,   s = alpha / rank,
// A (rank, in) and B (out, rank) being the adapter's parameters in the block's unit
// (ParamTable::adapter_param). Nothing of the forward is kept: the backward recomputes the
// rank-wide u = x A^T, so an adapter costs two scratch buffers of rows x rank, not activations
// per layer. Both directions run after the base layer's own: the forward adds into the product's
// output (a column slice where the product is fused), the backward adds into the input gradient
// the base layer wrote.
#pragma once

#include <cstddef>
#include <vector>

#include "backend/layer_ops.hpp"
#include "model/param_table.hpp"

namespace shardtrain {

template <typename Real>
class LoraLayers {
 public:
  // rows: the B*T rows of a micro-batch (or the most a decode step takes).
  LoraLayers(const ParamTable& table, int rows, const LayerOps<Real>& ops);

  // Elements of scratch for `rows` rows: the plan of the models' activation accounting.
  static size_t plan_elements(const ParamTable& table, int rows);

  // After the base forward of `product` in block `layer`: each adapted layer of it adds its term
  // to out (n rows of the product's width). unit: the block's gathered parameters.
  void forward(int layer, BlockProduct product, const Real* x, Real* out, int n, const Real* unit) const;
  // After the base backward of `product`: dx (n, in) += the adapters' input gradient, given the
  // product's output gradient dout; their parameter gradients accumulate into unit_grads (null:
  // none, the adapters frozen).
  void backward(int layer, BlockProduct product, const Real* x, const Real* dout, Real* dx, int n, const Real* unit,
                Real* unit_grads) const;

 private:
  const ParamTable& table_;
  const LayerOps<Real>& ops_;
  std::vector<LinearSite> sites_;
  Real scaling_;
  int rank_;
  mutable DeviceArray<Real> u_, du_;
};

}  // namespace shardtrain
