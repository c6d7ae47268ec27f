// Test helpers for comparing tensors: deterministic pseudo-random fills (SplitMix64, seeded, no
// global state), an elementwise closeness check that reports its worst element, and buffers with
// guard zones of sentinels before and after the data.
//
// Convention: every comparison is |actual - ref| <= atol + rtol * |ref| element by element, with
// ref in double. A failure is a GoogleTest ADD_FAILURE (the test goes on) naming the label, the
// max abs and rel differences, the worst index (largest fraction of its threshold) with both
// values, and how much of the threshold it used. NaN never passes. Set SHARDTRAIN_TEST_VERBOSE=1 to
// print the fraction used by every check (to calibrate a tolerance model).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace shardtrain::testing {

// SplitMix64 (Steele, Lea, Flood 2014): tiny, seedable, good enough to make test data.
class TestRng {
 public:
  explicit TestRng(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [lo, hi).
  double uniform(double lo, double hi) { return lo + (hi - lo) * (static_cast<double>(next() >> 11) * 0x1p-53); }
  // Uniform integer in [0, n).
  int below(int n) { return static_cast<int>(next() % static_cast<uint64_t>(n)); }

 private:
  uint64_t state_;
};

// The unit roundoff of Real (2^-24 for float, 2^-53 for double), and its name for messages.
template <typename Real>
constexpr double unit_roundoff() {
  return std::is_same_v<Real, float> ? 0x1p-24 : 0x1p-53;
}
template <typename Real>
const char* type_name() {
  return std::is_same_v<Real, float> ? "float" : "double";
}

// Fills p[0..n) with values uniform in [lo, hi), rounded to T. Same seed, same values.
template <typename T>
void fill_uniform(T* p, size_t n, uint64_t seed, double lo = -1.0, double hi = 1.0) {
  TestRng rng(seed);
  for (size_t i = 0; i < n; i++) p[i] = static_cast<T>(rng.uniform(lo, hi));
}

// Fills p[0..n) with integers uniform in [0, bound).
inline void fill_indices(int* p, size_t n, uint64_t seed, int bound) {
  TestRng rng(seed);
  for (size_t i = 0; i < n; i++) p[i] = rng.below(bound);
}

template <typename T>
void fill_value(T* p, size_t n, T value) {
  for (size_t i = 0; i < n; i++) p[i] = value;
}

// A copy in double (exact for float input), for feeding the reference the very same numbers.
template <typename T>
std::vector<double> to_double(const T* p, size_t n) {
  return std::vector<double>(p, p + n);
}

template <typename T>
T quiet_nan() {
  return std::numeric_limits<T>::quiet_NaN();
}

struct Tolerance {
  double atol;
  double rtol;
};

struct CloseStats {
  size_t failures = 0;
  size_t worst = 0;             // index with the largest fraction of its threshold
  double worst_fraction = 0;    // |a - ref| / (atol + rtol |ref|) at `worst` (inf for NaN)
  double max_abs_diff = 0;
  double max_rel_diff = 0;      // |a - ref| / |ref| over elements with ref != 0
  size_t nan_count = 0;         // elements where actual or ref is NaN (never close)
  double worst_actual = 0, worst_ref = 0;
};

template <typename A>
CloseStats compare_close(const A* actual, const double* ref, size_t n, double atol, double rtol) {
  CloseStats st;
  for (size_t i = 0; i < n; i++) {
    const double a = static_cast<double>(actual[i]);
    const double r = ref[i];
    const double diff = std::fabs(a - r);
    const double threshold = atol + rtol * std::fabs(r);
    const bool ok = diff <= threshold;  // false for NaN
    double fraction;
    if (ok)
      fraction = threshold > 0 ? diff / threshold : 0.0;
    else
      fraction = std::isnan(diff) || threshold == 0 ? INFINITY : diff / threshold;
    if (!ok) st.failures++;
    if (std::isnan(diff)) {
      st.nan_count++;
    } else {
      st.max_abs_diff = std::max(st.max_abs_diff, diff);
      if (r != 0) st.max_rel_diff = std::max(st.max_rel_diff, diff / std::fabs(r));
    }
    if (i == 0 || fraction > st.worst_fraction) {
      st.worst_fraction = fraction;
      st.worst = i;
      st.worst_actual = a;
      st.worst_ref = r;
    }
  }
  return st;
}

inline bool verbose_checks() {
  const char* v = std::getenv("SHARDTRAIN_TEST_VERBOSE");
  return v && *v && std::strcmp(v, "0") != 0;
}

// Elementwise |actual - ref| <= atol + rtol |ref|; on failure one ADD_FAILURE with the worst element.
template <typename A>
bool expect_close(const A* actual, const double* ref, size_t n, double atol, double rtol, const std::string& label) {
  const CloseStats st = compare_close(actual, ref, n, atol, rtol);
  if (verbose_checks())
    std::printf("    [check] %-48s n=%-6zu used %6.3f of threshold (max abs %.3g, max rel %.3g)\n", label.c_str(), n,
                st.worst_fraction, st.max_abs_diff, st.max_rel_diff);
  if (st.failures == 0) return true;
  char detail[512];
  std::snprintf(detail, sizeof detail,
                ": %zu of %zu elements outside |a-ref| <= atol + rtol*|ref| (atol %.3g, rtol %.3g)\n"
                "  max abs diff %.3g, max rel diff %.3g, NaN elements %zu\n"
                "  worst index %zu: actual %.9g, ref %.9g, used %.3g x the threshold",
                st.failures, n, atol, rtol, st.max_abs_diff, st.max_rel_diff, st.nan_count, st.worst, st.worst_actual,
                st.worst_ref, st.worst_fraction);
  ADD_FAILURE() << label << detail;
  return false;
}

template <typename A>
bool expect_close(const A* actual, const std::vector<double>& ref, double atol, double rtol, const std::string& label) {
  return expect_close(actual, ref.data(), ref.size(), atol, rtol, label);
}

template <typename A>
bool expect_close(const A* actual, const std::vector<double>& ref, Tolerance tol, const std::string& label) {
  return expect_close(actual, ref.data(), ref.size(), tol.atol, tol.rtol, label);
}

// The sentinel written into a buffer's guard zones: a quiet NaN for floating types (so a read past
// the end poisons the result) and an unlikely bit pattern for integers. The payload bits carry a
// hash of the buffer's name, so a NaN copied from another buffer's guard (out[n] = a[n] + b[n]
// one past the end) does not pass for this buffer's own sentinel. Compared bitwise.
inline uint64_t name_hash(const std::string& name) {
  uint64_t h = 0xCBF29CE484222325ull;  // FNV-1a
  for (unsigned char ch : name) h = (h ^ ch) * 0x100000001B3ull;
  return h;
}

template <typename T>
T guard_sentinel(const std::string& name) {
  const uint64_t h = name_hash(name);
  if constexpr (std::is_same_v<T, float>) {
    const uint32_t bits = 0x7FC00000u | static_cast<uint32_t>(h & 0x3FFFFF) | 1u;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  } else if constexpr (std::is_same_v<T, double>) {
    const uint64_t bits = 0x7FF8000000000000ull | (h & 0x7FFFFFFFFFFFFull) | 1u;
    double d;
    std::memcpy(&d, &bits, sizeof d);
    return d;
  } else {
    return static_cast<T>(0x5EB70000 ^ static_cast<int>(h & 0xFFFF));
  }
}

// n elements with `guard` sentinel elements before and after. data() points at element 0. Call
// expect_guards_intact() after each call that writes (or may wrongly write) the buffer.
template <typename T>
class GuardedBuffer {
 public:
  explicit GuardedBuffer(size_t n, std::string name = "buffer", size_t guard = 16)
      : n_(n), guard_(guard), name_(std::move(name)), sentinel_(guard_sentinel<T>(name_)), storage_(n + 2 * guard) {
    for (size_t i = 0; i < guard_; i++) {
      storage_[i] = sentinel_;
      storage_[guard_ + n_ + i] = sentinel_;
    }
  }
  T* data() { return storage_.data() + guard_; }
  const T* data() const { return storage_.data() + guard_; }
  size_t size() const { return n_; }
  T& operator[](size_t i) { return data()[i]; }
  const T& operator[](size_t i) const { return data()[i]; }
  std::vector<double> to_double() const { return std::vector<double>(data(), data() + n_); }

  const std::string& name() const { return name_; }

  // One ADD_FAILURE naming the buffer, the first overwritten guard element (negative: before the
  // data, >= size(): after it) and what was found there.
  bool expect_guards_intact(const std::string& label) const {
    for (size_t i = 0; i < 2 * guard_; i++) {
      const size_t at = i < guard_ ? i : n_ + i;
      if (std::memcmp(&storage_[at], &sentinel_, sizeof(T)) != 0) {
        const long offset = at < guard_ ? static_cast<long>(at) - static_cast<long>(guard_)
                                        : static_cast<long>(at - guard_);
        ADD_FAILURE() << label << ": guard zone of '" << name_ << "' overwritten at element " << offset
                      << " (the buffer has " << n_ << " elements; found " << storage_[at] << ")";
        return false;
      }
    }
    return true;
  }

 private:
  size_t n_, guard_;
  std::string name_;
  T sentinel_;
  std::vector<T> storage_;
};

// Checks the guard zones of every buffer given.
template <typename... Buffers>
bool expect_guards_intact(const std::string& label, const Buffers&... buffers) {
  return (buffers.expect_guards_intact(label) & ...);
}

}  // namespace shardtrain::testing
