// CudaDevice: one GPU per rank, its compute stream, Device's streams and events (CUDA streams and
// events), the cuBLASLt handle and GEMM workspace (gpu::kCublasLtWorkspaceBytes), and a caching
// allocator. Not the layer math (cuda_ops.cpp, kernels/) and not communication (comm/cuda/).
//
// Ordering: everything this file queues (zero-fill, memset, copies) goes on the compute stream,
// in issue order with the kernels; the host waits only where the Device contract needs a host
// result (a copy into host memory) or asks for it (synchronize).
//
// The allocator keeps released blocks for reuse instead of returning them to the driver: cudaMalloc
// and cudaFree cost tens of microseconds to milliseconds, and cudaFree synchronizes the whole
// device. Requests are rounded up to a size class (gpu::allocator_block_bytes; the classes are
// backend/gpu_memory.hpp's, which the memory plan uses too), and a request takes the smallest
// cached block of at least its class that wastes at most 1/8 of it; blocks are never split or
// merged. A block released to the cache may be handed out again at once: its old and new users
// are both ordered on the compute stream, so the new user's work runs after the old one's. Work on
// another stream (the NCCL stream) must be joined back into the compute stream before its buffers
// are released, which comm/cuda/nccl_comm.cpp does. The allocator is driven by one host thread
// and is not thread-safe.
#include <algorithm>
#include <cstdint>
#include <map>
#include <cstdio>
#include <type_traits>
#include <unordered_map>

#include <cuda.h>
#include <cudaTypedefs.h>

#include "backend/cuda/cuda_backend.hpp"
#include "backend/cuda/cuda_handles.hpp"
#include "backend/gpu_memory.hpp"
#include "core/format.hpp"
#include "kernels/cuda_check.hpp"

namespace shardtrain {

struct CudaDevice::Cache {
  std::multimap<size_t, void*> free_blocks;  // cached: block bytes -> block
  std::unordered_map<void*, size_t> in_use;  // handed out: block -> block bytes
  // allocate_backed_prefix's ranges: the driver's reservation and the memory mapped at its start,
  // or (fallback) a block of the allocator backing it all.
  struct Prefix {
    size_t reserved = 0, mapped = 0;
    CUmemGenericAllocationHandle handle = 0;
    bool fallback = false;
  };
  std::unordered_map<void*, Prefix> prefixes;
};

namespace {

// The driver's virtual memory calls, found through the runtime (the binary does not link
// libcuda: it starts, and says "no GPU", where the driver is absent).
struct VirtualMemoryCalls {
  PFN_cuMemGetAllocationGranularity_v10020 granularity = nullptr;
  PFN_cuMemAddressReserve_v10020 reserve = nullptr;
  PFN_cuMemAddressFree_v10020 free = nullptr;
  PFN_cuMemCreate_v10020 create = nullptr;
  PFN_cuMemRelease_v10020 release = nullptr;
  PFN_cuMemMap_v10020 map = nullptr;
  PFN_cuMemUnmap_v10020 unmap = nullptr;
  PFN_cuMemSetAccess_v10020 set_access = nullptr;
  bool ok = false;
};

const VirtualMemoryCalls& virtual_memory_calls() {
  static const VirtualMemoryCalls calls = [] {
    VirtualMemoryCalls c;
    auto find = [](const char* symbol, auto* fn) {
      cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
      void* p = nullptr;
      if (cudaGetDriverEntryPointByVersion(symbol, &p, 10020, cudaEnableDefault, &found) != cudaSuccess ||
          found != cudaDriverEntryPointSuccess) {
        (void)cudaGetLastError();
        return false;
      }
      *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(p);
      return true;
    };
    c.ok = find("cuMemGetAllocationGranularity", &c.granularity) && find("cuMemAddressReserve", &c.reserve) &&
           find("cuMemAddressFree", &c.free) && find("cuMemCreate", &c.create) && find("cuMemRelease", &c.release) &&
           find("cuMemMap", &c.map) && find("cuMemUnmap", &c.unmap) && find("cuMemSetAccess", &c.set_access);
    return c;
  }();
  return calls;
}

}  // namespace

bool cuda_available(std::string* why) {
  int count = 0;
  cudaError_t rc = cudaGetDeviceCount(&count);
  if (rc != cudaSuccess) {
    (void)cudaGetLastError();
    if (why) *why = strprintf("the CUDA runtime found no usable GPU: %s", cudaGetErrorString(rc));
    return false;
  }
  if (count == 0) {
    if (why) *why = "the CUDA runtime sees no GPU (check CUDA_VISIBLE_DEVICES and the job's GPU request)";
    return false;
  }
  if (why) why->clear();
  return true;
}

std::unique_ptr<CudaDevice> CudaDevice::open(int local_rank) {
  std::string why;
  if (!cuda_available(&why)) throw InputError(why + "; run on a GPU node, or use train.device=cpu");
  int count = 0;
  CUDA_CHECK(cudaGetDeviceCount(&count));
  std::unique_ptr<CudaDevice> device(new CudaDevice());
  device->ordinal_ = local_rank % count;
  CUDA_CHECK(cudaSetDevice(device->ordinal_));
  cudaDeviceProp properties{};
  CUDA_CHECK(cudaGetDeviceProperties(&properties, device->ordinal_));
  device->name_ = strprintf("cuda:%d %s", device->ordinal_, properties.name);
  device->cache_ = std::make_unique<Cache>();
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  device->compute_ = stream;
  cublasLtHandle_t handle = nullptr;
  CUBLAS_CHECK(cublasLtCreate(&handle));
  device->cublaslt_ = handle;
  device->workspace_ = device->allocate(gpu::kCublasLtWorkspaceBytes);
  device->workspace_bytes_ = gpu::kCublasLtWorkspaceBytes;
  return device;
}

// Teardown is best effort and ignores errors: a broken context has already been reported by the
// call that broke it, and a destructor must not turn an exit-2 unwinding into an abort.
CudaDevice::~CudaDevice() {
  if (compute_) (void)cudaStreamSynchronize(compute_);
  if (cache_) {
    for (auto& block : cache_->free_blocks) (void)cudaFree(block.second);
    // Blocks still handed out (the workspace, arrays that outlive the device) die with it.
    for (auto& block : cache_->in_use) (void)cudaFree(block.first);
  }
  if (cublaslt_) (void)cublasLtDestroy(cublaslt_);
  if (compute_) (void)cudaStreamDestroy(compute_);
}

void CudaDevice::out_of_memory(size_t bytes) {
  const std::string message = strprintf(
      "out of GPU memory on %s: allocating %zu bytes (%s) failed with %s reserved by this rank, %s free "
      "of %s; use a smaller train.micro_batch, fsdp.activation_checkpointing=true, "
      "fsdp.sharding_strategy=FULL_SHARD or fsdp.cpu_offload=true ('shardtrain plan' lists what fits)",
      name_.c_str(), bytes, human_bytes(static_cast<double>(bytes)).c_str(),
      human_bytes(static_cast<double>(reserved_)).c_str(), human_bytes(static_cast<double>(free_memory())).c_str(),
      human_bytes(static_cast<double>(total_memory())).c_str());
  if (abort_on_exhaustion_) fatal_input(message);
  throw InputError(message);
}

void* CudaDevice::allocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  const size_t request = gpu::allocator_block_bytes(bytes);  // SIZE_MAX where rounding overflows
  void* p = nullptr;
  size_t block_bytes = 0;
  auto fit = cache_->free_blocks.lower_bound(request);
  if (fit != cache_->free_blocks.end() && fit->first - request <= request / 8) {
    p = fit->second;
    block_bytes = fit->first;
    cache_->free_blocks.erase(fit);
  } else {
    cudaError_t rc = request == SIZE_MAX ? cudaErrorMemoryAllocation : cudaMalloc(&p, request);
    if (rc == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // not sticky, but it would stay the "last error" for the next launch check
      empty_cache();
      rc = request == SIZE_MAX ? cudaErrorMemoryAllocation : cudaMalloc(&p, request);
      if (rc == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        out_of_memory(bytes);
      }
    }
    CUDA_CHECK(rc);
    block_bytes = request;
    reserved_ += block_bytes;
    peak_reserved_ = std::max(peak_reserved_, reserved_);
  }
  cache_->in_use.emplace(p, block_bytes);
  CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, compute_));
  return p;
}

std::string CudaDevice::pci_bus_id() const {
  char id[32] = "";
  CUDA_CHECK(cudaDeviceGetPCIBusId(id, sizeof id, ordinal_));
  return id;
}

void CudaDevice::release(void* p, size_t bytes) {
  if (!p) return;
  auto block = cache_->in_use.find(p);
  SHARD_CHECK(block != cache_->in_use.end(), "release of %zu bytes at %p, which %s did not allocate", bytes, p,
              name_.c_str());
  SHARD_CHECK(bytes <= block->second, "release of %zu bytes at %p, a block of %zu bytes", bytes, p, block->second);
  cache_->free_blocks.emplace(block->second, p);
  cache_->in_use.erase(block);
}

void CudaDevice::empty_cache() {
  if (cache_->free_blocks.empty()) return;
  // cudaFree waits for the device anyway; cached blocks may still be read by queued work.
  CUDA_CHECK(cudaStreamSynchronize(compute_));
  for (auto& block : cache_->free_blocks) {
    CUDA_CHECK(cudaFree(block.second));
    reserved_ -= block.first;
  }
  cache_->free_blocks.clear();
}

void CudaDevice::transfer(void* dst, const void* src, size_t bytes, CopyKind kind) {
  if (bytes == 0) return;
  // The direction is the caller's (no pointer query per copy). From host memory the call may
  // return before the transfer ends, as the Device contract allows: the runtime stages a
  // pageable source before returning, and a page-locked source stays untouched until the stream
  // gets there (backend/cuda/pinned_host.cpp waits first).
  const cudaMemcpyKind direction = kind == COPY_TO_DEVICE  ? cudaMemcpyHostToDevice
                                   : kind == COPY_ON_DEVICE ? cudaMemcpyDeviceToDevice
                                                            : cudaMemcpyDeviceToHost;
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, direction, compute_));
  if (kind == COPY_TO_HOST) CUDA_CHECK(cudaStreamSynchronize(compute_));  // the caller reads the bytes next
}

// The driver reserves `bytes` of addresses and maps physical memory at the start of them, rounded
// up to its granularity (2 MiB on current GPUs); the rest stays unmapped, and a kernel that touches
// it stops with an illegal address. Where the driver lacks these calls the allocator's block backs
// it all, said once.
void* CudaDevice::allocate_backed_prefix(size_t backed, size_t bytes) {
  const VirtualMemoryCalls& vm = virtual_memory_calls();
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = ordinal_;
  size_t granularity = 0;
  if (!vm.ok || vm.granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS ||
      granularity == 0) {
    static bool warned = false;
    if (!warned)
      std::fprintf(stderr, "warning: %s: the driver cannot map memory into reserved addresses; the gathered "
                   "fp32 buffers are fully backed (more memory than planned)\n", name_.c_str());
    warned = true;
    void* p = allocate(bytes);
    cache_->prefixes[p] = Cache::Prefix{bytes, 0, 0, true};
    return p;
  }
  static bool coarser_warned = false;
  if (granularity > gpu::kMappedGranule && !coarser_warned) {
    std::fprintf(stderr, "warning: %s maps memory in %zu-byte granules; the memory plan counted %zu: each gathered "
                 "fp32 buffer may hold up to %zu bytes more than planned\n", name_.c_str(), granularity,
                 gpu::kMappedGranule, granularity - gpu::kMappedGranule);
    coarser_warned = true;
  }
  auto round = [granularity](size_t n) { return (n + granularity - 1) / granularity * granularity; };
  Cache::Prefix prefix{round(bytes), round(backed), 0, false};
  CUdeviceptr address = 0;
  auto check = [&](CUresult rc, const char* call) {
    if (rc == CUDA_SUCCESS) return;
    fatal_internal(__FILE__, __LINE__, __func__,
                   strprintf("%s failed (CUresult %d) for %zu of %zu bytes on %s", call, static_cast<int>(rc), backed,
                             bytes, name_.c_str()));
  };
  check(vm.reserve(&address, prefix.reserved, 0, 0, 0), "cuMemAddressReserve");
  if (prefix.mapped) {
    CUresult rc = vm.create(&prefix.handle, prefix.mapped, &prop, 0);
    if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
      empty_cache();  // the cache's blocks are memory the driver could map
      rc = vm.create(&prefix.handle, prefix.mapped, &prop, 0);
    }
    if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
      (void)vm.free(address, prefix.reserved);
      out_of_memory(backed);
    }
    check(rc, "cuMemCreate");
    check(vm.map(address, prefix.mapped, 0, prefix.handle, 0), "cuMemMap");
    CUmemAccessDesc access{};
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    check(vm.set_access(address, prefix.mapped, &access, 1), "cuMemSetAccess");
    reserved_ += prefix.mapped;
    peak_reserved_ = std::max(peak_reserved_, reserved_);
  }
  void* p = reinterpret_cast<void*>(address);
  cache_->prefixes[p] = prefix;
  zero(p, backed);
  return p;
}

void CudaDevice::release_backed_prefix(void* p, size_t bytes) {
  auto it = cache_->prefixes.find(p);
  SHARD_CHECK(it != cache_->prefixes.end(), "release of %zu bytes at %p, which %s did not reserve", bytes, p,
              name_.c_str());
  const Cache::Prefix prefix = it->second;
  cache_->prefixes.erase(it);
  if (prefix.fallback) return release(p, bytes);
  // Unmapping frees the memory at once: queued work on any stream that reads it must finish first.
  // Best effort, as teardown is: a broken context has no work left to wait for.
  if (cudaDeviceSynchronize() != cudaSuccess) (void)cudaGetLastError();
  const VirtualMemoryCalls& vm = virtual_memory_calls();
  const CUdeviceptr address = reinterpret_cast<CUdeviceptr>(p);
  if (prefix.mapped) {
    (void)vm.unmap(address, prefix.mapped);
    (void)vm.release(prefix.handle);
    reserved_ -= prefix.mapped;
  }
  (void)vm.free(address, prefix.reserved);
}

void CudaDevice::zero(void* p, size_t bytes) {
  if (bytes == 0) return;
  CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, compute_));
}

void CudaDevice::wait_for_work() { CUDA_CHECK(cudaStreamSynchronize(compute_)); }

DeviceStream* CudaDevice::compute_stream() const { return device_stream(compute_); }

DeviceStream* CudaDevice::create_stream(bool urgent) {
  // A lower number is a higher priority; "greatest" is the most urgent the device offers.
  int least_priority = 0, greatest_priority = 0;
  CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least_priority, &greatest_priority));
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, urgent ? greatest_priority : least_priority));
  return device_stream(stream);
}

DeviceEvent* CudaDevice::create_event() {
  cudaEvent_t event = nullptr;
  CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  return device_event(event);
}

DeviceEvent* CudaDevice::create_timing_event() {
  cudaEvent_t event = nullptr;
  CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDefault));
  return device_event(event);
}

double CudaDevice::elapsed_seconds(DeviceEvent* start, DeviceEvent* end) {
  CUDA_CHECK(cudaEventSynchronize(cuda_event(end)));
  float ms = 0;
  CUDA_CHECK(cudaEventElapsedTime(&ms, cuda_event(start), cuda_event(end)));
  return ms / 1e3;
}

// Best effort, as the destructor: teardown must not turn an exit-2 unwinding into an abort.
void CudaDevice::destroy_stream(DeviceStream* stream) {
  (void)cudaStreamSynchronize(cuda_stream(stream));
  (void)cudaStreamDestroy(cuda_stream(stream));
}

void CudaDevice::destroy_event(DeviceEvent* event) { (void)cudaEventDestroy(cuda_event(event)); }

void CudaDevice::record(DeviceEvent* event, DeviceStream* stream) {
  CUDA_CHECK(cudaEventRecord(cuda_event(event), cuda_stream(stream)));
}

void CudaDevice::wait(DeviceStream* stream, DeviceEvent* event) {
  CUDA_CHECK(cudaStreamWaitEvent(cuda_stream(stream), cuda_event(event), 0));
}

bool CudaDevice::finished(DeviceEvent* event) {
  const cudaError_t rc = cudaEventQuery(cuda_event(event));
  if (rc == cudaErrorNotReady) return false;
  CUDA_CHECK(rc);
  return true;
}

void CudaDevice::bind_thread() { CUDA_CHECK(cudaSetDevice(ordinal_)); }

size_t CudaDevice::total_memory() const {
  size_t free_bytes = 0, total_bytes = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  return total_bytes;
}

size_t CudaDevice::free_memory() const {
  size_t free_bytes = 0, total_bytes = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  return free_bytes;
}

}  // namespace shardtrain
