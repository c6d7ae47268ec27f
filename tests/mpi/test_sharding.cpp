// Multi-rank properties of Comm and the FULL_SHARD engine, run on 1..4 ranks.
// Collectives are checked with small integers, which every reduction order sums exactly (==).
// The engine is checked against the unsharded model: the gradient gathered from the shards must
// equal the sum over ranks of each rank's unsharded micro-batch gradient, computed here by every
// rank for all ranks' data (float; tolerance from summation order, see kGradRtol).
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "comm/comm.hpp"
#include "model/families/gpt2/gpt2_model.hpp"
#include "shard/fsdp_engine.hpp"
#include "support/model_fixtures.hpp"
#include "support/mpi_gtest.hpp"

using namespace shardtrain;
using shardtrain::testing::all_ranks;
using shardtrain::testing::token_batch;

namespace {

ModelConfig awkward_model() {
  ModelConfig c;
  c.n_layer = 2;
  c.n_embd = 20;  // unit sizes that 3 does not divide: uneven padding
  c.n_head = 2;
  c.vocab_size = 37;
  c.max_seq_len = 9;
  return c;
}

void fill_tokens(std::vector<int>& v, int rank, int vocab, int salt) {
  for (size_t i = 0; i < v.size(); i++) v[i] = static_cast<int>((i * 7 + rank * 13 + salt * 5 + 3) % vocab);
}

}  // namespace

TEST(Comm, AllGatherPlacesEachShardExactly) {
  auto comm = make_mpi_comm(MPI_COMM_WORLD, nullptr);
  const int n = comm->size(), r = comm->rank();
  for (size_t shard : {size_t(1), size_t(5), size_t(1000)}) {
    std::vector<float> mine(shard), full(shard * n, -1.0f);
    for (size_t i = 0; i < shard; i++) mine[i] = static_cast<float>(r * 10000 + i);
    comm->all_gather(Span<const float>(mine), Span<float>(full), "test");
    bool ok = true;
    for (int q = 0; q < n; q++)
      for (size_t i = 0; i < shard; i++) ok &= full[q * shard + i] == static_cast<float>(q * 10000 + i);
    EXPECT_TRUE(all_ranks(ok)) << "shard " << shard;
  }
}

TEST(Comm, ReduceScatterAddsTheRankSumExactly) {
  auto comm = make_mpi_comm(MPI_COMM_WORLD, nullptr);
  const int n = comm->size(), r = comm->rank();
  for (size_t shard : {size_t(1), size_t(7), size_t(100003)}) {
    std::vector<float> full(shard * n), mine(shard, 1000.0f);  // the shard accumulates onto 1000
    for (size_t i = 0; i < full.size(); i++) full[i] = static_cast<float>((r + 1) * (i % 11));
    for (int repeat = 0; repeat < 2; repeat++)
      comm->reduce_scatter_add(Span<const float>(full), Span<float>(mine), DTYPE_FP32, "test");
    bool ok = true;
    const float rank_sum = n * (n + 1) / 2.0f;
    for (size_t i = 0; i < shard; i++) ok &= mine[i] == 1000.0f + 2 * rank_sum * ((r * shard + i) % 11);
    EXPECT_TRUE(all_ranks(ok)) << "shard " << shard;
  }
}

// Integers below 256 are exact in bf16 and fp16, so even 16-bit partial sums must be exact.
TEST(Comm, ReduceScatterIn16BitWireIsExactOnSmallIntegers) {
  auto comm = make_mpi_comm(MPI_COMM_WORLD, nullptr);
  const int n = comm->size(), r = comm->rank();
  const size_t shard = 1001;
  for (DType wire : {DTYPE_BF16, DTYPE_FP16}) {
    std::vector<float> full(shard * n), mine(shard, 0.5f);
    for (size_t i = 0; i < full.size(); i++) full[i] = static_cast<float>((r + 1) * (i % 7));
    uint64_t before = comm->bytes_sent();
    comm->reduce_scatter_add(Span<const float>(full), Span<float>(mine), wire, "test");
    bool ok = comm->bytes_sent() - before == static_cast<uint64_t>(n - 1) * shard * 2;
    const float rank_sum = n * (n + 1) / 2.0f;
    for (size_t i = 0; i < shard; i++) ok &= mine[i] == 0.5f + rank_sum * ((r * shard + i) % 7);
    EXPECT_TRUE(all_ranks(ok)) << dtype_name(wire);
  }
}

TEST(Comm, AllGatherOf16BitValues) {
  auto comm = make_mpi_comm(MPI_COMM_WORLD, nullptr);
  const int n = comm->size(), r = comm->rank();
  std::vector<uint16_t> mine(13), full(13 * n);
  for (size_t i = 0; i < mine.size(); i++) mine[i] = static_cast<uint16_t>(r * 1000 + i);
  comm->all_gather(Span<const uint16_t>(mine), Span<uint16_t>(full), "test");
  bool ok = true;
  for (int q = 0; q < n; q++)
    for (size_t i = 0; i < 13; i++) ok &= full[q * 13 + i] == q * 1000 + i;
  EXPECT_TRUE(all_ranks(ok));
}

TEST(Engine, InitializationIsIndependentOfRankCount) {
  ParamTable table(awkward_model());
  MemoryTracker mem_world, mem_self;
  auto world = make_mpi_comm(MPI_COMM_WORLD, nullptr);
  auto self = make_mpi_comm(MPI_COMM_SELF, nullptr);
  FsdpEngine sharded(table, *world, *self, mem_world, {}, cpu_backend());
  FsdpEngine whole(table, *self, *self, mem_self, {}, cpu_backend());
  sharded.init_parameters(42);
  whole.init_parameters(42);
  bool ok = true;
  for (size_t u = 0; u < table.units().size(); u++) {
    std::vector<float> a = sharded.gather_unit(static_cast<int>(u), false);
    std::vector<float> b = whole.gather_unit(static_cast<int>(u), false);
    ok &= a == b;
  }
  EXPECT_TRUE(all_ranks(ok));
}

TEST(Engine, ShardedGradientEqualsSumOfUnshardedGradients) {
  const ModelConfig cfg = awkward_model();
  ParamTable table(cfg);
  MemoryTracker memory;
  auto comm = make_mpi_comm(MPI_COMM_WORLD, nullptr);
  auto self = make_mpi_comm(MPI_COMM_SELF, nullptr);
  const int n = comm->size(), r = comm->rank();
  const int B = 2, T = 5;
  FsdpEngine engine(table, *comm, *self, memory, {}, cpu_backend());
  engine.init_parameters(7);
  GptModel<float> model(table, B, T, false, cpu_layer_ops<float>());
  std::vector<int> tokens(B * T), targets(B * T);
  const float dloss = 1.0f / (B * T * n);
  // Two micro-batches, so the shard gradients also accumulate.
  double local_loss = 0;
  for (int micro = 0; micro < 2; micro++) {
    fill_tokens(tokens, r, cfg.vocab_size, micro);
    fill_tokens(targets, r + 100, cfg.vocab_size, micro);
    engine.train_micro_batch(model, token_batch(tokens, targets, B, T), dloss, &local_loss);  // host memory: the device
  }
  engine.finish_step();

  // Oracle: every rank's data through the unsharded model, gradients summed in rank order.
  std::vector<std::vector<float>> units, grads;
  for (size_t u = 0; u < table.units().size(); u++) {
    units.push_back(engine.gather_unit(static_cast<int>(u), false));
    grads.emplace_back(units.back().size(), 0.0f);
  }
  std::vector<const float*> unit_ptrs;
  std::vector<float*> grad_ptrs;
  for (size_t u = 0; u < units.size(); u++) unit_ptrs.push_back(units[u].data()), grad_ptrs.push_back(grads[u].data());
  GptModel<float> reference(table, B, T, false, cpu_layer_ops<float>());
  double oracle_loss_of_this_rank = 0;
  for (int q = 0; q < n; q++) {
    for (int micro = 0; micro < 2; micro++) {
      fill_tokens(tokens, q, cfg.vocab_size, micro);
      fill_tokens(targets, q + 100, cfg.vocab_size, micro);
      double l = forward_backward_unsharded(reference, table, unit_ptrs, grad_ptrs, token_batch(tokens, targets, B, T), dloss);
      if (q == r) oracle_loss_of_this_rank += l;
    }
  }
  // Float sums of 2n micro-batch gradients in a different order: relative error ~ 2n * 2^-24
  // per element; 1e-5 relative plus 1e-7 absolute (elements that nearly cancel) is ample.
  const double kGradRtol = 1e-5, kGradAtol = 1e-7;
  bool ok = std::fabs(local_loss - oracle_loss_of_this_rank) <= 1e-6 * std::fabs(oracle_loss_of_this_rank);
  double worst = 0;
  for (size_t u = 0; u < units.size(); u++) {
    std::vector<float> g = engine.gather_unit(static_cast<int>(u), true);
    for (size_t i = 0; i < g.size(); i++) {
      double err = std::fabs(g[i] - grads[u][i]), limit = kGradAtol + kGradRtol * std::fabs(grads[u][i]);
      worst = std::max(worst, err / limit);
      ok &= err <= limit;
    }
  }
  EXPECT_TRUE(all_ranks(ok)) << "worst error / threshold on rank " << r << ": " << worst;
}

// Frozen parameters (train.freeze): the engine shards a unit's trainable and frozen parameters as
// two spaces and keeps gradients for the trainable one only. Oracle: the unsharded model of the
// same values with nothing frozen; each trainable parameter's gathered gradient must equal its
// gradient there, and frozen ones have none (zeros), for units mixed, wholly frozen and untouched,
// under the options that move gradients differently.
TEST(Engine, FrozenParametersGetNoGradientAndTheOthersTheirsUnchanged) {
  const ModelConfig cfg = awkward_model();
  const ParamTable whole(cfg);
  auto comm = make_mpi_comm(MPI_COMM_WORLD, nullptr);
  auto self = make_mpi_comm(MPI_COMM_SELF, nullptr);
  const int n = comm->size(), r = comm->rank();
  const int B = 2, T = 5;
  const std::vector<std::vector<std::string>> freezes = {
      {"wpe", "h.0.ln_1.*", "h.1.mlp.fc.weight"},  // mixed units
      {"h.0.*"},                                   // a whole block
      {"wte", "wpe"},                              // the embeddings and with them the tied head
      {"wte", "wpe", "h.0.*"},                     // the backward stops above h.0
  };
  std::vector<EngineOptions> options(4);
  options[1].strategy = SHARDING_SHARD_GRAD_OP;
  options[2].reduce_every_microbatch = false;
  options[3].forward_prefetch = true, options[3].limit_all_gathers = 3;
  bool ok = true;
  std::string failure;
  for (const auto& freeze : freezes) {
    const ParamTable table(cfg, freeze);
    for (const EngineOptions& o : options) {
      MemoryTracker memory;
      FsdpEngine engine(table, *comm, *self, memory, o, cpu_backend());
      engine.init_parameters(7);
      GptModel<float> model(table, B, T, false, cpu_layer_ops<float>());
      std::vector<int> tokens(B * T), targets(B * T);
      const float dloss = 1.0f / (B * T * n);
      for (int micro = 0; micro < 2; micro++) {
        fill_tokens(tokens, r, cfg.vocab_size, micro);
        fill_tokens(targets, r + 100, cfg.vocab_size, micro);
        double loss = 0;
        engine.train_micro_batch(model, token_batch(tokens, targets, B, T), dloss, &loss);
      }
      engine.finish_step();
      // The same values in the unfrozen table's layout, and its gradients over every rank's data.
      std::vector<std::vector<float>> units, grads, values(table.units().size()), got(table.units().size());
      for (const UnitInfo& u : whole.units()) units.emplace_back(u.numel), grads.emplace_back(u.numel, 0.0f);
      for (size_t u = 0; u < table.units().size(); u++) {
        values[u] = engine.gather_unit(static_cast<int>(u), false);
        got[u] = engine.gather_unit(static_cast<int>(u), true);
      }
      for (size_t id = 0; id < table.params().size(); id++) {
        const ParamInfo &p = table.params()[id], &q = whole.params()[id];
        std::copy_n(values[p.unit].data() + p.offset, p.numel, units[q.unit].data() + q.offset);
      }
      std::vector<const float*> unit_ptrs;
      std::vector<float*> grad_ptrs;
      for (size_t u = 0; u < units.size(); u++)
        unit_ptrs.push_back(units[u].data()), grad_ptrs.push_back(grads[u].data());
      GptModel<float> reference(whole, B, T, false, cpu_layer_ops<float>());
      for (int q = 0; q < n; q++)
        for (int micro = 0; micro < 2; micro++) {
          fill_tokens(tokens, q, cfg.vocab_size, micro);
          fill_tokens(targets, q + 100, cfg.vocab_size, micro);
          forward_backward_unsharded(reference, whole, unit_ptrs, grad_ptrs, token_batch(tokens, targets, B, T), dloss);
        }
      for (size_t id = 0; id < table.params().size(); id++) {
        const ParamInfo &p = table.params()[id], &q = whole.params()[id];
        for (size_t i = 0; i < p.numel; i++) {
          const double expected = p.frozen ? 0.0 : grads[q.unit][q.offset + i];
          const double g = got[p.unit][p.offset + i];
          if (std::fabs(g - expected) > 1e-7 + 1e-5 * std::fabs(expected)) {
            if (ok)
              failure = p.name + "[" + std::to_string(i) + "] with " + freeze[0] + ": " + std::to_string(g) +
                        " != " + std::to_string(expected);
            ok = false;
          }
        }
      }
    }
  }
  EXPECT_TRUE(all_ranks(ok)) << failure;
}

// The bytes plan_memory predicts for an engine's construction: every category but the
// communicators' buffers, which come with their first use.
size_t planned_at_construction(const ParamTable& table, const GroupShape& g) {
  const auto plan = FsdpEngine::plan_memory(FsdpEngine::plan_layout(table, g), {});
  size_t bytes = 0;
  for (int c = 0; c < MEM_CATEGORY_COUNT; c++)
    if (c != MEM_COMM_BUFFERS) bytes += plan[c];
  return bytes;
}

// Frozen parameters take no gradient memory: the engine charges gradients (shards and unsharded
// buffers) for the trainable space alone, and allocates exactly what plan_memory predicts (as the
// device counts it).
TEST(Engine, FrozenParametersChargeNoGradientMemory) {
  const ModelConfig cfg = awkward_model();
  auto comm = make_mpi_comm(MPI_COMM_WORLD, nullptr);
  auto self = make_mpi_comm(MPI_COMM_SELF, nullptr);
  MemoryTracker all_memory, frozen_memory;
  const ParamTable whole(cfg), table(cfg, {"wte", "h.0.*"});
  FsdpEngine a(whole, *comm, *self, all_memory, {}, cpu_backend());
  Device& device = *cpu_backend().device;
  const size_t before = device.live_bytes();
  FsdpEngine b(table, *comm, *self, frozen_memory, {}, cpu_backend());
  const size_t allocated = device.live_bytes() - before;  // what the device counted, not the tracker
  size_t trainable_shards = 0;
  for (const UnitShard& s : b.shards()) trainable_shards += s.grads.size();
  const GroupShape g{comm->size(), comm->rank(), 1, 0};
  bool ok = frozen_memory.current(MEM_GRADIENTS) < all_memory.current(MEM_GRADIENTS) &&
            // Two spaces are padded each: at most one more element per unit.
            frozen_memory.current(MEM_SHARDED_PARAMS) <=
                all_memory.current(MEM_SHARDED_PARAMS) + table.units().size() * sizeof(float) &&
            planned_at_construction(table, g) == allocated &&
            trainable_shards * comm->size() < table.trainable_params() + comm->size() * table.units().size();
  EXPECT_TRUE(all_ranks(ok));
}
