// GoogleTest main for the GPU tests (`make test-gpu`): every CUDA kernel against the CPU backend
// (test_kernels.cpp) and the NCCL communicator against MPI (test_nccl_comm.cpp), run alone or
// under mpirun. MPI is initialised first because the NCCL tests bootstrap over it. Without a usable
// GPU on every rank the program prints one line, `gpu_tests: no GPU (<why>): skipped`, and exits
// 0 without running a test, so CPU-only machines can run the target (--gtest_list_tests still
// lists them). Otherwise only rank 0 prints, and the exit code is the worst verdict over the ranks.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <string>

#include "backend/cuda/cuda_backend.hpp"
#include "support/mpi_gtest.hpp"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);

  std::string why;
  int available = shardtrain::cuda_available(&why) ? 1 : 0, everywhere = 0;
  MPI_Allreduce(&available, &everywhere, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!everywhere && !GTEST_FLAG_GET(list_tests)) {  // listing the tests needs no GPU
    if (rank == 0) std::printf("gpu_tests: no GPU (%s): skipped\n", available ? "another rank has none" : why.c_str());
    MPI_Finalize();
    return 0;
  }

  return shardtrain::testing::run_all_tests_on_every_rank();
}
