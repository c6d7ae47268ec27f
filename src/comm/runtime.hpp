// The process's MPI runtime: bootstrap, who we are (rank, world, node-local rank, host), rank-0
// logging, and the collective agreement on input errors.
//
// One Runtime object lives in main() and is passed down; there are no globals. Every check whose
// outcome could differ between ranks (a file one rank cannot read) goes through agree(), so that
// all ranks fail together with the same message instead of some waiting in a collective forever.
#pragma once

#include <mpi.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
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

// Where the ranks run, the same on every rank: the node of each world rank (a node is what
// MPI_COMM_TYPE_SHARED groups, numbered in the order of their lowest rank) and each node's host name.
struct NodeLayout {
  std::vector<int> node_of_rank;
  std::vector<std::string> host_of_node;
  int nodes() const { return static_cast<int>(host_of_node.size()); }
  int ranks() const { return static_cast<int>(node_of_rank.size()); }
  std::vector<int> ranks_on(int node) const;
};

// The shard groups and replica groups for shard groups of `group_size` ranks (0: the ranks of one
// node, which needs the same number of ranks on every node). The ranks in node order (node by node,
// by rank within a node) are cut into consecutive groups, so a shard group is a node, or part of
// one, whenever group_size divides the ranks per node, however the launcher numbered the ranks
// (`--map-by node` included); under the usual block placement that is rank / group_size. Replica
// group k holds the k-th rank of every shard group. Pure (tests/unit/test_groups.cpp).
struct GroupPlan {
  int group_size = 0;                // resolved: ranks per shard group
  std::vector<int> shard_of_rank;    // each world rank's shard group (its MPI_Comm_split color)
  std::vector<int> replica_of_rank;  // each world rank's replica group
  std::string error;                 // non-empty: the layout cannot have these groups (why, and the fix)
  // "2 shard groups of 2 ranks: {0 2} on h1, {1 3} on h2 | 2 replica groups: {0 1} {2 3}"
  std::string describe(const NodeLayout& layout) const;
  // The shard groups that hold part of one host's ranks together with ranks of another host,
  // described ("{2 3} on h1+h2"); groups of whole hosts are not listed.
  std::vector<std::string> straddling(const NodeLayout& layout) const;
};
GroupPlan plan_groups(const NodeLayout& layout, int group_size);

// The timeout of the Runtime's collectives and the setting that chose it (named in the watchdog's
// message): fsdp.comm_timeout for train, --comm-timeout for the other commands. 0 disables.
struct CollectiveTimeout {
  static constexpr double DEFAULT_SECONDS = 300;
  double seconds = DEFAULT_SECONDS;
  std::string option = "fsdp.comm_timeout";
};

// The start-up timeout of a command line, read before MPI_Init and before the options are parsed:
// the value of --comm-timeout (any command) or --fsdp.comm_timeout (train) when the command line
// gives one that reads as seconds, else the default (a bad value is refused later by the parser).
CollectiveTimeout startup_timeout(const std::vector<std::string>& args);

class Runtime {
 public:
  // MPI_Init (by an interval timer: no thread of ours runs during it), and every collective of the
  // Runtime's own, is timed with `timeout` until set_collective_timeout: a rank that never arrives
  // (stopped, or dead without its launcher noticing) ends the job with a message instead of hanging it.
  Runtime(int* argc, char*** argv, const CollectiveTimeout& timeout = {});
  ~Runtime();

  // The Runtime's own collectives (the agreements, splits, gathers) and MPI_Finalize are timed like
  // the engine's: one that waits longer than this (a rank stuck reading a file, a peer gone) aborts
  // every rank with a message instead of hanging. The start-up timeout until the options are
  // known; then the command's option.
  void set_collective_timeout(const CollectiveTimeout& timeout);
  const CollectiveTimeout& collective_timeout() const { return timeout_; }
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
  // Every rank's node and every node's host (gathered at start-up).
  const NodeLayout& layout() const { return layout_; }
  // Collective. This rank's shard group, or its replica group, for shard groups of `group_size`
  // ranks (0: the ranks of one node) as plan_groups lays them out, as a raw communicator for a Comm
  // to wrap; the Runtime owns it. A layout that cannot have those groups (group_size 0 on nodes with
  // different rank counts) throws UsageError on every rank with the same message (all plan from the
  // same layout) before any split. shard_group_comm logs the groups (rank 0) when there are several
  // nodes or several shard groups, and warns when a shard group spans hosts.
  MPI_Comm shard_group_comm(int group_size) const;
  MPI_Comm replica_group_comm(int group_size) const;

  // Collective. Each rank passes its own error message ("" when fine) and its kind
  // (InputError::kind). When any rank failed, every rank throws the error of the lowest failing
  // rank: its message, its type.
  void agree(const std::string& local_error, char kind = 'I') const;
  // Runs `check` on every rank and agrees on the outcome: an InputError on any rank becomes the
  // same error, of the same type, on all ranks.
  template <typename F>
  void agree_on(F&& check) const {
    std::string error;
    char kind = 'I';
    try {
      check();
    } catch (const InputError& e) {
      error = e.what(), kind = e.kind();
    }
    agree(error, kind);
  }

  // Runs `work` on rank 0 alone while the other ranks wait, then agrees on its outcome as agree_on
  // does. The wait is not a timed collective -- the work may rightly take hours (data encode of a
  // large corpus) -- but rank 0 sends a heartbeat from a thread of its own while it works, and a
  // waiting rank that hears none for the collective timeout aborts the job: a stopped or vanished
  // rank 0 does not hang the others, and a slow one does not trip them.
  template <typename F>
  void on_root(const char* what, F&& work) const {
    std::string error;
    char kind = 'I';
    if (is_root()) {
      RootHeartbeat heartbeat(*this);
      try {
        work();
      } catch (const InputError& e) {
        error = e.what(), kind = e.kind();
      }
      heartbeat.finish();
    } else {
      wait_for_root(what);
    }
    agree(error, kind);
  }

  // Test hook: SHARDTRAIN_DEBUG_STALL=RANK:POINT:SECONDS makes that rank sleep at that point
  // (init: before MPI_Init; root-work: inside on_root's work; finalize: before MPI_Finalize);
  // RANK:POINT:segv makes it call a null function pointer there (app/crash_report.hpp).
  static void debug_stall(const char* point);

  // Rank 0 prints to stdout (info) or stderr (warn); the others stay silent.
  void info(const char* fmt, ...) const __attribute__((format(printf, 2, 3)));
  void warn(const char* fmt, ...) const __attribute__((format(printf, 2, 3)));

 private:
  int rank_ = 0, world_ = 1, local_rank_ = 0, local_size_ = 1;
  std::string host_;
  MPI_Comm node_ = MPI_COMM_NULL;  // this node's ranks
  NodeLayout layout_;
  void gather_layout();
  GroupPlan checked_plan(int group_size) const;
  MPI_Comm split(int color, int key, const char* what) const;
  mutable std::vector<MPI_Comm> splits_;  // handed out by split_world
  MPI_Comm heartbeat_ = MPI_COMM_NULL;    // on_root's heartbeats, apart from every collective
  CollectiveTimeout timeout_;
  std::unique_ptr<Watchdog> watchdog_;

  // Rank 0's side of on_root: a thread that sends each waiting rank a byte every heartbeat
  // interval; finish() stops it and tells the waiting ranks that the work is over.
  class RootHeartbeat {
   public:
    explicit RootHeartbeat(const Runtime& rt);
    ~RootHeartbeat();
    void finish();

   private:
    void stop();
    const Runtime& rt_;
    std::vector<MPI_Request> pending_;  // the last heartbeat to each rank
    std::atomic<bool> stop_{false};
    std::thread thread_;
  };
  void wait_for_root(const char* what) const;
};

}  // namespace shardtrain
