// See perf.hpp.
#include "app/perf.hpp"

#include <cblas.h>
#include <immintrin.h>
#include <omp.h>
#include <sched.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "backend/cpu/bf16_gemm.hpp"
#include "backend/cpu/gemm.hpp"
#include "backend/dtype.hpp"
#include "core/error.hpp"

extern "C" {
char* openblas_get_corename(void);
char* openblas_get_config(void);
void openblas_set_num_threads(int);
}

namespace shardtrain {

int default_threads_per_rank(int local_ranks) {
  cpu_set_t set;
  int allowed = static_cast<int>(std::thread::hardware_concurrency());
  if (sched_getaffinity(0, sizeof set, &set) == 0) allowed = CPU_COUNT(&set);
  int per_rank = static_cast<int>(std::thread::hardware_concurrency()) / std::max(1, local_ranks);
  return std::max(1, std::min(allowed, per_rank));
}

void set_compute_threads(int threads) {
  omp_set_num_threads(threads);
  openblas_set_num_threads(threads);  // OpenBLAS's OpenMP build follows omp_get_max_threads() anyway
}

double measure_sgemm_gflops(int n, int repeats) {
  std::vector<float> a(static_cast<size_t>(n) * n, 0.5f), b(a.size(), 0.25f), c(a.size(), 0.0f);
  double best = 0;
  for (int r = 0; r < repeats + 1; r++) {  // the first run warms up caches and thread pools
    auto t0 = std::chrono::steady_clock::now();
    cpu::gemm(false, false, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);  // as training multiplies
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0) best = std::max(best, 2.0 * n * n * n / s / 1e9);
  }
  return best;
}

double measure_bf16_gemm_gflops(int n, int repeats) {
  cpu::Bf16Gemm gemm({{n, n}}, n);
  std::vector<float> a(static_cast<size_t>(n) * n, 0.5f), b(a.size(), 0.25f), c(a.size(), 0.0f);
  // Both operands with their bf16 copies, as training passes them (the engine's gathered unit; the
  // model's saved activation with fsdp.activation_dtype=bf16): the products alone.
  std::vector<uint16_t> a16(a.size(), float_to_bf16(0.5f)), b16(b.size(), float_to_bf16(0.25f));
  double best = 0;
  for (int r = 0; r < repeats + 1; r++) {  // the first run also creates the kernel
    auto t0 = std::chrono::steady_clock::now();
    gemm.forward(c.data(), a.data(), a16.data(), b.data(), b16.data(), nullptr, n, n, n);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0) best = std::max(best, 2.0 * n * n * n / s / 1e9);
  }
  return best;
}

namespace {

// CHAINS independent accumulators per thread, ITERATIONS rounds: 2 x lanes x CHAINS x ITERATIONS
// FLOP (a bf16 dot product: 2 products per fp32 lane, so 4 x lanes). Twelve chains cover a 4-cycle
// latency on two pipes with room; the multipliers keep the values finite and away from denormals.
constexpr int CHAINS = 12;
constexpr long ITERATIONS = 1 << 23;

// Makes every chain's value observable (summed into a volatile), so that none is optimised away.
template <typename Vec>
void keep_alive(const Vec (&acc)[CHAINS]) {
  float lanes[sizeof(Vec) / sizeof(float)];
  float sink = 0;
  for (const Vec& v : acc) {
    std::memcpy(lanes, &v, sizeof v);
    for (float x : lanes) sink += x;
  }
  volatile float keep = sink;
  (void)keep;
}

__attribute__((target("avx512f"))) double fma_avx512_flops() {
  __m512 acc[CHAINS];
  for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_set1_ps(1.0f + c * 1e-3f);
  const __m512 m = _mm512_set1_ps(0.999999f), a = _mm512_set1_ps(1e-7f);
  for (long i = 0; i < ITERATIONS; i++)
    for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_fmadd_ps(acc[c], m, a);
  keep_alive(acc);
  return 2.0 * 16 * CHAINS * ITERATIONS;
}

__attribute__((target("avx2,fma"))) double fma_avx2_flops() {
  __m256 acc[CHAINS];
  for (int c = 0; c < CHAINS; c++) acc[c] = _mm256_set1_ps(1.0f + c * 1e-3f);
  const __m256 m = _mm256_set1_ps(0.999999f), a = _mm256_set1_ps(1e-7f);
  for (long i = 0; i < ITERATIONS; i++)
    for (int c = 0; c < CHAINS; c++) acc[c] = _mm256_fmadd_ps(acc[c], m, a);
  keep_alive(acc);
  return 2.0 * 8 * CHAINS * ITERATIONS;
}

__attribute__((target("avx512f,avx512bf16"))) double dot_bf16_flops() {
  __m512 acc[CHAINS];
  for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_set1_ps(1.0f + c * 1e-3f);
  // Products of 2^-10 x 2^-10 pairs: the sums grow by 2^-19 per round, far from overflow.
  const __m512bh x = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0x1p-10f), _mm512_set1_ps(0x1p-10f));
  for (long i = 0; i < ITERATIONS; i++)
    for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_dpbf16_ps(acc[c], x, x);
  keep_alive(acc);
  return 4.0 * 16 * CHAINS * ITERATIONS;
}

}  // namespace

FmaPeak measure_fma_peak(bool bf16) {
  __builtin_cpu_init();
  double (*kernel)() = nullptr;
  FmaPeak peak;
  if (bf16) {
    if (__builtin_cpu_supports("avx512bf16")) kernel = dot_bf16_flops, peak.unit = "avx512_bf16 dot products";
  } else if (__builtin_cpu_supports("avx512f")) {
    kernel = fma_avx512_flops, peak.unit = "avx512 fma";
  } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    kernel = fma_avx2_flops, peak.unit = "avx2 fma";
  }
  if (!kernel) return peak;
  // Each thread's rate is its FLOPs per second of its own CPU time, summed over the threads: the
  // cores' arithmetic peak even while other processes take turns on them (wall time would measure
  // the share the machine gives us, which the same-run GEMM peak already does).
  for (int round = 0; round < 5; round++) {  // the best of five: the first also wakes the cores
    double gflops = 0;
#pragma omp parallel reduction(+ : gflops)
    {
      timespec t0, t1;
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
      const double flop = kernel();
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
      gflops += flop / ((t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec)) / 1e9;
    }
    peak.gflops = std::max(peak.gflops, gflops);
  }
  return peak;
}

std::string blas_description() {
  return strprintf("%s (%s)", openblas_get_corename(), openblas_get_config());
}

}  // namespace shardtrain
