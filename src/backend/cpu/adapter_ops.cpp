// LoHa's and LoKr's weight-delta arithmetic (backend/cpu/ops.hpp): a scaled elementwise product
// (LoHa's Hadamard product of two low-rank products) and a scaled Kronecker product with its two
// gradients (LoKr). Plain loops with a fixed schedule: each output element is computed by one
// thread, and each of kron_backward's sums adds its terms in row-major order in double, so the bits
// do not depend on the thread count.
#include <algorithm>
#include <climits>

#include "backend/cpu/ops.hpp"
#include "core/error.hpp"

namespace shardtrain::cpu {
namespace {

// kron_backward's dB: columns of a row of B summed together, this many at a time (a stack buffer
// of double accumulators; more tasks for the threads when B has few rows).
constexpr int kKronColumnBlock = 256;

// Non-negative factor shapes whose element counts and product rows and columns are ints.
bool kron_shape_ok(int p, int q, int r, int t) {
  auto fits = [](int x, int y) { return static_cast<long long>(x) * y <= INT_MAX; };
  return p >= 0 && q >= 0 && r >= 0 && t >= 0 && fits(p, q) && fits(r, t) && fits(p, r) && fits(q, t);
}

}  // namespace

template <typename Real>
void multiply(Real* out, const Real* a, const Real* b, size_t n, Real s) {
#pragma omp parallel for simd schedule(static)
  for (size_t i = 0; i < n; i++) out[i] = s * a[i] * b[i];
}

template <typename Real>
void kron(Real* out, const Real* A, int p, int q, const Real* B, int r, int t, Real s) {
  SHARD_CHECK(kron_shape_ok(p, q, r, t), "kron: p=%d q=%d r=%d t=%d", p, q, r, t);
  const size_t cols = static_cast<size_t>(q) * t;
  const int rows = p * r;
#pragma omp parallel for schedule(static)
  for (int row = 0; row < rows; row++) {
    const int i = row / r, k = row % r;
    const Real* b = B + static_cast<size_t>(k) * t;
    Real* o = out + static_cast<size_t>(row) * cols;
    for (int j = 0; j < q; j++) {
      const Real sa = s * A[static_cast<size_t>(i) * q + j];
      Real* oj = o + static_cast<size_t>(j) * t;
      for (int l = 0; l < t; l++) oj[l] = sa * b[l];
    }
  }
}

template <typename Real>
void kron_backward(Real* dA, Real* dB, const Real* dout, const Real* A, int p, int q, const Real* B, int r, int t,
                   Real s) {
  SHARD_CHECK(kron_shape_ok(p, q, r, t), "kron_backward: p=%d q=%d r=%d t=%d", p, q, r, t);
  const size_t cols = static_cast<size_t>(q) * t;  // dout's row length
  const double scale = static_cast<double>(s);
  if (dA) {
    // dA[i, j]: the (r, t) block of dout at block row i, block column j, dotted with B, (k, l) in order.
    const int elements = p * q;
#pragma omp parallel for schedule(static)
    for (int e = 0; e < elements; e++) {
      const int i = e / q, j = e % q;
      double sum = 0;
      for (int k = 0; k < r; k++) {
        const Real* d = dout + (static_cast<size_t>(i) * r + k) * cols + static_cast<size_t>(j) * t;
        const Real* b = B + static_cast<size_t>(k) * t;
        for (int l = 0; l < t; l++) sum += static_cast<double>(d[l]) * b[l];
      }
      dA[e] = static_cast<Real>(scale * sum);
    }
  }
  if (dB) {
    // dB[k, l]: element (k, l) of every block, weighted by A, (i, j) in order; a block of
    // consecutive l at a time so that each dout row segment is read contiguously.
    const int blocks_per_row = (t + kKronColumnBlock - 1) / kKronColumnBlock;
    const int tasks = r * blocks_per_row;
#pragma omp parallel for schedule(static)
    for (int task = 0; task < tasks; task++) {
      const int k = task / blocks_per_row;
      const int lo = (task % blocks_per_row) * kKronColumnBlock, hi = std::min(t, lo + kKronColumnBlock);
      double sum[kKronColumnBlock] = {};
      for (int i = 0; i < p; i++) {
        const Real* d_row = dout + (static_cast<size_t>(i) * r + k) * cols;
        for (int j = 0; j < q; j++) {
          const double a = static_cast<double>(A[static_cast<size_t>(i) * q + j]);
          const Real* d = d_row + static_cast<size_t>(j) * t;
          for (int l = lo; l < hi; l++) sum[l - lo] += static_cast<double>(d[l]) * a;
        }
      }
      Real* out = dB + static_cast<size_t>(k) * t;
      for (int l = lo; l < hi; l++) out[l] = static_cast<Real>(scale * sum[l - lo]);
    }
  }
}

#define INSTANTIATE(Real)                                                                                   \
  template void multiply<Real>(Real*, const Real*, const Real*, size_t, Real);                              \
  template void kron<Real>(Real*, const Real*, int, int, const Real*, int, int, Real);                      \
  template void kron_backward<Real>(Real*, Real*, const Real*, const Real*, int, int, const Real*, int, int, Real);
INSTANTIATE(float)
INSTANTIATE(double)
#undef INSTANTIATE

}  // namespace shardtrain::cpu
