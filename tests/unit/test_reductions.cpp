// The CPU backend's reductions give the same bits for any OpenMP thread count: the gradient norm
// feeds clipping, so a thread-count-dependent sum would make runs on other machines diverge.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "backend/layer_ops.hpp"

using namespace shardtrain;

namespace {

// Values over many magnitudes, so that a different grouping of the sum changes its low bits.
template <typename Real>
std::vector<Real> spread_values(size_t n) {
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> mantissa(-1, 1);
  std::uniform_int_distribution<int> exponent(-20, 20);
  std::vector<Real> x(n);
  for (Real& v : x) v = static_cast<Real>(std::ldexp(mantissa(rng), exponent(rng)));
  return x;
}

uint64_t bits(double x) {
  uint64_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

template <typename Real>
void expect_thread_independent_sum_squares() {
  const std::vector<Real> x = spread_values<Real>((size_t{1} << 20) + 4099);  // blocks and a ragged tail
  const int threads_before = omp_get_max_threads();
  std::vector<double> results;
  for (int threads : {1, 2, 3, 4}) {
    omp_set_num_threads(threads);
    results.push_back(cpu_layer_ops<Real>().sum_squares(x.data(), x.size()));
  }
  omp_set_num_threads(threads_before);
  long double exact = 0;  // the oracle: another order, more precision
  for (Real v : x) exact += static_cast<long double>(v) * v;
  for (size_t t = 1; t < results.size(); t++)
    EXPECT_EQ(bits(results[t]), bits(results[0])) << t + 1 << " threads: " << results[t] << " vs " << results[0];
  EXPECT_NEAR(results[0], static_cast<double>(exact), 1e-12 * static_cast<double>(exact));
}

}  // namespace

TEST(CpuReductions, SumSquaresIsTheSameBitsForAnyThreadCount) {
  expect_thread_independent_sum_squares<float>();
  expect_thread_independent_sum_squares<double>();
}

TEST(CpuReductions, SumSquaresOfShortAndEmptyInputs) {
  EXPECT_EQ(cpu_layer_ops<float>().sum_squares(nullptr, 0), 0.0);
  const float x[3] = {1.5f, -2.0f, 0.25f};
  EXPECT_EQ(cpu_layer_ops<float>().sum_squares(x, 3), 1.5 * 1.5 + 4.0 + 0.0625);
}
