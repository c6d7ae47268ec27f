// GoogleTest main for the multi-rank tests, run under `mpirun -np 1..4`. Every test judges its
// own part and combines verdicts collectively (all_ranks), so all ranks agree; only rank 0
// prints. The process exit code is the verdict.
#include <gtest/gtest.h>
#include <mpi.h>
#include <omp.h>

#include "support/mpi_gtest.hpp"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  // Up to 4 ranks share 2 cores here: OpenMP teams of several threads per rank spin-wait against
  // each other (seconds per parallel loop). These tests are about ranks, not threads.
  omp_set_num_threads(1);
  ::testing::InitGoogleTest(&argc, argv);
  return shardtrain::testing::run_all_tests_on_every_rank();
}
