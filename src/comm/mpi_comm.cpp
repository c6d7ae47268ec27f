// Comm over MPI on host buffers. Open MPI's reductions are deterministic for a fixed rank count
// and message size, which the determinism invariant (bit-identical reruns) relies on.
#include <climits>

#include "comm/comm.hpp"
#include "comm/watchdog.hpp"
#include "core/error.hpp"

namespace shardtrain {
namespace {

int checked_count(size_t n) {
  SHARD_CHECK(n <= static_cast<size_t>(INT_MAX), "message of %zu elements exceeds MPI's int count", n);
  return static_cast<int>(n);
}

class MpiComm final : public Comm {
 public:
  MpiComm(MPI_Comm comm, Watchdog* watchdog) : comm_(comm), watchdog_(watchdog) {
    MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    MPI_CHECK(MPI_Comm_size(comm_, &size_));
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void all_gather(Span<const float> shard, Span<float> full, const char* what) override {
    SHARD_CHECK(full.size == shard.size * size_, "all_gather %s: full %zu != shard %zu x %d", what, full.size,
                shard.size, size_);
    Watchdog::Scope scope(watchdog_, what);
    const float* own_slot = full.data + rank_ * shard.size;
    if (shard.data == own_slot) {
      MPI_CHECK(MPI_Allgather(MPI_IN_PLACE, 0, MPI_FLOAT, full.data, checked_count(shard.size), MPI_FLOAT, comm_));
    } else {
      MPI_CHECK(MPI_Allgather(shard.data, checked_count(shard.size), MPI_FLOAT, full.data,
                              checked_count(shard.size), MPI_FLOAT, comm_));
    }
  }

  void reduce_scatter_sum(Span<const float> full, Span<float> shard, const char* what) override {
    SHARD_CHECK(full.size == shard.size * size_, "reduce_scatter %s: full %zu != shard %zu x %d", what,
                full.size, shard.size, size_);
    Watchdog::Scope scope(watchdog_, what);
    MPI_CHECK(MPI_Reduce_scatter_block(full.data, shard.data, checked_count(shard.size), MPI_FLOAT, MPI_SUM, comm_));
  }

  void all_reduce_sum(Span<double> values, const char* what) override {
    Watchdog::Scope scope(watchdog_, what);
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, values.data, checked_count(values.size), MPI_DOUBLE, MPI_SUM, comm_));
  }

  void all_reduce_max(Span<double> values, const char* what) override {
    Watchdog::Scope scope(watchdog_, what);
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, values.data, checked_count(values.size), MPI_DOUBLE, MPI_MAX, comm_));
  }

  void broadcast(Span<char> bytes, int root, const char* what) override {
    Watchdog::Scope scope(watchdog_, what);
    MPI_CHECK(MPI_Bcast(bytes.data, checked_count(bytes.size), MPI_CHAR, root, comm_));
  }

  void barrier(const char* what) override {
    Watchdog::Scope scope(watchdog_, what);
    MPI_CHECK(MPI_Barrier(comm_));
  }

 private:
  MPI_Comm comm_;
  Watchdog* watchdog_;
  int rank_ = 0, size_ = 1;
};

}  // namespace

std::unique_ptr<Comm> make_mpi_comm(MPI_Comm comm, Watchdog* watchdog) {
  return std::make_unique<MpiComm>(comm, watchdog);
}

}  // namespace shardtrain
