// CudnnAttention (src/backend/cuda/cudnn_attention.hpp, train.attention=cudnn) against the CPU
// reference attention (backend/cpu/attention.cpp) on random inputs: forward out and lse, backward
// dqkv, for odd T, grouped-query heads (KV = NH, NH/2, 1) and head sizes 64 and 128; the refusal
// of head sizes cuDNN has no engine for; bit-identical repeated calls; the memory held against the
// memory plan (staging exactly, cuDNN's workspace within the estimate); bf16 copies of qkv and out
// (16-bit activations) read in place of staging them; the unmasked graph (FLUX's joint attention)
// against the CPU without the mask. Plus a disabled benchmark, cuDNN against the tiled kernels at
// GPT-2 small's heads and at FLUX.1's joint attention (docs/gpu.md, "Attention kernels"):
//   gpu_tests --gtest_also_run_disabled_tests --gtest_filter='CudnnAttentionBench.*'
//
// The oracle is the CPU's fp32 attention of the bf16-rounded inputs (qkv, and dout), which is what
// cuDNN is given: the comparison then measures cuDNN's own arithmetic. Its tolerance model:
// scores, softmax statistics and accumulations are fp32 on both sides (errors ~1e-6); cuDNN rounds
// to bf16 (relative error <= 2^-9 each) the probabilities before P V and P^T dO, the score
// gradients before dS K and dS^T Q, and the outputs out and dqkv. With |v| <= 1, out is a convex
// combination: the probability roundings move it by at most 2^-9 and the output rounding by 2^-9
// |out|, so |out error| <= 2^-8. The gradients are sums of such rounded terms whose size is set
// by the largest gradient of that part (dq, dk, dv) of the tensor: we allow 4 * 2^-8 of the part's
// largest |value| plus 2^-8 relative -- a few bf16 roundings of each term, with room for the sums
// of several (the group's heads, the causal rows). A wrong mask, head mapping, scale or layout
// moves elements by O(their size), ten times and more beyond that. lse is fp32 statistics of fp32
// scores: 1e-4 absolute (hardware exp2 approximations), far below the ~1/T change of one key.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "app/compute_options.hpp"
#include "app/memory_plan.hpp"
#include "backend/cpu/ops.hpp"
#include "backend/cuda/cuda_backend.hpp"
#include "backend/cuda/cudnn_attention.hpp"
#include "backend/dtype.hpp"
#include "backend/gpu_memory.hpp"
#include "support/tensor_check.hpp"

namespace {

using namespace shardtrain;
using shardtrain::testing::expect_close;
using shardtrain::testing::fill_uniform;
using shardtrain::testing::Tolerance;

constexpr double kBf16 = 0x1p-8;  // twice bf16's unit roundoff: one rounding of a value and one of its terms

struct Shape {
  int B, T, NH, KV, HS;
  size_t row() const { return static_cast<size_t>(NH + 2 * KV) * HS; }
  size_t qkv() const { return static_cast<size_t>(B) * T * row(); }
  size_t out() const { return static_cast<size_t>(B) * T * NH * HS; }
  size_t lse() const { return static_cast<size_t>(B) * NH * T; }
};
std::string name_of(const Shape& s) {
  return "B" + std::to_string(s.B) + "_T" + std::to_string(s.T) + "_NH" + std::to_string(s.NH) + "_KV" +
         std::to_string(s.KV) + "_HS" + std::to_string(s.HS);
}
void PrintTo(const Shape& s, std::ostream* os) { *os << name_of(s); }

std::vector<float> bf16_rounded(std::vector<float> v) {
  for (float& x : v) x = half_to_float(float_to_half(x, DTYPE_BF16), DTYPE_BF16);
  return v;
}
std::vector<float> uniform(size_t n, uint64_t seed) {
  std::vector<float> v(n);
  fill_uniform(v.data(), n, seed, -1.0, 1.0);
  return v;
}
std::vector<double> widen(const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); }

// Device copies of host vectors and back (the device's own copies; the caching allocator's memory).
struct Gpu {
  std::unique_ptr<CudaDevice> device = CudaDevice::open(0);
  std::unique_ptr<CudnnAttention> cudnn = std::make_unique<CudnnAttention>(*device);

  ~Gpu() { cudnn.reset(); }  // before the device
  DeviceArray<float> upload(const std::vector<float>& v) {
    DeviceArray<float> d(*device, v.size());
    device->copy_to_device(d.data(), v.data(), v.size() * sizeof(float));
    return d;
  }
  DeviceArray<float> filled(size_t n, float value) { return upload(std::vector<float>(n, value)); }
  DeviceArray<int> upload_ints(const std::vector<int>& v) {
    DeviceArray<int> d(*device, v.size());
    device->copy_to_device(d.data(), v.data(), v.size() * sizeof(int));
    return d;
  }
  // v rounded to bf16 on the host, in an allocation of its own (so 16-byte aligned, as cuDNN needs).
  DeviceArray<uint16_t> upload_bf16(const std::vector<float>& v) {
    std::vector<uint16_t> halves(v.size());
    for (size_t i = 0; i < v.size(); i++) halves[i] = float_to_half(v[i], DTYPE_BF16);
    DeviceArray<uint16_t> d(*device, halves.size());
    device->copy_to_device(d.data(), halves.data(), d.bytes());
    return d;
  }
  std::vector<float> download(const DeviceArray<float>& d) {
    std::vector<float> v(d.size());
    device->copy_to_host(v.data(), d.data(), d.bytes());
    return v;
  }
};

class CudnnAttentionTest : public ::testing::TestWithParam<Shape> {
 protected:
  static void SetUpTestSuite() { gpu_ = new Gpu; }
  static void TearDownTestSuite() {
    delete gpu_;
    gpu_ = nullptr;
  }
  static Gpu& gpu() { return *gpu_; }

 private:
  static inline Gpu* gpu_ = nullptr;
};

// Per part of dqkv (the q, k and v columns of each row): 4 * 2^-8 of the part's largest |value|,
// that scale no smaller than 2^-16 of dqkv's largest |value|. The floor is for parts whose exact
// gradient is zero: at T = 1 each query sees one key, its softmax is the constant 1, and dq and dk
// vanish; cuDNN gives 0, the fp32 reference its rounding noise (dS = P (dP - D) cancels to a few
// fp32 ulps of dP, which is of dv's size), so a tolerance scaled by that noise alone fails on 0.
void expect_dqkv_close(const std::vector<float>& actual, const std::vector<float>& ref, const Shape& s) {
  const size_t q_cols = static_cast<size_t>(s.NH) * s.HS, kv_cols = static_cast<size_t>(s.KV) * s.HS;
  double largest_overall = 0;
  for (float x : ref) largest_overall = std::max(largest_overall, std::fabs(static_cast<double>(x)));
  const struct {
    const char* name;
    size_t begin, width;
  } parts[] = {{"dq", 0, q_cols}, {"dk", q_cols, kv_cols}, {"dv", q_cols + kv_cols, kv_cols}};
  for (const auto& part : parts) {
    std::vector<float> got, want;
    for (size_t r = 0; r < static_cast<size_t>(s.B) * s.T; r++)
      for (size_t c = part.begin; c < part.begin + part.width; c++) {
        got.push_back(actual[r * s.row() + c]);
        want.push_back(ref[r * s.row() + c]);
      }
    double largest = 0;
    for (float x : want) largest = std::max(largest, std::fabs(static_cast<double>(x)));
    ASSERT_GT(largest_overall, 0.0) << "a reference gradient of zeros tests nothing";
    const double scale = std::max(largest, largest_overall / 65536);
    expect_close(got.data(), widen(want), Tolerance{4 * kBf16 * scale, kBf16}, std::string("cudnn ") + part.name);
  }
}

TEST_P(CudnnAttentionTest, ForwardMatchesCpu) {
  const Shape s = GetParam();
  const std::vector<float> qkv = bf16_rounded(uniform(s.qkv(), 31));
  std::vector<float> out(s.out()), lse(s.lse());
  cpu::attention_forward(out.data(), lse.data(), qkv.data(), s.B, s.T, s.NH, s.KV, s.HS);

  auto d_qkv = gpu().upload(qkv);
  auto d_out = gpu().filled(s.out(), NAN), d_lse = gpu().filled(s.lse(), NAN);  // unwritten elements fail
  ASSERT_TRUE(gpu().cudnn->forward(d_out.data(), d_lse.data(), d_qkv.data(), s.B, s.T, s.NH, s.KV, s.HS))
      << "cuDNN refused a supported shape (its reason is printed above)";
  expect_close(gpu().download(d_lse).data(), widen(lse), Tolerance{1e-4, 0.0}, "cudnn lse");
  expect_close(gpu().download(d_out).data(), widen(out), Tolerance{kBf16, 0.0}, "cudnn out");
}

TEST_P(CudnnAttentionTest, BackwardMatchesCpu) {
  const Shape s = GetParam();
  const std::vector<float> qkv = bf16_rounded(uniform(s.qkv(), 41)), dout = bf16_rounded(uniform(s.out(), 42));
  auto d_qkv = gpu().upload(qkv), d_dout = gpu().upload(dout);
  auto d_out = gpu().filled(s.out(), NAN), d_lse = gpu().filled(s.lse(), NAN), d_dqkv = gpu().filled(s.qkv(), NAN);
  ASSERT_TRUE(gpu().cudnn->forward(d_out.data(), d_lse.data(), d_qkv.data(), s.B, s.T, s.NH, s.KV, s.HS));
  // The reference backward takes cuDNN's forward (out and lse) too, so that only the backward's
  // own arithmetic is compared (the forward is ForwardMatchesCpu's).
  const std::vector<float> out = gpu().download(d_out), lse = gpu().download(d_lse);
  std::vector<float> dqkv(s.qkv());
  cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), s.B, s.T, s.NH, s.KV, s.HS);
  ASSERT_TRUE(gpu().cudnn->backward(d_dqkv.data(), d_dout.data(), d_qkv.data(), d_out.data(), d_lse.data(), s.B, s.T,
                                    s.NH, s.KV, s.HS))
      << "cuDNN refused a supported shape (its reason is printed above)";
  expect_dqkv_close(gpu().download(d_dqkv), dqkv, s);
}

// The unmasked graph (a diffusion transformer's joint attention, KV = NH there but any grouping
// here) against the CPU's attention without the mask, forward and backward; and it is not the
// causal graph: their outputs differ beyond T = 1.
// A masked graph's output (`graph` names it) differs from the plain causal graph's on the same qkv:
// the mask took effect.
void expect_not_the_causal_output(Gpu& gpu, const Shape& s, const DeviceArray<float>& d_qkv,
                                  const std::vector<float>& got_out, const std::string& graph) {
  auto c_out = gpu.filled(s.out(), NAN), c_lse = gpu.filled(s.lse(), NAN);
  ASSERT_TRUE(gpu.cudnn->forward(c_out.data(), c_lse.data(), d_qkv.data(), s.B, s.T, s.NH, s.KV, s.HS));
  const std::vector<float> causal = gpu.download(c_out);
  EXPECT_NE(std::memcmp(causal.data(), got_out.data(), causal.size() * sizeof(float)), 0)
      << graph << " gave the causal graph's output";
}

TEST_P(CudnnAttentionTest, UnmaskedMatchesCpuWithoutTheMask) {
  const Shape s = GetParam();
  const std::vector<float> qkv = bf16_rounded(uniform(s.qkv(), 61)), dout = bf16_rounded(uniform(s.out(), 62));
  std::vector<float> out(s.out()), lse(s.lse());
  cpu::attention_forward(out.data(), lse.data(), qkv.data(), s.B, s.T, s.NH, s.KV, s.HS, cpu::AttentionTiles(), false);
  auto d_qkv = gpu().upload(qkv), d_dout = gpu().upload(dout);
  auto d_out = gpu().filled(s.out(), NAN), d_lse = gpu().filled(s.lse(), NAN), d_dqkv = gpu().filled(s.qkv(), NAN);
  ASSERT_TRUE(gpu().cudnn->forward(d_out.data(), d_lse.data(), d_qkv.data(), s.B, s.T, s.NH, s.KV, s.HS, nullptr, false))
      << "cuDNN refused the unmasked graph (its reason is printed above)";
  const std::vector<float> got_out = gpu().download(d_out), got_lse = gpu().download(d_lse);
  expect_close(got_lse.data(), widen(lse), Tolerance{1e-4, 0.0}, "unmasked cudnn lse");
  expect_close(got_out.data(), widen(out), Tolerance{kBf16, 0.0}, "unmasked cudnn out");
  std::vector<float> dqkv(s.qkv());
  cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), got_out.data(), got_lse.data(), s.B, s.T, s.NH, s.KV,
                          s.HS, cpu::AttentionTiles(), false);
  ASSERT_TRUE(gpu().cudnn->backward(d_dqkv.data(), d_dout.data(), d_qkv.data(), d_out.data(), d_lse.data(), s.B, s.T,
                                    s.NH, s.KV, s.HS, nullptr, nullptr, false));
  expect_dqkv_close(gpu().download(d_dqkv), dqkv, s);
  if (s.T > 1) expect_not_the_causal_output(gpu(), s, d_qkv, got_out, "the unmasked graph");
}

// Packed documents: each sequence cut into documents of 1, 2, 3, ... tokens (the last what is
// left), row t seeing only its own document's keys; cuDNN's graph with the documents' score bias
// against the CPU with the same doc_start, and differing from the graph without it.
TEST_P(CudnnAttentionTest, PackedDocumentsMatchCpu) {
  const Shape s = GetParam();
  std::vector<int> doc_start(static_cast<size_t>(s.B) * s.T);
  for (int b = 0; b < s.B; b++)
    for (int t = 0, start = 0, length = 1 + b; t < s.T; t++) {
      if (t - start == length) start = t, length++;
      doc_start[static_cast<size_t>(b) * s.T + t] = start;
    }
  const std::vector<float> qkv = bf16_rounded(uniform(s.qkv(), 71)), dout = bf16_rounded(uniform(s.out(), 72));
  std::vector<float> out(s.out()), lse(s.lse());
  cpu::attention_forward(out.data(), lse.data(), qkv.data(), s.B, s.T, s.NH, s.KV, s.HS, cpu::AttentionTiles(), true,
                         doc_start.data());
  auto d_qkv = gpu().upload(qkv), d_dout = gpu().upload(dout);
  auto d_docs = gpu().upload_ints(doc_start);
  auto d_out = gpu().filled(s.out(), NAN), d_lse = gpu().filled(s.lse(), NAN), d_dqkv = gpu().filled(s.qkv(), NAN);
  ASSERT_TRUE(gpu().cudnn->forward(d_out.data(), d_lse.data(), d_qkv.data(), s.B, s.T, s.NH, s.KV, s.HS, nullptr, true,
                                   d_docs.data()))
      << "cuDNN refused the packed documents' graph (its reason is printed above)";
  const std::vector<float> got_out = gpu().download(d_out), got_lse = gpu().download(d_lse);
  expect_close(got_lse.data(), widen(lse), Tolerance{1e-4, 0.0}, "documents cudnn lse");
  expect_close(got_out.data(), widen(out), Tolerance{kBf16, 0.0}, "documents cudnn out");
  std::vector<float> dqkv(s.qkv());
  cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), got_out.data(), got_lse.data(), s.B, s.T, s.NH, s.KV,
                          s.HS, cpu::AttentionTiles(), true, doc_start.data());
  ASSERT_TRUE(gpu().cudnn->backward(d_dqkv.data(), d_dout.data(), d_qkv.data(), d_out.data(), d_lse.data(), s.B, s.T,
                                    s.NH, s.KV, s.HS, nullptr, nullptr, true, d_docs.data()));
  expect_dqkv_close(gpu().download(d_dqkv), dqkv, s);
  if (s.T > 2) expect_not_the_causal_output(gpu(), s, d_qkv, got_out, "the documents' graph");
  // The next micro-batch rewrites the same array (here: one document per row) and says so: the
  // bias built for the first documents must not be reused.
  const std::vector<int> one_document(doc_start.size(), 0);
  gpu().device->copy_to_device(d_docs.data(), one_document.data(), one_document.size() * sizeof(int));
  gpu().cudnn->documents_changed(d_docs.data());
  ASSERT_TRUE(gpu().cudnn->forward(d_out.data(), d_lse.data(), d_qkv.data(), s.B, s.T, s.NH, s.KV, s.HS, nullptr, true,
                                   d_docs.data()));
  std::vector<float> causal_out(s.out()), causal_lse(s.lse());
  cpu::attention_forward(causal_out.data(), causal_lse.data(), qkv.data(), s.B, s.T, s.NH, s.KV, s.HS);
  expect_close(gpu().download(d_out).data(), widen(causal_out), Tolerance{kBf16, 0.0}, "documents rewritten, out");
}

// Same inputs, same bits: the forward and the (deterministic) backward twice.
TEST_P(CudnnAttentionTest, RepeatedCallsAreBitIdentical) {
  const Shape s = GetParam();
  auto d_qkv = gpu().upload(uniform(s.qkv(), 51)), d_dout = gpu().upload(uniform(s.out(), 52));
  std::vector<float> first[3];
  for (int call = 0; call < 2; call++) {
    auto d_out = gpu().filled(s.out(), NAN), d_lse = gpu().filled(s.lse(), NAN), d_dqkv = gpu().filled(s.qkv(), NAN);
    ASSERT_TRUE(gpu().cudnn->forward(d_out.data(), d_lse.data(), d_qkv.data(), s.B, s.T, s.NH, s.KV, s.HS));
    ASSERT_TRUE(gpu().cudnn->backward(d_dqkv.data(), d_dout.data(), d_qkv.data(), d_out.data(), d_lse.data(), s.B, s.T,
                                      s.NH, s.KV, s.HS));
    const std::vector<float> now[3] = {gpu().download(d_out), gpu().download(d_lse), gpu().download(d_dqkv)};
    for (int i = 0; i < 3; i++) {
      if (call == 0) {
        first[i] = now[i];
      } else {
        static const char* names[3] = {"out", "lse", "dqkv"};
        ASSERT_EQ(now[i].size(), first[i].size());
        EXPECT_EQ(std::memcmp(now[i].data(), first[i].data(), now[i].size() * sizeof(float)), 0)
            << names[i] << " differs between two identical calls";
      }
    }
  }
}

// 16-bit activations: with bf16 copies of qkv and out (what CudaLayerOps passes for buffers bound
// to it) the forward and backward give the bits of staging them, and it is the copies that cuDNN
// reads: the fp32 qkv and out passed beside them are NaN. A fresh CudnnAttention given the copies
// stages no qkv.
TEST_P(CudnnAttentionTest, Bf16CopiesAreReadInPlaceOfStaging) {
  const Shape s = GetParam();
  const std::vector<float> qkv = bf16_rounded(uniform(s.qkv(), 91));
  auto d_qkv = gpu().upload(qkv), d_dout = gpu().upload(uniform(s.out(), 92));
  auto d_out = gpu().filled(s.out(), NAN), d_lse = gpu().filled(s.lse(), NAN), d_dqkv = gpu().filled(s.qkv(), NAN);
  ASSERT_TRUE(gpu().cudnn->forward(d_out.data(), d_lse.data(), d_qkv.data(), s.B, s.T, s.NH, s.KV, s.HS));
  ASSERT_TRUE(gpu().cudnn->backward(d_dqkv.data(), d_dout.data(), d_qkv.data(), d_out.data(), d_lse.data(), s.B, s.T,
                                    s.NH, s.KV, s.HS));
  const std::vector<float> staged[3] = {gpu().download(d_out), gpu().download(d_lse), gpu().download(d_dqkv)};

  CudnnAttention cudnn(*gpu().device);  // fresh: its staging grows from nothing
  DeviceArray<uint16_t> qkv16 = gpu().upload_bf16(qkv), out16 = gpu().upload_bf16(staged[0]);
  auto nan_qkv = gpu().filled(s.qkv(), NAN), nan_out = gpu().filled(s.out(), NAN);
  auto c_out = gpu().filled(s.out(), NAN), c_lse = gpu().filled(s.lse(), NAN), c_dqkv = gpu().filled(s.qkv(), NAN);
  ASSERT_TRUE(cudnn.forward(c_out.data(), c_lse.data(), nan_qkv.data(), s.B, s.T, s.NH, s.KV, s.HS, qkv16.data()));
  EXPECT_EQ(cudnn.staging_bytes(), gpu::cudnn_attention_out_bytes(s.B, s.T, s.NH, s.HS)) << "qkv was staged";
  ASSERT_TRUE(cudnn.backward(c_dqkv.data(), d_dout.data(), nan_qkv.data(), nan_out.data(), c_lse.data(), s.B, s.T,
                             s.NH, s.KV, s.HS, qkv16.data(), out16.data()));
  const std::vector<float> from_copies[3] = {gpu().download(c_out), gpu().download(c_lse), gpu().download(c_dqkv)};
  static const char* names[3] = {"out", "lse", "dqkv"};
  for (int i = 0; i < 3; i++) {
    ASSERT_EQ(from_copies[i].size(), staged[i].size());
    EXPECT_EQ(std::memcmp(from_copies[i].data(), staged[i].data(), staged[i].size() * sizeof(float)), 0)
        << names[i] << " differs between staged inputs and their bf16 copies";
  }
}

// T = 1, 7, 33, 130 (odd, and not multiples of cuDNN's 64/128 tiles); GQA groups of 1, 2 and NH;
// head sizes 64 and 128. One realistic GPT-2 small shape.
INSTANTIATE_TEST_SUITE_P(Shapes, CudnnAttentionTest,
                         ::testing::Values(Shape{2, 1, 4, 4, 64}, Shape{2, 7, 4, 2, 64}, Shape{1, 33, 4, 1, 64},
                                           Shape{2, 130, 4, 4, 128}, Shape{1, 130, 6, 3, 128},
                                           Shape{1, 33, 2, 1, 128}, Shape{2, 256, 12, 12, 64}),
                         [](const ::testing::TestParamInfo<Shape>& info) { return name_of(info.param); });

// Head sizes cuDNN has no engine for: refused before cuDNN is asked, nothing written (the caller
// runs the tiled kernels), and supported sizes are not refused.
TEST(CudnnAttentionLimits, UnsupportedHeadSizesAreRefusedWithoutWriting) {
  EXPECT_NE(CudnnAttention::unsupported_reason(64, 60, false), "");
  EXPECT_NE(CudnnAttention::unsupported_reason(64, 256, true), "");
  EXPECT_EQ(CudnnAttention::unsupported_reason(128, 64, true), "");
  EXPECT_EQ(CudnnAttention::unsupported_reason(7, 128, false), "");

  Gpu gpu;
  const Shape s{1, 5, 2, 2, 12};  // 12: not a multiple of 8
  auto d_qkv = gpu.upload(uniform(s.qkv(), 61));
  auto d_out = gpu.filled(s.out(), 7.0f), d_lse = gpu.filled(s.lse(), 7.0f), d_dqkv = gpu.filled(s.qkv(), 7.0f);
  EXPECT_FALSE(gpu.cudnn->forward(d_out.data(), d_lse.data(), d_qkv.data(), s.B, s.T, s.NH, s.KV, s.HS));
  EXPECT_FALSE(gpu.cudnn->backward(d_dqkv.data(), d_out.data(), d_qkv.data(), d_out.data(), d_lse.data(), s.B, s.T,
                                   s.NH, s.KV, s.HS));
  for (const auto* d : {&d_out, &d_lse, &d_dqkv})
    for (float x : gpu.download(*d)) ASSERT_EQ(x, 7.0f) << "a refused call wrote its output";
}

// The memory plan (app/memory_plan.hpp's plan_cudnn_attention, what train.attention=cudnn adds to
// the GPU plan) against what a fresh CudnnAttention holds after a forward and after a backward of
// one shape: the staging exactly (also written out here: bf16 qkv and out after the forward; then
// bf16 dqkv and dout and fp32 row sums too), cuDNN's workspace at most the plan's estimate (the
// real and the estimated numbers are printed). An lse that is not 16-byte aligned adds the lse
// copy, B*NH*T floats, which the plan leaves out (every model's lse is its own allocation).
TEST(CudnnAttentionMemory, StagingIsThePlannedStagingAndTheWorkspaceWithinTheEstimate) {
  Gpu gpu;
  for (const Shape& s : {Shape{2, 128, 4, 4, 64}, Shape{1, 256, 6, 3, 128}, Shape{3, 384, 8, 2, 32},
                         Shape{2, 130, 4, 1, 64}, Shape{8, 1024, 12, 12, 64}}) {
    SCOPED_TRACE(name_of(s));
    ModelConfig model;
    model.arch = "llama", model.n_embd = s.NH * s.HS, model.n_head = s.NH, model.n_kv_head = s.KV;
    ComputeOptions compute;
    compute.device = "cuda", compute.attention = ATTENTION_CUDNN;
    const gpu::CudnnAttentionMemory forward_plan = gpu::cudnn_attention_memory(s.B, s.T, s.NH, s.KV, s.HS, false);
    const gpu::CudnnAttentionMemory plan = plan_cudnn_attention(model, {}, s.B, s.T, compute);
    const size_t qkv16 = s.qkv() * 2, out16 = s.out() * 2, rows = s.lse() * 4;

    CudnnAttention cudnn(*gpu.device);  // fresh: its buffers grow from nothing
    auto d_qkv = gpu.upload(uniform(s.qkv(), 81)), d_dout = gpu.upload(uniform(s.out(), 82));
    auto d_out = gpu.filled(s.out(), 0), d_lse = gpu.filled(s.lse(), 0), d_dqkv = gpu.filled(s.qkv(), 0);
    ASSERT_TRUE(cudnn.forward(d_out.data(), d_lse.data(), d_qkv.data(), s.B, s.T, s.NH, s.KV, s.HS));
    EXPECT_EQ(cudnn.staging_bytes(), qkv16 + out16);
    EXPECT_EQ(cudnn.staging_bytes(), forward_plan.staging());
    EXPECT_LE(cudnn.workspace_bytes(), forward_plan.workspace);
    std::printf("cudnn forward %s: workspace %zu B, estimate %zu B\n", name_of(s).c_str(), cudnn.workspace_bytes(),
                forward_plan.workspace);

    if (!CudnnAttention::unsupported_reason(s.T, s.HS, true).empty()) continue;  // this cuDNN: the tiled backward
    ASSERT_TRUE(cudnn.backward(d_dqkv.data(), d_dout.data(), d_qkv.data(), d_out.data(), d_lse.data(), s.B, s.T,
                               s.NH, s.KV, s.HS));
    EXPECT_EQ(cudnn.staging_bytes(), 2 * qkv16 + 2 * out16 + rows);
    EXPECT_EQ(cudnn.staging_bytes(), plan.staging());
    EXPECT_LE(cudnn.workspace_bytes(), plan.workspace);
    std::printf("cudnn forward + backward %s: workspace %zu B, estimate %zu B (dP alone %zu B)\n", name_of(s).c_str(),
                cudnn.workspace_bytes(), plan.workspace, static_cast<size_t>(s.B) * s.NH * s.T * s.T * 2);

    // An lse one float past an aligned address: staged through the lse copy.
    auto d_lse_unaligned = gpu.filled(s.lse() + 4, 0);
    ASSERT_TRUE(cudnn.forward(d_out.data(), d_lse_unaligned.data() + 1, d_qkv.data(), s.B, s.T, s.NH, s.KV, s.HS));
    EXPECT_EQ(cudnn.staging_bytes(), plan.staging() + rows);
    EXPECT_EQ(rows, gpu::cudnn_attention_row_bytes(s.B, s.T, s.NH));
  }
}

// ---- benchmark (disabled by default) -------------------------------------------------------------
// Forward + backward, cuDNN against the tiled fp32 kernels (make_cuda_layer_ops), at GPT-2 small's
// heads: B = 8, NH = 12, HS = 64, T = 1024 and 4096. Milliseconds per forward + backward (median
// of 10 after 3 warm-up runs, CUDA events on the compute stream) and the ratio.
double median_ms(CudaDevice& device, int runs, const std::function<void()>& step) {
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(device.compute_stream());
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  for (int i = 0; i < 3; i++) step();
  std::vector<float> ms;
  for (int i = 0; i < runs; i++) {
    cudaEventRecord(start, stream);
    step();
    cudaEventRecord(stop, stream);
    cudaEventSynchronize(stop);
    float t = 0;
    cudaEventElapsedTime(&t, start, stop);
    ms.push_back(t);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

TEST(CudnnAttentionBench, DISABLED_CudnnAgainstTiled) {
  Gpu gpu;
  std::unique_ptr<LayerOps<float>> tiled = make_cuda_layer_ops(*gpu.device);
  for (int T : {1024, 4096}) {
    const Shape s{8, T, 12, 12, 64};
    auto d_qkv = gpu.upload(uniform(s.qkv(), 71)), d_dout = gpu.upload(uniform(s.out(), 72));
    auto d_out = gpu.filled(s.out(), 0), d_lse = gpu.filled(s.lse(), 0), d_dqkv = gpu.filled(s.qkv(), 0);
    const double tiled_ms = median_ms(*gpu.device, 10, [&] {
      tiled->attention_forward(d_out.data(), d_lse.data(), d_qkv.data(), s.B, s.T, s.NH, s.KV, s.HS, nullptr);
      tiled->attention_backward(d_dqkv.data(), d_dout.data(), d_qkv.data(), d_out.data(), d_lse.data(), s.B, s.T, s.NH,
                                s.KV, s.HS, nullptr);
    });
    bool ran = true;
    const double cudnn_ms = median_ms(*gpu.device, 10, [&] {
      ran = gpu.cudnn->forward(d_out.data(), d_lse.data(), d_qkv.data(), s.B, s.T, s.NH, s.KV, s.HS) &&
            gpu.cudnn->backward(d_dqkv.data(), d_dout.data(), d_qkv.data(), d_out.data(), d_lse.data(), s.B, s.T,
                                s.NH, s.KV, s.HS);
    });
    ASSERT_TRUE(ran) << "cuDNN refused " << name_of(s);
    std::printf("attention fwd+bwd %s: tiled %.2f ms, cudnn %.2f ms, tiled/cudnn %.2fx; cudnn workspace %.1f MiB, "
                "staging %.1f MiB\n",
                name_of(s).c_str(), tiled_ms, cudnn_ms, tiled_ms / cudnn_ms, gpu.cudnn->workspace_bytes() / 1048576.0,
                gpu.cudnn->staging_bytes() / 1048576.0);
  }
  // FLUX.1's joint attention at 512² (512 text + 1024 image tokens, 24 heads of 128), unmasked.
  const Shape s{1, 1536, 24, 24, 128};
  auto d_qkv = gpu.upload(uniform(s.qkv(), 73)), d_dout = gpu.upload(uniform(s.out(), 74));
  auto d_out = gpu.filled(s.out(), 0), d_lse = gpu.filled(s.lse(), 0), d_dqkv = gpu.filled(s.qkv(), 0);
  const double tiled_ms = median_ms(*gpu.device, 10, [&] {
    tiled->bidirectional_attention_forward(d_out.data(), d_lse.data(), d_qkv.data(), s.B, s.T, s.NH, s.HS);
    tiled->bidirectional_attention_backward(d_dqkv.data(), d_dout.data(), d_qkv.data(), d_out.data(), d_lse.data(),
                                            s.B, s.T, s.NH, s.HS);
  });
  bool ran = true;
  const double cudnn_ms = median_ms(*gpu.device, 10, [&] {
    ran = gpu.cudnn->forward(d_out.data(), d_lse.data(), d_qkv.data(), s.B, s.T, s.NH, s.KV, s.HS, nullptr, false) &&
          gpu.cudnn->backward(d_dqkv.data(), d_dout.data(), d_qkv.data(), d_out.data(), d_lse.data(), s.B, s.T, s.NH,
                              s.KV, s.HS, nullptr, nullptr, false);
  });
  ASSERT_TRUE(ran) << "cuDNN refused the unmasked " << name_of(s);
  std::printf("attention fwd+bwd %s unmasked: tiled %.2f ms, cudnn %.2f ms, tiled/cudnn %.2fx\n", name_of(s).c_str(),
              tiled_ms, cudnn_ms, tiled_ms / cudnn_ms);
}

}  // namespace
