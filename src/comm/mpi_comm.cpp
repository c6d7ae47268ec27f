// Comm over MPI on host buffers.
//
// reduce_scatter_add is our own ring (n-1 MPI_Sendrecv steps of one chunk each): Open MPI 4.1's
// reduce_scatter_block reduces the whole buffer to a root through a freshly malloc'ed full-size
// temporary, which costs page faults and twice the traffic on every call. The ring moves the
// optimal (n-1)/n of the buffer per rank, needs two chunk-sized buffers, adds into the shard
// directly, and sums each chunk in a fixed rank order: reruns on the same rank count are
// bit-identical (the determinism invariant).
#include <algorithm>
#include <climits>
#include <vector>

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

  void reduce_scatter_add(Span<const float> full, Span<float> shard, const char* what) override {
    SHARD_CHECK(full.size == shard.size * size_, "reduce_scatter %s: full %zu != shard %zu x %d", what,
                full.size, shard.size, size_);
    const size_t n = shard.size;
    auto chunk = [&](int c) { return full.data + static_cast<size_t>((c % size_ + size_) % size_) * n; };
    if (size_ == 1) {
      add_into(shard.data, chunk(0), n);
      return;
    }
    Watchdog::Scope scope(watchdog_, what);
    if (ring_send_.size() < n) ring_send_.resize(n), ring_recv_.resize(n);
    const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
    // Step s sends the partial sum of chunk (rank-s-1) and receives that of chunk (rank-s-2);
    // after size-1 steps the received partial is this rank's own chunk, missing only our term.
    std::copy(chunk(rank_ - 1), chunk(rank_ - 1) + n, ring_send_.begin());
    for (int s = 0; s < size_ - 1; s++) {
      MPI_CHECK(MPI_Sendrecv(ring_send_.data(), checked_count(n), MPI_FLOAT, next, 0, ring_recv_.data(),
                             checked_count(n), MPI_FLOAT, prev, 0, comm_, MPI_STATUS_IGNORE));
      const float* own = chunk(rank_ - s - 2);
      if (s < size_ - 2) {
        float* partial = ring_recv_.data();
#pragma omp parallel for simd schedule(static)
        for (size_t i = 0; i < n; i++) partial[i] += own[i];
        std::swap(ring_send_, ring_recv_);
      } else {
        float* out = shard.data;
        const float* partial = ring_recv_.data();
#pragma omp parallel for simd schedule(static)
        for (size_t i = 0; i < n; i++) out[i] += partial[i] + own[i];
      }
    }
  }

  size_t buffer_bytes() const override { return (ring_send_.size() + ring_recv_.size()) * sizeof(float); }

  void all_reduce_sum(Span<float> values, const char* what) override {
    if (size_ == 1) return;
    Watchdog::Scope scope(watchdog_, what);
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, values.data, checked_count(values.size), MPI_FLOAT, MPI_SUM, comm_));
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
  static void add_into(float* out, const float* in, size_t n) {
#pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; i++) out[i] += in[i];
  }

  MPI_Comm comm_;
  Watchdog* watchdog_;
  std::vector<float> ring_send_, ring_recv_;
  int rank_ = 0, size_ = 1;
};

}  // namespace

std::unique_ptr<Comm> make_mpi_comm(MPI_Comm comm, Watchdog* watchdog) {
  return std::make_unique<MpiComm>(comm, watchdog);
}

}  // namespace shardtrain
