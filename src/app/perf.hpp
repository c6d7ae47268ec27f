// Machine facts used for reporting: the threads a rank should use, the GEMM rate that MFU is
// measured against (MFU = model FLOP/s / FLOP/s of a large GEMM of the precision in use --
// OpenBLAS SGEMM, or the bf16 matmul -- measured in the same run, on all ranks at once), and the
// hardware's own peak of that precision (hardware MFU), from independent multiply-add chains.
#pragma once

#include <string>

namespace shardtrain {

// Cores this process may run on (its affinity mask), shared evenly by the ranks of the node.
int default_threads_per_rank(int local_ranks);
// Applies the thread count to OpenMP and OpenBLAS.
void set_compute_threads(int threads);
// Best GFLOP/s of an n x n x n SGEMM over `repeats` runs on this process's threads.
double measure_sgemm_gflops(int n, int repeats);
// Best GFLOP/s of an n x n x n product with bf16 operands and fp32 accumulation through the
// CPU's bf16 GEMM (backend/cpu/bf16_gemm.hpp), over `repeats` runs: the activation rounded per
// product, the weight passed with its bf16 copy, as in training.
double measure_bf16_gemm_gflops(int n, int repeats);

// The arithmetic peak of this process's threads, measured: every thread runs independent chains
// of vector multiply-adds (enough to hide their latency) from registers, no memory traffic, and
// its rate is taken over its own CPU time (so other processes on the cores do not lower it).
// fp32: AVX-512 or AVX2 FMA; bf16: AVX512-BF16 dot products (vdpbf16ps: 2 products per fp32
// lane). `unit` says which instructions ran; gflops is 0 where the CPU has none for the precision.
struct FmaPeak {
  double gflops = 0;
  std::string unit;  // e.g. "avx512 fma", "avx512_bf16 dot product"
};
FmaPeak measure_fma_peak(bool bf16);

// OpenBLAS's kernel name and build configuration, e.g. "Haswell (OpenBLAS 0.3.21 ...)".
std::string blas_description();

}  // namespace shardtrain
