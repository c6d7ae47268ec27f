// A small GPT trained for a few steps by the engine and optimizer on a chosen backend and
// communicators, for the multi-rank tests that compare a run on the host with the same run on a
// foreign device (support/foreign_device.hpp): same losses and parameters bit for bit.
#pragma once

#include <mpi.h>

#include <functional>
#include <memory>
#include <vector>

#include "comm/comm.hpp"
#include "model/families/gpt2/gpt2_model.hpp"
#include "optim/adamw.hpp"
#include "shard/fsdp_engine.hpp"
#include "support/foreign_device.hpp"
#include "support/model_fixtures.hpp"

namespace shardtrain::testing {

inline ModelConfig small_training_model() {
  ModelConfig c;
  c.n_layer = 2;
  c.n_embd = 20;  // unit sizes 3 does not divide: padding in every shard
  c.n_head = 2;
  c.vocab_size = 37;
  c.max_seq_len = 9;
  return c;
}

// The GPU's arrangement on a foreign device: its memory for the model and engine, plain host
// memory for offloaded state, the CPU's operations for both.
inline Backend foreign_backend(ForeignDevice& device) {
  return Backend{&device,          &host_device(),          &cpu_layer_ops<float>(),
                 &cpu_shard_ops(), &cpu_layer_ops<float>(), &cpu_shard_ops()};
}

// The communicator an engine uses over an MPI communicator; the default is MPI on host memory
// (which also reads a foreign device's memory directly: it is ordinary memory).
using CommMaker = std::function<std::unique_ptr<Comm>(MPI_Comm)>;
inline std::unique_ptr<Comm> host_mpi_comm(MPI_Comm comm) { return make_mpi_comm(comm, nullptr); }

// One engine, optimizer and model on a backend, trained for `steps` steps on fixed data; the
// shard group is the world, the replica group each rank alone.
struct TrainingRun {
  ParamTable table{small_training_model()};
  MemoryTracker memory;
  std::unique_ptr<Comm> world, self;
  // The step's sums where they are host memory (cpu_offload), as the trainer's host communicator.
  std::unique_ptr<Comm> host_world = make_mpi_comm(MPI_COMM_WORLD, nullptr);
  FsdpEngine engine;
  AdamW optimizer;
  GptModel<float> model;
  std::vector<double> losses;

  TrainingRun(const Backend& backend, const EngineOptions& engine_options, const CommMaker& make_comm = host_mpi_comm,
              DType activation_dtype = DTYPE_FP32)
      : world(make_comm(MPI_COMM_WORLD)),
        self(make_comm(MPI_COMM_SELF)),
        engine(table, *world, *self, memory, engine_options, backend),
        optimizer(OptimConfig{}, engine, memory),
        model(table, 2, 5, false, *backend.ops, activation_dtype) {
    engine.init_parameters(11);
  }
  TrainingRun(const Backend& backend, bool offload, bool overlap = false)
      : TrainingRun(backend, options(offload, overlap)) {}

  static EngineOptions options(bool offload, bool overlap) {
    EngineOptions o;
    o.cpu_offload = offload;
    o.overlap_reduce_scatter = overlap;
    return o;
  }

  // `micro_batches` per step: the gradient shards accumulate that many reduce-scatters.
  void train(int steps, int micro_batches = 1) {
    std::vector<int> tokens(10), targets(10);
    for (int s = 0; s < steps; s++) {
      engine.zero_grads();
      // The trainer's step: the sums where the optimizer reads them, summed over the world by the
      // engine's kind of communicator where they are the device's memory, the host reads them once.
      Device& device = engine.master_device();
      DeviceArray<double> sums(device, 2);
      double host[2] = {0, 0};
      for (int m = 0; m < micro_batches; m++) {
        const int batch = s * micro_batches + m;  // with one micro-batch per step, batch s
        for (size_t i = 0; i < tokens.size(); i++) {
          tokens[i] = static_cast<int>((i * 7 + world->rank() * 13 + batch * 5) % 37);
          targets[i] = static_cast<int>((i * 11 + world->rank() * 3 + batch) % 37);
        }
        engine.train_micro_batch(model, token_batch(tokens, targets, 2, 5),
                                 1.0f / (10 * world->size() * micro_batches), sums.data());
      }
      engine.finish_step();
      optimizer.accumulate_grad_sq_norm(sums.data() + 1);
      Comm& sums_comm = device.is_host() ? *host_world : *world;
      sums_comm.all_reduce_sum(Span<double>(sums.data(), 2), "test");
      optimizer.step(s, sums.data());
      device.copy_to_host(host, sums.data(), sums.bytes());
      losses.push_back(host[0]);
    }
  }

  // Every unit's full parameters, as seen through gather_unit (host vectors).
  std::vector<std::vector<float>> parameters() {
    std::vector<std::vector<float>> all;
    for (size_t u = 0; u < table.units().size(); u++) all.push_back(engine.gather_unit(static_cast<int>(u), false));
    return all;
  }
};

}  // namespace shardtrain::testing
