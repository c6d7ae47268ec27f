// The one communication interface the engine and optimizer use: typed spans in, element counts
// derived here, never at call sites.
//
// Contract ("collective discipline", docs/architecture.md): every rank of the communicator calls the same
// collectives in the same order with the same sizes. `what` names the collective for the
// watchdog's message; pass a string literal. The MPI implementation (below) works on host
// buffers; the NCCL one (comm/cuda/nccl_comm.hpp, built with CUDA=1) on a GPU's buffers.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "backend/dtype.hpp"

namespace shardtrain {

class Watchdog;

template <typename T>
struct Span {
  T* data = nullptr;
  size_t size = 0;
  Span() = default;
  Span(T* d, size_t n) : data(d), size(n) {}
  template <typename U>
  Span(std::vector<U>& v) : data(v.data()), size(v.size()) {}
  template <typename U>
  Span(const std::vector<U>& v) : data(v.data()), size(v.size()) {}
  template <typename U>
  Span(const Span<U>& other) : data(other.data), size(other.size) {}
  T& operator[](size_t i) const { return data[i]; }
};

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // full.size == shard.size * size(); rank r's shard lands at full[r*shard.size ...].
  // shard may alias that slot of full (in-place gather).
  virtual void all_gather(Span<const float> shard, Span<float> full, const char* what) = 0;
  virtual void all_gather(Span<const uint16_t> shard, Span<uint16_t> full, const char* what) = 0;
  // Bytes: the records of quantized frozen parameters (backend/quant.hpp).
  virtual void all_gather(Span<const uint8_t> shard, Span<uint8_t> full, const char* what) = 0;
  // Non-blocking all-gathers for prefetching: the buffers must stay untouched until wait(handle).
  // Every rank starts and waits for them in the same order.
  virtual int start_all_gather(Span<const float> shard, Span<float> full, const char* what) = 0;
  virtual int start_all_gather(Span<const uint16_t> shard, Span<uint16_t> full, const char* what) = 0;
  virtual int start_all_gather(Span<const uint8_t> shard, Span<uint8_t> full, const char* what) = 0;
  virtual void wait(int handle) = 0;
  // shard += sum over ranks of their full[rank()*shard.size ...]; full.size == shard.size * size().
  // Accumulating into the shard saves the gradient-accumulation pass and a shard-sized buffer.
  // wire bf16/fp16: values travel, and partial sums are rounded, in 16 bits; each rank's own
  // term and the final accumulation stay fp32.
  virtual void reduce_scatter_add(Span<const float> full, Span<float> shard, DType wire, const char* what) = 0;
  // The same, started: `full` must stay untouched and `shard` unread until wait(handle), which
  // every rank calls in the same order. NCCL runs it on the communication stream while the
  // device computes on; MPI (no asynchronous progress in Open MPI 4.1) completes it here.
  virtual int start_reduce_scatter_add(Span<const float> full, Span<float> shard, DType wire, const char* what) = 0;
  // Elementwise over ranks, in place.
  virtual void all_reduce_sum(Span<float> values, const char* what) = 0;
  virtual void all_reduce_sum(Span<double> values, const char* what) = 0;
  virtual void all_reduce_max(Span<double> values, const char* what) = 0;
  virtual void broadcast(Span<char> bytes, int root, const char* what) = 0;
  virtual void barrier(const char* what) = 0;
  // Bytes this rank has sent through collectives so far: exact for the ring reduce-scatter, the
  // ring/Bruck volume (n-1)/n of the gathered buffer for all-gathers, 2(n-1)/n for all-reduces.
  virtual uint64_t bytes_sent() const = 0;
  // Bytes of the communicator's own working buffers that no DeviceArray counts (the MPI ring's
  // chunk buffers, host vectors kept from call to call); 0 where they come from the device.
  virtual size_t uncounted_buffer_bytes() const { return 0; }
};

// An MPI communicator on host memory. `watchdog` (may be null) times every blocking collective.
std::unique_ptr<Comm> make_mpi_comm(MPI_Comm comm, Watchdog* watchdog);

}  // namespace shardtrain

namespace shardtrain {

// A stand-in with the rank and size of `real` that moves no data: all-gathers leave the other
// ranks' parts as they are, reduce-scatters add only this rank's own chunk. Results are wrong;
// timing a step with it against the real communicator measures the exposed communication time.
std::unique_ptr<Comm> make_silent_comm(const Comm& real);

}  // namespace shardtrain
