// Comm over MPI on a device's buffers, through one host staging buffer (see staged_comm.hpp).
//
// Ordering. The copies run on the device's compute stream. Each collective first copies its
// inputs into the staging buffer with a copy the host waits for (copy_to_host, or queued copies
// and one synchronize()): that wait also covers the previous collective's copy back out of the
// staging buffer, which the device may still be reading, before MPI writes into it. A broadcast
// receiver copies nothing in, so it waits for the device explicitly. The copy back
// (copy_to_device) is queued; compute issued afterwards sees the result, the host does not wait.
#include "comm/staged_comm.hpp"

#include <vector>

#include "backend/device.hpp"
#include "comm/comm_impl.hpp"
#include "core/error.hpp"

namespace shardtrain {
namespace {

class StagedComm final : public Comm {
 public:
  StagedComm(MPI_Comm comm, Watchdog* watchdog, Device& device, Device& host)
      : mpi_(make_mpi_comm(comm, watchdog)), device_(device), host_(host) {
    SHARD_CHECK(host.is_host(), "staging buffers on %s, which is not host memory", host.name());
  }
  ~StagedComm() override { release_staging(); }

  int rank() const override { return mpi_->rank(); }
  int size() const override { return mpi_->size(); }

  void all_gather(Span<const float> shard, Span<float> full, const char* what) override { gather(shard, full, what); }
  void all_gather(Span<const uint16_t> shard, Span<uint16_t> full, const char* what) override {
    gather(shard, full, what);
  }
  void all_gather(Span<const uint8_t> shard, Span<uint8_t> full, const char* what) override { gather(shard, full, what); }
  int start_all_gather(Span<const float> shard, Span<float> full, const char* what) override {
    return start_gather(shard, full, what);
  }
  int start_all_gather(Span<const uint8_t> shard, Span<uint8_t> full, const char* what) override {
    return start_gather(shard, full, what);
  }
  int start_all_gather(Span<const uint16_t> shard, Span<uint16_t> full, const char* what) override {
    return start_gather(shard, full, what);
  }

  void wait(int handle) override {
    SHARD_CHECK(handle >= 0 && handle < static_cast<int>(pending_.size()) && pending_[handle].what,
                "unknown request %d", handle);
    pending_[handle].what = nullptr;  // complete since its start; the slot is free again
  }

  void reduce_scatter_add(Span<const float> full, Span<float> shard, DType wire, const char* what) override {
    SHARD_CHECK(full.size == shard.size * size(), "reduce_scatter %s: full %zu != shard %zu x %d", what, full.size,
                shard.size, size());
    const size_t n = shard.size;
    if (n == 0) return;
    // The shard comes along: the MPI ring adds into it (out += partial + own) in fp32.
    float* staged_full = staging<float>(staging_bytes_reduce_scatter(n, size()));
    float* staged_shard = staged_full + full.size;
    device_.start_copy_to_host(staged_full, full.data, full.size * sizeof(float));
    device_.start_copy_to_host(staged_shard, shard.data, n * sizeof(float));
    device_.synchronize();
    mpi_->reduce_scatter_add(Span<const float>(staged_full, full.size), Span<float>(staged_shard, n), wire, what);
    device_.copy_to_device(shard.data, staged_shard, n * sizeof(float));
  }

  int start_reduce_scatter_add(Span<const float> full, Span<float> shard, DType wire, const char* what) override {
    reduce_scatter_add(full, shard, wire, what);
    return finished_request(what);
  }

  void all_reduce_sum(Span<float> values, const char* what) override {
    all_reduce(values, [&](Span<float> staged) { mpi_->all_reduce_sum(staged, what); });
  }
  void all_reduce_sum(Span<double> values, const char* what) override {
    all_reduce(values, [&](Span<double> staged) { mpi_->all_reduce_sum(staged, what); });
  }
  void all_reduce_max(Span<double> values, const char* what) override {
    all_reduce(values, [&](Span<double> staged) { mpi_->all_reduce_max(staged, what); });
  }

  void broadcast(Span<char> bytes, int root, const char* what) override {
    SHARD_CHECK(root >= 0 && root < size(), "broadcast %s: root %d of %d ranks", what, root, size());
    if (bytes.size == 0 || size() == 1) return;
    char* staged = staging<char>(staging_bytes_all_reduce(bytes.size, 1));
    if (rank() == root)
      device_.copy_to_host(staged, bytes.data, bytes.size);
    else
      device_.synchronize();  // the previous collective's copy out of the staging buffer is done
    mpi_->broadcast(Span<char>(staged, bytes.size), root, what);
    if (rank() != root) device_.copy_to_device(bytes.data, staged, bytes.size);
  }

  void barrier(const char* what) override { mpi_->barrier(what); }

  uint64_t bytes_sent() const override { return mpi_->bytes_sent(); }
  // Allocated from the host device without a DeviceArray, so counted here and nowhere else.
  size_t uncounted_buffer_bytes() const override { return mpi_->uncounted_buffer_bytes() + staging_bytes_; }

 private:
  struct Pending {
    const char* what = nullptr;  // null: the slot is free
  };

  template <typename T>
  void gather(Span<const T> shard, Span<T> full, const char* what) {
    SHARD_CHECK(full.size == shard.size * size(), "all_gather %s: full %zu != shard %zu x %d", what, full.size,
                shard.size, size());
    if (shard.size == 0) return;
    if (size() == 1) {
      if (shard.data != full.data) device_.copy_on_device(full.data, shard.data, shard.size * sizeof(T));
      return;
    }
    // This rank's part into its slot, the MPI gather in place, the whole buffer back.
    T* staged = staging<T>(staging_bytes_all_gather(full.size, sizeof(T)));
    T* own = staged + static_cast<size_t>(rank()) * shard.size;
    device_.copy_to_host(own, shard.data, shard.size * sizeof(T));
    mpi_->all_gather(Span<const T>(own, shard.size), Span<T>(staged, full.size), what);
    device_.copy_to_device(full.data, staged, full.size * sizeof(T));
  }

  template <typename T>
  int start_gather(Span<const T> shard, Span<T> full, const char* what) {
    SHARD_CHECK(shard.data == full.data + static_cast<size_t>(rank()) * shard.size, "start_all_gather is in place");
    gather(shard, full, what);
    return finished_request(what);
  }

  template <typename T, typename Reduce>
  void all_reduce(Span<T> values, Reduce reduce) {
    if (values.size == 0 || size() == 1) return;  // the MPI communicator's result on one rank: the values
    const size_t bytes = staging_bytes_all_reduce(values.size, sizeof(T));
    T* staged = staging<T>(bytes);
    device_.copy_to_host(staged, values.data, bytes);
    reduce(Span<T>(staged, values.size));
    device_.copy_to_device(values.data, staged, bytes);
  }

  int finished_request(const char* what) {
    return static_cast<int>(take_slot(pending_, what, [] { return Pending{}; }));
  }

  // The staging buffer with room for `bytes`: grown to exactly that (the plan counts the largest
  // collective's need, staged_comm.hpp), never shrunk.
  template <typename T>
  T* staging(size_t bytes) {
    if (bytes > staging_bytes_) {
      release_staging();
      staging_ = host_.allocate(bytes);
      staging_bytes_ = bytes;
    }
    return static_cast<T*>(staging_);
  }

  void release_staging() {
    if (!staging_) return;
    device_.synchronize();  // the last copy back may still be reading it
    host_.release(staging_, staging_bytes_);
    staging_ = nullptr;
    staging_bytes_ = 0;
  }

  std::unique_ptr<Comm> mpi_;
  Device& device_;
  Device& host_;
  void* staging_ = nullptr;
  size_t staging_bytes_ = 0;
  std::vector<Pending> pending_;
};

}  // namespace

std::unique_ptr<Comm> make_staged_comm(MPI_Comm comm, Watchdog* watchdog, Device& device, Device& host) {
  return std::make_unique<StagedComm>(comm, watchdog, device, host);
}

}  // namespace shardtrain
