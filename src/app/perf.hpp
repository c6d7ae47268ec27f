// Machine facts used for reporting: the threads a rank should use, and the SGEMM peak that MFU
// is measured against (MFU = model FLOP/s / FLOP/s of a large OpenBLAS SGEMM
// measured in the same run, on all ranks at once).
#pragma once

#include <string>

namespace shardtrain {

// Cores this process may run on (its affinity mask), shared evenly by the ranks of the node.
int default_threads_per_rank(int local_ranks);
// Applies the thread count to OpenMP and OpenBLAS.
void set_compute_threads(int threads);
// Best GFLOP/s of an n x n x n SGEMM over `repeats` runs on this process's threads.
double measure_sgemm_gflops(int n, int repeats);
// OpenBLAS's kernel name and build configuration, e.g. "Haswell (OpenBLAS 0.3.21 ...)".
std::string blas_description();

}  // namespace shardtrain
