// Host MPI collectives on a device's buffers (fsdp.comm_backend=mpi on a GPU): each collective
// copies its device buffers into a host staging buffer, runs the MPI communicator
// (comm/mpi_comm.cpp) on the copies and copies the results back. NCCL refuses two ranks on one
// GPU; this does not, so several ranks may share a GPU (tests, small machines), at the price of
// every collective crossing PCIe twice and the host waiting for the device before each one.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <memory>

#include "comm/comm.hpp"

namespace shardtrain {

class Device;
class Watchdog;

// A communicator over the ranks of `comm` whose spans are `device`'s memory (all of them: the
// all-reduces and the broadcast too; barrier takes none). The staging buffer comes from `host`,
// the backend's host device (Backend::host: page-locked beside a GPU, so the copies run at PCIe
// speed); the MPI communicator on it is make_mpi_comm(comm, watchdog), so results, wire types,
// the accumulating reduce-scatter and bytes_sent() are the MPI communicator's bit for bit.
//
// Every collective completes in its call: the started forms (start_all_gather,
// start_reduce_scatter_add) return a finished handle for wait(). One staging buffer therefore
// serves all collectives; it grows to exactly the largest collective seen (staging_bytes_* below)
// and is kept. It is allocated from `host` but counted by no Device: uncounted_buffer_bytes()
// reports it, with the MPI ring's own buffers, as the bytes actually allocated.
//
// On one rank nothing is staged but the reduce-scatter (the all-gather copies on the device when
// not in place; the all-reduces and the broadcast are the identity).
std::unique_ptr<Comm> make_staged_comm(MPI_Comm comm, Watchdog* watchdog, Device& device, Device& host);

// The staging bytes one collective needs, which the communicator allocates and the memory plan
// counts (app/compute_backend.hpp's plan_comm_staging_bytes): an all-gather its gathered buffer, a
// reduce-scatter its full buffer and the shard it adds into (fp32 whatever the wire), an
// all-reduce or broadcast its values.
constexpr size_t staging_bytes_all_gather(size_t full_n, size_t elem_bytes) { return full_n * elem_bytes; }
constexpr size_t staging_bytes_reduce_scatter(size_t shard_n, int ranks) {
  return (static_cast<size_t>(ranks) + 1) * shard_n * sizeof(float);
}
constexpr size_t staging_bytes_all_reduce(size_t n, size_t elem_bytes) { return n * elem_bytes; }

}  // namespace shardtrain
