// LoHa, LoKr and OFT (PEFT 0.21.2, docs/adapters.md): adapters that change an adapted layer's weight
// W (out, in), frozen, by a delta built from their parameters (s = alpha / rank):
//   LoHa  dW = s (w1_a w1_b) (.) (w2_a w2_b)            elementwise product of two rank-r products
//   LoKr  dW = s kron(w1, w2)                           w1 (a, c), w2 (b, d), each maybe a rank-r
//                                                        product (AdapterConfig's lokr_shape)
//   OFT   dW = W blockdiag(R_1, ..., R_nb)^T - W         R_j orthogonal rotations (model/oft.hpp):
//                                                        PEFT rotates the input, x~ = x blockdiag(R)
// and the layer computes y = x W^T + b + x dW^T. The forward and the backward each build dW into a
// scratch matrix the size of the largest adapted weight, so an adapted layer costs about twice its
// base products; nothing is kept between them. The backward adds dx += dy dW and, for trainable
// parameters, takes G = dy^T x (out, in) -- the gradient of dW -- back to the factors. OFT's b x b
// rotations and their gradients are host arithmetic in double (a device round trip per adapted
// layer; b^3 work per block, small next to the layer).
#pragma once

#include <array>
#include <cstddef>
#include <vector>

#include "model/adapter_layers.hpp"

namespace shardtrain {

template <typename Real>
class DeltaLayers : public AdapterLayers<Real> {
 public:
  // rows: the B*T rows of a micro-batch (or the most a decode step takes).
  DeltaLayers(const ParamTable& table, int rows, const LayerOps<Real>& ops);
  // Bytes of scratch, as LoraLayers::plan_bytes.
  static size_t plan_bytes(const ParamTable& table, int rows, size_t real_bytes);

  // The AdapterLayers calls (model/adapter_layers.hpp). No dropout: options refuse it.
  void set_row_keys(const uint64_t*) override {}
  void forward(int layer, BlockProduct product, const Real* x, Real* out, int n, const Real* unit) const override;
  const Real* output_grad(int, BlockProduct, const Real*, const Real* dout, int, const Real*, Real*) const override {
    return dout;
  }
  void backward(int layer, BlockProduct product, const Real* x, const Real* dout, Real* dx, int n, const Real* unit,
                Real* unit_grads) const override;

 private:
  // Elements of the scratch matrices: delta_ and the method's work_[i], the most any adapted layer needs.
  static std::array<size_t, 5> scratch_elements(const ParamTable& table);
  const ParamTable& table_;
  const LayerOps<Real>& ops_;
  const std::vector<LinearSite>& sites(int layer) const { return table_.block_sites(layer); }
  Real scaling_;
  // dW, then in the backward G; work_: LoHa's two products and a gradient, LoKr's w1, w2 and their
  // gradients, OFT's rotations, their gradients, the parameters' gradients and the base weight as
  // the GEMMs see it (LayerOps::copy_operand).
  mutable DeviceArray<Real> delta_;
  mutable std::array<DeviceArray<Real>, 4> work_;
  mutable std::vector<Real> host_;            // OFT: parameters or gradients on their way
  mutable std::vector<double> host_double_;  // OFT: the same in double
  // dW of block `layer`'s adapted layer `site` (its first parameter `first`) into delta_.
  void build_delta(int layer, size_t site, int first, const Real* unit) const;
  // With G in delta_ (and build_delta's work_ still in place): the parameters' gradients.
  void delta_backward(int layer, size_t site, int first, const Real* unit, Real* unit_grads) const;
  // OFT: the layer's rotations into work_[0] (blocks x b x b).
  void oft_rotations(const Real* v, int blocks) const;
};

}  // namespace shardtrain
