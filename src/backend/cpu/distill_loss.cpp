// Knowledge distillation's fused loss on a micro-batch's logits (backend/cpu/ops.hpp,
// distill_loss_forward; docs/distillation.md): the student's cross-entropy against the targets plus
// T^2 times the KL divergence of its temperature-T distribution from the teacher's, and the loss's
// gradient in place of the student's logits. One row per iteration of a static OpenMP loop, each
// row sequential in index order with double accumulators, so the bits do not depend on the thread
// count; kernels/distill.cu is the same arithmetic with a block-tree summation order.
#include <algorithm>
#include <cmath>

#include "backend/cpu/ops.hpp"
#include "backend/math.hpp"
#include "core/error.hpp"

namespace shardtrain::cpu {

template <typename Real>
void distill_loss_forward(Real* losses, Real* student_to_grad, const Real* teacher, const int* targets, int N,
                          int V, Real alpha, Real temperature) {
  SHARD_CHECK(N >= 0 && V > 0, "distill_loss_forward: N=%d V=%d", N, V);
  SHARD_CHECK(temperature > Real(0) && std::isfinite(static_cast<double>(temperature)),
              "distill_loss_forward: temperature %g must be > 0", static_cast<double>(temperature));
  SHARD_CHECK(alpha >= Real(0) && alpha <= Real(1), "distill_loss_forward: alpha %g must be in [0, 1]",
              static_cast<double>(alpha));
  for (int n = 0; n < N; n++)
    SHARD_CHECK(targets[n] < V, "distill_loss_forward: targets[%d] = %d, V = %d", n, targets[n], V);
  const double a = static_cast<double>(alpha), T = static_cast<double>(temperature);
  const double w = 1.0 / T, b = (1.0 - a) * T, kl_weight = (1.0 - a) * T * T;
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; n++) {
    Real* s = student_to_grad + static_cast<size_t>(n) * V;
    const Real* t = teacher + static_cast<size_t>(n) * V;
    const int target = targets[n];
    if (target < 0) {  // ignored (a loss mask's prompt token): neither term, no gradient
      std::fill(s, s + V, Real(0));
      losses[n] = Real(0);
      continue;
    }
    Real max_s = s[0], max_t = t[0];
    for (int i = 1; i < V; i++) {
      max_s = s[i] > max_s ? s[i] : max_s;
      max_t = t[i] > max_t ? t[i] : max_t;
    }
    const double ms = static_cast<double>(max_s), mt = static_cast<double>(max_t);
    double z1 = 0, z2 = 0, z3 = 0;
    for (int i = 0; i < V; i++) {
      const double x = static_cast<double>(s[i]) - ms, y = static_cast<double>(t[i]) - mt;
      z1 += static_cast<double>(exp_fast(static_cast<Real>(x)));
      z2 += static_cast<double>(exp_fast(static_cast<Real>(x * w)));
      z3 += static_cast<double>(exp_fast(static_cast<Real>(y * w)));
    }
    const double log_z2 = std::log(z2), log_z3 = std::log(z3);
    const double ce = std::log(z1) - (static_cast<double>(s[target]) - ms);  // read before s is overwritten
    double kl = 0;
    for (int i = 0; i < V; i++) {
      const double x = static_cast<double>(s[i]) - ms, y = static_cast<double>(t[i]) - mt;
      const double e1 = static_cast<double>(exp_fast(static_cast<Real>(x)));
      const double e2 = static_cast<double>(exp_fast(static_cast<Real>(x * w)));
      const double e3 = static_cast<double>(exp_fast(static_cast<Real>(y * w)));
      const double p = e3 / z3;
      if (p > 0) kl += p * ((y * w - log_z3) - (x * w - log_z2));
      const double onehot = i == target ? 1.0 : 0.0;
      s[i] = static_cast<Real>(a * (e1 / z1 - onehot) + b * (e2 / z2 - p));
    }
    losses[n] = static_cast<Real>(a * ce + kl_weight * kl);
  }
}

template void distill_loss_forward<float>(float*, float*, const float*, const int*, int, int, float, float);
template void distill_loss_forward<double>(double*, double*, const double*, const int*, int, int, double, double);

}  // namespace shardtrain::cpu
