// GoogleTest under mpirun: every test judges its own part and combines verdicts over the ranks
// (all_ranks), so every rank agrees; only rank 0 prints; the exit code is the worst verdict.
#pragma once

#include <gtest/gtest.h>
#include <mpi.h>

namespace shardtrain::testing {

// Collective: true when `local` is true on every rank of MPI_COMM_WORLD.
inline bool all_ranks(bool local) {
  int mine = local ? 1 : 0, all = 0;
  MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return all == 1;
}

// After MPI_Init and InitGoogleTest: runs every test, finalizes MPI, returns the exit code.
inline int run_all_tests_on_every_rank() {
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

}  // namespace shardtrain::testing
