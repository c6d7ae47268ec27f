// GPU tests of the CUDA device (caching allocator, copies, streams and events) and of the NCCL
// communicator, on one rank over MPI_COMM_SELF: the test machine has one GPU, and NCCL does not
// support two ranks on one GPU. Multi-rank NCCL runs are the job of the end-to-end tests.
//
// Oracle: the MPI communicator (comm/mpi_comm.cpp) on host copies of the same data, and host
// formulas over every rank's terms. On one rank no reduction order is involved, so the NCCL
// results must match bit for bit (a 16-bit wire included: this rank's own term stays fp32 by
// contract). Inputs are nonzero (rank-dependent where a host formula is the oracle), and
// accumulating collectives start from a nonzero shard, so a result differs from its input and
// from zero. On one rank the 16-bit wire itself carries only zeros (the own slot is zeroed, its
// term added in fp32): its rounding and widening kernels are checked directly against
// backend/dtype.hpp, on values chosen to hit every rounding case. Device buffers carry guard
// zones (tests/support/tensor_check.hpp) copied up and down with the data, so a write past either
// end shows. Every comparison is exact.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "backend/cuda/cuda_backend.hpp"
#include "backend/cuda/cuda_handles.hpp"
#include "backend/dtype.hpp"
#include "comm/comm.hpp"
#include "comm/cuda/nccl_comm.hpp"
#include "comm/watchdog.hpp"
#include "core/error.hpp"
#include "kernels/comm_kernels.hpp"
#include "kernels/cuda_check.hpp"
#include "kernels/launch.hpp"
#include "support/tensor_check.hpp"

namespace shardtrain {
namespace {

using testing::GuardedBuffer;

constexpr size_t kGuard = 16;  // GuardedBuffer's default

// A device image of a GuardedBuffer, guard zones included.
template <typename T>
struct DeviceGuarded {
  DeviceArray<T> storage;
  T* data() { return storage.data() + kGuard; }
};

template <typename T>
DeviceGuarded<T> upload(Device& device, const GuardedBuffer<T>& host) {
  DeviceGuarded<T> out{DeviceArray<T>(device, host.size() + 2 * kGuard)};
  device.copy_to_device(out.storage.data(), host.data() - kGuard, out.storage.bytes());
  return out;
}

template <typename T>
void download(Device& device, GuardedBuffer<T>& host, const DeviceGuarded<T>& from) {
  device.copy_to_host(host.data() - kGuard, from.storage.data(), from.storage.bytes());
}

template <typename T>
DeviceArray<T> upload(Device& device, const std::vector<T>& host) {
  DeviceArray<T> out(device, host.size());
  device.copy_to_device(out.data(), host.data(), out.bytes());
  return out;
}

template <typename T>
std::vector<T> download(Device& device, const DeviceArray<T>& from) {
  std::vector<T> out(from.size());
  device.copy_to_host(out.data(), from.data(), from.bytes());
  return out;
}

// Bitwise equality, except that any NaN equals any NaN in floating types: arithmetic on a NaN
// gives the host's payload on the CPU and the canonical NaN on the GPU.
template <typename T>
bool same_bits(const T* a, const T* b, size_t n, const std::string& label) {
  for (size_t i = 0; i < n; i++) {
    if constexpr (std::is_floating_point_v<T>) {
      if (std::isnan(a[i]) && std::isnan(b[i])) continue;
    }
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) {
      ADD_FAILURE() << label << ": first difference at element " << i << " of " << n << ": " << +a[i] << " vs "
                    << +b[i];
      return false;
    }
  }
  return true;
}

// Floats with all 24 significand bits in play (so a 16-bit rounding anywhere would show), of
// both signs and several binades.
std::vector<float> busy_floats(size_t n, uint64_t seed) {
  testing::TestRng rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(rng.uniform(-4.0, 4.0)) + 0x1p-20f;
  return v;
}

// One device and two communicators over MPI_COMM_SELF, shared by the whole suite (NCCL set-up
// costs a good fraction of a second): NCCL with a watchdog (so its monitor thread runs), and MPI
// as the oracle.
class GpuTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    std::string why;
    if (!cuda_available(&why)) return;
    device_ = CudaDevice::open(0);
    watchdog_ = std::make_unique<Watchdog>(120.0, "fsdp.comm_timeout", "[gpu test]");
    nccl_ = make_nccl_comm(MPI_COMM_SELF, *device_, watchdog_.get());
    mpi_ = make_mpi_comm(MPI_COMM_SELF, nullptr);
  }
  static void TearDownTestSuite() {
    nccl_.reset();  // before the device: it releases its scratch buffers there
    mpi_.reset();
    watchdog_.reset();
    device_.reset();
  }
  void SetUp() override {
    std::string why;
    if (!cuda_available(&why)) GTEST_SKIP() << "no GPU: " << why;
  }

  CudaDevice& device() { return *device_; }
  Comm& nccl() { return *nccl_; }
  Comm& mpi() { return *mpi_; }
  // The device's compute stream, for launching the wire kernels directly.
  kernels::LaunchContext launch() {
    kernels::LaunchContext ctx;
    ctx.stream = cuda_stream(device().compute_stream());
    CUDA_CHECK(cudaDeviceGetAttribute(&ctx.sm_count, cudaDevAttrMultiProcessorCount, device().ordinal()));
    return ctx;
  }
  // Nonzero test data that differs between ranks: busy_floats seeded by (seed, rank).
  std::vector<float> rank_floats(size_t n, int rank, uint64_t seed) {
    return busy_floats(n, seed * 1000 + static_cast<uint64_t>(rank));
  }

  static std::unique_ptr<CudaDevice> device_;
  static std::unique_ptr<Watchdog> watchdog_;
  static std::unique_ptr<Comm> nccl_, mpi_;
};

std::unique_ptr<CudaDevice> GpuTest::device_;
std::unique_ptr<Watchdog> GpuTest::watchdog_;
std::unique_ptr<Comm> GpuTest::nccl_, GpuTest::mpi_;

// ---- CudaDevice -----------------------------------------------------------------------------

using CudaDeviceMemoryTest = GpuTest;

TEST_F(CudaDeviceMemoryTest, OpensTheGpuWithStreamHandleAndWorkspace) {
  EXPECT_EQ(device().kind(), DEVICE_CUDA);
  EXPECT_FALSE(device().is_host());
  EXPECT_EQ(std::string(device().name()).rfind("cuda:" + std::to_string(device().ordinal()) + " ", 0), 0u)
      << device().name();
  EXPECT_NE(device().compute_stream(), nullptr);
  EXPECT_NE(device().cublaslt(), nullptr);
  EXPECT_NE(device().gemm_workspace(), nullptr);
  EXPECT_EQ(device().gemm_workspace_bytes(), size_t{32} << 20);
  EXPECT_GE(device().reserved_bytes(), device().gemm_workspace_bytes());
  EXPECT_GE(device().peak_reserved_bytes(), device().reserved_bytes());
  EXPECT_GT(device().total_memory(), 0u);
  EXPECT_LE(device().free_memory(), device().total_memory());
}

TEST_F(CudaDeviceMemoryTest, AllocateZeroFillsEvenABlockReusedFromTheCache) {
  for (size_t bytes : {size_t{4}, size_t{1000} * 4, size_t{3} << 20, (size_t{5} << 20) + 12}) {
    std::vector<uint8_t> dirty(bytes, 0xA5);
    void* p = device().allocate(bytes);
    device().copy_to_device(p, dirty.data(), bytes);
    device().release(p, bytes);
    const size_t reserved = device().reserved_bytes();
    void* q = device().allocate(bytes);
    EXPECT_EQ(device().reserved_bytes(), reserved) << bytes << " bytes: the released block was not reused";
    std::vector<uint8_t> back(bytes, 0xFF);
    device().copy_to_host(back.data(), q, bytes);
    EXPECT_EQ(back, std::vector<uint8_t>(bytes, 0)) << bytes << " bytes";
    device().release(q, bytes);
  }
  EXPECT_EQ(device().allocate(0), nullptr);
  device().release(nullptr, 0);
}

TEST_F(CudaDeviceMemoryTest, CacheServesSmallerRequestsOfTheSameClassWithoutGrowing) {
  // 10 MiB + 1 byte rounds to 12 MiB; 11 MiB - 3 bytes to 12 MiB too; 1000 and 1024 bytes share
  // the 1024-byte class.
  const std::vector<std::pair<size_t, size_t>> cases = {{(size_t{10} << 20) + 1, (size_t{11} << 20) - 3},
                                                        {1024, 1000}};
  for (auto [first, second] : cases) {
    void* p = device().allocate(first);
    device().release(p, first);
    const size_t reserved = device().reserved_bytes(), peak = device().peak_reserved_bytes();
    void* q = device().allocate(second);
    EXPECT_EQ(device().reserved_bytes(), reserved) << first << " then " << second;
    EXPECT_EQ(device().peak_reserved_bytes(), peak);
    device().release(q, second);
  }
}

TEST_F(CudaDeviceMemoryTest, EmptyCacheReturnsCachedBlocksToTheDriver) {
  const size_t bytes = size_t{64} << 20;
  void* p = device().allocate(bytes);
  const size_t with_block = device().reserved_bytes();
  device().release(p, bytes);
  EXPECT_EQ(device().reserved_bytes(), with_block) << "release keeps the block cached";
  device().empty_cache();
  EXPECT_LE(device().reserved_bytes(), with_block - bytes);
  EXPECT_GE(device().reserved_bytes(), device().gemm_workspace_bytes()) << "the workspace is in use, not cached";
}

TEST_F(CudaDeviceMemoryTest, ABackedPrefixHoldsOnlyItsHeadZeroedAndReturnsIt) {
  // 1 MiB + 12 bytes backed of 96 MiB reserved: the reserved bytes grow by the head rounded to the
  // driver's granularity (2 MiB on current GPUs), not by the whole range.
  const size_t backed = (size_t{1} << 20) + 12, bytes = size_t{96} << 20;
  const size_t before = device().reserved_bytes();
  void* p = device().allocate_backed_prefix(backed, bytes);
  ASSERT_NE(p, nullptr);
  const size_t grown = device().reserved_bytes() - before;
  EXPECT_GE(grown, backed);
  EXPECT_LE(grown, size_t{4} << 20) << "the unbacked tail has memory behind it";
  std::vector<uint8_t> back(backed, 0xFF), pattern(backed);
  device().copy_to_host(back.data(), p, backed);
  EXPECT_EQ(back, std::vector<uint8_t>(backed, 0)) << "the head is zeroed";
  for (size_t i = 0; i < backed; i++) pattern[i] = static_cast<uint8_t>(i * 37 + 1);
  device().copy_to_device(p, pattern.data(), backed);
  device().copy_to_host(back.data(), p, backed);
  EXPECT_EQ(back, pattern);
  device().release_backed_prefix(p, bytes);
  EXPECT_EQ(device().reserved_bytes(), before);
  // And a DeviceArray backed in part releases the same way.
  {
    DeviceArray<float> partial(device(), 1u << 20, 1000);
    EXPECT_EQ(partial.bytes(), 1000 * sizeof(float));
  }
  EXPECT_EQ(device().reserved_bytes(), before);
}

TEST_F(CudaDeviceMemoryTest, CopyRoundTripsHostDeviceDeviceHost) {
  const size_t bytes = 1000003;  // odd, not a multiple of any size class
  std::vector<uint8_t> host(bytes);
  for (size_t i = 0; i < bytes; i++) host[i] = static_cast<uint8_t>(i * 131 + 7);
  void* a = device().allocate(bytes);
  void* b = device().allocate(bytes);
  device().copy_to_device(a, host.data(), bytes);
  device().copy_on_device(b, a, bytes);
  std::vector<uint8_t> back(bytes + 2, 0xEE);
  device().copy_to_host(back.data() + 1, b, bytes);
  EXPECT_EQ(back.front(), 0xEE);
  EXPECT_EQ(back.back(), 0xEE);
  EXPECT_TRUE(std::equal(host.begin(), host.end(), back.begin() + 1));
  device().zero(static_cast<char*>(b) + 10, 20);
  device().copy_to_host(back.data() + 1, b, bytes);
  for (size_t i = 0; i < bytes; i++)
    ASSERT_EQ(back[i + 1], (i >= 10 && i < 30) ? 0 : host[i]) << "byte " << i << " after zero(10, 20)";
  device().synchronize();
  device().release(a, bytes);
  device().release(b, bytes);
}

// Device's streams and events are the GPU's: a stream of its own that waits for an event recorded
// on the compute stream sees the compute stream's work, and the compute stream, waiting for an
// event of that stream, sees its work in turn. 64 MiB makes a missing wait show as stale data.
TEST_F(CudaDeviceMemoryTest, EventsOrderAStreamOfItsOwnWithTheComputeStream) {
  const size_t n = size_t{16} << 20;
  std::vector<float> values(n);
  for (size_t i = 0; i < n; i++) values[i] = static_cast<float>(i % 1000 + 1);
  DeviceArray<float> a(device(), n), b(device(), n);
  DeviceStream* side = device().create_stream(/*urgent=*/true);
  DeviceEvent* uploaded = device().create_event();
  DeviceEvent* copied = device().create_event();
  ASSERT_NE(side, nullptr);
  ASSERT_NE(side, device().compute_stream());
  device().copy_to_device(a.data(), values.data(), a.bytes());  // queued on the compute stream
  device().record(uploaded, device().compute_stream());
  device().wait(side, uploaded);
  CUDA_CHECK(cudaMemcpyAsync(b.data(), a.data(), a.bytes(), cudaMemcpyDeviceToDevice, cuda_stream(side)));
  device().record(copied, side);
  device().wait(device().compute_stream(), copied);
  const auto back = download(device(), b);  // on the compute stream, after the side stream's copy
  EXPECT_TRUE(device().finished(uploaded));
  EXPECT_TRUE(device().finished(copied));
  size_t wrong = 0;
  for (size_t i = 0; i < n; i++) wrong += back[i] != values[i];
  EXPECT_EQ(wrong, 0u) << "elements of the copy on the side stream not equal to the upload";
  device().destroy_event(uploaded);
  device().destroy_event(copied);
  device().destroy_stream(side);
}

TEST_F(CudaDeviceMemoryTest, ImpossibleAllocationThrowsInputErrorNamingTheBytes) {
  const size_t pebibyte = size_t{1} << 50;
  const size_t reserved = device().reserved_bytes();
  try {
    device().allocate(pebibyte);
    FAIL() << "allocating 1 PiB succeeded";
  } catch (const InputError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(std::to_string(pebibyte)), std::string::npos) << message;
    EXPECT_NE(message.find("train.micro_batch"), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << "one line: " << message;
  }
  EXPECT_LE(device().reserved_bytes(), reserved);  // the failed attempt emptied the cache
  // The device still works after the failure.
  DeviceArray<float> after(device(), 1000);
  EXPECT_EQ(download(device(), after), std::vector<float>(1000, 0.0f));
}

// ---- NCCL communicator ----------------------------------------------------------------------

using NcclCommTest = GpuTest;

TEST_F(NcclCommTest, IsOneRankOverCommSelf) {
  EXPECT_EQ(nccl().rank(), 0);
  EXPECT_EQ(nccl().size(), 1);
}

TEST_F(NcclCommTest, AllGatherOutOfPlaceMatchesMpi) {
  const size_t n = 1000003;
  GuardedBuffer<float> shard(n, "shard"), full(n, "full"), expected(n, "expected");
  const auto values = busy_floats(n, 1);
  std::copy(values.begin(), values.end(), shard.data());
  testing::fill_value(full.data(), n, -7.0f);
  auto d_shard = upload(device(), shard);
  auto d_full = upload(device(), full);
  nccl().all_gather(Span<const float>(d_shard.data(), n), Span<float>(d_full.data(), n), "all_gather(test)");
  download(device(), full, d_full);
  mpi().all_gather(Span<const float>(shard.data(), n), Span<float>(expected.data(), n), "all_gather(test)");
  same_bits(full.data(), expected.data(), n, "all_gather out of place");
  testing::expect_guards_intact("all_gather out of place", full);
}

TEST_F(NcclCommTest, AllGatherInPlaceLeavesTheShardInItsSlot) {
  const size_t n = 4099;
  GuardedBuffer<float> full(n, "full");
  const auto values = busy_floats(n, 2);
  std::copy(values.begin(), values.end(), full.data());
  auto d_full = upload(device(), full);
  nccl().all_gather(Span<const float>(d_full.data(), n), Span<float>(d_full.data(), n), "all_gather(in place)");
  download(device(), full, d_full);
  same_bits(full.data(), values.data(), n, "all_gather in place");
  testing::expect_guards_intact("all_gather in place", full);
}

TEST_F(NcclCommTest, AllGather16BitMovesRawBits) {
  // NaN payloads, infinities, subnormals and negative zero in bf16 and fp16 encodings: the
  // gather is byte movement and must not touch a bit.
  const std::vector<uint16_t> specials = {0x0000, 0x8000, 0x7FC1, 0xFFFF, 0x7F80, 0xFC00, 0x0001, 0x7E01, 0x3C00};
  const size_t n = 777;
  GuardedBuffer<uint16_t> shard(n, "shard16"), full(n, "full16"), expected(n, "expected16");
  for (size_t i = 0; i < n; i++) shard[i] = i < specials.size() ? specials[i] : static_cast<uint16_t>(i * 40503u);
  auto d_shard = upload(device(), shard);
  auto d_full = upload(device(), full);
  nccl().all_gather(Span<const uint16_t>(d_shard.data(), n), Span<uint16_t>(d_full.data(), n), "all_gather(16)");
  download(device(), full, d_full);
  mpi().all_gather(Span<const uint16_t>(shard.data(), n), Span<uint16_t>(expected.data(), n), "all_gather(16)");
  same_bits(full.data(), expected.data(), n, "16-bit all_gather");
  testing::expect_guards_intact("16-bit all_gather", full);
}

TEST_F(NcclCommTest, StartedAllGathersCompleteAtWaitAndFreeTheirHandles) {
  const size_t n = 65537;
  const auto a_values = busy_floats(n, 3);
  std::vector<uint16_t> b_values(n);
  for (size_t i = 0; i < n; i++) b_values[i] = float_to_bf16(a_values[i]);
  auto a = upload(device(), a_values);
  auto b = upload(device(), b_values);
  const int ha = nccl().start_all_gather(Span<const float>(a.data(), n), Span<float>(a.data(), n), "prefetch(a)");
  const int hb = nccl().start_all_gather(Span<const uint16_t>(b.data(), n), Span<uint16_t>(b.data(), n), "prefetch(b)");
  EXPECT_NE(ha, hb);
  nccl().wait(ha);
  nccl().wait(hb);
  EXPECT_TRUE(same_bits(download(device(), a).data(), a_values.data(), n, "started fp32 gather"));
  EXPECT_TRUE(same_bits(download(device(), b).data(), b_values.data(), n, "started 16-bit gather"));
  // Waited handles are free again.
  const int again = nccl().start_all_gather(Span<const float>(a.data(), n), Span<float>(a.data(), n), "prefetch(a)");
  EXPECT_TRUE(again == ha || again == hb) << again;
  nccl().wait(again);
}

// The collective runs on its own stream: it must see the compute stream's work queued before the
// call (the zero-fill and the upload) and the compute stream's later work (the download) must see
// its result. 64 MiB makes a missing dependency visible as stale data.
TEST_F(NcclCommTest, CollectivesAreOrderedWithTheComputeStream) {
  const size_t n = size_t{16} << 20;
  std::vector<float> values(n);
  for (size_t i = 0; i < n; i++) values[i] = static_cast<float>(i % 1000 + 1);
  DeviceArray<float> shard(device(), n), full(device(), n);
  device().copy_to_device(shard.data(), values.data(), shard.bytes());
  nccl().all_gather(Span<const float>(shard.data(), n), Span<float>(full.data(), n), "all_gather(ordering)");
  std::vector<float> shard_add(n, 0.5f);
  DeviceArray<float> grads(device(), n);
  device().copy_to_device(grads.data(), shard_add.data(), grads.bytes());
  nccl().reduce_scatter_add(Span<const float>(grads.data(), n), Span<float>(full.data(), n), DTYPE_FP32,
                            "reduce_scatter(ordering)");
  const auto back = download(device(), full);
  size_t wrong = 0;
  for (size_t i = 0; i < n; i++) wrong += back[i] != values[i] + 0.5f;
  EXPECT_EQ(wrong, 0u) << "elements not equal to the gathered value + 0.5";
}

class NcclReduceScatterTest : public GpuTest, public ::testing::WithParamInterface<DType> {};

TEST_P(NcclReduceScatterTest, AccumulatesIntoTheShardLikeMpi) {
  const DType wire = GetParam();
  const size_t n = 100003;
  GuardedBuffer<float> shard(n, "shard"), expected(n, "expected");
  const auto full_values = busy_floats(n, 4);
  const auto shard_values = busy_floats(n, 5);
  std::copy(shard_values.begin(), shard_values.end(), shard.data());
  std::copy(shard_values.begin(), shard_values.end(), expected.data());
  auto d_full = upload(device(), full_values);
  auto d_shard = upload(device(), shard);
  for (int call = 0; call < 2; call++) {  // twice: the second call accumulates onto the first
    nccl().reduce_scatter_add(Span<const float>(d_full.data(), n), Span<float>(d_shard.data(), n), wire,
                              "reduce_scatter(test)");
    mpi().reduce_scatter_add(Span<const float>(full_values.data(), n), Span<float>(expected.data(), n), wire,
                             "reduce_scatter(test)");
  }
  download(device(), shard, d_shard);
  same_bits(shard.data(), expected.data(), n, std::string("reduce_scatter_add, wire ") + dtype_name(wire));
  // This rank's own term stays fp32 whatever the wire: no 16-bit rounding on one rank.
  for (size_t i = 0; i < n; i++) {
    const float once = shard_values[i] + full_values[i];
    ASSERT_EQ(shard[i], once + full_values[i]) << "element " << i;
  }
  testing::expect_guards_intact("reduce_scatter_add", shard);
  // The input is read only.
  EXPECT_TRUE(same_bits(download(device(), d_full).data(), full_values.data(), n, "full after reduce_scatter"));
}

TEST_P(NcclReduceScatterTest, StartedReductionsMatchBlockingOnesAtWait) {
  // Two started reductions into two shards, the second before the first is joined (the engine's
  // alternating block buffers), then the compute stream reads both shards after wait().
  const DType wire = GetParam();
  const size_t n = 65537;
  const auto full_a = busy_floats(n, 6), full_b = busy_floats(n, 7), start = busy_floats(n, 8);
  std::vector<float> expected_a(start), expected_b(start);
  mpi().reduce_scatter_add(Span<const float>(full_a.data(), n), Span<float>(expected_a.data(), n), wire, "test");
  mpi().reduce_scatter_add(Span<const float>(full_b.data(), n), Span<float>(expected_b.data(), n), wire, "test");
  auto d_full_a = upload(device(), full_a), d_full_b = upload(device(), full_b);
  auto d_shard_a = upload(device(), start), d_shard_b = upload(device(), start);
  const int a = nccl().start_reduce_scatter_add(Span<const float>(d_full_a.data(), n), Span<float>(d_shard_a.data(), n),
                                                wire, "reduce_scatter(started a)");
  const int b = nccl().start_reduce_scatter_add(Span<const float>(d_full_b.data(), n), Span<float>(d_shard_b.data(), n),
                                                wire, "reduce_scatter(started b)");
  EXPECT_NE(a, b);
  nccl().wait(a);
  nccl().wait(b);
  EXPECT_TRUE(same_bits(download(device(), d_shard_a).data(), expected_a.data(), n, "started reduction a"));
  EXPECT_TRUE(same_bits(download(device(), d_shard_b).data(), expected_b.data(), n, "started reduction b"));
}

INSTANTIATE_TEST_SUITE_P(Wire, NcclReduceScatterTest, ::testing::Values(DTYPE_FP32, DTYPE_BF16, DTYPE_FP16),
                         [](const ::testing::TestParamInfo<DType>& info) { return std::string(dtype_name(info.param)); });

// Values that exercise every rounding path of float_to_bf16/float_to_fp16: exact ties (to even,
// both directions), just above and below ties, fp16 overflow to inf and the last finite value,
// fp16 subnormals and underflow to zero, bf16's largest finite, NaN, infinities, signed zeros.
std::vector<float> rounding_cases() {
  std::vector<float> v = {0.0f, -0.0f, 1.0f, -1.0f, 1.0f + 0x1p-8f, 1.0f + 0x1p-8f + 0x1p-23f, 1.0f + 3 * 0x1p-8f,
                          1.0f + 0x1p-11f, 1.0f + 3 * 0x1p-11f, 1.0f + 0x1p-11f - 0x1p-23f, 65504.0f, 65519.0f,
                          65520.0f, 1e6f, -1e6f, 0x1p-14f, 0x1p-15f, 0x1p-24f, 0x1p-25f, 0x1.8p-25f, 0x1p-26f,
                          3 * 0x1p-25f, 5.96e-8f, std::numeric_limits<float>::max(),
                          std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
                          0x1.fffffep127f, 3.14159265f, -2.71828182f};
  const auto random = busy_floats(4093, 6);
  v.insert(v.end(), random.begin(), random.end());
  testing::TestRng rng(7);
  for (int i = 0; i < 4096; i++) v.push_back(bits_float(static_cast<uint32_t>(rng.next())));  // any bit pattern
  return v;
}

class NcclWireKernelTest : public GpuTest, public ::testing::WithParamInterface<DType> {};

// The wire launch_to_half writes: every element rounded as the CPU rounds it, [zero_begin, zero_end) +0.
void expect_wire(const std::vector<uint16_t>& out, const std::vector<float>& in, DType wire, size_t zero_begin,
                 size_t zero_end) {
  for (size_t i = 0; i < in.size(); i++) {
    const uint16_t expected = (i >= zero_begin && i < zero_end) ? 0 : float_to_half(in[i], wire);
    ASSERT_EQ(out[i], expected) << dtype_name(wire) << " element " << i << " of " << in.size() << " = " << in[i]
                                << " (bits 0x" << std::hex << float_bits(in[i]) << std::dec << "), zeroed ["
                                << zero_begin << ", " << zero_end << ")";
  }
}

TEST_P(NcclWireKernelTest, ToWireRoundsExactlyLikeTheCpuAndZeroesTheOwnSlot) {
  const DType wire = GetParam();
  const auto in = rounding_cases();
  const size_t n = in.size(), zero_begin = n / 3, zero_end = n / 3 + 101;
  auto d_in = upload(device(), in);
  DeviceArray<uint16_t> d_out(device(), n);
  kernels::launch_to_half(d_out.data(), d_in.data(), n, wire, launch(), zero_begin, zero_end);
  expect_wire(download(device(), d_out), in, wire, zero_begin, zero_end);
}

// The wire kernel converts packs of 8 and then the last n % 8 elements in a launch of their own:
// a zeroed slot that reaches into that tail (or lies wholly in it) is zeroed there too.
TEST_P(NcclWireKernelTest, TheOwnSlotIsZeroedInTheUnpackedTail) {
  const DType wire = GetParam();
  const auto cases = rounding_cases();
  const size_t n = 8 * 41 + 5;  // 41 packs and a tail of 5
  const std::vector<float> in(cases.begin(), cases.begin() + n);
  for (auto [zero_begin, zero_end] : {std::pair<size_t, size_t>{n - 9, n - 2}, {n - 4, n - 3}, {n - 5, n}, {3, n - 1}}) {
    auto d_in = upload(device(), in);
    DeviceArray<uint16_t> d_out(device(), n);
    kernels::launch_to_half(d_out.data(), d_in.data(), n, wire, launch(), zero_begin, zero_end);
    expect_wire(download(device(), d_out), in, wire, zero_begin, zero_end);
  }
}

TEST_P(NcclWireKernelTest, AddFromWireWidensLikeTheCpu) {
  const DType wire = GetParam();
  const auto values = rounding_cases();
  const size_t n = values.size();
  std::vector<uint16_t> wire_sum(n);
  for (size_t i = 0; i < n; i++) wire_sum[i] = float_to_half(values[n - 1 - i], wire);
  const auto own = busy_floats(n, 8);
  const auto shard0 = busy_floats(n, 9);
  std::vector<float> expected = shard0, expected_no_own = shard0;
  for (size_t i = 0; i < n; i++) {
    expected[i] += half_to_float(wire_sum[i], wire) + own[i];
    expected_no_own[i] += half_to_float(wire_sum[i], wire) + 0.0f;
  }
  auto d_wire = upload(device(), wire_sum);
  auto d_own = upload(device(), own);
  auto d_shard = upload(device(), shard0);
  auto d_shard_no_own = upload(device(), shard0);
  launch_comm_add_from_wire(d_shard.data(), d_wire.data(), d_own.data(), n, wire, launch());
  launch_comm_add_from_wire(d_shard_no_own.data(), d_wire.data(), nullptr, n, wire, launch());
  EXPECT_TRUE(same_bits(download(device(), d_shard).data(), expected.data(), n, "add_from_wire"));
  EXPECT_TRUE(same_bits(download(device(), d_shard_no_own).data(), expected_no_own.data(), n, "add_from_wire, no own"));
}

INSTANTIATE_TEST_SUITE_P(Wire, NcclWireKernelTest, ::testing::Values(DTYPE_BF16, DTYPE_FP16),
                         [](const ::testing::TestParamInfo<DType>& info) { return std::string(dtype_name(info.param)); });

TEST_F(NcclCommTest, AllReducesOnDeviceAndHostSpansMatchMpi) {
  const size_t n = 1031;
  const auto f = busy_floats(n, 10);
  std::vector<double> d(n), m(n);
  for (size_t i = 0; i < n; i++) d[i] = f[i] * 1e-3, m[i] = -f[i];
  auto d_f = upload(device(), f);
  auto d_d = upload(device(), d);
  auto d_m = upload(device(), m);
  nccl().all_reduce_sum(Span<float>(d_f.data(), n), "all_reduce(float)");
  nccl().all_reduce_sum(Span<double>(d_d.data(), n), "all_reduce(double)");
  nccl().all_reduce_max(Span<double>(d_m.data(), n), "all_reduce_max(double)");
  auto ef = f;
  auto ed = d;
  auto em = m;
  mpi().all_reduce_sum(Span<float>(ef.data(), n), "all_reduce(float)");
  mpi().all_reduce_sum(Span<double>(ed.data(), n), "all_reduce(double)");
  mpi().all_reduce_max(Span<double>(em.data(), n), "all_reduce_max(double)");
  EXPECT_TRUE(same_bits(download(device(), d_f).data(), ef.data(), n, "all_reduce_sum float"));
  EXPECT_TRUE(same_bits(download(device(), d_d).data(), ed.data(), n, "all_reduce_sum double"));
  EXPECT_TRUE(same_bits(download(device(), d_m).data(), em.data(), n, "all_reduce_max double"));
  // Host spans (the trainer's scalars) go through MPI.
  double host_sums[2] = {1.5, -2.25}, host_peak[1] = {3.0};
  nccl().all_reduce_sum(Span<double>(host_sums, 2), "all_reduce(host)");
  nccl().all_reduce_max(Span<double>(host_peak, 1), "all_reduce_max(host)");
  EXPECT_EQ(host_sums[0], 1.5);
  EXPECT_EQ(host_sums[1], -2.25);
  EXPECT_EQ(host_peak[0], 3.0);
}

TEST_F(NcclCommTest, BroadcastsHostAndDeviceBytes) {
  std::string host = "checkpoint list: step_00000100.h5";
  const std::string original = host;
  nccl().broadcast(Span<char>(&host[0], host.size()), 0, "broadcast(host)");
  EXPECT_EQ(host, original);
  std::vector<char> bytes(333);
  for (size_t i = 0; i < bytes.size(); i++) bytes[i] = static_cast<char>(i * 7);
  auto d_bytes = upload(device(), bytes);
  nccl().broadcast(Span<char>(d_bytes.data(), bytes.size()), 0, "broadcast(device)");
  EXPECT_EQ(download(device(), d_bytes), bytes);
}

// Every collective on nonzero, rank-dependent data against host formulas over the terms of all
// ranks (here one): the gathers and reductions write results that differ from what their output
// buffers held (and the reductions from zero), and one rank sends no bytes.
TEST_F(NcclCommTest, OneRankCollectivesMatchHostFormulasAndSendNoBytes) {
  const size_t n = 4096;
  const int rank = nccl().rank(), ranks = nccl().size();
  ASSERT_EQ(ranks, 1) << "the byte count below holds for one rank";
  const size_t total = n * static_cast<size_t>(ranks), own = static_cast<size_t>(rank) * n;
  auto bf16_of = [](const std::vector<float>& v) {
    std::vector<uint16_t> out(v.size());
    for (size_t i = 0; i < v.size(); i++) out[i] = float_to_bf16(v[i]);
    return out;
  };

  // Out of place into a buffer of other values: slot r becomes rank r's shard.
  const auto shard_values = rank_floats(n, rank, 21);
  auto d_shard = upload(device(), shard_values);
  auto d_gathered = upload(device(), rank_floats(total, rank, 22));
  nccl().all_gather(Span<const float>(d_shard.data(), n), Span<float>(d_gathered.data(), total), "all_gather(one rank)");
  // Started, in place as the engine prefetches: this rank's slot holds its shard, the others NaN.
  const auto shard16 = bf16_of(rank_floats(n, rank, 23));
  std::vector<uint16_t> gathered16(total, 0x7FC1);
  std::copy(shard16.begin(), shard16.end(), gathered16.begin() + own);
  auto d_gathered16 = upload(device(), gathered16);
  nccl().wait(nccl().start_all_gather(Span<const uint16_t>(d_gathered16.data() + own, n),
                                      Span<uint16_t>(d_gathered16.data(), total), "prefetch(one rank)"));
  std::vector<float> gathered_expected;
  std::vector<uint16_t> gathered16_expected;
  for (int r = 0; r < ranks; r++) {
    const auto theirs = rank_floats(n, r, 21);
    const auto theirs16 = bf16_of(rank_floats(n, r, 23));
    gathered_expected.insert(gathered_expected.end(), theirs.begin(), theirs.end());
    gathered16_expected.insert(gathered16_expected.end(), theirs16.begin(), theirs16.end());
  }
  EXPECT_TRUE(same_bits(download(device(), d_gathered).data(), gathered_expected.data(), total, "all_gather"));
  EXPECT_TRUE(
      same_bits(download(device(), d_gathered16).data(), gathered16_expected.data(), total, "started all_gather"));

  // shard += the sum over ranks r of rank r's full[own ...], onto a nonzero shard, on both wires.
  const auto full_values = rank_floats(total, rank, 24), start = rank_floats(n, rank, 25);
  std::vector<float> reduced_expected = start;
  for (int r = 0; r < ranks; r++) {
    const auto theirs = rank_floats(total, r, 24);
    for (size_t i = 0; i < n; i++) reduced_expected[i] += theirs[own + i];
  }
  for (DType wire : {DTYPE_FP32, DTYPE_BF16}) {
    auto d_full = upload(device(), full_values);
    auto d_reduced = upload(device(), start);
    nccl().reduce_scatter_add(Span<const float>(d_full.data(), total), Span<float>(d_reduced.data(), n), wire,
                              "reduce_scatter(one rank)");
    const auto got = download(device(), d_reduced);
    EXPECT_TRUE(same_bits(got.data(), reduced_expected.data(), n,
                          std::string("reduce_scatter_add, wire ") + dtype_name(wire)));
    size_t unchanged = 0;
    for (size_t i = 0; i < n; i++) unchanged += got[i] == start[i] || got[i] == 0.0f;
    EXPECT_EQ(unchanged, 0u) << dtype_name(wire) << ": elements equal to the shard before the reduction, or zero";
  }

  // Elementwise over ranks, in place (on one rank: the rank's own terms).
  const auto summands = rank_floats(n, rank, 26);
  std::vector<float> summed(n, 0.0f);
  for (int r = 0; r < ranks; r++) {
    const auto theirs = rank_floats(n, r, 26);
    for (size_t i = 0; i < n; i++) summed[i] += theirs[i];
  }
  auto d_summed = upload(device(), summands);
  nccl().all_reduce_sum(Span<float>(d_summed.data(), n), "all_reduce(one rank)");
  EXPECT_TRUE(same_bits(download(device(), d_summed).data(), summed.data(), n, "all_reduce_sum"));

  device().synchronize();
  EXPECT_EQ(nccl().bytes_sent(), 0u) << "one rank sends nothing";
}

TEST_F(NcclCommTest, ACommunicatorWithoutWatchdogWorksAndTearsDown) {
  for (int round = 0; round < 2; round++) {
    auto comm = make_nccl_comm(MPI_COMM_SELF, device(), nullptr);
    const auto values = busy_floats(1000, 11 + round);
    auto shard = upload(device(), values);
    DeviceArray<float> full(device(), values.size());
    comm->all_gather(Span<const float>(shard.data(), values.size()), Span<float>(full.data(), values.size()),
                     "all_gather(no watchdog)");
    EXPECT_TRUE(same_bits(download(device(), full).data(), values.data(), values.size(), "gather without watchdog"));
  }
}

}  // namespace
}  // namespace shardtrain
