// The adapters' arithmetic around a block's matrix products, as the models call it: LoRA and DoRA
// add a low-rank product's output (model/lora.hpp); LoHa, LoKr and OFT add x dW^T for a weight
// delta dW built from their parameters (model/delta_adapters.hpp). Each runs after the base layer's
// own forward and backward, on the block's gathered unit, and keeps nothing between the two: the
// backward rebuilds what it needs (so activation checkpointing recomputes nothing else).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "backend/layer_ops.hpp"
#include "core/error.hpp"
#include "model/param_table.hpp"

namespace shardtrain {

template <typename Real>
class AdapterLayers {
 public:
  virtual ~AdapterLayers() = default;
  // The training rows' dropout keys (host memory, one per key row -- the rows the layers were made
  // for, or their key_rows --, dropout_token_key), or null: no dropout (evaluation). Kept until
  // the next call.
  virtual void set_row_keys(const uint64_t* keys) = 0;
  // The following products' rows take their keys from key row `first` on: a model whose products
  // have rows of several kinds (a diffusion transformer's image, text and joint tokens and its
  // samples) keeps a run of keys per kind.
  virtual void select_row_keys(size_t first) {}
  // After the base forward of `product` in block `layer`: each adapted layer of it adds its term
  // to out (n rows of the product's width). unit: the block's gathered parameters.
  virtual void forward(int layer, BlockProduct product, const Real* x, Real* out, int n, const Real* unit) const = 0;
  // Before the base backward of `product`: the output gradient that the base layer's backward and
  // then backward() take -- dout itself, or (DoRA) a rescaled copy; parameter gradients that need
  // dout itself accumulate into unit_grads here.
  virtual const Real* output_grad(int layer, BlockProduct product, const Real* x, const Real* dout, int n,
                                  const Real* unit, Real* unit_grads) const = 0;
  // After the base backward of `product`: dx (n, in) += the adapters' input gradient, given the
  // product's output gradient dout (output_grad's); their parameter gradients accumulate into
  // unit_grads (null, or a frozen parameter: none).
  virtual void backward(int layer, BlockProduct product, const Real* x, const Real* dout, Real* dx, int n,
                        const Real* unit, Real* unit_grads) const = 0;
};

// The table's method for `rows` rows (null without adapters) with `key_rows` dropout keys (-1: one
// per row), and its scratch bytes for `rows` rows of `real_bytes` elements: the plan of the
// models' activation accounting.
template <typename Real>
std::unique_ptr<AdapterLayers<Real>> make_adapter_layers(const ParamTable& table, int rows, const LayerOps<Real>& ops,
                                                         int key_rows = -1);
size_t plan_adapter_bytes(const ParamTable& table, int rows, size_t real_bytes, int key_rows = -1);

// A model's block linear layers: each product of a block (a site's BlockProduct) is its GEMM and
// the adapters on its output together, so that no model places adapter hooks by hand. It holds
// one AdapterLayers for a micro-batch's rows and, while a generation decodes, one for a step's.
// l is the block, w its gathered unit (the adapters' parameters are in it), g its gradients.
template <typename Real>
class ModelAdapters {
 public:
  ModelAdapters(const ParamTable& table, int rows, const LayerOps<Real>& ops, int key_rows = -1)
      : table_(table), ops_(ops), rows_(rows), train_(make_adapter_layers(table, rows, ops, key_rows)) {}
  // out (n rows, width) = x (n, in) weight^T + bias (null: none), plus the adapters' parts; n = -1:
  // every row of the micro-batch (a diffusion transformer's products have the rows of one stream,
  // of the joint sequence or of the samples).
  void linear_forward(int l, BlockProduct product, Real* out, const Real* x, const Real* weight, const Real* bias,
                      int in, int width, const Real* w, int n = -1) const {
    ops_.matmul_forward(out, x, weight, bias, rows(n), in, width);
    if (train_) train_->forward(l, product, x, out, rows(n), w);
  }
  // Its backward from dout: dx written (the adapters' part added), dweight and dbias (null: none, a
  // frozen weight) accumulated, the adapters' gradients into g.
  void linear_backward(int l, BlockProduct product, Real* dx, Real* dweight, Real* dbias, const Real* dout,
                       const Real* x, const Real* weight, int in, int width, const Real* w, Real* g, int n = -1) const {
    const Real* d = train_ ? train_->output_grad(l, product, x, dout, rows(n), w, g) : dout;
    ops_.matmul_backward(dx, dweight, dbias, d, x, weight, rows(n), in, width);
    if (train_) train_->backward(l, product, x, d, dx, rows(n), w, g);
  }
  void set_dropout_keys(const uint64_t* keys) {
    if (train_) train_->set_row_keys(keys);
  }
  void select_dropout_keys(size_t first) {
    if (train_) train_->select_row_keys(first);
  }
  // Generation: steps of up to max_chunk rows.
  void begin_decode(int max_chunk) { decode_ = make_adapter_layers(table_, max_chunk, ops_); }
  void end_decode() { decode_.reset(); }
  // A decoding step's product of n rows, with the adapters.
  void linear_decode(int l, BlockProduct product, Real* out, const Real* x, const Real* weight, const Real* bias,
                     int in, int width, const Real* w, int n) const {
    ops_.matmul_forward(out, x, weight, bias, n, in, width);
    if (decode_) decode_->forward(l, product, x, out, n, w);
  }

 private:
  int rows(int n) const {
    SHARD_CHECK(n <= rows_, "an adapted product of %d rows, the adapters hold %d", n, rows_);
    return n < 0 ? rows_ : n;
  }
  const ParamTable& table_;
  const LayerOps<Real>& ops_;
  int rows_;
  std::unique_ptr<AdapterLayers<Real>> train_, decode_;
};

}  // namespace shardtrain
