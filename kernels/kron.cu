// LoHa's and LoKr's weight deltas on the GPU (backend/cpu/ops.hpp's multiply, kron and
// kron_backward): LoHa's scaled Hadamard product of its two low-rank products, LoKr's scaled
// Kronecker product of its two factors and the factors' gradients.
//
// Deterministic, no atomics:
//  - multiply: a grid-stride loop, float4 when every pointer is 16-byte aligned (the n % 4 tail on
//    the first threads); out = (s * a) * b with two IEEE multiplications (__fmul_rn, never fused),
//    the CPU's expression: bit-identical.
//  - kron: one thread per output column (j, l), looping over the rows (i, k) of its grid-y stripe;
//    out = (s * A[i, j]) * B[k, l], the CPU's two roundings: bit-identical.
//  - kron_backward: each element of dA (of dB) is a sum over the r*t (the p*q) terms of its block,
//    in double, of widened floats whose products are exact in double; then times s in double and
//    rounded once to float, as on the CPU. Who sums is a function of the sum's length alone:
//      length <= 64: one thread per element adding the terms in the CPU's (row-major) order --
//        bit-identical to the CPU;
//      length <= 8192: one warp per element, lane x adding terms x, x + 32, ... in order, then
//        warp_sum's fixed shuffle tree (common.cuh);
//      longer: one block of 256 threads per element, the same with block_sum's fixed tree.
//    The two wider paths differ from the CPU only by double reassociation (~1e-16 relative of the
//    terms' absolute sum) before the one rounding to float, and repeat bit for bit.
#include <climits>

#include "common.cuh"

namespace shardtrain::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kSerialMaxTerms = 64;
constexpr int kWarpMaxTerms = 8192;
constexpr int kKronMaxThreads = 256;

// Non-negative factor shapes whose element counts and product rows and columns are ints (the
// CPU's check).
bool kron_shape_ok(int p, int q, int r, int t) {
  auto fits = [](int x, int y) { return static_cast<long long>(x) * y <= INT_MAX; };
  return p >= 0 && q >= 0 && r >= 0 && t >= 0 && fits(p, q) && fits(r, t) && fits(p, r) && fits(q, t);
}

// (s * a) * b, both products rounded (the CPU's expression; no FMA can apply to it anyway).
__device__ inline float scaled_product(float s, float a, float b) { return __fmul_rn(__fmul_rn(s, a), b); }

// out[i] = (s * a[i]) * b[i]; out may alias a or b (each element is read before it is written, by
// the same thread).
__global__ void multiply_kernel(float* out, const float* a, const float* b, size_t n, float s, bool vec4) {
  const size_t start = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t done = 0;
  if (vec4) {
    const size_t n4 = n / 4;
    for (size_t i = start; i < n4; i += stride) {
      const float4 x = reinterpret_cast<const float4*>(a)[i];
      const float4 y = reinterpret_cast<const float4*>(b)[i];
      reinterpret_cast<float4*>(out)[i] = make_float4(scaled_product(s, x.x, y.x), scaled_product(s, x.y, y.y),
                                                      scaled_product(s, x.z, y.z), scaled_product(s, x.w, y.w));
    }
    done = n4 * 4;
  }
  for (size_t i = done + start; i < n; i += stride) out[i] = scaled_product(s, a[i], b[i]);
}

// out (rows = p*r, cols = q*t): thread column c = j*t + l, rows blockIdx.y, blockIdx.y + gridDim.y, ...
__global__ void kron_kernel(float* out, const float* A, int q, const float* B, int r, int t, int rows, int cols,
                            float s) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  const int j = c / t, l = c % t;
  for (int row = blockIdx.y; row < rows; row += gridDim.y) {
    const int i = row / r, k = row % r;
    out[static_cast<size_t>(row) * cols + c] =
        scaled_product(s, A[static_cast<size_t>(i) * q + j], B[static_cast<size_t>(k) * t + l]);
  }
}

// The terms of kron_backward's sums, as the CPU orders them. dA's element e = i*q + j, term
// m = k*t + l; dB's element e = k*t + l, term m = i*q + j. Both read dout[(i*r + k), (j*t + l)].
struct KronGradA {
  const float* dout;
  const float* B;
  unsigned q, r, t;
  size_t cols;  // q*t, dout's row length
  __device__ double operator()(unsigned e, unsigned m) const {
    const unsigned i = e / q, j = e % q, k = m / t, l = m % t;
    return static_cast<double>(dout[(static_cast<size_t>(i) * r + k) * cols + static_cast<size_t>(j) * t + l]) *
           static_cast<double>(B[m]);
  }
};
struct KronGradB {
  const float* dout;
  const float* A;
  unsigned q, r, t;
  size_t cols;
  __device__ double operator()(unsigned e, unsigned m) const {
    const unsigned k = e / t, l = e % t, i = m / q, j = m % q;
    return static_cast<double>(dout[(static_cast<size_t>(i) * r + k) * cols + static_cast<size_t>(j) * t + l]) *
           static_cast<double>(A[m]);
  }
};

// grad[e] = float(s * sum_m term(e, m)) for e < elements, m < terms; kGroup consecutive threads per
// element (1, a warp, or the whole block), lane x adding terms x, x + kGroup, ... in order, then the
// group's fixed shuffle tree. Every thread reaches the shuffles (no early return).
template <int kGroup, typename Term>
__global__ void __launch_bounds__(kThreads)
    kron_grad_kernel(float* grad, unsigned elements, unsigned terms, double s, Term term) {
  static_assert(kGroup == 1 || kGroup == kWarpSize || kGroup == kThreads, "a thread, a warp or the block");
  constexpr unsigned kPerBlock = kThreads / kGroup;
  const unsigned lane = threadIdx.x % kGroup;
  const unsigned e = blockIdx.x * kPerBlock + threadIdx.x / kGroup;
  double acc = 0.0;
  if (e < elements)
    for (unsigned m = lane; m < terms; m += kGroup) acc += term(e, m);
  if constexpr (kGroup == kThreads) {
    __shared__ double shared[kWarpSize];
    acc = block_sum(acc, shared);
  } else if constexpr (kGroup == kWarpSize) {
    acc = warp_sum(acc);
  }
  if (lane == 0 && e < elements) grad[e] = __double2float_rn(__dmul_rn(s, acc));
}

template <typename Term>
void launch_kron_grad(float* grad, int elements, int terms, float s, Term term, const LaunchContext& ctx) {
  const unsigned n = static_cast<unsigned>(elements), m = static_cast<unsigned>(terms);
  const double scale = static_cast<double>(s);
  if (terms <= kSerialMaxTerms) {
    const unsigned blocks = static_cast<unsigned>(ceil_div(n, kThreads));
    kron_grad_kernel<1><<<blocks, kThreads, 0, ctx.stream>>>(grad, n, m, scale, term);
  } else if (terms <= kWarpMaxTerms) {
    const unsigned blocks = static_cast<unsigned>(ceil_div(n, kThreads / kWarpSize));
    kron_grad_kernel<kWarpSize><<<blocks, kThreads, 0, ctx.stream>>>(grad, n, m, scale, term);
  } else {
    kron_grad_kernel<kThreads><<<n, kThreads, 0, ctx.stream>>>(grad, n, m, scale, term);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void launch_multiply(float* out, const float* a, const float* b, size_t n, float s, const LaunchContext& ctx) {
  if (n == 0) return;
  const bool vec4 = all_aligned16(out, a, b);
  const size_t work = vec4 ? ceil_div(n, 4) : n;
  multiply_kernel<<<grid_for(work, kThreads, ctx), kThreads, 0, ctx.stream>>>(out, a, b, n, s, vec4);
  CUDA_CHECK_LAUNCH();
}

void launch_kron(float* out, const float* A, int p, int q, const float* B, int r, int t, float s,
                 const LaunchContext& ctx) {
  SHARD_CHECK(kron_shape_ok(p, q, r, t), "kron: p=%d q=%d r=%d t=%d", p, q, r, t);
  const int rows = p * r, cols = q * t;
  if (rows == 0 || cols == 0) return;
  // As column_affine (dora.cu): a block covers up to 256 consecutive columns (fewer for a narrow
  // product), and enough row blocks to fill the device; every element is computed the same way
  // whatever the grid.
  const int threads =
      static_cast<int>(std::min<size_t>(kKronMaxThreads, ceil_div(static_cast<size_t>(cols), kWarpSize) * kWarpSize));
  const unsigned col_blocks = static_cast<unsigned>(ceil_div(static_cast<size_t>(cols), threads));
  const size_t fill = ceil_div(static_cast<size_t>(std::max(1, ctx.sm_count)) * 8, col_blocks);
  const unsigned row_blocks = static_cast<unsigned>(std::min<size_t>({static_cast<size_t>(rows), fill, 65535}));
  kron_kernel<<<dim3(col_blocks, row_blocks), threads, 0, ctx.stream>>>(out, A, q, B, r, t, rows, cols, s);
  CUDA_CHECK_LAUNCH();
}

void launch_kron_backward(float* dA, float* dB, const float* dout, const float* A, int p, int q, const float* B, int r,
                          int t, float s, const LaunchContext& ctx) {
  SHARD_CHECK(kron_shape_ok(p, q, r, t), "kron_backward: p=%d q=%d r=%d t=%d", p, q, r, t);
  const int a_elements = p * q, b_elements = r * t;
  const size_t cols = static_cast<size_t>(q) * t;
  const unsigned uq = static_cast<unsigned>(q), ur = static_cast<unsigned>(r), ut = static_cast<unsigned>(t);
  // An empty sum (no terms) still writes s * 0, as the CPU does.
  if (dA && a_elements > 0) launch_kron_grad(dA, a_elements, b_elements, s, KronGradA{dout, B, uq, ur, ut, cols}, ctx);
  if (dB && b_elements > 0) launch_kron_grad(dB, b_elements, a_elements, s, KronGradB{dout, A, uq, ur, ut, cols}, ctx);
}

}  // namespace shardtrain::kernels
