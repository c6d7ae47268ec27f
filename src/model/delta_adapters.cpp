// See delta_adapters.hpp. Row-major products (LayerOps::gemm) for a layer with in inputs and out
// outputs, its output a column slice [column, column + out) of a product `width` wide:
//   forward   dW;  y[:, slice] += x dW^T
//   backward  dW;  dx += dy[:, slice] dW;  G = dy[:, slice]^T x;  then per method
//     LoHa  P1 = w1_a w1_b, P2 = w2_a w2_b:  dP1 = s G (.) P2, dw1_a += dP1 w1_b^T, dw1_b += w1_a^T dP1 (P2 alike)
//     LoKr  dw1, dw2 = kron_backward(G);  a low-rank factor w = w_a w_b: dw_a += dw w_b^T, dw_b += w_a^T dw
//     OFT   dR_j = G_j^T W_j over each block's columns j;  dv from dR (OftRotation::backward)
#include "model/delta_adapters.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "model/oft.hpp"

namespace shardtrain {

namespace {

// OFT's rotation of the table's settings.
OftRotation oft_rotation(const AdapterConfig& a) { return {a.block_size, a.cayley_neumann, a.neumann_terms}; }
int oft_blocks(const AdapterConfig& a, int in) { return a.block_share ? 1 : in / a.block_size; }

}  // namespace

template <typename Real>
std::array<size_t, 5> DeltaLayers<Real>::scratch_elements(const ParamTable& table) {
  const AdapterConfig& a = table.adapter();
  std::array<size_t, 5> most{};
  for (const LinearSite& site : table.all_sites()) {
    const size_t weight = static_cast<size_t>(site.in) * site.out;
    std::array<size_t, 5> need{weight, 0, 0, 0, 0};
    if (a.type == ADAPTER_LOHA) need = {weight, weight, weight, weight, 0};
    if (a.type == ADAPTER_LOKR) {
      const LokrShape k = lokr_shape(a, site.in, site.out);
      const size_t w1 = static_cast<size_t>(k.a) * k.c, w2 = static_cast<size_t>(k.b) * k.d;
      need = {weight, w1, w2, w1, w2};
    }
    if (a.type == ADAPTER_OFT) {
      const size_t b = a.block_size, rotations = oft_blocks(a, site.in) * b * b;
      need = {weight, rotations, rotations, oft_blocks(a, site.in) * b * (b - 1) / 2, weight};
    }
    for (size_t i = 0; i < most.size(); i++) most[i] = std::max(most[i], need[i]);
  }
  return most;
}

template <typename Real>
DeltaLayers<Real>::DeltaLayers(const ParamTable& table, int /*rows*/, const LayerOps<Real>& ops)
    : table_(table),
      ops_(ops),
      scaling_(static_cast<Real>(table.adapter().scaling())) {
  const std::array<size_t, 5> elements = scratch_elements(table);
  delta_ = DeviceArray<Real>(ops.device(), elements[0]);
  for (size_t i = 0; i < work_.size(); i++)
    if (elements[i + 1] > 0) work_[i] = DeviceArray<Real>(ops.device(), elements[i + 1]);
}

template <typename Real>
size_t DeltaLayers<Real>::plan_bytes(const ParamTable& table, int /*rows*/, size_t real_bytes) {
  size_t elements = 0;
  for (size_t e : scratch_elements(table)) elements += e;
  return elements * real_bytes;
}

template <typename Real>
void DeltaLayers<Real>::oft_rotations(const Real* v, int blocks) const {
  const AdapterConfig& a = table_.adapter();
  const int b = a.block_size, nv = b * (b - 1) / 2;
  host_.resize(static_cast<size_t>(blocks) * std::max(nv, b * b));
  host_double_.resize(static_cast<size_t>(blocks) * (nv + b * b));
  ops_.device().copy_to_host(host_.data(), v, static_cast<size_t>(blocks) * nv * sizeof(Real));
  double* params = host_double_.data();
  double* rotations = params + static_cast<size_t>(blocks) * nv;
  for (size_t i = 0; i < static_cast<size_t>(blocks) * nv; i++) params[i] = host_[i];
  for (int j = 0; j < blocks; j++) oft_rotation(a).forward(params + j * nv, rotations + static_cast<size_t>(j) * b * b);
  for (size_t i = 0; i < static_cast<size_t>(blocks) * b * b; i++) host_[i] = static_cast<Real>(rotations[i]);
  ops_.device().copy_to_device(work_[0].data(), host_.data(), static_cast<size_t>(blocks) * b * b * sizeof(Real));
}

template <typename Real>
void DeltaLayers<Real>::build_delta(int layer, size_t k, int first, const Real* unit) const {
  const LinearSite& site = sites(layer)[k];
  const AdapterConfig& a = table_.adapter();
  const int u = block_unit(layer), in = site.in, out = site.out, r = a.rank;
  auto param = [&](int i) { return param_in(table_, unit, u, first + i); };
  Real* delta = delta_.data();
  switch (a.type) {
    case ADAPTER_LOHA:
      ops_.gemm(false, false, out, in, r, Real(1), param(0), r, param(1), in, Real(0), work_[0].data(), in);
      ops_.gemm(false, false, out, in, r, Real(1), param(2), r, param(3), in, Real(0), work_[1].data(), in);
      ops_.multiply(delta, work_[0].data(), work_[1].data(), static_cast<size_t>(out) * in, scaling_);
      return;
    case ADAPTER_LOKR: {
      const LokrShape s = lokr_shape(a, in, out);
      int next = 0;
      const Real* w1 = param(next++);
      if (s.w1_low_rank) {
        ops_.gemm(false, false, s.a, s.c, r, Real(1), w1, r, param(next++), s.c, Real(0), work_[0].data(), s.c);
        w1 = work_[0].data();
      }
      const Real* w2 = param(next++);
      if (s.w2_low_rank) {
        ops_.gemm(false, false, s.b, s.d, r, Real(1), w2, r, param(next++), s.d, Real(0), work_[1].data(), s.d);
        w2 = work_[1].data();
      }
      ops_.kron(delta, w1, s.a, s.c, w2, s.b, s.d, scaling_);
      return;
    }
    case ADAPTER_OFT: {
      const int b = a.block_size, blocks = oft_blocks(a, in);
      oft_rotations(param(0), blocks);
      // The weight the layer's GEMM multiplies (maybe only its 16-bit copy: a quantized base), kept
      // in work_[3] for the backward.
      Real* W = work_[3].data();
      ops_.copy_operand(W, param_in(table_, unit, u, site.weight), static_cast<size_t>(out) * in);
      ops_.device().copy_on_device(delta, W, static_cast<size_t>(out) * in * sizeof(Real));
      for (int j = 0; j < in / b; j++)  // dW_j = W_j R_j^T - W_j over the block's columns
        ops_.gemm(false, true, out, b, b, Real(1), W + j * b, in, work_[0].data() + (a.block_share ? 0 : j) * b * b,
                  b, Real(-1), delta + j * b, in);
      return;
    }
    default: SHARD_CHECK(false, "DeltaLayers for adapter.type=%s", adapter_type_name(a.type));
  }
}

template <typename Real>
void DeltaLayers<Real>::delta_backward(int layer, size_t k, int first, const Real* unit, Real* unit_grads) const {
  const LinearSite& site = sites(layer)[k];
  const AdapterConfig& a = table_.adapter();
  const int u = block_unit(layer), in = site.in, out = site.out, r = a.rank;
  auto param = [&](int i) { return param_in(table_, unit, u, first + i); };
  auto grad = [&](int i) { return grad_in(table_, unit_grads, u, first + i); };
  const Real* G = delta_.data();
  // A low-rank factor w = w_a (m, r) w_b (r, n) given dw (m, n).
  auto low_rank_grads = [&](int i, const Real* dw, int m, int n) {
    if (Real* d = grad(i)) ops_.gemm(false, true, m, r, n, Real(1), dw, n, param(i + 1), n, Real(1), d, r);
    if (Real* d = grad(i + 1)) ops_.gemm(true, false, r, n, m, Real(1), param(i), r, dw, n, Real(1), d, n);
  };
  switch (a.type) {
    case ADAPTER_LOHA: {
      const size_t n = static_cast<size_t>(out) * in;
      ops_.multiply(work_[2].data(), G, work_[1].data(), n, scaling_);  // dP1
      low_rank_grads(0, work_[2].data(), out, in);
      ops_.multiply(work_[2].data(), G, work_[0].data(), n, scaling_);  // dP2
      low_rank_grads(2, work_[2].data(), out, in);
      return;
    }
    case ADAPTER_LOKR: {
      const LokrShape s = lokr_shape(a, in, out);
      const Real* w1 = s.w1_low_rank ? work_[0].data() : param(0);
      const int second = s.w1_low_rank ? 2 : 1;
      const Real* w2 = s.w2_low_rank ? work_[1].data() : param(second);
      ops_.kron_backward(work_[2].data(), work_[3].data(), G, w1, s.a, s.c, w2, s.b, s.d, scaling_);
      auto factor_grads = [&](int i, bool low_rank, const Real* dw, int m, int n) {
        if (low_rank) return low_rank_grads(i, dw, m, n);
        if (Real* d = grad(i)) ops_.residual_forward(d, d, dw, static_cast<size_t>(m) * n);
      };
      factor_grads(0, s.w1_low_rank, work_[2].data(), s.a, s.c);
      factor_grads(second, s.w2_low_rank, work_[3].data(), s.b, s.d);
      return;
    }
    case ADAPTER_OFT: {
      Real* dv = grad(0);
      if (!dv) return;
      const int b = a.block_size, blocks = oft_blocks(a, in), nv = b * (b - 1) / 2;
      const Real* W = work_[3].data();  // build_delta's copy
      for (int j = 0; j < in / b; j++)  // dR_j = G_j^T W_j, summed over the blocks when they share one
        ops_.gemm(true, false, b, b, out, Real(1), G + j * b, in, W + j * b, in, Real(a.block_share && j > 0),
                  work_[1].data() + (a.block_share ? 0 : j) * b * b, b);
      const size_t rotations = static_cast<size_t>(blocks) * b * b, params = static_cast<size_t>(blocks) * nv;
      host_.resize(std::max(rotations, params));
      host_double_.assign(params + 2 * rotations, 0.0);
      double* v = host_double_.data();  // the parameters again, the rotations' gradients, dv
      double* dR = v + params;
      double* dv_host = dR + rotations;
      ops_.device().copy_to_host(host_.data(), param(0), params * sizeof(Real));
      for (size_t i = 0; i < params; i++) v[i] = host_[i];
      ops_.device().copy_to_host(host_.data(), work_[1].data(), rotations * sizeof(Real));
      for (size_t i = 0; i < rotations; i++) dR[i] = host_[i];
      for (int j = 0; j < blocks; j++)
        oft_rotation(a).backward(v + j * nv, dR + static_cast<size_t>(j) * b * b, dv_host + j * nv);
      for (size_t i = 0; i < params; i++) host_[i] = static_cast<Real>(dv_host[i]);
      ops_.device().copy_to_device(work_[2].data(), host_.data(), params * sizeof(Real));
      ops_.residual_forward(dv, dv, work_[2].data(), params);
      return;
    }
    default: SHARD_CHECK(false, "DeltaLayers for adapter.type=%s", adapter_type_name(a.type));
  }
}

template <typename Real>
void DeltaLayers<Real>::forward(int layer, BlockProduct product, const Real* x, Real* out, int n,
                                const Real* unit) const {
  for (size_t k = 0; k < sites(layer).size(); k++) {
    const int first = table_.adapter_param(layer, static_cast<int>(k));
    const LinearSite& site = sites(layer)[k];
    if (first < 0 || site.product != product) continue;
    build_delta(layer, k, first, unit);
    ops_.gemm(false, true, n, site.out, site.in, Real(1), x, site.in, delta_.data(), site.in, Real(1),
              out + site.column, site.width);
  }
}

template <typename Real>
void DeltaLayers<Real>::backward(int layer, BlockProduct product, const Real* x, const Real* dout, Real* dx, int n,
                                 const Real* unit, Real* unit_grads) const {
  for (size_t k = 0; k < sites(layer).size(); k++) {
    const int first = table_.adapter_param(layer, static_cast<int>(k));
    const LinearSite& site = sites(layer)[k];
    if (first < 0 || site.product != product) continue;
    const Real* dy = dout + site.column;
    build_delta(layer, k, first, unit);
    ops_.gemm(false, false, n, site.in, site.out, Real(1), dy, site.width, delta_.data(), site.in, Real(1), dx, site.in);
    if (!unit_grads) continue;
    ops_.gemm(true, false, site.out, site.in, n, Real(1), dy, site.width, x, site.in, Real(0), delta_.data(), site.in);
    delta_backward(layer, k, first, unit, unit_grads);
  }
}

template class DeltaLayers<float>;
template class DeltaLayers<double>;

}  // namespace shardtrain
