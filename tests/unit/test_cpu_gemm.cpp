// The CPU's fp32 GEMM (backend/cpu/gemm.hpp) splits a product into panels that depend on its shape
// alone: its results match a naive fp64 product for every way of panelling (rows, columns, K, one
// panel; transposes, leading dimensions wider than the rows, alpha and beta), and its bits are the
// same for any thread count and inside a parallel region -- what OpenBLAS's own threading did not
// give on AMD EPYCs (docs/architecture.md, "Determinism").
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "app/perf.hpp"
#include "backend/cpu/gemm.hpp"

using shardtrain::cpu::GemmSplit;
using shardtrain::cpu::SPLIT_COLUMNS;
using shardtrain::cpu::SPLIT_K;
using shardtrain::cpu::SPLIT_ROWS;

using namespace shardtrain;

namespace {

struct GemmCase {
  bool trans_a, trans_b;
  int M, N, K;
  int pad;  // leading dimensions this much wider than the rows they hold
  float alpha, beta;
};

std::string name_of(const GemmCase& c) {
  return std::string(c.trans_a ? "T" : "N") + (c.trans_b ? "T" : "N") + " M" + std::to_string(c.M) + " N" +
         std::to_string(c.N) + " K" + std::to_string(c.K) + " pad" + std::to_string(c.pad);
}

std::vector<float> uniform(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

// The operands and C of a case, with their leading dimensions.
struct Operands {
  explicit Operands(const GemmCase& c)
      : lda((c.trans_a ? c.M : c.K) + c.pad),
        ldb((c.trans_b ? c.K : c.N) + c.pad),
        ldc(c.N + c.pad),
        A(uniform(static_cast<size_t>(c.trans_a ? c.K : c.M) * lda, 1)),
        B(uniform(static_cast<size_t>(c.trans_b ? c.N : c.K) * ldb, 2)),
        C(uniform(static_cast<size_t>(c.M) * ldc, 3)) {}
  int lda, ldb, ldc;
  std::vector<float> A, B, C;
};

std::vector<float> run(const GemmCase& c, const Operands& o) {
  std::vector<float> C = o.C;
  cpu::gemm(c.trans_a, c.trans_b, c.M, c.N, c.K, c.alpha, o.A.data(), o.lda, o.B.data(), o.ldb, c.beta, C.data(),
            o.ldc);
  return C;
}

const std::vector<GemmCase>& cases() {
  static const std::vector<GemmCase> all = {
      {false, false, 7, 5, 3, 0, 1.0f, 0.0f},       // one panel: small
      {false, true, 120, 112, 40, 0, 1.0f, 0.0f},   // one panel: under 2^21 multiply-adds
      {false, false, 640, 96, 80, 3, 0.5f, 1.0f},   // rows: 16 panels of 48 -> 64-row panels, a short last one
      {true, false, 300, 77, 129, 5, 1.0f, 1.0f},   // rows, op(A) transposed (a weight gradient)
      {false, true, 96, 1000, 64, 0, 1.0f, 0.0f},   // columns (an LM head: tokens x vocabulary)
      {true, true, 100, 515, 47, 2, -2.0f, 0.25f},  // columns, both transposed, odd sizes
      {false, false, 64, 80, 2000, 1, 0.5f, 1.0f},  // K: 16 slices summed into C (an LM head's dinp)
      {true, true, 48, 96, 1500, 3, 1.0f, 0.0f},    // K, both transposed, beta 0
  };
  return all;
}

TEST(CpuGemm, MatchesAnFp64ProductForEveryPanelling) {
  const GemmSplit splits[] = {SPLIT_ROWS, SPLIT_ROWS, SPLIT_ROWS, SPLIT_ROWS, SPLIT_COLUMNS, SPLIT_COLUMNS, SPLIT_K,
                              SPLIT_K};
  ASSERT_EQ(cases().size(), std::size(splits));
  for (size_t i = 0; i < cases().size(); i++) {  // the cases cover every kind of split
    const GemmCase& c = cases()[i];
    EXPECT_EQ(cpu::gemm_panels(c.M, c.N, c.K).split, splits[i]) << name_of(c);
    EXPECT_EQ(cpu::gemm_panels(c.M, c.N, c.K).count > 1, i > 1) << name_of(c);
  }
  set_compute_threads(2);
  for (const GemmCase& c : cases()) {
    const Operands o(c);
    const std::vector<float> got = run(c, o);
    for (int i = 0; i < c.M; i++)
      for (int j = 0; j < c.N; j++) {
        double sum = 0, magnitude = 0;
        for (int k = 0; k < c.K; k++) {
          const double a = c.trans_a ? o.A[static_cast<size_t>(k) * o.lda + i] : o.A[static_cast<size_t>(i) * o.lda + k];
          const double b = c.trans_b ? o.B[static_cast<size_t>(j) * o.ldb + k] : o.B[static_cast<size_t>(k) * o.ldb + j];
          sum += a * b, magnitude += std::fabs(a * b);
        }
        const double c0 = o.C[static_cast<size_t>(i) * o.ldc + j];
        const double want = c.alpha * sum + c.beta * c0;
        // fp32 accumulation of K products: at most K ulps of the terms' magnitude, plus the update.
        const double tol = (c.K + 2) * 0x1p-23 * (std::fabs(c.alpha) * magnitude + std::fabs(c.beta * c0));
        ASSERT_NEAR(got[static_cast<size_t>(i) * o.ldc + j], want, tol) << name_of(c) << " at " << i << "," << j;
      }
    for (int i = 0; i < c.M; i++)  // the padding of C is not written
      for (int j = c.N; j < o.ldc; j++)
        ASSERT_EQ(got[static_cast<size_t>(i) * o.ldc + j], o.C[static_cast<size_t>(i) * o.ldc + j]) << name_of(c);
  }
}

TEST(CpuGemm, BitsDoNotDependOnTheThreadCountNorOnBeingInAParallelRegion) {
  const int threads_before = omp_get_max_threads();
  for (const GemmCase& c : cases()) {
    const Operands o(c);
    set_compute_threads(1);
    const std::vector<float> one = run(c, o);
    for (int threads : {2, 3, 4}) {
      set_compute_threads(threads);
      EXPECT_EQ(0, std::memcmp(run(c, o).data(), one.data(), one.size() * sizeof(float)))
          << name_of(c) << ": " << threads << " threads";
    }
    set_compute_threads(2);
    std::vector<float> nested;
#pragma omp parallel num_threads(2)
    {
#pragma omp single
      nested = run(c, o);  // the per-head attention products: inside the caller's parallel loop
    }
    EXPECT_EQ(0, std::memcmp(nested.data(), one.data(), one.size() * sizeof(float))) << name_of(c) << ": nested";
  }
  set_compute_threads(threads_before);
}

TEST(CpuGemm, GemvBitsDoNotDependOnTheThreadCount) {
  const int M = 30000, N = 96, lda = 100;  // an LM head's row of logits: 8 panels of rows
  const std::vector<float> A = uniform(static_cast<size_t>(M) * lda, 4), x = uniform(N, 5), y0 = uniform(M, 6);
  auto gemv = [&] {
    std::vector<float> y = y0;
    cpu::gemv(M, N, 1.0f, A.data(), lda, x.data(), 0.5f, y.data());
    return y;
  };
  const int threads_before = omp_get_max_threads();
  set_compute_threads(1);
  const std::vector<float> one = gemv();
  for (int i = 0; i < M; i++) {
    double want = 0.5 * y0[i];
    for (int k = 0; k < N; k++) want += static_cast<double>(A[static_cast<size_t>(i) * lda + k]) * x[k];
    ASSERT_NEAR(one[i], want, 1e-4) << i;
  }
  for (int threads : {2, 3}) {
    set_compute_threads(threads);
    EXPECT_EQ(0, std::memcmp(gemv().data(), one.data(), one.size() * sizeof(float))) << threads << " threads";
  }
  set_compute_threads(threads_before);
}

}  // namespace
