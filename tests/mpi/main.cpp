// GoogleTest main for the multi-rank tests, run under `mpirun -np 1..4`. Every test judges its
// own part and combines verdicts collectively (collective_ok), so all ranks agree; only rank 0
// prints. The process exit code is the verdict.
#include <gtest/gtest.h>
#include <mpi.h>
#include <omp.h>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  // Up to 4 ranks share 2 cores here: OpenMP teams of several threads per rank spin-wait against
  // each other (seconds per parallel loop). These tests are about ranks, not threads.
  omp_set_num_threads(1);
  ::testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  int result = RUN_ALL_TESTS();
  int worst = 0;
  MPI_Allreduce(&result, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}
