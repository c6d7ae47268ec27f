// The elementwise layers on the GPU: GELU and SiLU forward/backward (backend/math.hpp's
// gelu_value, gelu_derivative, silu_value and silu_derivative, the very functions the CPU loops
// call), SwiGLU forward/backward (silu_value,
// silu_derivative), the residual add, x *= s, out = a / b (DoRA's quotient), and counter-keyed
// dropout (the CPU's mask and division, bit-identical: common.cuh's mirror of core/random.hpp
// decides which elements stay).
//
// One grid-stride kernel template: float4 loads and stores when every pointer is 16-byte aligned
// (the n % 4 tail then goes to the first threads), scalar otherwise. Each element's result does
// not depend on which path computed it. residual, scale and divide are one IEEE operation per
// element, bit-identical to the CPU; GELU and SwiGLU differ from the CPU in the last bits at most
// (FMA contraction and exp_fast's ~2 ulp). SwiGLU reads rows of gate (I) | up (I): its own
// kernels, one element (n, i) per thread, float4 when I % 4 == 0 and every pointer is 16-byte
// aligned.
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
struct SiluForward {
  __device__ float operator()(float x, float) const { return silu_value(x); }
};
struct SiluBackward {
  __device__ float operator()(float dout, float inp) const { return dout * silu_derivative(inp); }
};
struct Add {
  __device__ float operator()(float a, float b) const { return a + b; }
};
struct Scale {
  float s;
  __device__ float operator()(float x, float) const { return x * s; }
};
struct Divide {  // the IEEE division whatever the compiler flags (the CPU's a / b)
  __device__ float operator()(float a, float b) const { return __fdiv_rn(a, b); }
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

// out = silu(gate) * up, dgate = dout * up * silu'(gate), dup = dout * silu(gate): the CPU's
// expressions (backend/cpu/pointwise.cpp), in its order; float4 overloads go component by component.
__device__ inline float swiglu_value(float g, float u) { return silu_value(g) * u; }
__device__ inline float4 swiglu_value(float4 g, float4 u) {
  return make_float4(swiglu_value(g.x, u.x), swiglu_value(g.y, u.y), swiglu_value(g.z, u.z), swiglu_value(g.w, u.w));
}
__device__ inline void swiglu_grad(float dy, float g, float u, float& dg, float& du) {
  dg = dy * u * silu_derivative(g);
  du = dy * silu_value(g);
}
__device__ inline void swiglu_grad(float4 dy, float4 g, float4 u, float4& dg, float4& du) {
  swiglu_grad(dy.x, g.x, u.x, dg.x, du.x);
  swiglu_grad(dy.y, g.y, u.y, dg.y, du.y);
  swiglu_grad(dy.z, g.z, u.z, dg.z, du.z);
  swiglu_grad(dy.w, g.w, u.w, dg.w, du.w);
}

// Element i (in units of kVec floats) of an (N, I) tensor: the index of its gate in the (N, 2I)
// rows; its up is row_vecs further.
__device__ inline size_t gate_index(size_t i, int row_vecs) { return i + i / row_vecs * row_vecs; }

template <int kVec>
__global__ void swiglu_forward_kernel(float* out, const float* gate_up, int row_vecs, size_t n) {
  using V = typename VecOf<kVec>::type;
  const V* gu = reinterpret_cast<const V*>(gate_up);
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t g = gate_index(i, row_vecs);
    reinterpret_cast<V*>(out)[i] = swiglu_value(gu[g], gu[g + row_vecs]);
  }
}

template <int kVec>
__global__ void swiglu_backward_kernel(float* dgate_up, const float* dout, const float* gate_up, int row_vecs,
                                       size_t n) {
  using V = typename VecOf<kVec>::type;
  const V* gu = reinterpret_cast<const V*>(gate_up);
  V* dgu = reinterpret_cast<V*>(dgate_up);
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t g = gate_index(i, row_vecs);
    V dg, du;
    swiglu_grad(reinterpret_cast<const V*>(dout)[i], gu[g], gu[g + row_vecs], dg, du);
    dgu[g] = dg;
    dgu[g + row_vecs] = du;
  }
}

// Dropout: element (r, c) kept iff rng_counter_keep(row key of r, c, threshold24) (common.cuh, the
// CPU's decision bit for bit), then divided by keep_fraction = 1 - p with the IEEE division
// (__fdiv_rn: the CPU's x / (1 - p) whatever the compiler flags), else +0. i counts kVec-float
// vectors of the (N, C) tensor, row_vecs of them per row (kVec 4: C % 4 == 0, so a vector never
// straddles two rows). Each thread reads its element before writing it: out may be inp.
__device__ inline float dropout_value(float x, uint64_t key, uint64_t c, uint32_t threshold24, float keep_fraction) {
  return rng_counter_keep(key, c, threshold24) ? __fdiv_rn(x, keep_fraction) : 0.0f;
}
__device__ inline float4 dropout_value(float4 x, uint64_t key, uint64_t c, uint32_t threshold24,
                                       float keep_fraction) {
  return make_float4(dropout_value(x.x, key, c, threshold24, keep_fraction),
                     dropout_value(x.y, key, c + 1, threshold24, keep_fraction),
                     dropout_value(x.z, key, c + 2, threshold24, keep_fraction),
                     dropout_value(x.w, key, c + 3, threshold24, keep_fraction));
}

template <int kVec>
__global__ void dropout_kernel(float* out, const float* inp, const uint64_t* row_keys, uint64_t site, int row_vecs,
                               size_t n, uint32_t threshold24, float keep_fraction) {
  using V = typename VecOf<kVec>::type;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t r = i / row_vecs;
    const uint64_t c = static_cast<uint64_t>(i % row_vecs) * kVec;
    const uint64_t key = rng_dropout_row_key(row_keys[r], site);
    const V x = reinterpret_cast<const V*>(inp)[i];
    reinterpret_cast<V*>(out)[i] = dropout_value(x, key, c, threshold24, keep_fraction);
  }
}

void check_swiglu_args(const char* what, int N, int I) {
  SHARD_CHECK(N >= 0 && I >= 0, "%s: N=%d I=%d", what, N, I);
}

}  // namespace

void launch_swiglu_forward(float* out, const float* gate_up, int N, int I, const LaunchContext& ctx) {
  check_swiglu_args("swiglu_forward", N, I);
  const size_t n = static_cast<size_t>(N) * I;
  if (n == 0) return;
  if (I % 4 == 0 && all_aligned16(out, gate_up))
    swiglu_forward_kernel<4><<<grid_for(n / 4, kThreads, ctx), kThreads, 0, ctx.stream>>>(out, gate_up, I / 4, n / 4);
  else
    swiglu_forward_kernel<1><<<grid_for(n, kThreads, ctx), kThreads, 0, ctx.stream>>>(out, gate_up, I, n);
  CUDA_CHECK_LAUNCH();
}

void launch_swiglu_backward(float* dgate_up, const float* dout, const float* gate_up, int N, int I,
                            const LaunchContext& ctx) {
  check_swiglu_args("swiglu_backward", N, I);
  const size_t n = static_cast<size_t>(N) * I;
  if (n == 0) return;
  if (I % 4 == 0 && all_aligned16(dgate_up, dout, gate_up))
    swiglu_backward_kernel<4><<<grid_for(n / 4, kThreads, ctx), kThreads, 0, ctx.stream>>>(dgate_up, dout, gate_up,
                                                                                            I / 4, n / 4);
  else
    swiglu_backward_kernel<1><<<grid_for(n, kThreads, ctx), kThreads, 0, ctx.stream>>>(dgate_up, dout, gate_up, I, n);
  CUDA_CHECK_LAUNCH();
}

void launch_gelu_forward(float* out, const float* inp, size_t n, const LaunchContext& ctx) {
  launch_elementwise<1>(out, inp, nullptr, n, GeluForward{}, ctx);
}

void launch_gelu_backward(float* dinp, const float* dout, const float* inp, size_t n, const LaunchContext& ctx) {
  launch_elementwise<2>(dinp, dout, inp, n, GeluBackward{}, ctx);
}

void launch_silu_forward(float* out, const float* inp, size_t n, const LaunchContext& ctx) {
  launch_elementwise<1>(out, inp, nullptr, n, SiluForward{}, ctx);
}

void launch_silu_backward(float* dinp, const float* dout, const float* inp, size_t n, const LaunchContext& ctx) {
  launch_elementwise<2>(dinp, dout, inp, n, SiluBackward{}, ctx);
}

void launch_residual_forward(float* out, const float* a, const float* b, size_t n, const LaunchContext& ctx) {
  launch_elementwise<2>(out, a, b, n, Add{}, ctx);
}

void launch_dropout(float* out, const float* inp, const uint64_t* row_keys, uint64_t site, int N, int C, float p,
                    const LaunchContext& ctx) {
  SHARD_CHECK(N >= 0 && C >= 0 && p >= 0.0f && p <= 1.0f, "dropout: N=%d C=%d p=%g", N, C, static_cast<double>(p));
  const size_t n = static_cast<size_t>(N) * C;
  if (n == 0) return;
  if (p == 0.0f) {  // the identity (x / 1 == x): a copy, or nothing in place
    if (out != inp) CUDA_CHECK(cudaMemcpyAsync(out, inp, n * sizeof(float), cudaMemcpyDeviceToDevice, ctx.stream));
    return;
  }
  const uint32_t threshold24 = ::shardtrain::dropout_threshold24(p);  // core/random.hpp's, as the CPU's
  const float keep_fraction = 1.0f - p;
  if (C % 4 == 0 && all_aligned16(out, inp))
    dropout_kernel<4><<<grid_for(n / 4, kThreads, ctx), kThreads, 0, ctx.stream>>>(out, inp, row_keys, site, C / 4,
                                                                                    n / 4, threshold24, keep_fraction);
  else
    dropout_kernel<1><<<grid_for(n, kThreads, ctx), kThreads, 0, ctx.stream>>>(out, inp, row_keys, site, C, n,
                                                                                threshold24, keep_fraction);
  CUDA_CHECK_LAUNCH();
}

void launch_scale(float* x, size_t n, float s, const LaunchContext& ctx) {
  launch_elementwise<1>(x, x, nullptr, n, Scale{s}, ctx);
}

void launch_divide(float* out, const float* a, const float* b, size_t n, const LaunchContext& ctx) {
  launch_elementwise<2>(out, a, b, n, Divide{}, ctx);
}

}  // namespace shardtrain::kernels
