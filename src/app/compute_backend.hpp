// The compute backend of a run (train.device): the host (OpenBLAS + OpenMP, MPI collectives) or
// this rank's GPU (CUDA kernels and cuBLASLt; collectives by NCCL on communicators bootstrapped
// over MPI, or with fsdp.comm_backend=mpi by host MPI through page-locked staging buffers). It
// owns the device, its operations, and makes the communicators that work on the device's memory;
// the trainer, engine and model are the same for both.
#pragma once

#include <mpi.h>

#include <memory>
#include <string>
#include <vector>

#include "app/compute_options.hpp"
#include "backend/cpu/bf16_gemm.hpp"
#include "backend/layer_ops.hpp"
#include "comm/comm.hpp"
#include "comm/runtime.hpp"
#include "shard/fsdp_engine.hpp"

namespace shardtrain {

class Watchdog;
struct ModelConfig;

// What the CPU's bf16 GEMMs (backend/cpu/bf16_gemm.hpp) are sized for: the linear layers of the
// models a run multiplies (the trained one's and its frozen companions') and their input rows.
struct GemmWorkload {
  std::vector<cpu::LinearShape> layers;
  int rows = 0;
};
// Every linear layer's weight shape, the LM head included (not the adapters' low-rank products).
std::vector<cpu::LinearShape> linear_layers(const ModelConfig& model);
// True where fsdp.param_dtype makes the host compute its GEMMs in bf16: bf16 on train.device=cpu.
bool cpu_bf16_compute(const std::string& device, DType compute_dtype);
// The workspace bytes the backend allocates for `workload` at start-up (the plan's "workspace"):
// the CPU's bf16 operand copies and oneDNN's scratchpad, 0 where it computes in fp32.
size_t plan_gemm_workspace_bytes(const std::string& device, DType compute_dtype, const GemmWorkload& workload);
// The page-locked host bytes the staged communicators (fsdp.comm_backend=mpi on a GPU,
// comm/staged_comm.hpp) hold at most, 0 for any other run: each communicator keeps one buffer
// for its largest collective -- the shard group's largest parameter gather or gradient
// reduce-scatter (of the trained model's `layout` and the gathers of its frozen companions'
// `frozen_layouts`: a teacher's, a text encoder's; on the replica group where one takes that as its
// shard group), the replica group's largest gradient all-reduce, and the step's sums
// (`step_sums_bytes`) over the world of shard x replica ranks (the trainer's step communicator,
// made unless fsdp.cpu_offload). What they hold is measured by Comm::uncounted_buffer_bytes.
// A frozen companion's units, gathered on the trained model's shard communicator or (on_replica) on
// its replica one.
struct FrozenLayout {
  std::vector<UnitLayout> units;
  bool on_replica = false;
};
size_t plan_comm_staging_bytes(const ComputeOptions& compute, const GroupShape& groups,
                               const EngineOptions& engine, const std::vector<UnitLayout>& layout,
                               size_t step_sums_bytes, const std::vector<FrozenLayout>& frozen_layouts = {});

class ComputeBackend {
 public:
  // options.device: "cpu" or "cuda" (the GPU of node-local rank modulo the visible GPUs). Throws
  // UsageError when this build has no CUDA backend, InputError when no GPU can be used.
  // options.compute_dtype (fsdp.param_dtype): on a GPU, bf16 or fp16 runs the GEMMs on the tensor
  // cores with operands in that type; on the CPU bf16 runs the linear layers' GEMMs in bf16 with
  // fp32 accumulation (oneDNN), sized for `workload`; fp16 is a storage and wire format there.
  ComputeBackend(const ComputeOptions& options, const Runtime& rt, const GemmWorkload& workload = {});
  ~ComputeBackend();

  const Backend& backend() const { return backend_; }
  const ComputeOptions& options() const { return options_; }
  bool on_gpu() const { return backend_.device->kind() == DEVICE_CUDA; }
  // A communicator over `comm` on the device's memory: MPI for the host; for a GPU NCCL, or with
  // fsdp.comm_backend=mpi host MPI through page-locked staging buffers (comm/staged_comm.hpp).
  std::unique_ptr<Comm> make_comm(MPI_Comm comm, Watchdog* watchdog) const;
  // Which communicators make_comm makes, for the start line: "NCCL", "MPI through page-locked host
  // staging (fsdp.comm_backend=mpi)" or "MPI".
  std::string comm_description() const;
  // e.g. "cpu" or "cuda:0 NVIDIA H100 80GB HBM3".
  std::string describe() const { return backend_.device->name(); }
  // The GEMMs' arithmetic for the start line: "fp32 (OpenBLAS)", "bf16 operands, fp32
  // accumulation (oneDNN 2.6.3 bf16 matmul)", ...
  std::string gemm_description() const;
  // Bytes the GEMMs' workspace holds now (the plan's "workspace" on the CPU).
  size_t gemm_workspace_bytes() const;
  // Whether the host multiplies in bf16 (fsdp.param_dtype=bf16 on the CPU), and whether with the
  // CPU's bf16 dot products (oneDNN) rather than SGEMMs on the rounded operands.
  bool cpu_bf16_gemms() const { return cpu_bf16_ != nullptr; }
  bool cpu_bf16_dot_products() const { return cpu_bf16_ && cpu_bf16_->onednn(); }
  // Dense bf16 tensor-core peak of the GPU in GFLOP/s from its name (0 when unknown or on the host).
  double gpu_peak_gflops() const;
  // Memory free on the GPU now (cudaMemGetInfo), and its total; 0 on the host.
  size_t gpu_free_bytes() const;
  size_t gpu_total_bytes() const;

 private:
  struct Cuda;
  std::unique_ptr<Cuda> cuda_;
  std::unique_ptr<cpu::Bf16Gemm> cpu_bf16_;
  std::unique_ptr<LayerOps<float>> cpu_bf16_ops_;
  ComputeOptions options_;
  Backend backend_;
};

// True when this build includes the CUDA backend (make CUDA=1).
bool cuda_backend_built();

}  // namespace shardtrain
