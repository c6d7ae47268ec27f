// Row-major GEMM dispatch to OpenBLAS for float and double: C = alpha * op(A) @ op(B) + beta * C.
// Inside an OpenMP parallel region OpenBLAS (OpenMP build) runs single-threaded, which is what the
// per-head attention loops want; outside one it uses the OpenMP pool.
#pragma once

#include <cblas.h>

namespace shardtrain::cpu {

inline void gemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
                 const float* B, int ldb, float beta, float* C, int ldc) {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, M, N, K,
              alpha, A, lda, B, ldb, beta, C, ldc);
}

inline void gemm(bool trans_a, bool trans_b, int M, int N, int K, double alpha, const double* A, int lda,
                 const double* B, int ldb, double beta, double* C, int ldc) {
  cblas_dgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, M, N, K,
              alpha, A, lda, B, ldb, beta, C, ldc);
}

// Row-major y = alpha * A(M,N) @ x + beta * y (A with leading dimension lda): one row of a matrix
// product (a decode step's N = 1) without GEMM's packing of A, which costs as much as the product.
inline void gemv(int M, int N, float alpha, const float* A, int lda, const float* x, float beta, float* y) {
  cblas_sgemv(CblasRowMajor, CblasNoTrans, M, N, alpha, A, lda, x, 1, beta, y, 1);
}

inline void gemv(int M, int N, double alpha, const double* A, int lda, const double* x, double beta, double* y) {
  cblas_dgemv(CblasRowMajor, CblasNoTrans, M, N, alpha, A, lda, x, 1, beta, y, 1);
}

// Columns are processed in blocks of this many so that column-sum loops (bias and LayerNorm
// parameter gradients) read whole cache lines and still split evenly over threads.
constexpr int COLUMN_BLOCK = 32;

}  // namespace shardtrain::cpu
