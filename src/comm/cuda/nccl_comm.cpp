// Comm over NCCL on device buffers: the CUDA backend's shard and replica communicators. Same
// semantics as comm/mpi_comm.cpp (read it first); this file is about streams, events and hangs.
//
// The GPU is seen only through Device (backend/device.hpp): its memory, and the streams and events
// below (created, recorded and waited through Device; their CUDA handles passed to NCCL).
//
// Streams. Collectives run on this communicator's own non-blocking stream. Every call first
// records an event on the device's compute stream and makes the communication stream wait for
// it, so a collective sees all compute work issued before the call. A blocking call then records
// an event on the communication stream and makes the compute stream wait for it, so compute
// work issued after the call sees the result; the host itself does not wait. A started
// all-gather records its own event, and wait(handle) makes the compute stream wait for that one:
// the gather overlaps whatever compute is issued in between. Because every use of a buffer by
// the communication stream is joined back into the compute stream before the caller can release
// it, the device's caching allocator (ordered on the compute stream alone) may hand the buffer
// out again at once. The host learns results only through the device (copy into host memory).
//
// Host memory. broadcast and barrier serve the trainer's host data and go through MPI on the same
// ranks; the all-reduces accept host spans too (e.g. scalars summed on the host) and send them
// through MPI. Device spans go through NCCL. all-gathers and reduce-scatters take device memory
// only. Either way the watchdog times the call.
//
// Hangs and errors. The communicator is nonblocking (config.blocking = 0): no NCCL call can
// block the host inside NCCL. After a call answers ncclInProgress (set-up, lazy connection on
// first use) the host polls ncclCommGetAsyncError until the communicator is ready again. With a
// watchdog (timeout > 0), a monitor thread polls every 10 ms: the completion event of each queued
// collective (oldest first: one stream runs them in order), the event recorded just before it
// (the moment it actually starts on the GPU, after the compute it waited for), and
// ncclCommGetAsyncError. A collective still running `timeout` seconds after it started, a
// set-up poll longer than `timeout`, or any asynchronous NCCL error aborts the communicator
// (ncclCommAbort, which releases the GPU) and every rank (fatal_internal -> MPI_Abort) with a
// message naming the collective. Cost: two event records per collective and a thread that
// wakes every 10 ms; the host never blocks on a collective. Every NCCL call on the
// communicator holds `mutex_`, so the abort never runs beside another NCCL call.
//
// reduce_scatter_add with a 16-bit wire: the fp32 full buffer is rounded to bf16/fp16 on the
// device (kernels' launch_to_half) with this rank's own chunk set to zero, ncclReduceScatter sums the other ranks' terms
// in 16 bits, and shard += widen(sum) + own chunk in fp32: as in the MPI ring, values travel
// and partial sums round in 16 bits while this rank's own term and the accumulation stay fp32
// (on one rank the result is the MPI one bit for bit; on more, NCCL's reduction order is its own).
// The scratch buffers (16-bit copies, the received chunk) come from the device and are kept
// for the next call; they grow to the largest unit seen.
#include <cuda_runtime.h>
#include <nccl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "comm/cuda/nccl_comm.hpp"
#include "backend/cuda/cuda_handles.hpp"
#include "backend/device.hpp"
#include "comm/comm_impl.hpp"
#include "comm/cuda/nccl_check.hpp"
#include "comm/watchdog.hpp"
#include "core/error.hpp"
#include "kernels/comm_kernels.hpp"
#include "kernels/cuda_check.hpp"
#include "kernels/launch.hpp"

namespace shardtrain {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Memory the GPU can use as a NCCL buffer: cudaMalloc'ed or managed.
bool is_device_memory(const void* p) {
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged;
}

class NcclComm final : public Comm {
 public:
  NcclComm(MPI_Comm comm, Device& device, Watchdog* watchdog)
      : mpi_comm_(comm), device_(device), compute_(device.compute_stream()), watchdog_(watchdog) {
    SHARD_CHECK(device.kind() == DEVICE_CUDA, "a NCCL communicator on %s, not a GPU", device.name());
    MPI_CHECK(MPI_Comm_rank(mpi_comm_, &rank_));
    MPI_CHECK(MPI_Comm_size(mpi_comm_, &size_));
    rank_label_ = rank_label();
    timeout_ = watchdog_ ? watchdog_->timeout_seconds() : 0;
    device_.bind_thread();
    int ordinal = 0;
    CUDA_CHECK(cudaGetDevice(&ordinal));
    CUDA_CHECK(cudaDeviceGetAttribute(&launch_.sm_count, cudaDevAttrMultiProcessorCount, ordinal));
    ncclUniqueId id{};
    if (rank_ == 0) NCCL_CHECK(ncclGetUniqueId(&id));
    {
      Watchdog::Scope scope(watchdog_, "broadcast(NCCL unique id)");
      MPI_CHECK(MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, mpi_comm_));
    }
    // No barrier after the broadcast: ncclCommInitRankConfig waits for every rank itself, and
    // the set-up poll below bounds that wait by the watchdog's timeout.
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      enqueue_locked(ncclCommInitRankConfig(&comm_, size_, id, rank_, &config), "ncclCommInitRankConfig",
                     "set-up (ncclCommInitRankConfig)");
    }
    settle("set-up (ncclCommInitRankConfig)");
    // Urgent: a collective's blocks are scheduled ahead of queued compute blocks, so a ring that
    // peers are waiting on is not held up behind this rank's kernels.
    stream_ = device_.create_stream(/*urgent=*/true);
    launch_.stream = cuda_stream(stream_);
    compute_ready_ = device_.create_event();
    comm_done_ = device_.create_event();
    if (timeout_ > 0) monitor_ = std::thread([this] { monitor_loop(); });
  }

  ~NcclComm() override {
    if (monitor_.joinable()) {
      stop_ = true;
      monitor_.join();
    }
    // Finalize flushes what is still queued (an all-gather that was started and never waited is
    // the caller's bug, but must not hang us), then the communicator is freed.
    {
      std::lock_guard<std::mutex> lock(mutex_);
      enqueue_locked(ncclCommFinalize(comm_), "ncclCommFinalize", "tear-down (ncclCommFinalize)");
    }
    settle("tear-down (ncclCommFinalize)");
    {
      std::lock_guard<std::mutex> lock(mutex_);
      enqueue_locked(ncclCommDestroy(comm_), "ncclCommDestroy", "tear-down (ncclCommDestroy)");
      comm_ = nullptr;
    }
    // The scratch buffers go back to the device's cache when the members die: destroy_stream
    // first waits for the stream's work, their last use. Teardown is best effort.
    device_.destroy_stream(stream_);
    for (auto& pair : spare_events_) device_.destroy_event(pair.first), device_.destroy_event(pair.second);
    for (auto& watch : watches_) device_.destroy_event(watch.start), device_.destroy_event(watch.done);
    for (auto& pending : pending_) device_.destroy_event(pending.done);
    device_.destroy_event(compute_ready_);
    device_.destroy_event(comm_done_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void all_gather(Span<const float> shard, Span<float> full, const char* what) override {
    gather(shard.data, full.data, shard.size, full.size, sizeof(float), what, nullptr);
  }

  void all_gather(Span<const uint16_t> shard, Span<uint16_t> full, const char* what) override {
    gather(shard.data, full.data, shard.size, full.size, sizeof(uint16_t), what, nullptr);
  }

  void all_gather(Span<const uint8_t> shard, Span<uint8_t> full, const char* what) override {
    gather(shard.data, full.data, shard.size, full.size, 1, what, nullptr);
  }

  int start_all_gather(Span<const float> shard, Span<float> full, const char* what) override {
    return start_gather(shard.data, full.data, shard.size, full.size, sizeof(float), what);
  }

  int start_all_gather(Span<const uint8_t> shard, Span<uint8_t> full, const char* what) override {
    return start_gather(shard.data, full.data, shard.size, full.size, 1, what);
  }

  int start_all_gather(Span<const uint16_t> shard, Span<uint16_t> full, const char* what) override {
    return start_gather(shard.data, full.data, shard.size, full.size, sizeof(uint16_t), what);
  }

  void wait(int handle) override {
    SHARD_CHECK(handle >= 0 && handle < static_cast<int>(pending_.size()) && pending_[handle].what,
                "unknown request %d", handle);
    settle(pending_[handle].what);
    device_.wait(compute_, pending_[handle].done);
    pending_[handle].what = nullptr;  // the slot is free again
  }

  uint64_t bytes_sent() const override { return bytes_sent_; }

  void reduce_scatter_add(Span<const float> full, Span<float> shard, DType wire, const char* what) override {
    reduce_scatter(full, shard, wire, what);
    join();
  }

  // Queued like the blocking one; the compute stream goes on until wait(handle) joins it.
  int start_reduce_scatter_add(Span<const float> full, Span<float> shard, DType wire, const char* what) override {
    const size_t slot = take_pending(what);
    reduce_scatter(full, shard, wire, what);
    device_.record(pending_[slot].done, stream_);
    return static_cast<int>(slot);
  }

  // Bytes are counted as comm/mpi_comm.cpp counts them (the fp32 all-reduce only).
  void all_reduce_sum(Span<float> values, const char* what) override {
    bytes_sent_ += 2 * (size_ - 1) * values.size * sizeof(float) / size_;
    all_reduce(values.data, values.size, ncclFloat32, ncclSum, MPI_FLOAT, MPI_SUM, what);
  }

  void all_reduce_sum(Span<double> values, const char* what) override {
    all_reduce(values.data, values.size, ncclFloat64, ncclSum, MPI_DOUBLE, MPI_SUM, what);
  }

  void all_reduce_max(Span<double> values, const char* what) override {
    all_reduce(values.data, values.size, ncclFloat64, ncclMax, MPI_DOUBLE, MPI_MAX, what);
  }

  void broadcast(Span<char> bytes, int root, const char* what) override {
    SHARD_CHECK(root >= 0 && root < size_, "broadcast %s: root %d of %d ranks", what, root, size_);
    if (bytes.size == 0) return;
    if (!is_device_memory(bytes.data)) {
      Watchdog::Scope scope(watchdog_, what);
      MPI_CHECK(MPI_Bcast(bytes.data, checked_count(bytes.size), MPI_CHAR, root, mpi_comm_));
      return;
    }
    begin(what);
    enqueue("ncclBroadcast", what,
            [&] { return ncclBroadcast(bytes.data, bytes.data, bytes.size, ncclUint8, root, comm_, nccl_stream()); });
    finish(what);
    join();
  }

  // Host-side: orders the ranks, not the GPUs' queued work.
  void barrier(const char* what) override {
    Watchdog::Scope scope(watchdog_, what);
    MPI_CHECK(MPI_Barrier(mpi_comm_));
  }

 private:
  // One queued collective, for the monitor: `start` is recorded just before it on the
  // communication stream, `done` just after.
  struct Watch {
    DeviceEvent *start = nullptr, *done = nullptr;
    const char* what = nullptr;
    bool started = false;
    Clock::time_point started_at;
  };
  struct Pending {
    DeviceEvent* done = nullptr;
    const char* what = nullptr;  // null: the slot is free
  };

  void gather(const void* shard, void* full, size_t shard_n, size_t full_n, size_t elem_bytes, const char* what,
              Pending* pending) {
    SHARD_CHECK(full_n == shard_n * size_, "all_gather %s: full %zu != shard %zu x %d", what, full_n, shard_n, size_);
    const size_t bytes = shard_n * elem_bytes;
    if (bytes) {
      require_device(shard, what, "shard");
      require_device(full, what, "full");
    }
    bytes_sent_ += static_cast<uint64_t>(size_ - 1) * bytes;
    begin(what);
    // Raw bytes: no arithmetic, so one NCCL type serves fp32 and every 16-bit format. In place
    // when shard is this rank's slot of full, which NCCL recognises.
    if (bytes)
      enqueue("ncclAllGather", what,
              [&] { return ncclAllGather(shard, full, bytes, ncclUint8, comm_, nccl_stream()); });
    finish(what);
    if (pending) {
      device_.record(pending->done, stream_);
    } else {
      join();
    }
  }

  // Queues a reduce-scatter into `shard` on the communication stream (see the file comment).
  void reduce_scatter(Span<const float> full, Span<float> shard, DType wire, const char* what) {
    SHARD_CHECK(full.size == shard.size * size_, "reduce_scatter %s: full %zu != shard %zu x %d", what, full.size,
                shard.size, size_);
    const size_t n = shard.size;
    if (n == 0) return;
    require_device(full.data, what, "full");
    require_device(shard.data, what, "shard");
    bytes_sent_ += static_cast<uint64_t>(size_ - 1) * n * dtype_bytes(wire);
    const size_t own_begin = static_cast<size_t>(rank_) * n;  // this rank's chunk of full
    // Growing a scratch buffer returns the old one to the compute-stream-ordered cache: first
    // make the compute stream wait for the started reductions that may still use it.
    auto grow = [&](auto& buffer, size_t size) {
      using Array = std::decay_t<decltype(buffer)>;
      if (buffer.size() >= size) return;
      join();
      buffer = Array(device_, size);  // before begin(): its zero-fill is compute work
    };
    if (wire == DTYPE_FP32) {
      grow(chunk_, n);
      begin(what);
      enqueue("ncclReduceScatter(fp32)", what,
              [&] { return ncclReduceScatter(full.data, chunk_.data(), n, ncclFloat32, ncclSum, comm_, nccl_stream()); });
      launch_comm_add(shard.data, chunk_.data(), n, launch_);
    } else {
      grow(wire_full_, full.size);
      grow(wire_chunk_, n);
      begin(what);
      kernels::launch_to_half(wire_full_.data(), full.data, full.size, wire, launch_, own_begin, own_begin + n);
      const ncclDataType_t type = wire == DTYPE_BF16 ? ncclBfloat16 : ncclFloat16;
      enqueue("ncclReduceScatter(16-bit)", what, [&] {
        return ncclReduceScatter(wire_full_.data(), wire_chunk_.data(), n, type, ncclSum, comm_, nccl_stream());
      });
      launch_comm_add_from_wire(shard.data, wire_chunk_.data(), full.data + own_begin, n, wire, launch_);
    }
    finish(what);
  }

  // A free slot of pending_ for a started collective named `what`.
  size_t take_pending(const char* what) {
    return take_slot(pending_, what, [&] { return Pending{device_.create_event(), nullptr}; });
  }

  int start_gather(const void* shard, void* full, size_t shard_n, size_t full_n, size_t elem_bytes, const char* what) {
    SHARD_CHECK(full_n == shard_n * size_, "all_gather %s: full %zu != shard %zu x %d", what, full_n, shard_n, size_);
    SHARD_CHECK(shard == static_cast<const char*>(full) + rank_ * shard_n * elem_bytes, "start_all_gather is in place");
    const size_t slot = take_pending(what);
    gather(shard, full, shard_n, full_n, elem_bytes, what, &pending_[slot]);
    return static_cast<int>(slot);
  }

  void all_reduce(void* values, size_t n, ncclDataType_t type, ncclRedOp_t op, MPI_Datatype mpi_type, MPI_Op mpi_op,
                  const char* what) {
    if (n == 0) return;
    if (!is_device_memory(values)) {
      Watchdog::Scope scope(watchdog_, what);
      MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, values, checked_count(n), mpi_type, mpi_op, mpi_comm_));
      return;
    }
    begin(what);
    enqueue("ncclAllReduce", what, [&] { return ncclAllReduce(values, values, n, type, op, comm_, nccl_stream()); });
    finish(what);
    join();
  }

  void require_device(const void* p, const char* what, const char* which) const {
    SHARD_CHECK(is_device_memory(p), "%s: the %s buffer %p is not device memory (NCCL collectives need GPU buffers)",
                what, which, p);
  }

  // The communication stream waits for the compute stream's work issued so far; with a monitor,
  // the collective's start event follows.
  void begin(const char* what) {
    settle(what);
    device_.record(compute_ready_, compute_);
    device_.wait(stream_, compute_ready_);
    if (!monitor_.joinable()) return;
    std::lock_guard<std::mutex> lock(mutex_);
    if (spare_events_.empty()) spare_events_.emplace_back(device_.create_event(), device_.create_event());
    current_ = Watch{spare_events_.back().first, spare_events_.back().second, what, false, {}};
    spare_events_.pop_back();
    device_.record(current_.start, stream_);
  }

  // Hands the collective queued since begin() to the monitor.
  void finish(const char* what) {
    if (!monitor_.joinable()) return;
    std::lock_guard<std::mutex> lock(mutex_);
    device_.record(current_.done, stream_);
    watches_.push_back(current_);
  }

  // The compute stream waits for everything queued on the communication stream.
  void join() {
    device_.record(comm_done_, stream_);
    device_.wait(compute_, comm_done_);
  }

  // Makes the NCCL call `call` under the lock; waits out an in-progress answer.
  template <typename Call>
  void enqueue(const char* statement, const char* what, Call&& call) {
    ncclResult_t rc;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      rc = call();
      enqueue_locked(rc, statement, what);
    }
    if (rc == ncclInProgress) settle(what);
  }

  // `rc` is the answer of a NCCL call made under the lock: success and in-progress are fine.
  void enqueue_locked(ncclResult_t rc, const char* statement, const char* what) {
    if (rc == ncclSuccess || rc == ncclInProgress) return;
    fail_locked(what, strprintf("%s: %s (%s)", statement, ncclGetErrorString(rc), ncclGetLastError(comm_)));
  }

  // Returns when no NCCL call is in progress on the communicator; fails on an asynchronous error
  // or when that takes longer than the timeout.
  void settle(const char* what) {
    const Clock::time_point since = Clock::now();
    for (int polls = 0;; polls++) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (check_state_locked(what) == ncclSuccess) return;
        if (timeout_ > 0 && seconds_since(since) > timeout_)
          fail_locked(what, strprintf("NCCL was still busy after fsdp.comm_timeout=%g s: another rank is stalled or "
                                      "dead (raise fsdp.comm_timeout if set-up is legitimately this slow)",
                                      timeout_));
      }
      if (polls < 100) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
  }

  // ncclSuccess or ncclInProgress; fails on anything else.
  ncclResult_t check_state_locked(const char* what) {
    ncclResult_t state = ncclSuccess;
    ncclResult_t rc = ncclCommGetAsyncError(comm_, &state);
    if (rc != ncclSuccess)
      fail_locked(what, strprintf("ncclCommGetAsyncError: %s (%s)", ncclGetErrorString(rc), ncclGetLastError(comm_)));
    if (state != ncclSuccess && state != ncclInProgress)
      fail_locked(what,
                  strprintf("asynchronous NCCL error: %s (%s)", ncclGetErrorString(state), ncclGetLastError(comm_)));
    return state;
  }

  void monitor_loop() {
    device_.bind_thread();
    while (!stop_) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      std::lock_guard<std::mutex> lock(mutex_);
      check_state_locked(watches_.empty() ? "communicator (between collectives)" : watches_.front().what);
      while (!watches_.empty()) {
        if (!device_.finished(watches_.front().done)) break;
        spare_events_.emplace_back(watches_.front().start, watches_.front().done);
        watches_.pop_front();
      }
      if (watches_.empty()) continue;
      Watch& running = watches_.front();  // one stream: only the oldest can be running
      if (!running.started) {
        if (!device_.finished(running.start)) continue;
        running.started = true;
        running.started_at = Clock::now();
      }
      if (seconds_since(running.started_at) > timeout_)
        fail_locked(running.what, strprintf("collective did not complete within fsdp.comm_timeout=%g s: another rank "
                                            "is stalled or dead (raise fsdp.comm_timeout if steps are legitimately "
                                            "this slow)",
                                            timeout_));
    }
  }

  // Aborts the communicator (the GPU stops waiting for peers), then every rank. Holds mutex_, so
  // no other NCCL call of this process runs beside the abort; a second failing thread waits on
  // the lock until MPI_Abort ends the process. The reason is printed before the abort too: the
  // abort releases a main thread stuck in cudaStreamSynchronize, whose own (less telling) fatal
  // error may reach MPI_Abort first.
  [[noreturn]] void fail_locked(const char* what, const std::string& why) {
    const std::string message = strprintf("NCCL %s on rank %d of %d: %s", what, rank_, size_, why.c_str());
    std::fprintf(stderr, "%s %s; aborting the NCCL communicator\n", rank_label_.c_str(), message.c_str());
    std::fflush(stderr);
    if (comm_) (void)ncclCommAbort(comm_);
    fatal_internal(__FILE__, __LINE__, __func__, message + "; NCCL communicator aborted, aborting all ranks");
  }

  // NCCL takes the communication stream as the runtime's handle.
  cudaStream_t nccl_stream() const { return cuda_stream(stream_); }

  MPI_Comm mpi_comm_;
  Device& device_;
  DeviceStream* compute_;
  Watchdog* watchdog_;
  std::string rank_label_;  // "[rank r/N host]" in MPI_COMM_WORLD, as core/error.cpp prints it
  double timeout_ = 0;      // seconds; 0: no bound
  int rank_ = 0, size_ = 1;
  uint64_t bytes_sent_ = 0;

  ncclComm_t comm_ = nullptr;
  DeviceStream* stream_ = nullptr;
  kernels::LaunchContext launch_;  // the communication stream, for the wire kernels
  DeviceEvent *compute_ready_ = nullptr, *comm_done_ = nullptr;
  std::vector<Pending> pending_;
  DeviceArray<float> chunk_;
  DeviceArray<uint16_t> wire_full_, wire_chunk_;

  // Shared with the monitor thread, under mutex_ (as is every NCCL call on comm_).
  std::mutex mutex_;
  std::deque<Watch> watches_;
  std::vector<std::pair<DeviceEvent*, DeviceEvent*>> spare_events_;
  Watch current_;
  std::atomic<bool> stop_{false};
  std::thread monitor_;
};

}  // namespace

std::unique_ptr<Comm> make_nccl_comm(MPI_Comm comm, Device& device, Watchdog* watchdog) {
  return std::make_unique<NcclComm>(comm, device, watchdog);
}

}  // namespace shardtrain
