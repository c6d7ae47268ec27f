// The CUDA backend's entry points, as plain C++ (no CUDA headers), for the host code that picks a
// backend. Built only with `make CUDA=1` (SHARDTRAIN_CUDA defined).
//
//   CudaDevice      one GPU per rank (node-local rank modulo the visible GPUs), its compute
//                   stream, the streams and events of Device's interface, cuBLASLt handle and
//                   workspace, and a caching allocator whose bytes the engine's memory accounting
//                   sees: src/backend/cuda/cuda_device.cpp.
//   LayerOps/ShardOps on that device: src/backend/cuda/cuda_ops.cpp, over the launchers of
//                   kernels/ (hand-written kernels, cuBLASLt GEMMs).
// The NCCL communicator is a layer above (comm/cuda/nccl_comm.hpp): it sees the GPU only through
// Device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "backend/device.hpp"
#include "backend/layer_ops.hpp"

struct CUstream_st;
struct cublasLtContext;

namespace shardtrain {

// True when the CUDA runtime sees at least one GPU; `why` gets the reason when not.
bool cuda_available(std::string* why);

class CudaDevice : public Device {
 public:
  // Selects GPU local_rank % visible GPUs, creates the streams and the cuBLASLt handle.
  // Throws InputError (one line, what to do) when no GPU can be used.
  static std::unique_ptr<CudaDevice> open(int local_rank);
  ~CudaDevice() override;

  DeviceKind kind() const override { return DEVICE_CUDA; }
  const char* name() const override { return name_.c_str(); }
  void* allocate(size_t bytes) override;  // from the cache; cudaMalloc when it has no fit
  void release(void* p, size_t bytes) override;  // back to the cache
  void zero(void* p, size_t bytes) override;
  // Reserved addresses with device memory mapped at their start (the driver's virtual memory).
  void* allocate_backed_prefix(size_t backed, size_t bytes) override;
  void release_backed_prefix(void* p, size_t bytes) override;

  DeviceStream* compute_stream() const override;
  DeviceStream* create_stream(bool urgent) override;
  DeviceEvent* create_event() override;
  void destroy_stream(DeviceStream* stream) override;
  void destroy_event(DeviceEvent* event) override;
  void record(DeviceEvent* event, DeviceStream* stream) override;
  void wait(DeviceStream* stream, DeviceEvent* event) override;
  bool finished(DeviceEvent* event) override;
  DeviceEvent* create_timing_event() override;
  double elapsed_seconds(DeviceEvent* start, DeviceEvent* end) override;
  void bind_thread() override;  // cudaSetDevice(ordinal())

  int ordinal() const { return ordinal_; }
  cublasLtContext* cublaslt() const { return cublaslt_; }
  void* gemm_workspace() const { return workspace_; }
  size_t gemm_workspace_bytes() const { return workspace_bytes_; }
  // Bytes obtained from cudaMalloc and not returned (cached blocks included), and its peak.
  size_t reserved_bytes() const { return reserved_; }
  size_t peak_reserved_bytes() const override { return peak_reserved_; }
  // Device memory of the card, and free right now (cudaMemGetInfo).
  size_t total_memory() const;
  size_t free_memory() const;
  // Returns cached blocks to the driver.
  void empty_cache();
  // From now on running out of memory aborts every rank with exit 2 and the out-of-memory line
  // (fatal_input) instead of throwing: in a multi-rank run one rank's exception cannot be agreed
  // while the others wait in a collective.
  void abort_on_exhaustion() { abort_on_exhaustion_ = true; }
  // The GPU's PCI bus id ("0000:3b:00.0"): the same GPU seen by two ranks has the same one.
  std::string pci_bus_id() const;

 protected:
  void transfer(void* dst, const void* src, size_t bytes, CopyKind kind) override;
  void wait_for_work() override;

 private:
  CudaDevice() = default;
  struct Cache;
  // "out of GPU memory ..." naming the request and what to change: exit 2, or an InputError the
  // caller may catch (abort_on_exhaustion).
  [[noreturn]] void out_of_memory(size_t bytes);
  int ordinal_ = -1;
  std::string name_;
  CUstream_st* compute_ = nullptr;
  cublasLtContext* cublaslt_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  size_t reserved_ = 0, peak_reserved_ = 0;
  bool abort_on_exhaustion_ = false;
  std::unique_ptr<Cache> cache_;
};

// Page-locked host memory whose copies run on `gpu`'s compute stream (fsdp.cpu_offload):
// src/backend/cuda/pinned_host.cpp. Its kind() is DEVICE_CPU: kind() says where the memory is,
// and this is host memory that the CPU reads and writes directly (the offloaded optimizer steps
// it there); page-locking only makes the copies to and from the GPU fast and asynchronous.
std::unique_ptr<Device> make_pinned_host(CudaDevice& gpu);

// Operations on the device's compute stream (src/backend/cuda/cuda_ops.cpp). gemm_operands: bf16
// or fp16 rounds the fp32 operands of every GEMM to it for the tensor cores (fp32 accumulation;
// fsdp.param_dtype on a GPU), fp32 keeps exact fp32 GEMMs.
// cudnn_attention: attention through cuDNN's fused SDPA (cudnn_attention.hpp), the tiled kernels
// for the shapes it has no engine for; else the tiled kernels always.
std::unique_ptr<LayerOps<float>> make_cuda_layer_ops(CudaDevice& device, DType gemm_operands = DTYPE_FP32,
                                                     bool cudnn_attention = false);
std::unique_ptr<ShardOps> make_cuda_shard_ops(CudaDevice& device);

}  // namespace shardtrain
