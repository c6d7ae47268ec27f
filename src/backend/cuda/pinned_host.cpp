// Page-locked host memory for fsdp.cpu_offload: the master shards, gradients and moments the
// optimizer steps on the CPU. Page-locked, the copies to and from the GPU run at full PCIe speed
// and asynchronously on the GPU's compute stream, which orders them with the kernels; anything
// the host does to this memory first waits for that stream.
#include <cstring>

#include "backend/cuda/cuda_backend.hpp"
#include "kernels/cuda_check.hpp"

namespace shardtrain {
namespace {

class PinnedHost : public Device {
 public:
  explicit PinnedHost(CudaDevice& gpu) : gpu_(gpu) {}
  // Host memory, page-locked or not: the CPU reads and writes it directly, so is_host() must
  // say so (checkpoints then read the offloaded state in place instead of staging a copy).
  DeviceKind kind() const override { return DEVICE_CPU; }
  const char* name() const override { return "cpu (page-locked)"; }
  void* allocate(size_t bytes) override {
    if (bytes == 0) return nullptr;
    void* p = nullptr;
    if (cudaHostAlloc(&p, bytes, cudaHostAllocPortable) != cudaSuccess) {
      (void)cudaGetLastError();
      // Only training runs allocate here, collectively: one rank's failure aborts them all.
      fatal_input(strprintf("cannot page-lock %zu bytes of host memory (fsdp.cpu_offload's state or "
                            "fsdp.comm_backend=mpi's staging); lower the per-rank state (more ranks, FULL_SHARD) "
                            "or raise the locked-memory limit (ulimit -l)",
                            bytes));
    }
    std::memset(p, 0, bytes);
    return p;
  }
  void release(void* p, size_t) override {
    if (p) CUDA_CHECK(cudaFreeHost(p));
  }
  void zero(void* p, size_t bytes) override {
    gpu_.synchronize();  // a copy from or to this memory may still be in flight
    if (bytes) std::memset(p, 0, bytes);
  }

 protected:
  // Host memory on both sides: the host copies, after the GPU's copies from or to it.
  void transfer(void* dst, const void* src, size_t bytes, CopyKind) override {
    gpu_.synchronize();
    if (bytes) std::memmove(dst, src, bytes);
  }
  void wait_for_work() override { gpu_.synchronize(); }

 private:
  CudaDevice& gpu_;
};

}  // namespace

std::unique_ptr<Device> make_pinned_host(CudaDevice& gpu) { return std::make_unique<PinnedHost>(gpu); }

}  // namespace shardtrain
