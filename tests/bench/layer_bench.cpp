// Layer micro-benchmarks of the CPU backend (float, on the threads OpenMP gives) at GPT-2 small
// shapes: B=4, T=64 (N = B*T = 256 rows), C=768, NH=12, V=50257; and Llama's own layers (RMSNorm,
// rotary embedding, SwiGLU) at llama-135M (SmolLM-135M) shapes: B=4, T=256 (N = 1024 rows), C=576,
// NH=9 query heads, KV=3 key/value heads, HS=64, I=1536 (the MLP width).
//
// Counters and their formulas (rates are per second of wall-clock time: every benchmark uses
// UseRealTime, because the work runs on OpenMP/OpenBLAS threads, not on the timing thread):
//   BM_Sgemm_Peak                 FLOP/s  = 2 n^3 (n = 2048, cblas_sgemm, the reference peak)
//   BM_MatmulForward/<shape>      FLOP/s  = 2 N C OC
//   BM_MatmulBackward/<shape>     FLOP/s  = 4 N C OC (dinp and dweight GEMMs; bias sums ignored)
//   BM_AttentionForward           FLOP/s  = 4 B T^2 C (q k^T and att v counted over the full TxT)
//   BM_AttentionBackward          FLOP/s  = 8 B T^2 C (four TxT products per head, full TxT)
//   BM_AttentionTrain/T<T>/<path> FLOP/s  = 6 B T^2 C (forward + backward, the causal half of the six
//                                 TxT products), B = 1, NH = 12, HS = 64, T = 256, 1024, 4096; path
//                                 tiled (cpu::attention_*) or materialised (the pre-issue-17 T x T
//                                 path, kept in this file as the baseline); counter "saved+scratch
//                                 MiB": what the forward keeps for the backward plus its scratch
//   BM_AttentionBackwardPasses/<shape>/<one|two|automatic>  FLOP/s = 4 B T^2 NH HS causally, 8 B T^2
//                                 NH HS over every key (the backward's four products, without the
//                                 recompute): the backward in one pass, two, or the heads of whole
//                                 rounds of the threads in one and the rest in two
//                                 (cpu::AttentionTiles::passes)
//   BM_LayernormForward           bytes/s = 4 (2 N C) (read inp, write out; per-row stats ignored)
//   BM_LayernormBackward          bytes/s = 4 (4 N C) (read dout, inp; read+write dinp)
//   BM_RmsnormForward             bytes/s = 4 (2 N C) (llama shapes; read inp, write out)
//   BM_RmsnormBackward            bytes/s = 4 (4 N C) (llama shapes; read dout, inp; read+write dinp)
//   BM_RopeForward/Backward       bytes/s = 4 (2 N (NH+KV) HS) (llama shapes; q and k heads read+written in place)
//   BM_SwigluForward              bytes/s = 4 (3 N I) (llama shapes; read gate|up, write out)
//   BM_SwigluBackward             bytes/s = 4 (5 N I) (llama shapes; read dout, gate|up; write dgate|dup)
//   BM_GeluForward                bytes/s = 4 (2 n), n = N 4C
//   BM_GeluBackward               bytes/s = 4 (3 n)
//   BM_SoftmaxCrossentropyForward bytes/s = 4 (2 N V) (logits read, probabilities written in place)
//   BM_AdamW                      bytes/s = 4 (7 n), n = 10M (param, m, v, grad read; param, m, v written)
// The byte counts are the minimum traffic; multi-pass kernels move more.
// Shapes: qkv C->3C, attn_proj C->C, fc C->4C, fc_proj 4C->C, lm_head C->V (no bias, like the tied head).
//
// After the table, the console reporter prints each FLOP/s benchmark as a fraction of
// BM_Sgemm_Peak (fraction = FLOP/s / peak FLOP/s). For a machine-readable record use
// --benchmark_out=FILE --benchmark_out_format=json.
//
// Run alone (one MPI process): the library links code that uses MPI in its error paths, so main
// brackets the benchmarks with MPI_Init/MPI_Finalize. Under mpirun only rank 0 benchmarks.
#include <benchmark/benchmark.h>
#include <cblas.h>
#include <mpi.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "backend/cpu/ops.hpp"
#include "backend/math.hpp"
#include "core/random.hpp"

namespace {

using namespace shardtrain;

constexpr int B = 4, T = 64, C = 768, NH = 12, V = 50257;
constexpr int N = B * T;
// llama-135M: head size 64, three query heads per key/value head, rope theta 10000, RMSNorm eps 1e-5.
namespace llama {
constexpr int B = 4, T = 256, C = 576, NH = 9, KV = 3, HS = 64, I = 1536;
constexpr int N = B * T;
constexpr double ROPE_THETA = 10000.0;
constexpr float EPS = 1e-5f;
}  // namespace llama
constexpr int PEAK_N = 2048;
constexpr size_t ADAMW_N = 10'000'000;
constexpr double MIN_TIME_S = 0.2;
constexpr double WARMUP_S = 0.05;

// Deterministic values in [-scale, scale), a pure function of (seed, index).
std::vector<float> filled(size_t n, uint64_t seed, float scale = 1.0f) {
  std::vector<float> v(n);
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < n; i++) v[i] = scale * static_cast<float>(2.0 * counter_uniform(seed, i) - 1.0);
  return v;
}

std::vector<int> targets(size_t n, int vocab, uint64_t seed) {
  std::vector<int> t(n);
  for (size_t i = 0; i < n; i++) t[i] = static_cast<int>(counter_uniform(seed, i) * vocab);
  return t;
}

void set_flops(benchmark::State& state, double flops_per_iter) {
  state.counters["FLOP/s"] =
      benchmark::Counter(flops_per_iter * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}

void set_bytes(benchmark::State& state, double bytes_per_iter) {
  state.counters["bytes/s"] =
      benchmark::Counter(bytes_per_iter * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}

void BM_Sgemm_Peak(benchmark::State& state) {
  const int n = PEAK_N;
  auto a = filled(size_t(n) * n, 1), b = filled(size_t(n) * n, 2);
  std::vector<float> c(size_t(n) * n);
  for (auto _ : state) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(),
                n);
    benchmark::DoNotOptimize(c.data());
    benchmark::ClobberMemory();
  }
  set_flops(state, 2.0 * n * n * n);
}

struct GemmShape {
  const char* name;
  int in, out;  // C and OC of matmul_forward
  bool bias;
};
const GemmShape GEMM_SHAPES[] = {
    {"qkv", C, 3 * C, true},     {"attn_proj", C, C, true}, {"fc", C, 4 * C, true},
    {"fc_proj", 4 * C, C, true}, {"lm_head", C, V, false},
};

void BM_MatmulForward(benchmark::State& state, GemmShape s) {
  auto inp = filled(size_t(N) * s.in, 3), weight = filled(size_t(s.out) * s.in, 4, 0.02f);
  auto bias = filled(s.out, 5, 0.02f);
  std::vector<float> out(size_t(N) * s.out);
  for (auto _ : state) {
    cpu::matmul_forward(out.data(), inp.data(), weight.data(), s.bias ? bias.data() : nullptr, N, s.in, s.out);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  set_flops(state, 2.0 * N * s.in * s.out);
}

// dweight and dbias accumulate (+=) over the iterations; their values do not change the work.
void BM_MatmulBackward(benchmark::State& state, GemmShape s) {
  auto inp = filled(size_t(N) * s.in, 3), weight = filled(size_t(s.out) * s.in, 4, 0.02f);
  auto dout = filled(size_t(N) * s.out, 6, 0.01f);
  std::vector<float> dinp(size_t(N) * s.in), dweight(size_t(s.out) * s.in), dbias(s.out);
  for (auto _ : state) {
    cpu::matmul_backward(dinp.data(), dweight.data(), s.bias ? dbias.data() : nullptr, dout.data(), inp.data(),
                         weight.data(), N, s.in, s.out);
    benchmark::DoNotOptimize(dinp.data());
    benchmark::DoNotOptimize(dweight.data());
    benchmark::ClobberMemory();
  }
  set_flops(state, 4.0 * N * s.in * s.out);
}

void BM_AttentionForward(benchmark::State& state) {
  auto qkv = filled(size_t(N) * 3 * C, 7, 0.5f);
  std::vector<float> out(size_t(N) * C), lse(size_t(B) * NH * T);
  for (auto _ : state) {
    cpu::attention_forward(out.data(), lse.data(), qkv.data(), B, T, NH, NH, C / NH);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  set_flops(state, 4.0 * B * T * T * C);
}

void BM_AttentionBackward(benchmark::State& state) {
  auto qkv = filled(size_t(N) * 3 * C, 7, 0.5f), dout = filled(size_t(N) * C, 8, 0.01f);
  std::vector<float> out(size_t(N) * C), lse(size_t(B) * NH * T), dqkv(qkv.size());
  cpu::attention_forward(out.data(), lse.data(), qkv.data(), B, T, NH, NH, C / NH);
  for (auto _ : state) {
    cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, NH, NH, C / NH);
    benchmark::DoNotOptimize(dqkv.data());
    benchmark::ClobberMemory();
  }
  set_flops(state, 8.0 * B * T * T * C);
}

// The attention ShardTrain had before the tiled one (backend/cpu/attention.cpp before issue 17),
// kept here only as the baseline of BM_AttentionTrain: per (batch, head) the full T x T scores in
// one GEMM, the causal softmax in place, the probabilities kept (B*NH*T*T) for the backward, which
// takes as much scratch again. Multi-head only (KV = NH).
namespace materialised {
void forward(float* out, float* att, const float* qkv, int B, int T, int NH, int HS) {
  const int row = 3 * NH * HS, C = NH * HS;
  const float scale = 1.0f / std::sqrt(float(HS));
#pragma omp parallel for collapse(2) schedule(static)
  for (int b = 0; b < B; b++)
    for (int h = 0; h < NH; h++) {
      const float* base = qkv + size_t(b) * T * row;
      float* a = att + (size_t(b) * NH + h) * T * T;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, T, HS, scale, base + h * HS, row,
                  base + (NH + h) * HS, row, 0.0f, a, T);
      for (int t = 0; t < T; t++) {
        float* r = a + size_t(t) * T;
        float max = r[0], sum = 0;
        for (int s = 1; s <= t; s++) max = std::max(max, r[s]);
        for (int s = 0; s <= t; s++) sum += (r[s] = std::exp(r[s] - max));
        for (int s = 0; s <= t; s++) r[s] /= sum;
        for (int s = t + 1; s < T; s++) r[s] = 0;
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, HS, T, 1.0f, a, T, base + (2 * NH + h) * HS, row,
                  0.0f, out + size_t(b) * T * C + h * HS, C);
    }
}
void backward(float* dqkv, float* scratch, const float* dout, const float* qkv, const float* att, int B, int T, int NH,
              int HS) {
  const int row = 3 * NH * HS, C = NH * HS;
  const float scale = 1.0f / std::sqrt(float(HS));
  auto gemm = [](bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* Bm, int ldb,
                 float beta, float* Cm, int ldc) {
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K, alpha, A, lda,
                Bm, ldb, beta, Cm, ldc);
  };
#pragma omp parallel for collapse(2) schedule(static)
  for (int b = 0; b < B; b++)
    for (int h = 0; h < NH; h++) {
      const size_t base = size_t(b) * T * row, head = (size_t(b) * NH + h) * T * T;
      const float *q = qkv + base + h * HS, *k = qkv + base + (NH + h) * HS, *v = qkv + base + (2 * NH + h) * HS;
      const float *a = att + head, *dy = dout + size_t(b) * T * C + h * HS;
      float* da = scratch + head;
      gemm(false, true, T, T, HS, 1.0f, dy, C, v, row, 0.0f, da, T);
      gemm(true, false, T, HS, T, 1.0f, a, T, dy, C, 0.0f, dqkv + base + (2 * NH + h) * HS, row);
      for (int t = 0; t < T; t++) {
        const float* ar = a + size_t(t) * T;
        float* dr = da + size_t(t) * T;
        float dot = 0;
        for (int s = 0; s <= t; s++) dot += ar[s] * dr[s];
        for (int s = 0; s <= t; s++) dr[s] = ar[s] * (dr[s] - dot);
        for (int s = t + 1; s < T; s++) dr[s] = 0;
      }
      gemm(false, false, T, HS, T, scale, da, T, k, row, 0.0f, dqkv + base + h * HS, row);
      gemm(true, false, T, HS, T, scale, da, T, q, row, 0.0f, dqkv + base + (NH + h) * HS, row);
    }
}
}  // namespace materialised

// The attention backward in one pass and in two (cpu::AttentionTiles::passes) at the shapes the
// training benchmarks run: llama-135M's grouped heads at T = 256 (B = 4) and 1024 (B = 1), GPT-2's at
// T = 1024, and the FLUX-shaped joint attention (320 rows, 6 heads of 128, every key).
struct PassesShape {
  const char* name;
  int B, T, NH, KV, HS;
  bool causal;
};
constexpr PassesShape PASSES_SHAPES[] = {{"llama_T256_B4", 4, 256, 9, 3, 64, true},
                                         {"llama_T1024_B1", 1, 1024, 9, 3, 64, true},
                                         {"gpt2_T1024_B1", 1, 1024, 12, 12, 64, true},
                                         {"flux_joint_T320", 1, 320, 6, 6, 128, false}};
void BM_AttentionBackwardPasses(benchmark::State& state, PassesShape s, cpu::AttentionTiles::Passes passes) {
  const size_t rows = size_t(s.B) * s.T;
  auto qkv = filled(rows * (s.NH + 2 * s.KV) * s.HS, 7, 0.5f), dout = filled(rows * s.NH * s.HS, 8, 0.01f);
  std::vector<float> out(rows * s.NH * s.HS), lse(rows * s.NH), dqkv(qkv.size());
  cpu::AttentionTiles tiles;
  tiles.passes = passes;
  cpu::attention_forward(out.data(), lse.data(), qkv.data(), s.B, s.T, s.NH, s.KV, s.HS, tiles, s.causal);
  for (auto _ : state) {
    cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), s.B, s.T, s.NH, s.KV, s.HS,
                            tiles, s.causal);
    benchmark::DoNotOptimize(dqkv.data());
    benchmark::ClobberMemory();
  }
  set_flops(state, (s.causal ? 4.0 : 8.0) * s.B * s.T * s.T * s.NH * s.HS);
}

// One training step's attention, forward then backward, at GPT-2's heads (12 x 64), B = 1, for
// long sequences: the tiled op against the materialised baseline.
void BM_AttentionTrain(benchmark::State& state, int seq_len, bool tiled) {
  const int Bt = 1, Nt = Bt * seq_len, HS = C / NH;
  auto qkv = filled(size_t(Nt) * 3 * C, 7, 0.5f), dout = filled(size_t(Nt) * C, 8, 0.01f);
  std::vector<float> out(size_t(Nt) * C), dqkv(qkv.size());
  std::vector<float> saved(tiled ? size_t(Bt) * NH * seq_len : size_t(Bt) * NH * seq_len * seq_len);
  std::vector<float> scratch(tiled ? 0 : saved.size());
  for (auto _ : state) {
    if (tiled) {
      cpu::attention_forward(out.data(), saved.data(), qkv.data(), Bt, seq_len, NH, NH, HS);
      cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), saved.data(), Bt, seq_len, NH, NH, HS);
    } else {
      materialised::forward(out.data(), saved.data(), qkv.data(), Bt, seq_len, NH, HS);
      materialised::backward(dqkv.data(), scratch.data(), dout.data(), qkv.data(), saved.data(), Bt, seq_len, NH, HS);
    }
    benchmark::DoNotOptimize(dqkv.data());
    benchmark::ClobberMemory();
  }
  set_flops(state, 6.0 * Bt * seq_len * seq_len * C);
  state.counters["saved+scratch MiB"] = double(saved.size() + scratch.size()) * sizeof(float) / (1 << 20);
}

void BM_LayernormForward(benchmark::State& state) {
  auto inp = filled(size_t(N) * C, 9), weight = filled(C, 10), bias = filled(C, 11);
  std::vector<float> out(size_t(N) * C), mean(N), rstd(N);
  for (auto _ : state) {
    cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), weight.data(), bias.data(), N, C);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  set_bytes(state, 4.0 * 2 * N * C);
}

// dinp, dweight and dbias accumulate (+=) over the iterations; their values do not change the work.
void BM_LayernormBackward(benchmark::State& state) {
  auto inp = filled(size_t(N) * C, 9), weight = filled(C, 10), bias = filled(C, 11);
  auto dout = filled(size_t(N) * C, 12, 0.01f);
  std::vector<float> out(size_t(N) * C), mean(N), rstd(N), dinp(size_t(N) * C), dweight(C), dbias(C);
  cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), weight.data(), bias.data(), N, C);
  for (auto _ : state) {
    cpu::layernorm_backward(dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(), weight.data(),
                            mean.data(), rstd.data(), N, C);
    benchmark::DoNotOptimize(dinp.data());
    benchmark::ClobberMemory();
  }
  set_bytes(state, 4.0 * 4 * N * C);
}

void BM_RmsnormForward(benchmark::State& state) {
  constexpr int N = llama::N, C = llama::C;
  auto inp = filled(size_t(N) * C, 19), weight = filled(C, 20);
  std::vector<float> out(size_t(N) * C), rstd(N);
  for (auto _ : state) {
    cpu::rmsnorm_forward(out.data(), rstd.data(), inp.data(), weight.data(), llama::EPS, N, C);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  set_bytes(state, 4.0 * 2 * N * C);
}

// dinp and dweight accumulate (+=) over the iterations; their values do not change the work.
void BM_RmsnormBackward(benchmark::State& state) {
  constexpr int N = llama::N, C = llama::C;
  auto inp = filled(size_t(N) * C, 19), weight = filled(C, 20), dout = filled(size_t(N) * C, 21, 0.01f);
  std::vector<float> out(size_t(N) * C), rstd(N), dinp(size_t(N) * C), dweight(C);
  cpu::rmsnorm_forward(out.data(), rstd.data(), inp.data(), weight.data(), llama::EPS, N, C);
  for (auto _ : state) {
    cpu::rmsnorm_backward(dinp.data(), dweight.data(), dout.data(), inp.data(), weight.data(), rstd.data(), N, C);
    benchmark::DoNotOptimize(dinp.data());
    benchmark::ClobberMemory();
  }
  set_bytes(state, 4.0 * 4 * N * C);
}

// The rope tables (T, HS/2) as the model builds them: angle = t * theta^(-2i/HS).
void rope_tables(std::vector<float>& cos, std::vector<float>& sin) {
  constexpr int T = llama::T, HS = llama::HS;
  cos.resize(size_t(T) * HS / 2);
  sin.resize(cos.size());
  for (int t = 0; t < T; t++)
    for (int i = 0; i < HS / 2; i++) {
      const double angle = t * std::pow(llama::ROPE_THETA, -2.0 * i / HS);
      cos[size_t(t) * HS / 2 + i] = static_cast<float>(std::cos(angle));
      sin[size_t(t) * HS / 2 + i] = static_cast<float>(std::sin(angle));
    }
}

// In place: each iteration turns the q and k heads once more (forward) or back (backward); the
// turns are rotations, so the values stay bounded and the work is the same.
void BM_Rope(benchmark::State& state, bool backward) {
  constexpr int B = llama::B, T = llama::T, N = llama::N, NH = llama::NH, KV = llama::KV, HS = llama::HS;
  auto qkv = filled(size_t(N) * (NH + 2 * KV) * HS, 22, 0.5f);
  std::vector<float> cos, sin;
  rope_tables(cos, sin);
  for (auto _ : state) {
    if (backward)
      cpu::rope_backward(qkv.data(), cos.data(), sin.data(), B, T, NH, KV, HS);
    else
      cpu::rope_forward(qkv.data(), cos.data(), sin.data(), B, T, NH, KV, HS);
    benchmark::DoNotOptimize(qkv.data());
    benchmark::ClobberMemory();
  }
  set_bytes(state, 4.0 * 2 * N * (NH + KV) * HS);
}

void BM_SwigluForward(benchmark::State& state) {
  constexpr int N = llama::N, I = llama::I;
  auto gate_up = filled(size_t(N) * 2 * I, 23, 3.0f);
  std::vector<float> out(size_t(N) * I);
  for (auto _ : state) {
    cpu::swiglu_forward(out.data(), gate_up.data(), N, I);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  set_bytes(state, 4.0 * 3 * N * I);
}

void BM_SwigluBackward(benchmark::State& state) {
  constexpr int N = llama::N, I = llama::I;
  auto gate_up = filled(size_t(N) * 2 * I, 23, 3.0f), dout = filled(size_t(N) * I, 24, 0.01f);
  std::vector<float> dgate_up(size_t(N) * 2 * I);
  for (auto _ : state) {
    cpu::swiglu_backward(dgate_up.data(), dout.data(), gate_up.data(), N, I);
    benchmark::DoNotOptimize(dgate_up.data());
    benchmark::ClobberMemory();
  }
  set_bytes(state, 4.0 * 5 * N * I);
}

void BM_GeluForward(benchmark::State& state) {
  const size_t n = size_t(N) * 4 * C;
  auto inp = filled(n, 13, 3.0f);
  std::vector<float> out(n);
  for (auto _ : state) {
    cpu::gelu_forward(out.data(), inp.data(), n);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  set_bytes(state, 4.0 * 2 * n);
}

void BM_GeluBackward(benchmark::State& state) {
  const size_t n = size_t(N) * 4 * C;
  auto inp = filled(n, 13, 3.0f), dout = filled(n, 14, 0.01f);
  std::vector<float> dinp(n);
  for (auto _ : state) {
    cpu::gelu_backward(dinp.data(), dout.data(), inp.data(), n);
    benchmark::DoNotOptimize(dinp.data());
    benchmark::ClobberMemory();
  }
  set_bytes(state, 4.0 * 3 * n);
}

// In place: after the first iteration the buffer holds probabilities and each later iteration
// takes their softmax again. The values stay finite and the work (one exp per element) is the same.
void BM_SoftmaxCrossentropyForward(benchmark::State& state) {
  auto logits = filled(size_t(N) * V, 15, 5.0f);
  auto tgt = targets(N, V, 16);
  std::vector<float> losses(N);
  for (auto _ : state) {
    cpu::softmax_crossentropy_forward(losses.data(), logits.data(), tgt.data(), N, V);
    benchmark::DoNotOptimize(losses.data());
    benchmark::ClobberMemory();
  }
  set_bytes(state, 4.0 * 2 * N * V);
}

// The optimizer's inner loop (optim/adamw.cpp) over one 10M-element segment.
void BM_AdamW(benchmark::State& state) {
  const size_t n = ADAMW_N;
  auto param = filled(n, 17, 0.02f), grad = filled(n, 18, 0.01f);
  std::vector<float> m(n, 0.0f), v(n, 0.0f);
  const float beta1 = 0.9f, beta2 = 0.95f;
  const AdamWStep s{3e-4f, beta1, beta2, 1e-8f, 0.1f, 1.0f - beta1, 1.0f - beta2};
  float* p = param.data();
  float* pm = m.data();
  float* pv = v.data();
  const float* g = grad.data();
  const float decay = 1.0f;
  for (auto _ : state) {
#pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; i++) adamw_update(&p[i], &pm[i], &pv[i], g[i], decay, s);
    benchmark::DoNotOptimize(p);
    benchmark::ClobberMemory();
  }
  set_bytes(state, 4.0 * 7 * n);
}

// Console table, then each FLOP/s benchmark's fraction of BM_Sgemm_Peak.
class PeakFractionReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& reports) override {
    for (const Run& r : reports) {
      if (r.run_type != Run::RT_Iteration || r.error_occurred) continue;
      auto it = r.counters.find("FLOP/s");
      if (it == r.counters.end()) continue;
      const std::string& name = r.run_name.function_name;
      if (flops_.count(name) == 0) order_.push_back(name);
      flops_[name] = std::max(flops_[name], it->second.value);
    }
    ConsoleReporter::ReportRuns(reports);
  }

  void PrintFractions() const {
    auto peak = flops_.find("BM_Sgemm_Peak");
    if (peak == flops_.end() || peak->second <= 0) return;
    std::printf("\nFraction of SGEMM peak (fraction = FLOP/s / FLOP/s of BM_Sgemm_Peak, %.1f GFLOP/s, %d threads)\n",
                peak->second / 1e9, omp_get_max_threads());
    std::printf("%-36s %12s %9s\n", "benchmark", "GFLOP/s", "fraction");
    for (const std::string& name : order_) {
      double f = flops_.at(name);
      std::printf("%-36s %12.1f %9.3f\n", name.c_str(), f / 1e9, f / peak->second);
    }
  }

 private:
  std::map<std::string, double> flops_;
  std::vector<std::string> order_;
};

benchmark::internal::Benchmark* configure(benchmark::internal::Benchmark* b) {
  return b->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(MIN_TIME_S)->MinWarmUpTime(WARMUP_S);
}

void register_benchmarks() {
  configure(benchmark::RegisterBenchmark("BM_Sgemm_Peak", BM_Sgemm_Peak));
  for (const GemmShape& s : GEMM_SHAPES)
    configure(benchmark::RegisterBenchmark((std::string("BM_MatmulForward/") + s.name).c_str(), BM_MatmulForward, s));
  for (const GemmShape& s : GEMM_SHAPES)
    configure(
        benchmark::RegisterBenchmark((std::string("BM_MatmulBackward/") + s.name).c_str(), BM_MatmulBackward, s));
  configure(benchmark::RegisterBenchmark("BM_AttentionForward", BM_AttentionForward));
  configure(benchmark::RegisterBenchmark("BM_AttentionBackward", BM_AttentionBackward));
  for (const PassesShape& s : PASSES_SHAPES)
    for (auto passes : {cpu::AttentionTiles::Passes::one, cpu::AttentionTiles::Passes::two,
                        cpu::AttentionTiles::Passes::automatic}) {
      const char* pass_name = passes == cpu::AttentionTiles::Passes::one   ? "/one"
                              : passes == cpu::AttentionTiles::Passes::two ? "/two"
                                                                           : "/automatic";
      configure(benchmark::RegisterBenchmark((std::string("BM_AttentionBackwardPasses/") + s.name + pass_name).c_str(),
                                             BM_AttentionBackwardPasses, s, passes));
    }
  for (int seq_len : {256, 1024, 4096})
    for (bool tiled : {true, false})
      configure(benchmark::RegisterBenchmark(
          ("BM_AttentionTrain/T" + std::to_string(seq_len) + (tiled ? "/tiled" : "/materialised")).c_str(),
          BM_AttentionTrain, seq_len, tiled));
  configure(benchmark::RegisterBenchmark("BM_LayernormForward", BM_LayernormForward));
  configure(benchmark::RegisterBenchmark("BM_LayernormBackward", BM_LayernormBackward));
  configure(benchmark::RegisterBenchmark("BM_RmsnormForward", BM_RmsnormForward));
  configure(benchmark::RegisterBenchmark("BM_RmsnormBackward", BM_RmsnormBackward));
  configure(benchmark::RegisterBenchmark("BM_RopeForward", BM_Rope, false));
  configure(benchmark::RegisterBenchmark("BM_RopeBackward", BM_Rope, true));
  configure(benchmark::RegisterBenchmark("BM_SwigluForward", BM_SwigluForward));
  configure(benchmark::RegisterBenchmark("BM_SwigluBackward", BM_SwigluBackward));
  configure(benchmark::RegisterBenchmark("BM_GeluForward", BM_GeluForward));
  configure(benchmark::RegisterBenchmark("BM_GeluBackward", BM_GeluBackward));
  configure(benchmark::RegisterBenchmark("BM_SoftmaxCrossentropyForward", BM_SoftmaxCrossentropyForward));
  configure(benchmark::RegisterBenchmark("BM_AdamW", BM_AdamW));
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int status = 0;
  if (rank == 0) {
    benchmark::Initialize(&argc, argv);
    if (benchmark::ReportUnrecognizedArguments(argc, argv)) {
      status = 2;
    } else {
      register_benchmarks();
      PeakFractionReporter reporter;
      benchmark::RunSpecifiedBenchmarks(&reporter);
      reporter.PrintFractions();
      benchmark::Shutdown();
    }
  }
  MPI_Finalize();
  return status;
}
