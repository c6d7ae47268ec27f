// The compute backend of a run (train.device): the host (OpenBLAS + OpenMP, MPI collectives) or
// this rank's GPU (CUDA kernels and cuBLASLt, NCCL collectives on communicators bootstrapped
// over MPI). It owns the device, its operations, and makes the communicators that work on the
// device's memory; the trainer, engine and model are the same for both.
#pragma once

#include <mpi.h>

#include <memory>
#include <string>

#include "backend/layer_ops.hpp"
#include "comm/comm.hpp"
#include "comm/runtime.hpp"

namespace shardtrain {

class Watchdog;

class ComputeBackend {
 public:
  // device: "cpu" or "cuda" (the GPU of node-local rank modulo the visible GPUs). Throws
  // UsageError when this build has no CUDA backend, InputError when no GPU can be used.
  // compute_dtype (fsdp.param_dtype): on a GPU, bf16 or fp16 runs the GEMMs on the tensor cores
  // with operands in that type; the CPU computes in fp32 whatever it is.
  ComputeBackend(const std::string& device, DType compute_dtype, const Runtime& rt);
  ~ComputeBackend();

  const Backend& backend() const { return backend_; }
  bool on_gpu() const { return backend_.device->kind() == DEVICE_CUDA; }
  // A communicator over `comm` on the device's memory: MPI for the host, NCCL for a GPU.
  std::unique_ptr<Comm> make_comm(MPI_Comm comm, Watchdog* watchdog) const;
  // e.g. "cpu" or "cuda:0 NVIDIA H100 80GB HBM3".
  std::string describe() const { return backend_.device->name(); }
  // Dense bf16 tensor-core peak of the GPU in GFLOP/s from its name (0 when unknown or on the host).
  double gpu_peak_gflops() const;
  // Memory free on the GPU now (cudaMemGetInfo), and its total; 0 on the host.
  size_t gpu_free_bytes() const;
  size_t gpu_total_bytes() const;

 private:
  struct Cuda;
  std::unique_ptr<Cuda> cuda_;
  Backend backend_;
};

// True when this build includes the CUDA backend (make CUDA=1).
bool cuda_backend_built();

}  // namespace shardtrain
