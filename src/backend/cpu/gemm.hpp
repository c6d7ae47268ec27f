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

// Columns are processed in blocks of this many so that column-sum loops (bias and LayerNorm
// parameter gradients) read whole cache lines and still split evenly over threads.
constexpr int COLUMN_BLOCK = 32;

}  // namespace shardtrain::cpu
