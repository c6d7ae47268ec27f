// NCCL_CHECK: the NCCL member of kernels/cuda_check.hpp's family. Evaluates the call once; a
// result other than ncclSuccess names the statement, NCCL's error string and its last-error text,
// and aborts every rank (fatal_internal). Only for calls that have no communicator in flight
// (ncclGetUniqueId, ncclGetVersion): calls on a nonblocking communicator may answer
// ncclInProgress and must go through the communicator's own wait (comm/cuda/nccl_comm.cpp), which
// also aborts the communicator before the ranks.
#pragma once

#include <nccl.h>

#include "core/error.hpp"

#define NCCL_CHECK(call)                                                                           \
  do {                                                                                             \
    ncclResult_t nccl_check_rc_ = (call);                                                          \
    if (nccl_check_rc_ != ncclSuccess)                                                             \
      ::shardtrain::fatal_internal(__FILE__, __LINE__, __func__,                                   \
                                   ::shardtrain::strprintf("%s: %s (%s)", #call, ncclGetErrorString(nccl_check_rc_), \
                                                           ncclGetLastError(nullptr)));            \
  } while (0)
