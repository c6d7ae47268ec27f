// The elementwise layers on the GPU: GELU forward/backward (backend/math.hpp's gelu_value and
// gelu_derivative, the very functions the CPU loops call), the residual add, and x *= s.
//
// One grid-stride kernel template: float4 loads and stores when every pointer is 16-byte aligned
// (the n % 4 tail then goes to the first threads), scalar otherwise. Each element's result does
// not depend on which path computed it. residual and scale are one IEEE operation per element,
// bit-identical to the CPU; GELU differs from the CPU in the last bits at most (FMA contraction
// and exp_fast's ~2 ulp).
#include "common.cuh"

namespace shardtrain::kernels {
namespace {

constexpr int kThreads = 256;

struct GeluForward {
  __device__ float operator()(float x, float) const { return gelu_value(x); }
};
struct GeluBackward {
  __device__ float operator()(float dout, float inp) const { return dout * gelu_derivative(inp); }
};
struct Add {
  __device__ float operator()(float a, float b) const { return a + b; }
};
struct Scale {
  float s;
  __device__ float operator()(float x, float) const { return x * s; }
};

// out[i] = op(a[i], b[i]) (b[i] = 0 when kInputs == 1). out may alias a or b.
template <int kInputs, typename Op>
__global__ void elementwise_kernel(float* out, const float* a, const float* b, size_t n, bool vec4, Op op) {
  const size_t start = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t done = 0;
  if (vec4) {
    const size_t n4 = n / 4;
    for (size_t i = start; i < n4; i += stride) {
      const float4 x = reinterpret_cast<const float4*>(a)[i];
      const float4 y = kInputs == 2 ? reinterpret_cast<const float4*>(b)[i] : make_float4(0.f, 0.f, 0.f, 0.f);
      reinterpret_cast<float4*>(out)[i] = make_float4(op(x.x, y.x), op(x.y, y.y), op(x.z, y.z), op(x.w, y.w));
    }
    done = n4 * 4;
  }
  for (size_t i = done + start; i < n; i += stride) out[i] = op(a[i], kInputs == 2 ? b[i] : 0.0f);
}

template <int kInputs, typename Op>
void launch_elementwise(float* out, const float* a, const float* b, size_t n, Op op, const LaunchContext& ctx) {
  if (n == 0) return;
  const bool vec4 = aligned16(out) && aligned16(a) && (kInputs == 1 || aligned16(b));
  const size_t work = vec4 ? ceil_div(n, 4) : n;
  elementwise_kernel<kInputs><<<grid_for(work, kThreads, ctx), kThreads, 0, ctx.stream>>>(out, a, b, n, vec4, op);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void launch_gelu_forward(float* out, const float* inp, size_t n, const LaunchContext& ctx) {
  launch_elementwise<1>(out, inp, nullptr, n, GeluForward{}, ctx);
}

void launch_gelu_backward(float* dinp, const float* dout, const float* inp, size_t n, const LaunchContext& ctx) {
  launch_elementwise<2>(dinp, dout, inp, n, GeluBackward{}, ctx);
}

void launch_residual_forward(float* out, const float* a, const float* b, size_t n, const LaunchContext& ctx) {
  launch_elementwise<2>(out, a, b, n, Add{}, ctx);
}

void launch_scale(float* x, size_t n, float s, const LaunchContext& ctx) {
  launch_elementwise<1>(x, x, nullptr, n, Scale{s}, ctx);
}

}  // namespace shardtrain::kernels
