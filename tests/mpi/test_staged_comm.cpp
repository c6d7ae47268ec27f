// The staged communicator (comm/staged_comm.hpp: host MPI on a device's buffers through a host
// staging buffer, fsdp.comm_backend=mpi on a GPU) on a foreign device (support/foreign_device.hpp:
// device memory the host may touch only through copies, each checked for direction), against the
// MPI communicator on host buffers: every collective, element and wire type gives the same bits,
// as do the byte counts, and a training run gives the host run's losses and parameters. Run on
// 1..4 ranks.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "app/compute_backend.hpp"
#include "comm/comm.hpp"
#include "comm/staged_comm.hpp"
#include "support/foreign_device.hpp"
#include "support/mpi_gtest.hpp"
#include "support/training_run.hpp"

using namespace shardtrain;
using shardtrain::testing::all_ranks;
using shardtrain::testing::ForeignDevice;
using shardtrain::testing::TrainingRun;

namespace {

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

// Values that differ by rank, element and call, of mixed signs and magnitudes (so that a sum's
// order shows in its bits), within fp16's range for the 16-bit wires.
std::vector<float> floats(size_t n, int rank, int salt) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; i++)
    v[i] = static_cast<float>(std::sin(0.37 * i + 1.3 * rank + 0.11 * salt) * (1.0 + 97.0 * ((i + rank) % 5)));
  return v;
}
std::vector<double> doubles(size_t n, int rank, int salt) {
  std::vector<double> v(n);
  for (size_t i = 0; i < n; i++) v[i] = std::cos(0.61 * i + 0.7 * rank + salt) * std::pow(10.0, (i + rank) % 7);
  return v;
}
std::vector<uint16_t> halves(size_t n, int rank, int salt) {
  std::vector<uint16_t> v(n);
  for (size_t i = 0; i < n; i++) v[i] = static_cast<uint16_t>(i * 2654435761u + rank * 40503u + salt * 977u);
  return v;
}

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// The same values on the host (for the MPI communicator) and on the foreign device (for the staged one).
template <typename T>
struct Mirrored {
  ForeignDevice& device;
  std::vector<T> host;
  DeviceArray<T> on_device;
  Mirrored(ForeignDevice& d, const std::vector<T>& values) : device(d), host(values), on_device(d, values.size()) {
    device.copy_to_device(on_device.data(), host.data(), on_device.bytes());
  }
  Span<T> host_span(size_t begin, size_t n) { return Span<T>(host.data() + begin, n); }
  Span<T> device_span(size_t begin, size_t n) { return Span<T>(on_device.data() + begin, n); }
  std::vector<T> device_values() {
    std::vector<T> out(host.size());
    device.copy_to_host(out.data(), on_device.data(), on_device.bytes());
    return out;
  }
  // Both copies hold the same bits.
  bool agree() { return same_bits(host, device_values()); }
};

// The MPI communicator on host memory and the staged one on the foreign device, over the world.
struct CommPair {
  ForeignDevice device;
  std::unique_ptr<Comm> mpi = make_mpi_comm(MPI_COMM_WORLD, nullptr);
  std::unique_ptr<Comm> staged = make_staged_comm(MPI_COMM_WORLD, nullptr, device, host_device());
  size_t largest_staging = 0;  // the largest staging_bytes_* of the collectives issued
  void issued(size_t staging_bytes) { largest_staging = std::max(largest_staging, staging_bytes); }
};

// Odd sizes (and none): shards that are not multiples of anything, a single element, empty.
const size_t kShardSizes[] = {0, 1, 7, 1031};

template <typename T, typename Make>
void check_all_gathers(CommPair& p, Make make, const char* type) {
  const int R = p.staged->size(), r = p.staged->rank();
  for (size_t n : kShardSizes) {
    for (bool in_place : {false, true}) {
      // The full buffer starts with other values: every slot must be overwritten.
      Mirrored<T> full(p.device, make(n * R, r, 90));
      Mirrored<T> separate(p.device, make(n, r, 5));
      std::vector<T> own = separate.host;
      if (in_place) std::copy(own.begin(), own.end(), full.host.begin() + r * n);
      if (in_place) p.device.copy_to_device(full.on_device.data() + r * n, own.data(), n * sizeof(T));
      Span<const T> host_shard = in_place ? full.host_span(r * n, n) : separate.host_span(0, n);
      Span<const T> device_shard = in_place ? full.device_span(r * n, n) : separate.device_span(0, n);
      p.mpi->all_gather(host_shard, full.host_span(0, n * R), "test");
      p.staged->all_gather(device_shard, full.device_span(0, n * R), "test");
      if (R > 1 && n) p.issued(staging_bytes_all_gather(n * R, sizeof(T)));
      // An independent oracle as well: the concatenation of every rank's shard.
      std::vector<T> expected;
      for (int q = 0; q < R; q++) {
        std::vector<T> part = make(n, q, 5);
        expected.insert(expected.end(), part.begin(), part.end());
      }
      EXPECT_TRUE(all_ranks(full.agree() && same_bits(full.host, expected)))
          << type << " all_gather, shard " << n << (in_place ? ", in place" : "");
    }
  }
}

// Two started in-place gathers in flight, waited for in order; then the handles are reused.
template <typename T, typename Make>
void check_started_gathers(CommPair& p, Make make, const char* type) {
  const int R = p.staged->size(), r = p.staged->rank();
  for (size_t n : kShardSizes) {
    Mirrored<T> a(p.device, make(n * R, r, 1)), b(p.device, make(n * R, r, 2));
    const int ha_mpi = p.mpi->start_all_gather(a.host_span(r * n, n), a.host_span(0, n * R), "test a");
    const int hb_mpi = p.mpi->start_all_gather(b.host_span(r * n, n), b.host_span(0, n * R), "test b");
    const int ha = p.staged->start_all_gather(a.device_span(r * n, n), a.device_span(0, n * R), "test a");
    const int hb = p.staged->start_all_gather(b.device_span(r * n, n), b.device_span(0, n * R), "test b");
    p.mpi->wait(ha_mpi), p.mpi->wait(hb_mpi);
    p.staged->wait(ha), p.staged->wait(hb);
    if (R > 1 && n) p.issued(staging_bytes_all_gather(n * R, sizeof(T)));
    p.mpi->wait(p.mpi->start_all_gather(a.host_span(r * n, n), a.host_span(0, n * R), "test again"));
    const int again = p.staged->start_all_gather(a.device_span(r * n, n), a.device_span(0, n * R), "test again");
    p.staged->wait(again);
    EXPECT_TRUE(all_ranks(a.agree() && b.agree() && again == ha)) << type << " started all_gather, shard " << n;
  }
}

TEST(StagedComm, AllGathersGiveTheMpiBits) {
  CommPair p;
  check_all_gathers<float>(p, floats, "fp32");
  check_all_gathers<uint16_t>(p, halves, "16-bit");
  check_started_gathers<float>(p, floats, "fp32");
  check_started_gathers<uint16_t>(p, halves, "16-bit");
  EXPECT_TRUE(all_ranks(p.staged->bytes_sent() == p.mpi->bytes_sent()));
  // The staging buffer is the largest collective's, counted beside the ring's own buffers.
  EXPECT_TRUE(all_ranks(p.staged->uncounted_buffer_bytes() == p.mpi->uncounted_buffer_bytes() + p.largest_staging));
}

TEST(StagedComm, ReduceScattersAccumulateTheMpiBits) {
  CommPair p;
  const int R = p.staged->size(), r = p.staged->rank();
  for (DType wire : {DTYPE_FP32, DTYPE_BF16, DTYPE_FP16}) {
    for (size_t n : kShardSizes) {
      for (bool started : {false, true}) {
        Mirrored<float> full(p.device, floats(n * R, r, 3));
        Mirrored<float> shard(p.device, floats(n, r, 4));  // accumulated into, not overwritten
        const std::vector<float> before = shard.host;
        // Twice: the second adds onto the first's result, as gradient accumulation does.
        for (int round = 0; round < 2; round++) {
          if (started) {
            p.mpi->wait(p.mpi->start_reduce_scatter_add(full.host_span(0, n * R), shard.host_span(0, n), wire, "t"));
            p.staged->wait(
                p.staged->start_reduce_scatter_add(full.device_span(0, n * R), shard.device_span(0, n), wire, "t"));
          } else {
            p.mpi->reduce_scatter_add(full.host_span(0, n * R), shard.host_span(0, n), wire, "t");
            p.staged->reduce_scatter_add(full.device_span(0, n * R), shard.device_span(0, n), wire, "t");
          }
        }
        if (n) p.issued(staging_bytes_reduce_scatter(n, R));
        // The inputs are left as they were, and something was added (not a copy of the shard).
        const bool accumulated = n == 0 || !same_bits(shard.host, before);
        EXPECT_TRUE(all_ranks(shard.agree() && full.agree() && accumulated))
            << "reduce_scatter_add, wire " << dtype_name(wire) << ", shard " << n << (started ? ", started" : "");
      }
    }
  }
  EXPECT_TRUE(all_ranks(p.staged->bytes_sent() == p.mpi->bytes_sent()));
  EXPECT_TRUE(all_ranks(p.staged->uncounted_buffer_bytes() == p.mpi->uncounted_buffer_bytes() + p.largest_staging));
}

TEST(StagedComm, AllReducesAndBroadcastsGiveTheMpiBits) {
  CommPair p;
  const int R = p.staged->size(), r = p.staged->rank();
  for (size_t n : kShardSizes) {
    Mirrored<float> sum_f(p.device, floats(n, r, 6));
    p.mpi->all_reduce_sum(sum_f.host_span(0, n), "test");
    p.staged->all_reduce_sum(sum_f.device_span(0, n), "test");
    Mirrored<double> sum_d(p.device, doubles(n, r, 7)), max_d(p.device, doubles(n, r, 8));
    p.mpi->all_reduce_sum(sum_d.host_span(0, n), "test");
    p.staged->all_reduce_sum(sum_d.device_span(0, n), "test");
    p.mpi->all_reduce_max(max_d.host_span(0, n), "test");
    p.staged->all_reduce_max(max_d.device_span(0, n), "test");
    if (R > 1 && n) p.issued(staging_bytes_all_reduce(n, sizeof(double)));
    EXPECT_TRUE(all_ranks(sum_f.agree() && sum_d.agree() && max_d.agree())) << "all-reduces of " << n;
    for (int root = 0; root < R; root++) {
      std::vector<float> values = floats(n, r, 9);
      Mirrored<char> bytes(p.device, std::vector<char>(reinterpret_cast<const char*>(values.data()),
                                                       reinterpret_cast<const char*>(values.data() + n)));
      p.mpi->broadcast(bytes.host_span(0, bytes.host.size()), root, "test");
      p.staged->broadcast(bytes.device_span(0, bytes.host.size()), root, "test");
      const std::vector<float> from_root = floats(n, root, 9);
      const bool root_values = std::memcmp(bytes.host.data(), from_root.data(), n * sizeof(float)) == 0;
      EXPECT_TRUE(all_ranks(bytes.agree() && root_values)) << "broadcast of " << n << " floats from rank " << root;
    }
  }
  p.staged->barrier("test");
  EXPECT_TRUE(all_ranks(p.staged->bytes_sent() == p.mpi->bytes_sent()));
  EXPECT_TRUE(all_ranks(p.staged->uncounted_buffer_bytes() == p.mpi->uncounted_buffer_bytes() + p.largest_staging));
}

// The engine and optimizer with the staged communicators on the foreign device train as the
// host run with MPI does, in every setting a GPU run can take: state on the device or offloaded,
// reduce-scatters started (alternating gradient buffers), 16-bit gathers and reduce-scatters;
// two micro-batches a step, so that the reduce-scatters accumulate.
TEST(StagedComm, TrainingGivesTheHostBits) {
  ForeignDevice device;
  shardtrain::testing::CommMaker staged = [&](MPI_Comm comm) { return make_staged_comm(comm, nullptr, device, host_device()); };
  for (bool offload : {false, true}) {
    for (bool overlap : {false, true}) {
      for (DType dtype : {DTYPE_FP32, DTYPE_BF16}) {
        EngineOptions options = TrainingRun::options(offload, overlap);
        options.param_dtype = options.reduce_dtype = dtype;
        TrainingRun host(cpu_backend(), options), foreign(shardtrain::testing::foreign_backend(device), options, staged);
        host.train(3, 2);
        foreign.train(3, 2);
        // The staging the plan promises for this run: the shard group's largest collective (the
        // test's step sums share the world communicator, so their 16 bytes add nothing).
        ComputeOptions gpu_mpi;
        gpu_mpi.device = "cuda";
        gpu_mpi.comm = COMM_MPI;
        const GroupShape groups{world_size(), world_rank(), 1, 0};
        const size_t sums_bytes = 2 * sizeof(double);  // a language model's step sums
        const size_t planned = plan_comm_staging_bytes(gpu_mpi, groups, options,
                                                       FsdpEngine::plan_layout(host.table, groups), sums_bytes);
        const size_t step_sums = world_size() > 1 && !offload ? sums_bytes : 0;
        const size_t staged_bytes = foreign.world->uncounted_buffer_bytes() - host.world->uncounted_buffer_bytes();
        const bool same_traffic = foreign.world->bytes_sent() == host.world->bytes_sent();
        const bool losses = host.losses == foreign.losses;
        const bool parameters = host.parameters() == foreign.parameters();
        EXPECT_TRUE(all_ranks(losses && parameters && same_traffic))
            << "offload " << offload << " overlap " << overlap << " " << dtype_name(dtype);
        EXPECT_TRUE(all_ranks(staged_bytes + step_sums == planned))
            << "staged " << staged_bytes << " + " << step_sums << " bytes, planned " << planned;
      }
    }
  }
  EXPECT_GT(device.copied(), 0u);
}

}  // namespace
