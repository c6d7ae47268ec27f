// Where the model's and the engine's buffers live and how bytes move between them: host memory
// for the CPU backend, GPU memory from a caching allocator for the CUDA backend. The model, the
// FSDP engine and the optimizer hold every large buffer as a DeviceArray and never touch its
// elements directly unless the device is the host; what they compute on it goes through the
// backend's LayerOps (backend/layer_ops.hpp).
//
// Ordering: every call is ordered after the work already issued to the device's compute stream.
// Copies name their direction (no pointer queries on the way): copy_to_host returns once the
// bytes are there, the others may return earlier. Streams and events (below) let code that queues
// work of its own order it with that stream.
//
// Host synchronizations -- the host waiting for the device's queued work: copy_to_host,
// synchronize(), and the LayerOps reductions that return a value -- are counted (host_syncs()),
// so that a training step can be held to one (docs/architecture.md, "One host synchronization
// per step") on any backend, the host included.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "core/error.hpp"

namespace shardtrain {

// Where a device's memory is, which decides who may touch it: DEVICE_CPU memory is host memory
// that the CPU reads and writes directly (plain or page-locked), DEVICE_CUDA memory is a GPU's.
enum DeviceKind { DEVICE_CPU, DEVICE_CUDA };

// Opaque handles of a device's streams and events (declared, never defined). On a DEVICE_CUDA
// device they are the CUDA runtime's cudaStream_t and cudaEvent_t (backend/cuda/cuda_handles.hpp
// converts), for the libraries that take those (NCCL).
struct DeviceStream;
struct DeviceEvent;

class Device {
 public:
  virtual ~Device() = default;
  virtual DeviceKind kind() const = 0;
  virtual const char* name() const = 0;
  bool is_host() const { return kind() == DEVICE_CPU; }

  // Zero-filled memory for `bytes` (0 gives null). Throws when the device has none left.
  virtual void* allocate(size_t bytes) = 0;
  virtual void release(void* p, size_t bytes) = 0;
  virtual void zero(void* p, size_t bytes) = 0;
  // `bytes` of addresses of which only the first `backed` are memory (zero-filled); an access
  // beyond them faults at once. For a buffer that the ops find by address but never read in full:
  // a gathered unit whose quantized weights exist only as their 16-bit copy
  // (EngineOptions::linear_weights_in_half_only). Devices that cannot leave addresses unbacked say so.
  virtual void* allocate_backed_prefix(size_t backed, size_t bytes) {
    (void)backed, (void)bytes;
    fatal_internal(__FILE__, __LINE__, __func__, strprintf("%s cannot leave addresses unbacked", name()));
  }
  virtual void release_backed_prefix(void* p, size_t bytes) { (void)p, (void)bytes; }

  // ---- copies; `src`/`dst` without "host" are this device's memory ----
  // Into host memory; returns once the bytes are there (a host synchronization).
  void copy_to_host(void* host_dst, const void* src, size_t bytes) {
    count_host_sync();
    transfer(host_dst, src, bytes, COPY_TO_HOST);
  }
  // Into host memory, queued: the bytes are there after the next synchronize(). host_dst must be
  // memory of the backend's host device (Backend::host: page-locked beside a GPU).
  void start_copy_to_host(void* host_dst, const void* src, size_t bytes) {
    transfer(host_dst, src, bytes, COPY_TO_HOST_QUEUED);
  }
  // From host memory, which the caller may reuse once the call returns.
  void copy_to_device(void* dst, const void* host_src, size_t bytes) { transfer(dst, host_src, bytes, COPY_TO_DEVICE); }
  void copy_on_device(void* dst, const void* src, size_t bytes) { transfer(dst, src, bytes, COPY_ON_DEVICE); }
  // Returns when all work issued to the device so far has finished (a host synchronization).
  void synchronize() {
    count_host_sync();
    wait_for_work();
  }
  // Times the host has waited for this device (the list above); for the per-step check.
  uint64_t host_syncs() const { return host_syncs_; }
  void count_host_sync() { host_syncs_++; }
  // The most memory this device has held from its allocator at once (a GPU's caching allocator:
  // what the card had to provide); 0 where nobody counts (the host).
  virtual size_t peak_reserved_bytes() const { return 0; }

  // ---- streams and events ----
  // For work queued on streams of its own that must be ordered against the compute stream (the
  // NCCL communicator's collectives). A stream runs its work in order; an event marks the work
  // queued on a stream so far. The host runs everything in program order and has no streams:
  // compute_stream() is null there and the other calls fail.
  virtual DeviceStream* compute_stream() const { return nullptr; }
  // `urgent`: scheduled ahead of queued compute work where the device can (work that other
  // ranks wait on).
  virtual DeviceStream* create_stream(bool urgent) { no_streams(); }
  virtual DeviceEvent* create_event() { no_streams(); }
  // Teardown, best effort (never fails): destroy_stream first waits for the stream's work.
  virtual void destroy_stream(DeviceStream* stream) { no_streams(); }
  virtual void destroy_event(DeviceEvent* event) { no_streams(); }
  // Marks the work queued on `stream` so far.
  virtual void record(DeviceEvent* event, DeviceStream* stream) { no_streams(); }
  // Work queued on `stream` from now on runs after the work `event` marks; the host does not wait.
  virtual void wait(DeviceStream* stream, DeviceEvent* event) { no_streams(); }
  // True once the work `event` marks has finished; never waits.
  virtual bool finished(DeviceEvent* event) { no_streams(); }
  // Events that also take the time at which the device reaches them (create_event's do not, which
  // keeps those cheap), and the seconds between two such events; waits until `end` is reached.
  virtual DeviceEvent* create_timing_event() { no_streams(); }
  virtual double elapsed_seconds(DeviceEvent* start, DeviceEvent* end) { no_streams(); }
  // Makes this the device that the calling thread's runtime calls address (a thread of its own
  // that queries events, say); nothing on the host.
  virtual void bind_thread() {}

  // What the DeviceArrays on this device hold now and held at most: counted at allocation, not
  // planned, so the memory plan can be checked against it.
  size_t live_bytes() const { return live_bytes_; }
  size_t peak_live_bytes() const { return peak_live_bytes_; }
  void count_allocation(size_t bytes) {
    live_bytes_ += bytes;
    if (live_bytes_ > peak_live_bytes_) peak_live_bytes_ = live_bytes_;
  }
  void count_release(size_t bytes) { live_bytes_ -= bytes; }
  // Forgets a transient's peak (the trainer's start-up GEMM probe): the peak is from now on.
  void restart_peak_count() { peak_live_bytes_ = live_bytes_; }

 protected:
  enum CopyKind { COPY_TO_HOST, COPY_TO_HOST_QUEUED, COPY_TO_DEVICE, COPY_ON_DEVICE };
  virtual void transfer(void* dst, const void* src, size_t bytes, CopyKind kind) = 0;
  virtual void wait_for_work() = 0;

 private:
  [[noreturn]] void no_streams() const {
    fatal_internal(__FILE__, __LINE__, __func__, strprintf("%s has no streams: its work runs in program order", name()));
  }
  size_t live_bytes_ = 0, peak_live_bytes_ = 0;
  uint64_t host_syncs_ = 0;
};

// The host: plain zeroed heap memory, memcpy.
Device& host_device();

// A fixed-size array of T on a device. Not copyable; moves transfer ownership.
template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  DeviceArray(Device& device, size_t n) : device_(&device), size_(n), backed_(n) {
    data_ = static_cast<T*>(device.allocate(n * sizeof(T)));
    device.count_allocation(bytes());
  }
  // n elements of addresses, only the first `backed` of them memory (Device::allocate_backed_prefix).
  DeviceArray(Device& device, size_t n, size_t backed) : device_(&device), size_(n), backed_(std::min(backed, n)) {
    data_ = static_cast<T*>(backed_ < n ? device.allocate_backed_prefix(bytes(), n * sizeof(T))
                                        : device.allocate(n * sizeof(T)));
    device.count_allocation(bytes());
  }
  ~DeviceArray() { reset(); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  DeviceArray(DeviceArray&& o) noexcept { *this = std::move(o); }
  DeviceArray& operator=(DeviceArray&& o) noexcept {
    if (this != &o) {
      reset();
      std::swap(device_, o.device_);
      std::swap(data_, o.data_);
      std::swap(size_, o.size_);
      std::swap(backed_, o.backed_);
    }
    return *this;
  }

  T* data() { return data_; }
  const T* data() const { return data_; }
  size_t size() const { return size_; }
  // The memory behind it: all its elements unless made with a backed prefix.
  size_t bytes() const { return backed_ * sizeof(T); }
  Device* device() const { return device_; }
  bool on_host() const { return device_ == nullptr || device_->is_host(); }

  // Element access and iteration only for arrays in host memory.
  T& operator[](size_t i) { return data_[i]; }
  const T& operator[](size_t i) const { return data_[i]; }
  T* begin() { return data_; }
  T* end() { return data_ + size_; }
  const T* begin() const { return data_; }
  const T* end() const { return data_ + size_; }

  void zero() {
    if (size_) device_->zero(data_, bytes());
  }
  void reset() {
    if (data_ && backed_ < size_) device_->release_backed_prefix(data_, size_ * sizeof(T));
    else if (data_) device_->release(data_, bytes());
    if (data_) device_->count_release(bytes());
    data_ = nullptr;
    size_ = backed_ = 0;
  }

 private:
  Device* device_ = nullptr;
  T* data_ = nullptr;
  size_t size_ = 0, backed_ = 0;
};

}  // namespace shardtrain
