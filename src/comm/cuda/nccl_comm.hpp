// The NCCL implementation of Comm (comm/cuda/nccl_comm.cpp). Built only with `make CUDA=1`.
#pragma once

#include <mpi.h>

#include <memory>

#include "comm/comm.hpp"

namespace shardtrain {

class Device;
class Watchdog;

// A NCCL communicator over the ranks of `comm` on `device`, a GPU (kind() DEVICE_CUDA) that it
// sees only through Device: rank 0 of `comm` creates the unique id, MPI broadcasts it, every rank
// calls ncclCommInitRank on the device (bound to its threads with bind_thread()). Collectives run
// on a communication stream of the device that waits (an event) for the compute stream's work
// issued before the call; blocking calls make the compute stream wait for the collective;
// started all-gathers are joined by wait(handle). Spans are device memory, except that
// all_reduce_*, broadcast and barrier also take host memory (then MPI carries them). `watchdog`
// (may be null) bounds every wait: a collective that does not finish within its timeout, or an
// asynchronous NCCL error, aborts the communicator and every rank with a message.
std::unique_ptr<Comm> make_nccl_comm(MPI_Comm comm, Device& device, Watchdog* watchdog);

}  // namespace shardtrain
