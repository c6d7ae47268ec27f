// LoHa's and LoKr's weight-delta ops on the CPU (backend/cpu/ops.hpp: multiply, kron,
// kron_backward), through the LayerOps interface (cpu_layer_ops<Real>()), for float and double,
// against naive loops written here from the definitions:
//   - multiply and kron: against the exact value (in double) under the two roundings of
//     (s * a) * b, and bit for bit against the same expression evaluated in Real;
//   - kron_backward: against the explicit formula (a scatter over every element of dout, in
//     double) and, for double, against central differences of L(A, B) = sum(dout * kron(A, B));
//     the gradients are written, not accumulated (prefilled NaN must not leak), a null dA or dB
//     leaves the other's bits alone, and the bits do not depend on the OpenMP thread count.
// Shapes are odd on purpose (p=3, q=5, r=2, t=7), include vectors (1 x N, N x 1), a single element,
// empty factors, and s != 1 (negative too). Every buffer is guarded (support/tensor_check.hpp).
#include <gtest/gtest.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "backend/layer_ops.hpp"
#include "support/tensor_check.hpp"

namespace {

using shardtrain::cpu_layer_ops;
using shardtrain::testing::expect_close;
using shardtrain::testing::expect_guards_intact;
using shardtrain::testing::fill_uniform;
using shardtrain::testing::fill_value;
using shardtrain::testing::GuardedBuffer;
using shardtrain::testing::quiet_nan;
using shardtrain::testing::Tolerance;
using shardtrain::testing::unit_roundoff;

// (s * a) * b: two roundings, each within u relative of its exact value, so within 2u + u^2 of
// s * a * b, which the reference computes in double (exact for float inputs up to 2^-53).
template <typename Real>
Tolerance two_products() {
  return {0.0, 2.5 * unit_roundoff<Real>()};
}

template <typename Real>
::testing::AssertionResult bits_equal(const Real* actual, const Real* expected, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (std::memcmp(&actual[i], &expected[i], sizeof(Real)) != 0)
      return ::testing::AssertionFailure() << "first difference at element " << i << " of " << n << ": got "
                                           << actual[i] << ", expected " << expected[i];
  return ::testing::AssertionSuccess();
}

template <typename Real>
class AdapterOpsTest : public ::testing::Test {
 protected:
  static const shardtrain::LayerOps<Real>& ops() { return cpu_layer_ops<Real>(); }
};
using RealTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(AdapterOpsTest, RealTypes);

// ---- multiply --------------------------------------------------------------------------------------

TYPED_TEST(AdapterOpsTest, MultiplyMatchesNaiveLoop) {
  using Real = TypeParam;
  for (size_t n : {size_t{1}, size_t{7}, size_t{1001}}) {
    for (Real s : {Real(1), Real(0.37), Real(-2.5)}) {
      const std::string label = "multiply n=" + std::to_string(n) + " s=" + std::to_string(s);
      GuardedBuffer<Real> a(n, "a"), b(n, "b"), out(n, "out");
      fill_uniform(a.data(), n, 11, -2.0, 2.0);
      fill_uniform(b.data(), n, 12, -2.0, 2.0);
      std::vector<double> exact(n);
      std::vector<Real> naive(n);
      for (size_t i = 0; i < n; i++) {
        exact[i] = static_cast<double>(s) * static_cast<double>(a[i]) * static_cast<double>(b[i]);
        const Real sa = s * a[i];
        naive[i] = sa * b[i];
      }
      const std::vector<double> a0 = a.to_double(), b0 = b.to_double();

      fill_value(out.data(), n, quiet_nan<Real>());
      this->ops().multiply(out.data(), a.data(), b.data(), n, s);
      expect_close(out.data(), exact, two_products<Real>(), label);
      EXPECT_TRUE(bits_equal(out.data(), naive.data(), n)) << label << ": (s * a) * b in Real";
      EXPECT_EQ(a.to_double(), a0) << label << ": a changed";
      EXPECT_EQ(b.to_double(), b0) << label << ": b changed";

      this->ops().multiply(a.data(), a.data(), b.data(), n, s);  // out == a
      EXPECT_TRUE(bits_equal(a.data(), naive.data(), n)) << label << ": in place on a";
      fill_uniform(a.data(), n, 11, -2.0, 2.0);
      this->ops().multiply(b.data(), a.data(), b.data(), n, s);  // out == b
      EXPECT_TRUE(bits_equal(b.data(), naive.data(), n)) << label << ": in place on b";
      expect_guards_intact(label, a, b, out);
    }
  }
}

// ---- kron and kron_backward ------------------------------------------------------------------------

struct KronShape {
  int p, q, r, t;
  size_t a_size() const { return static_cast<size_t>(p) * q; }
  size_t b_size() const { return static_cast<size_t>(r) * t; }
  size_t out_size() const { return a_size() * b_size(); }
};
std::string name_of(const KronShape& s) {
  return "p" + std::to_string(s.p) + "_q" + std::to_string(s.q) + "_r" + std::to_string(s.r) + "_t" +
         std::to_string(s.t);
}

const KronShape kKronShapes[] = {
    {3, 5, 2, 7},   // the odd case
    {1, 9, 1, 4},   // 1 x N factors: a 1 x 36 product
    {1, 1, 1, 13},  // A a single element
    {4, 1, 3, 1},   // N x 1 factors
    {1, 1, 1, 1},   // one element
    {2, 3, 5, 4},   // B bigger than A
    {6, 7, 1, 1},   // B a single element
    {3, 4, 17, 300},  // dB's column blocks: 300 = 256 + 44
    {2, 3, 0, 4},   // empty B: nothing to write but dA = s * 0
    {0, 3, 2, 2},   // empty A: nothing to write but dB = s * 0
};

// The reference from the definition, in double: every element of the product, written in the
// product's own order.
template <typename Real>
std::vector<double> kron_reference(const Real* A, const Real* B, const KronShape& s, double scale) {
  std::vector<double> out(s.out_size());
  const size_t cols = static_cast<size_t>(s.q) * s.t;
  for (int i = 0; i < s.p; i++)
    for (int j = 0; j < s.q; j++)
      for (int k = 0; k < s.r; k++)
        for (int l = 0; l < s.t; l++)
          out[(static_cast<size_t>(i) * s.r + k) * cols + static_cast<size_t>(j) * s.t + l] =
              scale * static_cast<double>(A[i * s.q + j]) * static_cast<double>(B[k * s.t + l]);
  return out;
}

// The explicit gradients, in double, by scattering every element of dout onto the A and B
// elements it multiplies (walking dout in memory order), then scaling. abs_a and abs_b get the
// same sums of absolute values (times |s|): the size of the terms, for the tolerance.
template <typename Real>
void kron_backward_reference(std::vector<double>& dA, std::vector<double>& dB, std::vector<double>& abs_a,
                             std::vector<double>& abs_b, const Real* dout, const Real* A, const Real* B,
                             const KronShape& s, double scale) {
  dA.assign(s.a_size(), 0.0);
  dB.assign(s.b_size(), 0.0);
  abs_a.assign(s.a_size(), 0.0);
  abs_b.assign(s.b_size(), 0.0);
  const int rows = s.p * s.r, cols = s.q * s.t;
  for (int row = 0; row < rows; row++)
    for (int col = 0; col < cols; col++) {
      const int i = row / s.r, k = row % s.r, j = col / s.t, l = col % s.t;
      const double d = dout[static_cast<size_t>(row) * cols + col];
      const double a = A[i * s.q + j], b = B[k * s.t + l];
      dA[i * s.q + j] += d * b;
      dB[k * s.t + l] += d * a;
      abs_a[i * s.q + j] += std::fabs(d * b);
      abs_b[k * s.t + l] += std::fabs(d * a);
    }
  for (double& v : dA) v *= scale;
  for (double& v : dB) v *= scale;
  for (double& v : abs_a) v *= std::fabs(scale);
  for (double& v : abs_b) v *= std::fabs(scale);
}

// A sum of `terms` terms in double errs by at most terms * 2^-53 * sum|terms| (times 2 for
// double Real, whose products round too); then the result rounds once to Real (u relative).
template <typename Real>
Tolerance sum_tolerance(size_t terms, const std::vector<double>& abs_sums) {
  double abs_max = 0;
  for (double v : abs_sums) abs_max = std::max(abs_max, v);
  return {4.0 * static_cast<double>(terms + 1) * 0x1p-53 * abs_max, 2.0 * unit_roundoff<Real>()};
}

TYPED_TEST(AdapterOpsTest, KronMatchesNaiveLoop) {
  using Real = TypeParam;
  for (const KronShape& s : kKronShapes) {
    for (Real scale : {Real(1), Real(0.75), Real(-1.3)}) {
      const std::string label = "kron " + name_of(s) + " s=" + std::to_string(scale);
      GuardedBuffer<Real> A(s.a_size(), "A"), B(s.b_size(), "B"), out(s.out_size(), "out");
      fill_uniform(A.data(), A.size(), 21, -2.0, 2.0);
      fill_uniform(B.data(), B.size(), 22, -2.0, 2.0);
      const std::vector<double> ref = kron_reference(A.data(), B.data(), s, scale);
      std::vector<Real> naive(s.out_size());  // (s * A[i, j]) * B[k, l] in Real, the product's order
      for (size_t e = 0; e < naive.size(); e++) {
        const size_t cols = static_cast<size_t>(s.q) * s.t, row = e / cols, col = e % cols;
        const Real sa = scale * A[(row / s.r) * s.q + col / s.t];
        naive[e] = sa * B[(row % s.r) * s.t + col % s.t];
      }
      const std::vector<double> A0 = A.to_double(), B0 = B.to_double();
      fill_value(out.data(), out.size(), quiet_nan<Real>());
      this->ops().kron(out.data(), A.data(), s.p, s.q, B.data(), s.r, s.t, scale);
      expect_close(out.data(), ref, two_products<Real>(), label);
      EXPECT_TRUE(bits_equal(out.data(), naive.data(), naive.size())) << label << ": (s * A) * B in Real";
      EXPECT_EQ(A.to_double(), A0) << label << ": A changed";
      EXPECT_EQ(B.to_double(), B0) << label << ": B changed";
      expect_guards_intact(label, A, B, out);
    }
  }
}

// Kron by hand at small integers: kron([[1, 2]], [[1], [10]]) * 3 = [[3, 6], [30, 60]].
TYPED_TEST(AdapterOpsTest, KronOfSmallIntegers) {
  using Real = TypeParam;
  const Real A[] = {1, 2}, B[] = {1, 10};
  Real out[4];
  this->ops().kron(out, A, 1, 2, B, 2, 1, Real(3));
  EXPECT_EQ(out[0], Real(3));
  EXPECT_EQ(out[1], Real(6));
  EXPECT_EQ(out[2], Real(30));
  EXPECT_EQ(out[3], Real(60));
  Real dA[2], dB[2];
  const Real dout[] = {1, 0, 0, 1};  // picks A[0] * B[0] and A[1] * B[1]
  this->ops().kron_backward(dA, dB, dout, A, 1, 2, B, 2, 1, Real(3));
  EXPECT_EQ(dA[0], Real(3));   // 3 * (1 * 1 + 0 * 10)
  EXPECT_EQ(dA[1], Real(30));  // 3 * (0 * 1 + 1 * 10)
  EXPECT_EQ(dB[0], Real(3));   // 3 * (1 * 1 + 0 * 2)
  EXPECT_EQ(dB[1], Real(6));   // 3 * (0 * 1 + 1 * 2)
}

TYPED_TEST(AdapterOpsTest, KronBackwardMatchesExplicitFormula) {
  using Real = TypeParam;
  for (const KronShape& s : kKronShapes) {
    for (Real scale : {Real(1), Real(0.75), Real(-1.3)}) {
      const std::string label = "kron_backward " + name_of(s) + " s=" + std::to_string(scale);
      GuardedBuffer<Real> A(s.a_size(), "A"), B(s.b_size(), "B"), dout(s.out_size(), "dout");
      GuardedBuffer<Real> dA(s.a_size(), "dA"), dB(s.b_size(), "dB");
      fill_uniform(A.data(), A.size(), 31, -2.0, 2.0);
      fill_uniform(B.data(), B.size(), 32, -2.0, 2.0);
      fill_uniform(dout.data(), dout.size(), 33);
      std::vector<double> ref_a, ref_b, abs_a, abs_b;
      kron_backward_reference(ref_a, ref_b, abs_a, abs_b, dout.data(), A.data(), B.data(), s, scale);
      const std::vector<double> A0 = A.to_double(), B0 = B.to_double(), dout0 = dout.to_double();

      std::vector<Real> first_a, first_b;
      for (int call = 0; call < 2; call++) {  // written, not accumulated: the second call repeats the first
        fill_value(dA.data(), dA.size(), quiet_nan<Real>());
        fill_value(dB.data(), dB.size(), quiet_nan<Real>());
        this->ops().kron_backward(dA.data(), dB.data(), dout.data(), A.data(), s.p, s.q, B.data(), s.r, s.t, scale);
        if (call == 0) {
          expect_close(dA.data(), ref_a, sum_tolerance<Real>(s.b_size(), abs_a), label + " dA");
          expect_close(dB.data(), ref_b, sum_tolerance<Real>(s.a_size(), abs_b), label + " dB");
          first_a.assign(dA.data(), dA.data() + dA.size());
          first_b.assign(dB.data(), dB.data() + dB.size());
        } else {
          EXPECT_TRUE(bits_equal(dA.data(), first_a.data(), first_a.size())) << label << ": dA rerun";
          EXPECT_TRUE(bits_equal(dB.data(), first_b.data(), first_b.size())) << label << ": dB rerun";
        }
      }
      // Prefilled garbage (not NaN) is overwritten just the same.
      fill_value(dA.data(), dA.size(), Real(123));
      fill_value(dB.data(), dB.size(), Real(-7));
      this->ops().kron_backward(dA.data(), dB.data(), dout.data(), A.data(), s.p, s.q, B.data(), s.r, s.t, scale);
      EXPECT_TRUE(bits_equal(dA.data(), first_a.data(), first_a.size())) << label << ": dA over a prefill";
      EXPECT_TRUE(bits_equal(dB.data(), first_b.data(), first_b.size())) << label << ": dB over a prefill";

      // A null gradient: not computed, the other the same bits.
      fill_value(dA.data(), dA.size(), quiet_nan<Real>());
      fill_value(dB.data(), dB.size(), quiet_nan<Real>());
      this->ops().kron_backward(dA.data(), nullptr, dout.data(), A.data(), s.p, s.q, B.data(), s.r, s.t, scale);
      EXPECT_TRUE(bits_equal(dA.data(), first_a.data(), first_a.size())) << label << ": dA with dB null";
      for (size_t e = 0; e < dB.size(); e++) ASSERT_TRUE(std::isnan(dB[e])) << label << ": dB written through null";
      this->ops().kron_backward(nullptr, dB.data(), dout.data(), A.data(), s.p, s.q, B.data(), s.r, s.t, scale);
      EXPECT_TRUE(bits_equal(dB.data(), first_b.data(), first_b.size())) << label << ": dB with dA null";

      EXPECT_EQ(A.to_double(), A0) << label << ": A changed";
      EXPECT_EQ(B.to_double(), B0) << label << ": B changed";
      EXPECT_EQ(dout.to_double(), dout0) << label << ": dout changed";
      expect_guards_intact(label, A, B, dout, dA, dB);
    }
  }
}

// Central differences of L(A, B) = sum(dout * kron(A, B) * s), with kron the naive double loop:
// L is linear in each element, so the difference quotient is exact but for rounding (~1e-13).
TEST(AdapterOpsDouble, KronBackwardMatchesFiniteDifferences) {
  const auto& ops = cpu_layer_ops<double>();
  for (const KronShape& s : {KronShape{3, 5, 2, 7}, KronShape{1, 9, 1, 4}, KronShape{4, 1, 3, 1}}) {
    const double scale = -0.6;
    std::vector<double> A(s.a_size()), B(s.b_size()), dout(s.out_size());
    fill_uniform(A.data(), A.size(), 41, -2.0, 2.0);
    fill_uniform(B.data(), B.size(), 42, -2.0, 2.0);
    fill_uniform(dout.data(), dout.size(), 43);
    auto loss = [&](const std::vector<double>& a, const std::vector<double>& b) {
      const std::vector<double> out = kron_reference(a.data(), b.data(), s, scale);
      double sum = 0;
      for (size_t e = 0; e < out.size(); e++) sum += dout[e] * out[e];
      return sum;
    };
    std::vector<double> dA(s.a_size()), dB(s.b_size());
    ops.kron_backward(dA.data(), dB.data(), dout.data(), A.data(), s.p, s.q, B.data(), s.r, s.t, scale);
    const double h = 1e-3;
    std::vector<double> fd_a(A.size()), fd_b(B.size());
    for (size_t e = 0; e < A.size(); e++) {
      std::vector<double> plus = A, minus = A;
      plus[e] += h;
      minus[e] -= h;
      fd_a[e] = (loss(plus, B) - loss(minus, B)) / (2 * h);
    }
    for (size_t e = 0; e < B.size(); e++) {
      std::vector<double> plus = B, minus = B;
      plus[e] += h;
      minus[e] -= h;
      fd_b[e] = (loss(A, plus) - loss(A, minus)) / (2 * h);
    }
    expect_close(dA.data(), fd_a, 1e-9, 1e-9, "kron_backward dA vs finite differences " + name_of(s));
    expect_close(dB.data(), fd_b, 1e-9, 1e-9, "kron_backward dB vs finite differences " + name_of(s));
  }
}

// Each output element is one thread's fixed-order sum: 1, 2 or 3 threads give the same bits.
TYPED_TEST(AdapterOpsTest, KronBackwardBitsDoNotDependOnThreads) {
  using Real = TypeParam;
  const KronShape s{5, 6, 33, 301};
  std::vector<Real> A(s.a_size()), B(s.b_size()), dout(s.out_size());
  fill_uniform(A.data(), A.size(), 51);
  fill_uniform(B.data(), B.size(), 52);
  fill_uniform(dout.data(), dout.size(), 53);
  const int saved = omp_get_max_threads();
  std::vector<Real> first_a, first_b, first_out;
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    std::vector<Real> dA(s.a_size()), dB(s.b_size()), out(s.out_size());
    this->ops().kron_backward(dA.data(), dB.data(), dout.data(), A.data(), s.p, s.q, B.data(), s.r, s.t, Real(0.5));
    this->ops().kron(out.data(), A.data(), s.p, s.q, B.data(), s.r, s.t, Real(0.5));
    if (threads == 1) {
      first_a = dA;
      first_b = dB;
      first_out = out;
      continue;
    }
    EXPECT_TRUE(bits_equal(dA.data(), first_a.data(), dA.size())) << threads << " threads: dA";
    EXPECT_TRUE(bits_equal(dB.data(), first_b.data(), dB.size())) << threads << " threads: dB";
    EXPECT_TRUE(bits_equal(out.data(), first_out.data(), out.size())) << threads << " threads: kron";
  }
  omp_set_num_threads(saved);
}

}  // namespace
