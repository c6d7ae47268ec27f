// GoogleTest main for the single-process unit tests. MPI is initialised because the library's
// fatal paths and Comm can be used with MPI_COMM_SELF.
#include <gtest/gtest.h>
#include <mpi.h>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  int result = RUN_ALL_TESTS();
  MPI_Finalize();
  return result;
}
