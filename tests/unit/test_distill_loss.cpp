// Knowledge distillation's fused loss on the CPU (backend/cpu/ops.hpp: distill_loss_forward),
// through the LayerOps interface (cpu_layer_ops<Real>()), for float and double:
//   - against a naive double reference written here from the definition (log-softmax by loops:
//     CE = -log softmax(s)[target], KL = sum_i p_i (log p_i - log q_i) with p = softmax(t / T),
//     q = softmax(s / T), and the gradient from the formula), over several N and V (odd V = 37),
//     alpha in {0, 0.3, 1}, T in {0.5, 1, 2.5}, logits shifted by 50 and -7 (max subtraction);
//   - alpha = 1 against the cross-entropy op (softmax_crossentropy_forward, then its backward with
//     dloss = 1), at any temperature;
//   - a teacher equal to the student: KL = 0, the loss alpha CE, the gradient alpha times the
//     cross-entropy's, and exactly 0 with alpha = 0;
//   - (double) the gradient against central finite differences of the losses (h = 1e-6);
//   - extreme logits (a +-80 spread, rows shifted by 1000, teacher rows whose probabilities
//     underflow) stay finite, match the reference, and each gradient row sums to ~0;
//   - the bits do not depend on the OpenMP thread count; N = 0 writes nothing.
// Every buffer is guarded (support/tensor_check.hpp); the teacher is checked bit for bit unchanged.
#include <gtest/gtest.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "backend/layer_ops.hpp"
#include "model/batch.hpp"
#include "support/tensor_check.hpp"

namespace {

using shardtrain::cpu_layer_ops;
using shardtrain::testing::expect_close;
using shardtrain::testing::expect_guards_intact;
using shardtrain::testing::fill_indices;
using shardtrain::testing::fill_uniform;
using shardtrain::testing::fill_value;
using shardtrain::testing::GuardedBuffer;
using shardtrain::testing::quiet_nan;
using shardtrain::testing::Tolerance;
using shardtrain::testing::unit_roundoff;
using shardtrain::testing::type_name;

template <typename Real>
::testing::AssertionResult bits_equal(const Real* actual, const Real* expected, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (std::memcmp(&actual[i], &expected[i], sizeof(Real)) != 0)
      return ::testing::AssertionFailure() << "first difference at element " << i << " of " << n << ": got "
                                           << actual[i] << ", expected " << expected[i];
  return ::testing::AssertionSuccess();
}

// ---- the naive reference ---------------------------------------------------------------------------

// log softmax(x / T) of one row, by loops, in double.
std::vector<double> log_softmax(const double* x, int V, double T) {
  double max = x[0] / T;
  for (int i = 1; i < V; i++) max = std::max(max, x[i] / T);
  double sum = 0;
  for (int i = 0; i < V; i++) sum += std::exp(x[i] / T - max);
  const double lse = max + std::log(sum);
  std::vector<double> out(V);
  for (int i = 0; i < V; i++) out[i] = x[i] / T - lse;
  return out;
}

struct Reference {
  std::vector<double> losses, grad, ce, kl;
};

Reference reference(const std::vector<double>& s, const std::vector<double>& t, const std::vector<int>& targets,
                    int N, int V, double alpha, double T) {
  Reference ref;
  ref.losses.resize(N), ref.ce.resize(N), ref.kl.resize(N), ref.grad.resize(static_cast<size_t>(N) * V);
  for (int r = 0; r < N; r++) {
    const double* sr = s.data() + static_cast<size_t>(r) * V;
    const double* tr = t.data() + static_cast<size_t>(r) * V;
    const std::vector<double> log_softmax_s = log_softmax(sr, V, 1.0), log_q = log_softmax(sr, V, T),
                              log_p = log_softmax(tr, V, T);
    double kl = 0;
    for (int i = 0; i < V; i++) kl += std::exp(log_p[i]) * (log_p[i] - log_q[i]);  // exp -> 0: adds 0
    ref.ce[r] = -log_softmax_s[targets[r]];
    ref.kl[r] = kl;
    ref.losses[r] = alpha * ref.ce[r] + (1 - alpha) * T * T * kl;
    for (int i = 0; i < V; i++)
      ref.grad[static_cast<size_t>(r) * V + i] =
          alpha * (std::exp(log_softmax_s[i]) - (i == targets[r] ? 1.0 : 0.0)) +
          (1 - alpha) * T * (std::exp(log_q[i]) - std::exp(log_p[i]));
  }
  return ref;
}

// ---- tolerance model -------------------------------------------------------------------------------
//
// u: a unit roundoff. Each exponential's argument a (<= 0, |a| <= A, A the largest spread of a
// row's logits over the temperature) is rounded to Real (relative error u |a| of exp(a)) and
// exp_fast adds ~2 ulp (4 u), so each probability p_i is within u p_i (|a_i| + A + 8) of the exact
// one (the normalisation adds the mean argument error), and p_i |a_i| <= 1/e: within u (A + 9).
// Gradient: alpha of that at T = 1, plus (1 - alpha) T times two of them at T, plus the final
// rounding (rtol). Loss: the CE's log Z is within u (A + 4); the KL sum errs by at most
// u (2A + 8) sum p_i |d_i| (d_i = log p_i - log q_i, sum p_i |d_i| <= 2 (A + log V)) plus the two
// log Z's errors. The op's error is this model with Real's u; the double reference's is the same
// model with u = 2^-53, its arguments x / T - lse erring by up to u 2M / T (M = max |logit|: it
// never subtracts the row maximum exactly).
struct Spread {
  double student = 0, teacher = 0;  // the largest max - min over rows
  double magnitude = 0;             // the largest |logit|
};

template <typename Real>
Spread spread_of(const Real* s, const Real* t, int N, int V) {
  Spread sp;
  for (int r = 0; r < N; r++) {
    const Real* sr = s + static_cast<size_t>(r) * V;
    const Real* tr = t + static_cast<size_t>(r) * V;
    sp.student = std::max(sp.student, static_cast<double>(*std::max_element(sr, sr + V) - *std::min_element(sr, sr + V)));
    sp.teacher = std::max(sp.teacher, static_cast<double>(*std::max_element(tr, tr + V) - *std::min_element(tr, tr + V)));
    for (int i = 0; i < V; i++)
      sp.magnitude = std::max({sp.magnitude, std::fabs(static_cast<double>(sr[i])), std::fabs(static_cast<double>(tr[i]))});
  }
  return sp;
}

Tolerance grad_model(double u, double a1, double aT, double alpha, double T) {
  return {u * (alpha * (a1 + 9) + (1 - alpha) * T * 2 * (aT + 9)), u};
}
Tolerance loss_model(double u, double a1, double aT, int V, double alpha, double T) {
  const double kl = (2 * aT + 8) * 2 * (aT + std::log(V)) + 2 * (aT + 4);
  return {u * (alpha * (a1 + 4) + (1 - alpha) * T * T * kl), u};
}
Tolerance operator+(Tolerance x, Tolerance y) { return {x.atol + y.atol, x.rtol + y.rtol}; }

template <typename Real>
Tolerance grad_tolerance(const Spread& sp, int V, double alpha, double T) {
  const double a1 = sp.student, aT = std::max(sp.student, sp.teacher) / T, m = 2 * sp.magnitude;
  return grad_model(unit_roundoff<Real>(), a1, aT, alpha, T) + grad_model(0x1p-53, a1 + m, aT + m / T, alpha, T);
}

template <typename Real>
Tolerance loss_tolerance(const Spread& sp, int V, double alpha, double T) {
  const double a1 = sp.student, aT = std::max(sp.student, sp.teacher) / T, m = 2 * sp.magnitude;
  return loss_model(unit_roundoff<Real>(), a1, aT, V, alpha, T) +
         loss_model(0x1p-53, a1 + m, aT + m / T, V, alpha, T);
}

// ---- one call --------------------------------------------------------------------------------------

template <typename Real>
struct Inputs {
  int N, V;
  GuardedBuffer<Real> student, teacher;
  GuardedBuffer<int> targets;
  Inputs(int n, int v)
      : N(n), V(v), student(static_cast<size_t>(n) * v, "student"), teacher(static_cast<size_t>(n) * v, "teacher"),
        targets(n, "targets") {}
};

// Student and teacher logits uniform in [shift - 4, shift + 4), independent; targets uniform.
template <typename Real>
Inputs<Real> random_inputs(int N, int V, uint64_t seed, double shift = 0) {
  Inputs<Real> in(N, V);
  fill_uniform(in.student.data(), in.student.size(), seed, shift - 4, shift + 4);
  fill_uniform(in.teacher.data(), in.teacher.size(), seed + 1, shift - 4, shift + 4);
  fill_indices(in.targets.data(), N, seed + 2, V);
  return in;
}

template <typename Real>
struct Outputs {
  GuardedBuffer<Real> losses, grad;
};

// Runs the op on a copy of the inputs (losses prefilled with NaN); checks every guard and that the
// teacher and targets are unchanged.
template <typename Real>
Outputs<Real> run(const Inputs<Real>& in, Real alpha, Real T, const std::string& label) {
  Outputs<Real> out{GuardedBuffer<Real>(in.N, "losses"), GuardedBuffer<Real>(in.student.size(), "student_to_grad")};
  fill_value(out.losses.data(), out.losses.size(), quiet_nan<Real>());
  std::copy(in.student.data(), in.student.data() + in.student.size(), out.grad.data());
  GuardedBuffer<Real> teacher(in.teacher.size(), "teacher");
  std::copy(in.teacher.data(), in.teacher.data() + in.teacher.size(), teacher.data());
  cpu_layer_ops<Real>().distill_loss_forward(out.losses.data(), out.grad.data(), teacher.data(), in.targets.data(),
                                             in.N, in.V, alpha, T);
  expect_guards_intact(label, out.losses, out.grad, teacher, in.targets);
  EXPECT_TRUE(bits_equal(teacher.data(), in.teacher.data(), teacher.size())) << label << ": the teacher was written";
  return out;
}

std::string describe(int N, int V, double alpha, double T) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "N=%d V=%d alpha=%g T=%g", N, V, alpha, T);
  return buf;
}

template <typename Real>
class DistillLossTest : public ::testing::Test {};
using RealTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(DistillLossTest, RealTypes);

const double kAlphas[] = {0.0, 0.3, 1.0};
const double kTemperatures[] = {0.5, 1.0, 2.5};

struct Shape {
  int N, V;
  double shift;
};
const Shape kShapes[] = {{1, 2, 0}, {3, 37, 0}, {5, 64, 50}, {2, 1000, 0}, {4, 257, -7}};

// ---- tests -----------------------------------------------------------------------------------------

TYPED_TEST(DistillLossTest, MatchesNaiveReference) {
  using Real = TypeParam;
  uint64_t seed = 100;
  for (const Shape& shape : kShapes) {
    const Inputs<Real> in = random_inputs<Real>(shape.N, shape.V, seed += 10, shape.shift);
    const Spread sp = spread_of(in.student.data(), in.teacher.data(), in.N, in.V);
    for (double alpha_d : kAlphas)
      for (double T_d : kTemperatures) {
        const Real alpha = static_cast<Real>(alpha_d), T = static_cast<Real>(T_d);
        const std::string label = std::string(type_name<Real>()) + " " + describe(in.N, in.V, alpha, T) +
                                  " shift=" + std::to_string(shape.shift);
        const Outputs<Real> out = run(in, alpha, T, label);
        const Reference ref = reference(in.student.to_double(), in.teacher.to_double(),
                                        std::vector<int>(in.targets.data(), in.targets.data() + in.N), in.N, in.V,
                                        static_cast<double>(alpha), static_cast<double>(T));
        expect_close(out.losses.data(), ref.losses, loss_tolerance<Real>(sp, in.V, alpha, T), label + " losses");
        expect_close(out.grad.data(), ref.grad, grad_tolerance<Real>(sp, in.V, alpha, T), label + " gradient");
      }
  }
}

// alpha = 1: the cross-entropy op's losses and (backward with dloss = 1) its gradient, whatever T.
// The cross-entropy op sums in Real and scales by 1/sum in Real: its fp32 error model (tests/unit/
// test_layers.cpp) is 4 (V + 8) u; in double both sides are within ~1e-15 of the exact value.
TYPED_TEST(DistillLossTest, AlphaOneIsTheCrossEntropyOp) {
  using Real = TypeParam;
  for (const Shape& shape : kShapes) {
    const Inputs<Real> in = random_inputs<Real>(shape.N, shape.V, 300 + shape.V, shape.shift);
    std::vector<Real> probs(in.student.data(), in.student.data() + in.student.size()), ce_losses(in.N);
    const auto& ops = cpu_layer_ops<Real>();
    ops.softmax_crossentropy_forward(ce_losses.data(), probs.data(), in.targets.data(), in.N, in.V);
    ops.softmax_crossentropy_backward(probs.data(), in.targets.data(), Real(1), in.N, in.V);
    const double k = 4.0 * (in.V + 8 + std::fabs(shape.shift)) * unit_roundoff<float>();
    const Tolerance tol = std::is_same_v<Real, float> ? Tolerance{k, k} : Tolerance{1e-12, 1e-12};
    for (double T : kTemperatures) {
      const std::string label = std::string(type_name<Real>()) + " " + describe(in.N, in.V, 1, T);
      const Outputs<Real> out = run(in, Real(1), static_cast<Real>(T), label);
      expect_close(out.losses.data(), std::vector<double>(ce_losses.begin(), ce_losses.end()), tol, label + " losses");
      expect_close(out.grad.data(), std::vector<double>(probs.begin(), probs.end()), tol, label + " gradient");
    }
  }
}

// teacher == student: KL(p || p) = 0 and softmax(s/T) - softmax(t/T) = 0 -- exactly, since the op
// runs the same operations on the same numbers. So the loss is alpha times the alpha = 1 loss (up
// to the two roundings), the gradient alpha times the alpha = 1 gradient, and with alpha = 0 both
// are exactly 0.
TYPED_TEST(DistillLossTest, TeacherEqualToStudentAddsNoKl) {
  using Real = TypeParam;
  const double u = unit_roundoff<Real>();
  for (const Shape& shape : kShapes) {
    Inputs<Real> in = random_inputs<Real>(shape.N, shape.V, 400 + shape.V, shape.shift);
    std::copy(in.student.data(), in.student.data() + in.student.size(), in.teacher.data());
    for (double T_d : kTemperatures) {
      const Real T = static_cast<Real>(T_d);
      const Outputs<Real> ce = run(in, Real(1), T, "alpha=1");
      for (double alpha_d : kAlphas) {
        const Real alpha = static_cast<Real>(alpha_d);
        const double a = static_cast<double>(alpha);
        const std::string label = std::string(type_name<Real>()) + " teacher=student " + describe(in.N, in.V, a, T);
        const Outputs<Real> out = run(in, alpha, T, label);
        std::vector<double> scaled_losses(in.N), scaled_grad(out.grad.size());
        for (int r = 0; r < in.N; r++) scaled_losses[r] = a * static_cast<double>(ce.losses[r]);
        for (size_t i = 0; i < scaled_grad.size(); i++) scaled_grad[i] = a * static_cast<double>(ce.grad[i]);
        expect_close(out.losses.data(), scaled_losses, 0.0, 3 * u, label + " losses = alpha CE");
        expect_close(out.grad.data(), scaled_grad, 0.0, 3 * u, label + " gradient = alpha CE's");
        if (alpha_d == 0.0) {
          for (int r = 0; r < in.N; r++) EXPECT_EQ(out.losses[r], Real(0)) << label << " row " << r;
          for (size_t i = 0; i < out.grad.size(); i++) ASSERT_EQ(out.grad[i], Real(0)) << label << " element " << i;
        }
      }
    }
  }
}

// Extreme logits: student rows with a +-80 spread (one shifted by +1000, where exp without the
// max subtraction overflows), teacher rows whose probabilities underflow at T = 0.5 (one-hot-like
// rows of +-80, and rows of +-400 where even double's exp(-1600) is 0). Finite everywhere, each
// gradient row sums to ~0 (both softmax differences do), and the naive reference still agrees.
TYPED_TEST(DistillLossTest, ExtremeLogitsStayFinite) {
  using Real = TypeParam;
  const int N = 4, V = 37;
  Inputs<Real> in(N, V);
  fill_uniform(in.student.data(), in.student.size(), 501, -80.0, 80.0);
  fill_uniform(in.teacher.data(), in.teacher.size(), 502, -80.0, 80.0);
  fill_indices(in.targets.data(), N, 503, V);
  for (int i = 0; i < V; i++) {
    in.student[1 * V + i] += Real(1000);                 // row 1: shifted far from 0
    in.teacher[2 * V + i] = i == 5 ? Real(80) : Real(-80);  // row 2: one teacher token, the rest exp(-320)
    in.teacher[3 * V + i] = i % 2 ? Real(400) : Real(-400);  // row 3: half the teacher's tokens at exp(-1600)
  }
  in.targets[2] = 6;  // a target the teacher gives ~0
  Spread sp = spread_of(in.student.data(), in.teacher.data(), N, V);
  sp.student = 160;  // row 1's shift is no spread (magnitude, for the reference's error)
  for (double alpha_d : kAlphas)
    for (double T_d : kTemperatures) {
      const Real alpha = static_cast<Real>(alpha_d), T = static_cast<Real>(T_d);
      const std::string label = std::string(type_name<Real>()) + " extreme " + describe(N, V, alpha, T);
      const Outputs<Real> out = run(in, alpha, T, label);
      for (int r = 0; r < N; r++) {
        ASSERT_TRUE(std::isfinite(static_cast<double>(out.losses[r]))) << label << " row " << r;
        EXPECT_GE(out.losses[r], Real(0)) << label << " row " << r;  // CE >= 0, KL >= 0 (up to rounding: > -tiny)
        double row_sum = 0, row_abs = 0;
        for (int i = 0; i < V; i++) {
          const double g = static_cast<double>(out.grad[static_cast<size_t>(r) * V + i]);
          ASSERT_TRUE(std::isfinite(g)) << label << " row " << r << " element " << i;
          row_sum += g, row_abs += std::fabs(g);
        }
        EXPECT_LE(std::fabs(row_sum), 8 * V * unit_roundoff<Real>() * std::max(1.0, row_abs)) << label << " row " << r;
      }
      const Reference ref = reference(in.student.to_double(), in.teacher.to_double(),
                                      std::vector<int>(in.targets.data(), in.targets.data() + N), N, V,
                                      static_cast<double>(alpha), static_cast<double>(T));
      expect_close(out.losses.data(), ref.losses, loss_tolerance<Real>(sp, V, alpha, T), label + " losses");
      expect_close(out.grad.data(), ref.grad, grad_tolerance<Real>(sp, V, alpha, T), label + " gradient");
    }
}

// Rows are independent and each is summed sequentially: 1, 3 and 8 threads give the same bits.
TYPED_TEST(DistillLossTest, BitsDoNotDependOnThreadCount) {
  using Real = TypeParam;
  const Inputs<Real> in = random_inputs<Real>(13, 301, 600);
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const Outputs<Real> one = run(in, Real(0.3), Real(2.5), "1 thread");
  for (int threads : {3, 8}) {
    omp_set_num_threads(threads);
    const Outputs<Real> many = run(in, Real(0.3), Real(2.5), std::to_string(threads) + " threads");
    EXPECT_TRUE(bits_equal(many.losses.data(), one.losses.data(), one.losses.size())) << threads << " threads";
    EXPECT_TRUE(bits_equal(many.grad.data(), one.grad.data(), one.grad.size())) << threads << " threads";
  }
  omp_set_num_threads(saved);
}

// A loss mask's ignored target (IGNORED_TARGET): the row has neither term nor gradient, and the
// other rows are what they are without it.
TYPED_TEST(DistillLossTest, IgnoredTargetsGiveNoLossAndNoGradient) {
  using Real = TypeParam;
  const int N = 7, V = 50;
  Inputs<Real> in = random_inputs<Real>(N, V, 61);
  const Outputs<Real> full = run(in, Real(0.5), Real(2), "all targets");
  for (int r = 1; r < N; r += 3) in.targets[r] = shardtrain::IGNORED_TARGET;
  const Outputs<Real> masked = run(in, Real(0.5), Real(2), "some ignored");
  for (int r = 0; r < N; r++) {
    const bool ignored = r % 3 == 1;
    EXPECT_EQ(masked.losses[r], ignored ? Real(0) : full.losses[r]) << "row " << r;
    for (int i = 0; i < V; i++) {
      const size_t at = static_cast<size_t>(r) * V + i;
      ASSERT_EQ(masked.grad[at], ignored ? Real(0) : full.grad[at]) << "row " << r << " column " << i;
    }
  }
}

TYPED_TEST(DistillLossTest, EmptyBatchWritesNothing) {
  using Real = TypeParam;
  GuardedBuffer<Real> losses(0, "losses"), grad(0, "student_to_grad"), teacher(0, "teacher");
  GuardedBuffer<int> targets(0, "targets");
  cpu_layer_ops<Real>().distill_loss_forward(losses.data(), grad.data(), teacher.data(), targets.data(), 0, 50,
                                             Real(0.5), Real(2));
  expect_guards_intact("N=0", losses, grad, teacher, targets);
}

// d losses[r] / d s, scaled by R[r] (a different weight per row, so a gradient landing in the
// wrong row shows), against central differences of L(s) = sum_r R[r] losses[r] with h = 1e-6 on
// every element, the rows' differences taken before they are summed (no cancellation of L itself).
// Truncation ~h^2 |L'''| / 6 (< 1e-11 even at T = 0.5), rounding ~1e-16 |losses| / h ~ 1e-9:
// atol 1e-7 max(1, max |analytic|), rtol 1e-6 -- far below any wrong term.
TEST(DistillLoss, GradientMatchesFiniteDifferences) {
  const int N = 3, V = 37;
  const double h = 1e-6;
  const Inputs<double> in = random_inputs<double>(N, V, 700);
  const std::vector<double> R = {0.37, -1.3, 2.1};
  const auto& ops = cpu_layer_ops<double>();
  for (double alpha : kAlphas)
    for (double T : kTemperatures) {
      std::vector<double> s(in.student.data(), in.student.data() + in.student.size()), scratch(s.size());
      std::vector<double> losses(N), plus(N), minus(N);
      const auto forward = [&](std::vector<double>& out) {
        scratch = s;  // the op overwrites its input
        ops.distill_loss_forward(out.data(), scratch.data(), in.teacher.data(), in.targets.data(), N, V, alpha, T);
      };
      forward(losses);
      std::vector<double> analytic = scratch;
      double scale = 1.0;
      for (int r = 0; r < N; r++)
        for (int i = 0; i < V; i++) {
          analytic[static_cast<size_t>(r) * V + i] *= R[r];
          scale = std::max(scale, std::fabs(analytic[static_cast<size_t>(r) * V + i]));
        }
      std::vector<double> numeric(s.size());
      for (size_t k = 0; k < s.size(); k++) {
        const double x0 = s[k], xp = x0 + h, xm = x0 - h;
        s[k] = xp;
        forward(plus);
        s[k] = xm;
        forward(minus);
        s[k] = x0;
        double dl = 0;
        for (int r = 0; r < N; r++) dl += (plus[r] - minus[r]) * R[r];
        numeric[k] = dl / (xp - xm);
      }
      expect_close(analytic.data(), numeric, 1e-7 * scale, 1e-6, "finite differences " + describe(N, V, alpha, T));
    }
}

}  // namespace
