// Every CUDA runtime and cuBLAS(Lt) call goes through one of these (NCCL's: comm/cuda/nccl_check.hpp):
// a failure names the statement and the library's own error string and aborts every rank
// (fatal_internal), never a silent wrong result or a hang. Include only in CUDA=1 sources. Here,
// in the lowest CUDA layer, so that the kernels, backend/cuda and comm/cuda all share it.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include "core/error.hpp"

#define CUDA_CHECK(call)                                                                           \
  do {                                                                                             \
    cudaError_t cuda_check_rc_ = (call);                                                           \
    if (cuda_check_rc_ != cudaSuccess)                                                             \
      ::shardtrain::fatal_internal(__FILE__, __LINE__, __func__,                                   \
                                   ::shardtrain::strprintf("%s: %s", #call, cudaGetErrorString(cuda_check_rc_))); \
  } while (0)

#define CUBLAS_CHECK(call)                                                                         \
  do {                                                                                             \
    cublasStatus_t cublas_check_rc_ = (call);                                                      \
    if (cublas_check_rc_ != CUBLAS_STATUS_SUCCESS)                                                 \
      ::shardtrain::fatal_internal(__FILE__, __LINE__, __func__,                                   \
                                   ::shardtrain::strprintf("%s: %s", #call, cublasGetStatusString(cublas_check_rc_))); \
  } while (0)

// Kernel launches: the launch error now, not at the next synchronizing call.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())
