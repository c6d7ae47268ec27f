// See oft.hpp. Gradients: for R = sum_k c_k Q^k, d/dQ = sum_k c_k sum_{i<k} (Q^T)^i dR (Q^T)^(k-1-i);
// for R = (I - Q) M with M = (I + Q)^-1, d/dQ = -(I + R)^T dR M^T; then dv(i,j) = dQ(i,j) - dQ(j,i).
#include "model/oft.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.hpp"

namespace shardtrain {

namespace {

using Matrix = std::vector<double>;

Matrix multiply(const Matrix& a, const Matrix& b, int n) {
  Matrix c(static_cast<size_t>(n) * n, 0.0);
  for (int i = 0; i < n; i++)
    for (int k = 0; k < n; k++) {
      const double x = a[i * n + k];
      for (int j = 0; j < n; j++) c[i * n + j] += x * b[k * n + j];
    }
  return c;
}

Matrix transpose(const Matrix& a, int n) {
  Matrix t(a.size());
  for (int i = 0; i < n; i++)
    for (int j = 0; j < n; j++) t[j * n + i] = a[i * n + j];
  return t;
}

Matrix identity(int n) {
  Matrix m(static_cast<size_t>(n) * n, 0.0);
  for (int i = 0; i < n; i++) m[i * n + i] = 1;
  return m;
}

Matrix skew(const double* v, int n) {
  Matrix q(static_cast<size_t>(n) * n, 0.0);
  size_t at = 0;
  for (int i = 0; i < n; i++)
    for (int j = i + 1; j < n; j++, at++) q[i * n + j] = v[at], q[j * n + i] = -v[at];
  return q;
}

// (I + Q)^-1 by Gauss-Jordan with partial pivoting: I + Q is invertible for skew Q (eigenvalues 1 + i t).
Matrix inverse_of_identity_plus(const Matrix& q, int n) {
  Matrix a = q, inv = identity(n);
  for (int i = 0; i < n; i++) a[i * n + i] += 1;
  for (int col = 0; col < n; col++) {
    int pivot = col;
    for (int r = col + 1; r < n; r++)
      if (std::fabs(a[r * n + col]) > std::fabs(a[pivot * n + col])) pivot = r;
    if (pivot != col)
      for (int j = 0; j < n; j++) std::swap(a[col * n + j], a[pivot * n + j]), std::swap(inv[col * n + j], inv[pivot * n + j]);
    const double d = a[col * n + col];
    SHARD_CHECK(d != 0, "OFT: I + Q is singular");
    for (int j = 0; j < n; j++) a[col * n + j] /= d, inv[col * n + j] /= d;
    for (int r = 0; r < n; r++) {
      if (r == col || a[r * n + col] == 0) continue;
      const double f = a[r * n + col];
      for (int j = 0; j < n; j++) a[r * n + j] -= f * a[col * n + j], inv[r * n + j] -= f * inv[col * n + j];
    }
  }
  return inv;
}

// The Cayley-Neumann series' coefficients c_0 .. c_K of Q^k, as PEFT sums them.
std::vector<double> neumann_coefficients(int terms) {
  if (terms <= 1) return {1};
  if (terms == 2) return {1, 2};
  const int last = std::max(terms - 1, 3);
  std::vector<double> c(last + 1, 2.0);
  c[0] = 1, c[last] = 1;
  return c;
}

}  // namespace

void OftRotation::forward(const double* v, double* R) const {
  const int n = block;
  const Matrix q = skew(v, n);
  Matrix r;
  if (cayley_neumann) {
    const std::vector<double> c = neumann_coefficients(neumann_terms);
    r = identity(n);
    Matrix power = identity(n);
    for (size_t k = 1; k < c.size(); k++) {
      power = multiply(power, q, n);
      for (size_t e = 0; e < r.size(); e++) r[e] += c[k] * power[e];
    }
  } else {
    Matrix i_minus_q = identity(n);
    for (size_t e = 0; e < q.size(); e++) i_minus_q[e] -= q[e];
    r = multiply(i_minus_q, inverse_of_identity_plus(q, n), n);
  }
  for (size_t e = 0; e < r.size(); e++) R[e] = r[e];
}

void OftRotation::backward(const double* v, const double* dR, double* dv) const {
  const int n = block;
  const Matrix q = skew(v, n), g(dR, dR + static_cast<size_t>(n) * n);
  Matrix dq(static_cast<size_t>(n) * n, 0.0);
  if (cayley_neumann) {
    const std::vector<double> c = neumann_coefficients(neumann_terms);
    const Matrix qt = transpose(q, n);
    // powers[i] = (Q^T)^i
    std::vector<Matrix> powers{identity(n)};
    for (size_t k = 1; k < c.size(); k++) powers.push_back(multiply(powers.back(), qt, n));
    for (size_t k = 1; k < c.size(); k++)
      for (size_t i = 0; i < k; i++) {
        const Matrix term = multiply(multiply(powers[i], g, n), powers[k - 1 - i], n);
        for (size_t e = 0; e < dq.size(); e++) dq[e] += c[k] * term[e];
      }
  } else {
    const Matrix m = inverse_of_identity_plus(q, n);
    Matrix r(static_cast<size_t>(n) * n);
    forward(v, r.data());
    for (int i = 0; i < n; i++) r[i * n + i] += 1;  // I + R
    dq = multiply(multiply(transpose(r, n), g, n), transpose(m, n), n);
    for (double& x : dq) x = -x;
  }
  size_t at = 0;
  for (int i = 0; i < n; i++)
    for (int j = i + 1; j < n; j++, at++) dv[at] += dq[i * n + j] - dq[j * n + i];
}

}  // namespace shardtrain
