// The CPU layer ops (backend/cpu/ops.hpp), GPT-2's and Llama's, against the naive double oracle
// (support/reference_ops) and against central finite differences, over awkward shapes (nothing a
// power of two or a multiple of a block size). For every op and shape:
//   (a) Float...MatchesReference: the float instantiation vs the double reference, under the
//       tolerance model written next to it;
//   (b) Double...MatchesReference: the double instantiation vs the reference at 1e-12;
//   (c) ...FiniteDifferences: each backward (the double instantiation, and the reference itself)
//       vs central differences of L = sum(out * R) for a fixed random R;
//   (d) BackwardTwice...: parameter gradients accumulate (+=, prefilled values kept), activation
//       gradients are written (=, prefilled NaN garbage must not leak), layernorm's and rmsnorm's
//       dinp accumulate.
// Besides: the encoder without a position table; grouped-query attention against multi-head
// attention on repeated key/value heads; rope by hand at known angles and as its backward's
// adjoint and inverse; and the ops that reduce across threads (GQA's shared key/value gradients,
// rmsnorm's dweight) give the same bits on every call and with 1, 2 or 3 OpenMP threads.
// Every buffer an op touches lives in a GuardedBuffer whose NaN sentinels are checked after each
// call; outputs and written gradients are prefilled with NaN so an element left unwritten fails.
// Inputs the float op sees are exactly the inputs the reference sees (float widened to double).
#include <gtest/gtest.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <ostream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "backend/cpu/ops.hpp"
#include "backend/layer_ops.hpp"
#include "core/random.hpp"
#include "model/batch.hpp"
#include "support/reference_ops.hpp"
#include "support/tensor_check.hpp"

namespace {

namespace cpu = shardtrain::cpu;
namespace ref = shardtrain::reference;
using shardtrain::testing::expect_close;
using shardtrain::testing::expect_guards_intact;
using shardtrain::testing::fill_indices;
using shardtrain::testing::fill_uniform;
using shardtrain::testing::fill_value;
using shardtrain::testing::GuardedBuffer;
using shardtrain::testing::quiet_nan;
using shardtrain::testing::Tolerance;
using shardtrain::testing::type_name;

// ---- tolerance models ----------------------------------------------------------------------------
//
// u = 2^-24 is fp32's unit roundoff. A sum of K fp32 terms, in any order, blocked or not, with or
// without FMA, errs by at most gamma_K * sum|terms| ~ K u sum|terms| (Higham, Thm 3.1); with random
// rounding it is ~sqrt(K) u sum|terms| in practice. Our inputs are O(1) (|x| <= 1..4) and so are
// the outputs, so we allow atol = rtol = 4 K u: about 4 sqrt(K) times the typical error and near
// the worst case for a typical row. K is the longest chain of roundings that feeds one output
// element (the reduction length plus the few pointwise operations around it). exp_fast (~2 ulp),
// sqrt and division add O(1) u each and are absorbed by the factor 4.
// The double instantiation uses the same model with u = 2^-53; K u is < 1e-14 for every shape
// here, so a flat 1e-12 (atol and rtol) holds with a wide margin and still catches any real bug.
constexpr double kU32 = 0x1p-24;
constexpr Tolerance kDoubleTol{1e-12, 1e-12};

Tolerance fp32_sum(int K) { return {4.0 * K * kU32, 4.0 * K * kU32}; }

// The model of the element type under test: the fp32 model given, or the flat double one.
template <typename Real>
Tolerance model(Tolerance fp32) {
  return std::is_same_v<Real, float> ? fp32 : kDoubleTol;
}

// ---- finite differences --------------------------------------------------------------------------
//
// The gradient of L(x) = sum_j out_j(x) R_j, numerically: dL/dx_i ~ sum_j (out_j(x+h e_i) -
// out_j(x-h e_i)) R_j / (2h), with h = 1e-6 and the step actually taken ((x+h)-(x-h) in double).
// Differencing the outputs before summing avoids the cancellation of the large sum L itself.
// Error model: truncation ~ h^2/6 |L'''| ~ 1e-13, rounding ~ K 2^-53 |out| / h ~ 1e-9; we allow
// rtol 1e-6 and atol 1e-7 * max(1, max|analytic|), which still catches any wrong term (a missing
// or wrong gradient term changes results at O(1) relative).
constexpr double kFdStep = 1e-6;
constexpr Tolerance kFdTol{1e-7, 1e-6};

// Every index when n is small; otherwise ~kFdMaxPoints evenly spread, always including the last.
constexpr size_t kFdMaxPoints = 160;
std::vector<size_t> fd_indices(size_t n) {
  std::vector<size_t> idx;
  if (n <= kFdMaxPoints) {
    for (size_t i = 0; i < n; i++) idx.push_back(i);
    return idx;
  }
  const size_t stride = (n + kFdMaxPoints - 1) / kFdMaxPoints;
  for (size_t i = stride / 2; i < n; i += stride) idx.push_back(i);
  if (idx.back() != n - 1) idx.push_back(n - 1);
  return idx;
}

using Forward = std::function<void(std::vector<double>& out)>;

// forward() recomputes the outputs from the current contents of x (it reads x through a capture).
void expect_matches_finite_differences(double* x, size_t n, const double* analytic, const std::vector<double>& R,
                                       const Forward& forward, const std::string& label) {
  const std::vector<size_t> idx = fd_indices(n);
  std::vector<double> numeric(idx.size()), picked(idx.size());
  std::vector<double> plus(R.size()), minus(R.size());
  double scale = 1.0;
  for (size_t i = 0; i < n; i++) scale = std::max(scale, std::fabs(analytic[i]));
  for (size_t k = 0; k < idx.size(); k++) {
    const size_t i = idx[k];
    const double x0 = x[i];
    const double xp = x0 + kFdStep, xm = x0 - kFdStep;
    x[i] = xp;
    forward(plus);
    x[i] = xm;
    forward(minus);
    x[i] = x0;
    double dl = 0;
    for (size_t j = 0; j < R.size(); j++) dl += (plus[j] - minus[j]) * R[j];
    numeric[k] = dl / (xp - xm);
    picked[k] = analytic[i];
  }
  expect_close(picked.data(), numeric, kFdTol.atol * scale, kFdTol.rtol,
               label + " (" + std::to_string(idx.size()) + " of " + std::to_string(n) + " elements)");
}

std::vector<double> random_vector(size_t n, uint64_t seed, double lo = -1.0, double hi = 1.0) {
  std::vector<double> v(n);
  fill_uniform(v.data(), n, seed, lo, hi);
  return v;
}

// Determinism checks: runs fn with the OpenMP default team size set to n, then restores it.
template <typename Fn>
void with_threads(int n, Fn fn) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(n);
  fn();
  omp_set_num_threads(saved);
}

template <typename Real>
bool same_bits(const std::vector<Real>& a, const std::vector<Real>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(Real)) == 0;
}

// Readable test names: GoogleTest calls name_of(param) through this.
struct ShapeName {
  template <typename P>
  std::string operator()(const ::testing::TestParamInfo<P>& info) const {
    return name_of(info.param);
  }
};

// ==================================================================================================
// Encoder: out(B,T,C) = wte[token] + wpe[t], or wte[token] alone when wpe is null (Llama: no
// position table). wpe gets kExtraPositions rows beyond T, whose gradient must stay untouched. V is
// small so tokens repeat (the scatter must accumulate).
// ==================================================================================================
struct EncoderShape {
  int B, T, C, V;
};
std::string name_of(const EncoderShape& s) {
  return "B" + std::to_string(s.B) + "_T" + std::to_string(s.T) + "_C" + std::to_string(s.C) + "_V" +
         std::to_string(s.V);
}
void PrintTo(const EncoderShape& s, std::ostream* os) { *os << name_of(s); }
constexpr int kExtraPositions = 3;

// positions = false passes wpe = null.
template <typename Real>
void check_encoder_forward(const EncoderShape& s, bool positions) {
  const size_t BT = static_cast<size_t>(s.B) * s.T, maxT = s.T + kExtraPositions;
  GuardedBuffer<int> tokens(BT, "tokens");
  GuardedBuffer<Real> wte(static_cast<size_t>(s.V) * s.C, "wte"), wpe(maxT * s.C, "wpe"), out(BT * s.C, "out");
  fill_indices(tokens.data(), BT, 11, s.V);
  fill_uniform(wte.data(), wte.size(), 12);
  fill_uniform(wpe.data(), wpe.size(), 13);
  fill_value(out.data(), out.size(), quiet_nan<Real>());
  cpu::encoder_forward(out.data(), tokens.data(), wte.data(), positions ? wpe.data() : nullptr, s.B, s.T, s.C);
  expect_guards_intact("encoder_forward", tokens, wte, wpe, out);

  std::vector<double> ref_out(out.size());
  const std::vector<double> ref_wpe = wpe.to_double();
  ref::encoder_forward(ref_out.data(), tokens.data(), wte.to_double().data(), positions ? ref_wpe.data() : nullptr,
                       s.B, s.T, s.C);
  // One rounding of a + b: |err| <= u |a + b|; 2 u so the check does not sit on its own bound.
  // Without positions the rows are copies: exact.
  const Tolerance tol = positions ? model<Real>({0.0, 2 * kU32}) : Tolerance{0.0, 0.0};
  expect_close(out.data(), ref_out, tol,
               std::string("encoder out ") + (positions ? "" : "without wpe ") + type_name<Real>());
}

// calls = 1 checks one backward; calls = 2 checks that the parameter gradients accumulate.
// positions = false passes dwpe = null; dwte must then be what it is with a dwpe, bit for bit.
template <typename Real>
void check_encoder_backward(const EncoderShape& s, int calls, bool positions) {
  const size_t BT = static_cast<size_t>(s.B) * s.T, maxT = s.T + kExtraPositions;
  GuardedBuffer<int> tokens(BT, "tokens");
  GuardedBuffer<Real> dout(BT * s.C, "dout"), dwte(static_cast<size_t>(s.V) * s.C, "dwte"), dwpe(maxT * s.C, "dwpe");
  fill_indices(tokens.data(), BT, 21, s.V);
  fill_uniform(dout.data(), dout.size(), 22);
  fill_uniform(dwte.data(), dwte.size(), 23);  // prefilled: parameter gradients accumulate
  fill_uniform(dwpe.data(), dwpe.size(), 24);
  std::vector<Real> dwte_with_dwpe(dwte.data(), dwte.data() + dwte.size()), dwpe_scratch(dwpe.size(), Real(0));
  std::vector<double> ref_dwte = dwte.to_double(), ref_dwpe = dwpe.to_double();
  for (int call = 0; call < calls; call++) {
    cpu::encoder_backward(dwte.data(), positions ? dwpe.data() : nullptr, dout.data(), tokens.data(), s.B, s.T, s.C);
    expect_guards_intact("encoder_backward call " + std::to_string(call + 1), tokens, dout, dwte, dwpe);
    ref::encoder_backward(ref_dwte.data(), positions ? ref_dwpe.data() : nullptr, dout.to_double().data(),
                          tokens.data(), s.B, s.T, s.C);
    if (!positions)
      cpu::encoder_backward(dwte_with_dwpe.data(), dwpe_scratch.data(), dout.data(), tokens.data(), s.B, s.T, s.C);
  }
  // dwte[v] = prefill + up to calls*B*T rows of dout (tokens repeat); dwpe[t] = prefill + calls*B rows.
  const Tolerance tol = model<Real>(fp32_sum(calls * static_cast<int>(BT) + 1));
  const std::string type = type_name<Real>();
  if (positions) {
    expect_close(dwte.data(), ref_dwte, tol, "encoder dwte " + type);
    expect_close(dwpe.data(), ref_dwpe, tol, "encoder dwpe " + type);
  } else {
    expect_close(dwte.data(), ref_dwte, tol, "encoder dwte without dwpe " + type);
    EXPECT_EQ(std::memcmp(dwte.data(), dwte_with_dwpe.data(), dwte.size() * sizeof(Real)), 0)
        << "encoder dwte without dwpe differs from dwte with one";
  }
}

void check_encoder_gradients(const EncoderShape& s, bool reference, bool positions) {
  const size_t BT = static_cast<size_t>(s.B) * s.T, maxT = s.T + kExtraPositions;
  const auto forward_fn = reference ? &ref::encoder_forward : &cpu::encoder_forward<double>;
  const auto backward_fn = reference ? &ref::encoder_backward : &cpu::encoder_backward<double>;
  std::vector<int> tokens(BT);
  fill_indices(tokens.data(), BT, 31, s.V);
  std::vector<double> wte = random_vector(static_cast<size_t>(s.V) * s.C, 32);
  std::vector<double> wpe = random_vector(maxT * s.C, 33);
  const std::vector<double> R = random_vector(BT * s.C, 34);
  std::vector<double> dwte(wte.size(), 0.0), dwpe(wpe.size(), 0.0);
  backward_fn(dwte.data(), positions ? dwpe.data() : nullptr, R.data(), tokens.data(), s.B, s.T, s.C, nullptr);
  const Forward forward = [&](std::vector<double>& out) {
    forward_fn(out.data(), tokens.data(), wte.data(), positions ? wpe.data() : nullptr, s.B, s.T, s.C, nullptr);
  };
  const std::string who = std::string(reference ? "reference " : "cpu<double> ") + (positions ? "" : "no-wpe ");
  expect_matches_finite_differences(wte.data(), wte.size(), dwte.data(), R, forward, who + "encoder dwte");
  if (positions)
    expect_matches_finite_differences(wpe.data(), wpe.size(), dwpe.data(), R, forward, who + "encoder dwpe");
}

class EncoderTest : public ::testing::TestWithParam<EncoderShape> {};
TEST_P(EncoderTest, ForwardFloatMatchesReference) { check_encoder_forward<float>(GetParam(), true); }
TEST_P(EncoderTest, ForwardDoubleMatchesReference) { check_encoder_forward<double>(GetParam(), true); }
TEST_P(EncoderTest, BackwardFloatMatchesReference) { check_encoder_backward<float>(GetParam(), 1, true); }
TEST_P(EncoderTest, BackwardDoubleMatchesReference) { check_encoder_backward<double>(GetParam(), 1, true); }
TEST_P(EncoderTest, BackwardMatchesFiniteDifferences) { check_encoder_gradients(GetParam(), false, true); }
TEST_P(EncoderTest, ReferenceBackwardMatchesFiniteDifferences) { check_encoder_gradients(GetParam(), true, true); }
TEST_P(EncoderTest, BackwardTwiceAccumulatesParameterGradients) { check_encoder_backward<float>(GetParam(), 2, true); }
// Llama: no position table. The output is the token rows exactly; dwte is the same scatter.
TEST_P(EncoderTest, ForwardWithoutWpeCopiesTokenRowsFloat) { check_encoder_forward<float>(GetParam(), false); }
TEST_P(EncoderTest, ForwardWithoutWpeCopiesTokenRowsDouble) { check_encoder_forward<double>(GetParam(), false); }
TEST_P(EncoderTest, BackwardWithoutDwpeFloatMatchesReference) { check_encoder_backward<float>(GetParam(), 1, false); }
TEST_P(EncoderTest, BackwardWithoutDwpeDoubleMatchesReference) {
  check_encoder_backward<double>(GetParam(), 1, false);
}
TEST_P(EncoderTest, BackwardWithoutDwpeMatchesFiniteDifferences) { check_encoder_gradients(GetParam(), false, false); }
TEST_P(EncoderTest, ReferenceBackwardWithoutDwpeMatchesFiniteDifferences) {
  check_encoder_gradients(GetParam(), true, false);
}
TEST_P(EncoderTest, BackwardTwiceWithoutDwpeAccumulatesDwte) { check_encoder_backward<float>(GetParam(), 2, false); }

// Positions restarting with each packed document (data.restart_positions): each token takes the wpe
// row of its position, and dwpe gathers every token of a position, against the reference.
TEST_P(EncoderTest, RestartedPositionsMatchReference) {
  const EncoderShape s = GetParam();
  const size_t BT = static_cast<size_t>(s.B) * s.T;
  std::vector<int> tokens(BT), positions(BT);
  fill_indices(tokens.data(), BT, 31, s.V);
  for (int b = 0; b < s.B; b++)
    for (int t = 0, start = 0; t < s.T; t++) {
      if (t % 5 == 3 + b % 2) start = t;
      positions[static_cast<size_t>(b) * s.T + t] = t - start;
    }
  const std::vector<double> wte = random_vector(static_cast<size_t>(s.V) * s.C, 32),
                            wpe = random_vector(static_cast<size_t>(s.T) * s.C, 33),
                            dout = random_vector(BT * s.C, 34);
  std::vector<double> out(BT * s.C), ref_out(out.size()), dwte(wte.size()), dwpe(wpe.size()), ref_dwte(wte.size()),
      ref_dwpe(wpe.size());
  cpu::encoder_forward(out.data(), tokens.data(), wte.data(), wpe.data(), s.B, s.T, s.C, positions.data());
  ref::encoder_forward(ref_out.data(), tokens.data(), wte.data(), wpe.data(), s.B, s.T, s.C, positions.data());
  cpu::encoder_backward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), s.B, s.T, s.C, positions.data());
  ref::encoder_backward(ref_dwte.data(), ref_dwpe.data(), dout.data(), tokens.data(), s.B, s.T, s.C, positions.data());
  expect_close(out.data(), ref_out, Tolerance{0.0, 0.0}, "encoder out with positions");
  expect_close(dwpe.data(), ref_dwpe, kDoubleTol, "encoder dwpe with positions");
  expect_close(dwte.data(), ref_dwte, kDoubleTol, "encoder dwte with positions");
}

INSTANTIATE_TEST_SUITE_P(Shapes, EncoderTest,
                         ::testing::Values(EncoderShape{1, 1, 12, 11}, EncoderShape{1, 5, 12, 50},
                                           EncoderShape{2, 7, 24, 11}, EncoderShape{3, 13, 36, 50},
                                           EncoderShape{2, 13, 12, 11}, EncoderShape{3, 5, 36, 11}),
                         ShapeName());

// ==================================================================================================
// LayerNorm over rows of C, N = B*T rows. Inputs are uniform in [-2, 3) (non-zero mean, so a
// one-pass variance would lose digits), weight in [0.5, 1.5), bias in [-0.5, 0.5).
// ==================================================================================================
struct LayerNormShape {
  int B, T, C;
};
std::string name_of(const LayerNormShape& s) {
  return "B" + std::to_string(s.B) + "_T" + std::to_string(s.T) + "_C" + std::to_string(s.C);
}
void PrintTo(const LayerNormShape& s, std::ostream* os) { *os << name_of(s); }

template <typename Real>
struct LayerNormInputs {
  explicit LayerNormInputs(const LayerNormShape& s)
      : N(s.B * s.T), C(s.C), inp(static_cast<size_t>(N) * C, "inp"), weight(C, "weight"), bias(C, "bias") {
    fill_uniform(inp.data(), inp.size(), 41, -2.0, 3.0);
    fill_uniform(weight.data(), weight.size(), 42, 0.5, 1.5);
    fill_uniform(bias.data(), bias.size(), 43, -0.5, 0.5);
  }
  int N, C;
  GuardedBuffer<Real> inp, weight, bias;
};

template <typename Real>
void check_layernorm_forward(const LayerNormShape& s) {
  LayerNormInputs<Real> in(s);
  const int N = in.N, C = in.C;
  GuardedBuffer<Real> out(static_cast<size_t>(N) * C, "out"), mean(N, "mean"), rstd(N, "rstd");
  fill_value(out.data(), out.size(), quiet_nan<Real>());
  fill_value(mean.data(), mean.size(), quiet_nan<Real>());
  fill_value(rstd.data(), rstd.size(), quiet_nan<Real>());
  cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), in.inp.data(), in.weight.data(), in.bias.data(), N, C);
  expect_guards_intact("layernorm_forward", out, mean, rstd, in.inp, in.weight, in.bias);

  std::vector<double> ref_out(out.size()), ref_mean(N), ref_rstd(N);
  ref::layernorm_forward(ref_out.data(), ref_mean.data(), ref_rstd.data(), in.inp.to_double().data(),
                         in.weight.to_double().data(), in.bias.to_double().data(), N, C);
  // mean: a sum of C terms; var: C squared differences; rstd, xhat, * weight + bias: a few more.
  const Tolerance tol = model<Real>(fp32_sum(2 * C + 4));
  const std::string type = type_name<Real>();
  expect_close(out.data(), ref_out, tol, "layernorm out " + type);
  expect_close(mean.data(), ref_mean, tol, "layernorm mean " + type);
  expect_close(rstd.data(), ref_rstd, tol, "layernorm rstd " + type);
}

template <typename Real>
void check_layernorm_backward(const LayerNormShape& s, int calls) {
  LayerNormInputs<Real> in(s);
  const int N = in.N, C = in.C;
  GuardedBuffer<Real> out(static_cast<size_t>(N) * C, "out"), mean(N, "mean"), rstd(N, "rstd");
  cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), in.inp.data(), in.weight.data(), in.bias.data(), N, C);

  GuardedBuffer<Real> dout(out.size(), "dout"), dinp(out.size(), "dinp"), dweight(C, "dweight"), dbias(C, "dbias");
  fill_uniform(dout.data(), dout.size(), 44);
  fill_uniform(dinp.data(), dinp.size(), 45);  // prefilled: all three gradients accumulate
  fill_uniform(dweight.data(), dweight.size(), 46);
  fill_uniform(dbias.data(), dbias.size(), 47);
  std::vector<double> ref_dinp = dinp.to_double(), ref_dweight = dweight.to_double(), ref_dbias = dbias.to_double();
  for (int call = 0; call < calls; call++) {
    cpu::layernorm_backward(dinp.data(), dweight.data(), dbias.data(), dout.data(), in.inp.data(), in.weight.data(),
                            mean.data(), rstd.data(), N, C);
    expect_guards_intact("layernorm_backward call " + std::to_string(call + 1), dinp, dweight, dbias, dout, in.inp,
                         in.weight, mean, rstd);
    // The reference sees the statistics the op saved, so this isolates the backward.
    ref::layernorm_backward(ref_dinp.data(), ref_dweight.data(), ref_dbias.data(), dout.to_double().data(),
                            in.inp.to_double().data(), in.weight.to_double().data(), mean.to_double().data(),
                            rstd.to_double().data(), N, C);
  }
  // dinp: two sums over C per row; dweight, dbias: sums over N rows; plus the prefill.
  const Tolerance tol = model<Real>(fp32_sum(2 * C + calls * N + 4));
  const std::string type = type_name<Real>();
  expect_close(dinp.data(), ref_dinp, tol, "layernorm dinp " + type);
  expect_close(dweight.data(), ref_dweight, tol, "layernorm dweight " + type);
  expect_close(dbias.data(), ref_dbias, tol, "layernorm dbias " + type);
}

void check_layernorm_gradients(const LayerNormShape& s, bool reference) {
  const int N = s.B * s.T, C = s.C;
  const auto forward_fn = reference ? &ref::layernorm_forward : &cpu::layernorm_forward<double>;
  const auto backward_fn = reference ? &ref::layernorm_backward : &cpu::layernorm_backward<double>;
  std::vector<double> inp = random_vector(static_cast<size_t>(N) * C, 51, -2.0, 3.0);
  std::vector<double> weight = random_vector(C, 52, 0.5, 1.5), bias = random_vector(C, 53, -0.5, 0.5);
  const std::vector<double> R = random_vector(inp.size(), 54);
  std::vector<double> out(inp.size()), mean(N), rstd(N);
  forward_fn(out.data(), mean.data(), rstd.data(), inp.data(), weight.data(), bias.data(), N, C);
  std::vector<double> dinp(inp.size(), 0.0), dweight(C, 0.0), dbias(C, 0.0);
  backward_fn(dinp.data(), dweight.data(), dbias.data(), R.data(), inp.data(), weight.data(), mean.data(), rstd.data(),
              N, C);
  const Forward forward = [&](std::vector<double>& y) {
    std::vector<double> m(N), r(N);
    forward_fn(y.data(), m.data(), r.data(), inp.data(), weight.data(), bias.data(), N, C);
  };
  const std::string who = reference ? "reference " : "cpu<double> ";
  expect_matches_finite_differences(inp.data(), inp.size(), dinp.data(), R, forward, who + "layernorm dinp");
  expect_matches_finite_differences(weight.data(), weight.size(), dweight.data(), R, forward, who + "layernorm dweight");
  expect_matches_finite_differences(bias.data(), bias.size(), dbias.data(), R, forward, who + "layernorm dbias");
}

class LayerNormTest : public ::testing::TestWithParam<LayerNormShape> {};
TEST_P(LayerNormTest, ForwardFloatMatchesReference) { check_layernorm_forward<float>(GetParam()); }
TEST_P(LayerNormTest, ForwardDoubleMatchesReference) { check_layernorm_forward<double>(GetParam()); }
TEST_P(LayerNormTest, BackwardFloatMatchesReference) { check_layernorm_backward<float>(GetParam(), 1); }
TEST_P(LayerNormTest, BackwardDoubleMatchesReference) { check_layernorm_backward<double>(GetParam(), 1); }
TEST_P(LayerNormTest, BackwardMatchesFiniteDifferences) { check_layernorm_gradients(GetParam(), false); }
TEST_P(LayerNormTest, ReferenceBackwardMatchesFiniteDifferences) { check_layernorm_gradients(GetParam(), true); }
// layernorm is the exception: dinp accumulates too (it adds onto the residual stream).
TEST_P(LayerNormTest, BackwardTwiceAccumulatesAllGradients) { check_layernorm_backward<float>(GetParam(), 2); }

std::vector<LayerNormShape> layernorm_shapes() {
  std::vector<LayerNormShape> shapes;
  for (int B : {1, 3})
    for (int T : {1, 5, 7, 13})
      for (int C : {12, 24, 36}) shapes.push_back({B, T, C});
  return shapes;
}
INSTANTIATE_TEST_SUITE_P(Shapes, LayerNormTest, ::testing::ValuesIn(layernorm_shapes()), ShapeName());

// ==================================================================================================
// RMSNorm (Llama) over rows of C, N = B*T rows, with the eps given. Most shapes: inputs uniform in
// [-2, 3), eps 1e-5. "Tiny" shapes: inputs in [-0.02, 0.03) with eps 1e-4, comparable to their mean
// square (~2.3e-4), so a dropped, fixed or misplaced eps shows; rstd ~ 55 there. C = 41 crosses
// the 32-column block of the dweight sums. Weight in [0.5, 1.5).
// ==================================================================================================
struct RmsNormShape {
  int B, T, C;
  bool tiny;
};
std::string name_of(const RmsNormShape& s) {
  return "B" + std::to_string(s.B) + "_T" + std::to_string(s.T) + "_C" + std::to_string(s.C) + (s.tiny ? "_tiny" : "");
}
void PrintTo(const RmsNormShape& s, std::ostream* os) { *os << name_of(s); }

double rmsnorm_eps(const RmsNormShape& s) { return s.tiny ? 1e-4 : 1e-5; }

template <typename Real>
struct RmsNormInputs {
  explicit RmsNormInputs(const RmsNormShape& s)
      : N(s.B * s.T), C(s.C), eps(static_cast<Real>(rmsnorm_eps(s))), inp(static_cast<size_t>(N) * C, "inp"),
        weight(C, "weight") {
    fill_uniform(inp.data(), inp.size(), 141, s.tiny ? -0.02 : -2.0, s.tiny ? 0.03 : 3.0);
    fill_uniform(weight.data(), weight.size(), 142, 0.5, 1.5);
  }
  int N, C;
  Real eps;
  GuardedBuffer<Real> inp, weight;
};

// Scales a tolerance's atol by the size of rstd: the backward's terms are ~ rstd |dout w| (up to
// ~55 for the tiny inputs), and its cancellations err in proportion to them.
Tolerance scaled_atol(Tolerance t, const std::vector<double>& rstd) {
  double f = 1.0;
  for (double r : rstd) f = std::max(f, r);
  return {t.atol * f, t.rtol};
}

template <typename Real>
void check_rmsnorm_forward(const RmsNormShape& s) {
  RmsNormInputs<Real> in(s);
  const int N = in.N, C = in.C;
  GuardedBuffer<Real> out(static_cast<size_t>(N) * C, "out"), rstd(N, "rstd");
  fill_value(out.data(), out.size(), quiet_nan<Real>());
  fill_value(rstd.data(), rstd.size(), quiet_nan<Real>());
  cpu::rmsnorm_forward(out.data(), rstd.data(), in.inp.data(), in.weight.data(), in.eps, N, C);
  expect_guards_intact("rmsnorm_forward", out, rstd, in.inp, in.weight);

  std::vector<double> ref_out(out.size()), ref_rstd(N);
  // The reference gets eps as the op saw it (rounded to Real).
  ref::rmsnorm_forward(ref_out.data(), ref_rstd.data(), in.inp.to_double().data(), in.weight.to_double().data(),
                       static_cast<double>(in.eps), N, C);
  // The mean square: a sum of C squares; then + eps, sqrt, division and two products.
  const Tolerance tol = model<Real>(fp32_sum(C + 5));
  const std::string type = type_name<Real>();
  expect_close(out.data(), ref_out, tol, "rmsnorm out " + type);
  expect_close(rstd.data(), ref_rstd, tol, "rmsnorm rstd " + type);
}

// calls = 2: dinp and dweight both accumulate (dinp adds onto the residual stream, like layernorm's).
template <typename Real>
void check_rmsnorm_backward(const RmsNormShape& s, int calls) {
  RmsNormInputs<Real> in(s);
  const int N = in.N, C = in.C;
  GuardedBuffer<Real> out(static_cast<size_t>(N) * C, "out"), rstd(N, "rstd");
  cpu::rmsnorm_forward(out.data(), rstd.data(), in.inp.data(), in.weight.data(), in.eps, N, C);

  GuardedBuffer<Real> dout(out.size(), "dout"), dinp(out.size(), "dinp"), dweight(C, "dweight");
  fill_uniform(dout.data(), dout.size(), 143);
  fill_uniform(dinp.data(), dinp.size(), 144);  // prefilled: both gradients accumulate
  fill_uniform(dweight.data(), dweight.size(), 145);
  std::vector<double> ref_dinp = dinp.to_double(), ref_dweight = dweight.to_double();
  for (int call = 0; call < calls; call++) {
    cpu::rmsnorm_backward(dinp.data(), dweight.data(), dout.data(), in.inp.data(), in.weight.data(), rstd.data(), N,
                          C);
    expect_guards_intact("rmsnorm_backward call " + std::to_string(call + 1), dinp, dweight, dout, in.inp, in.weight,
                         rstd);
    // The reference sees the rstd the op saved, so this isolates the backward.
    ref::rmsnorm_backward(ref_dinp.data(), ref_dweight.data(), dout.to_double().data(), in.inp.to_double().data(),
                          in.weight.to_double().data(), rstd.to_double().data(), N, C);
  }
  // dinp: a sum over C per row and a few roundings; dweight: sums over N rows; plus the prefill.
  const Tolerance tol = scaled_atol(model<Real>(fp32_sum(C + calls * N + 4)), rstd.to_double());
  const std::string type = type_name<Real>();
  expect_close(dinp.data(), ref_dinp, tol, "rmsnorm dinp " + type);
  expect_close(dweight.data(), ref_dweight, tol, "rmsnorm dweight " + type);
}

void check_rmsnorm_gradients(const RmsNormShape& s, bool reference) {
  const int N = s.B * s.T, C = s.C;
  const double eps = rmsnorm_eps(s);
  const auto forward_fn = reference ? &ref::rmsnorm_forward : &cpu::rmsnorm_forward<double>;
  const auto backward_fn = reference ? &ref::rmsnorm_backward : &cpu::rmsnorm_backward<double>;
  std::vector<double> inp = random_vector(static_cast<size_t>(N) * C, 151, s.tiny ? -0.02 : -2.0, s.tiny ? 0.03 : 3.0);
  std::vector<double> weight = random_vector(C, 152, 0.5, 1.5);
  const std::vector<double> R = random_vector(inp.size(), 153);
  std::vector<double> out(inp.size()), rstd(N);
  forward_fn(out.data(), rstd.data(), inp.data(), weight.data(), eps, N, C);
  std::vector<double> dinp(inp.size(), 0.0), dweight(C, 0.0);
  backward_fn(dinp.data(), dweight.data(), R.data(), inp.data(), weight.data(), rstd.data(), N, C);
  const Forward forward = [&](std::vector<double>& y) {
    std::vector<double> r(N);
    forward_fn(y.data(), r.data(), inp.data(), weight.data(), eps, N, C);
  };
  const std::string who = reference ? "reference " : "cpu<double> ";
  expect_matches_finite_differences(inp.data(), inp.size(), dinp.data(), R, forward, who + "rmsnorm dinp");
  expect_matches_finite_differences(weight.data(), weight.size(), dweight.data(), R, forward, who + "rmsnorm dweight");
}

// dweight is a sum over rows: fixed column blocks, each summed in row order, whatever the threads.
void check_rmsnorm_deterministic(const RmsNormShape& s) {
  RmsNormInputs<float> in(s);
  const int N = in.N, C = in.C;
  std::vector<float> out(static_cast<size_t>(N) * C), rstd(N), dout(out.size());
  fill_uniform(dout.data(), dout.size(), 146);
  cpu::rmsnorm_forward(out.data(), rstd.data(), in.inp.data(), in.weight.data(), in.eps, N, C);
  auto run = [&](std::vector<float>& dinp, std::vector<float>& dweight) {
    dinp.assign(out.size(), 0.0f);
    dweight.assign(C, 0.0f);
    cpu::rmsnorm_backward(dinp.data(), dweight.data(), dout.data(), in.inp.data(), in.weight.data(), rstd.data(), N,
                          C);
  };
  std::vector<float> dinp1, dweight1, dinp_again, dweight_again;
  with_threads(1, [&] { run(dinp1, dweight1); });
  for (int threads : {1, 2, 3}) {
    with_threads(threads, [&] { run(dinp_again, dweight_again); });
    EXPECT_TRUE(same_bits(dinp1, dinp_again)) << "rmsnorm dinp differs between 1 and " << threads << " threads";
    EXPECT_TRUE(same_bits(dweight1, dweight_again)) << "rmsnorm dweight differs between 1 and " << threads
                                                    << " threads";
  }
  // Not vacuous: the sums are real numbers, checked against the reference elsewhere.
  for (float v : dweight1) ASSERT_TRUE(std::isfinite(v) && v != 0.0f) << "rmsnorm dweight " << v;
}

class RmsNormTest : public ::testing::TestWithParam<RmsNormShape> {};
TEST_P(RmsNormTest, ForwardFloatMatchesReference) { check_rmsnorm_forward<float>(GetParam()); }
TEST_P(RmsNormTest, ForwardDoubleMatchesReference) { check_rmsnorm_forward<double>(GetParam()); }
TEST_P(RmsNormTest, BackwardFloatMatchesReference) { check_rmsnorm_backward<float>(GetParam(), 1); }
TEST_P(RmsNormTest, BackwardDoubleMatchesReference) { check_rmsnorm_backward<double>(GetParam(), 1); }
TEST_P(RmsNormTest, BackwardMatchesFiniteDifferences) { check_rmsnorm_gradients(GetParam(), false); }
TEST_P(RmsNormTest, ReferenceBackwardMatchesFiniteDifferences) { check_rmsnorm_gradients(GetParam(), true); }
// Like layernorm's, rmsnorm's dinp accumulates too (it adds onto the residual stream).
TEST_P(RmsNormTest, BackwardTwiceAccumulatesAllGradients) { check_rmsnorm_backward<float>(GetParam(), 2); }
TEST_P(RmsNormTest, BackwardSameBitsOnEveryThreadCount) { check_rmsnorm_deterministic(GetParam()); }

std::vector<RmsNormShape> rmsnorm_shapes() {
  std::vector<RmsNormShape> shapes;
  for (int B : {1, 3})
    for (int T : {1, 5, 13})
      for (int C : {12, 36, 41}) shapes.push_back({B, T, C, false});
  for (int C : {12, 41}) shapes.push_back({2, 7, C, true});
  return shapes;
}
INSTANTIATE_TEST_SUITE_P(Shapes, RmsNormTest, ::testing::ValuesIn(rmsnorm_shapes()), ShapeName());

// ==================================================================================================
// Matmul: out(N,OC) = inp(N,C) @ weight(OC,C)^T + bias, with and without bias; the backward with
// and without dinp (the first layer's input needs no gradient).
// ==================================================================================================
struct MatmulShape {
  int N, C, OC;
  bool bias;
};
std::string name_of(const MatmulShape& s) {
  return "N" + std::to_string(s.N) + "_C" + std::to_string(s.C) + "_OC" + std::to_string(s.OC) +
         (s.bias ? "_bias" : "_nobias");
}
void PrintTo(const MatmulShape& s, std::ostream* os) { *os << name_of(s); }

template <typename Real>
struct MatmulInputs {
  explicit MatmulInputs(const MatmulShape& s)
      : inp(static_cast<size_t>(s.N) * s.C, "inp"),
        weight(static_cast<size_t>(s.OC) * s.C, "weight"),
        bias(s.bias ? s.OC : 0, "bias") {
    fill_uniform(inp.data(), inp.size(), 61);
    fill_uniform(weight.data(), weight.size(), 62);
    fill_uniform(bias.data(), bias.size(), 63);
  }
  const Real* bias_or_null() const { return bias.size() ? bias.data() : nullptr; }
  GuardedBuffer<Real> inp, weight, bias;
};

template <typename Real>
void check_matmul_forward(const MatmulShape& s) {
  MatmulInputs<Real> in(s);
  GuardedBuffer<Real> out(static_cast<size_t>(s.N) * s.OC, "out");
  fill_value(out.data(), out.size(), quiet_nan<Real>());
  cpu::matmul_forward(out.data(), in.inp.data(), in.weight.data(), in.bias_or_null(), s.N, s.C, s.OC);
  expect_guards_intact("matmul_forward", out, in.inp, in.weight, in.bias);

  std::vector<double> ref_out(out.size());
  const std::vector<double> bias = in.bias.to_double();
  ref::matmul_forward(ref_out.data(), in.inp.to_double().data(), in.weight.to_double().data(),
                      s.bias ? bias.data() : nullptr, s.N, s.C, s.OC);
  // C products plus the bias.
  expect_close(out.data(), ref_out, model<Real>(fp32_sum(s.C + 1)), std::string("matmul out ") + type_name<Real>());
}

// calls = 2: dweight, dbias accumulate; dinp is written. with_dinp = false passes dinp = null.
template <typename Real>
void check_matmul_backward(const MatmulShape& s, int calls, bool with_dinp) {
  MatmulInputs<Real> in(s);
  GuardedBuffer<Real> dout(static_cast<size_t>(s.N) * s.OC, "dout"), dinp(in.inp.size(), "dinp"),
      dweight(in.weight.size(), "dweight"), dbias(in.bias.size(), "dbias");
  fill_uniform(dout.data(), dout.size(), 64);
  fill_value(dinp.data(), dinp.size(), quiet_nan<Real>());  // garbage: dinp is written, never read
  fill_uniform(dweight.data(), dweight.size(), 65);          // prefilled: parameter gradients accumulate
  fill_uniform(dbias.data(), dbias.size(), 66);
  std::vector<double> ref_dinp(dinp.size()), ref_dweight = dweight.to_double(), ref_dbias = dbias.to_double();
  for (int call = 0; call < calls; call++) {
    cpu::matmul_backward(with_dinp ? dinp.data() : nullptr, dweight.data(), s.bias ? dbias.data() : nullptr,
                         dout.data(), in.inp.data(), in.weight.data(), s.N, s.C, s.OC);
    expect_guards_intact("matmul_backward call " + std::to_string(call + 1), dout, dinp, dweight, dbias, in.inp,
                         in.weight);
    ref::matmul_backward(ref_dinp.data(), ref_dweight.data(), s.bias ? ref_dbias.data() : nullptr,
                         dout.to_double().data(), in.inp.to_double().data(), in.weight.to_double().data(), s.N, s.C,
                         s.OC);
  }
  const std::string type = type_name<Real>();
  if (with_dinp) {
    expect_close(dinp.data(), ref_dinp, model<Real>(fp32_sum(s.OC)), "matmul dinp " + type);
  } else {
    for (size_t i = 0; i < dinp.size(); i++)
      if (!std::isnan(dinp[i])) {
        ADD_FAILURE() << "matmul_backward with dinp = null wrote dinp's buffer at " << i;
        break;
      }
  }
  // dweight, dbias: N terms per call plus the prefill.
  const Tolerance tol = model<Real>(fp32_sum(calls * s.N + 1));
  expect_close(dweight.data(), ref_dweight, tol, "matmul dweight " + type);
  if (s.bias) expect_close(dbias.data(), ref_dbias, tol, "matmul dbias " + type);
}

void check_matmul_gradients(const MatmulShape& s, bool reference) {
  const auto forward_fn = reference ? &ref::matmul_forward : &cpu::matmul_forward<double>;
  const auto backward_fn = reference ? &ref::matmul_backward : &cpu::matmul_backward<double>;
  std::vector<double> inp = random_vector(static_cast<size_t>(s.N) * s.C, 71);
  std::vector<double> weight = random_vector(static_cast<size_t>(s.OC) * s.C, 72);
  std::vector<double> bias = random_vector(s.OC, 73);
  const std::vector<double> R = random_vector(static_cast<size_t>(s.N) * s.OC, 74);
  std::vector<double> dinp(inp.size()), dweight(weight.size(), 0.0), dbias(bias.size(), 0.0);
  backward_fn(dinp.data(), dweight.data(), s.bias ? dbias.data() : nullptr, R.data(), inp.data(), weight.data(), s.N,
              s.C, s.OC);
  const Forward forward = [&](std::vector<double>& out) {
    forward_fn(out.data(), inp.data(), weight.data(), s.bias ? bias.data() : nullptr, s.N, s.C, s.OC);
  };
  const std::string who = reference ? "reference " : "cpu<double> ";
  expect_matches_finite_differences(inp.data(), inp.size(), dinp.data(), R, forward, who + "matmul dinp");
  expect_matches_finite_differences(weight.data(), weight.size(), dweight.data(), R, forward, who + "matmul dweight");
  if (s.bias) expect_matches_finite_differences(bias.data(), bias.size(), dbias.data(), R, forward, who + "matmul dbias");
}

class MatmulTest : public ::testing::TestWithParam<MatmulShape> {};
TEST_P(MatmulTest, ForwardFloatMatchesReference) { check_matmul_forward<float>(GetParam()); }
TEST_P(MatmulTest, ForwardDoubleMatchesReference) { check_matmul_forward<double>(GetParam()); }
TEST_P(MatmulTest, BackwardFloatMatchesReference) { check_matmul_backward<float>(GetParam(), 1, true); }
TEST_P(MatmulTest, BackwardDoubleMatchesReference) { check_matmul_backward<double>(GetParam(), 1, true); }
TEST_P(MatmulTest, BackwardWithoutDinpLeavesItAlone) { check_matmul_backward<float>(GetParam(), 1, false); }
TEST_P(MatmulTest, BackwardMatchesFiniteDifferences) { check_matmul_gradients(GetParam(), false); }
TEST_P(MatmulTest, ReferenceBackwardMatchesFiniteDifferences) { check_matmul_gradients(GetParam(), true); }
TEST_P(MatmulTest, BackwardTwiceAccumulatesParamsOverwritesDinp) { check_matmul_backward<float>(GetParam(), 2, true); }

std::vector<MatmulShape> matmul_shapes() {
  std::vector<MatmulShape> shapes;
  for (int N : {1, 5, 13, 39})
    for (int C : {12, 36})
      for (int OC : {20, 37})
        for (bool bias : {true, false}) shapes.push_back({N, C, OC, bias});
  shapes.push_back({21, 36, 108, true});  // the qkv projection, OC = 3C
  shapes.push_back({7, 24, 96, true});    // the MLP up projection, OC = 4C
  shapes.push_back({15, 36, 11, false});  // the tied classifier, OC = V
  return shapes;
}
INSTANTIATE_TEST_SUITE_P(Shapes, MatmulTest, ::testing::ValuesIn(matmul_shapes()), ShapeName());

// ==================================================================================================
// Causal self-attention with grouped-query heads: qkv(B,T,(NH+2KV)*HS) in [-2, 2), so scores spread
// over a few units. KV = NH is GPT-2's multi-head attention; KV < NH shares each key/value head
// among NH/KV consecutive query heads, whose gradients must sum into it. Odd head sizes are allowed.
// The op is tiled (no T x T matrix; it saves each row's log-sum-exp): `tiles` of 0 means the
// default; small and odd tiles put partial tiles, several key tiles per query tile, key tiles that
// start past a query tile's first rows, and tiles larger than T into cases of a few dozen rows.
// ==================================================================================================
struct AttentionShape {
  int B, T, NH, KV, HS;
  cpu::AttentionTiles tiles = {0, 0};
  cpu::AttentionTiles op_tiles() const { return tiles.query ? tiles : cpu::AttentionTiles(); }
};
std::string name_of(const AttentionShape& s) {
  std::string name = "B" + std::to_string(s.B) + "_T" + std::to_string(s.T) + "_NH" + std::to_string(s.NH) + "_KV" +
                     std::to_string(s.KV) + "_HS" + std::to_string(s.HS);
  if (s.tiles.query) name += "_tiles" + std::to_string(s.tiles.query) + "x" + std::to_string(s.tiles.key);
  return name;
}
void PrintTo(const AttentionShape& s, std::ostream* os) { *os << name_of(s); }

size_t att_size(const AttentionShape& s) { return static_cast<size_t>(s.B) * s.NH * s.T * s.T; }
size_t lse_size(const AttentionShape& s) { return static_cast<size_t>(s.B) * s.NH * s.T; }
size_t qkv_size(const AttentionShape& s) { return static_cast<size_t>(s.B) * s.T * (s.NH + 2 * s.KV) * s.HS; }
size_t attention_out_size(const AttentionShape& s) { return static_cast<size_t>(s.B) * s.T * s.NH * s.HS; }

// The op's forward and backward at the shape's tiles.
template <typename Real>
void attention_forward_op(Real* out, Real* lse, const Real* qkv, const AttentionShape& s) {
  cpu::attention_forward(out, lse, qkv, s.B, s.T, s.NH, s.KV, s.HS, s.op_tiles());
}
template <typename Real>
void attention_backward_op(Real* dqkv, const Real* dout, const Real* qkv, const Real* out, const Real* lse,
                           const AttentionShape& s) {
  cpu::attention_backward(dqkv, dout, qkv, out, lse, s.B, s.T, s.NH, s.KV, s.HS, s.op_tiles());
}

// fp32 attention: a score is HS products (|q k| <= 4) scaled; the softmax adds exp_fast and a sum
// of up to T terms, the online form one rescaling per key tile; out sums T products p * v. The
// chain is ~ 4 HS + 2 T. The backward recomputes p from lse (the forward's chain), then chains dP
// (HS), dS (the row's D: HS) and dq/dk/dv (T); a shared k or v sums the NH/KV query heads' shares
// on top, so T grows to T * NH/KV.
Tolerance fp32_attention_forward(const AttentionShape& s) { return fp32_sum(4 * s.HS + 2 * s.T); }
Tolerance fp32_attention_backward(const AttentionShape& s) {
  return fp32_sum(6 * s.HS + 3 * s.T + s.T * (s.NH / s.KV));
}

template <typename Real>
void check_attention_forward(const AttentionShape& s) {
  GuardedBuffer<Real> qkv(qkv_size(s), "qkv"), out(attention_out_size(s), "out"), lse(lse_size(s), "lse");
  fill_uniform(qkv.data(), qkv.size(), 81, -2.0, 2.0);
  fill_value(out.data(), out.size(), quiet_nan<Real>());
  fill_value(lse.data(), lse.size(), quiet_nan<Real>());
  attention_forward_op(out.data(), lse.data(), qkv.data(), s);
  expect_guards_intact("attention_forward", qkv, out, lse);

  std::vector<double> ref_out(out.size()), ref_att(att_size(s)), ref_lse(lse.size());
  ref::attention_forward(ref_out.data(), ref_att.data(), ref_lse.data(), qkv.to_double().data(), s.B, s.T, s.NH, s.KV,
                         s.HS);
  const Tolerance tol = model<Real>(fp32_attention_forward(s));
  const std::string type = type_name<Real>();
  expect_close(out.data(), ref_out, tol, "attention out " + type);
  expect_close(lse.data(), ref_lse, tol, "attention lse " + type);
}

// The backward from the op's own saved out and lse, against the reference's backward from its
// materialised probabilities: the recomputation is part of what is checked.
template <typename Real>
void check_attention_backward(const AttentionShape& s, int calls) {
  GuardedBuffer<Real> qkv(qkv_size(s), "qkv"), out(attention_out_size(s), "out"), lse(lse_size(s), "lse");
  fill_uniform(qkv.data(), qkv.size(), 82, -2.0, 2.0);
  attention_forward_op(out.data(), lse.data(), qkv.data(), s);

  GuardedBuffer<Real> dout(out.size(), "dout"), dqkv(qkv.size(), "dqkv");
  fill_uniform(dout.data(), dout.size(), 83);
  fill_value(dqkv.data(), dqkv.size(), quiet_nan<Real>());  // garbage: dqkv is written
  for (int call = 0; call < calls; call++) {
    attention_backward_op(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), s);
    expect_guards_intact("attention_backward call " + std::to_string(call + 1), dqkv, dout, qkv, out, lse);
  }
  const std::vector<double> wide_qkv = qkv.to_double();
  std::vector<double> ref_out(out.size()), ref_att(att_size(s)), ref_dqkv(dqkv.size());
  ref::attention_forward(ref_out.data(), ref_att.data(), nullptr, wide_qkv.data(), s.B, s.T, s.NH, s.KV, s.HS);
  ref::attention_backward(ref_dqkv.data(), dout.to_double().data(), wide_qkv.data(), ref_att.data(), s.B, s.T, s.NH,
                          s.KV, s.HS);
  expect_close(dqkv.data(), ref_dqkv, model<Real>(fp32_attention_backward(s)),
               std::string("attention dqkv ") + type_name<Real>());
}

// Central differences of L = sum(out * R) through the op's forward (double), against its backward
// and, separately, the reference's.
void check_attention_gradients(const AttentionShape& s, bool reference) {
  std::vector<double> qkv = random_vector(qkv_size(s), 91, -2.0, 2.0);
  const std::vector<double> R = random_vector(attention_out_size(s), 92);
  std::vector<double> out(R.size()), att(att_size(s)), lse(lse_size(s)), dqkv(qkv.size());
  if (reference) {
    ref::attention_forward(out.data(), att.data(), nullptr, qkv.data(), s.B, s.T, s.NH, s.KV, s.HS);
    ref::attention_backward(dqkv.data(), R.data(), qkv.data(), att.data(), s.B, s.T, s.NH, s.KV, s.HS);
  } else {
    attention_forward_op(out.data(), lse.data(), qkv.data(), s);
    attention_backward_op(dqkv.data(), R.data(), qkv.data(), out.data(), lse.data(), s);
  }
  std::vector<double> lse_scratch(lse.size());
  const Forward forward = [&](std::vector<double>& y) { attention_forward_op(y.data(), lse_scratch.data(), qkv.data(), s); };
  const std::string who = reference ? "reference " : "cpu<double> ";
  expect_matches_finite_differences(qkv.data(), qkv.size(), dqkv.data(), R, forward, who + "attention dqkv");
}

// Grouped-query attention is multi-head attention on a qkv whose key/value heads are repeated
// (head h gets kv head h / (NH/KV)), and the shared key/value gradients are the repeated heads'
// gradients summed over each group. This checks the op against itself at KV = NH (which the
// reference and finite differences pin down) through that identity, independently of the
// reference's GQA indexing.
void check_attention_gqa_equals_repeated_mha(const AttentionShape& s) {
  const int NH = s.NH, KV = s.KV, HS = s.HS, group = NH / KV;
  const size_t BT = static_cast<size_t>(s.B) * s.T;
  const size_t row = static_cast<size_t>(NH + 2 * KV) * HS, mha_row = static_cast<size_t>(3 * NH) * HS;
  const std::vector<double> qkv = random_vector(qkv_size(s), 93, -2.0, 2.0);
  const std::vector<double> dout = random_vector(attention_out_size(s), 94);
  std::vector<double> mha(BT * mha_row);
  for (size_t bt = 0; bt < BT; bt++)
    for (int h = 0; h < NH; h++)
      for (int i = 0; i < HS; i++) {
        const int kv = h / group;
        mha[bt * mha_row + static_cast<size_t>(h) * HS + i] = qkv[bt * row + static_cast<size_t>(h) * HS + i];
        mha[bt * mha_row + static_cast<size_t>(NH + h) * HS + i] = qkv[bt * row + static_cast<size_t>(NH + kv) * HS + i];
        mha[bt * mha_row + static_cast<size_t>(2 * NH + h) * HS + i] =
            qkv[bt * row + static_cast<size_t>(NH + KV + kv) * HS + i];
      }
  AttentionShape mha_shape = s;
  mha_shape.KV = NH;
  std::vector<double> out(dout.size()), lse(lse_size(s)), dqkv(qkv.size());
  std::vector<double> mha_out(dout.size()), mha_lse(lse_size(s)), mha_dqkv(mha.size());
  attention_forward_op(out.data(), lse.data(), qkv.data(), s);
  attention_forward_op(mha_out.data(), mha_lse.data(), mha.data(), mha_shape);
  attention_backward_op(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), s);
  attention_backward_op(mha_dqkv.data(), dout.data(), mha.data(), mha_out.data(), mha_lse.data(), mha_shape);
  // Fold the repeated heads' gradients back: dq as is, dk and dv summed over each group.
  std::vector<double> folded(qkv.size(), 0.0);
  for (size_t bt = 0; bt < BT; bt++)
    for (int h = 0; h < NH; h++)
      for (int i = 0; i < HS; i++) {
        const int kv = h / group;
        folded[bt * row + static_cast<size_t>(h) * HS + i] = mha_dqkv[bt * mha_row + static_cast<size_t>(h) * HS + i];
        folded[bt * row + static_cast<size_t>(NH + kv) * HS + i] +=
            mha_dqkv[bt * mha_row + static_cast<size_t>(NH + h) * HS + i];
        folded[bt * row + static_cast<size_t>(NH + KV + kv) * HS + i] +=
            mha_dqkv[bt * mha_row + static_cast<size_t>(2 * NH + h) * HS + i];
      }
  expect_close(out.data(), mha_out, kDoubleTol, "GQA out vs repeated-kv MHA out");
  expect_close(lse.data(), mha_lse, kDoubleTol, "GQA lse vs repeated-kv MHA lse");
  expect_close(dqkv.data(), folded, kDoubleTol, "GQA dqkv vs repeated-kv MHA dqkv, k and v summed per group");
}

// Every output element is computed by one task in a fixed order (the shared key/value gradients
// summed over the group and the query tiles inside one task): the same inputs give the same bits
// on every call and with any number of threads (float, where the order shows).
void check_attention_deterministic(const AttentionShape& s) {
  std::vector<float> qkv(qkv_size(s)), dout(attention_out_size(s));
  fill_uniform(qkv.data(), qkv.size(), 95, -2.0, 2.0);
  fill_uniform(dout.data(), dout.size(), 96);
  auto run = [&](std::vector<float>& out, std::vector<float>& lse, std::vector<float>& dqkv) {
    out.assign(dout.size(), quiet_nan<float>());
    lse.assign(lse_size(s), quiet_nan<float>());
    dqkv.assign(qkv.size(), quiet_nan<float>());
    attention_forward_op(out.data(), lse.data(), qkv.data(), s);
    attention_backward_op(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), s);
  };
  std::vector<float> out1, lse1, dqkv1, out_again, lse_again, dqkv_again;
  with_threads(1, [&] { run(out1, lse1, dqkv1); });
  for (int threads : {1, 2, 3}) {
    with_threads(threads, [&] { run(out_again, lse_again, dqkv_again); });
    EXPECT_TRUE(same_bits(out1, out_again)) << "attention out differs between 1 and " << threads << " threads";
    EXPECT_TRUE(same_bits(lse1, lse_again)) << "attention lse differs between 1 and " << threads << " threads";
    EXPECT_TRUE(same_bits(dqkv1, dqkv_again)) << "attention dqkv differs between 1 and " << threads << " threads";
  }
  // Not vacuous (NaN garbage left behind would compare equal too): everything written and finite,
  // and most gradients non-zero (only the first position's queries get exactly 0: one-key softmax).
  size_t finite = 0, nonzero = 0;
  for (float v : dqkv1) finite += std::isfinite(v), nonzero += v != 0.0f;
  for (float v : out1) finite += std::isfinite(v);
  for (float v : lse1) finite += std::isfinite(v);
  EXPECT_EQ(finite, dqkv1.size() + out1.size() + lse1.size()) << "attention left non-finite values";
  EXPECT_GT(nonzero, dqkv1.size() / 2) << "dqkv is mostly zero";
}

class AttentionTest : public ::testing::TestWithParam<AttentionShape> {};
TEST_P(AttentionTest, ForwardFloatMatchesReference) { check_attention_forward<float>(GetParam()); }
TEST_P(AttentionTest, ForwardDoubleMatchesReference) { check_attention_forward<double>(GetParam()); }
TEST_P(AttentionTest, BackwardFloatMatchesReference) { check_attention_backward<float>(GetParam(), 1); }
TEST_P(AttentionTest, BackwardDoubleMatchesReference) { check_attention_backward<double>(GetParam(), 1); }
TEST_P(AttentionTest, BackwardTwiceOverwritesDqkv) { check_attention_backward<float>(GetParam(), 2); }

// {NH, KV, HS}: GPT-2-style multi-head (KV = NH; head sizes 12, 4, 18) and grouped-query with
// groups of 2, 3 and 4 query heads (one multi-query, KV = 1), odd head sizes.
struct Heads {
  int NH, KV, HS;
};
constexpr Heads kMhaHeads[] = {{1, 1, 12}, {3, 3, 4}, {2, 2, 18}};
constexpr Heads kGqaHeads[] = {{4, 2, 5}, {6, 2, 5}, {4, 1, 7}, {8, 2, 9}};
// Tiles {query, key}: the default; smaller than T with the key tile a non-multiple of the query
// tile and vice versa; one-row query tiles; tiles no smaller than T (one tile).
constexpr cpu::AttentionTiles kTiles[] = {{0, 0}, {4, 6}, {5, 3}, {1, 7}, {256, 512}};

std::vector<AttentionShape> attention_shapes() {
  std::vector<AttentionShape> shapes;
  for (int T : {1, 7, 33, 130}) {
    for (const Heads& h : kMhaHeads) shapes.push_back({1, T, h.NH, h.KV, h.HS});
    for (const Heads& h : kGqaHeads) shapes.push_back({2, T, h.NH, h.KV, h.HS});
    for (const cpu::AttentionTiles& tiles : kTiles)
      if (tiles.query) shapes.push_back({2, T, 6, 2, 5, tiles}), shapes.push_back({1, T, 3, 3, 12, tiles});
  }
  return shapes;
}
INSTANTIATE_TEST_SUITE_P(Shapes, AttentionTest, ::testing::ValuesIn(attention_shapes()), ShapeName());

// Finite differences cost a forward per input element: small cases, every tile shape.
class AttentionGradientTest : public ::testing::TestWithParam<AttentionShape> {};
TEST_P(AttentionGradientTest, BackwardMatchesFiniteDifferences) { check_attention_gradients(GetParam(), false); }
TEST_P(AttentionGradientTest, ReferenceBackwardMatchesFiniteDifferences) {
  check_attention_gradients(GetParam(), true);
}
std::vector<AttentionShape> attention_gradient_shapes() {
  std::vector<AttentionShape> shapes;
  for (int T : {1, 5, 13})
    for (const cpu::AttentionTiles& tiles : kTiles) {
      shapes.push_back({1, T, 2, 2, 6, tiles});
      shapes.push_back({2, T, 4, 1, 3, tiles});
    }
  return shapes;
}
INSTANTIATE_TEST_SUITE_P(Shapes, AttentionGradientTest, ::testing::ValuesIn(attention_gradient_shapes()), ShapeName());

class GqaAttentionTest : public ::testing::TestWithParam<AttentionShape> {};
TEST_P(GqaAttentionTest, EqualsMultiHeadOnRepeatedKvWithGroupSummedGradients) {
  check_attention_gqa_equals_repeated_mha(GetParam());
}
TEST_P(GqaAttentionTest, SameBitsOnEveryCallAndThreadCount) { check_attention_deterministic(GetParam()); }

std::vector<AttentionShape> gqa_shapes() {
  std::vector<AttentionShape> shapes;
  for (const Heads& h : kGqaHeads) shapes.push_back({2, 13, h.NH, h.KV, h.HS});
  shapes.push_back({3, 7, 8, 2, 6});      // groups of 4 over B * KV = 6 parallel iterations
  shapes.push_back({1, 130, 8, 2, 16});   // several default tiles on each side
  shapes.push_back({2, 33, 4, 2, 8, {4, 6}});  // many small tiles: many tasks per thread
  return shapes;
}
INSTANTIATE_TEST_SUITE_P(Shapes, GqaAttentionTest, ::testing::ValuesIn(gqa_shapes()), ShapeName());

// Packed documents (doc_start): every document of a packed sequence gets exactly what attention
// over that document alone gives -- out, lse, and the backward's dqkv for its rows -- the oracle
// being the op itself on the document cut out (checked against the reference above). Documents
// start mid-tile, span several tiles and are one token long; a sequence that is one document
// gives the unpacked op's bits.
struct DocumentCase {
  AttentionShape shape;                   // B = the number of sequences below
  std::vector<std::vector<int>> starts;   // per sequence, its documents' first positions (0 first)
};

template <typename Real>
void check_documents_equal_each_alone(const DocumentCase& c, double tolerance) {
  const AttentionShape& s = c.shape;
  const int T = s.T, row = (s.NH + 2 * s.KV) * s.HS, C = s.NH * s.HS;
  std::vector<Real> qkv(qkv_size(s)), out(attention_out_size(s)), lse(lse_size(s)), dout(out.size()),
      dqkv(qkv.size());
  fill_uniform(qkv.data(), qkv.size(), 95, -2.0, 2.0);
  fill_uniform(dout.data(), dout.size(), 96);
  std::vector<int> doc_start(static_cast<size_t>(s.B) * T);
  for (int b = 0; b < s.B; b++)
    for (int t = 0, d = 0; t < T; t++) {
      while (d + 1 < static_cast<int>(c.starts[b].size()) && c.starts[b][d + 1] <= t) d++;
      doc_start[static_cast<size_t>(b) * T + t] = c.starts[b][d];
    }
  cpu::attention_forward(out.data(), lse.data(), qkv.data(), s.B, T, s.NH, s.KV, s.HS, s.op_tiles(), true,
                         doc_start.data());
  cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), s.B, T, s.NH, s.KV, s.HS,
                          s.op_tiles(), true, doc_start.data());
  for (int b = 0; b < s.B; b++)
    for (size_t d = 0; d < c.starts[b].size(); d++) {
      const int first = c.starts[b][d], n = (d + 1 < c.starts[b].size() ? c.starts[b][d + 1] : T) - first;
      const auto rows = [&](const std::vector<Real>& v, int width) {
        const auto begin = v.begin() + (static_cast<size_t>(b) * T + first) * width;
        return std::vector<Real>(begin, begin + static_cast<size_t>(n) * width);
      };
      const std::vector<Real> q1 = rows(qkv, row), dout1 = rows(dout, C);
      std::vector<Real> out1(dout1.size()), lse1(static_cast<size_t>(s.NH) * n), dqkv1(q1.size());
      cpu::attention_forward(out1.data(), lse1.data(), q1.data(), 1, n, s.NH, s.KV, s.HS, s.op_tiles());
      cpu::attention_backward(dqkv1.data(), dout1.data(), q1.data(), out1.data(), lse1.data(), 1, n, s.NH, s.KV, s.HS,
                              s.op_tiles());
      const std::string where = name_of(s) + " sequence " + std::to_string(b) + " document at " + std::to_string(first);
      const std::vector<Real> packed_out = rows(out, C), packed_dqkv = rows(dqkv, row);
      for (size_t i = 0; i < out1.size(); i++)
        ASSERT_NEAR(packed_out[i], out1[i], tolerance) << where << " out[" << i << "]";
      for (size_t i = 0; i < dqkv1.size(); i++)
        ASSERT_NEAR(packed_dqkv[i], dqkv1[i], tolerance) << where << " dqkv[" << i << "]";
      for (int h = 0; h < s.NH; h++)
        for (int t = 0; t < n; t++)
          ASSERT_NEAR(lse[(static_cast<size_t>(b) * s.NH + h) * T + first + t], lse1[static_cast<size_t>(h) * n + t],
                      tolerance)
              << where << " lse head " << h << " row " << t;
    }
}

void PrintTo(const DocumentCase& c, std::ostream* os) { *os << name_of(c.shape); }
class DocumentAttentionTest : public ::testing::TestWithParam<DocumentCase> {};
TEST_P(DocumentAttentionTest, EveryDocumentGetsWhatItGetsAlone) {
  check_documents_equal_each_alone<double>(GetParam(), 1e-12);
  check_documents_equal_each_alone<float>(GetParam(), 2e-5);
}
const DocumentCase kDocumentCases[] = {
    {{2, 23, 4, 4, 8, {4, 4}}, {{0, 5, 6, 14}, {0, 1, 2, 3, 20}}},    // mid-tile starts, one-token documents
    {{1, 40, 4, 2, 8, {4, 8}}, {{0, 9, 31}}},                          // grouped heads, documents over tiles
    {{2, 37, 8, 2, 6, {8, 4}}, {{0, 17, 18}, {0, 36}}},               // query tiles larger than key tiles
    {{1, 150, 4, 1, 16, {0, 0}}, {{0, 70, 129}}},                      // the default tiles
};
INSTANTIATE_TEST_SUITE_P(Cases, DocumentAttentionTest, ::testing::ValuesIn(kDocumentCases),
                         [](const ::testing::TestParamInfo<DocumentCase>& info) { return "case" + std::to_string(info.index); });

TEST(DocumentAttention, OneDocumentPerSequenceGivesTheUnpackedBits) {
  const AttentionShape s{2, 45, 4, 2, 8, {8, 16}};
  std::vector<float> qkv(qkv_size(s)), out(attention_out_size(s)), lse(lse_size(s)), dout(out.size()),
      dqkv(qkv.size());
  fill_uniform(qkv.data(), qkv.size(), 97, -2.0, 2.0);
  fill_uniform(dout.data(), dout.size(), 98);
  std::vector<float> out2(out.size()), lse2(lse.size()), dqkv2(dqkv.size());
  const std::vector<int> zeros(static_cast<size_t>(s.B) * s.T, 0);
  cpu::attention_forward(out.data(), lse.data(), qkv.data(), s.B, s.T, s.NH, s.KV, s.HS, s.op_tiles());
  cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), s.B, s.T, s.NH, s.KV, s.HS,
                          s.op_tiles());
  cpu::attention_forward(out2.data(), lse2.data(), qkv.data(), s.B, s.T, s.NH, s.KV, s.HS, s.op_tiles(), true,
                         zeros.data());
  cpu::attention_backward(dqkv2.data(), dout.data(), qkv.data(), out2.data(), lse2.data(), s.B, s.T, s.NH, s.KV, s.HS,
                          s.op_tiles(), true, zeros.data());
  EXPECT_TRUE(same_bits(out2, out));
  EXPECT_TRUE(same_bits(lse2, lse));
  EXPECT_TRUE(same_bits(dqkv2, dqkv));
}

// The backward in one pass (a task per sequence and query head that gathers dQ on the way), in two
// (dK and dV by key tiles, then dQ by query tiles), and split between them (the heads of whole
// rounds in one pass, on 2-5 threads: every case has a thread count that leaves heads over) give
// the same bits: the split follows the thread count. Causal, packed documents, and over every key
// (a diffusion transformer's joint attention); tiles whose key tile is a multiple of the query tile
// (others always take two passes), with partial tiles at the end and documents that end mid-tile.
struct PassesCase {
  AttentionShape shape;
  bool causal;
  std::vector<std::vector<int>> starts;  // per sequence, its documents' first positions; empty: none
};
class AttentionPassesTest : public ::testing::TestWithParam<PassesCase> {};
TEST_P(AttentionPassesTest, OnePassGivesTheTwoPassesBits) {
  const PassesCase& c = GetParam();
  const AttentionShape& s = c.shape;
  std::vector<float> qkv(qkv_size(s)), out(attention_out_size(s)), lse(lse_size(s)), dout(out.size());
  fill_uniform(qkv.data(), qkv.size(), 99, -2.0, 2.0);
  fill_uniform(dout.data(), dout.size(), 100);
  std::vector<int> doc_start;
  for (const std::vector<int>& starts : c.starts)
    for (int t = 0, d = 0; t < s.T; t++) {
      while (d + 1 < static_cast<int>(starts.size()) && starts[d + 1] <= t) d++;
      doc_start.push_back(starts[d]);
    }
  const int* docs = doc_start.empty() ? nullptr : doc_start.data();
  cpu::attention_forward(out.data(), lse.data(), qkv.data(), s.B, s.T, s.NH, s.KV, s.HS, s.op_tiles(), c.causal, docs);
  const auto backward = [&](cpu::AttentionTiles::Passes passes, int threads) {
    cpu::AttentionTiles tiles = s.op_tiles();
    tiles.passes = passes;
    std::vector<float> dqkv(qkv.size(), quiet_nan<float>());
    with_threads(threads, [&] {
      cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), s.B, s.T, s.NH, s.KV, s.HS,
                              tiles, c.causal, docs);
    });
    return dqkv;
  };
  const std::vector<float> two = backward(cpu::AttentionTiles::Passes::two, 2);
  size_t finite = 0, nonzero = 0;
  for (float v : two) finite += std::isfinite(v), nonzero += v != 0.0f;
  EXPECT_EQ(finite, two.size()) << "two passes left non-finite values";
  EXPECT_GT(nonzero, two.size() / 2) << "dqkv is mostly zero";
  for (int threads : {1, 2, 3})
    EXPECT_TRUE(same_bits(backward(cpu::AttentionTiles::Passes::one, threads), two))
        << name_of(s) << (c.causal ? " causal" : " joint") << ": one pass on " << threads << " threads";
  for (int threads : {2, 3, 4, 5})
    EXPECT_TRUE(same_bits(backward(cpu::AttentionTiles::Passes::automatic, threads), two))
        << name_of(s) << (c.causal ? " causal" : " joint") << ": automatic on " << threads << " threads";
}
const PassesCase kPassesCases[] = {
    {{2, 130, 8, 2, 16}, true, {}},                               // the default tiles, grouped heads
    {{1, 300, 4, 1, 16}, true, {}},                               // default tiles, a partial last key tile
    {{2, 37, 6, 2, 5, {4, 8}}, true, {}},                         // two query tiles per key tile
    {{2, 33, 4, 4, 8, {1, 7}}, true, {}},                         // one-row query tiles
    {{2, 23, 4, 4, 8, {4, 4}}, true, {{0, 5, 6, 14}, {0, 1, 2, 3, 20}}},  // documents, one-token ones
    {{1, 40, 4, 2, 8, {4, 8}}, true, {{0, 9, 31}}},                // documents over tiles
    {{1, 150, 4, 1, 16}, true, {{0, 70, 129}}},                    // documents, the default tiles
    {{1, 45, 3, 3, 12, {8, 16}}, false, {}},                       // joint attention, partial tiles
    {{1, 300, 6, 6, 16}, false, {}},                               // joint attention, the default tiles
};
INSTANTIATE_TEST_SUITE_P(Cases, AttentionPassesTest, ::testing::ValuesIn(kPassesCases),
                         [](const ::testing::TestParamInfo<PassesCase>& info) {
                           return "case" + std::to_string(info.index);
                         });

// ==================================================================================================
// Rotary position embedding, in place on the q and k heads of qkv (the attention layout above), v
// untouched. The tables (T, HS/2) are the reference's rope_tables with theta = 100 (angles up to
// ~13 rad over the positions here), rounded to the element type: the op and the reference see the
// same numbers. HS must be even; T, NH, KV and HS/2 are odd where they can be.
// ==================================================================================================
constexpr double kRopeTheta = 100.0;

template <typename Real>
struct RopeTables {
  RopeTables(int T, int HS, double theta)
      : cos(static_cast<size_t>(T) * (HS / 2), "cos"), sin(static_cast<size_t>(T) * (HS / 2), "sin") {
    std::vector<double> c(cos.size()), s(sin.size());
    ref::rope_tables(c.data(), s.data(), T, HS, theta);
    for (size_t i = 0; i < c.size(); i++) cos[i] = static_cast<Real>(c[i]), sin[i] = static_cast<Real>(s[i]);
  }
  GuardedBuffer<Real> cos, sin;
};

// The v heads of every row of `after` are bit for bit those of `before`.
template <typename Real>
void expect_v_untouched(const Real* after, const Real* before, const AttentionShape& s, const std::string& label) {
  const size_t row = static_cast<size_t>(s.NH + 2 * s.KV) * s.HS, v0 = static_cast<size_t>(s.NH + s.KV) * s.HS;
  for (size_t bt = 0; bt < static_cast<size_t>(s.B) * s.T; bt++)
    if (std::memcmp(after + bt * row + v0, before + bt * row + v0, (row - v0) * sizeof(Real)) != 0) {
      ADD_FAILURE() << label << ": the v heads of row " << bt << " changed";
      return;
    }
}

// Each output is a x cos -+ b x sin: two products and a sum.
constexpr int kRopeChain = 3;

// Positions restarting with each packed document: each token turns by its position's angles,
// forward and backward, against the reference.
TEST(Rope, RestartedPositionsMatchReference) {
  const AttentionShape s{2, 11, 3, 1, 6};
  std::vector<int> positions(static_cast<size_t>(s.B) * s.T);
  for (int b = 0; b < s.B; b++)
    for (int t = 0, start = 0; t < s.T; t++) {
      if (t == 4 + b || t == 9) start = t;
      positions[static_cast<size_t>(b) * s.T + t] = t - start;
    }
  std::vector<double> cos(static_cast<size_t>(s.T) * (s.HS / 2)), sin(cos.size());
  ref::rope_tables(cos.data(), sin.data(), s.T, s.HS, kRopeTheta);
  for (bool backward : {false, true}) {
    std::vector<double> x = random_vector(qkv_size(s), 35, -2.0, 2.0), ref_x = x;
    if (backward) {
      cpu::rope_backward(x.data(), cos.data(), sin.data(), s.B, s.T, s.NH, s.KV, s.HS, positions.data());
      ref::rope_backward(ref_x.data(), cos.data(), sin.data(), s.B, s.T, s.NH, s.KV, s.HS, positions.data());
    } else {
      cpu::rope_forward(x.data(), cos.data(), sin.data(), s.B, s.T, s.NH, s.KV, s.HS, positions.data());
      ref::rope_forward(ref_x.data(), cos.data(), sin.data(), s.B, s.T, s.NH, s.KV, s.HS, positions.data());
    }
    expect_close(x.data(), ref_x, kDoubleTol, backward ? "rope_backward with positions" : "rope_forward with positions");
  }
}

// backward = false: rope_forward on qkv; true: rope_backward on a gradient.
template <typename Real>
void check_rope(const AttentionShape& s, bool backward) {
  GuardedBuffer<Real> x(qkv_size(s), backward ? "dqkv" : "qkv");
  RopeTables<Real> tables(s.T, s.HS, kRopeTheta);
  fill_uniform(x.data(), x.size(), backward ? 162 : 161, -2.0, 2.0);
  const std::vector<Real> before(x.data(), x.data() + x.size());
  std::vector<double> ref_x = x.to_double();
  const std::vector<double> cos = tables.cos.to_double(), sin = tables.sin.to_double();
  if (backward) {
    cpu::rope_backward(x.data(), tables.cos.data(), tables.sin.data(), s.B, s.T, s.NH, s.KV, s.HS);
    ref::rope_backward(ref_x.data(), cos.data(), sin.data(), s.B, s.T, s.NH, s.KV, s.HS);
  } else {
    cpu::rope_forward(x.data(), tables.cos.data(), tables.sin.data(), s.B, s.T, s.NH, s.KV, s.HS);
    ref::rope_forward(ref_x.data(), cos.data(), sin.data(), s.B, s.T, s.NH, s.KV, s.HS);
  }
  const std::string label = std::string(backward ? "rope_backward " : "rope_forward ") + type_name<Real>();
  expect_guards_intact(label, x, tables.cos, tables.sin);
  expect_close(x.data(), ref_x, model<Real>(fp32_sum(kRopeChain)), label);
  expect_v_untouched(x.data(), before.data(), s, label);
}

// L = sum(rope(qkv) * R) over the whole row, v included (it passes through, so its gradient is R,
// which the in-place backward leaves in place).
void check_rope_gradients(const AttentionShape& s, bool reference) {
  const auto forward_fn = reference ? &ref::rope_forward : &cpu::rope_forward<double>;
  const auto backward_fn = reference ? &ref::rope_backward : &cpu::rope_backward<double>;
  std::vector<double> cos(static_cast<size_t>(s.T) * (s.HS / 2)), sin(cos.size());
  ref::rope_tables(cos.data(), sin.data(), s.T, s.HS, kRopeTheta);
  std::vector<double> qkv = random_vector(qkv_size(s), 163, -2.0, 2.0);
  const std::vector<double> R = random_vector(qkv.size(), 164);
  std::vector<double> dqkv = R;
  backward_fn(dqkv.data(), cos.data(), sin.data(), s.B, s.T, s.NH, s.KV, s.HS, nullptr);
  const Forward forward = [&](std::vector<double>& y) {
    y = qkv;
    forward_fn(y.data(), cos.data(), sin.data(), s.B, s.T, s.NH, s.KV, s.HS, nullptr);
  };
  const std::string who = reference ? "reference " : "cpu<double> ";
  expect_matches_finite_differences(qkv.data(), qkv.size(), dqkv.data(), R, forward, who + "rope dqkv");
}

// The backward is the forward's adjoint: <rope(x), y> = <x, rope_backward(y)> for any x, y. And,
// the tables being true rotations (cos^2 + sin^2 = 1), it is also the inverse: backward(forward(x)) = x.
void check_rope_adjoint_and_inverse(const AttentionShape& s) {
  std::vector<double> cos(static_cast<size_t>(s.T) * (s.HS / 2)), sin(cos.size());
  ref::rope_tables(cos.data(), sin.data(), s.T, s.HS, kRopeTheta);
  const std::vector<double> x = random_vector(qkv_size(s), 165, -2.0, 2.0), y = random_vector(x.size(), 166);
  std::vector<double> rx = x, by = y;
  cpu::rope_forward(rx.data(), cos.data(), sin.data(), s.B, s.T, s.NH, s.KV, s.HS);
  cpu::rope_backward(by.data(), cos.data(), sin.data(), s.B, s.T, s.NH, s.KV, s.HS);
  double lhs = 0, rhs = 0, magnitude = 0;
  for (size_t i = 0; i < x.size(); i++) {
    lhs += rx[i] * y[i];
    rhs += x[i] * by[i];
    magnitude += std::fabs(rx[i] * y[i]) + std::fabs(x[i] * by[i]);
  }
  EXPECT_NEAR(lhs, rhs, 1e-13 * magnitude) << "<rope(x), y> != <x, rope_backward(y)>";
  std::vector<double> round_trip = rx;
  cpu::rope_backward(round_trip.data(), cos.data(), sin.data(), s.B, s.T, s.NH, s.KV, s.HS);
  expect_close(round_trip.data(), x, kDoubleTol, "rope_backward(rope_forward(x)) vs x");
}

// One hand-worked case: HS = 4, theta = 10000, so inv_freq = {10000^0, 10000^(-2/4)} = {1, 0.01}
// and at position t = 1 the two pairs turn by 1 rad and 0.01 rad; t = 0 turns by nothing. Rotate-half
// pairs element i with i + 2 (interleaved pairs would take i with i + 1 instead): a unit vector
// e_0 goes to (cos 1, 0, sin 1, 0), e_1 to (0, cos .01, 0, sin .01), e_3 to (0, -sin .01, 0, cos .01).
// qkv rows: q0 | q1 | k0 | v0 (NH = 2, KV = 1); B = 2 checks that position means t, not b*T + t.
template <typename Real>
void check_rope_by_hand() {
  const int B = 2, T = 2, NH = 2, KV = 1, HS = 4, row = (NH + 2 * KV) * HS;
  const double inv_freq[2] = {1.0, std::pow(10000.0, -2.0 / 4)};  // = 0.01
  GuardedBuffer<Real> cos(T * HS / 2, "cos"), sin(T * HS / 2, "sin"), qkv(B * T * row, "qkv");
  for (int t = 0; t < T; t++)
    for (int i = 0; i < HS / 2; i++) {
      cos[t * 2 + i] = static_cast<Real>(std::cos(t * inv_freq[i]));
      sin[t * 2 + i] = static_cast<Real>(std::sin(t * inv_freq[i]));
    }
  const double c1 = std::cos(1.0), s1 = std::sin(1.0), c2 = std::cos(0.01), s2 = std::sin(0.01);
  // Per batch: q0, q1, k0, v0 and what rope makes of them at t = 1.
  const double in[2][4][4] = {{{1, 0, 0, 0}, {0, 1, 0, 0}, {0, 0, 0, 1}, {5, 6, 7, 8}},
                              {{0, 0, 1, 0}, {1, 2, 3, 4}, {1, 0, 0, 0}, {-1, -2, -3, -4}}};
  const double at_t1[2][4][4] = {
      {{c1, 0, s1, 0}, {0, c2, 0, s2}, {0, -s2, 0, c2}, {5, 6, 7, 8}},
      {{-s1, 0, c1, 0}, {1 * c1 - 3 * s1, 2 * c2 - 4 * s2, 3 * c1 + 1 * s1, 4 * c2 + 2 * s2}, {c1, 0, s1, 0},
       {-1, -2, -3, -4}}};
  std::vector<double> input(qkv.size()), expected(qkv.size());
  for (int b = 0; b < B; b++)
    for (int t = 0; t < T; t++)
      for (int head = 0; head < 4; head++)
        for (int i = 0; i < HS; i++) {
          const size_t at = (static_cast<size_t>(b) * T + t) * row + head * HS + i;
          input[at] = in[b][head][i];
          expected[at] = t == 0 ? in[b][head][i] : at_t1[b][head][i];
          qkv[at] = static_cast<Real>(input[at]);
        }
  const std::vector<Real> before(qkv.data(), qkv.data() + qkv.size());
  const Tolerance tol = model<Real>({4 * kU32, 4 * kU32});
  const std::string type = type_name<Real>();
  cpu::rope_forward(qkv.data(), cos.data(), sin.data(), B, T, NH, KV, HS);
  expect_guards_intact("rope_forward by hand", qkv, cos, sin);
  expect_close(qkv.data(), expected, tol, "rope_forward by hand " + type);
  expect_v_untouched(qkv.data(), before.data(), {B, T, NH, KV, HS}, "rope_forward by hand " + type);
  // Back: the inverse turn restores the unit vectors.
  cpu::rope_backward(qkv.data(), cos.data(), sin.data(), B, T, NH, KV, HS);
  expect_guards_intact("rope_backward by hand", qkv, cos, sin);
  expect_close(qkv.data(), input, tol, "rope_backward by hand " + type);
  expect_v_untouched(qkv.data(), before.data(), {B, T, NH, KV, HS}, "rope_backward by hand " + type);
}

TEST(RopeByHand, RotateHalfPairsAtKnownAnglesFloat) { check_rope_by_hand<float>(); }
TEST(RopeByHand, RotateHalfPairsAtKnownAnglesDouble) { check_rope_by_hand<double>(); }

class RopeTest : public ::testing::TestWithParam<AttentionShape> {};
TEST_P(RopeTest, ForwardFloatMatchesReference) { check_rope<float>(GetParam(), false); }
TEST_P(RopeTest, ForwardDoubleMatchesReference) { check_rope<double>(GetParam(), false); }
TEST_P(RopeTest, BackwardFloatMatchesReference) { check_rope<float>(GetParam(), true); }
TEST_P(RopeTest, BackwardDoubleMatchesReference) { check_rope<double>(GetParam(), true); }
TEST_P(RopeTest, BackwardMatchesFiniteDifferences) { check_rope_gradients(GetParam(), false); }
TEST_P(RopeTest, ReferenceBackwardMatchesFiniteDifferences) { check_rope_gradients(GetParam(), true); }
TEST_P(RopeTest, BackwardIsAdjointAndInverseOfForward) { check_rope_adjoint_and_inverse(GetParam()); }

std::vector<AttentionShape> rope_shapes() {
  std::vector<AttentionShape> shapes;
  // {NH, KV, HS}: multi-head, grouped (3 and 4 per group), multi-query; HS/2 = 1, 3, 5, 2.
  const Heads heads[] = {{3, 3, 6}, {6, 2, 10}, {4, 1, 2}, {8, 2, 4}};
  for (int B : {1, 3})
    for (int T : {1, 7, 13})
      for (const Heads& h : heads) shapes.push_back({B, T, h.NH, h.KV, h.HS});
  return shapes;
}
INSTANTIATE_TEST_SUITE_P(Shapes, RopeTest, ::testing::ValuesIn(rope_shapes()), ShapeName());

// ==================================================================================================
// GELU and the residual add: pointwise over n elements, n not a multiple of any vector width.
// GELU inputs span [-6, 6) to reach both tails.
// ==================================================================================================
struct PointwiseShape {
  size_t n;
};
std::string name_of(const PointwiseShape& s) { return "n" + std::to_string(s.n); }
void PrintTo(const PointwiseShape& s, std::ostream* os) { *os << name_of(s); }

// fp32 GELU as x * sigmoid(2u): u = sqrt(2/pi)(x + 0.044715 x^3) carries a relative error of a few
// u, which exp turns into an absolute error of ~|2u| (<= 25 at |x| = 6) u in the exponent, i.e. a
// relative error of ~25 u in the far negative tail. rtol 64 u; atol 16 u covers the zero crossing
// of gelu' near x = -0.75 (where s and x s (1-s) 2u' cancel).
constexpr Tolerance kFp32Gelu{16 * kU32, 64 * kU32};

template <typename Real>
void check_gelu_forward(const PointwiseShape& s) {
  GuardedBuffer<Real> inp(s.n, "inp"), out(s.n, "out");
  fill_uniform(inp.data(), s.n, 101, -6.0, 6.0);
  fill_value(out.data(), s.n, quiet_nan<Real>());
  cpu::gelu_forward(out.data(), inp.data(), s.n);
  expect_guards_intact("gelu_forward", inp, out);
  std::vector<double> ref_out(s.n);
  ref::gelu_forward(ref_out.data(), inp.to_double().data(), s.n);
  expect_close(out.data(), ref_out, model<Real>(kFp32Gelu), std::string("gelu out ") + type_name<Real>());
}

template <typename Real>
void check_gelu_backward(const PointwiseShape& s, int calls) {
  GuardedBuffer<Real> inp(s.n, "inp"), dout(s.n, "dout"), dinp(s.n, "dinp");
  fill_uniform(inp.data(), s.n, 102, -6.0, 6.0);
  fill_uniform(dout.data(), s.n, 103);
  fill_value(dinp.data(), s.n, quiet_nan<Real>());  // garbage: dinp is written
  for (int call = 0; call < calls; call++) {
    cpu::gelu_backward(dinp.data(), dout.data(), inp.data(), s.n);
    expect_guards_intact("gelu_backward call " + std::to_string(call + 1), inp, dout, dinp);
  }
  std::vector<double> ref_dinp(s.n);
  ref::gelu_backward(ref_dinp.data(), dout.to_double().data(), inp.to_double().data(), s.n);
  expect_close(dinp.data(), ref_dinp, model<Real>(kFp32Gelu), std::string("gelu dinp ") + type_name<Real>());
}

void check_gelu_gradients(const PointwiseShape& s, bool reference) {
  const auto forward_fn = reference ? &ref::gelu_forward : &cpu::gelu_forward<double>;
  const auto backward_fn = reference ? &ref::gelu_backward : &cpu::gelu_backward<double>;
  std::vector<double> inp = random_vector(s.n, 104, -6.0, 6.0);
  const std::vector<double> R = random_vector(s.n, 105);
  std::vector<double> dinp(s.n);
  backward_fn(dinp.data(), R.data(), inp.data(), s.n);
  const Forward forward = [&](std::vector<double>& y) { forward_fn(y.data(), inp.data(), s.n); };
  const std::string who = reference ? "reference " : "cpu<double> ";
  expect_matches_finite_differences(inp.data(), inp.size(), dinp.data(), R, forward, who + "gelu dinp");
}

template <typename Real>
void check_residual_forward(const PointwiseShape& s) {
  GuardedBuffer<Real> a(s.n, "a"), b(s.n, "b"), out(s.n, "out");
  fill_uniform(a.data(), s.n, 111);
  fill_uniform(b.data(), s.n, 112);
  fill_value(out.data(), s.n, quiet_nan<Real>());
  cpu::residual_forward(out.data(), a.data(), b.data(), s.n);
  expect_guards_intact("residual_forward", a, b, out);
  std::vector<double> ref_out(s.n);
  ref::residual_forward(ref_out.data(), a.to_double().data(), b.to_double().data(), s.n);
  // One rounding: |err| <= u |a + b|; 2 u so the check does not sit on its own bound.
  expect_close(out.data(), ref_out, model<Real>({0.0, 2 * kU32}), std::string("residual out ") + type_name<Real>());
}

class GeluTest : public ::testing::TestWithParam<PointwiseShape> {};
TEST_P(GeluTest, ForwardFloatMatchesReference) { check_gelu_forward<float>(GetParam()); }
TEST_P(GeluTest, ForwardDoubleMatchesReference) { check_gelu_forward<double>(GetParam()); }
TEST_P(GeluTest, BackwardFloatMatchesReference) { check_gelu_backward<float>(GetParam(), 1); }
TEST_P(GeluTest, BackwardDoubleMatchesReference) { check_gelu_backward<double>(GetParam(), 1); }
TEST_P(GeluTest, BackwardMatchesFiniteDifferences) { check_gelu_gradients(GetParam(), false); }
TEST_P(GeluTest, ReferenceBackwardMatchesFiniteDifferences) { check_gelu_gradients(GetParam(), true); }
TEST_P(GeluTest, BackwardTwiceOverwritesDinp) { check_gelu_backward<float>(GetParam(), 2); }

class ResidualTest : public ::testing::TestWithParam<PointwiseShape> {};
TEST_P(ResidualTest, ForwardFloatMatchesReference) { check_residual_forward<float>(GetParam()); }
TEST_P(ResidualTest, ForwardDoubleMatchesReference) { check_residual_forward<double>(GetParam()); }

const PointwiseShape kPointwiseShapes[] = {{1}, {7}, {37}, {257}, {1003}, {4099}};
INSTANTIATE_TEST_SUITE_P(Sizes, GeluTest, ::testing::ValuesIn(kPointwiseShapes), ShapeName());
INSTANTIATE_TEST_SUITE_P(Sizes, ResidualTest, ::testing::ValuesIn(kPointwiseShapes), ShapeName());

// ==================================================================================================
// SwiGLU (Llama's MLP): out(N,I) = silu(gate) * up over rows gate_up(N,2I) = [gate | up]. Gates
// span [-8, 8) to reach both tails of silu; up is in [-1, 1).
// ==================================================================================================
struct SwigluShape {
  int N, I;
};
std::string name_of(const SwigluShape& s) { return "N" + std::to_string(s.N) + "_I" + std::to_string(s.I); }
void PrintTo(const SwigluShape& s, std::ostream* os) { *os << name_of(s); }

// fp32 silu as g / (1 + exp_fast(-g)): exp_fast errs by ~2 u relative, then 1 + e, the division
// and the product with up add a rounding each: ~6 u relative; rtol 32 u. silu'(g) = s (1 + g (1 - s))
// crosses zero near g = -1.28, where 1 + g (1 - s) cancels and errs by a few u absolutely; atol 8 u.
// For large g, 1 - s keeps only s's absolute error, ~|g| u <= 8 u where silu' ~ 1: inside rtol.
constexpr Tolerance kFp32Swiglu{8 * kU32, 32 * kU32};

template <typename Real>
void fill_gate_up(Real* gate_up, const SwigluShape& s, uint64_t seed) {
  for (int n = 0; n < s.N; n++) {
    fill_uniform(gate_up + static_cast<size_t>(n) * 2 * s.I, s.I, seed + 2 * n, -8.0, 8.0);
    fill_uniform(gate_up + static_cast<size_t>(n) * 2 * s.I + s.I, s.I, seed + 2 * n + 1, -1.0, 1.0);
  }
}

template <typename Real>
void check_swiglu_forward(const SwigluShape& s) {
  const size_t NI = static_cast<size_t>(s.N) * s.I;
  GuardedBuffer<Real> gate_up(2 * NI, "gate_up"), out(NI, "out");
  fill_gate_up(gate_up.data(), s, 171);
  fill_value(out.data(), out.size(), quiet_nan<Real>());
  cpu::swiglu_forward(out.data(), gate_up.data(), s.N, s.I);
  expect_guards_intact("swiglu_forward", gate_up, out);
  std::vector<double> ref_out(NI);
  ref::swiglu_forward(ref_out.data(), gate_up.to_double().data(), s.N, s.I);
  expect_close(out.data(), ref_out, model<Real>(kFp32Swiglu), std::string("swiglu out ") + type_name<Real>());
}

// calls = 2: dgate_up is written (=); prefilled NaN garbage must not leak.
template <typename Real>
void check_swiglu_backward(const SwigluShape& s, int calls) {
  const size_t NI = static_cast<size_t>(s.N) * s.I;
  GuardedBuffer<Real> gate_up(2 * NI, "gate_up"), dout(NI, "dout"), dgate_up(2 * NI, "dgate_up");
  fill_gate_up(gate_up.data(), s, 172);
  fill_uniform(dout.data(), dout.size(), 173);
  fill_value(dgate_up.data(), dgate_up.size(), quiet_nan<Real>());  // garbage: dgate_up is written
  for (int call = 0; call < calls; call++) {
    cpu::swiglu_backward(dgate_up.data(), dout.data(), gate_up.data(), s.N, s.I);
    expect_guards_intact("swiglu_backward call " + std::to_string(call + 1), gate_up, dout, dgate_up);
  }
  std::vector<double> ref_dgate_up(2 * NI);
  ref::swiglu_backward(ref_dgate_up.data(), dout.to_double().data(), gate_up.to_double().data(), s.N, s.I);
  expect_close(dgate_up.data(), ref_dgate_up, model<Real>(kFp32Swiglu),
               std::string("swiglu dgate_up ") + type_name<Real>());
}

void check_swiglu_gradients(const SwigluShape& s, bool reference) {
  const size_t NI = static_cast<size_t>(s.N) * s.I;
  const auto forward_fn = reference ? &ref::swiglu_forward : &cpu::swiglu_forward<double>;
  const auto backward_fn = reference ? &ref::swiglu_backward : &cpu::swiglu_backward<double>;
  std::vector<double> gate_up(2 * NI);
  fill_gate_up(gate_up.data(), s, 174);
  const std::vector<double> R = random_vector(NI, 175);
  std::vector<double> dgate_up(2 * NI);
  backward_fn(dgate_up.data(), R.data(), gate_up.data(), s.N, s.I);
  const Forward forward = [&](std::vector<double>& y) { forward_fn(y.data(), gate_up.data(), s.N, s.I); };
  const std::string who = reference ? "reference " : "cpu<double> ";
  expect_matches_finite_differences(gate_up.data(), gate_up.size(), dgate_up.data(), R, forward,
                                    who + "swiglu dgate_up");
}

class SwigluTest : public ::testing::TestWithParam<SwigluShape> {};
TEST_P(SwigluTest, ForwardFloatMatchesReference) { check_swiglu_forward<float>(GetParam()); }
TEST_P(SwigluTest, ForwardDoubleMatchesReference) { check_swiglu_forward<double>(GetParam()); }
TEST_P(SwigluTest, BackwardFloatMatchesReference) { check_swiglu_backward<float>(GetParam(), 1); }
TEST_P(SwigluTest, BackwardDoubleMatchesReference) { check_swiglu_backward<double>(GetParam(), 1); }
TEST_P(SwigluTest, BackwardMatchesFiniteDifferences) { check_swiglu_gradients(GetParam(), false); }
TEST_P(SwigluTest, ReferenceBackwardMatchesFiniteDifferences) { check_swiglu_gradients(GetParam(), true); }
TEST_P(SwigluTest, BackwardTwiceOverwritesDgateUp) { check_swiglu_backward<float>(GetParam(), 2); }

const SwigluShape kSwigluShapes[] = {{1, 1}, {1, 7}, {5, 37}, {13, 11}, {3, 257}, {2, 1003}};
INSTANTIATE_TEST_SUITE_P(Shapes, SwigluTest, ::testing::ValuesIn(kSwigluShapes), ShapeName());

// ==================================================================================================
// Softmax cross-entropy, in place over logits(N,V). Logits are uniform in [-4, 4) + shift; a shift
// of 100 overflows exp in float unless the row maximum is subtracted first.
// ==================================================================================================
struct CrossEntropyShape {
  int N, V;
  int shift;
};
std::string name_of(const CrossEntropyShape& s) {
  const std::string shift = s.shift > 0 ? "_shiftplus" + std::to_string(s.shift)
                            : s.shift < 0 ? "_shiftminus" + std::to_string(-s.shift) : "";
  return "N" + std::to_string(s.N) + "_V" + std::to_string(s.V) + shift;
}
void PrintTo(const CrossEntropyShape& s, std::ostream* os) { *os << name_of(s); }

// probs: exp_fast and a sum of V terms, one division: fp32_sum(V + 4). The loss, -log p, adds an
// absolute error of about u |logit| if it is formed as (max + log sum) - logit, so atol gets a
// further 4 u (|shift| + 4).
Tolerance fp32_probs(const CrossEntropyShape& s) { return fp32_sum(s.V + 4); }
Tolerance fp32_losses(const CrossEntropyShape& s) {
  const Tolerance t = fp32_sum(s.V + 4);
  return {t.atol + 4 * kU32 * (std::abs(s.shift) + 4), t.rtol};
}

// Every third row's target is a loss mask's ignored one (IGNORED_TARGET): no loss, no gradient.
void ignore_some(int* targets, int N) {
  for (int n = 1; n < N; n += 3) targets[n] = shardtrain::IGNORED_TARGET;
}

template <typename Real>
void check_crossentropy_forward(const CrossEntropyShape& s) {
  GuardedBuffer<Real> logits(static_cast<size_t>(s.N) * s.V, "logits"), losses(s.N, "losses");
  GuardedBuffer<int> targets(s.N, "targets");
  fill_uniform(logits.data(), logits.size(), 121, s.shift - 4.0, s.shift + 4.0);
  fill_indices(targets.data(), s.N, 122, s.V);
  ignore_some(targets.data(), s.N);
  fill_value(losses.data(), losses.size(), quiet_nan<Real>());
  std::vector<double> ref_probs = logits.to_double(), ref_losses(s.N);
  cpu::softmax_crossentropy_forward(losses.data(), logits.data(), targets.data(), s.N, s.V);
  expect_guards_intact("softmax_crossentropy_forward", logits, losses, targets);
  ref::softmax_crossentropy_forward(ref_losses.data(), ref_probs.data(), targets.data(), s.N, s.V);
  const std::string type = type_name<Real>();
  expect_close(logits.data(), ref_probs, model<Real>(fp32_probs(s)), "crossentropy probs " + type);
  expect_close(losses.data(), ref_losses, model<Real>(fp32_losses(s)), "crossentropy losses " + type);
}

template <typename Real>
void check_crossentropy_backward(const CrossEntropyShape& s) {
  GuardedBuffer<Real> logits(static_cast<size_t>(s.N) * s.V, "probs"), losses(s.N, "losses");
  GuardedBuffer<int> targets(s.N, "targets");
  fill_uniform(logits.data(), logits.size(), 123, s.shift - 4.0, s.shift + 4.0);
  fill_indices(targets.data(), s.N, 124, s.V);
  ignore_some(targets.data(), s.N);
  cpu::softmax_crossentropy_forward(losses.data(), logits.data(), targets.data(), s.N, s.V);
  // The mean over N tokens, as the trainer uses it; the reference gets dloss as the op sees it.
  const Real dloss = Real(1.0 / s.N);
  std::vector<double> ref_dlogits = logits.to_double();
  cpu::softmax_crossentropy_backward(logits.data(), targets.data(), dloss, s.N, s.V);
  expect_guards_intact("softmax_crossentropy_backward", logits, targets);
  ref::softmax_crossentropy_backward(ref_dlogits.data(), targets.data(), static_cast<double>(dloss), s.N, s.V);
  // Two roundings, in either order: (p - 1) * dloss, or p * dloss - dloss, whose subtraction cancels
  // when p -> 1 and errs by up to ~u |dloss| in absolute terms. So atol 4 u |dloss|, rtol 4 u.
  const double d = std::fabs(static_cast<double>(dloss));
  expect_close(logits.data(), ref_dlogits, model<Real>({4 * kU32 * d, 4 * kU32}),
               std::string("crossentropy dlogits ") + type_name<Real>());
}

void check_crossentropy_gradients(const CrossEntropyShape& s, bool reference) {
  const auto forward_fn = reference ? &ref::softmax_crossentropy_forward : &cpu::softmax_crossentropy_forward<double>;
  const auto backward_fn =
      reference ? &ref::softmax_crossentropy_backward : &cpu::softmax_crossentropy_backward<double>;
  std::vector<double> logits = random_vector(static_cast<size_t>(s.N) * s.V, 131, s.shift - 4.0, s.shift + 4.0);
  std::vector<int> targets(s.N);
  fill_indices(targets.data(), s.N, 132, s.V);
  const double dloss = 0.37;  // L = dloss * sum_n loss_n, so R = dloss everywhere
  const std::vector<double> R(s.N, dloss);
  std::vector<double> dlogits = logits, losses(s.N);
  forward_fn(losses.data(), dlogits.data(), targets.data(), s.N, s.V);
  backward_fn(dlogits.data(), targets.data(), dloss, s.N, s.V);
  std::vector<double> scratch(logits.size());
  const Forward forward = [&](std::vector<double>& y) {
    scratch = logits;  // the forward consumes its input
    forward_fn(y.data(), scratch.data(), targets.data(), s.N, s.V);
  };
  const std::string who = reference ? "reference " : "cpu<double> ";
  expect_matches_finite_differences(logits.data(), logits.size(), dlogits.data(), R, forward,
                                    who + "crossentropy dlogits");
}

class CrossEntropyTest : public ::testing::TestWithParam<CrossEntropyShape> {};
TEST_P(CrossEntropyTest, ForwardFloatMatchesReference) { check_crossentropy_forward<float>(GetParam()); }
TEST_P(CrossEntropyTest, ForwardDoubleMatchesReference) { check_crossentropy_forward<double>(GetParam()); }
TEST_P(CrossEntropyTest, BackwardFloatMatchesReference) { check_crossentropy_backward<float>(GetParam()); }
TEST_P(CrossEntropyTest, BackwardDoubleMatchesReference) { check_crossentropy_backward<double>(GetParam()); }
TEST_P(CrossEntropyTest, BackwardMatchesFiniteDifferences) { check_crossentropy_gradients(GetParam(), false); }
TEST_P(CrossEntropyTest, ReferenceBackwardMatchesFiniteDifferences) { check_crossentropy_gradients(GetParam(), true); }

std::vector<CrossEntropyShape> crossentropy_shapes() {
  std::vector<CrossEntropyShape> shapes;
  for (int N : {1, 5, 13, 39})
    for (int V : {11, 50}) shapes.push_back({N, V, 0});
  shapes.push_back({7, 257, 0});
  shapes.push_back({5, 50, 100});
  shapes.push_back({3, 11, -100});
  return shapes;
}
INSTANTIATE_TEST_SUITE_P(Shapes, CrossEntropyTest, ::testing::ValuesIn(crossentropy_shapes()), ShapeName());


// ==================================================================================================
// Null parameter gradients (frozen parameters): every backward accepts a null dweight, dbias,
// dwte or dwpe, computes nothing for it and gives every other output the same bits as the call
// with all gradients present. Each case runs the full call on copies of the same prefilled
// buffers, then the call with some gradients null, and compares the remaining outputs bitwise.
// ==================================================================================================
template <typename Real>
std::vector<Real> copy_of(const GuardedBuffer<Real>& b) {
  return std::vector<Real>(b.data(), b.data() + b.size());
}

template <typename Real>
void expect_same_bits(const GuardedBuffer<Real>& actual, const std::vector<Real>& expected, const std::string& label) {
  ASSERT_EQ(actual.size(), expected.size()) << label;
  EXPECT_EQ(std::memcmp(actual.data(), expected.data(), expected.size() * sizeof(Real)), 0)
      << label << " differs from the call with every gradient present";
}

// A buffer prefilled from a seed: the same contents before every run.
template <typename Real>
void refill(GuardedBuffer<Real>& b, uint64_t seed) {
  fill_uniform(b.data(), b.size(), seed);
}

template <typename Real>
void check_matmul_null_gradients(const MatmulShape& s) {
  MatmulInputs<Real> in(s);
  GuardedBuffer<Real> dout(static_cast<size_t>(s.N) * s.OC, "dout"), dinp(in.inp.size(), "dinp"),
      dweight(in.weight.size(), "dweight"), dbias(static_cast<size_t>(s.OC), "dbias");
  fill_uniform(dout.data(), dout.size(), 67);
  auto run = [&](bool with_dinp, bool with_dweight, bool with_dbias) {
    fill_value(dinp.data(), dinp.size(), quiet_nan<Real>());
    refill(dweight, 68);
    refill(dbias, 69);
    cpu::matmul_backward(with_dinp ? dinp.data() : nullptr, with_dweight ? dweight.data() : nullptr,
                         with_dbias ? dbias.data() : nullptr, dout.data(), in.inp.data(), in.weight.data(), s.N, s.C,
                         s.OC);
    expect_guards_intact("matmul_backward with null gradients", dout, dinp, dweight, dbias, in.inp, in.weight);
  };
  run(true, true, true);
  const std::vector<Real> full_dinp = copy_of(dinp), full_dweight = copy_of(dweight), full_dbias = copy_of(dbias);
  const std::vector<Real> prefill_dweight = [&] { refill(dweight, 68); return copy_of(dweight); }();
  const std::vector<Real> prefill_dbias = [&] { refill(dbias, 69); return copy_of(dbias); }();
  const std::string type = type_name<Real>();
  for (int mask = 0; mask < 8; mask++) {
    const bool with_dinp = mask & 1, with_dweight = mask & 2, with_dbias = mask & 4;
    run(with_dinp, with_dweight, with_dbias);
    const std::string label = "matmul (dinp " + std::to_string(with_dinp) + ", dweight " +
                              std::to_string(with_dweight) + ", dbias " + std::to_string(with_dbias) + ") " + type;
    if (with_dinp)
      expect_same_bits(dinp, full_dinp, label + " dinp");
    else
      EXPECT_TRUE(std::all_of(dinp.data(), dinp.data() + dinp.size(), [](Real x) { return std::isnan(x); }))
          << label << ": dinp written although null";
    expect_same_bits(dweight, with_dweight ? full_dweight : prefill_dweight, label + " dweight");
    expect_same_bits(dbias, with_dbias ? full_dbias : prefill_dbias, label + " dbias");
  }
}

template <typename Real>
void check_layernorm_null_gradients(const LayerNormShape& s) {
  LayerNormInputs<Real> in(s);
  const int N = in.N, C = in.C;
  GuardedBuffer<Real> out(static_cast<size_t>(N) * C, "out"), mean(N, "mean"), rstd(N, "rstd");
  cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), in.inp.data(), in.weight.data(), in.bias.data(), N, C);
  GuardedBuffer<Real> dout(out.size(), "dout"), dinp(out.size(), "dinp"), dweight(C, "dweight"), dbias(C, "dbias");
  fill_uniform(dout.data(), dout.size(), 48);
  auto run = [&](bool with_dweight, bool with_dbias) {
    refill(dinp, 49);  // dinp accumulates
    refill(dweight, 50);
    refill(dbias, 51);
    cpu::layernorm_backward(dinp.data(), with_dweight ? dweight.data() : nullptr, with_dbias ? dbias.data() : nullptr,
                            dout.data(), in.inp.data(), in.weight.data(), mean.data(), rstd.data(), N, C);
    expect_guards_intact("layernorm_backward with null gradients", dinp, dweight, dbias, dout, in.inp, in.weight,
                         mean, rstd);
  };
  run(false, false);  // the prefills, untouched
  const std::vector<Real> prefill_dweight = copy_of(dweight), prefill_dbias = copy_of(dbias);
  run(true, true);
  const std::vector<Real> full_dinp = copy_of(dinp), full_dweight = copy_of(dweight), full_dbias = copy_of(dbias);
  const std::string type = type_name<Real>();
  for (int mask = 0; mask < 4; mask++) {
    const bool with_dweight = mask & 1, with_dbias = mask & 2;
    run(with_dweight, with_dbias);
    const std::string label =
        "layernorm (dweight " + std::to_string(with_dweight) + ", dbias " + std::to_string(with_dbias) + ") " + type;
    expect_same_bits(dinp, full_dinp, label + " dinp");
    expect_same_bits(dweight, with_dweight ? full_dweight : prefill_dweight, label + " dweight");
    expect_same_bits(dbias, with_dbias ? full_dbias : prefill_dbias, label + " dbias");
  }
}

template <typename Real>
void check_rmsnorm_null_gradients(const RmsNormShape& s) {
  RmsNormInputs<Real> in(s);
  const int N = in.N, C = in.C;
  GuardedBuffer<Real> out(static_cast<size_t>(N) * C, "out"), rstd(N, "rstd");
  cpu::rmsnorm_forward(out.data(), rstd.data(), in.inp.data(), in.weight.data(), in.eps, N, C);
  GuardedBuffer<Real> dout(out.size(), "dout"), dinp(out.size(), "dinp"), dweight(C, "dweight");
  fill_uniform(dout.data(), dout.size(), 147);
  auto run = [&](bool with_dweight) {
    refill(dinp, 148);
    refill(dweight, 149);
    cpu::rmsnorm_backward(dinp.data(), with_dweight ? dweight.data() : nullptr, dout.data(), in.inp.data(),
                          in.weight.data(), rstd.data(), N, C);
    expect_guards_intact("rmsnorm_backward with null dweight", dinp, dweight, dout, in.inp, in.weight, rstd);
  };
  run(true);
  const std::vector<Real> full_dinp = copy_of(dinp);
  run(false);
  const std::string label = std::string("rmsnorm (no dweight) ") + type_name<Real>();
  expect_same_bits(dinp, full_dinp, label + " dinp");
  GuardedBuffer<Real> prefill(C, "prefill");
  refill(prefill, 149);
  expect_same_bits(dweight, copy_of(prefill), label + " dweight buffer");
}

template <typename Real>
void check_encoder_null_gradients(const EncoderShape& s) {
  const size_t BT = static_cast<size_t>(s.B) * s.T, maxT = s.T + kExtraPositions;
  GuardedBuffer<int> tokens(BT, "tokens");
  GuardedBuffer<Real> dout(BT * s.C, "dout"), dwte(static_cast<size_t>(s.V) * s.C, "dwte"), dwpe(maxT * s.C, "dwpe");
  fill_indices(tokens.data(), BT, 25, s.V);
  fill_uniform(dout.data(), dout.size(), 26);
  auto run = [&](bool with_dwte, bool with_dwpe) {
    refill(dwte, 27);
    refill(dwpe, 28);
    cpu::encoder_backward(with_dwte ? dwte.data() : nullptr, with_dwpe ? dwpe.data() : nullptr, dout.data(),
                          tokens.data(), s.B, s.T, s.C);
    expect_guards_intact("encoder_backward with null gradients", tokens, dout, dwte, dwpe);
  };
  run(false, false);  // both null: nothing to do, the prefills untouched
  const std::vector<Real> prefill_dwte = copy_of(dwte), prefill_dwpe = copy_of(dwpe);
  run(true, true);
  const std::vector<Real> full_dwte = copy_of(dwte), full_dwpe = copy_of(dwpe);
  const std::string type = type_name<Real>();
  for (int mask = 0; mask < 4; mask++) {
    const bool with_dwte = mask & 1, with_dwpe = mask & 2;
    run(with_dwte, with_dwpe);
    const std::string label =
        "encoder (dwte " + std::to_string(with_dwte) + ", dwpe " + std::to_string(with_dwpe) + ") " + type;
    expect_same_bits(dwte, with_dwte ? full_dwte : prefill_dwte, label + " dwte");
    expect_same_bits(dwpe, with_dwpe ? full_dwpe : prefill_dwpe, label + " dwpe");
  }
}

TEST_P(MatmulTest, NullGradientsLeaveTheOthersBitwiseFloat) { check_matmul_null_gradients<float>(GetParam()); }
TEST_P(MatmulTest, NullGradientsLeaveTheOthersBitwiseDouble) { check_matmul_null_gradients<double>(GetParam()); }
TEST_P(LayerNormTest, NullGradientsLeaveTheOthersBitwiseFloat) { check_layernorm_null_gradients<float>(GetParam()); }
TEST_P(LayerNormTest, NullGradientsLeaveTheOthersBitwiseDouble) { check_layernorm_null_gradients<double>(GetParam()); }
TEST_P(RmsNormTest, NullDweightLeavesDinpBitwiseFloat) { check_rmsnorm_null_gradients<float>(GetParam()); }
TEST_P(RmsNormTest, NullDweightLeavesDinpBitwiseDouble) { check_rmsnorm_null_gradients<double>(GetParam()); }
TEST_P(EncoderTest, NullGradientsLeaveTheOthersBitwiseFloat) { check_encoder_null_gradients<float>(GetParam()); }
TEST_P(EncoderTest, NullGradientsLeaveTheOthersBitwiseDouble) { check_encoder_null_gradients<double>(GetParam()); }

// ==================================================================================================
// Dropout keyed by the counter RNG: out = keep ? inp / (1 - p) : 0, keep(r, c) =
// counter_keep(dropout_row_key(row_keys[r], site), c, dropout_threshold24(p)). Inputs are in
// [0.5, 1.5) so a kept element is never 0 and the mask can be read off the output.
// ==================================================================================================
struct DropoutShape {
  int N, C;
  float p;
};
std::string name_of(const DropoutShape& s) {
  return "N" + std::to_string(s.N) + "_C" + std::to_string(s.C) + "_p" + std::to_string(static_cast<int>(s.p * 1000));
}
void PrintTo(const DropoutShape& s, std::ostream* os) { *os << name_of(s); }

std::vector<uint64_t> random_keys(size_t n, uint64_t seed) {
  shardtrain::testing::TestRng rng(seed);
  std::vector<uint64_t> keys(n);
  for (uint64_t& k : keys) k = rng.next();
  return keys;
}

// The mask as the documented formula gives it (1 kept, 0 dropped), row-major (N, C).
std::vector<uint8_t> expected_mask(const std::vector<uint64_t>& row_keys, uint64_t site, int C, float p) {
  const uint32_t threshold = shardtrain::dropout_threshold24(p);
  std::vector<uint8_t> mask(row_keys.size() * C);
  for (size_t r = 0; r < row_keys.size(); r++) {
    const uint64_t key = shardtrain::dropout_row_key(row_keys[r], site);
    for (int c = 0; c < C; c++) mask[r * C + c] = shardtrain::counter_keep(key, c, threshold);
  }
  return mask;
}

template <typename Real>
std::vector<uint8_t> mask_of(const Real* out, size_t n) {
  std::vector<uint8_t> mask(n);
  for (size_t i = 0; i < n; i++) mask[i] = out[i] != Real(0);
  return mask;
}

// Every element is +0 where the formula drops it and exactly inp / (1 - p) where it keeps it.
template <typename Real>
void check_dropout_formula(const DropoutShape& s) {
  const size_t n = static_cast<size_t>(s.N) * s.C;
  const std::vector<uint64_t> keys = random_keys(s.N, 201);
  const uint64_t site = 7;
  GuardedBuffer<Real> inp(n, "inp"), out(n, "out");
  GuardedBuffer<uint64_t> row_keys(s.N, "row_keys");
  std::copy(keys.begin(), keys.end(), row_keys.data());
  fill_uniform(inp.data(), n, 202, 0.5, 1.5);
  fill_value(out.data(), n, quiet_nan<Real>());
  cpu::dropout(out.data(), inp.data(), row_keys.data(), site, s.N, s.C, s.p);
  expect_guards_intact("dropout", inp, out, row_keys);
  const std::vector<uint8_t> mask = expected_mask(keys, site, s.C, s.p);
  const Real keep_fraction = Real(1) - Real(s.p);
  size_t wrong = 0, first_wrong = n;
  for (size_t i = 0; i < n; i++) {
    const Real want = mask[i] ? inp[i] / keep_fraction : Real(0);
    if (std::memcmp(&out[i], &want, sizeof(Real)) != 0) {
      wrong++;
      first_wrong = std::min(first_wrong, i);
    }
  }
  EXPECT_EQ(wrong, 0u) << "dropout " << name_of(s) << " " << type_name<Real>() << ": first wrong element "
                       << first_wrong;
}

// In place (out == inp) gives the out-of-place bits; the same keys give the same output on every
// call and thread count (a pure function of the keys, no state).
template <typename Real>
void check_dropout_in_place_and_repeatable(const DropoutShape& s) {
  const size_t n = static_cast<size_t>(s.N) * s.C;
  const std::vector<uint64_t> keys = random_keys(s.N, 203);
  std::vector<Real> inp(n), out(n);
  fill_uniform(inp.data(), n, 204);
  cpu::dropout(out.data(), inp.data(), keys.data(), 11, s.N, s.C, s.p);
  std::vector<Real> in_place = inp;
  cpu::dropout(in_place.data(), in_place.data(), keys.data(), 11, s.N, s.C, s.p);
  EXPECT_TRUE(same_bits(out, in_place)) << "dropout in place differs from out of place, " << name_of(s);
  for (int threads : {1, 2, 3}) {
    std::vector<Real> again(n, quiet_nan<Real>());
    with_threads(threads, [&] { cpu::dropout(again.data(), inp.data(), keys.data(), 11, s.N, s.C, s.p); });
    EXPECT_TRUE(same_bits(out, again)) << "dropout differs on a repeat with " << threads << " threads, " << name_of(s);
  }
}

// Backward = the same call on the output gradient: the op is linear with a diagonal matrix, so
// <dropout(x), R> = <x, dropout(R)> (double: equal to rounding).
void check_dropout_adjoint(const DropoutShape& s) {
  const size_t n = static_cast<size_t>(s.N) * s.C;
  const std::vector<uint64_t> keys = random_keys(s.N, 205);
  const std::vector<double> x = random_vector(n, 206), R = random_vector(n, 207);
  std::vector<double> y(n), dx(n);
  cpu::dropout(y.data(), x.data(), keys.data(), 3, s.N, s.C, s.p);
  cpu::dropout(dx.data(), R.data(), keys.data(), 3, s.N, s.C, s.p);
  double forward = 0, adjoint = 0, scale = 0;
  for (size_t i = 0; i < n; i++) {
    forward += y[i] * R[i];
    adjoint += x[i] * dx[i];
    scale += std::fabs(y[i] * R[i]);
  }
  EXPECT_NEAR(forward, adjoint, 1e-13 * std::max(1.0, scale)) << "dropout adjoint, " << name_of(s);
}

class DropoutTest : public ::testing::TestWithParam<DropoutShape> {};
TEST_P(DropoutTest, MaskAndScaleAreTheFormulaFloat) { check_dropout_formula<float>(GetParam()); }
TEST_P(DropoutTest, MaskAndScaleAreTheFormulaDouble) { check_dropout_formula<double>(GetParam()); }
TEST_P(DropoutTest, InPlaceEqualsOutOfPlaceAndRepeatsFloat) { check_dropout_in_place_and_repeatable<float>(GetParam()); }
TEST_P(DropoutTest, InPlaceEqualsOutOfPlaceAndRepeatsDouble) {
  check_dropout_in_place_and_repeatable<double>(GetParam());
}
TEST_P(DropoutTest, BackwardIsTheSameCallAdjoint) { check_dropout_adjoint(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Shapes, DropoutTest,
                         ::testing::Values(DropoutShape{1, 1, 0.5f}, DropoutShape{5, 12, 0.1f},
                                           DropoutShape{13, 37, 0.5f}, DropoutShape{7, 33, 0.9f},
                                           DropoutShape{39, 100, 0.25f}, DropoutShape{3, 5, 1.0f},
                                           DropoutShape{4, 9, 0.0f}),
                         ShapeName());

// The fraction dropped over 2^20 elements is the Bernoulli rate threshold/2^24 (within 2^-25 of p)
// up to 5 binomial standard deviations; the scale is exactly 1 / (1 - p).
TEST(DropoutStatistics, DroppedFractionIsPWithinFiveSigma) {
  const int N = 1024, C = 1024;
  const size_t n = static_cast<size_t>(N) * C;
  const std::vector<uint64_t> keys = random_keys(N, 211);
  std::vector<float> ones(n, 1.0f), out(n);
  for (float p : {0.01f, 0.1f, 0.25f, 0.5f, 0.9f}) {
    const double q = shardtrain::dropout_threshold24(p) / 16777216.0;
    EXPECT_LE(std::fabs(q - p), 0x1p-25) << "threshold of p = " << p;
    cpu::dropout(out.data(), ones.data(), keys.data(), 5, N, C, p);
    size_t dropped = 0;
    for (float v : out) {
      if (v == 0.0f) {
        dropped++;
      } else if (v != 1.0f / (1.0f - p)) {
        ADD_FAILURE() << "kept element " << v << " is not 1 / (1 - p) for p = " << p;
        break;
      }
    }
    const double mean = n * q, sigma = std::sqrt(n * q * (1 - q));
    EXPECT_LE(std::fabs(static_cast<double>(dropped) - mean), 5 * sigma)
        << "p = " << p << ": dropped " << dropped << " of " << n << ", expected " << mean << " +- " << sigma;
  }
}

// Masks of different sites, of different row keys and of different rows agree where independent
// Bernoulli(q) draws would: on a fraction q^2 + (1-q)^2 of the positions, within 5 sigma. Rows
// with equal keys get equal masks; changing one row's key changes that row's mask only. Row keys
// as simple as 0, 1, 2, ... still give independent rows (the row key is mixed with the site).
TEST(DropoutStatistics, MasksDependOnKeyAndSiteOnly) {
  const int N = 256, C = 1024;
  const size_t n = static_cast<size_t>(N) * C;
  const float p = 0.3f;
  const double q = shardtrain::dropout_threshold24(p) / 16777216.0, agree = q * q + (1 - q) * (1 - q);
  const double sigma = std::sqrt(n * agree * (1 - agree));
  std::vector<float> ones(n, 1.0f);
  auto mask = [&](const std::vector<uint64_t>& keys, uint64_t site) {
    std::vector<float> out(n);
    cpu::dropout(out.data(), ones.data(), keys.data(), site, N, C, p);
    return mask_of(out.data(), n);
  };
  auto expect_independent = [&](const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, const std::string& what) {
    size_t same = 0;
    for (size_t i = 0; i < n; i++) same += a[i] == b[i];
    EXPECT_LE(std::fabs(static_cast<double>(same) - n * agree), 5 * sigma)
        << what << ": " << same << " of " << n << " positions agree, independent masks give " << n * agree;
  };
  std::vector<uint64_t> simple(N);
  for (int r = 0; r < N; r++) simple[r] = static_cast<uint64_t>(r);
  const std::vector<uint64_t> keys = random_keys(N, 212);
  const std::vector<uint8_t> base = mask(keys, 1);
  EXPECT_EQ(base, mask(keys, 1)) << "the same keys and site gave another mask";
  EXPECT_EQ(base, expected_mask(keys, 1, C, p)) << "the mask is not the documented formula";
  expect_independent(base, mask(keys, 2), "sites 1 and 2");
  expect_independent(base, mask(keys, 1ull << 40), "sites 1 and 2^40");
  expect_independent(base, mask(random_keys(N, 213), 1), "other row keys");
  const std::vector<uint8_t> simple_mask = mask(simple, 0);
  expect_independent(simple_mask, mask(simple, 1), "row keys 0..N-1, sites 0 and 1");
  // Row r against row r + 1 (a shifted copy of the mask), for simple and for random keys.
  for (const std::vector<uint8_t>* m : {&base, &simple_mask}) {
    std::vector<uint8_t> shifted(m->begin() + C, m->end());
    shifted.insert(shifted.end(), m->begin(), m->begin() + C);
    expect_independent(*m, shifted, m == &base ? "neighbouring rows" : "neighbouring rows of keys 0..N-1");
  }
  // Column c against column c + 1 within each row.
  std::vector<uint8_t> next_column(n);
  for (size_t i = 0; i < n; i++) next_column[i] = base[(i / C) * C + (i % C + 1) % C];
  expect_independent(base, next_column, "neighbouring columns");

  std::vector<uint64_t> equal(N, keys[0]);  // every row the same key: every row the same mask
  const std::vector<uint8_t> equal_mask = mask(equal, 1);
  for (int r = 1; r < N; r++)
    ASSERT_TRUE(std::equal(equal_mask.begin(), equal_mask.begin() + C, equal_mask.begin() + static_cast<size_t>(r) * C))
        << "rows with equal keys got different masks (row " << r << ")";
  std::vector<uint64_t> one_changed = keys;
  one_changed[17] ^= 1;
  const std::vector<uint8_t> changed = mask(one_changed, 1);
  for (int r = 0; r < N; r++) {
    const bool same_row = std::equal(base.begin() + static_cast<size_t>(r) * C, base.begin() + (r + 1) * size_t(C),
                                     changed.begin() + static_cast<size_t>(r) * C);
    EXPECT_EQ(same_row, r != 17) << "row " << r << " after flipping one bit of row 17's key";
  }
}

// p = 0 is the identity, bit for bit (NaN payloads and -0 included), in place and out of place;
// p = 1 writes +0 everywhere (inf and NaN inputs included).
TEST(DropoutEdges, ZeroIsIdentityOneIsZeros) {
  const int N = 3, C = 7;
  const size_t n = static_cast<size_t>(N) * C;
  const std::vector<uint64_t> keys = random_keys(N, 214);
  std::vector<float> inp(n);
  fill_uniform(inp.data(), n, 215);
  inp[0] = -0.0f;
  inp[1] = std::numeric_limits<float>::infinity();
  inp[2] = shardtrain::testing::guard_sentinel<float>("payload");
  std::vector<float> out(n, 5.0f);
  cpu::dropout(out.data(), inp.data(), keys.data(), 9, N, C, 0.0f);
  EXPECT_TRUE(same_bits(out, inp)) << "p = 0 out of place";
  std::vector<float> in_place = inp;
  cpu::dropout(in_place.data(), in_place.data(), keys.data(), 9, N, C, 0.0f);
  EXPECT_TRUE(same_bits(in_place, inp)) << "p = 0 in place";
  cpu::dropout(out.data(), inp.data(), keys.data(), 9, N, C, 1.0f);
  EXPECT_TRUE(same_bits(out, std::vector<float>(n, 0.0f))) << "p = 1";
  std::vector<double> empty;
  cpu::dropout(empty.data(), empty.data(), static_cast<const uint64_t*>(nullptr), 9, 0, C, 0.5f);  // N = 0: nothing
}

// The CPU backend's LayerOps forwards dropout to cpu::dropout.
TEST(DropoutEdges, LayerOpsInterfaceIsTheCpuFunction) {
  const int N = 5, C = 12;
  const size_t n = static_cast<size_t>(N) * C;
  const std::vector<uint64_t> keys = random_keys(N, 216);
  std::vector<float> inp(n), a(n), b(n);
  fill_uniform(inp.data(), n, 217);
  cpu::dropout(a.data(), inp.data(), keys.data(), 4, N, C, 0.4f);
  shardtrain::cpu_layer_ops<float>().dropout(b.data(), inp.data(), keys.data(), 4, N, C, 0.4f);
  EXPECT_TRUE(same_bits(a, b));
}

}  // namespace
