// See perf.hpp.
#include "app/perf.hpp"

#include <cblas.h>
#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <vector>

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
  openblas_set_num_threads(threads);
}

double measure_sgemm_gflops(int n, int repeats) {
  std::vector<float> a(static_cast<size_t>(n) * n, 0.5f), b(a.size(), 0.25f), c(a.size(), 0.0f);
  double best = 0;
  for (int r = 0; r < repeats + 1; r++) {  // the first run warms up caches and thread pools
    auto t0 = std::chrono::steady_clock::now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0) best = std::max(best, 2.0 * n * n * n / s / 1e9);
  }
  return best;
}

std::string blas_description() {
  return strprintf("%s (%s)", openblas_get_corename(), openblas_get_config());
}

}  // namespace shardtrain
