// The AdamW step on this rank's shard: for every element, backend/math.hpp's adamw_update (the
// CPU optimizer's own function) with grad * grad_multiplier (the clipping and averaging factor)
// and the decay mask (0 for parameters without weight decay). float4 loads and stores of param,
// m, v and grad when all four are 16-byte aligned (the n % 4 tail goes to the first threads),
// scalar otherwise; each element's result is the same either way. Differences from the CPU are
// FMA contraction only (last bit of m, v and the update).
#include "common.cuh"

namespace shardtrain::kernels {
namespace {

constexpr int kThreads = 256;

__device__ inline void adamw_element(float* param, float* m, float* v, float grad, float grad_multiplier, float decay,
                                     const AdamWStep& step) {
  adamw_update(param, m, v, grad * grad_multiplier, decay, step);
}

__global__ void adamw_kernel(float* param, float* m, float* v, const float* grad, size_t n, float grad_multiplier,
                             float decay, AdamWStep step, bool vec4) {
  const size_t start = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t done = 0;
  if (vec4) {
    const size_t n4 = n / 4;
    for (size_t i = start; i < n4; i += stride) {
      float4 p = reinterpret_cast<float4*>(param)[i];
      float4 mm = reinterpret_cast<float4*>(m)[i];
      float4 vv = reinterpret_cast<float4*>(v)[i];
      const float4 g = reinterpret_cast<const float4*>(grad)[i];
      adamw_element(&p.x, &mm.x, &vv.x, g.x, grad_multiplier, decay, step);
      adamw_element(&p.y, &mm.y, &vv.y, g.y, grad_multiplier, decay, step);
      adamw_element(&p.z, &mm.z, &vv.z, g.z, grad_multiplier, decay, step);
      adamw_element(&p.w, &mm.w, &vv.w, g.w, grad_multiplier, decay, step);
      reinterpret_cast<float4*>(param)[i] = p;
      reinterpret_cast<float4*>(m)[i] = mm;
      reinterpret_cast<float4*>(v)[i] = vv;
    }
    done = n4 * 4;
  }
  for (size_t i = done + start; i < n; i += stride) {
    float p = param[i], mm = m[i], vv = v[i];
    adamw_element(&p, &mm, &vv, grad[i], grad_multiplier, decay, step);
    param[i] = p;
    m[i] = mm;
    v[i] = vv;
  }
}

// Block k updates segment k (at most kAdamWSegmentElements, so one block's threads cover it in a
// few strides); scalar accesses, as segments start anywhere in a shard.
__global__ void adamw_multi_kernel(const AdamWSegment* segments, const double* sums, AdamWClip clip, AdamWStep step) {
  float multiplier;
  if (!adamw_grad_multiplier(sums, clip, &multiplier)) return;  // the whole step is skipped
  const AdamWSegment s = segments[blockIdx.x];
  for (size_t i = threadIdx.x; i < s.n; i += blockDim.x) {
    float p = s.param[i], mm = s.m[i], vv = s.v[i];
    adamw_element(&p, &mm, &vv, s.grad[i], multiplier, s.decay, step);
    s.param[i] = p;
    s.m[i] = mm;
    s.v[i] = vv;
  }
}

}  // namespace

void launch_adamw_multi(const AdamWSegment* segments, size_t count, const double* sums, const AdamWClip& clip,
                        const AdamWStep& step, const LaunchContext& ctx) {
  if (count == 0) return;
  constexpr int kMultiThreads = 512;
  adamw_multi_kernel<<<static_cast<unsigned>(count), kMultiThreads, 0, ctx.stream>>>(segments, sums, clip, step);
  CUDA_CHECK_LAUNCH();
}

void launch_adamw(float* param, float* m, float* v, const float* grad, size_t n, float grad_multiplier, float decay,
                  const AdamWStep& step, const LaunchContext& ctx) {
  if (n == 0) return;
  const bool vec4 = all_aligned16(param, m, v, grad);
  const size_t work = vec4 ? ceil_div(n, 4) : n;
  adamw_kernel<<<grid_for(work, kThreads, ctx), kThreads, 0, ctx.stream>>>(param, m, v, grad, n, grad_multiplier,
                                                                          decay, step, vec4);
  CUDA_CHECK_LAUNCH();
}

}  // namespace shardtrain::kernels
