// The process's MPI runtime: bootstrap, who we are (rank, world, node-local rank, host), rank-0
// logging, and the collective agreement on input errors.
//
// One Runtime object lives in main() and is passed down; there are no globals. Every check whose
// outcome could differ between ranks (a file one rank cannot read) goes through agree(), so that
// all ranks fail together with the same message instead of some waiting in a collective forever.
#pragma once

#include <mpi.h>

#include <memory>
#include <string>
#include <vector>

#include "core/error.hpp"

namespace shardtrain {

class Comm;
class Watchdog;

// Collective over `comm` (host memory): "" when every rank passes "", else the message of the
// lowest rank that passed one, on every rank.
std::string agreed_error(const std::string& local_error, Comm& comm);

// "" when MPI_Init_thread's `provided` level is enough for us, else why not: the watchdog's
// thread may call MPI_Abort while the main thread is inside a collective.
std::string mpi_thread_level_error(int provided);

class Runtime {
 public:
  Runtime(int* argc, char*** argv);
  ~Runtime();

  // The Runtime's own collectives (the agreements, splits, gathers) and MPI_Finalize are timed like
  // the engine's: one that waits longer than this (a rank stuck reading a file, a peer gone) aborts
  // every rank with a message instead of hanging. DEFAULT_COLLECTIVE_TIMEOUT until the options are
  // known; then fsdp.comm_timeout (0 disables).
  static constexpr double DEFAULT_COLLECTIVE_TIMEOUT = 300;
  void set_collective_timeout(double seconds);
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  int rank() const { return rank_; }
  int world() const { return world_; }
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }
  bool is_root() const { return rank_ == 0; }
  const std::string& host() const { return host_; }
  // The one way to the raw MPI communicator of all ranks, for what must have one (a Comm,
  // parallel HDF5); everything else talks through Comm and this class.
  MPI_Comm world_comm() const { return MPI_COMM_WORLD; }
  // Collective. The ranks of equal `color`, ordered by `key`, as a raw communicator for a Comm to
  // wrap; the Runtime owns it and frees it before MPI_Finalize.
  MPI_Comm split_world(int color, int key) const;
  // Collective over this node's ranks: each one's `mine`, by node-local rank.
  std::vector<std::string> node_all_gather(const std::string& mine) const;

  // Collective. Each rank passes its own error message ("" when fine). When any rank failed, every
  // rank throws InputError carrying the message of the lowest failing rank.
  void agree(const std::string& local_error) const;
  // Runs `check` on every rank and agrees on the outcome: an InputError on any rank becomes the
  // same InputError on all ranks.
  template <typename F>
  void agree_on(F&& check) const {
    std::string error;
    try {
      check();
    } catch (const InputError& e) {
      error = e.what();
    }
    agree(error);
  }

  // Rank 0 prints to stdout (info) or stderr (warn); the others stay silent.
  void info(const char* fmt, ...) const __attribute__((format(printf, 2, 3)));
  void warn(const char* fmt, ...) const __attribute__((format(printf, 2, 3)));

 private:
  int rank_ = 0, world_ = 1, local_rank_ = 0, local_size_ = 1;
  std::string host_;
  MPI_Comm node_ = MPI_COMM_NULL;  // this node's ranks
  mutable std::vector<MPI_Comm> splits_;  // handed out by split_world
  std::unique_ptr<Watchdog> watchdog_;
};

}  // namespace shardtrain
