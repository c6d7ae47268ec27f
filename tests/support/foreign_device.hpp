// A Device whose memory the host code must treat as foreign (kind CUDA: every host read or write
// goes through its copies), backed by ordinary memory so the CPU operations still compute on it:
// the paths a GPU takes, on any machine. It checks the direction every copy states against where
// the pointers are -- its own allocations (device memory) or not (host memory) -- and fails the
// running test on a copy that names the wrong one, the check a GPU would only make by failing.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>

#include "backend/device.hpp"

namespace shardtrain::testing {

class ForeignDevice : public Device {
 public:
  DeviceKind kind() const override { return DEVICE_CUDA; }
  const char* name() const override { return "foreign (test)"; }
  void* allocate(size_t bytes) override {
    if (bytes == 0) return nullptr;
    void* p = std::calloc(1, bytes);
    blocks_[reinterpret_cast<uintptr_t>(p)] = bytes;
    return p;
  }
  void release(void* p, size_t) override {
    blocks_.erase(reinterpret_cast<uintptr_t>(p));
    std::free(p);
  }
  void zero(void* p, size_t bytes) override {
    if (bytes == 0) return;
    EXPECT_TRUE(owns(p, bytes)) << "zero() of memory that is not the device's";
    std::memset(p, 0, bytes);
  }
  size_t copied() const { return copied_; }
  // Whether [p, p + bytes) lies in one of this device's allocations.
  bool owns(const void* p, size_t bytes) const {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    auto it = blocks_.upper_bound(a);
    if (it == blocks_.begin()) return false;
    --it;
    return a + bytes <= it->first + it->second;
  }

 protected:
  void transfer(void* dst, const void* src, size_t bytes, CopyKind kind) override {
    if (bytes == 0) return;
    const bool to_device = kind == COPY_TO_DEVICE || kind == COPY_ON_DEVICE;
    const bool from_device = kind != COPY_TO_DEVICE;
    EXPECT_EQ(owns(dst, bytes), to_device) << "a copy's destination is not where its direction (" << kind << ") says";
    EXPECT_EQ(owns(src, bytes), from_device) << "a copy's source is not where its direction (" << kind << ") says";
    std::memmove(dst, src, bytes);
    copied_ += bytes;
  }
  void wait_for_work() override {}

 private:
  std::map<uintptr_t, size_t> blocks_;  // allocation start -> bytes
  size_t copied_ = 0;
};

}  // namespace shardtrain::testing
