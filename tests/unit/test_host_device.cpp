// The host device's partly backed arrays (Device::allocate_backed_prefix): the head is zeroed
// memory the array counts, the tail addresses with nothing behind them.
#include <gtest/gtest.h>

#include <csignal>
#include <cstdlib>
#include <cstdint>

#include "backend/device.hpp"

namespace shardtrain {
namespace {

TEST(HostDeviceBackedPrefix, TheHeadIsZeroedWritableMemoryAndOnlyItIsCounted) {
  Device& host = host_device();
  const size_t before = host.live_bytes();
  {
    DeviceArray<float> partial(host, size_t{1} << 20, 1000);
    EXPECT_EQ(partial.size(), size_t{1} << 20);
    EXPECT_EQ(partial.bytes(), 1000 * sizeof(float));
    EXPECT_EQ(host.live_bytes() - before, 1000 * sizeof(float));
    for (size_t i = 0; i < 1000; i++) EXPECT_EQ(partial.data()[i], 0.0f) << i;
    for (size_t i = 0; i < 1000; i++) partial.data()[i] = static_cast<float>(i);
    EXPECT_EQ(partial.data()[999], 999.0f);
  }
  EXPECT_EQ(host.live_bytes(), before);
}

TEST(HostDeviceBackedPrefixDeathTest, ReadingTheTailFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  // Past the head's page: a stray read of an unbacked weight stops the run instead of reading stale
  // values.
  EXPECT_EXIT(
      {
        DeviceArray<float> partial(host_device(), size_t{1} << 20, 1000);
        volatile float v = partial.data()[(size_t{1} << 20) - 1];
        (void)v;
        std::_Exit(0);
      },
      ::testing::KilledBySignal(SIGSEGV), "");
}

}  // namespace
}  // namespace shardtrain
