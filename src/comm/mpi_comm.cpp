// Comm over MPI on host buffers.
//
// reduce_scatter_add is our own ring (n-1 MPI_Sendrecv steps of one chunk each): Open MPI 4.1's
// reduce_scatter_block reduces the whole buffer to a root through a freshly malloc'ed full-size
// temporary, which costs page faults and twice the traffic on every call. The ring moves the
// optimal (n-1)/n of the buffer per rank, needs two chunk-sized buffers, adds into the shard
// directly, and sums each chunk in a fixed rank order: reruns on the same rank count are
// bit-identical (the determinism invariant).
#include <algorithm>
#include <cstring>
#include <vector>

#include "comm/comm.hpp"
#include "comm/comm_impl.hpp"
#include "comm/watchdog.hpp"
#include "core/error.hpp"

namespace shardtrain {
namespace {

class MpiComm final : public Comm {
 public:
  MpiComm(MPI_Comm comm, Watchdog* watchdog) : comm_(comm), watchdog_(watchdog) {
    MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    MPI_CHECK(MPI_Comm_size(comm_, &size_));
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void all_gather(Span<const float> shard, Span<float> full, const char* what) override {
    gather(shard.data, full.data, shard.size, full.size, MPI_FLOAT, sizeof(float), what);
  }

  void all_gather(Span<const uint16_t> shard, Span<uint16_t> full, const char* what) override {
    gather(shard.data, full.data, shard.size, full.size, MPI_UINT16_T, sizeof(uint16_t), what);
  }

  void all_gather(Span<const uint8_t> shard, Span<uint8_t> full, const char* what) override {
    gather(shard.data, full.data, shard.size, full.size, MPI_UINT8_T, 1, what);
  }

  int start_all_gather(Span<const float> shard, Span<float> full, const char* what) override {
    return start_gather(shard.data, full.data, shard.size, full.size, MPI_FLOAT, sizeof(float), what);
  }

  int start_all_gather(Span<const uint8_t> shard, Span<uint8_t> full, const char* what) override {
    return start_gather(shard.data, full.data, shard.size, full.size, MPI_UINT8_T, 1, what);
  }

  int start_all_gather(Span<const uint16_t> shard, Span<uint16_t> full, const char* what) override {
    return start_gather(shard.data, full.data, shard.size, full.size, MPI_UINT16_T, sizeof(uint16_t), what);
  }

  void wait(int handle) override {
    SHARD_CHECK(handle >= 0 && handle < static_cast<int>(pending_.size()), "unknown request %d", handle);
    Watchdog::Scope scope(watchdog_, pending_[handle].what);
    MPI_CHECK(MPI_Wait(&pending_[handle].request, MPI_STATUS_IGNORE));
    pending_[handle].what = nullptr;  // the slot is free again
  }

  int start_reduce_scatter_add(Span<const float> full, Span<float> shard, DType wire, const char* what) override {
    reduce_scatter_add(full, shard, wire, what);
    return finished_request(what);
  }

  uint64_t bytes_sent() const override { return bytes_sent_; }
  size_t uncounted_buffer_bytes() const override {
    return (ring_send_.capacity() + ring_recv_.capacity()) * sizeof(float) +
           (wire_send_.capacity() + wire_recv_.capacity()) * sizeof(uint16_t);
  }

  void reduce_scatter_add(Span<const float> full, Span<float> shard, DType wire, const char* what) override {
    SHARD_CHECK(full.size == shard.size * size_, "reduce_scatter %s: full %zu != shard %zu x %d", what,
                full.size, shard.size, size_);
    const size_t n = shard.size;
    auto chunk = [&](int c) { return full.data + static_cast<size_t>((c % size_ + size_) % size_) * n; };
    if (size_ == 1) {
      add_into(shard.data, chunk(0), n);
      return;
    }
    Watchdog::Scope scope(watchdog_, what);
    bytes_sent_ += static_cast<uint64_t>(size_ - 1) * n * dtype_bytes(wire);
    if (wire != DTYPE_FP32) return reduce_scatter_add_16(chunk, shard.data, n, wire);
    if (ring_send_.size() < n) grow_exactly(ring_send_, n), grow_exactly(ring_recv_, n);
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



  void all_reduce_sum(Span<float> values, const char* what) override {
    if (size_ == 1) return;
    Watchdog::Scope scope(watchdog_, what);
    bytes_sent_ += 2 * (size_ - 1) * values.size * sizeof(float) / size_;
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
  void gather(const void* shard, void* full, size_t shard_n, size_t full_n, MPI_Datatype type, size_t bytes,
              const char* what) {
    SHARD_CHECK(full_n == shard_n * size_, "all_gather %s: full %zu != shard %zu x %d", what, full_n, shard_n, size_);
    if (size_ == 1) {
      if (shard != full) std::memcpy(full, shard, shard_n * bytes);
      return;
    }
    Watchdog::Scope scope(watchdog_, what);
    bytes_sent_ += static_cast<uint64_t>(size_ - 1) * shard_n * bytes;
    const char* own_slot = static_cast<const char*>(full) + rank_ * shard_n * bytes;
    if (shard == own_slot) {
      MPI_CHECK(MPI_Allgather(MPI_IN_PLACE, 0, type, full, checked_count(shard_n), type, comm_));
    } else {
      MPI_CHECK(MPI_Allgather(shard, checked_count(shard_n), type, full, checked_count(shard_n), type, comm_));
    }
  }

  // A free slot of pending_ for a request named `what`.
  size_t take_pending(const char* what) {
    const size_t slot = take_slot(pending_, what, [] { return Pending{}; });
    pending_[slot].request = MPI_REQUEST_NULL;
    return slot;
  }

  // A handle for work already complete: wait() returns at once (MPI_Wait on a null request).
  int finished_request(const char* what) { return static_cast<int>(take_pending(what)); }

  int start_gather(const void* shard, void* full, size_t shard_n, size_t full_n, MPI_Datatype type, size_t bytes,
                   const char* what) {
    SHARD_CHECK(full_n == shard_n * size_, "all_gather %s: full %zu != shard %zu x %d", what, full_n, shard_n, size_);
    SHARD_CHECK(shard == static_cast<const char*>(full) + rank_ * shard_n * bytes, "start_all_gather is in place");
    const size_t slot = take_pending(what);
    bytes_sent_ += static_cast<uint64_t>(size_ - 1) * shard_n * bytes;
    MPI_CHECK(MPI_Iallgather(MPI_IN_PLACE, 0, type, full, checked_count(shard_n), type, comm_, &pending_[slot].request));
    return static_cast<int>(slot);
  }

  // The ring of reduce_scatter_add with 16-bit messages: each hop widens the received partial,
  // adds this rank's fp32 term and rounds again for the next hop.
  template <typename ChunkFn>
  void reduce_scatter_add_16(ChunkFn chunk, float* out, size_t n, DType wire) {
    if (wire_send_.size() < n) grow_exactly(wire_send_, n), grow_exactly(wire_recv_, n);
    const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
    uint16_t *send = wire_send_.data(), *recv = wire_recv_.data();
    const float* first = chunk(rank_ - 1);
#pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; i++) send[i] = float_to_half(first[i], wire);
    for (int s = 0; s < size_ - 1; s++) {
      MPI_CHECK(MPI_Sendrecv(send, checked_count(n), MPI_UINT16_T, next, 0, recv, checked_count(n), MPI_UINT16_T,
                             prev, 0, comm_, MPI_STATUS_IGNORE));
      const float* own = chunk(rank_ - s - 2);
      if (s < size_ - 2) {
#pragma omp parallel for simd schedule(static)
        for (size_t i = 0; i < n; i++) send[i] = float_to_half(half_to_float(recv[i], wire) + own[i], wire);
      } else {
#pragma omp parallel for simd schedule(static)
        for (size_t i = 0; i < n; i++) out[i] += half_to_float(recv[i], wire) + own[i];
      }
    }
  }

  // To exactly n elements: resize alone grows the capacity geometrically (to twice the old size
  // when a larger unit comes after a smaller one, as llama's root after its blocks), and the plan
  // counts n (uncounted_buffer_bytes reports the capacity).
  template <typename T>
  static void grow_exactly(std::vector<T>& v, size_t n) {
    v.reserve(n);
    v.resize(n);
  }

  static void add_into(float* out, const float* in, size_t n) {
#pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; i++) out[i] += in[i];
  }

  MPI_Comm comm_;
  Watchdog* watchdog_;
  std::vector<float> ring_send_, ring_recv_;
  std::vector<uint16_t> wire_send_, wire_recv_;
  struct Pending {
    MPI_Request request = MPI_REQUEST_NULL;
    const char* what = nullptr;  // null: the slot is free
  };
  std::vector<Pending> pending_;
  uint64_t bytes_sent_ = 0;
  int rank_ = 0, size_ = 1;
};

}  // namespace

std::unique_ptr<Comm> make_mpi_comm(MPI_Comm comm, Watchdog* watchdog) {
  return std::make_unique<MpiComm>(comm, watchdog);
}

}  // namespace shardtrain
