// Selection of the compute backend (see compute_backend.hpp). The CUDA half is compiled only
// with SHARDTRAIN_CUDA (make CUDA=1); without it, train.device=cuda is a usage error.
#include "app/compute_backend.hpp"

#include "comm/staged_comm.hpp"
#include "core/error.hpp"
#include "model/config.hpp"

#include <algorithm>
#include <vector>

#ifdef SHARDTRAIN_CUDA
#include "backend/cuda/cuda_backend.hpp"
#include "comm/cuda/nccl_comm.hpp"
#endif

namespace shardtrain {

#ifdef SHARDTRAIN_CUDA
struct ComputeBackend::Cuda {
  std::unique_ptr<CudaDevice> device;
  std::unique_ptr<Device> pinned_host;
  std::unique_ptr<LayerOps<float>> ops;
  std::unique_ptr<ShardOps> shard_ops;
};
bool cuda_backend_built() { return true; }
#else
struct ComputeBackend::Cuda {};
bool cuda_backend_built() { return false; }
#endif

std::vector<cpu::LinearShape> linear_layers(const ModelConfig& m) { return family_of(m).gemm_shapes(m); }

bool cpu_bf16_compute(const std::string& device, DType compute_dtype) {
  return device == "cpu" && compute_dtype == DTYPE_BF16;
}

bool gemms_multiply_half_copies(const ComputeOptions& options) {
  if (options.gpu()) return options.compute_dtype != DTYPE_FP32;
  return cpu_bf16_compute(options.device, options.compute_dtype) && cpu::Bf16Gemm::native_bf16();
}

size_t plan_gemm_workspace_bytes(const std::string& device, DType compute_dtype, const GemmWorkload& workload) {
  return cpu_bf16_compute(device, compute_dtype) ? cpu::Bf16Gemm::plan_workspace_bytes(workload.layers, workload.rows)
                                                 : 0;
}

ComputeBackend::ComputeBackend(const ComputeOptions& options, const Runtime& rt, const GemmWorkload& workload)
    : options_(options) {
  const std::string& device = options.device;
  const DType compute_dtype = options.compute_dtype;
  if (device == "cpu") {
    backend_ = cpu_backend();
    if (cpu_bf16_compute(device, compute_dtype)) {
      cpu_bf16_ = std::make_unique<cpu::Bf16Gemm>(workload.layers, workload.rows);
      cpu_bf16_ops_ = make_cpu_bf16_layer_ops(*cpu_bf16_);
      backend_.ops = cpu_bf16_ops_.get();
    }
    return;
  }
  SHARD_CHECK(device == "cuda", "unknown device '%s' (validated by the options)", device.c_str());
#ifdef SHARDTRAIN_CUDA
  cuda_ = std::make_unique<Cuda>();
  rt.agree_on([&] {
    cuda_->device = CudaDevice::open(rt.local_rank());
    cuda_->pinned_host = make_pinned_host(*cuda_->device);
    cuda_->ops = make_cuda_layer_ops(*cuda_->device, compute_dtype, options.attention_kernel() == ATTENTION_CUDNN);
    cuda_->shard_ops = make_cuda_shard_ops(*cuda_->device);
  });
  // Two ranks on one GPU would make NCCL fail at set-up with an internal error: say it first. (A
  // rank may see one GPU only, e.g. under srun --gpus-per-task=1: compare the GPUs, not counts.)
  // Staged MPI collectives (fsdp.comm_backend=mpi) let ranks share a GPU.
  if (options.nccl()) {
    const std::string mine = cuda_->device->pci_bus_id();
    const std::vector<std::string> ids = rt.node_all_gather(mine);
    rt.agree_on([&] {
      for (int r = 0; r < rt.local_size(); r++)
        if (r != rt.local_rank() && ids[r] == mine)
          throw UsageError(strprintf("train.device=cuda: node-local ranks %d and %d both got GPU %s on %s, which "
                                     "NCCL cannot use; start one rank per GPU (mpirun -np <GPUs per node> per node, "
                                     "or srun --gpus-per-task=1), or set fsdp.comm_backend=mpi to share GPUs",
                                     std::min(r, rt.local_rank()), std::max(r, rt.local_rank()), mine.c_str(),
                                     rt.host().c_str()));
    });
  }
  cuda_->device->abort_on_exhaustion();
  // Offloaded state is host memory (page-locked): the CPU's operations step it.
  backend_ = Backend{cuda_->device.get(),    cuda_->pinned_host.get(), cuda_->ops.get(),
                     cuda_->shard_ops.get(), &cpu_layer_ops<float>(),   &cpu_shard_ops()};
#else
  (void)rt, (void)compute_dtype;
  throw UsageError("train.device=cuda: this build has no CUDA backend; rebuild with 'make CUDA=1' (see docs/gpu.md) "
                   "or use train.device=cpu");
#endif
}

ComputeBackend::~ComputeBackend() = default;

std::string ComputeBackend::gemm_description() const {
  if (cpu_bf16_) return "bf16 operands, fp32 accumulation: " + cpu_bf16_->describe();
  if (on_gpu())
    return options_.compute_dtype == DTYPE_FP32 ? "fp32 (cuBLASLt)"
                                        : std::string(dtype_name(options_.compute_dtype)) + " operands, fp32 accumulation (cuBLASLt)";
  return "fp32 (OpenBLAS)";
}

size_t ComputeBackend::gemm_workspace_bytes() const { return cpu_bf16_ ? cpu_bf16_->workspace_bytes() : 0; }

std::unique_ptr<Comm> ComputeBackend::make_comm(MPI_Comm comm, Watchdog* watchdog) const {
  if (!on_gpu()) return make_mpi_comm(comm, watchdog);
#ifdef SHARDTRAIN_CUDA
  if (options_.nccl()) return make_nccl_comm(comm, *cuda_->device, watchdog);
#endif
  return make_staged_comm(comm, watchdog, *backend_.device, *backend_.host);
}

std::string ComputeBackend::comm_description() const {
  if (!on_gpu()) return "MPI";
  return options_.nccl() ? "NCCL" : "MPI through page-locked host staging (fsdp.comm_backend=mpi)";
}

size_t plan_comm_staging_bytes(const ComputeOptions& compute, const GroupShape& groups,
                               const EngineOptions& engine, const std::vector<UnitLayout>& layout,
                               size_t step_sums_bytes, const std::vector<FrozenLayout>& frozen_layouts) {
  if (!compute.gpu() || compute.nccl()) return 0;
  const size_t gather_elem = engine.param_dtype == DTYPE_FP32 ? sizeof(float) : sizeof(uint16_t);
  size_t shard = 0, replica = 0;
  // The collectives FsdpEngine issues: each space gathered on its own; the trainable space's
  // gradients reduce-scattered over the shard group and all-reduced over the replicas.
  // on_replica: a companion that gathers over the replica group (FrozenLayout).
  auto add_engine = [&](const std::vector<UnitLayout>& units, bool gradients, bool on_replica) {
    size_t& gathers = on_replica ? replica : shard;
    const int gather_ranks = on_replica ? groups.replica_size : groups.shard_size;
    for (const UnitLayout& u : units) {
      if (gather_ranks > 1)
        for (const SpaceLayout* space : {&u.trainable, &u.frozen})
          if (space->numel > 0)
            gathers = std::max(gathers, staging_bytes_all_gather(space->padded_numel, gather_elem));
      if (gather_ranks > 1 && u.quantized.numel > 0)  // its records, bytes
        gathers = std::max(gathers, staging_bytes_all_gather(u.all_records() * u.record_bytes(), 1));
      if (!gradients || u.trainable.numel == 0) continue;
      if (groups.shard_size > 1)
        shard = std::max(shard, staging_bytes_reduce_scatter(u.trainable.shard_numel, groups.shard_size));
      if (groups.replica_size > 1)
        replica = std::max(replica, staging_bytes_all_reduce(u.trainable.shard_numel, sizeof(float)));
    }
  };
  add_engine(layout, !engine.inference, false);
  for (const FrozenLayout& frozen : frozen_layouts) add_engine(frozen.units, false, frozen.on_replica);
  const int world = groups.shard_size * groups.replica_size;
  const size_t step = world > 1 && !engine.cpu_offload
                          ? staging_bytes_all_reduce(step_sums_bytes / sizeof(double), sizeof(double))
                          : 0;
  return shard + replica + step;
}

size_t ComputeBackend::gpu_free_bytes() const {
#ifdef SHARDTRAIN_CUDA
  if (cuda_) return cuda_->device->free_memory();
#endif
  return 0;
}

size_t ComputeBackend::gpu_total_bytes() const {
#ifdef SHARDTRAIN_CUDA
  if (cuda_) return cuda_->device->total_memory();
#endif
  return 0;
}

double ComputeBackend::gpu_peak_gflops() const {
  if (!on_gpu()) return 0;
  // Dense (not 2:4 sparse) bf16 peaks from NVIDIA's data sheets, in GFLOP/s.
  const std::string name = describe();
  struct Card {
    const char* key;
    double gflops;
  };
  static const Card cards[] = {{"H100 PCIe", 756e3}, {"H100 NVL", 835e3}, {"H100", 989e3}, {"H200", 989e3},
                               {"H20", 148e3},       {"A100", 312e3},     {"L40S", 362e3}, {"B200", 2250e3}};
  for (const Card& c : cards)
    if (name.find(c.key) != std::string::npos) return c.gflops;
  return 0;
}

}  // namespace shardtrain
