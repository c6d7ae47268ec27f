// Token + position embedding on the GPU: out(B,T,C) = wte[tokens[b,t]] + wpe[t], and its backward
// dwte(V,C) += scatter of dout by token, dwpe(maxT,C) += dout summed over the batch. A null wpe
// (dwpe) means no position table (llama): the forward copies the token rows (no + 0, which would
// turn -0 into +0), the backward skips dwpe. A null dwte (a frozen token table) skips the sort and
// the scatter; the workspace is then not read.
//
// The backward is deterministic and adds in exactly the CPU's order (backend/cpu/pointwise.cpp):
// each gradient element starts from its old value and adds the rows of dout in increasing b*T+t,
// so the results are bit-identical to the CPU's. dwpe: one thread per (t, c) loops over b. dwte:
// the positions are sorted by token with a stable radix sort (CUB), which keeps positions of the
// same token in increasing order; a block per run of equal tokens (and per 256 columns) then sums
// that run's rows in order into its dwte row. No atomics; a token that repeats often makes one
// long run, which is a serial loop, but a coalesced one (consecutive threads, consecutive columns).
#include <cub/device/device_radix_sort.cuh>

#include "common.cuh"

namespace shardtrain::kernels {
namespace {

constexpr int kThreads = 256;

// kWpe false: no position table, wpe is null.
template <bool kWpe>
__global__ void encoder_forward_kernel(float* out, const int* tokens, const float* wte, const float* wpe,
                                       const int* positions, int T, int C, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t bt = i / C;
    const int c = static_cast<int>(i % C);
    const int t = positions ? positions[bt] : static_cast<int>(bt % T);
    const float e = wte[static_cast<size_t>(tokens[bt]) * C + c];
    out[i] = kWpe ? e + wpe[static_cast<size_t>(t) * C + c] : e;
  }
}

// C % 4 == 0 and 16-byte aligned tables: one float4 per thread and step. n4 = B*T*C/4.
template <bool kWpe>
__global__ void encoder_forward_vec4_kernel(float4* out, const int* tokens, const float4* wte, const float4* wpe,
                                            const int* positions, int T, int C4, size_t n4) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n4;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t bt = i / C4;
    const int c4 = static_cast<int>(i % C4);
    const int t = positions ? positions[bt] : static_cast<int>(bt % T);
    const float4 e = wte[static_cast<size_t>(tokens[bt]) * C4 + c4];
    if (kWpe) {
      const float4 p = wpe[static_cast<size_t>(t) * C4 + c4];
      out[i] = make_float4(e.x + p.x, e.y + p.y, e.z + p.z, e.w + p.w);
    } else {
      out[i] = e;
    }
  }
}

template <bool kWpe>
void encoder_forward(float* out, const int* tokens, const float* wte, const float* wpe, const int* positions, int T,
                     int C, size_t n, const LaunchContext& ctx) {
  if (C % 4 == 0 && all_aligned16(out, wte, wpe)) {  // a null wpe counts as aligned
    const size_t n4 = n / 4;
    encoder_forward_vec4_kernel<kWpe><<<grid_for(n4, kThreads, ctx), kThreads, 0, ctx.stream>>>(
        reinterpret_cast<float4*>(out), tokens, reinterpret_cast<const float4*>(wte),
        reinterpret_cast<const float4*>(wpe), positions, T, C / 4, n4);
  } else {
    encoder_forward_kernel<kWpe><<<grid_for(n, kThreads, ctx), kThreads, 0, ctx.stream>>>(out, tokens, wte, wpe,
                                                                                          positions, T, C, n);
  }
  CUDA_CHECK_LAUNCH();
}

// dwpe[t][c] += dout[b][t][c] for b = 0, 1, ... in order.
__global__ void encoder_backward_wpe_kernel(float* dwpe, const float* dout, int B, int T, int C) {
  const size_t n = static_cast<size_t>(T) * C;
  const size_t row = static_cast<size_t>(T) * C;  // elements of one sequence of dout
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float acc = dwpe[i];
    for (int b = 0; b < B; b++) acc += dout[b * row + i];
    dwpe[i] = acc;
  }
}

__global__ void iota_kernel(int* p, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] = i;
}

// Block (x = sorted position i, y = column block): if i starts a run of equal tokens, add the run's
// dout rows, in increasing position, into dwte[token]. Other blocks return at once.
__global__ void encoder_backward_wte_kernel(float* dwte, const float* dout, const int* sorted_tokens,
                                            const int* sorted_positions, int BT, int C) {
  const int i = blockIdx.x;
  const int token = sorted_tokens[i];
  if (i > 0 && sorted_tokens[i - 1] == token) return;
  const int c = blockIdx.y * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float* row = dwte + static_cast<size_t>(token) * C;
  float acc = row[c];
  for (int j = i; j < BT && sorted_tokens[j] == token; j++) acc += dout[static_cast<size_t>(sorted_positions[j]) * C + c];
  row[c] = acc;
}

struct EncoderWorkspace {
  int* positions_in;
  int* sorted_tokens;
  int* sorted_positions;
  void* sort_temp;
  size_t sort_temp_bytes;
  size_t bytes;
};

// The same carving sizes (base null) and cuts (base given) the workspace.
EncoderWorkspace carve_encoder_workspace(void* base, int BT) {
  EncoderWorkspace w{};
  WorkspaceCarver carver(base);
  w.positions_in = carver.take<int>(BT);
  w.sorted_tokens = carver.take<int>(BT);
  w.sorted_positions = carver.take<int>(BT);
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, w.sort_temp_bytes, static_cast<const int*>(nullptr),
                                              static_cast<int*>(nullptr), static_cast<const int*>(nullptr),
                                              static_cast<int*>(nullptr), BT));
  w.sort_temp = carver.take<char>(w.sort_temp_bytes);
  w.bytes = carver.bytes();
  return w;
}

}  // namespace

void launch_encoder_forward(float* out, const int* tokens, const float* wte, const float* wpe, int B, int T, int C,
                            const int* positions, const LaunchContext& ctx) {
  SHARD_CHECK(B >= 0 && T >= 0 && C >= 0, "encoder_forward: B=%d T=%d C=%d", B, T, C);
  const size_t n = static_cast<size_t>(B) * T * C;
  if (n == 0) return;
  if (wpe)
    encoder_forward<true>(out, tokens, wte, wpe, positions, T, C, n, ctx);
  else
    encoder_forward<false>(out, tokens, wte, nullptr, nullptr, T, C, n, ctx);
}

namespace {
// table[keys[i]] += dout row i for every i, each row of the table adding its rows in increasing i:
// the keys sorted stably with their places (CUB's radix sort), then one block per run of equal keys.
void scatter_rows_in_order(float* table, const float* dout, const int* keys, int BT, int C, void* workspace,
                           const LaunchContext& ctx) {
  EncoderWorkspace w = carve_encoder_workspace(workspace, BT);
  iota_kernel<<<grid_for(BT, kThreads, ctx), kThreads, 0, ctx.stream>>>(w.positions_in, BT);
  CUDA_CHECK_LAUNCH();
  // Keys (token ids, positions) are non-negative ints: all 32 key bits, as their range is not an argument.
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(w.sort_temp, w.sort_temp_bytes, keys, w.sorted_tokens, w.positions_in,
                                              w.sorted_positions, BT, 0, static_cast<int>(8 * sizeof(int)),
                                              ctx.stream));
  const int threads = std::min(kThreads, static_cast<int>(ceil_div(C, kWarpSize)) * kWarpSize);
  const dim3 grid(static_cast<unsigned>(BT), static_cast<unsigned>(ceil_div(C, threads)));
  encoder_backward_wte_kernel<<<grid, threads, 0, ctx.stream>>>(table, dout, w.sorted_tokens, w.sorted_positions, BT,
                                                                C);
  CUDA_CHECK_LAUNCH();
}
}  // namespace

size_t encoder_backward_workspace_bytes(int B, int T) {
  return carve_encoder_workspace(nullptr, std::max(1, B * T)).bytes;
}

void launch_encoder_backward(float* dwte, float* dwpe, const float* dout, const int* tokens, int B, int T, int C,
                             const int* positions, void* workspace, const LaunchContext& ctx) {
  SHARD_CHECK(B >= 0 && T >= 0 && C >= 0, "encoder_backward: B=%d T=%d C=%d", B, T, C);
  const int BT = B * T;
  if (BT == 0 || C == 0) return;
  // dwte and dwpe each may be null (frozen, or no position table); the sort and its workspace
  // serve dwte, and dwpe when positions are given (packed documents: a row has several tokens).
  if (dwpe && positions) {
    scatter_rows_in_order(dwpe, dout, positions, BT, C, workspace, ctx);
  } else if (dwpe) {
    encoder_backward_wpe_kernel<<<grid_for(static_cast<size_t>(T) * C, kThreads, ctx), kThreads, 0, ctx.stream>>>(
        dwpe, dout, B, T, C);
    CUDA_CHECK_LAUNCH();
  }
  if (dwte) scatter_rows_in_order(dwte, dout, tokens, BT, C, workspace, ctx);
}

}  // namespace shardtrain::kernels
