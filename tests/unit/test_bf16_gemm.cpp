// The CPU's bf16 linear layers (backend/cpu/bf16_gemm.hpp), both kernels -- oneDNN's bf16 matmul
// (where this CPU runs it: native_bf16()) and OpenBLAS SGEMMs on the rounded operands (everywhere)
// -- against a naive loop in double over the operands rounded to bf16 here (float_to_bf16):
//   - forward (onto a bias or not) and both backward products, with dweight accumulated and each
//     gradient optional, match the reference to fp32 summation error (K u sum |a b|), while the
//     same loop over unrounded operands is far outside that bound (the test sees the rounding);
//   - the bias gradient is the fp32 column sum, as without bf16;
//   - the two kernels agree, and each gives the same bits twice;
//   - a weight passed with its bf16 copy (the engine's gathered unit) gives the same bits, is not
//     rounded again, and the copy is what is multiplied;
//   - the workspace: what plan_workspace_bytes predicts is what the constructor holds, and
//     running every product of the planned layers (weights with their copies) does not grow it; a
//     larger product, or a weight without its copy, does.
// Shapes are odd (K = 1 and odd K split unevenly into halves by the SGEMM kernel).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "backend/cpu/bf16_gemm.hpp"
#include "backend/cpu/ops.hpp"
#include "backend/dtype.hpp"
#include "support/tensor_check.hpp"

namespace {

using shardtrain::bf16_to_float;
using shardtrain::float_to_bf16;
using shardtrain::cpu::Bf16Gemm;
using shardtrain::cpu::LinearShape;
using shardtrain::testing::fill_uniform;

double round_bf16(float x) { return bf16_to_float(float_to_bf16(x)); }

// out(N,OC) = inp(N,C) W(OC,C)^T in double, with both operands rounded to bf16 (or not), and the
// bound of fp32 summation error for each element: K u sum |a b| (u = 2^-24), doubled for slack.
struct Reference {
  std::vector<double> value, bound;
};
Reference product(const std::vector<float>& a, bool trans_a, const std::vector<float>& b, bool trans_b, int M, int N,
                  int K, bool rounded) {
  Reference r{std::vector<double>(static_cast<size_t>(M) * N), std::vector<double>(static_cast<size_t>(M) * N)};
  // Element (i, k) of op(x), a rows x cols matrix (x stored transposed when t).
  auto op = [&](const std::vector<float>& x, bool t, int i, int k, int rows, int cols) {
    float v = t ? x[static_cast<size_t>(k) * rows + i] : x[static_cast<size_t>(i) * cols + k];
    return rounded ? round_bf16(v) : static_cast<double>(v);
  };
  for (int i = 0; i < M; i++)
    for (int j = 0; j < N; j++) {
      double sum = 0, magnitude = 0;
      for (int k = 0; k < K; k++) {
        const double p = op(a, trans_a, i, k, M, K) * op(b, trans_b, k, j, K, N);
        sum += p, magnitude += std::fabs(p);
      }
      r.value[static_cast<size_t>(i) * N + j] = sum;
      r.bound[static_cast<size_t>(i) * N + j] = 2.0 * (K + 1) * 0x1p-24 * magnitude + 1e-30;
    }
  return r;
}

// Every element within its bound; returns the largest |error| / bound seen.
double expect_within(const std::vector<float>& got, const Reference& want, const std::vector<float>& base,
                     const char* what) {
  double worst = 0;
  for (size_t i = 0; i < got.size(); i++) {
    const double err = std::fabs(got[i] - (base.empty() ? 0.0 : base[i]) - want.value[i]);
    worst = std::max(worst, err / want.bound[i]);
    if (err > want.bound[i]) {
      ADD_FAILURE() << what << ": element " << i << " is " << got[i] << ", expected " << want.value[i]
                    << " within " << want.bound[i];
      break;
    }
  }
  return worst;
}

// How far the unrounded product is, in units of the bound: must be far outside for the test to mean anything.
double worst_ratio(const Reference& rounded, const Reference& exact) {
  double worst = 0;
  for (size_t i = 0; i < rounded.value.size(); i++)
    worst = std::max(worst, std::fabs(rounded.value[i] - exact.value[i]) / rounded.bound[i]);
  return worst;
}

// The bf16 copy of a weight whose values are bf16 already (the engine's gathered copy).
std::vector<uint16_t> bf16_copy(const std::vector<float>& weight) {
  std::vector<uint16_t> copy(weight.size());
  for (size_t i = 0; i < weight.size(); i++) copy[i] = float_to_bf16(weight[i]);
  return copy;
}
// The weight as the engine gathers it: every value rounded to bf16.
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// 2x, exactly (a power of two): its bf16 copy is the copy's double.
std::vector<float> doubled(std::vector<float> x) {
  for (float& v : x) v *= 2.0f;
  return x;
}

void round_in_place(std::vector<float>* x) {
  for (float& v : *x) v = static_cast<float>(round_bf16(v));
}

struct Shape {
  int N, C, OC;
};
const Shape SHAPES[] = {{7, 1, 5}, {13, 33, 17}, {64, 40, 120}, {31, 96, 3}, {1, 64, 40}};

class Bf16GemmTest : public ::testing::TestWithParam<bool> {
 protected:
  bool onednn() const { return GetParam(); }
  void SetUp() override {
    if (onednn() && !Bf16Gemm::native_bf16()) GTEST_SKIP() << "this CPU has no bf16 dot products";
  }
};

TEST_P(Bf16GemmTest, ForwardMatchesRoundedOperandsToSummationError) {
  for (const Shape& s : SHAPES)
    for (bool with_bias : {false, true}) {
      SCOPED_TRACE(testing::Message() << "N=" << s.N << " C=" << s.C << " OC=" << s.OC << " bias " << with_bias);
      std::vector<float> inp(s.N * s.C), weight(s.OC * s.C), bias(s.OC), out(s.N * s.OC, NAN);
      fill_uniform(inp.data(), inp.size(), 1), fill_uniform(weight.data(), weight.size(), 2);
      fill_uniform(bias.data(), bias.size(), 3);
      Bf16Gemm gemm({{s.C, s.OC}}, s.N, onednn());
      gemm.forward(out.data(), inp.data(), nullptr, weight.data(), nullptr, with_bias ? bias.data() : nullptr, s.N, s.C, s.OC);
      Reference want = product(inp, false, weight, true, s.N, s.OC, s.C, true);
      std::vector<float> base;
      if (with_bias)
        for (int n = 0; n < s.N; n++) base.insert(base.end(), bias.begin(), bias.end());
      for (size_t i = 0; i < base.size(); i++) want.bound[i] += 0x1p-23 * std::fabs(base[i] + want.value[i]);
      expect_within(out, want, base, "forward");
      if (s.C > 1) {  // with K = 1 a single product: the bound is tight enough either way
        EXPECT_GT(worst_ratio(want, product(inp, false, weight, true, s.N, s.OC, s.C, false)), 10.0);
      }
    }
}

TEST_P(Bf16GemmTest, BackwardProductsAccumulateAndAreOptional) {
  for (const Shape& s : SHAPES) {
    SCOPED_TRACE(testing::Message() << "N=" << s.N << " C=" << s.C << " OC=" << s.OC);
    std::vector<float> inp(s.N * s.C), weight(s.OC * s.C), dout(s.N * s.OC);
    fill_uniform(inp.data(), inp.size(), 4), fill_uniform(weight.data(), weight.size(), 5);
    fill_uniform(dout.data(), dout.size(), 6);
    std::vector<float> dweight0(s.OC * s.C), dbias0(s.OC);
    fill_uniform(dweight0.data(), dweight0.size(), 7), fill_uniform(dbias0.data(), dbias0.size(), 8);
    std::vector<float> dinp(s.N * s.C, NAN), dweight = dweight0, dbias = dbias0;
    Bf16Gemm gemm({{s.C, s.OC}}, s.N, onednn());
    gemm.backward(dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(), nullptr, weight.data(), nullptr, s.N, s.C, s.OC);

    // dinp = dout W; dweight += dout^T inp (onto what was there); dbias += column sums of dout in fp32.
    expect_within(dinp, product(dout, false, weight, false, s.N, s.C, s.OC, true), {}, "dinp");
    Reference dw = product(dout, true, inp, false, s.OC, s.C, s.N, true);
    for (size_t i = 0; i < dw.bound.size(); i++) dw.bound[i] += 0x1p-23 * std::fabs(dweight0[i] + dw.value[i]);
    expect_within(dweight, dw, dweight0, "dweight");
    std::vector<float> dbias_fp32 = dbias0;
    shardtrain::cpu::matmul_backward<float>(nullptr, nullptr, dbias_fp32.data(), dout.data(), nullptr, nullptr, s.N,
                                            s.C, s.OC);
    EXPECT_TRUE(same_bits(dbias, dbias_fp32));

    // Each gradient alone gives the same bits and leaves the others untouched.
    std::vector<float> dinp_only(s.N * s.C, NAN), untouched = dweight0;
    gemm.backward(dinp_only.data(), nullptr, nullptr, dout.data(), inp.data(), nullptr, weight.data(), nullptr, s.N, s.C, s.OC);
    EXPECT_EQ(0, std::memcmp(dinp_only.data(), dinp.data(), dinp.size() * sizeof(float)));
    std::vector<float> dweight_only = dweight0;
    gemm.backward(nullptr, dweight_only.data(), nullptr, dout.data(), inp.data(), nullptr, weight.data(), nullptr, s.N, s.C, s.OC);
    EXPECT_EQ(0, std::memcmp(dweight_only.data(), dweight.data(), dweight.size() * sizeof(float)));
  }
}

// "Rounded once": a weight passed with its bf16 copy is multiplied from the copy -- the same bits
// as rounding it here, and no weight element rounded -- and it is the copy that is read: a copy of
// other values gives the product of those values.
TEST_P(Bf16GemmTest, AWeightWithItsCopyIsNotRoundedAgain) {
  for (const Shape& s : SHAPES) {
    SCOPED_TRACE(testing::Message() << "N=" << s.N << " C=" << s.C << " OC=" << s.OC);
    std::vector<float> inp(s.N * s.C), weight(s.OC * s.C), bias(s.OC), dout(s.N * s.OC);
    fill_uniform(inp.data(), inp.size(), 11), fill_uniform(weight.data(), weight.size(), 12);
    fill_uniform(bias.data(), bias.size(), 13), fill_uniform(dout.data(), dout.size(), 14);
    round_in_place(&weight);
    const std::vector<uint16_t> weight16 = bf16_copy(weight);
    Bf16Gemm gemm({{s.C, s.OC}}, s.N, onednn());
    auto run = [&](const std::vector<float>& w, const uint16_t* w16, std::vector<float>* out, std::vector<float>* dinp,
                   std::vector<float>* dweight) {
      out->assign(s.N * s.OC, NAN), dinp->assign(s.N * s.C, NAN), dweight->assign(s.OC * s.C, 0.0f);
      gemm.forward(out->data(), inp.data(), nullptr, w.data(), w16, bias.data(), s.N, s.C, s.OC);
      gemm.backward(dinp->data(), dweight->data(), nullptr, dout.data(), inp.data(), nullptr, w.data(), w16, s.N, s.C, s.OC);
    };
    std::vector<float> out, dinp, dweight, out16, dinp16, dweight16;
    run(weight, nullptr, &out, &dinp, &dweight);
    const size_t rounded = gemm.weight_elements_rounded();
    EXPECT_EQ(rounded, 2u * s.OC * s.C) << "forward and dinp each round the weight";
    run(weight, weight16.data(), &out16, &dinp16, &dweight16);
    EXPECT_EQ(gemm.weight_elements_rounded(), rounded) << "a weight with its copy was rounded";
    EXPECT_TRUE(same_bits(out, out16));
    EXPECT_TRUE(same_bits(dinp, dinp16));
    EXPECT_TRUE(same_bits(dweight, dweight16));

    // oneDNN multiplies the copy: given the copy of twice the weight beside the weight itself, the
    // products are those of 2W (exactly twice, a power of two). The SGEMMs read the weight's fp32
    // values in place, equal to the copy's widening by the contract.
    if (!onednn()) continue;
    const std::vector<float> twice = doubled(weight);
    const std::vector<uint16_t> twice16 = bf16_copy(twice);
    std::vector<float> out2, dinp2, dweight2, want_out, want_dinp, want_dweight;
    run(weight, twice16.data(), &out2, &dinp2, &dweight2);
    run(twice, nullptr, &want_out, &want_dinp, &want_dweight);
    EXPECT_TRUE(same_bits(out2, want_out));
    EXPECT_TRUE(same_bits(dinp2, want_dinp));
    EXPECT_FALSE(same_bits(out2, out16));
  }
}

// The same for the input: an activation the model saved in bf16 (fsdp.activation_dtype) comes with
// its copy, which forward and the weight gradient multiply instead of rounding the input again.
TEST_P(Bf16GemmTest, AnInputWithItsCopyIsNotRoundedAgain) {
  for (const Shape& s : SHAPES) {
    SCOPED_TRACE(testing::Message() << "N=" << s.N << " C=" << s.C << " OC=" << s.OC);
    std::vector<float> inp(s.N * s.C), weight(s.OC * s.C), bias(s.OC), dout(s.N * s.OC);
    fill_uniform(inp.data(), inp.size(), 21), fill_uniform(weight.data(), weight.size(), 22);
    fill_uniform(bias.data(), bias.size(), 23), fill_uniform(dout.data(), dout.size(), 24);
    round_in_place(&inp);
    const std::vector<uint16_t> inp16 = bf16_copy(inp);
    Bf16Gemm gemm({{s.C, s.OC}}, s.N, onednn());
    auto run = [&](const std::vector<float>& x, const uint16_t* x16, std::vector<float>* out, std::vector<float>* dinp,
                   std::vector<float>* dweight) {
      out->assign(s.N * s.OC, NAN), dinp->assign(s.N * s.C, NAN), dweight->assign(s.OC * s.C, 0.0f);
      gemm.forward(out->data(), x.data(), x16, weight.data(), nullptr, bias.data(), s.N, s.C, s.OC);
      gemm.backward(dinp->data(), dweight->data(), nullptr, dout.data(), x.data(), x16, weight.data(), nullptr, s.N,
                    s.C, s.OC);
    };
    std::vector<float> out, dinp, dweight, out16, dinp16, dweight16;
    run(inp, nullptr, &out, &dinp, &dweight);
    run(inp, inp16.data(), &out16, &dinp16, &dweight16);
    EXPECT_TRUE(same_bits(out, out16));
    EXPECT_TRUE(same_bits(dinp, dinp16));
    EXPECT_TRUE(same_bits(dweight, dweight16));

    // oneDNN multiplies the copy: the copy of 2X beside X gives 2X's products.
    if (!onednn()) continue;
    const std::vector<float> twice = doubled(inp);
    const std::vector<uint16_t> twice16 = bf16_copy(twice);
    std::vector<float> out2, dinp2, dweight2, want_out, want_dinp, want_dweight;
    run(inp, twice16.data(), &out2, &dinp2, &dweight2);
    run(twice, nullptr, &want_out, &want_dinp, &want_dweight);
    EXPECT_TRUE(same_bits(out2, want_out));
    EXPECT_TRUE(same_bits(dweight2, want_dweight));
    EXPECT_FALSE(same_bits(out2, out16));
  }
}

INSTANTIATE_TEST_SUITE_P(Kernels, Bf16GemmTest, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return std::string(info.param ? "OneDnn" : "SgemmOnRoundedOperands");
                         });

TEST(Bf16Gemm, KernelsAgreeAndRepeatBitForBit) {
  if (!Bf16Gemm::native_bf16()) GTEST_SKIP() << "this CPU has no bf16 dot products: one kernel only";
  const Shape s{96, 200, 72};
  std::vector<float> inp(s.N * s.C), weight(s.OC * s.C);
  fill_uniform(inp.data(), inp.size(), 9), fill_uniform(weight.data(), weight.size(), 10);
  std::vector<float> a(s.N * s.OC), again(a.size()), b(a.size());
  Bf16Gemm native({{s.C, s.OC}}, s.N, true), emulated({{s.C, s.OC}}, s.N, false);
  native.forward(a.data(), inp.data(), nullptr, weight.data(), nullptr, nullptr, s.N, s.C, s.OC);
  native.forward(again.data(), inp.data(), nullptr, weight.data(), nullptr, nullptr, s.N, s.C, s.OC);
  emulated.forward(b.data(), inp.data(), nullptr, weight.data(), nullptr, nullptr, s.N, s.C, s.OC);
  EXPECT_TRUE(same_bits(a, again));
  const Reference want = product(inp, false, weight, true, s.N, s.OC, s.C, true);
  for (size_t i = 0; i < a.size(); i++) ASSERT_LE(std::fabs(a[i] - b[i]), 2 * want.bound[i]) << i;
}

TEST(Bf16Gemm, WorkspaceIsWhatThePlanSaysUntilAProductOutgrowsIt) {
  // A llama-like layer set (q|k|v, o, gate|up, down, head) at 24 rows.
  const std::vector<LinearShape> layers{{40, 72}, {40, 40}, {40, 192}, {96, 40}, {40, 256}};
  const int rows = 24;
  for (bool onednn : {Bf16Gemm::native_bf16(), false}) {
    Bf16Gemm gemm(layers, rows, onednn);
    const size_t planned = onednn == Bf16Gemm::native_bf16() ? Bf16Gemm::plan_workspace_bytes(layers, rows)
                                                             : gemm.workspace_bytes();
    EXPECT_EQ(gemm.workspace_bytes(), planned);
    // At least the largest layer's two activation copies (dout, inp; the weights come rounded).
    EXPECT_GE(gemm.workspace_bytes(), 2u * rows * (40 + 256));
    for (const LinearShape& l : layers) {
      std::vector<float> inp(rows * l.in, 0.5f), weight(l.out * l.in, 0.25f), out(rows * l.out), dout(rows * l.out, 1.f);
      std::vector<float> dinp(rows * l.in), dweight(l.out * l.in), bias(l.out, 1.f), dbias(l.out);
      const std::vector<uint16_t> weight16 = bf16_copy(weight);
      gemm.forward(out.data(), inp.data(), nullptr, weight.data(), weight16.data(), bias.data(), rows, l.in, l.out);
      gemm.forward(out.data(), inp.data(), nullptr, weight.data(), weight16.data(), nullptr, rows, l.in, l.out);
      gemm.backward(dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(), nullptr, weight.data(), weight16.data(),
                    rows, l.in, l.out);
    }
    EXPECT_EQ(gemm.workspace_bytes(), planned) << "a planned product grew the workspace";
    // A weight that comes unrounded needs its copy beside the activations': beyond the plan.
    {
      Bf16Gemm fresh(layers, rows, onednn);
      std::vector<float> inp(rows * 40, 0.5f), weight(256 * 40, 0.25f), out(rows * 256);
      fresh.forward(out.data(), inp.data(), nullptr, weight.data(), nullptr, nullptr, rows, 40, 256);
      EXPECT_GT(fresh.workspace_bytes(), planned);
    }
    // The head's backward on 4x the rows: its three operand copies need more than the plan.
    std::vector<float> inp(4 * rows * 40, 0.5f), weight(256 * 40, 0.25f), dout(4 * rows * 256, 1.f);
    std::vector<float> dinp(4 * rows * 40), dweight(256 * 40);
    gemm.backward(dinp.data(), dweight.data(), nullptr, dout.data(), inp.data(), nullptr, weight.data(), nullptr, 4 * rows, 40, 256);
    EXPECT_GT(gemm.workspace_bytes(), planned);
    EXPECT_FLOAT_EQ(dinp[0], 256 * 0.25f);
    EXPECT_FLOAT_EQ(dweight[0], 4 * rows * 0.5f);
  }
}

}  // namespace
