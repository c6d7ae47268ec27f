// See lora.hpp. Row-major products (LayerOps::gemm) for a layer with in inputs and out outputs,
// its output a column slice [column, column + out) of a product `width` wide:
//   forward   u = x A^T (n, r);  y[:, slice] += s u B^T
//   backward  u again;  dB += s dy[:, slice]^T u;  du = s dy[:, slice] B;  dA += du^T x;  dx += du A
#include "model/lora.hpp"

#include <algorithm>

namespace shardtrain {

template <typename Real>
LoraLayers<Real>::LoraLayers(const ParamTable& table, int rows, const LayerOps<Real>& ops)
    : table_(table),
      ops_(ops),
      sites_(linear_sites(table.config())),
      scaling_(static_cast<Real>(table.adapter().scaling())),
      rank_(table.adapter().rank),
      u_(ops.device(), static_cast<size_t>(rows) * rank_),
      du_(ops.device(), static_cast<size_t>(rows) * rank_) {}

template <typename Real>
size_t LoraLayers<Real>::plan_elements(const ParamTable& table, int rows) {
  if (table.adapter().type != ADAPTER_LORA) return 0;
  return 2 * static_cast<size_t>(rows) * table.adapter().rank;
}

template <typename Real>
void LoraLayers<Real>::forward(int layer, BlockProduct product, const Real* x, Real* out, int n,
                               const Real* unit) const {
  const int unit_index = block_unit(layer), r = rank_;
  for (size_t k = 0; k < sites_.size(); k++) {
    const LinearSite& site = sites_[k];
    const int a = table_.adapter_param(layer, static_cast<int>(k));
    if (site.product != product || a < 0) continue;
    const Real* A = unit + table_.offset(unit_index, a);
    const Real* B = unit + table_.offset(unit_index, a + 1);
    ops_.gemm(false, true, n, r, site.in, Real(1), x, site.in, A, site.in, Real(0), u_.data(), r);
    ops_.gemm(false, true, n, site.out, r, scaling_, u_.data(), r, B, r, Real(1), out + site.column, site.width);
  }
}

template <typename Real>
void LoraLayers<Real>::backward(int layer, BlockProduct product, const Real* x, const Real* dout, Real* dx, int n,
                                const Real* unit, Real* unit_grads) const {
  const int unit_index = block_unit(layer), r = rank_;
  for (size_t k = 0; k < sites_.size(); k++) {
    const LinearSite& site = sites_[k];
    const int a = table_.adapter_param(layer, static_cast<int>(k));
    if (site.product != product || a < 0) continue;
    const Real* A = unit + table_.offset(unit_index, a);
    const Real* B = unit + table_.offset(unit_index, a + 1);
    Real* dA = grad_in(table_, unit_grads, unit_index, a);
    Real* dB = grad_in(table_, unit_grads, unit_index, a + 1);
    const Real* dy = dout + site.column;
    ops_.gemm(false, true, n, r, site.in, Real(1), x, site.in, A, site.in, Real(0), u_.data(), r);
    if (dB) ops_.gemm(true, false, site.out, r, n, scaling_, dy, site.width, u_.data(), r, Real(1), dB, r);
    ops_.gemm(false, false, n, r, site.out, scaling_, dy, site.width, B, r, Real(0), du_.data(), r);
    if (dA) ops_.gemm(true, false, r, site.in, n, Real(1), du_.data(), r, x, site.in, Real(1), dA, site.in);
    ops_.gemm(false, false, n, site.in, r, Real(1), du_.data(), r, A, site.in, Real(1), dx, site.in);
  }
}

template class LoraLayers<float>;
template class LoraLayers<double>;

}  // namespace shardtrain
