// The paths a GPU takes through the engine, optimizer and checkpoints, on any machine: a Device
// whose memory the host code must treat as foreign (kind CUDA: every host read or write goes
// through its copies, each checked for direction: support/foreign_device.hpp), backed by ordinary
// memory so the CPU operations still compute on it. A run on
// it must give the bits of the same run on the host backend -- training, the optimizer,
// cpu_offload, and checkpoints written from one and read into the other -- which checks every
// staging copy (initialization, checkpoint reads and writes, gathers for tests) for size, offset
// and direction. Run on 1..4 ranks.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <cstring>
#include <string>
#include <vector>

#include "ckpt/checkpoint_io.hpp"
#include "comm/comm.hpp"
#include "model/families/gpt2/gpt2_model.hpp"
#include "optim/adamw.hpp"
#include "shard/fsdp_engine.hpp"
#include "support/foreign_device.hpp"
#include "support/mpi_gtest.hpp"
#include "support/training_run.hpp"

using namespace shardtrain;
using shardtrain::testing::all_ranks;
using shardtrain::testing::ForeignDevice;
using shardtrain::testing::TrainingRun;
using shardtrain::testing::foreign_backend;

namespace {

// A folder every rank sees, made by rank 0 and removed with the object.
class SharedTempDir {
 public:
  SharedTempDir() {
    char buffer[64] = "/tmp/shardtrain-staging-XXXXXX";
    if (rank() == 0 && !mkdtemp(buffer)) buffer[0] = 0;
    MPI_Bcast(buffer, sizeof buffer, MPI_CHAR, 0, MPI_COMM_WORLD);
    path_ = buffer;
  }
  ~SharedTempDir() {
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank() == 0 && !path_.empty()) std::filesystem::remove_all(path_);
  }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  static int rank() {
    int r = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &r);
    return r;
  }
  std::string path_;
};

}  // namespace

TEST(DeviceStaging, TrainingOnAForeignDeviceGivesTheHostBits) {
  ForeignDevice device;
  // The GPU's settings: state on the device or offloaded, reduce-scatters started and joined
  // later from alternating block gradient buffers.
  for (bool offload : {false, true}) {
    for (bool overlap : {false, true}) {
      TrainingRun host(cpu_backend(), false), foreign(foreign_backend(device), offload, overlap);
      host.train(3);
      foreign.train(3);
      EXPECT_TRUE(all_ranks(host.losses == foreign.losses)) << "offload " << offload << " overlap " << overlap;
      EXPECT_TRUE(all_ranks(host.parameters() == foreign.parameters())) << "offload " << offload << " overlap " << overlap;
    }
  }
  EXPECT_GT(device.copied(), 0u);
}

TEST(DeviceStaging, CheckpointsMoveBetweenHostAndForeignDevice) {
  ForeignDevice device;
  SharedTempDir dir;
  for (const char* layout : {"sharded", "gathered"}) {
    for (bool offload : {false, true}) {
      TrainingRun writer(foreign_backend(device), offload), reader(cpu_backend(), false);
      TrainingRun writer_on_host(cpu_backend(), false), reader_on_device(foreign_backend(device), offload);
      writer.train(2);
      writer_on_host.train(2);
      CheckpointState state;
      state.layout = layout;
      state.step = 2;
      state.model = shardtrain::testing::small_training_model();
      int world = 1;
      MPI_Comm_size(MPI_COMM_WORLD, &world);
      state.world_size = world;  // sharded datasets are padded for it, and the load checks that
      const std::string from_device = dir.file("from-device.h5"), from_host = dir.file("from-host.h5");
      const CheckpointComm ranks{*writer.world, MPI_COMM_WORLD};
      save_checkpoint(from_device, state, writer.engine, writer.optimizer, ranks);
      save_checkpoint(from_host, state, writer_on_host.engine, writer_on_host.optimizer, ranks);
      load_checkpoint(from_device, reader.engine, reader.optimizer, ranks);
      load_checkpoint(from_host, reader_on_device.engine, reader_on_device.optimizer, ranks);
      // Both continue for two steps: the same bits as the writer continuing without a checkpoint.
      writer.train(2);
      reader.train(2);
      reader_on_device.train(2);
      const std::vector<double> expected(writer.losses.begin() + 2, writer.losses.end());
      EXPECT_TRUE(all_ranks(reader.losses == expected)) << layout << " device -> host, offload " << offload;
      EXPECT_TRUE(all_ranks(reader_on_device.losses == expected)) << layout << " host -> device, offload " << offload;
      EXPECT_TRUE(all_ranks(reader.parameters() == writer.parameters())) << layout << ", offload " << offload;
    }
  }
}
