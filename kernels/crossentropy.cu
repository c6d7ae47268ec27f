// Fused softmax + cross-entropy over the vocabulary on the GPU, in place, as
// backend/cpu/pointwise.cpp: forward turns logits(N,V) into probabilities and writes
// losses[n] = log(sum exp(l - max)) - (l[target] - max) (exact even when p[target] underflows);
// backward turns probs into dlogits = (probs - onehot(target)) * dloss. A target < 0 (a loss mask's
// ignored one) gives loss 0 and gradient 0, as on the CPU.
//
// Forward: one block per row (512 threads striding over V): block max, exp_fast(l - max) written
// back and block-summed, then scaled by 1/sum. exp_fast is backend/math.hpp's (the CPU's), so
// each exponential is the CPU's up to FMA contraction; the row sum is reassociated (fixed tree,
// deterministic), so probs and losses differ from the CPU's in the last bits.
// Backward: one block per row; (p * dloss) is rounded on its own (__fmul_rn, never fused into an
// FMA with the following subtraction), so dlogits are bit-identical to the CPU's.
#include "common.cuh"

namespace shardtrain::kernels {
namespace {

constexpr int kForwardThreads = 512;
constexpr int kBackwardThreads = 256;

__global__ void softmax_crossentropy_forward_kernel(float* losses, float* logits_to_probs, const int* targets, int V) {
  __shared__ float shared_max[kWarpSize];
  __shared__ float shared_sum[kWarpSize];
  const size_t row = blockIdx.x;
  float* r = logits_to_probs + row * V;
  const int target = targets[row];
  // Read by every thread before the first barrier, written after; an ignored target (< 0) has no loss.
  const float target_logit = target >= 0 ? r[target] : 0.0f;
  float local_max = -INFINITY;
  for (int i = threadIdx.x; i < V; i += blockDim.x) local_max = fmaxf(local_max, r[i]);
  const float max = block_max(local_max, shared_max);
  float local_sum = 0.0f;
  for (int i = threadIdx.x; i < V; i += blockDim.x) {
    const float e = exp_fast(r[i] - max);
    r[i] = e;
    local_sum += e;
  }
  const float sum = block_sum(local_sum, shared_sum);
  const float inv = 1.0f / sum;
  for (int i = threadIdx.x; i < V; i += blockDim.x) r[i] *= inv;
  if (threadIdx.x == 0) losses[row] = target >= 0 ? logf(sum) - (target_logit - max) : 0.0f;
}

__global__ void softmax_crossentropy_backward_kernel(float* probs_to_dlogits, const int* targets, float dloss, int V) {
  const size_t row = blockIdx.x;
  float* r = probs_to_dlogits + row * V;
  const int target = targets[row];
  for (int i = threadIdx.x; i < V; i += blockDim.x) {
    const float scaled = __fmul_rn(r[i], dloss);
    r[i] = target < 0 ? 0.0f : i == target ? scaled - dloss : scaled;  // ignored: no gradient
  }
}

}  // namespace

void launch_softmax_crossentropy_forward(float* losses, float* logits_to_probs, const int* targets, int N, int V,
                                         const LaunchContext& ctx) {
  SHARD_CHECK(N >= 0 && V > 0, "softmax_crossentropy_forward: N=%d V=%d", N, V);
  if (N == 0) return;
  softmax_crossentropy_forward_kernel<<<static_cast<unsigned>(N), kForwardThreads, 0, ctx.stream>>>(
      losses, logits_to_probs, targets, V);
  CUDA_CHECK_LAUNCH();
}

void launch_softmax_crossentropy_backward(float* probs_to_dlogits, const int* targets, float dloss, int N, int V,
                                          const LaunchContext& ctx) {
  SHARD_CHECK(N >= 0 && V > 0, "softmax_crossentropy_backward: N=%d V=%d", N, V);
  if (N == 0) return;
  softmax_crossentropy_backward_kernel<<<static_cast<unsigned>(N), kBackwardThreads, 0, ctx.stream>>>(
      probs_to_dlogits, targets, dloss, V);
  CUDA_CHECK_LAUNCH();
}

}  // namespace shardtrain::kernels
