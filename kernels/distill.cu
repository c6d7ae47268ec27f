// Knowledge distillation's fused loss on the GPU (docs/distillation.md), backend/cpu/ops.hpp's
// distill_loss_forward and its arithmetic: losses[r] = alpha CE + (1 - alpha) T^2 KL(softmax(t/T) ||
// softmax(s/T)) and, in place of the student's logits s, the loss's gradient
// alpha (softmax(s) - onehot) + (1 - alpha) T (softmax(s/T) - softmax(t/T)), not yet times dloss.
//
// One block per row (512 threads striding over V), three passes over the row: the block maxima of
// s and t (float, exact in any order); the three exponential sums Z1 (s), Z2 (s/T), Z3 (t/T),
// each thread's terms added in double and the threads combined by the fixed block tree; then each
// thread writes its elements' gradients and adds its share of the KL sum in double, combined by the
// same tree. Per element the CPU's expressions: x = s - max_s and y = t - max_t in double, the
// exponentials exp_fast(float(x)), exp_fast(float(x w)), exp_fast(float(y w)) with w = 1/T (math.hpp's,
// the CPU's up to FMA contraction), probabilities as double divisions (so equal student and teacher
// rows give a KL term and KL gradient of exactly 0, as on the CPU), one rounding to float per output.
// So the outputs differ from the CPU's only through the sums' order (double) and exp_fast's
// contraction (an ulp or two of an exponential). The target logit is read before the first barrier,
// the in-place writes happen after the last read of the row; the teacher is never written. A target
// of V or more gives a NaN loss (the CPU backend rejects it); one below 0 is ignored (loss 0,
// gradient 0). No workspace, no atomics.
#include <cmath>

#include "backend/math.hpp"
#include "common.cuh"

namespace shardtrain::kernels {
namespace {

constexpr int kDistillThreads = 512;

__global__ void distill_loss_forward_kernel(float* losses, float* student_to_grad, const float* teacher,
                                            const int* targets, int V, double a, double w, double b,
                                            double kl_weight) {
  __shared__ float shared_max[kWarpSize];
  __shared__ double shared_sum[kWarpSize];
  const size_t row = blockIdx.x;
  float* s = student_to_grad + row * V;
  const float* t = teacher + row * V;
  const int target = targets[row];
  if (target < 0) {  // ignored (a loss mask's prompt token): neither term, no gradient, as on the CPU
    for (int i = threadIdx.x; i < V; i += blockDim.x) s[i] = 0.0f;
    if (threadIdx.x == 0) losses[row] = 0.0f;
    return;  // the whole block: the target is the row's
  }
  const bool has_target = target < V;
  const float target_logit = has_target ? s[target] : NAN;  // read by every thread before the first barrier
  float local_max_s = -INFINITY, local_max_t = -INFINITY;
  for (int i = threadIdx.x; i < V; i += blockDim.x) {
    local_max_s = fmaxf(local_max_s, s[i]);
    local_max_t = fmaxf(local_max_t, t[i]);
  }
  const double ms = block_max(local_max_s, shared_max);
  const double mt = block_max(local_max_t, shared_max);

  double z1 = 0.0, z2 = 0.0, z3 = 0.0;
  for (int i = threadIdx.x; i < V; i += blockDim.x) {
    const double x = static_cast<double>(s[i]) - ms, y = static_cast<double>(t[i]) - mt;
    z1 += static_cast<double>(exp_fast(static_cast<float>(x)));
    z2 += static_cast<double>(exp_fast(static_cast<float>(x * w)));
    z3 += static_cast<double>(exp_fast(static_cast<float>(y * w)));
  }
  z1 = block_sum(z1, shared_sum);
  z2 = block_sum(z2, shared_sum);
  z3 = block_sum(z3, shared_sum);  // its barriers: every read of s above is done before the writes below

  const double log_z2 = log(z2), log_z3 = log(z3);
  double kl = 0.0;
  for (int i = threadIdx.x; i < V; i += blockDim.x) {
    const double x = static_cast<double>(s[i]) - ms, y = static_cast<double>(t[i]) - mt;
    const double e1 = static_cast<double>(exp_fast(static_cast<float>(x)));
    const double e2 = static_cast<double>(exp_fast(static_cast<float>(x * w)));
    const double e3 = static_cast<double>(exp_fast(static_cast<float>(y * w)));
    const double p = e3 / z3;
    if (p > 0.0) kl += p * ((y * w - log_z3) - (x * w - log_z2));
    const double onehot = i == target ? 1.0 : 0.0;
    s[i] = static_cast<float>(a * (e1 / z1 - onehot) + b * (e2 / z2 - p));
  }
  kl = block_sum(kl, shared_sum);
  if (threadIdx.x == 0) {
    const double ce = log(z1) - (static_cast<double>(target_logit) - ms);
    losses[row] = static_cast<float>(a * ce + kl_weight * kl);
  }
}

}  // namespace

void launch_distill_loss_forward(float* losses, float* student_to_grad, const float* teacher, const int* targets,
                                 int N, int V, float alpha, float temperature, const LaunchContext& ctx) {
  SHARD_CHECK(N >= 0 && V > 0, "distill_loss_forward: N=%d V=%d", N, V);
  SHARD_CHECK(temperature > 0.0f && std::isfinite(temperature), "distill_loss_forward: temperature %g must be > 0",
              static_cast<double>(temperature));
  SHARD_CHECK(alpha >= 0.0f && alpha <= 1.0f, "distill_loss_forward: alpha %g must be in [0, 1]",
              static_cast<double>(alpha));
  if (N == 0) return;
  // The CPU's scalars, in double from the float arguments.
  const double a = static_cast<double>(alpha), T = static_cast<double>(temperature);
  const double w = 1.0 / T, b = (1.0 - a) * T, kl_weight = (1.0 - a) * T * T;
  distill_loss_forward_kernel<<<static_cast<unsigned>(N), kDistillThreads, 0, ctx.stream>>>(
      losses, student_to_grad, teacher, targets, V, a, w, b, kl_weight);
  CUDA_CHECK_LAUNCH();
}

}  // namespace shardtrain::kernels
