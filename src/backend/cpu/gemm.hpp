// Row-major GEMM and GEMV for float and double through OpenBLAS: C = alpha * op(A) @ op(B) + beta * C.
//
// The split over threads is ours, not OpenBLAS's. Every OpenBLAS call runs single-threaded
// (single_threaded_blas); a product is cut into panels whose kind, size and count are a function
// of its shape alone (gemm_panels), and the panels are shared among the OpenMP threads -- or run
// one after another when the call is already inside a parallel region (the per-head attention
// products). Every element of C then comes from the same sequence of single-threaded OpenBLAS
// calls whatever the thread count: the bits do not depend on it. OpenBLAS's own split moves rows
// between its full and edge micro-kernels as the thread count changes, and with some kernel sets
// (Haswell's, on an AMD EPYC) that changes the bits of 4 of the tiny model's 5 GEMM shapes between
// 1 and 2 threads.
//
// Panels along C's rows or columns re-pack the other operand once per panel (OpenBLAS's threads
// share one packing); panels along K instead give each panel a K-slice of both operands and a
// product of its own, summed into C afterwards in panel order. gemm_panels picks the kind that
// moves the fewest extra elements: for the LM head's products, tokens x vocabulary x width and
// tokens x width x vocabulary, that is columns and K respectively.
#pragma once

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cstddef>
#include <vector>

namespace shardtrain::cpu {

// How a product is cut: `count` panels of `size` (the last one shorter) along C's rows (M), its
// columns (N), or the inner dimension (K). Products under 2^21 multiply-adds (the attention's
// 64 x 128 x 64 tiles among them) stay one call; larger ones get kGemmPanels panels of at least
// kGemmMinPanel, in multiples of 16, along the dimension whose split moves the fewest extra
// elements: (count - 1) re-packings of B (K x N) for rows, of A (M x K) for columns, and for K the
// count partial products, written and summed in a pass of their own (weighted 8 M N each: that
// pass is slower than packing). Eight panels: on 2 threads fewer, wider panels measured faster
// than 16 (less re-packing), and 8 still shares out evenly over 1, 2, 4 and 8 threads.
enum GemmSplit { SPLIT_ROWS, SPLIT_COLUMNS, SPLIT_K };
constexpr int kGemmPanels = 8;
constexpr int kGemmMinPanel = 64;
constexpr double kGemmMinSplit = 1 << 21;
struct GemmPanels {
  GemmSplit split;
  int size, count;
};
// The panel size for an extent cut into kGemmPanels: at least kGemmMinPanel, a multiple of 16.
inline int gemm_panel_size(int extent) {
  return std::max(kGemmMinPanel, (extent + kGemmPanels - 1) / kGemmPanels + 15) / 16 * 16;
}
inline GemmPanels gemm_panels(int M, int N, int K) {
  const int extents[] = {M, N, K};
  GemmPanels best{SPLIT_ROWS, M, 1};
  if (static_cast<double>(M) * N * K < kGemmMinSplit) return best;
  double best_extra = 0;
  for (GemmSplit split : {SPLIT_ROWS, SPLIT_COLUMNS, SPLIT_K}) {
    const int extent = extents[split];
    if (extent < 2 * kGemmMinPanel) continue;
    const int size = gemm_panel_size(extent);
    const int count = (extent + size - 1) / size;
    const double extra = split == SPLIT_ROWS      ? (count - 1.0) * K * N
                         : split == SPLIT_COLUMNS ? (count - 1.0) * M * K
                                                  : 8.0 * count * M * N;
    if (best.count == 1 || extra < best_extra) best = {split, size, count}, best_extra = extra;
  }
  return best;
}

// Runs a BLAS call on the calling thread alone. OpenBLAS's OpenMP build is single-threaded inside
// an active parallel region and otherwise uses omp_get_max_threads() threads (it follows the
// OpenMP setting over openblas_set_num_threads), so outside one the setting is 1 for the call.
template <typename Call>
void single_threaded_blas(const Call& call) {
  const int threads = omp_get_max_threads();
  if (omp_in_parallel() || threads == 1) {
    call();
    return;
  }
  omp_set_num_threads(1);
  call();
  omp_set_num_threads(threads);
}

// Runs body(0..count-1) on the OpenMP threads, or in order inside a parallel region.
template <typename Body>
void for_each_panel(int count, const Body& body) {
  if (count == 1 || omp_get_level() > 0) {
    for (int i = 0; i < count; i++) body(i);
    return;
  }
#pragma omp parallel for schedule(static)
  for (int i = 0; i < count; i++) body(i);
}

inline void blas_gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int M, int N, int K, float alpha, const float* A,
                      int lda, const float* B, int ldb, float beta, float* C, int ldc) {
  cblas_sgemm(CblasRowMajor, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
inline void blas_gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int M, int N, int K, double alpha, const double* A,
                      int lda, const double* B, int ldb, double beta, double* C, int ldc) {
  cblas_dgemm(CblasRowMajor, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

// The partial products of a K split, one M x N block per panel: per thread, kept for the next
// call (grown, never shrunk: at most kGemmPanels x M x N of the largest K-split product).
template <typename Real>
std::vector<Real>& k_split_partials() {
  static thread_local std::vector<Real> partials;
  return partials;
}

template <typename Real>
void gemm(bool trans_a, bool trans_b, int M, int N, int K, Real alpha, const Real* A, int lda, const Real* B, int ldb,
          Real beta, Real* C, int ldc) {
  const CBLAS_TRANSPOSE ta = trans_a ? CblasTrans : CblasNoTrans, tb = trans_b ? CblasTrans : CblasNoTrans;
  const GemmPanels p = gemm_panels(M, N, K);
  const auto first_of = [&](int i) { return static_cast<size_t>(i) * p.size; };
  const auto extent_of = [&](int i, int extent) { return std::min(p.size, extent - i * p.size); };
  if (p.split == SPLIT_ROWS) {  // rows of op(A) and of C
    for_each_panel(p.count, [&](int i) {
      const size_t r = first_of(i);
      single_threaded_blas([&] {
        blas_gemm(ta, tb, extent_of(i, M), N, K, alpha, trans_a ? A + r : A + r * lda, lda, B, ldb, beta, C + r * ldc,
                  ldc);
      });
    });
  } else if (p.split == SPLIT_COLUMNS) {  // columns of op(B) and of C
    for_each_panel(p.count, [&](int i) {
      const size_t c = first_of(i);
      single_threaded_blas([&] {
        blas_gemm(ta, tb, M, extent_of(i, N), K, alpha, A, lda, trans_b ? B + c * ldb : B + c, ldb, beta, C + c, ldc);
      });
    });
  } else {  // K: panel i's product of the i-th K-slices into its own block, then C from the blocks in order
    std::vector<Real>& partials = k_split_partials<Real>();
    const size_t block = static_cast<size_t>(M) * N;
    if (partials.size() < p.count * block) partials.resize(p.count * block);
    Real* blocks = partials.data();
    for_each_panel(p.count, [&](int i) {
      const size_t k = first_of(i);
      single_threaded_blas([&] {
        blas_gemm(ta, tb, M, N, extent_of(i, K), Real(1), trans_a ? A + k * lda : A + k, lda,
                  trans_b ? B + k : B + k * ldb, ldb, Real(0), blocks + i * block, N);
      });
    });
    const int rows_per_panel = (M + p.count - 1) / p.count;  // the sum, shared out by rows
    for_each_panel(p.count, [&](int part) {
      for (int r = part * rows_per_panel; r < std::min(M, (part + 1) * rows_per_panel); r++)
        for (int c = 0; c < N; c++) {
          Real sum = blocks[static_cast<size_t>(r) * N + c];
          for (int i = 1; i < p.count; i++) sum += blocks[i * block + static_cast<size_t>(r) * N + c];
          Real& out = C[static_cast<size_t>(r) * ldc + c];
          out = beta == Real(0) ? alpha * sum : alpha * sum + beta * out;  // beta 0: C may hold NaN
        }
    });
  }
}

inline void blas_gemv(int M, int N, float alpha, const float* A, int lda, const float* x, float beta, float* y) {
  cblas_sgemv(CblasRowMajor, CblasNoTrans, M, N, alpha, A, lda, x, 1, beta, y, 1);
}
inline void blas_gemv(int M, int N, double alpha, const double* A, int lda, const double* x, double beta, double* y) {
  cblas_dgemv(CblasRowMajor, CblasNoTrans, M, N, alpha, A, lda, x, 1, beta, y, 1);
}

// Row-major y = alpha * A(M,N) @ x + beta * y (A with leading dimension lda): one row of a matrix
// product (a decode step's N = 1) without GEMM's packing of A, which costs as much as the product.
// Split over A's rows, in panels that depend on M alone.
template <typename Real>
void gemv(int M, int N, Real alpha, const Real* A, int lda, const Real* x, Real beta, Real* y) {
  const int size =
      M < 2 * kGemmMinPanel || static_cast<double>(M) * N < kGemmMinSplit ? M : gemm_panel_size(M);
  for_each_panel((M + size - 1) / size, [&](int i) {
    const int first = i * size;
    single_threaded_blas([&] {
      blas_gemv(std::min(size, M - first), N, alpha, A + static_cast<size_t>(first) * lda, lda, x, beta, y + first);
    });
  });
}

// Columns are processed in blocks of this many so that column-sum loops (bias and LayerNorm
// parameter gradients) read whole cache lines and still split evenly over threads.
constexpr int COLUMN_BLOCK = 32;

}  // namespace shardtrain::cpu
