// "Operands rounded once" (LayerOps::bind_half_copy): with a 16-bit param_dtype the engine binds
// each gathered unit's 16-bit copy to the ops, so the GEMMs multiply the gathered copy and never
// round a weight again. On 1..4 ranks, every strategy, with and without cpu_offload:
//   - training with the CPU's bf16 GEMMs rounds no weight element (every GEMM weight was found in
//     a bound unit), with either kernel;
//   - oneDNN's kernel, which multiplies the bound copy, and the SGEMMs on rounded operands, which
//     read the fp32 values in place, train to the same losses within fp32 summation error: a copy
//     bound at the wrong place would multiply other weights.
// And the same with bf16 activations (fsdp.activation_dtype), whose saved tensors the model binds
// layer by layer: a stale binding (another layer's copy) would give oneDNN other activations.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <memory>
#include <vector>

#include "backend/cpu/bf16_gemm.hpp"
#include "backend/layer_ops.hpp"
#include "support/mpi_gtest.hpp"
#include "support/training_run.hpp"

using namespace shardtrain;
using shardtrain::testing::all_ranks;
using shardtrain::testing::token_batch;
using shardtrain::testing::TrainingRun;

namespace {

// The small training model's linear layers (support/training_run.hpp: C = 20, V = 37) at its
// 2 x 5 rows: q|k|v, attention and MLP projections, the tied head.
std::unique_ptr<cpu::Bf16Gemm> model_gemm(bool onednn) {
  return std::make_unique<cpu::Bf16Gemm>(std::vector<cpu::LinearShape>{{20, 60}, {20, 20}, {20, 80}, {80, 20}, {20, 37}},
                                         10, onednn);
}

struct Bf16Run {
  std::unique_ptr<cpu::Bf16Gemm> gemm;
  std::unique_ptr<LayerOps<float>> ops;
  Backend backend;
  std::unique_ptr<TrainingRun> run;  // last: destroyed first, so the engine unbinds its units from live ops
  Bf16Run(bool onednn, const EngineOptions& options, DType activation_dtype)
      : gemm(model_gemm(onednn)), ops(make_cpu_bf16_layer_ops(*gemm)) {
    backend = cpu_backend();
    backend.ops = ops.get();
    run = std::make_unique<TrainingRun>(backend, options, shardtrain::testing::host_mpi_comm, activation_dtype);
  }
};

TEST(RoundedOnce, TrainingRoundsNoWeightAndBothKernelsAgree) {
  for (ShardingStrategy strategy : {SHARDING_FULL_SHARD, SHARDING_SHARD_GRAD_OP, SHARDING_NO_SHARD}) {
    for (bool offload : {false, true}) {
      for (int variant = 0; variant < 3; variant++) {  // activations fp32, bf16; bf16 with the shard's copy kept
        const DType activations = variant == 0 ? DTYPE_FP32 : DTYPE_BF16;
        SCOPED_TRACE(::testing::Message() << "activations " << dtype_name(activations) << " keep_half_shard "
                                          << (variant == 2));
        EngineOptions options = TrainingRun::options(offload, false);
        options.strategy = strategy;
        options.param_dtype = options.reduce_dtype = DTYPE_BF16;
        options.keep_half_shard = variant == 2;
        Bf16Run emulated(false, options, activations);
        emulated.run->train(3, 2);
        EXPECT_TRUE(all_ranks(emulated.gemm->weight_elements_rounded() == 0))
            << sharding_strategy_name(strategy) << " offload " << offload << ": "
            << emulated.gemm->weight_elements_rounded() << " weight elements rounded by the SGEMM kernel";
        if (!cpu::Bf16Gemm::native_bf16()) continue;  // oneDNN's kernel would only emulate: not run here
        Bf16Run native(true, options, activations);
        native.run->train(3, 2);
        EXPECT_TRUE(all_ranks(native.gemm->weight_elements_rounded() == 0))
            << sharding_strategy_name(strategy) << " offload " << offload << ": "
            << native.gemm->weight_elements_rounded() << " weight elements rounded by oneDNN's kernel";
        bool close = native.run->losses.size() == emulated.run->losses.size();
        for (size_t s = 0; close && s < native.run->losses.size(); s++)
          close = std::fabs(native.run->losses[s] - emulated.run->losses[s]) <= 1e-5 * std::fabs(emulated.run->losses[s]);
        EXPECT_TRUE(all_ranks(close)) << sharding_strategy_name(strategy) << " offload " << offload << ": loss "
                                      << native.run->losses.back() << " (oneDNN) against "
                                      << emulated.run->losses.back() << " (SGEMM)";
      }
    }
  }
}

// fsdp.keep_half_shard: the shard's 16-bit copy is rounded again only after the masters change. The
// oracle is the same run rounding at every gather: the same bits through optimizer steps with
// gradient accumulation, and after the masters are written again through HostShard (as every
// loader does) in the middle of a run, which stale copies would not see.
TEST(RoundedOnce, TheKeptShardCopyFollowsStepsAndWrites) {
  for (ShardingStrategy strategy : {SHARDING_FULL_SHARD, SHARDING_SHARD_GRAD_OP, SHARDING_NO_SHARD}) {
    for (bool offload : {false, true}) {
      if (offload && strategy == SHARDING_NO_SHARD) continue;
      SCOPED_TRACE(::testing::Message() << sharding_strategy_name(strategy) << " offload " << offload);
      EngineOptions options = TrainingRun::options(offload, false);
      options.strategy = strategy;
      options.forward_prefetch = true;  // a prefetched block: into a buffer that held the other one
      options.param_dtype = DTYPE_BF16;
      Bf16Run every_gather(false, options, DTYPE_BF16);
      options.keep_half_shard = true;
      Bf16Run kept(false, options, DTYPE_BF16);
      every_gather.run->train(3, 2);
      kept.run->train(3, 2);
      EXPECT_TRUE(all_ranks(kept.run->losses == every_gather.run->losses));
      const std::vector<double> before = kept.run->losses;
      std::vector<int> tokens(10, 3), targets(10, 5);
      for (Bf16Run* r : {&every_gather, &kept}) {
        // A forward after the last step gathers every unit (so the kept copies are current), then
        // the masters are written through HostShard, as a loader writes them.
        DeviceArray<double> loss(r->run->engine.compute_device(), 1);
        r->run->engine.eval_micro_batch(r->run->model, token_batch(tokens, targets, 2, 5), loss.data());
        r->run->engine.init_parameters(12);
      }
      every_gather.run->train(2, 2);
      kept.run->train(2, 2);
      EXPECT_TRUE(all_ranks(kept.run->losses == every_gather.run->losses));
      EXPECT_TRUE(all_ranks(kept.run->parameters() == every_gather.run->parameters()));
      EXPECT_NE(kept.run->losses[3], before[2]);  // the new values show
    }
  }
}

}  // namespace
