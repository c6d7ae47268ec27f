// LoRA on a block's linear layers (PEFT 0.21.2, docs/adapters.md). An adapted layer y = x W^T + b
// (W frozen) adds
//   y += s dropout(x) A^T B^T,   s = alpha / rank,
// A (rank, in) and B (out, rank) being the adapter's parameters in the block's unit
// (ParamTable::adapter_param). Nothing of the forward is kept: the backward recomputes the
// rank-wide u = x A^T (and the dropped input, from the counter stream), so an adapter costs
// scratch buffers, not activations per layer. Dropout (adapter.dropout > 0) is on while training
// row keys are set (set_row_keys): each row's key (dropout_token_key) and each adapted layer's
// site give every element its own number, so the mask is a pure function of (seed, step,
// sequence, position, layer, element). Both directions run after the base layer's own: the
// forward adds into the product's output (a column slice where the product is fused), the
// backward adds into the input gradient the base layer wrote.
//
// DoRA (adapter.type = dora) adds a magnitude m (out) per layer and computes
//   y = b + g (x) (x W^T + s x A^T B^T),   g = m / ||W + s B A||_row,
// the norm of each output feature's row taken as a constant (detached, as PEFT does): m gets its
// gradient through g, A and B through the scaled output gradient g (x) dy, which output_grad
// hands the base layer's and the adapters' backward. With dropout (PEFT's formula) the base layer
// keeps its own output and input gradient, and the adapter adds
//   y += (g - 1) (x) x~ W^T + g (x) s x~ A^T B^T = x~ E^T,   E = (g - 1) (x) W + s g (x) B A,
// an extra product of the layer's size each way; m's gradient takes x~ in z.
#pragma once

#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

#include "backend/layer_ops.hpp"
#include "model/adapter_layers.hpp"
#include "model/param_table.hpp"

namespace shardtrain {

template <typename Real>
class LoraLayers : public AdapterLayers<Real> {
 public:
  // rows: the B*T rows of a micro-batch (or the most a decode step takes); key_rows: the dropout
  // keys set_row_keys takes (make_adapter_layers).
  LoraLayers(const ParamTable& table, int rows, const LayerOps<Real>& ops, int key_rows);

  // Bytes of scratch for `rows` rows of `real_bytes` elements: the plan of the models' activation
  // accounting.
  static size_t plan_bytes(const ParamTable& table, int rows, size_t real_bytes, int key_rows);

  // The AdapterLayers calls (model/adapter_layers.hpp): DoRA's output_grad scales the adapted
  // columns by their gains and accumulates the magnitudes' gradients from dout.
  void set_row_keys(const uint64_t* keys) override;
  void select_row_keys(size_t first) override { key_first_ = first; }
  void forward(int layer, BlockProduct product, const Real* x, Real* out, int n, const Real* unit) const override;
  const Real* output_grad(int layer, BlockProduct product, const Real* x, const Real* dout, int n, const Real* unit,
                          Real* unit_grads) const override;
  void backward(int layer, BlockProduct product, const Real* x, const Real* dout, Real* dx, int n, const Real* unit,
                Real* unit_grads) const override;

 private:
  const ParamTable& table_;
  const LayerOps<Real>& ops_;
  size_t most_sites_;  // the most sites a block of any kind has: dropout keys per (block, site)
  Real scaling_;
  int rank_, rows_, key_rows_;
  float dropout_;
  bool dropping_ = false;
  DeviceArray<uint64_t> row_keys_;
  size_t key_first_ = 0;  // select_row_keys
  const uint64_t* keys(int n) const;  // the product's n row keys
  mutable DeviceArray<Real> u_, du_, dropped_, dx_;  // the last two with dropout: rows x the widest input
  // DoRA: the adapted weight W + s B A (with dropout, then E), its row norms and the gains; the
  // product before the gains (rows x out) and the scaled output gradient (rows x width); with
  // dropout, g (x) B (out x rank).
  mutable DeviceArray<Real> weight_, norm_, gain_, z_, dz_, gained_b_;
  bool dora() const { return table_.adapter().type == ADAPTER_DORA; }
  const std::vector<LinearSite>& sites(int layer) const { return table_.block_sites(layer); }
  // The adapted layers of `product` in block `layer`: their sites() index and lora_A's position.
  std::vector<std::pair<size_t, int>> adapted(int layer, BlockProduct product) const;
  // DoRA: the gains of block `layer`'s adapted layer `site` into gain_, its norms into norm_.
  void dora_gains(int layer, size_t site, const Real* unit) const;
  // DoRA with dropout: the gains, then E = (g - 1) (x) W + s g (x) B A into weight_.
  void effective_weight(int layer, size_t site, const Real* unit) const;
  // The layer's input, dropped out where training (into dropped_); the site keys the layer.
  const Real* input(int layer, size_t site, const Real* x, int n, int in) const;
  uint64_t site_key(int layer, size_t site) const { return 1 + static_cast<uint64_t>(layer) * most_sites_ + site; }
};

}  // namespace shardtrain
