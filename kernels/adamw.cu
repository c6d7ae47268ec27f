// The AdamW step on this rank's shards, in one launch: block k updates segment k of the table
// (ShardOps::adamw_multi), every element by backend/math.hpp's adamw_update (the CPU optimizer's
// own function) with grad * the multiplier that adamw_grad_multiplier computes from the step's
// sums in device memory (unscaling and clipping), and the segment's decay mask (0 for parameters
// without weight decay); nothing at all when the sums say the step is not finite. Scalar accesses,
// as segments start anywhere in a shard. Differences from the CPU are FMA contraction only (last
// bit of m, v and the update).
#include "common.cuh"

namespace shardtrain::kernels {
namespace {

constexpr int kThreads = 512;

// Each segment is at most kAdamWSegmentElements, so one block's threads cover it in a few strides.
__global__ void adamw_multi_kernel(const AdamWSegment* segments, const double* sums, AdamWClip clip, AdamWStep step) {
  float multiplier;
  if (!adamw_grad_multiplier(sums, clip, &multiplier)) return;  // the whole step is skipped
  const AdamWSegment s = segments[blockIdx.x];
  for (size_t i = threadIdx.x; i < s.n; i += blockDim.x) {
    float p = s.param[i], m = s.m[i], v = s.v[i];
    adamw_update(&p, &m, &v, s.grad[i] * multiplier, s.decay, step);
    s.param[i] = p;
    s.m[i] = m;
    s.v[i] = v;
  }
}

}  // namespace

void launch_adamw_multi(const AdamWSegment* segments, size_t count, const double* sums, const AdamWClip& clip,
                        const AdamWStep& step, const LaunchContext& ctx) {
  if (count == 0) return;
  adamw_multi_kernel<<<static_cast<unsigned>(count), kThreads, 0, ctx.stream>>>(segments, sums, clip, step);
  CUDA_CHECK_LAUNCH();
}

}  // namespace shardtrain::kernels
