// See lora.hpp. Row-major products (LayerOps::gemm) for a layer with in inputs and out outputs,
// its output a column slice [column, column + out) of a product `width` wide, x~ = dropout(x):
//   forward   u = x~ A^T (n, r);  y[:, slice] += s u B^T
//   backward  x~, u again;  dB += s dy[:, slice]^T u;  du = s dy[:, slice] B;  dA += du^T x~;
//             dx += dropout(du A), with x~'s mask
// DoRA with dropout adds y[:, slice] += x~ E^T with the effective weight E = (g - 1) (x) W + s g (x) B A
// (rows scaled by their gains, effective_weight), and its backward dx += dropout(dy[:, slice] E).
#include "model/lora.hpp"

#include <algorithm>

#include "core/error.hpp"

namespace shardtrain {

template <typename Real>
LoraLayers<Real>::LoraLayers(const ParamTable& table, int rows, const LayerOps<Real>& ops, int key_rows)
    : table_(table),
      ops_(ops),
      most_sites_(0),
      scaling_(static_cast<Real>(table.adapter().scaling())),
      rank_(table.adapter().rank),
      rows_(rows),
      key_rows_(key_rows),
      dropout_(static_cast<float>(table.adapter().dropout)),
      u_(ops.device(), static_cast<size_t>(rows) * rank_),
      du_(ops.device(), static_cast<size_t>(rows) * rank_) {
  int widest = 0, most_out = 0, widest_product = 0;
  size_t largest = 0;
  for (int b = 0; b < table.block_count(); b++) most_sites_ = std::max(most_sites_, table.block_sites(b).size());
  for (const LinearSite& site : table.all_sites()) {
    widest = std::max(widest, site.in), most_out = std::max(most_out, site.out);
    widest_product = std::max(widest_product, site.width);
    largest = std::max(largest, static_cast<size_t>(site.in) * site.out);
  }
  if (dora()) {
    weight_ = DeviceArray<Real>(ops.device(), largest);
    norm_ = DeviceArray<Real>(ops.device(), most_out);
    gain_ = DeviceArray<Real>(ops.device(), most_out);
    z_ = DeviceArray<Real>(ops.device(), static_cast<size_t>(rows) * most_out);
    dz_ = DeviceArray<Real>(ops.device(), static_cast<size_t>(rows) * widest_product);
  }
  if (dropout_ == 0) return;
  if (dora()) gained_b_ = DeviceArray<Real>(ops.device(), static_cast<size_t>(most_out) * rank_);
  row_keys_ = DeviceArray<uint64_t>(ops.device(), key_rows);
  dropped_ = DeviceArray<Real>(ops.device(), static_cast<size_t>(rows) * widest);
  dx_ = DeviceArray<Real>(ops.device(), static_cast<size_t>(rows) * widest);
}

template <typename Real>
size_t LoraLayers<Real>::plan_bytes(const ParamTable& table, int rows, size_t real_bytes, int key_rows) {
  if (table.adapter().type == ADAPTER_NONE) return 0;
  size_t bytes = 2 * static_cast<size_t>(rows) * table.adapter().rank * real_bytes;
  size_t widest = 0, most_out = 0, widest_product = 0, largest = 0;
  for (const LinearSite& site : table.all_sites()) {
    widest = std::max(widest, static_cast<size_t>(site.in));
    most_out = std::max(most_out, static_cast<size_t>(site.out));
    widest_product = std::max(widest_product, static_cast<size_t>(site.width));
    largest = std::max(largest, static_cast<size_t>(site.in) * site.out);
  }
  if (table.adapter().type == ADAPTER_DORA)
    bytes += (largest + 2 * most_out + rows * (most_out + widest_product)) * real_bytes;
  if (table.adapter().dropout == 0) return bytes;
  if (table.adapter().type == ADAPTER_DORA) bytes += most_out * table.adapter().rank * real_bytes;
  return bytes + key_rows * sizeof(uint64_t) + 2 * rows * widest * real_bytes;
}

template <typename Real>
std::vector<std::pair<size_t, int>> LoraLayers<Real>::adapted(int layer, BlockProduct product) const {
  std::vector<std::pair<size_t, int>> out;
  for (size_t k = 0; k < sites(layer).size(); k++) {
    const int a = table_.adapter_param(layer, static_cast<int>(k));
    if (sites(layer)[k].product == product && a >= 0) out.emplace_back(k, a);
  }
  return out;
}

template <typename Real>
void LoraLayers<Real>::dora_gains(int layer, size_t k, const Real* unit) const {
  const LinearSite& site = sites(layer)[k];
  const int u = block_unit(layer), a = table_.adapter_param(layer, static_cast<int>(k)), r = rank_;
  // The weight the layer's GEMM multiplies (maybe only its 16-bit copy: a quantized base).
  ops_.copy_operand(weight_.data(), param_in(table_, unit, u, site.weight), static_cast<size_t>(site.out) * site.in);
  ops_.gemm(false, false, site.out, site.in, r, scaling_, param_in(table_, unit, u, a + 1), r,
            param_in(table_, unit, u, a), site.in, Real(1), weight_.data(), site.in);  // W + s B A
  ops_.row_norms(norm_.data(), weight_.data(), site.out, site.in);
  ops_.divide(gain_.data(), param_in(table_, unit, u, a + 2), norm_.data(), site.out);
}

template <typename Real>
void LoraLayers<Real>::effective_weight(int layer, size_t k, const Real* unit) const {
  const LinearSite& site = sites(layer)[k];
  const int u = block_unit(layer), a = table_.adapter_param(layer, static_cast<int>(k)), r = rank_;
  dora_gains(layer, k, unit);
  ops_.copy_operand(weight_.data(), param_in(table_, unit, u, site.weight), static_cast<size_t>(site.out) * site.in);
  ops_.scale_rows(weight_.data(), site.out, site.in, gain_.data(), Real(-1));  // (g - 1) (x) W
  ops_.device().copy_on_device(gained_b_.data(), param_in(table_, unit, u, a + 1),
                               static_cast<size_t>(site.out) * r * sizeof(Real));
  ops_.scale_rows(gained_b_.data(), site.out, r, gain_.data(), Real(0));  // g (x) B
  ops_.gemm(false, false, site.out, site.in, r, scaling_, gained_b_.data(), r, param_in(table_, unit, u, a), site.in,
            Real(1), weight_.data(), site.in);
}

template <typename Real>
void LoraLayers<Real>::set_row_keys(const uint64_t* keys) {
  dropping_ = keys && dropout_ > 0;
  if (dropping_) ops_.device().copy_to_device(row_keys_.data(), keys, row_keys_.bytes());
}

template <typename Real>
const uint64_t* LoraLayers<Real>::keys(int n) const {
  SHARD_CHECK(n <= rows_ && key_first_ + n <= static_cast<size_t>(key_rows_), "%d rows from dropout key %zu of %d", n,
              key_first_, key_rows_);
  return row_keys_.data() + key_first_;
}

template <typename Real>
const Real* LoraLayers<Real>::input(int layer, size_t site, const Real* x, int n, int in) const {
  if (!dropping_) return x;
  ops_.dropout(dropped_.data(), x, keys(n), site_key(layer, site), n, in, dropout_);
  return dropped_.data();
}

template <typename Real>
void LoraLayers<Real>::forward(int layer, BlockProduct product, const Real* x, Real* out, int n,
                               const Real* unit) const {
  const int unit_index = block_unit(layer), r = rank_;
  for (const auto& [k, a] : adapted(layer, product)) {
    const LinearSite& site = sites(layer)[k];
    const Real* A = unit + table_.offset(unit_index, a);
    const Real* B = unit + table_.offset(unit_index, a + 1);
    const Real* xin = input(layer, k, x, n, site.in);
    if (dora() && dropping_) {  // out += x~ E^T: PEFT's (g - 1) (x) x~ W^T + g (x) s x~ A^T B^T
      effective_weight(layer, k, unit);
      ops_.gemm(false, true, n, site.out, site.in, Real(1), xin, site.in, weight_.data(), site.in, Real(1),
                out + site.column, site.width);
      continue;
    }
    ops_.gemm(false, true, n, r, site.in, Real(1), xin, site.in, A, site.in, Real(0), u_.data(), r);
    ops_.gemm(false, true, n, site.out, r, scaling_, u_.data(), r, B, r, Real(1), out + site.column, site.width);
    if (!dora()) continue;
    // out = x W^T + b + s u B^T  ->  b + g (x) (x W^T + s u B^T)
    dora_gains(layer, k, unit);
    const Real* bias = site.bias >= 0 ? param_in(table_, unit, unit_index, site.bias) : nullptr;
    ops_.column_affine(out + site.column, site.width, n, site.out, gain_.data(), bias);
  }
}

template <typename Real>
const Real* LoraLayers<Real>::output_grad(int layer, BlockProduct product, const Real* x, const Real* dout, int n,
                                          const Real* unit, Real* unit_grads) const {
  if (!dora()) return dout;
  const int unit_index = block_unit(layer), r = rank_;
  bool copied = false;
  for (const auto& [k, a] : adapted(layer, product)) {
    const LinearSite& site = sites(layer)[k];
    // With dropout the base layer keeps dy (its output is x W^T + b, ungained): nothing to copy.
    if (!copied && !dropping_)
      ops_.device().copy_on_device(dz_.data(), dout, static_cast<size_t>(n) * site.width * sizeof(Real));
    copied = !dropping_;
    dora_gains(layer, k, unit);
    if (Real* dm = grad_in(table_, unit_grads, unit_index, a + 2)) {
      // dm += sum over rows of dy (x) z / n, z = x~ W^T + s x~ A^T B^T again.
      const Real* A = param_in(table_, unit, unit_index, a);
      const Real* xin = input(layer, k, x, n, site.in);
      ops_.copy_operand(weight_.data(), param_in(table_, unit, unit_index, site.weight),
                        static_cast<size_t>(site.out) * site.in);
      ops_.gemm(false, true, n, site.out, site.in, Real(1), xin, site.in, weight_.data(), site.in, Real(0), z_.data(),
                site.out);
      ops_.gemm(false, true, n, r, site.in, Real(1), xin, site.in, A, site.in, Real(0), u_.data(), r);
      ops_.gemm(false, true, n, site.out, r, scaling_, u_.data(), r, param_in(table_, unit, unit_index, a + 1), r,
                Real(1), z_.data(), site.out);
      ops_.column_dot_accumulate(dm, dout + site.column, site.width, z_.data(), site.out, n, site.out, norm_.data());
    }
    if (!dropping_) ops_.column_affine(dz_.data() + site.column, site.width, n, site.out, gain_.data(), nullptr);
  }
  return copied ? dz_.data() : dout;
}

template <typename Real>
void LoraLayers<Real>::backward(int layer, BlockProduct product, const Real* x, const Real* dout, Real* dx, int n,
                                const Real* unit, Real* unit_grads) const {
  const int unit_index = block_unit(layer), r = rank_;
  for (const auto& [k, a] : adapted(layer, product)) {
    const LinearSite& site = sites(layer)[k];
    const Real* A = unit + table_.offset(unit_index, a);
    const Real* B = unit + table_.offset(unit_index, a + 1);
    Real* dA = grad_in(table_, unit_grads, unit_index, a);
    Real* dB = grad_in(table_, unit_grads, unit_index, a + 1);
    const Real* dy = dout + site.column;
    int ld_dy = site.width;
    const Real* xin = input(layer, k, x, n, site.in);
    if (dora() && dropping_) {  // A and B see g (x) dy (dense in z_); x~ sees dy E
      effective_weight(layer, k, unit);
      ops_.copy_rows(z_.data(), site.out, dy, site.width, n, site.out);
      ops_.column_affine(z_.data(), site.out, n, site.out, gain_.data(), nullptr);
      dy = z_.data(), ld_dy = site.out;
    }
    ops_.gemm(false, true, n, r, site.in, Real(1), xin, site.in, A, site.in, Real(0), u_.data(), r);
    if (dB) ops_.gemm(true, false, site.out, r, n, scaling_, dy, ld_dy, u_.data(), r, Real(1), dB, r);
    ops_.gemm(false, false, n, r, site.out, scaling_, dy, ld_dy, B, r, Real(0), du_.data(), r);
    if (dA) ops_.gemm(true, false, r, site.in, n, Real(1), du_.data(), r, xin, site.in, Real(1), dA, site.in);
    if (!dropping_) {
      ops_.gemm(false, false, n, site.in, r, Real(1), du_.data(), r, A, site.in, Real(1), dx, site.in);
      continue;
    }
    // Through the dropout: the gradient of x~ masked as x~ was. DoRA's is dy E (E holds s g (x) B A,
    // so du A is in it).
    if (dora())
      ops_.gemm(false, false, n, site.in, site.out, Real(1), dout + site.column, site.width, weight_.data(), site.in,
                Real(0), dx_.data(), site.in);
    else
      ops_.gemm(false, false, n, site.in, r, Real(1), du_.data(), r, A, site.in, Real(0), dx_.data(), site.in);
    ops_.dropout(dx_.data(), dx_.data(), keys(n), site_key(layer, k), n, site.in, dropout_);
    ops_.residual_forward(dx, dx, dx_.data(), static_cast<size_t>(n) * site.in);
  }
}

template class LoraLayers<float>;
template class LoraLayers<double>;

}  // namespace shardtrain
