// The CUDA backend's LayerOps<float> and ShardOps (kernels/) against the CPU backend's functions
// (backend/cpu/ops.hpp, backend/dtype.hpp, backend/math.hpp), which the unit tests check against a
// double reference and finite differences. For every op: fixed-seed random inputs, the CPU result
// on host buffers, the CUDA result on device copies, compared element by element under the
// tolerance model written next to the test (support/tensor_check.hpp reports the worst element).
//
// Shapes are awkward on purpose: sizes that are not multiples of 4, 32 or the block sizes, T = 1,
// heads of odd size, grouped-query attention (groups of 2, 3, 4 query heads, and a single
// key/value head), and "misaligned" cases whose device pointers sit 4 bytes off a 16-byte
// boundary (scalar fallbacks of the float4 kernels, cuBLASLt alignment preferences, the bias
// epilogue's fallback). One case per GEMM-based op has a realistic GPT-2 shape (attention, rope
// and SwiGLU a Llama one too). Every device
// buffer has guard zones of sentinels checked on download; outputs and written gradients start
// as NaN so an element left unwritten fails; accumulated gradients start non-zero and are run
// twice (+= checked against the CPU doing the same). Deterministic ops are run twice from the
// same state and must agree bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "backend/cpu/gemm.hpp"
#include "backend/cpu/ops.hpp"
#include "backend/cuda/cuda_backend.hpp"
#include "backend/dtype.hpp"
#include "backend/gpu_memory.hpp"
#include "backend/layer_ops.hpp"
#include "backend/math.hpp"
#include "backend/quant.hpp"
#include "kernels/launch.hpp"
#include "support/tensor_check.hpp"

namespace {

using namespace shardtrain;
namespace cpu = shardtrain::cpu;
using shardtrain::testing::expect_close;
using shardtrain::testing::fill_indices;
using shardtrain::testing::fill_uniform;
using shardtrain::testing::guard_sentinel;
using shardtrain::testing::Tolerance;

// ---- tolerance models ----------------------------------------------------------------------------
//
// u = 2^-24. The unit tests (tests/unit/test_layers.cpp) show that the CPU's fp32 result of an
// output fed by a chain of K roundings (a K-term sum plus a few pointwise operations) is within
// atol = rtol = 4 K u of the exact value for our O(1) inputs. The GPU computes the same sums in
// another order (lane partials and shuffle trees, cuBLASLt's blocking and split-K, FMAs) and is
// bounded by the same model, so the two differ by at most 8 K u: fp32_pair(K). K is named next
// to each use. GEMM-based ops get their K from the reduction length, so realistic shapes
// (K ~ 1000) get a proportionally looser bound (~5e-4), still far below the O(1) error of any
// wrong term. Elementwise ops that are one IEEE operation per element, and ops whose CUDA
// version adds in the CPU's order, must be bit-identical: kExact.
constexpr double kU32 = 0x1p-24;
constexpr Tolerance kExact{0.0, 0.0};
Tolerance fp32_pair(long K) { return {8.0 * K * kU32, 8.0 * K * kU32}; }
// GELU: the same formula (backend/math.hpp) on both sides; only FMA contraction and exp_fast's
// ~2 ulp differ, a few ulp of the result, except near gelu'(x) = 0 (x ~ -0.75) where its two
// terms cancel: there the error is a few ulp of the terms (O(1)), hence the atol.
constexpr Tolerance kGeluTol{1e-6, 1e-5};
// AdamW: the same adamw_update on both sides, differing by FMA contraction only: ~1 ulp of m, v
// and of the parameter, plus lr times a few ulp of the O(1) update ratio.
constexpr Tolerance kAdamWTol{1e-7, 1e-6};

std::vector<double> widen(const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); }

std::vector<float> uniform_vector(size_t n, uint64_t seed, double lo = -1.0, double hi = 1.0) {
  std::vector<float> v(n);
  fill_uniform(v.data(), n, seed, lo, hi);
  return v;
}

std::vector<int> index_vector(size_t n, uint64_t seed, int bound) {
  std::vector<int> v(n);
  fill_indices(v.data(), n, seed, bound);
  return v;
}

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// Bitwise equality with the first differing element named.
template <typename T>
void expect_same_bits(const std::vector<T>& actual, const std::vector<T>& expected, const std::string& label) {
  ASSERT_EQ(actual.size(), expected.size()) << label;
  for (size_t i = 0; i < actual.size(); i++) {
    if (std::memcmp(&actual[i], &expected[i], sizeof(T)) != 0) {
      ADD_FAILURE() << label << ": first difference at element " << i << " of " << actual.size() << ": got "
                    << +actual[i] << ", expected " << +expected[i];
      return;
    }
  }
}

// ---- the device under test -----------------------------------------------------------------------
struct GpuContext {
  std::unique_ptr<CudaDevice> device;
  std::unique_ptr<LayerOps<float>> ops;
  std::unique_ptr<ShardOps> shard_ops;
};

// One CudaDevice (GPU 0) and its ops per test suite.
template <typename Base>
class GpuSuite : public Base {
 public:
  static void SetUpTestSuite() {
    gpu_ = new GpuContext;
    gpu_->device = CudaDevice::open(0);
    gpu_->ops = make_cuda_layer_ops(*gpu_->device);
    gpu_->shard_ops = make_cuda_shard_ops(*gpu_->device);
  }
  static void TearDownTestSuite() {
    delete gpu_;  // ops first, then the device (member order)
    gpu_ = nullptr;
  }

 protected:
  static CudaDevice& device() { return *gpu_->device; }
  static const LayerOps<float>& ops() { return *gpu_->ops; }
  static const ShardOps& shard_ops() { return *gpu_->shard_ops; }

 private:
  static inline GpuContext* gpu_ = nullptr;
};

// n elements of device memory between two guard zones of sentinels (support/tensor_check.hpp's,
// a NaN whose payload names the buffer). `misalign` extra front elements shift data() off the
// 16-byte alignment the allocator gives.
template <typename T>
class DeviceBuffer {
 public:
  static constexpr size_t kGuard = 16;
  DeviceBuffer(Device& device, std::string name, size_t n, int misalign = 0)
      : device_(&device), name_(std::move(name)), n_(n), front_(kGuard + misalign),
        sentinel_(guard_sentinel<T>(name_)), storage_(device, n + front_ + kGuard) {
    upload(std::vector<T>(n, T{}));
  }
  T* data() { return storage_.data() + front_; }
  size_t size() const { return n_; }

  void upload(const std::vector<T>& values) {
    ASSERT_EQ(values.size(), n_) << name_;
    std::vector<T> image(storage_.size(), sentinel_);
    std::copy(values.begin(), values.end(), image.begin() + front_);
    device_->copy_to_device(storage_.data(), image.data(), image.size() * sizeof(T));
  }
  void fill(T value) { upload(std::vector<T>(n_, value)); }

  // The data, after checking both guard zones (one failure naming the first overwritten element).
  std::vector<T> download(const std::string& label) {
    std::vector<T> image(storage_.size());
    device_->copy_to_host(image.data(), storage_.data(), image.size() * sizeof(T));
    for (size_t i = 0; i < image.size(); i++) {
      if (i >= front_ && i < front_ + n_) continue;
      if (std::memcmp(&image[i], &sentinel_, sizeof(T)) != 0) {
        ADD_FAILURE() << label << ": guard zone of '" << name_ << "' overwritten at element "
                      << static_cast<long>(i) - static_cast<long>(front_) << " (size " << n_ << ")";
        break;
      }
    }
    return std::vector<T>(image.begin() + front_, image.begin() + front_ + n_);
  }

 private:
  Device* device_;
  std::string name_;
  size_t n_, front_;
  T sentinel_;
  DeviceArray<T> storage_;
};

template <typename T>
DeviceBuffer<T> on_device(Device& device, const std::string& name, const std::vector<T>& values, int misalign) {
  DeviceBuffer<T> buffer(device, name, values.size(), misalign);
  buffer.upload(values);
  return buffer;
}

const float kNaN = std::numeric_limits<float>::quiet_NaN();

struct ShapeName {
  template <typename P>
  std::string operator()(const ::testing::TestParamInfo<P>& info) const {
    return name_of(info.param);
  }
};
std::string misaligned_suffix(int misalign) { return misalign ? "_misaligned" : ""; }

// ==================================================================================================
// Encoder. The CUDA backward adds in the CPU's order (a stable sort by token), so both directions
// are bit-identical. wpe has 3 rows beyond T whose gradient must stay untouched; V is small so
// tokens repeat.
// ==================================================================================================
struct EncoderShape {
  int B, T, C, V, misalign;
};
std::string name_of(const EncoderShape& s) {
  return "B" + std::to_string(s.B) + "_T" + std::to_string(s.T) + "_C" + std::to_string(s.C) + "_V" +
         std::to_string(s.V) + misaligned_suffix(s.misalign);
}
void PrintTo(const EncoderShape& s, std::ostream* os) { *os << name_of(s); }

class EncoderTest : public GpuSuite<::testing::TestWithParam<EncoderShape>> {};

TEST_P(EncoderTest, ForwardMatchesCpu) {
  const EncoderShape s = GetParam();
  const size_t BT = static_cast<size_t>(s.B) * s.T, maxT = s.T + 3;
  const std::vector<int> tokens = index_vector(BT, 11, s.V);
  const std::vector<float> wte = uniform_vector(static_cast<size_t>(s.V) * s.C, 12), wpe = uniform_vector(maxT * s.C, 13);
  std::vector<float> ref(BT * s.C);
  cpu::encoder_forward(ref.data(), tokens.data(), wte.data(), wpe.data(), s.B, s.T, s.C);

  auto d_tokens = on_device(device(), "tokens", tokens, s.misalign);
  auto d_wte = on_device(device(), "wte", wte, s.misalign), d_wpe = on_device(device(), "wpe", wpe, s.misalign);
  DeviceBuffer<float> d_out(device(), "out", ref.size(), s.misalign);
  d_out.fill(kNaN);
  ops().encoder_forward(d_out.data(), d_tokens.data(), d_wte.data(), d_wpe.data(), s.B, s.T, s.C, nullptr);
  expect_close(d_out.download("encoder_forward").data(), widen(ref), kExact, "encoder out");
}

TEST_P(EncoderTest, BackwardTwiceMatchesCpuBitwise) {
  const EncoderShape s = GetParam();
  const size_t BT = static_cast<size_t>(s.B) * s.T, maxT = s.T + 3;
  const std::vector<int> tokens = index_vector(BT, 21, s.V);
  const std::vector<float> dout = uniform_vector(BT * s.C, 22);
  std::vector<float> dwte = uniform_vector(static_cast<size_t>(s.V) * s.C, 23), dwpe = uniform_vector(maxT * s.C, 24);
  auto d_tokens = on_device(device(), "tokens", tokens, s.misalign);
  auto d_dout = on_device(device(), "dout", dout, s.misalign);
  auto d_dwte = on_device(device(), "dwte", dwte, s.misalign), d_dwpe = on_device(device(), "dwpe", dwpe, s.misalign);
  for (int call = 0; call < 2; call++) {  // prefilled gradients, accumulated twice
    cpu::encoder_backward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), s.B, s.T, s.C);
    ops().encoder_backward(d_dwte.data(), d_dwpe.data(), d_dout.data(), d_tokens.data(), s.B, s.T, s.C, nullptr);
  }
  expect_close(d_dwte.download("encoder_backward").data(), widen(dwte), kExact, "encoder dwte");
  expect_close(d_dwpe.download("encoder_backward").data(), widen(dwpe), kExact, "encoder dwpe");
  d_dout.download("encoder_backward (input)");
}

// Positions restarting per packed document: rows of wpe by position, dwpe scattered by position in
// the CPU's order (its sorted-run path), bit for bit.
std::vector<int> restarted_positions(int B, int T) {
  std::vector<int> positions(static_cast<size_t>(B) * T);
  for (int b = 0; b < B; b++)
    for (int t = 0, start = 0; t < T; t++) {
      if (t % 5 == 3 + b % 2) start = t;
      positions[static_cast<size_t>(b) * T + t] = t - start;
    }
  return positions;
}

TEST_P(EncoderTest, RestartedPositionsMatchCpuBitwise) {
  const EncoderShape s = GetParam();
  const size_t BT = static_cast<size_t>(s.B) * s.T;
  const std::vector<int> tokens = index_vector(BT, 25, s.V), positions = restarted_positions(s.B, s.T);
  const std::vector<float> wte = uniform_vector(static_cast<size_t>(s.V) * s.C, 26), dout = uniform_vector(BT * s.C, 27);
  std::vector<float> wpe = uniform_vector(static_cast<size_t>(s.T) * s.C, 28), dwpe = wpe, out(BT * s.C);
  cpu::encoder_forward(out.data(), tokens.data(), wte.data(), wpe.data(), s.B, s.T, s.C, positions.data());
  auto d_tokens = on_device(device(), "tokens", tokens, s.misalign), d_positions = on_device(device(), "positions", positions, 0);
  auto d_wte = on_device(device(), "wte", wte, s.misalign), d_wpe = on_device(device(), "wpe", wpe, s.misalign);
  auto d_dout = on_device(device(), "dout", dout, s.misalign), d_dwpe = on_device(device(), "dwpe", dwpe, s.misalign);
  DeviceBuffer<float> d_out(device(), "out", out.size(), s.misalign);
  ops().encoder_forward(d_out.data(), d_tokens.data(), d_wte.data(), d_wpe.data(), s.B, s.T, s.C, d_positions.data());
  expect_close(d_out.download("encoder_forward").data(), widen(out), kExact, "encoder out with positions");
  cpu::encoder_backward<float>(nullptr, dwpe.data(), dout.data(), tokens.data(), s.B, s.T, s.C, positions.data());
  ops().encoder_backward(nullptr, d_dwpe.data(), d_dout.data(), d_tokens.data(), s.B, s.T, s.C, d_positions.data());
  expect_close(d_dwpe.download("encoder_backward").data(), widen(dwpe), kExact, "encoder dwpe with positions");
}

// Llama: no position table (null wpe, dwpe). The forward copies the token rows bit for bit, -0
// included (an added +0 would make it +0); the backward leaves the absent dwpe alone.
TEST_P(EncoderTest, WithoutPositionTableMatchesCpuBitwise) {
  const EncoderShape s = GetParam();
  const size_t BT = static_cast<size_t>(s.B) * s.T;
  const std::vector<int> tokens = index_vector(BT, 14, s.V);
  std::vector<float> wte = uniform_vector(static_cast<size_t>(s.V) * s.C, 15);
  for (size_t i = 0; i < wte.size(); i += 7) wte[i] = -0.0f;
  const std::vector<float> dout = uniform_vector(BT * s.C, 16);
  std::vector<float> ref(BT * s.C), dwte = uniform_vector(wte.size(), 17);
  cpu::encoder_forward(ref.data(), tokens.data(), wte.data(), static_cast<const float*>(nullptr), s.B, s.T, s.C);

  auto d_tokens = on_device(device(), "tokens", tokens, s.misalign);
  auto d_wte = on_device(device(), "wte", wte, s.misalign);
  auto d_dout = on_device(device(), "dout", dout, s.misalign), d_dwte = on_device(device(), "dwte", dwte, s.misalign);
  DeviceBuffer<float> d_out(device(), "out", ref.size(), s.misalign);
  d_out.fill(kNaN);
  ops().encoder_forward(d_out.data(), d_tokens.data(), d_wte.data(), nullptr, s.B, s.T, s.C, nullptr);
  expect_same_bits(d_out.download("encoder_forward without wpe"), ref, "encoder out without wpe");
  for (int call = 0; call < 2; call++) {
    cpu::encoder_backward(dwte.data(), static_cast<float*>(nullptr), dout.data(), tokens.data(), s.B, s.T, s.C);
    ops().encoder_backward(d_dwte.data(), nullptr, d_dout.data(), d_tokens.data(), s.B, s.T, s.C, nullptr);
  }
  expect_same_bits(d_dwte.download("encoder_backward without dwpe"), dwte, "encoder dwte without dwpe");
}

INSTANTIATE_TEST_SUITE_P(Shapes, EncoderTest,
                         ::testing::Values(EncoderShape{1, 1, 12, 11, 0}, EncoderShape{2, 7, 24, 11, 0},
                                           EncoderShape{3, 13, 36, 50, 0}, EncoderShape{2, 5, 13, 7, 0},
                                           EncoderShape{3, 13, 36, 50, 1}, EncoderShape{4, 64, 300, 1000, 0}),
                         ShapeName());

// The encoder backward's workspace holds CUB's radix-sort storage, which only CUB sizes (with a
// null buffer, on this card); the memory plan estimates it (backend/gpu_memory.hpp). The estimate
// must cover what CUB asks for, from one token to a large micro-batch.
class EncoderWorkspaceTest : public GpuSuite<::testing::Test> {};

TEST_F(EncoderWorkspaceTest, CubNeedsNoMoreThanThePlannersEstimate) {
  const std::pair<int, int> shapes[] = {{1, 1}, {1, 7}, {1, 1000}, {8, 1024}, {32, 4096}};  // B, T
  for (const auto& [B, T] : shapes) {
    const size_t actual = kernels::encoder_backward_workspace_bytes(B, T);
    const size_t estimate = gpu::encoder_backward_workspace_estimate(B, T);
    EXPECT_LE(actual, estimate) << "B=" << B << " T=" << T << ": CUB's workspace exceeds the memory plan's estimate";
  }
}

// ==================================================================================================
// LayerNorm, N = B*T rows of C. Inputs in [-2, 3) (non-zero mean), weight in [0.5, 1.5).
// ==================================================================================================
struct LayerNormShape {
  int B, T, C, misalign;
};
std::string name_of(const LayerNormShape& s) {
  return "B" + std::to_string(s.B) + "_T" + std::to_string(s.T) + "_C" + std::to_string(s.C) +
         misaligned_suffix(s.misalign);
}
void PrintTo(const LayerNormShape& s, std::ostream* os) { *os << name_of(s); }

class LayerNormTest : public GpuSuite<::testing::TestWithParam<LayerNormShape>> {};

struct LayerNormData {
  explicit LayerNormData(const LayerNormShape& s)
      : N(s.B * s.T), C(s.C), inp(uniform_vector(static_cast<size_t>(N) * C, 41, -2.0, 3.0)),
        weight(uniform_vector(C, 42, 0.5, 1.5)), bias(uniform_vector(C, 43, -0.5, 0.5)),
        out(inp.size()), mean(N), rstd(N) {
    cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), weight.data(), bias.data(), N, C);
  }
  int N, C;
  std::vector<float> inp, weight, bias, out, mean, rstd;  // out, mean, rstd: the CPU's forward
};

TEST_P(LayerNormTest, ForwardMatchesCpu) {
  const LayerNormShape s = GetParam();
  LayerNormData d(s);
  auto d_inp = on_device(device(), "inp", d.inp, s.misalign);
  auto d_weight = on_device(device(), "weight", d.weight, s.misalign);
  auto d_bias = on_device(device(), "bias", d.bias, s.misalign);
  DeviceBuffer<float> d_out(device(), "out", d.out.size(), s.misalign), d_mean(device(), "mean", d.N, s.misalign),
      d_rstd(device(), "rstd", d.N, s.misalign);
  d_out.fill(kNaN);
  d_mean.fill(kNaN);
  d_rstd.fill(kNaN);
  ops().layernorm_forward(d_out.data(), d_mean.data(), d_rstd.data(), d_inp.data(), d_weight.data(), d_bias.data(),
                          d.N, d.C);
  // mean: C terms; variance: C more; rstd, normalise, scale and shift: a few.
  const Tolerance tol = fp32_pair(2 * d.C + 4);
  expect_close(d_out.download("layernorm_forward").data(), widen(d.out), tol, "layernorm out");
  expect_close(d_mean.download("layernorm_forward").data(), widen(d.mean), tol, "layernorm mean");
  expect_close(d_rstd.download("layernorm_forward").data(), widen(d.rstd), tol, "layernorm rstd");
}

// All three gradients accumulate (dinp too: it adds onto the residual stream); both sides see
// the CPU's saved statistics, which isolates the backward.
TEST_P(LayerNormTest, BackwardTwiceMatchesCpu) {
  const LayerNormShape s = GetParam();
  LayerNormData d(s);
  const std::vector<float> dout = uniform_vector(d.out.size(), 44);
  std::vector<float> dinp = uniform_vector(d.out.size(), 45), dweight = uniform_vector(d.C, 46),
                     dbias = uniform_vector(d.C, 47);
  auto d_dout = on_device(device(), "dout", dout, s.misalign), d_inp = on_device(device(), "inp", d.inp, s.misalign);
  auto d_weight = on_device(device(), "weight", d.weight, s.misalign);
  auto d_mean = on_device(device(), "mean", d.mean, s.misalign), d_rstd = on_device(device(), "rstd", d.rstd, s.misalign);
  auto d_dinp = on_device(device(), "dinp", dinp, s.misalign), d_dweight = on_device(device(), "dweight", dweight, s.misalign),
       d_dbias = on_device(device(), "dbias", dbias, s.misalign);
  for (int call = 0; call < 2; call++) {
    cpu::layernorm_backward(dinp.data(), dweight.data(), dbias.data(), dout.data(), d.inp.data(), d.weight.data(),
                            d.mean.data(), d.rstd.data(), d.N, d.C);
    ops().layernorm_backward(d_dinp.data(), d_dweight.data(), d_dbias.data(), d_dout.data(), d_inp.data(),
                             d_weight.data(), d_mean.data(), d_rstd.data(), d.N, d.C);
  }
  // dinp: two row sums of C terms per call; dweight, dbias: 2 N rows onto the prefill.
  expect_close(d_dinp.download("layernorm_backward").data(), widen(dinp), fp32_pair(4 * d.C + 8), "layernorm dinp");
  const Tolerance param_tol = fp32_pair(2 * d.N + 4);
  expect_close(d_dweight.download("layernorm_backward").data(), widen(dweight), param_tol, "layernorm dweight");
  expect_close(d_dbias.download("layernorm_backward").data(), widen(dbias), param_tol, "layernorm dbias");
}

TEST_P(LayerNormTest, BackwardRepeatsBitwise) {
  const LayerNormShape s = GetParam();
  LayerNormData d(s);
  const std::vector<float> dout = uniform_vector(d.out.size(), 48), zeros_c(d.C, 0.0f), zeros(d.out.size(), 0.0f);
  auto d_dout = on_device(device(), "dout", dout, s.misalign), d_inp = on_device(device(), "inp", d.inp, s.misalign);
  auto d_weight = on_device(device(), "weight", d.weight, s.misalign);
  auto d_mean = on_device(device(), "mean", d.mean, s.misalign), d_rstd = on_device(device(), "rstd", d.rstd, s.misalign);
  std::vector<float> first[3];
  for (int run = 0; run < 2; run++) {
    auto d_dinp = on_device(device(), "dinp", zeros, s.misalign), d_dweight = on_device(device(), "dweight", zeros_c, s.misalign),
         d_dbias = on_device(device(), "dbias", zeros_c, s.misalign);
    ops().layernorm_backward(d_dinp.data(), d_dweight.data(), d_dbias.data(), d_dout.data(), d_inp.data(),
                             d_weight.data(), d_mean.data(), d_rstd.data(), d.N, d.C);
    std::vector<float> got[3] = {d_dinp.download("run"), d_dweight.download("run"), d_dbias.download("run")};
    for (int k = 0; k < 3; k++) {
      if (run == 0) {
        first[k] = got[k];
      } else {
        EXPECT_TRUE(same_bits(first[k], got[k])) << "layernorm_backward output " << k << " differs between runs";
      }
    }
  }
}

std::vector<LayerNormShape> layernorm_shapes() {
  std::vector<LayerNormShape> shapes;
  for (int B : {1, 3})
    for (int T : {1, 7, 13})
      for (int C : {12, 36, 97}) shapes.push_back({B, T, C, 0});
  shapes.push_back({3, 13, 36, 1});
  shapes.push_back({2, 7, 97, 1});
  shapes.push_back({4, 33, 768, 0});   // GPT-2 width, several row chunks in the column sums
  shapes.push_back({3, 3001, 40, 0});  // N = 9003: the maximum number of column-sum chunks
  return shapes;
}
INSTANTIATE_TEST_SUITE_P(Shapes, LayerNormTest, ::testing::ValuesIn(layernorm_shapes()), ShapeName());

// ==================================================================================================
// RMSNorm (Llama), on LayerNorm's shapes. Inputs in [-2, 3), weight in [0.5, 1.5).
// ==================================================================================================
constexpr float kRmsNormEps = 1e-5f;

class RmsNormTest : public GpuSuite<::testing::TestWithParam<LayerNormShape>> {};

struct RmsNormData {
  explicit RmsNormData(const LayerNormShape& s)
      : N(s.B * s.T), C(s.C), inp(uniform_vector(static_cast<size_t>(N) * C, 131, -2.0, 3.0)),
        weight(uniform_vector(C, 132, 0.5, 1.5)), out(inp.size()), rstd(N) {
    cpu::rmsnorm_forward(out.data(), rstd.data(), inp.data(), weight.data(), kRmsNormEps, N, C);
  }
  int N, C;
  std::vector<float> inp, weight, out, rstd;  // out, rstd: the CPU's forward
};

TEST_P(RmsNormTest, ForwardMatchesCpu) {
  const LayerNormShape s = GetParam();
  RmsNormData d(s);
  auto d_inp = on_device(device(), "inp", d.inp, s.misalign);
  auto d_weight = on_device(device(), "weight", d.weight, s.misalign);
  DeviceBuffer<float> d_out(device(), "out", d.out.size(), s.misalign), d_rstd(device(), "rstd", d.N, s.misalign);
  d_out.fill(kNaN);
  d_rstd.fill(kNaN);
  ops().rmsnorm_forward(d_out.data(), d_rstd.data(), d_inp.data(), d_weight.data(), kRmsNormEps, d.N, d.C);
  // The sum of C squares; rstd, normalise and scale: a few.
  const Tolerance tol = fp32_pair(d.C + 4);
  expect_close(d_out.download("rmsnorm_forward").data(), widen(d.out), tol, "rmsnorm out");
  expect_close(d_rstd.download("rmsnorm_forward").data(), widen(d.rstd), tol, "rmsnorm rstd");
}

// dinp and dweight accumulate (dinp adds onto the residual stream, as LayerNorm's); both sides see
// the CPU's saved rstd.
TEST_P(RmsNormTest, BackwardTwiceMatchesCpu) {
  const LayerNormShape s = GetParam();
  RmsNormData d(s);
  const std::vector<float> dout = uniform_vector(d.out.size(), 133);
  std::vector<float> dinp = uniform_vector(d.out.size(), 134), dweight = uniform_vector(d.C, 135);
  auto d_dout = on_device(device(), "dout", dout, s.misalign), d_inp = on_device(device(), "inp", d.inp, s.misalign);
  auto d_weight = on_device(device(), "weight", d.weight, s.misalign);
  auto d_rstd = on_device(device(), "rstd", d.rstd, s.misalign);
  auto d_dinp = on_device(device(), "dinp", dinp, s.misalign);
  auto d_dweight = on_device(device(), "dweight", dweight, s.misalign);
  for (int call = 0; call < 2; call++) {
    cpu::rmsnorm_backward(dinp.data(), dweight.data(), dout.data(), d.inp.data(), d.weight.data(), d.rstd.data(), d.N,
                          d.C);
    ops().rmsnorm_backward(d_dinp.data(), d_dweight.data(), d_dout.data(), d_inp.data(), d_weight.data(),
                           d_rstd.data(), d.N, d.C);
  }
  // dinp: one row sum of C terms per call; dweight: 2 N rows onto the prefill.
  expect_close(d_dinp.download("rmsnorm_backward").data(), widen(dinp), fp32_pair(2 * d.C + 8), "rmsnorm dinp");
  expect_close(d_dweight.download("rmsnorm_backward").data(), widen(dweight), fp32_pair(2 * d.N + 4),
               "rmsnorm dweight");
}

TEST_P(RmsNormTest, RepeatsBitwise) {
  const LayerNormShape s = GetParam();
  RmsNormData d(s);
  const std::vector<float> dout = uniform_vector(d.out.size(), 136), zeros_c(d.C, 0.0f), zeros(d.out.size(), 0.0f);
  auto d_dout = on_device(device(), "dout", dout, s.misalign), d_inp = on_device(device(), "inp", d.inp, s.misalign);
  auto d_weight = on_device(device(), "weight", d.weight, s.misalign);
  std::vector<float> first[4];
  for (int run = 0; run < 2; run++) {
    DeviceBuffer<float> d_out(device(), "out", d.out.size(), s.misalign), d_rstd(device(), "rstd", d.N, s.misalign);
    auto d_dinp = on_device(device(), "dinp", zeros, s.misalign);
    auto d_dweight = on_device(device(), "dweight", zeros_c, s.misalign);
    ops().rmsnorm_forward(d_out.data(), d_rstd.data(), d_inp.data(), d_weight.data(), kRmsNormEps, d.N, d.C);
    ops().rmsnorm_backward(d_dinp.data(), d_dweight.data(), d_dout.data(), d_inp.data(), d_weight.data(),
                           d_rstd.data(), d.N, d.C);
    std::vector<float> got[4] = {d_out.download("run"), d_rstd.download("run"), d_dinp.download("run"),
                                 d_dweight.download("run")};
    for (int k = 0; k < 4; k++) {
      if (run == 0) {
        first[k] = got[k];
      } else {
        EXPECT_TRUE(same_bits(first[k], got[k])) << "rmsnorm output " << k << " differs between runs";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, RmsNormTest, ::testing::ValuesIn(layernorm_shapes()), ShapeName());

// ==================================================================================================
// Matmul: out(N,OC) = inp(N,C) @ weight(OC,C)^T + bias, with and without bias; the backward with
// and without dinp.
// ==================================================================================================
struct MatmulShape {
  int N, C, OC;
  bool bias;
  int misalign;
};
std::string name_of(const MatmulShape& s) {
  return "N" + std::to_string(s.N) + "_C" + std::to_string(s.C) + "_OC" + std::to_string(s.OC) +
         (s.bias ? "_bias" : "_nobias") + misaligned_suffix(s.misalign);
}
void PrintTo(const MatmulShape& s, std::ostream* os) { *os << name_of(s); }

class MatmulTest : public GpuSuite<::testing::TestWithParam<MatmulShape>> {};

TEST_P(MatmulTest, ForwardMatchesCpu) {
  const MatmulShape s = GetParam();
  const std::vector<float> inp = uniform_vector(static_cast<size_t>(s.N) * s.C, 61),
                           weight = uniform_vector(static_cast<size_t>(s.OC) * s.C, 62),
                           bias = uniform_vector(s.bias ? s.OC : 0, 63);
  std::vector<float> ref(static_cast<size_t>(s.N) * s.OC);
  cpu::matmul_forward(ref.data(), inp.data(), weight.data(), s.bias ? bias.data() : nullptr, s.N, s.C, s.OC);
  auto d_inp = on_device(device(), "inp", inp, s.misalign), d_weight = on_device(device(), "weight", weight, s.misalign);
  auto d_bias = on_device(device(), "bias", bias, s.misalign);
  DeviceBuffer<float> d_out(device(), "out", ref.size(), s.misalign);
  d_out.fill(kNaN);
  ops().matmul_forward(d_out.data(), d_inp.data(), d_weight.data(), s.bias ? d_bias.data() : nullptr, s.N, s.C, s.OC);
  // C products and the bias.
  expect_close(d_out.download("matmul_forward").data(), widen(ref), fp32_pair(s.C + 1), "matmul out");
}

void check_matmul_backward(const MatmulShape& s, bool with_dinp, Device& device, const LayerOps<float>& ops) {
  const std::vector<float> inp = uniform_vector(static_cast<size_t>(s.N) * s.C, 61),
                           weight = uniform_vector(static_cast<size_t>(s.OC) * s.C, 62),
                           dout = uniform_vector(static_cast<size_t>(s.N) * s.OC, 64);
  std::vector<float> dinp(inp.size(), kNaN), dweight = uniform_vector(weight.size(), 65),
                     dbias = uniform_vector(s.bias ? s.OC : 0, 66);
  auto d_inp = on_device(device, "inp", inp, s.misalign), d_weight = on_device(device, "weight", weight, s.misalign);
  auto d_dout = on_device(device, "dout", dout, s.misalign), d_dinp = on_device(device, "dinp", dinp, s.misalign);
  auto d_dweight = on_device(device, "dweight", dweight, s.misalign), d_dbias = on_device(device, "dbias", dbias, s.misalign);
  for (int call = 0; call < 2; call++) {  // dinp written (NaN garbage before), dweight and dbias accumulate
    cpu::matmul_backward(with_dinp ? dinp.data() : nullptr, dweight.data(), s.bias ? dbias.data() : nullptr,
                         dout.data(), inp.data(), weight.data(), s.N, s.C, s.OC);
    ops.matmul_backward(with_dinp ? d_dinp.data() : nullptr, d_dweight.data(), s.bias ? d_dbias.data() : nullptr,
                        d_dout.data(), d_inp.data(), d_weight.data(), s.N, s.C, s.OC);
  }
  const std::vector<float> got_dinp = d_dinp.download("matmul_backward");
  if (with_dinp)  // OC products
    expect_close(got_dinp.data(), widen(dinp), fp32_pair(s.OC), "matmul dinp");
  else
    EXPECT_TRUE(std::all_of(got_dinp.begin(), got_dinp.end(), [](float x) { return std::isnan(x); }))
        << "matmul_backward wrote dinp although it was null";
  // 2 x N products onto the prefill.
  const Tolerance tol = fp32_pair(2 * s.N + 1);
  expect_close(d_dweight.download("matmul_backward").data(), widen(dweight), tol, "matmul dweight");
  if (s.bias) expect_close(d_dbias.download("matmul_backward").data(), widen(dbias), tol, "matmul dbias");
}

TEST_P(MatmulTest, BackwardTwiceMatchesCpu) { check_matmul_backward(GetParam(), true, device(), ops()); }
TEST_P(MatmulTest, BackwardWithoutDinpMatchesCpu) { check_matmul_backward(GetParam(), false, device(), ops()); }

INSTANTIATE_TEST_SUITE_P(Shapes, MatmulTest,
                         ::testing::Values(MatmulShape{1, 1, 1, true, 0}, MatmulShape{5, 12, 7, true, 0},
                                           MatmulShape{13, 36, 50, false, 0}, MatmulShape{7, 33, 65, true, 0},
                                           MatmulShape{13, 36, 50, true, 1}, MatmulShape{7, 33, 65, false, 1},
                                           MatmulShape{300, 97, 129, true, 0},
                                           MatmulShape{1024, 768, 3072, true, 0}),  // realistic: B=4, T=256, MLP up
                         ShapeName());

// LayerOps with 16-bit GEMM operands (fsdp.param_dtype on a GPU): the fp32 operands are rounded
// to bf16/fp16 on the device, so the oracle is the CPU's fp32 matmul on operands rounded the same
// way on the host; the products of 16-bit values are exact in fp32, the bias is added in fp32.
class GemmOperandsTest : public GpuSuite<::testing::TestWithParam<DType>> {};

TEST_P(GemmOperandsTest, MatmulRoundsOperandsThenMatchesCpu) {
  const DType type = GetParam();
  auto rounded = [&](std::vector<float> v) {
    for (float& x : v) x = half_to_float(float_to_half(x, type), type);
    return v;
  };
  auto half_ops = make_cuda_layer_ops(device(), type);
  for (const MatmulShape& s : {MatmulShape{37, 50, 29, true, 0}, MatmulShape{13, 36, 50, true, 1},
                               MatmulShape{256, 768, 768, true, 0}}) {
    const std::vector<float> inp = uniform_vector(static_cast<size_t>(s.N) * s.C, 81),
                             weight = uniform_vector(static_cast<size_t>(s.OC) * s.C, 82),
                             bias = uniform_vector(s.OC, 83), dout = uniform_vector(static_cast<size_t>(s.N) * s.OC, 84);
    std::vector<float> ref(static_cast<size_t>(s.N) * s.OC), ref_dinp(inp.size()), ref_dweight(weight.size(), 0.0f);
    const std::vector<float> inp_r = rounded(inp), weight_r = rounded(weight), dout_r = rounded(dout);
    cpu::matmul_forward(ref.data(), inp_r.data(), weight_r.data(), bias.data(), s.N, s.C, s.OC);
    cpu::matmul_backward(ref_dinp.data(), ref_dweight.data(), static_cast<float*>(nullptr), dout_r.data(), inp_r.data(),
                         weight_r.data(), s.N, s.C, s.OC);

    auto d_inp = on_device(device(), "inp", inp, s.misalign), d_weight = on_device(device(), "weight", weight, s.misalign);
    auto d_bias = on_device(device(), "bias", bias, s.misalign), d_dout = on_device(device(), "dout", dout, s.misalign);
    DeviceBuffer<float> d_out(device(), "out", ref.size(), s.misalign), d_dinp(device(), "dinp", inp.size(), s.misalign);
    auto d_dweight = on_device(device(), "dweight", std::vector<float>(weight.size(), 0.0f), s.misalign);
    d_out.fill(kNaN);
    half_ops->matmul_forward(d_out.data(), d_inp.data(), d_weight.data(), d_bias.data(), s.N, s.C, s.OC);
    half_ops->matmul_backward(d_dinp.data(), d_dweight.data(), nullptr, d_dout.data(), d_inp.data(), d_weight.data(),
                              s.N, s.C, s.OC);
    const std::string label = std::string(dtype_name(type)) + " operands " + name_of(s);
    expect_close(d_out.download("matmul_forward").data(), widen(ref), fp32_pair(s.C + 1), label + " out");
    expect_close(d_dinp.download("matmul_backward").data(), widen(ref_dinp), fp32_pair(s.OC), label + " dinp");
    expect_close(d_dweight.download("matmul_backward").data(), widen(ref_dweight), fp32_pair(s.N), label + " dweight");
  }
}

// 16-bit values in an allocation of their own: aligned as the operand scratch that a rounded operand
// goes to. cuBLASLt's plan follows the operands' alignments (kernels/matmul.cu), and the same plan
// gives the same bits.
DeviceArray<uint16_t> halves_on_device(Device& device, const std::vector<uint16_t>& halves) {
  DeviceArray<uint16_t> copy(device, halves.size());
  device.copy_to_device(copy.data(), halves.data(), halves.size() * sizeof(uint16_t));
  return copy;
}

// "Rounded once": a weight bound with its 16-bit copy (LayerOps::bind_half_copy, as the engine binds
// its gathered units) gives the bits of rounding it per GEMM, and it is the copy that is
// multiplied: bound to the copy of 2W, the products are exactly those of 2W. The copies are
// allocations of their own (halves_on_device); the fp32 buffers of the misaligned shape stay
// misaligned. A copy 2 bytes off (a view into a flat buffer whose earlier parameters have odd
// sizes) may get another kernel -- the same values multiplied, summed in another order -- so it is
// held to fp32 reassociation error instead, and still to being what is multiplied.
TEST_P(GemmOperandsTest, ABoundWeightIsMultipliedFromItsCopy) {
  const DType type = GetParam();
  auto half_ops = make_cuda_layer_ops(device(), type);
  for (const MatmulShape& s : {MatmulShape{37, 50, 29, true, 0}, MatmulShape{13, 36, 50, true, 1},
                               MatmulShape{256, 768, 768, true, 0}}) {
    const std::vector<float> inp = uniform_vector(static_cast<size_t>(s.N) * s.C, 91),
                             bias = uniform_vector(s.OC, 93), dout = uniform_vector(static_cast<size_t>(s.N) * s.OC, 94);
    std::vector<float> weight = uniform_vector(static_cast<size_t>(s.OC) * s.C, 92), twice;
    std::vector<uint16_t> weight16, twice16;
    for (float& w : weight) {  // the gathered values: 16-bit already
      weight16.push_back(float_to_half(w, type));
      w = half_to_float(weight16.back(), type);
      twice.push_back(2.0f * w);
      twice16.push_back(float_to_half(2.0f * w, type));
    }
    auto d_inp = on_device(device(), "inp", inp, s.misalign), d_bias = on_device(device(), "bias", bias, s.misalign);
    auto d_dout = on_device(device(), "dout", dout, s.misalign);
    auto d_weight = on_device(device(), "weight", weight, s.misalign), d_twice = on_device(device(), "2w", twice, s.misalign);
    DeviceArray<uint16_t> d_weight16 = halves_on_device(device(), weight16),
                          d_twice16 = halves_on_device(device(), twice16);
    // out, dinp, dweight of one forward and backward on weight w (bound or not: the caller's doing).
    auto run = [&](const float* w) {
      DeviceBuffer<float> out(device(), "out", static_cast<size_t>(s.N) * s.OC, s.misalign),
          dinp(device(), "dinp", inp.size(), s.misalign);
      auto dweight = on_device(device(), "dweight", std::vector<float>(weight.size(), 0.0f), s.misalign);
      out.fill(kNaN);
      half_ops->matmul_forward(out.data(), d_inp.data(), w, d_bias.data(), s.N, s.C, s.OC);
      half_ops->matmul_backward(dinp.data(), dweight.data(), nullptr, d_dout.data(), d_inp.data(), w, s.N, s.C, s.OC);
      return std::vector<std::vector<float>>{out.download("matmul_forward"), dinp.download("matmul_backward"),
                                             dweight.download("matmul_backward")};
    };
    const std::string label = std::string(dtype_name(type)) + " " + name_of(s);
    const auto rounded_here = run(d_weight.data());
    const auto doubled_here = run(d_twice.data());
    half_ops->bind_half_copy(d_weight.data(), d_weight16.data(), weight.size(), type);
    const auto from_copy = run(d_weight.data());
    half_ops->bind_half_copy(d_weight.data(), d_twice16.data(), weight.size(), type);  // rebinding replaces
    const auto from_twice = run(d_weight.data());
    half_ops->unbind_half_copy(d_weight.data());
    const char* names[] = {"out", "dinp", "dweight"};
    for (int k = 0; k < 3; k++) {
      EXPECT_EQ(0, std::memcmp(from_copy[k].data(), rounded_here[k].data(), from_copy[k].size() * sizeof(float)))
          << label << " " << names[k] << ": the bound copy changed the bits";
      if (k < 2) {  // dweight = dout^T inp does not read the weight
        EXPECT_EQ(0, std::memcmp(from_twice[k].data(), doubled_here[k].data(), from_twice[k].size() * sizeof(float)))
            << label << " " << names[k] << ": the bound copy was not what was multiplied";
      }
    }
    EXPECT_NE(0, std::memcmp(from_twice[0].data(), from_copy[0].data(), from_copy[0].size() * sizeof(float)));
    if (s.misalign) {
      auto d_odd16 = on_device(device(), "weight16_2_bytes_off", weight16, 1);
      auto d_odd_twice16 = on_device(device(), "2w16_2_bytes_off", twice16, 1);
      half_ops->bind_half_copy(d_weight.data(), d_odd16.data(), weight.size(), type);
      const auto from_odd = run(d_weight.data());
      half_ops->bind_half_copy(d_weight.data(), d_odd_twice16.data(), weight.size(), type);
      const auto from_odd_twice = run(d_weight.data());
      half_ops->unbind_half_copy(d_weight.data());
      const Tolerance tols[] = {fp32_pair(s.C + 1), fp32_pair(s.OC)};  // out: C products and the bias
      for (int k = 0; k < 2; k++) {
        expect_close(from_odd[k].data(), widen(rounded_here[k]), tols[k], label + " " + names[k] + ", copy 2 bytes off");
        expect_close(from_odd_twice[k].data(), widen(doubled_here[k]), tols[k],
                     label + " " + names[k] + ", copy of 2W 2 bytes off");
      }
    }
  }
}

// 16-bit activations: an input bound with its 16-bit copy (as a model binds its working
// activations to their saved copies) gives the bits of rounding it per GEMM, alone and with the
// weight bound too (nothing rounded but dout), and it is the copy that is multiplied: bound to
// the copy of 2x, out and dweight are exactly those of 2x (dinp does not read the input). The
// copies are allocations of their own (halves_on_device).
TEST_P(GemmOperandsTest, ABoundInputIsMultipliedFromItsCopy) {
  const DType type = GetParam();
  auto half_ops = make_cuda_layer_ops(device(), type);
  for (const MatmulShape& s : {MatmulShape{37, 50, 29, true, 0}, MatmulShape{13, 36, 50, true, 1},
                               MatmulShape{256, 768, 768, true, 0}}) {
    const std::vector<float> bias = uniform_vector(s.OC, 103), dout = uniform_vector(static_cast<size_t>(s.N) * s.OC, 104);
    std::vector<float> inp = uniform_vector(static_cast<size_t>(s.N) * s.C, 101), twice;
    std::vector<float> weight = uniform_vector(static_cast<size_t>(s.OC) * s.C, 102);
    std::vector<uint16_t> inp16, twice16, weight16;
    for (float& x : inp) {  // the saved activations: 16-bit already
      inp16.push_back(float_to_half(x, type));
      x = half_to_float(inp16.back(), type);
      twice.push_back(2.0f * x);
      twice16.push_back(float_to_half(2.0f * x, type));
    }
    for (float& w : weight) {  // a gathered unit's weight: 16-bit already
      weight16.push_back(float_to_half(w, type));
      w = half_to_float(weight16.back(), type);
    }
    auto d_inp = on_device(device(), "inp", inp, s.misalign), d_twice = on_device(device(), "2x", twice, s.misalign);
    auto d_weight = on_device(device(), "weight", weight, s.misalign), d_bias = on_device(device(), "bias", bias, s.misalign);
    auto d_dout = on_device(device(), "dout", dout, s.misalign);
    DeviceArray<uint16_t> d_inp16 = halves_on_device(device(), inp16), d_twice16 = halves_on_device(device(), twice16),
                          d_weight16 = halves_on_device(device(), weight16);
    // out, dinp, dweight of one forward and backward on input x (bound or not: the caller's doing).
    auto run = [&](const float* x) {
      DeviceBuffer<float> out(device(), "out", static_cast<size_t>(s.N) * s.OC, s.misalign),
          dinp(device(), "dinp", inp.size(), s.misalign);
      auto dweight = on_device(device(), "dweight", std::vector<float>(weight.size(), 0.0f), s.misalign);
      out.fill(kNaN);
      half_ops->matmul_forward(out.data(), x, d_weight.data(), d_bias.data(), s.N, s.C, s.OC);
      half_ops->matmul_backward(dinp.data(), dweight.data(), nullptr, d_dout.data(), x, d_weight.data(), s.N, s.C,
                                s.OC);
      return std::vector<std::vector<float>>{out.download("matmul_forward"), dinp.download("matmul_backward"),
                                             dweight.download("matmul_backward")};
    };
    const std::string label = std::string(dtype_name(type)) + " " + name_of(s);
    const auto rounded_here = run(d_inp.data());
    const auto doubled_here = run(d_twice.data());
    half_ops->bind_half_copy(d_inp.data(), d_inp16.data(), inp.size(), type);
    const auto from_copy = run(d_inp.data());
    half_ops->bind_half_copy(d_weight.data(), d_weight16.data(), weight.size(), type);
    const auto both_from_copies = run(d_inp.data());
    half_ops->unbind_half_copy(d_weight.data());
    half_ops->bind_half_copy(d_inp.data(), d_twice16.data(), inp.size(), type);  // rebinding replaces
    const auto from_twice = run(d_inp.data());
    half_ops->unbind_half_copy(d_inp.data());
    const char* names[] = {"out", "dinp", "dweight"};
    for (int k = 0; k < 3; k++) {
      EXPECT_EQ(0, std::memcmp(from_copy[k].data(), rounded_here[k].data(), from_copy[k].size() * sizeof(float)))
          << label << " " << names[k] << ": the bound input's copy changed the bits";
      EXPECT_EQ(0, std::memcmp(both_from_copies[k].data(), rounded_here[k].data(),
                               both_from_copies[k].size() * sizeof(float)))
          << label << " " << names[k] << ": the bound input's and weight's copies changed the bits";
      if (k != 1) {  // dinp = dout weight does not read the input
        EXPECT_EQ(0, std::memcmp(from_twice[k].data(), doubled_here[k].data(), from_twice[k].size() * sizeof(float)))
            << label << " " << names[k] << ": the bound input's copy was not what was multiplied";
      }
    }
    EXPECT_NE(0, std::memcmp(from_twice[0].data(), from_copy[0].data(), from_copy[0].size() * sizeof(float)));
  }
}

INSTANTIATE_TEST_SUITE_P(Types, GemmOperandsTest, ::testing::Values(DTYPE_BF16, DTYPE_FP16),
                         [](const ::testing::TestParamInfo<DType>& info) { return std::string(dtype_name(info.param)); });

// ==================================================================================================
// LayerOps::gemm (the adapters' products): row-major C = alpha op(A) op(B) + beta C against cblas
// (backend/cpu/gemm.hpp), always fp32 whatever the ops' GEMM operand type. C is a column slice
// (offset, N columns) of a wider (M, ldc) matrix whose other columns must keep their bits; A and B
// have padded leading dimensions. beta = 0: the slice starts as NaN and must not be read. Two
// calls from the same prefill (beta != 0: the second accumulates onto the first), twice over, on
// the default ops and on ops with bf16 GEMM operands: all four runs must agree bit for bit.
// ==================================================================================================
struct GemmShape {
  bool trans_a, trans_b;
  int M, N, K;
  float alpha, beta;
  int ldc, offset;    // C: columns [offset, offset + N) of an (M, ldc) matrix
  int pad_a, pad_b;  // lda, ldb: the stored row length + pad
  int misalign;
  int a_rows() const { return trans_a ? K : M; }
  int a_cols() const { return trans_a ? M : K; }
  int b_rows() const { return trans_b ? N : K; }
  int b_cols() const { return trans_b ? K : N; }
  int lda() const { return std::max(1, a_cols() + pad_a); }
  int ldb() const { return std::max(1, b_cols() + pad_b); }
};
std::string scalar_name(float x) {  // 0.75 -> "0p75", -1.5 -> "m1p5"
  std::string digits = std::to_string(std::lround(std::fabs(x) * 100.0f));
  digits.insert(0, 3 - std::min<size_t>(3, digits.size()), '0');
  std::string name = digits.substr(0, digits.size() - 2) + "p" + digits.substr(digits.size() - 2);
  while (name.back() == '0') name.pop_back();
  if (name.back() == 'p') name.pop_back();
  return (x < 0 ? "m" : "") + name;
}
std::string name_of(const GemmShape& s) {
  return std::string(s.trans_a ? "T" : "N") + (s.trans_b ? "T" : "N") + "_M" + std::to_string(s.M) + "_N" +
         std::to_string(s.N) + "_K" + std::to_string(s.K) + "_alpha" + scalar_name(s.alpha) + "_beta" +
         scalar_name(s.beta) + "_ldc" + std::to_string(s.ldc) + "_off" + std::to_string(s.offset) + "_pad" +
         std::to_string(s.pad_a) + "x" + std::to_string(s.pad_b) + misaligned_suffix(s.misalign);
}
void PrintTo(const GemmShape& s, std::ostream* os) { *os << name_of(s); }

std::vector<GemmShape> gemm_shapes() {
  std::vector<GemmShape> shapes;
  // All four transpose combinations with beta 0 and 1, at odd sizes; C a middle or a last slice.
  int i = 0;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (float beta : {0.0f, 1.0f}) {
        const bool last = i % 2 == 1;
        shapes.push_back({ta, tb, 37, 5, 19, beta == 0.0f ? 0.75f : -1.5f, beta, 5 + 7, last ? 7 : 3, i % 3,
                          (i + 1) % 3, i / 4});
        i++;
      }
  shapes.push_back({false, false, 37, 5, 19, 1.0f, 0.0f, 5, 0, 0, 0, 0});   // plain: ldc = N, no padding
  shapes.push_back({true, false, 37, 5, 19, 2.0f, -0.5f, 13, 8, 1, 0, 1});  // beta neither 0 nor 1
  shapes.push_back({false, true, 1, 1, 1, 1.0f, 1.0f, 3, 1, 0, 0, 0});      // 1 x 1 x 1
  shapes.push_back({true, true, 9, 33, 65, 0.5f, 1.0f, 40, 6, 2, 3, 1});
  // K = 0: no product, C = beta C (cblas), A and B unread.
  shapes.push_back({false, false, 6, 7, 0, 1.0f, 0.0f, 10, 2, 0, 0, 0});
  shapes.push_back({true, true, 6, 7, 0, 1.0f, 0.5f, 10, 3, 0, 0, 1});
  shapes.push_back({false, true, 6, 7, 0, 1.0f, 1.0f, 10, 3, 0, 0, 0});
  // Realistic LoRA of GPT-2's q projection (B=4, T=256: 1024 rows, C=768, r=8, scaling 2): h = x A^T,
  // then into the q columns of the fused qkv (1024, 2304) out_q += 2 h B^T; backward with dout_q
  // those columns of dqkv: dh = 2 dout_q B, dB += 2 dout_q^T h, dA += dh^T x, dx += dh A.
  shapes.push_back({false, true, 1024, 8, 768, 1.0f, 0.0f, 8, 0, 0, 0, 0});
  shapes.push_back({false, true, 1024, 768, 8, 2.0f, 1.0f, 2304, 0, 0, 0, 0});
  shapes.push_back({false, false, 1024, 8, 768, 2.0f, 0.0f, 8, 0, 2304 - 768, 0, 0});
  shapes.push_back({true, false, 768, 8, 1024, 2.0f, 1.0f, 8, 0, 2304 - 768, 0, 0});
  shapes.push_back({true, false, 8, 768, 1024, 1.0f, 1.0f, 768, 0, 0, 0, 0});
  shapes.push_back({false, false, 1024, 768, 8, 1.0f, 1.0f, 768, 0, 0, 0, 0});
  return shapes;
}

class GemmTest : public GpuSuite<::testing::TestWithParam<GemmShape>> {};

TEST_P(GemmTest, MatchesCpu) {
  const GemmShape s = GetParam();
  ASSERT_LE(s.offset + s.N, s.ldc);
  const std::vector<float> A = uniform_vector(static_cast<size_t>(s.a_rows()) * s.lda(), 91),
                           B = uniform_vector(static_cast<size_t>(s.b_rows()) * s.ldb(), 92);
  std::vector<float> prefill = uniform_vector(static_cast<size_t>(s.M) * s.ldc, 93);
  auto in_slice = [&](size_t e) {
    const int col = static_cast<int>(e % s.ldc);
    return col >= s.offset && col < s.offset + s.N;
  };
  if (s.beta == 0.0f)  // not read
    for (size_t e = 0; e < prefill.size(); e++)
      if (in_slice(e)) prefill[e] = kNaN;
  std::vector<float> ref = prefill;
  for (int call = 0; call < 2; call++)
    cpu::gemm(s.trans_a, s.trans_b, s.M, s.N, s.K, s.alpha, A.data(), s.lda(), B.data(), s.ldb(), s.beta,
              ref.data() + s.offset, s.ldc);

  // The default ops and ops with bf16 GEMM operands: LayerOps::gemm is fp32 either way, so both
  // match the CPU, and each other bit for bit.
  auto bf16_ops = make_cuda_layer_ops(device(), DTYPE_BF16);
  auto d_A = on_device(device(), "A", A, s.misalign), d_B = on_device(device(), "B", B, s.misalign);
  DeviceBuffer<float> d_C(device(), "C", prefill.size(), s.misalign);  // the same pointers every run
  std::vector<float> first;
  for (const LayerOps<float>* layer_ops : {&ops(), static_cast<const LayerOps<float>*>(bf16_ops.get())})
    for (int run = 0; run < 2; run++) {
      d_C.upload(prefill);
      for (int call = 0; call < 2; call++)
        layer_ops->gemm(s.trans_a, s.trans_b, s.M, s.N, s.K, s.alpha, d_A.data(), s.lda(), d_B.data(), s.ldb(), s.beta,
                        d_C.data() + s.offset, s.ldc);
      const std::vector<float> got = d_C.download("gemm");
      const std::string label = "gemm " + name_of(s) + (layer_ops == &ops() ? "" : " (bf16 operand ops)") + " run " +
                                std::to_string(run);
      std::vector<float> slice, ref_slice, outside, prefill_outside;
      for (size_t e = 0; e < got.size(); e++) {
        if (in_slice(e)) {
          slice.push_back(got[e]);
          ref_slice.push_back(ref[e]);
        } else {
          outside.push_back(got[e]);
          prefill_outside.push_back(prefill[e]);
        }
      }
      expect_same_bits(outside, prefill_outside, label + ": columns outside the slice");
      if (s.K == 0) {  // C = beta C: one IEEE multiplication (or 0) per element on both sides
        expect_same_bits(slice, ref_slice, label);
      } else {
        // Two calls of K products, alpha and beta: 2 (K + 2) roundings, of terms up to |alpha| in size.
        const Tolerance tol = fp32_pair(2L * (s.K + 2));
        expect_close(slice.data(), widen(ref_slice), {tol.atol * std::max(1.0f, std::fabs(s.alpha)), tol.rtol},
                     label);
      }
      if (first.empty())
        first = got;
      else
        expect_same_bits(got, first, label + " against the first run");
      d_A.download(label + " (A)");
      d_B.download(label + " (B)");
    }
}

INSTANTIATE_TEST_SUITE_P(Shapes, GemmTest, ::testing::ValuesIn(gemm_shapes()), ShapeName());

// ==================================================================================================
// Attention with grouped-query heads: rows of qkv hold q (NH heads) | k (KV) | v (KV) of HS each.
// qkv in [-1, 1); the backward gets the CPU's saved out and lse on both sides. KV = NH is GPT-2's
// multi-head attention; KV < NH shares each k, v among NH/KV query heads (KV = 1: multi-query).
// Both sides are tiled (O(T) memory), in different tiles and orders: T past one and several of
// the kernel's 32-row tiles, ragged last tiles, head sizes from one to eight registers per lane
// (HS 200 also needs more than the default 48 KiB of shared memory).
// ==================================================================================================
struct AttentionShape {
  int B, T, NH, KV, HS, misalign;
  int group() const { return NH / KV; }
  size_t qkv_size() const { return static_cast<size_t>(B) * T * (NH + 2 * KV) * HS; }
  size_t out_size() const { return static_cast<size_t>(B) * T * NH * HS; }
  size_t lse_size() const { return static_cast<size_t>(B) * NH * T; }
};
std::string name_of(const AttentionShape& s) {
  return "B" + std::to_string(s.B) + "_T" + std::to_string(s.T) + "_NH" + std::to_string(s.NH) + "_KV" +
         std::to_string(s.KV) + "_HS" + std::to_string(s.HS) + misaligned_suffix(s.misalign);
}
void PrintTo(const AttentionShape& s, std::ostream* os) { *os << name_of(s); }

class AttentionTest : public GpuSuite<::testing::TestWithParam<AttentionShape>> {};

// Forward: a score is HS products; the softmax a max, exp and a sum over up to T (lse); out T more
// products. Backward: p recomputed (HS), dP (HS), the row's D (HS); dq: T more products; dk, dv:
// the group's G*T products.
Tolerance attention_lse_tol(const AttentionShape& s) { return fp32_pair(s.HS + s.T + 8); }
Tolerance attention_out_tol(const AttentionShape& s) { return fp32_pair(s.HS + 2 * s.T + 8); }
Tolerance attention_backward_tol(const AttentionShape& s) { return fp32_pair(4 * s.HS + (2 + s.group()) * s.T + 8); }

TEST_P(AttentionTest, ForwardMatchesCpu) {
  const AttentionShape s = GetParam();
  const std::vector<float> qkv = uniform_vector(s.qkv_size(), 81);
  std::vector<float> out(s.out_size()), lse(s.lse_size());
  cpu::attention_forward(out.data(), lse.data(), qkv.data(), s.B, s.T, s.NH, s.KV, s.HS);
  auto d_qkv = on_device(device(), "qkv", qkv, s.misalign);
  DeviceBuffer<float> d_out(device(), "out", out.size(), s.misalign), d_lse(device(), "lse", lse.size(), s.misalign);
  d_out.fill(kNaN);
  d_lse.fill(kNaN);
  ops().attention_forward(d_out.data(), d_lse.data(), d_qkv.data(), s.B, s.T, s.NH, s.KV, s.HS, nullptr);
  expect_close(d_lse.download("attention_forward").data(), widen(lse), attention_lse_tol(s), "attention lse");
  expect_close(d_out.download("attention_forward").data(), widen(out), attention_out_tol(s), "attention out");
}

TEST_P(AttentionTest, BackwardMatchesCpu) {
  const AttentionShape s = GetParam();
  const std::vector<float> qkv = uniform_vector(s.qkv_size(), 82), dout = uniform_vector(s.out_size(), 83);
  std::vector<float> out(s.out_size()), lse(s.lse_size()), dqkv(s.qkv_size());
  cpu::attention_forward(out.data(), lse.data(), qkv.data(), s.B, s.T, s.NH, s.KV, s.HS);
  cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), s.B, s.T, s.NH, s.KV, s.HS);
  auto d_qkv = on_device(device(), "qkv", qkv, s.misalign), d_dout = on_device(device(), "dout", dout, s.misalign);
  auto d_out = on_device(device(), "out", out, s.misalign), d_lse = on_device(device(), "lse", lse, s.misalign);
  DeviceBuffer<float> d_dqkv(device(), "dqkv", dqkv.size(), s.misalign);
  d_dqkv.fill(kNaN);  // written, never read
  ops().attention_backward(d_dqkv.data(), d_dout.data(), d_qkv.data(), d_out.data(), d_lse.data(), s.B, s.T, s.NH,
                           s.KV, s.HS, nullptr);
  expect_close(d_dqkv.download("attention_backward").data(), widen(dqkv), attention_backward_tol(s),
               "attention dqkv");
  d_out.download("attention_backward (out)");
  d_lse.download("attention_backward (lse)");
}

// Packed documents (doc_start): the kernels against the CPU's packed attention (which the unit
// tests hold to each document run alone). Documents of 1, 5 and many tokens, starting mid-tile.
std::vector<int> packed_doc_starts(const AttentionShape& s) {
  std::vector<int> starts(static_cast<size_t>(s.B) * s.T);
  for (int b = 0; b < s.B; b++)
    for (int t = 0, first = 0; t < s.T; t++) {
      if (t == 3 + b || t == 4 + b || t == 9 + 2 * b || t == s.T / 2 + 7) first = t;
      starts[static_cast<size_t>(b) * s.T + t] = first;
    }
  return starts;
}

TEST_P(AttentionTest, PackedDocumentsMatchCpu) {
  const AttentionShape s = GetParam();
  const std::vector<float> qkv = uniform_vector(s.qkv_size(), 88), dout = uniform_vector(s.out_size(), 89);
  const std::vector<int> starts = packed_doc_starts(s);
  std::vector<float> out(s.out_size()), lse(s.lse_size()), dqkv(s.qkv_size());
  cpu::attention_forward(out.data(), lse.data(), qkv.data(), s.B, s.T, s.NH, s.KV, s.HS, cpu::AttentionTiles(), true,
                         starts.data());
  cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), s.B, s.T, s.NH, s.KV, s.HS,
                          cpu::AttentionTiles(), true, starts.data());
  auto d_qkv = on_device(device(), "qkv", qkv, s.misalign), d_dout = on_device(device(), "dout", dout, s.misalign);
  auto d_starts = on_device(device(), "doc_start", starts, 0);
  DeviceBuffer<float> d_out(device(), "out", out.size(), s.misalign), d_lse(device(), "lse", lse.size(), s.misalign);
  DeviceBuffer<float> d_dqkv(device(), "dqkv", dqkv.size(), s.misalign);
  d_dqkv.fill(kNaN);
  ops().attention_forward(d_out.data(), d_lse.data(), d_qkv.data(), s.B, s.T, s.NH, s.KV, s.HS, d_starts.data());
  ops().attention_backward(d_dqkv.data(), d_dout.data(), d_qkv.data(), d_out.data(), d_lse.data(), s.B, s.T, s.NH,
                           s.KV, s.HS, d_starts.data());
  expect_close(d_lse.download("attention_forward").data(), widen(lse), attention_lse_tol(s), "packed attention lse");
  expect_close(d_out.download("attention_forward").data(), widen(out), attention_out_tol(s), "packed attention out");
  expect_close(d_dqkv.download("attention_backward").data(), widen(dqkv), attention_backward_tol(s),
               "packed attention dqkv");
}

// The grouping's meaning, independent of the CPU's grouped code: grouped-query attention is
// multi-head attention with each k, v head repeated for its NH/KV query heads, and its k, v
// gradients are the sums of the repeated heads' gradients. The oracle is the CPU's multi-head
// path (KV = NH) on the repeated qkv; the group sums are taken in double on the host.
TEST_P(AttentionTest, GroupedEqualsRepeatedHeads) {
  const AttentionShape s = GetParam();
  if (s.KV == s.NH) GTEST_SKIP() << "multi-head: nothing repeated";
  const int G = s.group(), row = (s.NH + 2 * s.KV) * s.HS, wide = 3 * s.NH * s.HS;
  const size_t BT = static_cast<size_t>(s.B) * s.T;
  const std::vector<float> qkv = uniform_vector(s.qkv_size(), 86), dout = uniform_vector(s.out_size(), 87);
  // Repeated: q as is, then k head h / G and v head h / G for every query head h.
  std::vector<float> repeated(BT * wide);
  for (size_t bt = 0; bt < BT; bt++) {
    const float* src = qkv.data() + bt * row;
    float* dst = repeated.data() + bt * wide;
    std::copy(src, src + s.NH * s.HS, dst);
    for (int h = 0; h < s.NH; h++)
      for (int part = 1; part <= 2; part++) {
        const float* head = src + (s.NH + (part - 1) * s.KV + h / G) * s.HS;
        std::copy(head, head + s.HS, dst + (part * s.NH + h) * s.HS);
      }
  }
  std::vector<float> out(s.out_size()), lse(s.lse_size()), drepeated(repeated.size());
  cpu::attention_forward(out.data(), lse.data(), repeated.data(), s.B, s.T, s.NH, s.NH, s.HS);
  cpu::attention_backward(drepeated.data(), dout.data(), repeated.data(), out.data(), lse.data(), s.B, s.T, s.NH,
                          s.NH, s.HS);
  std::vector<double> dqkv(s.qkv_size(), 0.0);  // dq as is; dk, dv summed over each group in double
  for (size_t bt = 0; bt < BT; bt++) {
    const float* src = drepeated.data() + bt * wide;
    double* dst = dqkv.data() + bt * row;
    for (int i = 0; i < s.NH * s.HS; i++) dst[i] = src[i];
    for (int h = 0; h < s.NH; h++)
      for (int part = 1; part <= 2; part++)
        for (int d = 0; d < s.HS; d++)
          dst[(s.NH + (part - 1) * s.KV + h / G) * s.HS + d] += src[(part * s.NH + h) * s.HS + d];
  }

  auto d_qkv = on_device(device(), "qkv", qkv, s.misalign), d_dout = on_device(device(), "dout", dout, s.misalign);
  DeviceBuffer<float> d_out(device(), "out", out.size(), s.misalign), d_lse(device(), "lse", lse.size(), s.misalign);
  DeviceBuffer<float> d_dqkv(device(), "dqkv", s.qkv_size(), s.misalign);
  d_dqkv.fill(kNaN);
  ops().attention_forward(d_out.data(), d_lse.data(), d_qkv.data(), s.B, s.T, s.NH, s.KV, s.HS, nullptr);
  ops().attention_backward(d_dqkv.data(), d_dout.data(), d_qkv.data(), d_out.data(), d_lse.data(), s.B, s.T, s.NH,
                           s.KV, s.HS, nullptr);
  expect_close(d_lse.download("grouped attention").data(), widen(lse), attention_lse_tol(s), "grouped lse");
  expect_close(d_out.download("grouped attention").data(), widen(out), attention_out_tol(s), "grouped out");
  expect_close(d_dqkv.download("grouped attention").data(), dqkv, attention_backward_tol(s), "grouped dqkv");
}

// Attention runs no GEMM on the GPU (fp32 tiles): ops made for bf16 GEMM operands
// (fsdp.param_dtype=bf16) give the fp32 ops' bits.
TEST_P(AttentionTest, Bf16GemmOperandsLeaveItFp32) {
  const AttentionShape s = GetParam();
  auto bf16_ops = make_cuda_layer_ops(device(), DTYPE_BF16);
  auto d_qkv = on_device(device(), "qkv", uniform_vector(s.qkv_size(), 84), s.misalign);
  auto d_dout = on_device(device(), "dout", uniform_vector(s.out_size(), 85), s.misalign);
  std::vector<float> outs[2], dqkvs[2];
  for (int bf16 = 0; bf16 < 2; bf16++) {
    const LayerOps<float>& o = bf16 ? *bf16_ops : ops();
    DeviceBuffer<float> d_out(device(), "out", s.out_size(), s.misalign), d_lse(device(), "lse", s.lse_size(), 0),
        d_dqkv(device(), "dqkv", s.qkv_size(), s.misalign);
    o.attention_forward(d_out.data(), d_lse.data(), d_qkv.data(), s.B, s.T, s.NH, s.KV, s.HS, nullptr);
    o.attention_backward(d_dqkv.data(), d_dout.data(), d_qkv.data(), d_out.data(), d_lse.data(), s.B, s.T, s.NH, s.KV,
                         s.HS, nullptr);
    outs[bf16] = d_out.download("attention"), dqkvs[bf16] = d_dqkv.download("attention");
  }
  expect_same_bits(outs[1], outs[0], "attention out with bf16 GEMM operands");
  expect_same_bits(dqkvs[1], dqkvs[0], "attention dqkv with bf16 GEMM operands");
}

TEST_P(AttentionTest, RepeatsBitwise) {
  const AttentionShape s = GetParam();
  auto d_qkv = on_device(device(), "qkv", uniform_vector(s.qkv_size(), 84), s.misalign);
  auto d_dout = on_device(device(), "dout", uniform_vector(s.out_size(), 85), s.misalign);
  DeviceBuffer<float> d_out(device(), "out", s.out_size(), s.misalign), d_lse(device(), "lse", s.lse_size(), s.misalign),
      d_dqkv(device(), "dqkv", s.qkv_size(), s.misalign);
  std::vector<float> first_out, first_lse, first_dqkv;
  for (int run = 0; run < 2; run++) {
    ops().attention_forward(d_out.data(), d_lse.data(), d_qkv.data(), s.B, s.T, s.NH, s.KV, s.HS, nullptr);
    ops().attention_backward(d_dqkv.data(), d_dout.data(), d_qkv.data(), d_out.data(), d_lse.data(), s.B, s.T, s.NH,
                             s.KV, s.HS, nullptr);
    std::vector<float> out = d_out.download("run"), lse = d_lse.download("run"), dqkv = d_dqkv.download("run");
    if (run == 0) {
      first_out = out, first_lse = lse, first_dqkv = dqkv;
    } else {
      EXPECT_TRUE(same_bits(first_out, out)) << "attention out differs between runs";
      EXPECT_TRUE(same_bits(first_lse, lse)) << "attention lse differs between runs";
      EXPECT_TRUE(same_bits(first_dqkv, dqkv)) << "attention dqkv differs between runs";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, AttentionTest,
    ::testing::Values(AttentionShape{1, 1, 3, 3, 4, 0}, AttentionShape{2, 7, 4, 4, 6, 0},
                      AttentionShape{3, 13, 6, 6, 6, 0}, AttentionShape{1, 5, 2, 2, 9, 0},
                      AttentionShape{2, 45, 4, 4, 16, 0}, AttentionShape{2, 7, 4, 4, 6, 1},
                      AttentionShape{1, 5, 2, 2, 9, 1}, AttentionShape{1, 130, 3, 3, 33, 0},
                      AttentionShape{1, 70, 2, 2, 100, 0}, AttentionShape{1, 40, 2, 1, 200, 1},
                      AttentionShape{4, 256, 12, 12, 64, 0},  // realistic: GPT-2 124M, T=256
                      AttentionShape{1, 1024, 12, 12, 64, 0},  // GPT-2 124M, T=1024: 32 tiles each way
                      // grouped: G = 2, 3, 4 and multi-query (KV = 1), odd head sizes, misaligned
                      AttentionShape{1, 1, 4, 2, 4, 0}, AttentionShape{2, 7, 4, 2, 6, 0},
                      AttentionShape{3, 13, 6, 2, 6, 0}, AttentionShape{1, 5, 4, 1, 5, 0},
                      AttentionShape{2, 45, 8, 2, 16, 0}, AttentionShape{2, 7, 6, 3, 7, 1},
                      AttentionShape{2, 33, 4, 1, 8, 1}, AttentionShape{1, 97, 8, 2, 48, 0},
                      AttentionShape{2, 256, 32, 4, 64, 0}),  // realistic: TinyLlama's heads, T=256
    ShapeName());

// ==================================================================================================
// Attention for generation (attention_decode): Q new tokens at positions start..start+Q-1, their k
// and v appended to caches of max_len rows that already hold `start` positions, each query attending
// causally over the cache. Random cache contents everywhere: the rows past start+Q must come back
// untouched, the appended rows bit-identical to the new tokens' k and v. Head sizes past the block
// (one thread per dimension) and not dividing it (idle threads in the value sum); GQA and MQA.
// ==================================================================================================
struct DecodeShape {
  int Q, start, max_len, NH, KV, HS;
  int T() const { return start + Q; }
};
std::string name_of(const DecodeShape& s) {
  return "Q" + std::to_string(s.Q) + "_start" + std::to_string(s.start) + "_M" + std::to_string(s.max_len) + "_NH" +
         std::to_string(s.NH) + "_KV" + std::to_string(s.KV) + "_HS" + std::to_string(s.HS);
}
void PrintTo(const DecodeShape& s, std::ostream* os) { *os << name_of(s); }

class AttentionDecodeTest : public GpuSuite<::testing::TestWithParam<DecodeShape>> {};

TEST_P(AttentionDecodeTest, MatchesCpu) {
  const DecodeShape s = GetParam();
  const size_t row = static_cast<size_t>(s.NH + 2 * s.KV) * s.HS, cache = static_cast<size_t>(s.max_len) * s.KV * s.HS;
  // Every cached position, then a sliding window of 3 (Mistral's, shortened so that it slides here).
  for (int window : {0, 3}) {
    const std::string label = "attention_decode window " + std::to_string(window);
    const std::vector<float> qkv = uniform_vector(s.Q * row, 91);
    std::vector<float> k = uniform_vector(cache, 92), v = uniform_vector(cache, 93);
    auto d_qkv = on_device(device(), "qkv", qkv, 0), d_k = on_device(device(), "k_cache", k, 0),
         d_v = on_device(device(), "v_cache", v, 0);
    const size_t out_size = static_cast<size_t>(s.Q) * s.NH * s.HS, scores = static_cast<size_t>(s.Q) * s.NH * s.T();
    std::vector<float> out(out_size), scratch(scores);
    cpu::attention_decode(out.data(), scratch.data(), k.data(), v.data(), qkv.data(), s.Q, s.start, s.NH, s.KV, s.HS,
                          window);
    DeviceBuffer<float> d_out(device(), "out", out_size), d_scratch(device(), "scratch", scores);
    d_out.fill(kNaN);
    d_scratch.fill(kNaN);
    ops().attention_decode(d_out.data(), d_scratch.data(), d_k.data(), d_v.data(), d_qkv.data(), s.Q, s.start, s.NH,
                           s.KV, s.HS, window);
    expect_same_bits(d_k.download(label), k, label + " k_cache");
    expect_same_bits(d_v.download(label), v, label + " v_cache");
    // Scores: HS products; the softmax over up to T; out: T more products (as attention_forward).
    expect_close(d_out.download(label).data(), widen(out), fp32_pair(s.HS + 2 * s.T() + 8), label + " out");
    d_scratch.download(label + " (scratch)");
  }
}

TEST_P(AttentionDecodeTest, RepeatsBitwise) {
  const DecodeShape s = GetParam();
  const size_t row = static_cast<size_t>(s.NH + 2 * s.KV) * s.HS, cache = static_cast<size_t>(s.max_len) * s.KV * s.HS;
  auto d_qkv = on_device(device(), "qkv", uniform_vector(s.Q * row, 94), 0);
  auto d_k = on_device(device(), "k_cache", uniform_vector(cache, 95), 0);
  auto d_v = on_device(device(), "v_cache", uniform_vector(cache, 96), 0);
  DeviceBuffer<float> d_out(device(), "out", static_cast<size_t>(s.Q) * s.NH * s.HS),
      d_scratch(device(), "scratch", static_cast<size_t>(s.Q) * s.NH * s.T());
  std::vector<float> first;
  for (int run = 0; run < 2; run++) {  // the second run appends the same k, v again: the same state
    ops().attention_decode(d_out.data(), d_scratch.data(), d_k.data(), d_v.data(), d_qkv.data(), s.Q, s.start, s.NH,
                           s.KV, s.HS, 0);
    std::vector<float> out = d_out.download("run");
    if (run == 0)
      first = out;
    else
      EXPECT_TRUE(same_bits(first, out)) << "attention_decode out differs between runs";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, AttentionDecodeTest,
    ::testing::Values(DecodeShape{1, 0, 1, 3, 3, 4}, DecodeShape{1, 6, 8, 4, 2, 6}, DecodeShape{5, 0, 5, 4, 4, 8},
                      DecodeShape{3, 10, 20, 6, 3, 7}, DecodeShape{3, 17, 24, 4, 2, 96},
                      DecodeShape{2, 5, 9, 2, 1, 300},
                      DecodeShape{1, 255, 256, 12, 12, 64},   // realistic: GPT-2 124M, one token after 255
                      DecodeShape{64, 0, 1024, 12, 12, 64},   // GPT-2 124M, a prefill chunk
                      DecodeShape{4, 100, 128, 9, 3, 64},     // SmolLM-135M's heads
                      DecodeShape{1, 2000, 2048, 32, 4, 64}),  // TinyLlama's heads, a long context
    ShapeName());

// ==================================================================================================
// Rope, in place on the q and k heads of qkv (layout as attention), tables of real Llama angles
// t * 10000^(-2i/HS). Each element is x cos -/+ y sin: two products and a sum, whose roundings
// (and FMA contraction on either side) differ by a few ulp of |x| + |y|: fp32_pair(2). v must stay
// bit-identical. One thread per element pair, nothing summed: runs repeat bitwise.
// ==================================================================================================
using RopeShape = AttentionShape;

class RopeTest : public GpuSuite<::testing::TestWithParam<RopeShape>> {};

struct RopeTables {
  RopeTables(int T, int HS) : cos(static_cast<size_t>(T) * (HS / 2)), sin(cos.size()) {
    for (int t = 0; t < T; t++)
      for (int i = 0; i < HS / 2; i++) {
        const double angle = t * std::pow(10000.0, -2.0 * i / HS);
        cos[static_cast<size_t>(t) * (HS / 2) + i] = static_cast<float>(std::cos(angle));
        sin[static_cast<size_t>(t) * (HS / 2) + i] = static_cast<float>(std::sin(angle));
      }
  }
  std::vector<float> cos, sin;
};

void check_rope(const RopeShape& s, bool backward, Device& device, const LayerOps<float>& ops) {
  const RopeTables tables(s.T, s.HS);
  const std::vector<float> input = uniform_vector(s.qkv_size(), backward ? 142 : 141);
  std::vector<float> ref = input;
  if (backward)
    cpu::rope_backward(ref.data(), tables.cos.data(), tables.sin.data(), s.B, s.T, s.NH, s.KV, s.HS);
  else
    cpu::rope_forward(ref.data(), tables.cos.data(), tables.sin.data(), s.B, s.T, s.NH, s.KV, s.HS);
  auto d_cos = on_device(device, "cos", tables.cos, s.misalign);
  auto d_sin = on_device(device, "sin", tables.sin, s.misalign);
  const std::string label = backward ? "rope_backward" : "rope_forward";
  std::vector<float> first;
  for (int run = 0; run < 2; run++) {
    auto d_x = on_device(device, "qkv", input, s.misalign);
    if (backward)
      ops.rope_backward(d_x.data(), d_cos.data(), d_sin.data(), s.B, s.T, s.NH, s.KV, s.HS, nullptr);
    else
      ops.rope_forward(d_x.data(), d_cos.data(), d_sin.data(), s.B, s.T, s.NH, s.KV, s.HS, nullptr);
    const std::vector<float> got = d_x.download(label);
    if (run == 1) {
      EXPECT_TRUE(same_bits(first, got)) << label << " differs between runs";
      break;
    }
    first = got;
    expect_close(got.data(), widen(ref), fp32_pair(2), label);
    const size_t row = static_cast<size_t>(s.NH + 2 * s.KV) * s.HS, v_begin = static_cast<size_t>(s.NH + s.KV) * s.HS;
    for (size_t bt = 0; bt < static_cast<size_t>(s.B) * s.T; bt++) {  // v untouched, bit for bit
      const std::vector<float> want(input.begin() + bt * row + v_begin, input.begin() + (bt + 1) * row),
          have(got.begin() + bt * row + v_begin, got.begin() + (bt + 1) * row);
      if (!same_bits(want, have)) {
        ADD_FAILURE() << label << " changed v of token " << bt;
        break;
      }
    }
  }
  d_cos.download(label + " (cos)");
  d_sin.download(label + " (sin)");
}

TEST_P(RopeTest, ForwardMatchesCpu) { check_rope(GetParam(), false, device(), ops()); }

TEST_P(RopeTest, RestartedPositionsMatchCpu) {
  const RopeShape s = GetParam();
  const RopeTables tables(s.T, s.HS);
  const std::vector<int> positions = restarted_positions(s.B, s.T);
  const std::vector<float> input = uniform_vector(s.qkv_size(), 144);
  auto d_cos = on_device(device(), "cos", tables.cos, s.misalign);
  auto d_sin = on_device(device(), "sin", tables.sin, s.misalign);
  auto d_positions = on_device(device(), "positions", positions, 0);
  for (bool backward : {false, true}) {
    std::vector<float> ref = input;
    auto d_x = on_device(device(), "qkv", input, s.misalign);
    if (backward) {
      cpu::rope_backward(ref.data(), tables.cos.data(), tables.sin.data(), s.B, s.T, s.NH, s.KV, s.HS, positions.data());
      ops().rope_backward(d_x.data(), d_cos.data(), d_sin.data(), s.B, s.T, s.NH, s.KV, s.HS, d_positions.data());
    } else {
      cpu::rope_forward(ref.data(), tables.cos.data(), tables.sin.data(), s.B, s.T, s.NH, s.KV, s.HS, positions.data());
      ops().rope_forward(d_x.data(), d_cos.data(), d_sin.data(), s.B, s.T, s.NH, s.KV, s.HS, d_positions.data());
    }
    expect_close(d_x.download("rope with positions").data(), widen(ref), fp32_pair(2),
                 backward ? "rope_backward with positions" : "rope_forward with positions");
  }
}
TEST_P(RopeTest, BackwardMatchesCpu) { check_rope(GetParam(), true, device(), ops()); }

// The backward is the forward's inverse (a rotation's transpose): the round trip gives back the
// input to a few ulp.
TEST_P(RopeTest, BackwardUndoesForward) {
  const RopeShape s = GetParam();
  const RopeTables tables(s.T, s.HS);
  const std::vector<float> input = uniform_vector(s.qkv_size(), 143);
  auto d_cos = on_device(device(), "cos", tables.cos, s.misalign);
  auto d_sin = on_device(device(), "sin", tables.sin, s.misalign);
  auto d_x = on_device(device(), "qkv", input, s.misalign);
  ops().rope_forward(d_x.data(), d_cos.data(), d_sin.data(), s.B, s.T, s.NH, s.KV, s.HS, nullptr);
  ops().rope_backward(d_x.data(), d_cos.data(), d_sin.data(), s.B, s.T, s.NH, s.KV, s.HS, nullptr);
  expect_close(d_x.download("rope round trip").data(), widen(input), fp32_pair(4), "rope round trip");
}

INSTANTIATE_TEST_SUITE_P(Shapes, RopeTest,
                         ::testing::Values(RopeShape{1, 1, 1, 1, 2, 0}, RopeShape{2, 7, 4, 4, 6, 0},
                                           RopeShape{3, 13, 6, 2, 10, 0}, RopeShape{1, 5, 4, 1, 2, 0},
                                           RopeShape{2, 7, 6, 3, 14, 1}, RopeShape{2, 33, 4, 2, 8, 1},
                                           RopeShape{2, 256, 32, 4, 64, 0}),  // realistic: TinyLlama, T=256
                         ShapeName());

// ==================================================================================================
// Elementwise: GELU, residual add, scale. n not a multiple of 4; misaligned cases take the scalar path.
// ==================================================================================================
struct PointwiseShape {
  size_t n;
  int misalign;
};
std::string name_of(const PointwiseShape& s) { return "n" + std::to_string(s.n) + misaligned_suffix(s.misalign); }
void PrintTo(const PointwiseShape& s, std::ostream* os) { *os << name_of(s); }

class PointwiseTest : public GpuSuite<::testing::TestWithParam<PointwiseShape>> {};

TEST_P(PointwiseTest, GeluForwardMatchesCpu) {
  const PointwiseShape s = GetParam();
  const std::vector<float> inp = uniform_vector(s.n, 91, -6.0, 6.0);
  std::vector<float> ref(s.n);
  cpu::gelu_forward(ref.data(), inp.data(), s.n);
  auto d_inp = on_device(device(), "inp", inp, s.misalign);
  DeviceBuffer<float> d_out(device(), "out", s.n, s.misalign);
  d_out.fill(kNaN);
  ops().gelu_forward(d_out.data(), d_inp.data(), s.n);
  expect_close(d_out.download("gelu_forward").data(), widen(ref), kGeluTol, "gelu out");
}

TEST_P(PointwiseTest, GeluBackwardMatchesCpu) {
  const PointwiseShape s = GetParam();
  const std::vector<float> inp = uniform_vector(s.n, 92, -6.0, 6.0), dout = uniform_vector(s.n, 93);
  std::vector<float> ref(s.n);
  cpu::gelu_backward(ref.data(), dout.data(), inp.data(), s.n);
  auto d_inp = on_device(device(), "inp", inp, s.misalign), d_dout = on_device(device(), "dout", dout, s.misalign);
  DeviceBuffer<float> d_dinp(device(), "dinp", s.n, s.misalign);
  d_dinp.fill(kNaN);
  ops().gelu_backward(d_dinp.data(), d_dout.data(), d_inp.data(), s.n);
  expect_close(d_dinp.download("gelu_backward").data(), widen(ref), kGeluTol, "gelu dinp");
}

TEST_P(PointwiseTest, ResidualMatchesCpuBitwise) {
  const PointwiseShape s = GetParam();
  const std::vector<float> a = uniform_vector(s.n, 94), b = uniform_vector(s.n, 95);
  std::vector<float> ref(s.n);
  cpu::residual_forward(ref.data(), a.data(), b.data(), s.n);
  auto d_a = on_device(device(), "a", a, s.misalign), d_b = on_device(device(), "b", b, s.misalign);
  DeviceBuffer<float> d_out(device(), "out", s.n, s.misalign);
  d_out.fill(kNaN);
  ops().residual_forward(d_out.data(), d_a.data(), d_b.data(), s.n);
  expect_close(d_out.download("residual_forward").data(), widen(ref), kExact, "residual out");
  ops().residual_forward(d_a.data(), d_a.data(), d_b.data(), s.n);  // in place, out == a
  expect_close(d_a.download("residual_forward in place").data(), widen(ref), kExact, "residual in place");
}

TEST_P(PointwiseTest, ScaleMatchesHostBitwise) {
  const PointwiseShape s = GetParam();
  std::vector<float> x = uniform_vector(s.n, 96);
  auto d_x = on_device(device(), "x", x, s.misalign);
  const float factor = 0.37f;
  for (float& v : x) v *= factor;
  ops().scale(d_x.data(), s.n, factor);
  expect_close(d_x.download("scale").data(), widen(x), kExact, "scale");
}

// DoRA's quotient: one IEEE division per element on both sides (__fdiv_rn), bit-identical; signs
// mixed, one a / +0 (an infinity on both sides; 0 / 0 is avoided: the two NaNs' bits differ).
// Out of place, then in place on a and on b.
TEST_P(PointwiseTest, DivideMatchesCpuBitwise) {
  const PointwiseShape s = GetParam();
  std::vector<float> a = uniform_vector(s.n, 97, -4.0, 4.0), b = uniform_vector(s.n, 98, 0.25, 2.0);
  for (size_t i = 1; i < s.n; i += 2) b[i] = -b[i];
  if (s.n > 2) {
    a[s.n / 2] = 1.5f;
    b[s.n / 2] = 0.0f;
  }
  std::vector<float> ref(s.n);
  cpu::divide(ref.data(), a.data(), b.data(), s.n);
  auto d_a = on_device(device(), "a", a, s.misalign), d_b = on_device(device(), "b", b, s.misalign);
  DeviceBuffer<float> d_out(device(), "out", s.n, s.misalign);
  for (int run = 0; run < 2; run++) {  // the second run repeats the first bit for bit
    d_out.fill(kNaN);
    ops().divide(d_out.data(), d_a.data(), d_b.data(), s.n);
    expect_same_bits(d_out.download("divide"), ref, "divide " + name_of(s));
  }
  ops().divide(d_a.data(), d_a.data(), d_b.data(), s.n);  // out == a
  expect_same_bits(d_a.download("divide in place (a)"), ref, "divide in place on a " + name_of(s));
  d_a.upload(a);
  ops().divide(d_b.data(), d_a.data(), d_b.data(), s.n);  // out == b
  expect_same_bits(d_b.download("divide in place (b)"), ref, "divide in place on b " + name_of(s));
}

// LoHa's scaled Hadamard product: (s * a) * b, two IEEE multiplications on both sides, bit-identical.
// Out of place, then in place on a and on b.
TEST_P(PointwiseTest, MultiplyMatchesCpuBitwise) {
  const PointwiseShape s = GetParam();
  const std::vector<float> a = uniform_vector(s.n, 99, -4.0, 4.0), b = uniform_vector(s.n, 100, -2.0, 2.0);
  const float factor = -0.37f;
  std::vector<float> ref(s.n);
  cpu::multiply(ref.data(), a.data(), b.data(), s.n, factor);
  auto d_a = on_device(device(), "a", a, s.misalign), d_b = on_device(device(), "b", b, s.misalign);
  DeviceBuffer<float> d_out(device(), "out", s.n, s.misalign);
  for (int run = 0; run < 2; run++) {
    d_out.fill(kNaN);
    ops().multiply(d_out.data(), d_a.data(), d_b.data(), s.n, factor);
    expect_same_bits(d_out.download("multiply"), ref, "multiply " + name_of(s));
  }
  ops().multiply(d_a.data(), d_a.data(), d_b.data(), s.n, factor);  // out == a
  expect_same_bits(d_a.download("multiply in place (a)"), ref, "multiply in place on a " + name_of(s));
  d_a.upload(a);
  ops().multiply(d_b.data(), d_a.data(), d_b.data(), s.n, factor);  // out == b
  expect_same_bits(d_b.download("multiply in place (b)"), ref, "multiply in place on b " + name_of(s));
}

INSTANTIATE_TEST_SUITE_P(Sizes, PointwiseTest,
                         ::testing::Values(PointwiseShape{1, 0}, PointwiseShape{3, 0}, PointwiseShape{4, 0},
                                           PointwiseShape{1001, 0}, PointwiseShape{65537, 0}, PointwiseShape{3, 1},
                                           PointwiseShape{1001, 1}, PointwiseShape{1000003, 0}),
                         ShapeName());

// ==================================================================================================
// SwiGLU: rows of gate_up hold gate (I) | up (I); gates in [-6, 6), ups and dout in [-1, 1).
// Misaligned cases and I % 4 != 0 take the scalar path, the others float4.
// ==================================================================================================
struct SwiGluShape {
  int N, I, misalign;
};
std::string name_of(const SwiGluShape& s) {
  return "N" + std::to_string(s.N) + "_I" + std::to_string(s.I) + misaligned_suffix(s.misalign);
}
void PrintTo(const SwiGluShape& s, std::ostream* os) { *os << name_of(s); }

class SwiGluTest : public GpuSuite<::testing::TestWithParam<SwiGluShape>> {};

// silu_value and silu_derivative (backend/math.hpp) on both sides: FMA contraction and exp_fast's
// ~2 ulp, a few ulp of the result, except near silu'(x) = 0 (x ~ -1.28) where its two terms cancel:
// a few ulp of the O(1) terms, hence the atol (as GELU's).
constexpr Tolerance kSiluTol{1e-6, 1e-5};

std::vector<float> gate_up_vector(const SwiGluShape& s, uint64_t seed) {
  const std::vector<float> gates = uniform_vector(static_cast<size_t>(s.N) * s.I, seed, -6.0, 6.0),
                           ups = uniform_vector(gates.size(), seed + 1);
  std::vector<float> gate_up(2 * gates.size());
  for (int n = 0; n < s.N; n++) {
    const size_t row = static_cast<size_t>(n) * s.I;
    std::copy(gates.begin() + row, gates.begin() + row + s.I, gate_up.begin() + 2 * row);
    std::copy(ups.begin() + row, ups.begin() + row + s.I, gate_up.begin() + 2 * row + s.I);
  }
  return gate_up;
}

TEST_P(SwiGluTest, ForwardMatchesCpu) {
  const SwiGluShape s = GetParam();
  const std::vector<float> gate_up = gate_up_vector(s, 151);
  std::vector<float> ref(static_cast<size_t>(s.N) * s.I);
  cpu::swiglu_forward(ref.data(), gate_up.data(), s.N, s.I);
  auto d_gate_up = on_device(device(), "gate_up", gate_up, s.misalign);
  std::vector<float> first;
  for (int run = 0; run < 2; run++) {
    DeviceBuffer<float> d_out(device(), "out", ref.size(), s.misalign);
    d_out.fill(kNaN);
    ops().swiglu_forward(d_out.data(), d_gate_up.data(), s.N, s.I);
    const std::vector<float> got = d_out.download("swiglu_forward");
    if (run == 0) {
      expect_close(got.data(), widen(ref), kSiluTol, "swiglu out");
      first = got;
    } else {
      EXPECT_TRUE(same_bits(first, got)) << "swiglu out differs between runs";
    }
  }
}

// dgate_up is written (=): NaN before, every element after.
TEST_P(SwiGluTest, BackwardMatchesCpu) {
  const SwiGluShape s = GetParam();
  const std::vector<float> gate_up = gate_up_vector(s, 153), dout = uniform_vector(static_cast<size_t>(s.N) * s.I, 155);
  std::vector<float> ref(gate_up.size());
  cpu::swiglu_backward(ref.data(), dout.data(), gate_up.data(), s.N, s.I);
  auto d_gate_up = on_device(device(), "gate_up", gate_up, s.misalign);
  auto d_dout = on_device(device(), "dout", dout, s.misalign);
  std::vector<float> first;
  for (int run = 0; run < 2; run++) {
    DeviceBuffer<float> d_dgate_up(device(), "dgate_up", ref.size(), s.misalign);
    d_dgate_up.fill(kNaN);
    ops().swiglu_backward(d_dgate_up.data(), d_dout.data(), d_gate_up.data(), s.N, s.I);
    const std::vector<float> got = d_dgate_up.download("swiglu_backward");
    if (run == 0) {
      expect_close(got.data(), widen(ref), kSiluTol, "swiglu dgate_up");
      first = got;
    } else {
      EXPECT_TRUE(same_bits(first, got)) << "swiglu dgate_up differs between runs";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, SwiGluTest,
                         ::testing::Values(SwiGluShape{1, 1, 0}, SwiGluShape{3, 5, 0}, SwiGluShape{7, 12, 0},
                                           SwiGluShape{7, 12, 1}, SwiGluShape{13, 101, 0}, SwiGluShape{13, 100, 1},
                                           SwiGluShape{512, 5632, 0}),  // realistic: TinyLlama's MLP, 512 tokens
                         ShapeName());

// ==================================================================================================
// Fused softmax + cross-entropy over V; logits in [-4, 4).
// ==================================================================================================
struct CrossEntropyShape {
  int N, V;
};
std::string name_of(const CrossEntropyShape& s) { return "N" + std::to_string(s.N) + "_V" + std::to_string(s.V); }
void PrintTo(const CrossEntropyShape& s, std::ostream* os) { *os << name_of(s); }

class CrossEntropyTest : public GpuSuite<::testing::TestWithParam<CrossEntropyShape>> {};

// Every third row's target ignored (a loss mask's IGNORED_TARGET, -1): the kernels give that row loss
// 0 and gradient 0, as the CPU does.
std::vector<int> with_ignored(std::vector<int> targets) {
  for (size_t n = 1; n < targets.size(); n += 3) targets[n] = -1;
  return targets;
}

TEST_P(CrossEntropyTest, ForwardMatchesCpu) {
  const CrossEntropyShape s = GetParam();
  const std::vector<int> targets = with_ignored(index_vector(s.N, 101, s.V));
  const std::vector<float> logits = uniform_vector(static_cast<size_t>(s.N) * s.V, 102, -4.0, 4.0);
  std::vector<float> probs = logits, losses(s.N);
  cpu::softmax_crossentropy_forward(losses.data(), probs.data(), targets.data(), s.N, s.V);
  auto d_targets = on_device(device(), "targets", targets, 0);
  auto d_probs = on_device(device(), "logits", logits, 0);
  DeviceBuffer<float> d_losses(device(), "losses", s.N);
  d_losses.fill(kNaN);
  ops().softmax_crossentropy_forward(d_losses.data(), d_probs.data(), d_targets.data(), s.N, s.V);
  // The row sum of V exponentials (positive terms: relative error bounded by the chain length),
  // exp_fast, the division and the log: K = V + 8. V = 513 and 1000 keep a dropped element visible
  // (~1/V) above the bound.
  const Tolerance tol = fp32_pair(s.V + 8);
  expect_close(d_probs.download("softmax_crossentropy_forward").data(), widen(probs), tol, "crossentropy probs");
  expect_close(d_losses.download("softmax_crossentropy_forward").data(), widen(losses), tol, "crossentropy losses");
}

TEST_P(CrossEntropyTest, BackwardMatchesCpuBitwise) {
  const CrossEntropyShape s = GetParam();
  const std::vector<int> targets = with_ignored(index_vector(s.N, 103, s.V));
  std::vector<float> probs = uniform_vector(static_cast<size_t>(s.N) * s.V, 104, -4.0, 4.0), losses(s.N);
  cpu::softmax_crossentropy_forward(losses.data(), probs.data(), targets.data(), s.N, s.V);
  auto d_targets = on_device(device(), "targets", targets, 0);
  auto d_probs = on_device(device(), "probs", probs, 0);
  const float dloss = 1.0f / (3.0f * s.N);
  cpu::softmax_crossentropy_backward(probs.data(), targets.data(), dloss, s.N, s.V);
  ops().softmax_crossentropy_backward(d_probs.data(), d_targets.data(), dloss, s.N, s.V);
  expect_close(d_probs.download("softmax_crossentropy_backward").data(), widen(probs), kExact, "crossentropy dlogits");
}

INSTANTIATE_TEST_SUITE_P(Shapes, CrossEntropyTest,
                         ::testing::Values(CrossEntropyShape{1, 1}, CrossEntropyShape{3, 7}, CrossEntropyShape{5, 513},
                                           CrossEntropyShape{4, 1000}, CrossEntropyShape{2, 50257}),
                         ShapeName());

// ==================================================================================================
// Knowledge distillation's fused loss (distill_loss_forward): student and teacher logits in
// [-4, 4), alpha in {0, 0.3, 1}, T in {0.5, 1, 2.5}. The kernel runs the CPU's per-element
// arithmetic (the same float arguments to exp_fast, everything else in double) and differs only in
// the order of its double row sums and in exp_fast's FMA contraction (<= 2 ulp, 4 u, of an
// exponential on either side). So each probability p_i (of softmax(s), softmax(s/T), softmax(t/T))
// is within 16 u p_i of the CPU's (its exponential's 8 u and the normalisation's 8 u), and:
//   gradient: alpha (16 u) + (1 - alpha) T (2 x 16 u), plus one rounding of each side (rtol 2 u);
//   loss: the CE's log Z1 within 8 u; the KL sum sum_i p_i d_i (d_i = log p_i - log q_i, |d_i| <= 2
//   (A + log V), A = spread / T the largest argument, spread = 8 here) within 16 u sum p_i |d_i|
//   + 2 x 8 u for the two log Z's; times the weights, plus one rounding of each side.
// ==================================================================================================
struct DistillShape {
  int N, V;
};
std::string name_of(const DistillShape& s) { return "N" + std::to_string(s.N) + "_V" + std::to_string(s.V); }
void PrintTo(const DistillShape& s, std::ostream* os) { *os << name_of(s); }

Tolerance distill_grad_tol(double alpha, double T) { return {16 * kU32 * (alpha + 2 * (1 - alpha) * T), 2 * kU32}; }
Tolerance distill_loss_tol(double alpha, double T, int V, double spread = 8.0) {
  const double A = spread / T;
  const double kl = 16 * 2 * (A + std::log(static_cast<double>(V))) + 16;
  return {kU32 * (8 * alpha + (1 - alpha) * T * T * kl), 2 * kU32};
}

class DistillLossTest : public GpuSuite<::testing::TestWithParam<DistillShape>> {};

// Against the CPU; the teacher is left bit for bit as it was, losses (NaN before) are all written,
// and a second run from the same inputs gives the same bits.
TEST_P(DistillLossTest, MatchesCpu) {
  const DistillShape s = GetParam();
  const size_t n = static_cast<size_t>(s.N) * s.V;
  const std::vector<int> targets = with_ignored(index_vector(s.N, 161, s.V));
  const std::vector<float> student = uniform_vector(n, 162, -4.0, 4.0), teacher = uniform_vector(n, 163, -4.0, 4.0);
  auto d_targets = on_device(device(), "targets", targets, 0);
  auto d_teacher = on_device(device(), "teacher", teacher, 0);
  for (float alpha : {0.0f, 0.3f, 1.0f})
    for (float T : {0.5f, 1.0f, 2.5f}) {
      const std::string label = "distill alpha=" + std::to_string(alpha) + " T=" + std::to_string(T);
      std::vector<float> grad = student, losses(s.N);
      cpu::distill_loss_forward(losses.data(), grad.data(), teacher.data(), targets.data(), s.N, s.V, alpha, T);
      std::vector<float> first_grad, first_losses;
      for (int run = 0; run < 2; run++) {
        auto d_grad = on_device(device(), "student", student, 0);
        DeviceBuffer<float> d_losses(device(), "losses", s.N);
        d_losses.fill(kNaN);
        ops().distill_loss_forward(d_losses.data(), d_grad.data(), d_teacher.data(), d_targets.data(), s.N, s.V,
                                   alpha, T);
        const std::vector<float> got_grad = d_grad.download(label), got_losses = d_losses.download(label);
        if (run == 0) {
          expect_close(got_grad.data(), widen(grad), distill_grad_tol(alpha, T), label + " gradient");
          expect_close(got_losses.data(), widen(losses), distill_loss_tol(alpha, T, s.V), label + " losses");
          first_grad = got_grad, first_losses = got_losses;
        } else {
          expect_same_bits(got_grad, first_grad, label + " gradient, second run");
          expect_same_bits(got_losses, first_losses, label + " losses, second run");
        }
      }
    }
  expect_same_bits(d_teacher.download("teacher"), teacher, "distill teacher (read only)");
}

// A teacher equal to the student: the KL term and its gradient are exactly 0 (as on the CPU), so
// with alpha = 0 every loss and every gradient element is 0.
TEST_P(DistillLossTest, TeacherEqualToStudentGivesZeroWithAlphaZero) {
  const DistillShape s = GetParam();
  const size_t n = static_cast<size_t>(s.N) * s.V;
  const std::vector<int> targets = index_vector(s.N, 164, s.V);
  const std::vector<float> logits = uniform_vector(n, 165, -4.0, 4.0);
  auto d_targets = on_device(device(), "targets", targets, 0);
  auto d_teacher = on_device(device(), "teacher", logits, 0);
  for (float T : {0.5f, 1.0f, 2.5f}) {
    auto d_grad = on_device(device(), "student", logits, 0);
    DeviceBuffer<float> d_losses(device(), "losses", s.N);
    d_losses.fill(kNaN);
    ops().distill_loss_forward(d_losses.data(), d_grad.data(), d_teacher.data(), d_targets.data(), s.N, s.V, 0.0f, T);
    const std::string label = "distill teacher=student alpha=0 T=" + std::to_string(T);
    expect_close(d_grad.download(label).data(), std::vector<double>(n, 0.0), kExact, label + " gradient");
    expect_close(d_losses.download(label).data(), std::vector<double>(s.N, 0.0), kExact, label + " losses");
  }
}

// +-80 logits, a teacher row whose probabilities underflow at T = 0.5 (exp(-320)), a student row
// shifted by 1000: finite, and the CPU's values under the same model with a spread of 160.
TEST_P(DistillLossTest, ExtremeLogitsStayFiniteAndMatchCpu) {
  const DistillShape s = GetParam();
  if (s.N < 3) GTEST_SKIP() << "needs 3 rows";
  const size_t n = static_cast<size_t>(s.N) * s.V;
  const std::vector<int> targets = index_vector(s.N, 166, s.V);
  std::vector<float> student = uniform_vector(n, 167, -80.0, 80.0), teacher = uniform_vector(n, 168, -80.0, 80.0);
  for (int i = 0; i < s.V; i++) {
    student[static_cast<size_t>(1) * s.V + i] += 1000.0f;
    teacher[static_cast<size_t>(2) * s.V + i] = i == 1 ? 80.0f : -80.0f;
  }
  auto d_targets = on_device(device(), "targets", targets, 0);
  auto d_teacher = on_device(device(), "teacher", teacher, 0);
  for (float alpha : {0.0f, 0.3f, 1.0f})
    for (float T : {0.5f, 2.5f}) {
      const std::string label = "distill extreme alpha=" + std::to_string(alpha) + " T=" + std::to_string(T);
      std::vector<float> grad = student, losses(s.N);
      cpu::distill_loss_forward(losses.data(), grad.data(), teacher.data(), targets.data(), s.N, s.V, alpha, T);
      auto d_grad = on_device(device(), "student", student, 0);
      DeviceBuffer<float> d_losses(device(), "losses", s.N);
      d_losses.fill(kNaN);
      ops().distill_loss_forward(d_losses.data(), d_grad.data(), d_teacher.data(), d_targets.data(), s.N, s.V,
                                 alpha, T);
      const std::vector<float> got_grad = d_grad.download(label), got_losses = d_losses.download(label);
      for (float g : got_grad) ASSERT_TRUE(std::isfinite(g)) << label;
      for (float l : got_losses) ASSERT_TRUE(std::isfinite(l)) << label;
      expect_close(got_grad.data(), widen(grad), distill_grad_tol(alpha, T), label + " gradient");
      expect_close(got_losses.data(), widen(losses), distill_loss_tol(alpha, T, s.V, 160.0), label + " losses");
    }
}

INSTANTIATE_TEST_SUITE_P(Shapes, DistillLossTest,
                         ::testing::Values(DistillShape{1, 2}, DistillShape{3, 37}, DistillShape{5, 513},
                                           DistillShape{4, 1000}, DistillShape{3, 50257}),
                         ShapeName());

// ==================================================================================================
// Reductions to the host. sum, sum_squares: both sides add widened floats in double, in different
// orders; each is within n 2^-53 sum|terms| of the exact value (Higham), so they differ by at
// most twice that. count_nonfinite is exact.
// ==================================================================================================
class ReduceTest : public GpuSuite<::testing::TestWithParam<size_t>> {};

TEST_P(ReduceTest, SumAndSumSquaresMatchCpu) {
  const size_t n = GetParam();
  const std::vector<float> x = uniform_vector(n, 111);
  double sum = 0, sum_abs = 0, squares = 0;
  for (float v : x) {
    sum += v;
    sum_abs += std::fabs(v);
    squares += static_cast<double>(v) * v;
  }
  auto d_x = on_device(device(), "x", x, static_cast<int>(n % 2));
  const double bound = 2.0 * static_cast<double>(n) * 0x1p-53;
  const double got_sum = ops().sum(d_x.data(), n), got_squares = ops().sum_squares(d_x.data(), n);
  EXPECT_LE(std::fabs(got_sum - sum), bound * sum_abs) << "sum of " << n;
  EXPECT_LE(std::fabs(got_squares - squares), bound * squares) << "sum_squares of " << n;
  EXPECT_EQ(ops().sum(d_x.data(), n), got_sum) << "sum repeats bitwise";
  EXPECT_EQ(ops().sum_squares(d_x.data(), n), got_squares) << "sum_squares repeats bitwise";
  d_x.download("reductions");
}

// The step's sums stay on the device: accumulate_* add the value sum()/sum_squares() return, bit
// for bit, onto what is there, and never make the host wait.
TEST_P(ReduceTest, AccumulateAddsTheReturnedValueWithoutWaiting) {
  const size_t n = GetParam();
  const std::vector<float> x = uniform_vector(n, 113);
  auto d_x = on_device(device(), "x", x, static_cast<int>(n % 2));
  const double sum = ops().sum(d_x.data(), n), squares = ops().sum_squares(d_x.data(), n);
  DeviceBuffer<double> totals(device(), "totals", 2, 0);
  totals.upload({0.25, -1.5});
  const uint64_t waits = device().host_syncs();
  ops().accumulate_sum(totals.data(), d_x.data(), n);
  ops().accumulate_sum_squares(totals.data() + 1, d_x.data(), n);
  ops().accumulate_sum(totals.data(), d_x.data(), n);  // twice: it adds
  EXPECT_EQ(device().host_syncs(), waits) << "accumulating waited for the device";
  const std::vector<double> got = totals.download("accumulated sums");
  EXPECT_EQ(got[0], (0.25 + sum) + sum);
  EXPECT_EQ(got[1], -1.5 + squares);
}

TEST_P(ReduceTest, CountNonfiniteIsExact) {
  const size_t n = GetParam();
  std::vector<float> x = uniform_vector(n, 112);
  auto d_x = on_device(device(), "x", x, 0);
  EXPECT_EQ(ops().count_nonfinite(d_x.data(), n), 0u);
  if (n == 0) return;
  const float specials[] = {kNaN, std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                            -kNaN};
  size_t expected = 0;
  for (size_t k = 0; k < 4; k++) {
    const size_t at[] = {0, n - 1, n / 2, n / 3};
    if (std::isfinite(x[at[k]])) expected++;
    x[at[k]] = specials[k];
  }
  d_x.upload(x);
  EXPECT_EQ(ops().count_nonfinite(d_x.data(), n), expected);
  EXPECT_EQ(ops().count_nonfinite(d_x.data(), n), expected) << "repeated";
  x[0] = std::numeric_limits<float>::max();  // large but finite
  d_x.upload(x);
  EXPECT_EQ(ops().count_nonfinite(d_x.data(), n), expected - 1);
}

INSTANTIATE_TEST_SUITE_P(Sizes, ReduceTest, ::testing::Values(0, 1, 7, 1000, 4097, 1000003),
                         [](const ::testing::TestParamInfo<size_t>& info) { return "n" + std::to_string(info.param); });

// ==================================================================================================
// ShardOps: 16-bit conversions must be bit-identical to backend/dtype.hpp on the host (the same
// code); AdamW must match the host loop of adamw_update within kAdamWTol.
// ==================================================================================================
class ShardOpsTest : public GpuSuite<::testing::TestWithParam<DType>> {};

// Every 16-bit pattern.
std::vector<uint16_t> every_half() {
  std::vector<uint16_t> halves(65536);
  for (uint32_t h = 0; h < 65536; h++) halves[h] = static_cast<uint16_t>(h);
  return halves;
}

// Floats of every magnitude (a stride through all 2^32 patterns), ties (bf16's and fp16's),
// subnormals, values beyond fp16's range (65504 is its largest, 65520 the first that overflows),
// infinities and NaN payloads.
std::vector<float> awkward_floats() {
  std::vector<float> floats;
  for (uint64_t bits = 0; bits < (uint64_t{1} << 32); bits += 4099) floats.push_back(bits_float(static_cast<uint32_t>(bits)));
  for (uint32_t bits : {0x00000000u, 0x80000000u, 0x7F800000u, 0xFF800000u, 0x7FC00000u, 0x7F800001u, 0xFFC12345u,
                        0x00000001u, 0x807FFFFFu, 0x3F808000u, 0x3F818000u, 0x477FEFFFu, 0x477FF000u, 0x33000000u,
                        0x33000001u, 0x33800000u, 0x387FE000u, 0x38800000u, 0x7F7FFFFFu, 0xC77FF000u})
    floats.push_back(bits_float(bits));
  floats.push_back(65504.0f);
  floats.push_back(65519.0f);
  return floats;
}

TEST_P(ShardOpsTest, HalfConversionsMatchHostBitwise) {
  const DType type = GetParam();
  const std::vector<uint16_t> halves = every_half();
  std::vector<float> widened(halves.size());
  for (size_t i = 0; i < halves.size(); i++) widened[i] = half_to_float(halves[i], type);
  auto d_halves = on_device(device(), "halves", halves, 0);
  DeviceBuffer<float> d_widened(device(), "widened", halves.size(), 1);
  shard_ops().from_half(d_widened.data(), d_halves.data(), halves.size(), type);
  expect_same_bits(d_widened.download("from_half"), widened, std::string("from_half ") + dtype_name(type));

  const std::vector<float> floats = awkward_floats();
  std::vector<uint16_t> rounded(floats.size());
  for (size_t i = 0; i < floats.size(); i++) rounded[i] = float_to_half(floats[i], type);
  auto d_floats = on_device(device(), "floats", floats, 1);
  DeviceBuffer<uint16_t> d_rounded(device(), "rounded", floats.size(), 1);
  shard_ops().to_half(d_rounded.data(), d_floats.data(), floats.size(), type);
  expect_same_bits(d_rounded.download("to_half"), rounded, std::string("to_half ") + dtype_name(type));
}

INSTANTIATE_TEST_SUITE_P(Types, ShardOpsTest, ::testing::Values(DTYPE_BF16, DTYPE_FP16),
                         [](const ::testing::TestParamInfo<DType>& info) { return std::string(dtype_name(info.param)); });

// 16-bit activations (LayerOps::round_to_half, widen_half): round_to_half must leave exactly what
// to_half then from_half give -- the 16-bit value and its widening -- on the host (dtype.hpp) and on
// the device (ShardOps), and widen_half is from_half.
class HalfActivationsTest : public GpuSuite<::testing::TestWithParam<DType>> {};

TEST_P(HalfActivationsTest, RoundToHalfIsToHalfThenFromHalfBitwise) {
  const DType type = GetParam();
  const std::string label = std::string("round_to_half ") + dtype_name(type);
  const std::vector<float> floats = awkward_floats();
  std::vector<uint16_t> halves(floats.size());
  std::vector<float> widened(floats.size());
  for (size_t i = 0; i < floats.size(); i++) {
    halves[i] = float_to_half(floats[i], type);
    widened[i] = half_to_float(halves[i], type);
  }
  auto d_values = on_device(device(), "values", floats, 1);  // misaligned: any alignment will do
  DeviceBuffer<uint16_t> d_halves(device(), "halves", floats.size(), 1);
  ops().round_to_half(d_values.data(), d_halves.data(), floats.size(), type);
  const std::vector<float> got_values = d_values.download(label);
  const std::vector<uint16_t> got_halves = d_halves.download(label);
  expect_same_bits(got_halves, halves, label + " 16-bit values");
  expect_same_bits(got_values, widened, label + " rounded values");
  for (int shift : {0, 1}) {  // a null copy: the rounding alone, packed (with a tail) and one by one
    auto d_alone = on_device(device(), "values", floats, shift);
    ops().round_to_half(d_alone.data(), nullptr, floats.size(), type);
    expect_same_bits(d_alone.download(label), widened, label + " rounded in place, no copy");
  }

  auto d_floats = on_device(device(), "floats", floats, 0);
  DeviceBuffer<uint16_t> d_to(device(), "to_half", floats.size(), 0);
  DeviceBuffer<float> d_from(device(), "from_half", floats.size(), 0);
  shard_ops().to_half(d_to.data(), d_floats.data(), floats.size(), type);
  shard_ops().from_half(d_from.data(), d_to.data(), floats.size(), type);
  expect_same_bits(got_halves, d_to.download("to_half"), label + " against the device's to_half");
  expect_same_bits(got_values, d_from.download("from_half"), label + " against the device's from_half");
}

// widen_half gives every pattern's widening, and rounding a widened value changes nothing: the
// 16-bit value comes back and the fp32 value keeps its bits (NaN patterns excepted: they come back
// quiet or canonical, as the first test's NaN payloads check).
TEST_P(HalfActivationsTest, WidenHalfRoundTrips) {
  const DType type = GetParam();
  const std::string label = std::string("widen_half ") + dtype_name(type);
  std::vector<uint16_t> halves;
  for (uint16_t h : every_half())
    if (!std::isnan(half_to_float(h, type))) halves.push_back(h);
  std::vector<float> widened(halves.size());
  for (size_t i = 0; i < halves.size(); i++) widened[i] = half_to_float(halves[i], type);
  auto d_halves = on_device(device(), "halves", halves, 1);
  DeviceBuffer<float> d_values(device(), "values", halves.size(), 1);
  d_values.fill(kNaN);
  ops().widen_half(d_values.data(), d_halves.data(), halves.size(), type);
  expect_same_bits(d_values.download(label), widened, label);

  DeviceBuffer<uint16_t> d_again(device(), "again", halves.size(), 0);
  ops().round_to_half(d_values.data(), d_again.data(), halves.size(), type);
  expect_same_bits(d_again.download(label), halves, label + " then round_to_half: 16-bit values");
  expect_same_bits(d_values.download(label), widened, label + " then round_to_half: fp32 values");
}

// The conversions take packs of 8 elements through 16-byte accesses where every pointer is
// 16-byte aligned, and the rest one by one: every length around a pack's edge, at each pairing of
// aligned and misaligned buffers (misaligned by 1-3 floats or 1-7 halves), gives the host's bits
// and writes nothing outside its n elements (the buffers' guard zones).
TEST_P(HalfActivationsTest, EveryLengthAndAlignmentGivesTheHostBits) {
  const DType type = GetParam();
  const std::vector<float> pool = awkward_floats();
  for (size_t n : {1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 64, 1000, 4101}) {
    for (auto [float_shift, half_shift] : {std::pair{0, 0}, {0, 3}, {1, 0}, {2, 5}, {3, 1}, {0, 4}, {4, 8}}) {
      const std::string label = std::string(dtype_name(type)) + " n=" + std::to_string(n) + " float shift " +
                                std::to_string(float_shift) + " half shift " + std::to_string(half_shift);
      const std::vector<float> floats(pool.begin() + n * 37 % 1000, pool.begin() + n * 37 % 1000 + n);
      std::vector<uint16_t> halves(n);
      std::vector<float> widened(n);
      for (size_t i = 0; i < n; i++) {
        halves[i] = float_to_half(floats[i], type);
        widened[i] = half_to_float(halves[i], type);
      }
      auto d_floats = on_device(device(), "floats", floats, float_shift);
      DeviceBuffer<uint16_t> d_halves(device(), "halves", n, half_shift);
      shard_ops().to_half(d_halves.data(), d_floats.data(), n, type);
      expect_same_bits(d_halves.download(label), halves, label + ": to_half");
      DeviceBuffer<float> d_widened(device(), "widened", n, float_shift);
      shard_ops().from_half(d_widened.data(), d_halves.data(), n, type);
      expect_same_bits(d_widened.download(label), widened, label + ": from_half");
      d_widened.fill(kNaN);
      ops().widen_half(d_widened.data(), d_halves.data(), n, type);
      expect_same_bits(d_widened.download(label), widened, label + ": widen_half");
      DeviceBuffer<uint16_t> d_kept(device(), "kept", n, half_shift);
      ops().round_to_half(d_floats.data(), d_kept.data(), n, type);
      expect_same_bits(d_kept.download(label), halves, label + ": round_to_half's 16-bit values");
      expect_same_bits(d_floats.download(label), widened, label + ": round_to_half's rounded values");
    }
  }
}

TEST_P(HalfActivationsTest, EmptyIsANoOp) {
  const DType type = GetParam();
  const float not_16_bit = bits_float(0x3F800001u);  // 1 + 2^-23: rounding would change it
  DeviceBuffer<float> d_values(device(), "values", 1, 0);
  DeviceBuffer<uint16_t> d_halves(device(), "halves", 1, 0);
  d_values.fill(not_16_bit);
  d_halves.fill(7);
  ops().round_to_half(d_values.data(), d_halves.data(), 0, type);
  ops().widen_half(d_values.data(), d_halves.data(), 0, type);
  EXPECT_EQ(d_values.download("round_to_half n=0")[0], not_16_bit);
  EXPECT_EQ(d_halves.download("round_to_half n=0")[0], 7);
}

INSTANTIATE_TEST_SUITE_P(Types, HalfActivationsTest, ::testing::Values(DTYPE_BF16, DTYPE_FP16),
                         [](const ::testing::TestParamInfo<DType>& info) { return std::string(dtype_name(info.param)); });

class AdamWTest : public GpuSuite<::testing::TestWithParam<PointwiseShape>> {};

TEST_P(AdamWTest, TwoStepsMatchHost) {
  const PointwiseShape s = GetParam();
  std::vector<float> param = uniform_vector(s.n, 121), m(s.n, 0.0f), v(s.n, 0.0f);
  auto d_param = on_device(device(), "param", param, s.misalign), d_m = on_device(device(), "m", m, s.misalign),
       d_v = on_device(device(), "v", v, s.misalign);
  for (int t = 1; t <= 2; t++) {
    const std::vector<float> grad = uniform_vector(s.n, 122 + t, -2.0, 2.0);
    auto d_grad = on_device(device(), "grad", grad, s.misalign);
    AdamWStep step{};
    step.lr = 1e-3f;
    step.beta1 = 0.9f;
    step.beta2 = 0.95f;
    step.eps = 1e-8f;
    step.weight_decay = 0.1f;
    step.bias_correction1 = 1.0f - std::pow(step.beta1, static_cast<float>(t));
    step.bias_correction2 = 1.0f - std::pow(step.beta2, static_cast<float>(t));
    const float multiplier = 0.5f, decay = t == 1 ? 1.0f : 0.0f;  // with and without weight decay
    for (size_t i = 0; i < s.n; i++) adamw_update(&param[i], &m[i], &v[i], grad[i] * multiplier, decay, step);
    // One segment; no clipping, and a gradient scale of 2 makes the multiplier 0.5.
    const AdamWSegment segment{d_param.data(), d_m.data(), d_v.data(), d_grad.data(), s.n, decay};
    DeviceArray<AdamWSegment> d_table(device(), 1);
    device().copy_to_device(d_table.data(), &segment, sizeof segment);
    DeviceBuffer<double> d_sums(device(), "sums", 2, 0);
    d_sums.upload({1.0, 1.0});
    shard_ops().adamw_multi(d_table.data(), 1, d_sums.data(), AdamWClip{0.0, 2.0}, step);
    d_grad.download("adamw (grad)");
  }
  expect_close(d_param.download("adamw").data(), widen(param), kAdamWTol, "adamw param");
  expect_close(d_m.download("adamw").data(), widen(m), kAdamWTol, "adamw m");
  expect_close(d_v.download("adamw").data(), widen(v), kAdamWTol, "adamw v");
}

// The fused step: one launch over a segment table, clipping and the loss scale from the step's sums
// in device memory, and no update at all when they are not finite -- against the host's own
// adamw_multi (the CPU backend) on the same segments, within kAdamWTol.
TEST_P(AdamWTest, FusedStepMatchesHostAndSkipsNonFiniteSteps) {
  const PointwiseShape s = GetParam();
  const std::vector<float> param0 = uniform_vector(s.n, 131), grad = uniform_vector(s.n, 132, -2.0, 2.0);
  std::vector<float> param = param0, m(s.n, 0.0f), v(s.n, 0.0f);
  auto d_param = on_device(device(), "param", param, s.misalign), d_m = on_device(device(), "m", m, s.misalign),
       d_v = on_device(device(), "v", v, s.misalign), d_grad = on_device(device(), "grad", grad, s.misalign);
  // Two segments, the first with weight decay, split where the table would split a parameter.
  const size_t half = s.n / 2;
  auto table = [&](float* p, float* mm, float* vv, const float* g) {
    return std::vector<AdamWSegment>{{p, mm, vv, g, half, 1.0f}, {p + half, mm + half, vv + half, g + half, s.n - half, 0.0f}};
  };
  const std::vector<AdamWSegment> host_table = table(param.data(), m.data(), v.data(), grad.data());
  const std::vector<AdamWSegment> device_table = table(d_param.data(), d_m.data(), d_v.data(), d_grad.data());
  DeviceArray<AdamWSegment> d_table(device(), device_table.size());
  device().copy_to_device(d_table.data(), device_table.data(), d_table.bytes());
  AdamWStep step{1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.1f, 0.05f};
  const AdamWClip clip{0.5, 4.0};  // a norm of 2 after unscaling: clipped to 0.5
  for (const double loss : {3.0, std::numeric_limits<double>::infinity()}) {
    const double sums[2] = {loss, 64.0};  // sqrt(64) / 4 = 2
    DeviceBuffer<double> d_sums(device(), "sums", 2, 0);
    d_sums.upload({sums[0], sums[1]});
    const uint64_t waits = device().host_syncs();
    cpu_shard_ops().adamw_multi(host_table.data(), host_table.size(), sums, clip, step);
    shard_ops().adamw_multi(d_table.data(), d_table.size(), d_sums.data(), clip, step);
    EXPECT_EQ(device().host_syncs(), waits) << "the fused step waited for the device";
  }
  EXPECT_NE(param, param0) << "the finite step updated nothing";
  expect_close(d_param.download("adamw_multi").data(), widen(param), kAdamWTol, "adamw_multi param");
  expect_close(d_m.download("adamw_multi").data(), widen(m), kAdamWTol, "adamw_multi m");
  expect_close(d_v.download("adamw_multi").data(), widen(v), kAdamWTol, "adamw_multi v");
}

INSTANTIATE_TEST_SUITE_P(Sizes, AdamWTest,
                         ::testing::Values(PointwiseShape{1, 0}, PointwiseShape{5, 0}, PointwiseShape{1000, 0},
                                           PointwiseShape{4099, 0}, PointwiseShape{5, 1}, PointwiseShape{4099, 1}),
                         ShapeName());

// ==================================================================================================
// Null parameter gradients (frozen parameters): a null dweight, dbias, dwte or dwpe is neither
// computed nor written, no kernel dereferences it, and every other output has the bits of the
// call with all gradients present (on the GPU: the same GPU call). Prefilled gradients, two calls.
// ==================================================================================================
class NullGradientsTest : public GpuSuite<::testing::Test> {};

// For every subset of the K nullable gradients (all present first): fresh device copies of their
// prefills, then call(ptrs) -- ptrs[k] gradient k's device pointer or null -- which runs the op
// twice and returns the outputs that are always present (norms: dinp), downloaded. Present
// gradients and the always-present outputs must have the all-present run's bits; absent
// gradients' buffers must keep their prefills.
template <typename Call>
void check_null_gradients(Device& device, const std::vector<std::vector<float>>& prefills,
                          const std::vector<std::string>& names, Call call, const std::string& op) {
  const size_t K = prefills.size();
  std::vector<std::vector<float>> full;
  std::vector<float> full_always;
  for (unsigned mask = (1u << K) - 1;; mask--) {
    std::vector<DeviceBuffer<float>> bufs;
    bufs.reserve(K);
    for (size_t k = 0; k < K; k++) bufs.push_back(on_device(device, names[k], prefills[k], 0));
    std::vector<float*> ptrs(K);
    for (size_t k = 0; k < K; k++) ptrs[k] = (mask >> k) & 1 ? bufs[k].data() : nullptr;
    const std::vector<float> always = call(ptrs);
    std::vector<std::vector<float>> got;
    for (size_t k = 0; k < K; k++) got.push_back(bufs[k].download(op + " " + names[k]));
    const std::string label = op + " with present-mask " + std::to_string(mask);
    if (full.empty()) {
      full = got;
      full_always = always;
    }
    for (size_t k = 0; k < K; k++) expect_same_bits(got[k], (mask >> k) & 1 ? full[k] : prefills[k], label + " " + names[k]);
    expect_same_bits(always, full_always, label + " (always-present outputs)");
    if (mask == 0) break;
  }
}

TEST_F(NullGradientsTest, LayerNormAndRmsNorm) {
  for (const LayerNormShape& s : {LayerNormShape{3, 13, 36, 0}, LayerNormShape{2, 7, 97, 1},
                                  LayerNormShape{4, 33, 768, 0}}) {
    const LayerNormData d(s);
    const RmsNormData r(s);
    const std::vector<float> dout = uniform_vector(d.out.size(), 161), dinp = uniform_vector(d.out.size(), 162);
    auto d_dout = on_device(device(), "dout", dout, s.misalign), d_inp = on_device(device(), "inp", d.inp, s.misalign);
    auto d_weight = on_device(device(), "weight", d.weight, s.misalign);
    auto d_mean = on_device(device(), "mean", d.mean, s.misalign), d_rstd = on_device(device(), "rstd", d.rstd, s.misalign);
    check_null_gradients(
        device(), {uniform_vector(d.C, 163), uniform_vector(d.C, 164)}, {"dweight", "dbias"},
        [&](const std::vector<float*>& g) {
          auto d_dinp = on_device(device(), "dinp", dinp, s.misalign);  // accumulated
          for (int call = 0; call < 2; call++)
            ops().layernorm_backward(d_dinp.data(), g[0], g[1], d_dout.data(), d_inp.data(), d_weight.data(),
                                     d_mean.data(), d_rstd.data(), d.N, d.C);
          return d_dinp.download("layernorm_backward dinp");
        },
        "layernorm_backward " + name_of(s));

    auto r_inp = on_device(device(), "inp", r.inp, s.misalign), r_weight = on_device(device(), "weight", r.weight, s.misalign);
    auto r_rstd = on_device(device(), "rstd", r.rstd, s.misalign);
    check_null_gradients(
        device(), {uniform_vector(r.C, 165)}, {"dweight"},
        [&](const std::vector<float*>& g) {
          auto r_dinp = on_device(device(), "dinp", dinp, s.misalign);
          for (int call = 0; call < 2; call++)
            ops().rmsnorm_backward(r_dinp.data(), g[0], d_dout.data(), r_inp.data(), r_weight.data(), r_rstd.data(),
                                   r.N, r.C);
          return r_dinp.download("rmsnorm_backward dinp");
        },
        "rmsnorm_backward " + name_of(s));
  }
}

TEST_F(NullGradientsTest, Matmul) {
  for (const MatmulShape& s : {MatmulShape{13, 36, 50, true, 0}, MatmulShape{7, 33, 65, true, 1},
                               MatmulShape{256, 768, 768, true, 0}}) {
    const std::vector<float> inp = uniform_vector(static_cast<size_t>(s.N) * s.C, 171),
                             weight = uniform_vector(static_cast<size_t>(s.OC) * s.C, 172),
                             dout = uniform_vector(static_cast<size_t>(s.N) * s.OC, 173);
    auto d_inp = on_device(device(), "inp", inp, s.misalign), d_weight = on_device(device(), "weight", weight, s.misalign);
    auto d_dout = on_device(device(), "dout", dout, s.misalign);
    // dinp is written, so its "prefill" is NaN: absent, it must stay NaN.
    const std::vector<std::vector<float>> prefills = {std::vector<float>(inp.size(), kNaN),
                                                      uniform_vector(weight.size(), 174), uniform_vector(s.OC, 175)};
    for (DType operands : {DTYPE_FP32, DTYPE_BF16}) {  // fp32, and the once-rounded 16-bit path
      auto layer_ops = make_cuda_layer_ops(device(), operands);
      check_null_gradients(
          device(), prefills, {"dinp", "dweight", "dbias"},
          [&](const std::vector<float*>& g) {
            for (int call = 0; call < 2; call++)
              layer_ops->matmul_backward(g[0], g[1], g[2], d_dout.data(), d_inp.data(), d_weight.data(), s.N, s.C,
                                         s.OC);
            return std::vector<float>();
          },
          std::string("matmul_backward ") + dtype_name(operands) + " " + name_of(s));
    }
  }
}

TEST_F(NullGradientsTest, Encoder) {
  for (const EncoderShape& s : {EncoderShape{2, 7, 24, 11, 0}, EncoderShape{3, 13, 36, 50, 1}}) {
    const size_t BT = static_cast<size_t>(s.B) * s.T, maxT = s.T + 3;
    auto d_tokens = on_device(device(), "tokens", index_vector(BT, 181, s.V), s.misalign);
    auto d_dout = on_device(device(), "dout", uniform_vector(BT * s.C, 182), s.misalign);
    check_null_gradients(
        device(), {uniform_vector(static_cast<size_t>(s.V) * s.C, 183), uniform_vector(maxT * s.C, 184)},
        {"dwte", "dwpe"},
        [&](const std::vector<float*>& g) {
          for (int call = 0; call < 2; call++)
            ops().encoder_backward(g[0], g[1], d_dout.data(), d_tokens.data(), s.B, s.T, s.C, nullptr);
          return std::vector<float>();
        },
        "encoder_backward " + name_of(s));
  }
}

// ==================================================================================================
// Dropout: the CUDA mask is the CPU's bit for bit (the same integer decision, common.cuh's mirror
// of core/random.hpp), and so is the scale (the same IEEE division). float4 path (C % 4 == 0,
// aligned) and scalar path (C odd, or misaligned); in place; repeats; p = 0 and p = 1.
// ==================================================================================================
struct DropoutShape {
  int N, C, misalign;
  float p;
};
std::string name_of(const DropoutShape& s) {
  return "N" + std::to_string(s.N) + "_C" + std::to_string(s.C) + "_p" +
         std::to_string(static_cast<int>(s.p * 1000)) + misaligned_suffix(s.misalign);
}
void PrintTo(const DropoutShape& s, std::ostream* os) { *os << name_of(s); }

class DropoutTest : public GpuSuite<::testing::TestWithParam<DropoutShape>> {};

std::vector<uint64_t> key_vector(size_t n, uint64_t seed) {
  shardtrain::testing::TestRng rng(seed);
  std::vector<uint64_t> keys(n);
  for (uint64_t& k : keys) k = rng.next();
  return keys;
}

TEST_P(DropoutTest, MatchesCpuBitwise) {
  const DropoutShape s = GetParam();
  const size_t n = static_cast<size_t>(s.N) * s.C;
  const std::vector<uint64_t> keys = key_vector(s.N, 191);
  const std::vector<float> inp = uniform_vector(n, 192);
  for (uint64_t site : {uint64_t{0}, uint64_t{12345}}) {
    std::vector<float> ref(n);
    cpu::dropout(ref.data(), inp.data(), keys.data(), site, s.N, s.C, s.p);
    auto d_keys = on_device(device(), "row_keys", keys, s.misalign);
    auto d_inp = on_device(device(), "inp", inp, s.misalign);
    DeviceBuffer<float> d_out(device(), "out", n, s.misalign);
    for (int run = 0; run < 2; run++) {  // the second run repeats the first bit for bit
      d_out.fill(kNaN);
      ops().dropout(d_out.data(), d_inp.data(), d_keys.data(), site, s.N, s.C, s.p);
      expect_same_bits(d_out.download("dropout"), ref, "dropout " + name_of(s) + " site " + std::to_string(site));
    }
    ops().dropout(d_inp.data(), d_inp.data(), d_keys.data(), site, s.N, s.C, s.p);  // in place
    expect_same_bits(d_inp.download("dropout in place"), ref, "dropout in place " + name_of(s));
    d_keys.download("dropout (row_keys)");
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, DropoutTest,
                         ::testing::Values(DropoutShape{1, 1, 0, 0.5f}, DropoutShape{5, 12, 0, 0.1f},
                                           DropoutShape{5, 12, 1, 0.1f}, DropoutShape{13, 37, 0, 0.5f},
                                           DropoutShape{7, 33, 1, 0.9f}, DropoutShape{3, 8, 0, 1.0f},
                                           DropoutShape{4, 9, 0, 0.0f}, DropoutShape{4, 12, 1, 0.0f},
                                           DropoutShape{1024, 768, 0, 0.1f},    // realistic: LoRA input, GPT-2
                                           DropoutShape{512, 2048, 0, 0.05f}),  // TinyLlama width
                         ShapeName());

// ==================================================================================================
// DoRA's per-output-feature ops (backend/cpu/ops.hpp): row_norms of a dense (rows, cols) matrix
// (the weight's norms); column_affine (the gains) and column_dot_accumulate (the magnitude's
// gradient) on columns [offset, offset + cols) of a (rows, ld) matrix -- a slice of a fused product
// -- whose other columns must keep their bits; column_dot's b has rows of cols + pad_b. The
// misaligned cases shift every device pointer 4 bytes off 16.
//
// Tolerances. row_norms and column_dot_accumulate sum widened floats in double on both sides, and
// the products are exact in double, so the two differ only by double reassociation (~1e-16
// relative) before one rounding to float: a quotient or norm at most one float ulp (2^-23 relative)
// apart, 4u relative allowed. column_dot adds that quotient q to out in fp32 (one more rounding of
// out + q); two calls: atol 8u max|q|, rtol 8u. column_affine is three roundings per call, the GPU
// always fusing the multiply-add (fmaf), the CPU as its compiler contracts it: fp32_pair(3) per call;
// the GPU is also checked bit for bit against a host loop of std::fma, the expression it evaluates.
// Every op runs twice from the same state and must repeat bit for bit.
// ==================================================================================================
constexpr Tolerance kDoubleSumOnce{0.0, 4.0 * kU32};

struct DoraShape {
  int rows, cols;
  int ld, offset;  // column_affine's y and column_dot's a: columns [offset, offset + cols) of (rows, ld)
  int pad_b;       // column_dot's b: ldb = cols + pad_b
  int misalign;
  int ldb() const { return cols + pad_b; }
};
std::string name_of(const DoraShape& s) {
  return "R" + std::to_string(s.rows) + "_C" + std::to_string(s.cols) + "_ld" + std::to_string(s.ld) + "_off" +
         std::to_string(s.offset) + "_padb" + std::to_string(s.pad_b) + misaligned_suffix(s.misalign);
}
void PrintTo(const DoraShape& s, std::ostream* os) { *os << name_of(s); }

class DoraTest : public GpuSuite<::testing::TestWithParam<DoraShape>> {};

// The elements of a (rows, ld) matrix inside the slice (in_slice) or outside it, in order.
std::vector<float> pick(const std::vector<float>& m, const DoraShape& s, bool in_slice) {
  std::vector<float> picked;
  for (size_t e = 0; e < m.size(); e++) {
    const int col = static_cast<int>(e % static_cast<size_t>(s.ld));
    if ((col >= s.offset && col < s.offset + s.cols) == in_slice) picked.push_back(m[e]);
  }
  return picked;
}

TEST_P(DoraTest, RowNormsMatchCpu) {
  const DoraShape s = GetParam();
  const std::vector<float> x = uniform_vector(static_cast<size_t>(s.rows) * s.cols, 201);
  std::vector<float> ref(s.rows);
  cpu::row_norms(ref.data(), x.data(), s.rows, s.cols);
  auto d_x = on_device(device(), "x", x, s.misalign);
  DeviceBuffer<float> d_out(device(), "out", ref.size(), s.misalign);
  std::vector<float> first;
  for (int run = 0; run < 2; run++) {
    d_out.fill(kNaN);
    ops().row_norms(d_out.data(), d_x.data(), s.rows, s.cols);
    const std::vector<float> got = d_out.download("row_norms");
    if (run == 0) {
      expect_close(got.data(), widen(ref), kDoubleSumOnce, "row_norms " + name_of(s));
      first = got;
    } else {
      expect_same_bits(got, first, "row_norms " + name_of(s) + " rerun");
    }
  }
  expect_same_bits(d_x.download("row_norms (x)"), x, "row_norms leaves x alone");
}

// scale_rows (DoRA with dropout's effective weight): a sum, then a product, per element on both
// sides -- the CPU's bits, with the offset of 0 (g (x) B) and of -1 ((g - 1) (x) W).
TEST_P(DoraTest, ScaleRowsIsTheCpusBits) {
  const DoraShape s = GetParam();
  const std::vector<float> y = uniform_vector(static_cast<size_t>(s.rows) * s.cols, 221, -2.0, 2.0),
                           scale = uniform_vector(s.rows, 222, 0.5, 1.5);
  auto d_scale = on_device(device(), "scale", scale, s.misalign);
  DeviceBuffer<float> d_y(device(), "y", y.size(), s.misalign);
  for (float offset : {0.0f, -1.0f}) {
    std::vector<float> ref = y;
    cpu::scale_rows(ref.data(), s.rows, s.cols, scale.data(), offset);
    d_y.upload(y);
    ops().scale_rows(d_y.data(), s.rows, s.cols, d_scale.data(), offset);
    expect_same_bits(d_y.download("scale_rows"), ref, "scale_rows " + name_of(s) + " offset " + std::to_string(offset));
  }
  expect_same_bits(d_scale.download("scale_rows (scale)"), scale, "scale_rows leaves scale alone");
}

TEST_P(DoraTest, ColumnAffineMatchesCpu) {
  const DoraShape s = GetParam();
  ASSERT_LE(s.offset + s.cols, s.ld);
  std::vector<float> prefill = uniform_vector(static_cast<size_t>(s.rows) * s.ld, 211, -2.0, 2.0);
  for (size_t e = 0; e < prefill.size(); e += 11) prefill[e] = -0.0f;  // null shift: +0 on both sides
  const std::vector<float> scale = uniform_vector(s.cols, 212, 0.5, 1.5), shift = uniform_vector(s.cols, 213);
  for (bool with_shift : {true, false}) {
    const std::string label = "column_affine " + name_of(s) + (with_shift ? "" : " (null shift)");
    std::vector<float> ref = prefill, fused = prefill;
    for (int call = 0; call < 2; call++) {
      cpu::column_affine(ref.data() + s.offset, s.ld, s.rows, s.cols, scale.data(),
                         with_shift ? shift.data() : nullptr);
      for (int r = 0; r < s.rows; r++)
        for (int c = 0; c < s.cols; c++) {
          float& v = fused[static_cast<size_t>(r) * s.ld + s.offset + c];
          const float b = with_shift ? shift[c] : 0.0f;
          v = std::fma(scale[c], v - b, b);
        }
    }
    const std::vector<float> ref_slice = pick(ref, s, true), fused_slice = pick(fused, s, true),
                             prefill_outside = pick(prefill, s, false);
    auto d_scale = on_device(device(), "scale", scale, s.misalign);
    auto d_shift = on_device(device(), "shift", shift, s.misalign);
    DeviceBuffer<float> d_y(device(), "y", prefill.size(), s.misalign);
    std::vector<float> first;
    for (int run = 0; run < 2; run++) {
      d_y.upload(prefill);
      for (int call = 0; call < 2; call++)
        ops().column_affine(d_y.data() + s.offset, s.ld, s.rows, s.cols, d_scale.data(),
                            with_shift ? d_shift.data() : nullptr);
      const std::vector<float> got = d_y.download("column_affine");
      if (run == 0) {
        const std::vector<float> slice = pick(got, s, true);
        expect_close(slice.data(), widen(ref_slice), fp32_pair(2 * 3), label);
        expect_same_bits(slice, fused_slice, label + " against std::fma on the host");
        expect_same_bits(pick(got, s, false), prefill_outside, label + ": columns outside the slice");
        first = got;
      } else {
        expect_same_bits(got, first, label + " rerun");
      }
    }
    d_scale.download(label + " (scale)");
    d_shift.download(label + " (shift)");
  }
}

TEST_P(DoraTest, ColumnDotAccumulateTwiceMatchesCpu) {
  const DoraShape s = GetParam();
  ASSERT_LE(s.offset + s.cols, s.ld);
  const std::vector<float> a = uniform_vector(static_cast<size_t>(s.rows) * s.ld, 221),
                           b = uniform_vector(static_cast<size_t>(s.rows) * s.ldb(), 222);
  std::vector<float> divisor = uniform_vector(s.cols, 223, 0.5, 2.0);
  for (size_t c = 2; c < divisor.size(); c += 3) divisor[c] = -divisor[c];
  const std::vector<float> prefill = uniform_vector(s.cols, 224);
  std::vector<float> ref = prefill;
  for (int call = 0; call < 2; call++)
    cpu::column_dot_accumulate(ref.data(), a.data() + s.offset, s.ld, b.data(), s.ldb(), s.rows, s.cols,
                               divisor.data());
  double q_max = 0;  // bounds every |q| and the double sums' error
  for (int c = 0; c < s.cols; c++) {
    double abs_sum = 0;
    for (int r = 0; r < s.rows; r++)
      abs_sum += std::fabs(static_cast<double>(a[static_cast<size_t>(r) * s.ld + s.offset + c]) *
                           b[static_cast<size_t>(r) * s.ldb() + c]);
    q_max = std::max(q_max, abs_sum / std::fabs(divisor[c]));
  }
  const Tolerance tol{8.0 * kU32 * q_max, 8.0 * kU32};

  auto d_a = on_device(device(), "a", a, s.misalign), d_b = on_device(device(), "b", b, s.misalign);
  auto d_divisor = on_device(device(), "divisor", divisor, s.misalign);
  DeviceBuffer<float> d_out(device(), "out", prefill.size(), s.misalign);
  const std::string label = "column_dot_accumulate " + name_of(s);
  std::vector<float> first;
  for (int run = 0; run < 2; run++) {
    d_out.upload(prefill);
    for (int call = 0; call < 2; call++)  // prefilled, accumulated twice
      ops().column_dot_accumulate(d_out.data(), d_a.data() + s.offset, s.ld, d_b.data(), s.ldb(), s.rows, s.cols,
                                  d_divisor.data());
    const std::vector<float> got = d_out.download("column_dot_accumulate");
    if (run == 0) {
      expect_close(got.data(), widen(ref), tol, label);
      if (s.rows == 0) expect_same_bits(got, ref, label + ": out + 0 / divisor");
      first = got;
    } else {
      expect_same_bits(got, first, label + " rerun");
    }
  }
  expect_same_bits(d_a.download(label + " (a)"), a, label + " leaves a alone");
  expect_same_bits(d_b.download(label + " (b)"), b, label + " leaves b alone");
  d_divisor.download(label + " (divisor)");
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, DoraTest,
    ::testing::Values(DoraShape{37, 19, 19, 0, 0, 0},        // odd, dense
                      DoraShape{37, 19, 24, 0, 3, 1},        // padded rows, misaligned
                      DoraShape{37, 41, 49, 5, 0, 1},        // a slice at column offset 5 of width 41
                      DoraShape{37, 41, 46, 5, 2, 0},        // ... the last columns
                      DoraShape{1, 1, 3, 1, 0, 0},           // one element
                      DoraShape{0, 19, 24, 5, 0, 0},         // no rows: no norms; out += 0 / divisor
                      DoraShape{37, 0, 8, 3, 0, 0},          // no columns: norms 0, nothing else
                      DoraShape{300, 257, 261, 3, 1, 1},     // several row chunks, 257 = 8 * 32 + 1
                      DoraShape{2304, 768, 768, 0, 0, 0},    // GPT-2: the fused qkv weight's 2304 row norms
                      DoraShape{1024, 768, 2304, 768, 0, 0}, // GPT-2, B=4 T=256: the k slice of qkv
                      DoraShape{1024, 2048, 2560, 0, 0, 0},  // TinyLlama: the q slice of q | k | v
                      DoraShape{1024, 256, 2560, 2048, 0, 1},  // ... its k slice, misaligned
                      DoraShape{2048, 5632, 5632, 0, 0, 0}),   // TinyLlama's down projection (2048 x 5632)
    ShapeName());

// ==================================================================================================
// LoKr's Kronecker product out (p*r, q*t) = s * kron(A (p, q), B (r, t)) and its gradients dA, dB
// (backend/cpu/ops.hpp). The forward is (s * A) * B, two IEEE multiplications on both sides:
// bit-identical. The backward sums widened floats in double on both sides (exact products); a sum
// of at most 64 terms is one thread's, in the CPU's order: bit-identical; longer ones (a warp's or
// a block's lanes and shuffle tree) differ from the CPU by double reassociation only, at most
// terms * 2^-53 of the terms' absolute sum, before each side's one rounding to float (<= 1 ulp,
// 2u relative, apart): atol |s| max(sum|terms|) terms 2^-51, rtol 4u. Gradients are written: NaN
// prefills must vanish; a null dA or dB leaves the other's bits; every op repeats bit for bit.
// ==================================================================================================
struct KronShape {
  int p, q, r, t;
  int misalign;
  size_t a_size() const { return static_cast<size_t>(p) * q; }
  size_t b_size() const { return static_cast<size_t>(r) * t; }
  size_t out_size() const { return a_size() * b_size(); }
};
std::string name_of(const KronShape& s) {
  return "p" + std::to_string(s.p) + "_q" + std::to_string(s.q) + "_r" + std::to_string(s.r) + "_t" +
         std::to_string(s.t) + misaligned_suffix(s.misalign);
}
void PrintTo(const KronShape& s, std::ostream* os) { *os << name_of(s); }

class KronTest : public GpuSuite<::testing::TestWithParam<KronShape>> {};

constexpr float kKronScale = -0.75f;

TEST_P(KronTest, ForwardMatchesCpuBitwise) {
  const KronShape s = GetParam();
  const std::vector<float> A = uniform_vector(s.a_size(), 301, -2.0, 2.0), B = uniform_vector(s.b_size(), 302);
  std::vector<float> ref(s.out_size());
  cpu::kron(ref.data(), A.data(), s.p, s.q, B.data(), s.r, s.t, kKronScale);
  auto d_A = on_device(device(), "A", A, s.misalign), d_B = on_device(device(), "B", B, s.misalign);
  DeviceBuffer<float> d_out(device(), "out", ref.size(), s.misalign);
  for (int run = 0; run < 2; run++) {
    d_out.fill(kNaN);
    ops().kron(d_out.data(), d_A.data(), s.p, s.q, d_B.data(), s.r, s.t, kKronScale);
    expect_same_bits(d_out.download("kron"), ref, "kron " + name_of(s));
  }
  expect_same_bits(d_A.download("kron (A)"), A, "kron leaves A alone");
  expect_same_bits(d_B.download("kron (B)"), B, "kron leaves B alone");
}

TEST_P(KronTest, BackwardMatchesCpu) {
  const KronShape s = GetParam();
  const std::vector<float> A = uniform_vector(s.a_size(), 311, -2.0, 2.0), B = uniform_vector(s.b_size(), 312),
                           dout = uniform_vector(s.out_size(), 313);
  std::vector<float> ref_a(s.a_size()), ref_b(s.b_size());
  cpu::kron_backward(ref_a.data(), ref_b.data(), dout.data(), A.data(), s.p, s.q, B.data(), s.r, s.t, kKronScale);
  // The terms' absolute sums, for the tolerance: sum|dout| |B| per dA element, sum|dout| |A| per dB.
  double abs_a = 0, abs_b = 0;
  {
    std::vector<double> sum_a(s.a_size()), sum_b(s.b_size());
    const size_t cols = static_cast<size_t>(s.q) * s.t;
    for (int i = 0; i < s.p; i++)
      for (int k = 0; k < s.r; k++)
        for (int j = 0; j < s.q; j++)
          for (int l = 0; l < s.t; l++) {
            const double d = std::fabs(static_cast<double>(dout[(static_cast<size_t>(i) * s.r + k) * cols +
                                                                static_cast<size_t>(j) * s.t + l]));
            sum_a[static_cast<size_t>(i) * s.q + j] += d * std::fabs(B[static_cast<size_t>(k) * s.t + l]);
            sum_b[static_cast<size_t>(k) * s.t + l] += d * std::fabs(A[static_cast<size_t>(i) * s.q + j]);
          }
    for (double v : sum_a) abs_a = std::max(abs_a, v);
    for (double v : sum_b) abs_b = std::max(abs_b, v);
  }
  const double scale = std::fabs(static_cast<double>(kKronScale));
  const Tolerance tol_a{scale * abs_a * static_cast<double>(s.b_size()) * 0x1p-51, 4.0 * kU32},
      tol_b{scale * abs_b * static_cast<double>(s.a_size()) * 0x1p-51, 4.0 * kU32};
  const bool serial_a = s.b_size() <= 64, serial_b = s.a_size() <= 64;  // one thread per element

  auto d_A = on_device(device(), "A", A, s.misalign), d_B = on_device(device(), "B", B, s.misalign);
  auto d_dout = on_device(device(), "dout", dout, s.misalign);
  DeviceBuffer<float> d_dA(device(), "dA", ref_a.size(), s.misalign), d_dB(device(), "dB", ref_b.size(), s.misalign);
  const std::string label = "kron_backward " + name_of(s);
  std::vector<float> first_a, first_b;
  for (int run = 0; run < 2; run++) {
    d_dA.fill(kNaN);
    d_dB.fill(kNaN);
    ops().kron_backward(d_dA.data(), d_dB.data(), d_dout.data(), d_A.data(), s.p, s.q, d_B.data(), s.r, s.t,
                        kKronScale);
    const std::vector<float> got_a = d_dA.download("kron_backward (dA)"), got_b = d_dB.download("kron_backward (dB)");
    if (run == 0) {
      expect_close(got_a.data(), widen(ref_a), tol_a, label + " dA");
      expect_close(got_b.data(), widen(ref_b), tol_b, label + " dB");
      if (serial_a) expect_same_bits(got_a, ref_a, label + " dA, one thread per element");
      if (serial_b) expect_same_bits(got_b, ref_b, label + " dB, one thread per element");
      first_a = got_a;
      first_b = got_b;
    } else {
      expect_same_bits(got_a, first_a, label + " dA rerun");
      expect_same_bits(got_b, first_b, label + " dB rerun");
    }
  }
  // One gradient null: not written, the other the same bits.
  d_dA.fill(kNaN);
  d_dB.fill(kNaN);
  ops().kron_backward(d_dA.data(), nullptr, d_dout.data(), d_A.data(), s.p, s.q, d_B.data(), s.r, s.t, kKronScale);
  expect_same_bits(d_dA.download("kron_backward (dA, dB null)"), first_a, label + " dA with dB null");
  const std::vector<float> untouched_b = d_dB.download("kron_backward (dB untouched)");
  for (size_t e = 0; e < untouched_b.size(); e++)
    ASSERT_TRUE(std::isnan(untouched_b[e])) << label << ": dB element " << e << " written through a null dB";
  ops().kron_backward(nullptr, d_dB.data(), d_dout.data(), d_A.data(), s.p, s.q, d_B.data(), s.r, s.t, kKronScale);
  expect_same_bits(d_dB.download("kron_backward (dB, dA null)"), first_b, label + " dB with dA null");
  expect_same_bits(d_A.download(label + " (A)"), A, label + " leaves A alone");
  expect_same_bits(d_B.download(label + " (B)"), B, label + " leaves B alone");
  expect_same_bits(d_dout.download(label + " (dout)"), dout, label + " leaves dout alone");
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, KronTest,
    ::testing::Values(KronShape{3, 5, 2, 7, 0},      // odd; both sums serial (14 and 15 terms)
                      KronShape{3, 5, 2, 7, 1},      // ... misaligned
                      KronShape{1, 9, 1, 4, 0},      // 1 x N factors
                      KronShape{4, 1, 3, 1, 0},      // N x 1 factors
                      KronShape{1, 1, 1, 1, 0},      // one element
                      KronShape{2, 3, 0, 4, 0},      // empty B: dA = s * 0
                      KronShape{0, 3, 2, 2, 0},      // empty A: dB = s * 0
                      KronShape{5, 13, 9, 11, 1},    // dA's 99 terms and dB's 65: warp sums
                      KronShape{3, 7, 97, 91, 0},    // dA's 8827 terms: block sums; dB's 21: serial
                      KronShape{8, 8, 96, 96, 0},    // LoKr factor 8 of 768 x 768 (GPT-2): 9216 / 64 terms
                      KronShape{64, 64, 64, 64, 0},  // 4096 x 4096 split evenly: 4096 terms both ways
                      KronShape{8, 8, 512, 512, 1},  // factor 8 of 4096 x 4096, misaligned: 262144 / 64
                      KronShape{32, 64, 64, 88, 0}),  // TinyLlama's up projection: 2048 x 5632 = 32*64 x 64*88
    ShapeName());

// The quantized base's gather-side kernel (ShardOps::dequantize_blocks): bit for bit the CPU's,
// which tests/unit/test_quant.cpp holds to bitsandbytes' own dequantization, for every format, in
// fp32 and with the bf16 / fp16 copy the GEMMs read, misaligned outputs included, and double-quantized
// records decoded through a nested table in device memory.
class DequantizeTest : public GpuSuite<::testing::Test> {};
TEST_F(DequantizeTest, MatchesCpuBitwise) {
  for (QuantType type : {QUANT_NF4, QUANT_FP4, QUANT_FP8, QUANT_BF16})
    for (bool nested : {false, true})
      for (size_t block : {size_t{32}, size_t{64}, size_t{4096}})
        for (DType half : {DTYPE_FP32, DTYPE_BF16, DTYPE_FP16}) {
          if (nested && !quant_nestable(type)) continue;
          const size_t blocks = block == 4096 ? 3 : 37, plain = quant_record_bytes(type, block), n = blocks * block;
          const size_t record = quant_record_bytes(type, block, nested);
          std::vector<float> x(n);
          fill_uniform(x.data(), n, 91, -3.0, 3.0);
          std::vector<uint8_t> block_record(plain), records(blocks * record);
          for (size_t b = 0; b < blocks; b++) {
            quantize_block(type, x.data() + b * block, b == 1 ? block / 3 : block, block, block_record.data());
            std::copy(block_record.begin(), block_record.begin() + record, records.begin() + b * record);
            if (nested) records[b * record + block / 2] = static_cast<uint8_t>(b * 37 % 256);  // its absmax code
          }
          // Double quantization: one weight of blocks - 3 records, offset 0.25, group scale 1.5, the
          // records handed over starting at its third (a shard's start), the last five past the
          // weight (padding, decoded as zeros).
          const std::vector<uint8_t> table = lone_weight_nested_table({0.25f, 1.5f}, blocks - 3);
          DeviceBuffer<uint8_t> d_table = on_device(device(), "table", table, 0);
          const NestedScales cpu_nested = nested ? nested_scales(table.data(), 1, 2) : NestedScales{};
          const NestedScales gpu_nested = nested ? nested_scales(d_table.data(), 1, 2) : NestedScales{};
          std::vector<float> want(n);
          std::vector<uint16_t> want_half(n);
          const bool with_half = half != DTYPE_FP32;
          cpu_shard_ops().dequantize_blocks(want.data(), with_half ? want_half.data() : nullptr, half, records.data(),
                                            blocks, type, block, cpu_nested);
          DeviceBuffer<uint8_t> d_records = on_device(device(), "records", records, 0);
          DeviceBuffer<float> d_out(device(), "out", n, 1);
          DeviceBuffer<uint16_t> d_half(device(), "half", n, 0);
          d_out.fill(kNaN);
          shard_ops().dequantize_blocks(d_out.data(), with_half ? d_half.data() : nullptr, half, d_records.data(),
                                        blocks, type, block, gpu_nested);
          const std::string label = std::string(quant_type_name(type)) + (nested ? " nested" : "") + " block " +
                                    std::to_string(block) + " " + dtype_name(half);
          const std::vector<float> got = d_out.download(label);
          const std::vector<uint16_t> got_half = d_half.download(label);
          for (size_t i = 0; i < n; i++) {
            ASSERT_EQ(float_bits(got[i]), float_bits(want[i])) << label << " element " << i;
            if (with_half) {
              ASSERT_EQ(got_half[i], want_half[i]) << label << " element " << i;
            }
          }
          if (with_half) {  // into the 16-bit copy alone: the same copy
            DeviceBuffer<uint16_t> d_half_only(device(), "half only", n, 0);
            shard_ops().dequantize_blocks(nullptr, d_half_only.data(), half, d_records.data(), blocks, type, block,
                                          gpu_nested);
            EXPECT_EQ(d_half_only.download(label), want_half) << label << " into the copy alone";
          }
        }
}

// ==================================================================================================
// A diffusion transformer's layers (model/families/flux) against the CPU backend: the joint
// attention without the causal mask, the interleaved rotary turn, adaptive LayerNorm with
// per-sample shift and scale rows `ld` apart, the gated residual, SiLU, the squared error and the
// strided row copy. Tolerances as the layers they mirror: the norms' row sums, attention's.
// ==================================================================================================
TEST_P(AttentionTest, BidirectionalMatchesCpu) {
  AttentionShape s = GetParam();
  s.KV = s.NH;  // the joint attention is multi-head
  const std::vector<float> qkv = uniform_vector(s.qkv_size(), 91), dout = uniform_vector(s.out_size(), 92);
  std::vector<float> out(s.out_size()), lse(s.lse_size()), dqkv(s.qkv_size());
  cpu::attention_forward(out.data(), lse.data(), qkv.data(), s.B, s.T, s.NH, s.NH, s.HS, cpu::AttentionTiles(), false);
  cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), s.B, s.T, s.NH, s.NH, s.HS,
                          cpu::AttentionTiles(), false);
  auto d_qkv = on_device(device(), "qkv", qkv, s.misalign), d_dout = on_device(device(), "dout", dout, s.misalign);
  DeviceBuffer<float> d_out(device(), "out", out.size(), s.misalign), d_lse(device(), "lse", lse.size(), s.misalign);
  DeviceBuffer<float> d_dqkv(device(), "dqkv", dqkv.size(), s.misalign);
  d_out.fill(kNaN);
  d_lse.fill(kNaN);
  d_dqkv.fill(kNaN);
  ops().bidirectional_attention_forward(d_out.data(), d_lse.data(), d_qkv.data(), s.B, s.T, s.NH, s.HS);
  ops().bidirectional_attention_backward(d_dqkv.data(), d_dout.data(), d_qkv.data(), d_out.data(), d_lse.data(), s.B,
                                         s.T, s.NH, s.HS);
  expect_close(d_lse.download("bidirectional forward").data(), widen(lse), attention_lse_tol(s), "bidirectional lse");
  expect_close(d_out.download("bidirectional forward").data(), widen(out), attention_out_tol(s), "bidirectional out");
  expect_close(d_dqkv.download("bidirectional backward").data(), widen(dqkv), attention_backward_tol(s),
               "bidirectional dqkv");
  // The last query row sees every key, the first only itself under the mask: without it the two
  // kernels differ from the causal ones (a kernel that kept the mask would pass only at T = 1).
  if (s.T > 1) {
    std::vector<float> causal_out(s.out_size()), causal_lse(s.lse_size());
    cpu::attention_forward(causal_out.data(), causal_lse.data(), qkv.data(), s.B, s.T, s.NH, s.NH, s.HS);
    EXPECT_FALSE(same_bits(causal_out, out)) << "the unmasked oracle equals the causal one";
  }
}

TEST_P(RopeTest, InterleavedPairsMatchCpu) {
  const RopeShape s = GetParam();
  const RopeTables tables(s.T, s.HS);
  const std::vector<float> input = uniform_vector(s.qkv_size(), 145);
  auto d_cos = on_device(device(), "cos", tables.cos, s.misalign);
  auto d_sin = on_device(device(), "sin", tables.sin, s.misalign);
  for (bool backward : {false, true}) {
    std::vector<float> ref = input;
    auto d_x = on_device(device(), "qkv", input, s.misalign);
    if (backward) {
      cpu::rope_pairs_backward(ref.data(), tables.cos.data(), tables.sin.data(), s.B, s.T, s.NH, s.KV, s.HS);
      ops().rope_pairs_backward(d_x.data(), d_cos.data(), d_sin.data(), s.B, s.T, s.NH, s.KV, s.HS);
    } else {
      cpu::rope_pairs_forward(ref.data(), tables.cos.data(), tables.sin.data(), s.B, s.T, s.NH, s.KV, s.HS);
      ops().rope_pairs_forward(d_x.data(), d_cos.data(), d_sin.data(), s.B, s.T, s.NH, s.KV, s.HS);
    }
    expect_close(d_x.download("rope pairs").data(), widen(ref), fp32_pair(2),
                 backward ? "rope_pairs_backward" : "rope_pairs_forward");
  }
}

// B samples of T rows of C; shift, scale and gate are chunks of a per-sample modulation row of ld.
struct DitShape {
  int B, T, C, ld, misalign;
  size_t rows() const { return static_cast<size_t>(B) * T; }
  size_t size() const { return rows() * C; }
  size_t mod_size() const { return static_cast<size_t>(B) * ld; }
};
std::string name_of(const DitShape& s) {
  return "B" + std::to_string(s.B) + "_T" + std::to_string(s.T) + "_C" + std::to_string(s.C) + "_ld" +
         std::to_string(s.ld) + misaligned_suffix(s.misalign);
}
void PrintTo(const DitShape& s, std::ostream* os) { *os << name_of(s); }

class DitLayersTest : public GpuSuite<::testing::TestWithParam<DitShape>> {};

// Modulation rows: shift at column 0, scale at C (ld >= 2C): the model's chunks of one product.
TEST_P(DitLayersTest, ModulateMatchesCpu) {
  const DitShape s = GetParam();
  const std::vector<float> inp = uniform_vector(s.size(), 51, -2.0, 3.0), mod = uniform_vector(s.mod_size(), 52),
                           dout = uniform_vector(s.size(), 53);
  std::vector<float> out(s.size()), mean(s.rows()), rstd(s.rows());
  cpu::modulate_forward(out.data(), mean.data(), rstd.data(), inp.data(), mod.data(), mod.data() + s.C, s.ld, s.B, s.T,
                        s.C, 1e-6f);
  auto d_inp = on_device(device(), "inp", inp, s.misalign), d_mod = on_device(device(), "mod", mod, s.misalign);
  DeviceBuffer<float> d_out(device(), "out", out.size(), s.misalign), d_mean(device(), "mean", s.rows(), s.misalign),
      d_rstd(device(), "rstd", s.rows(), s.misalign);
  d_out.fill(kNaN);
  ops().modulate_forward(d_out.data(), d_mean.data(), d_rstd.data(), d_inp.data(), d_mod.data(), d_mod.data() + s.C,
                         s.ld, s.B, s.T, s.C, 1e-6f);
  const Tolerance tol = fp32_pair(2 * s.C + 6);
  expect_close(d_out.download("modulate_forward").data(), widen(out), tol, "modulate out");
  expect_close(d_mean.download("modulate_forward").data(), widen(mean), tol, "modulate mean");
  expect_close(d_rstd.download("modulate_forward").data(), widen(rstd), tol, "modulate rstd");

  // The backward twice from the CPU's statistics: dinp, dshift, dscale all accumulate (+=).
  std::vector<float> dinp = uniform_vector(s.size(), 54), dmod = uniform_vector(s.mod_size(), 55);
  auto d_dout = on_device(device(), "dout", dout, s.misalign), d_dinp = on_device(device(), "dinp", dinp, s.misalign);
  auto d_dmod = on_device(device(), "dmod", dmod, s.misalign);
  auto d_cpu_mean = on_device(device(), "mean", mean, s.misalign), d_cpu_rstd = on_device(device(), "rstd", rstd, s.misalign);
  for (int call = 0; call < 2; call++) {
    cpu::modulate_backward(dinp.data(), dmod.data(), dmod.data() + s.C, dout.data(), inp.data(), mod.data() + s.C,
                           mean.data(), rstd.data(), s.ld, s.B, s.T, s.C);
    ops().modulate_backward(d_dinp.data(), d_dmod.data(), d_dmod.data() + s.C, d_dout.data(), d_inp.data(),
                            d_mod.data() + s.C, d_cpu_mean.data(), d_cpu_rstd.data(), s.ld, s.B, s.T, s.C);
  }
  expect_close(d_dinp.download("modulate_backward").data(), widen(dinp), fp32_pair(4 * s.C + 8), "modulate dinp");
  expect_close(d_dmod.download("modulate_backward").data(), widen(dmod), fp32_pair(2 * s.T + 4),
               "modulate dshift, dscale");
}

TEST_P(DitLayersTest, GateMatchesCpu) {
  const DitShape s = GetParam();
  const std::vector<float> resid = uniform_vector(s.size(), 61), y = uniform_vector(s.size(), 62),
                           mod = uniform_vector(s.mod_size(), 63), dout = uniform_vector(s.size(), 64);
  const float* gate = mod.data() + (s.ld - s.C);  // the last chunk of the row
  std::vector<float> out(s.size());
  cpu::gate_forward(out.data(), resid.data(), y.data(), gate, s.ld, s.B, s.T, s.C);
  auto d_resid = on_device(device(), "resid", resid, s.misalign), d_y = on_device(device(), "y", y, s.misalign);
  auto d_mod = on_device(device(), "mod", mod, s.misalign);
  const float* d_gate = d_mod.data() + (s.ld - s.C);
  ops().gate_forward(d_resid.data(), d_resid.data(), d_y.data(), d_gate, s.ld, s.B, s.T, s.C);  // in place
  expect_same_bits(d_resid.download("gate_forward"), out, "gate out (one product and one sum per element)");

  std::vector<float> dy(s.size()), dmod = uniform_vector(s.mod_size(), 65);
  auto d_dout = on_device(device(), "dout", dout, s.misalign), d_dmod = on_device(device(), "dmod", dmod, s.misalign);
  DeviceBuffer<float> d_dy(device(), "dy", s.size(), s.misalign);
  d_dy.fill(kNaN);
  for (int call = 0; call < 2; call++) {
    cpu::gate_backward(dy.data(), dmod.data() + (s.ld - s.C), dout.data(), y.data(), gate, s.ld, s.B, s.T, s.C);
    ops().gate_backward(d_dy.data(), d_dmod.data() + (s.ld - s.C), d_dout.data(), d_y.data(), d_gate, s.ld, s.B, s.T,
                        s.C);
  }
  expect_same_bits(d_dy.download("gate_backward"), dy, "gate dy");
  expect_close(d_dmod.download("gate_backward").data(), widen(dmod), fp32_pair(2 * s.T + 4), "gate dgate");
}

TEST_P(DitLayersTest, SiluSquaredErrorAndRowCopyMatchCpu) {
  const DitShape s = GetParam();
  const std::vector<float> x = uniform_vector(s.size(), 71, -6.0, 6.0), dout = uniform_vector(s.size(), 72),
                           target = uniform_vector(s.size(), 73);
  std::vector<float> out(s.size()), dx(s.size());
  cpu::silu_forward(out.data(), x.data(), out.size());
  cpu::silu_backward(dx.data(), dout.data(), x.data(), dx.size());
  auto d_x = on_device(device(), "x", x, s.misalign), d_dout = on_device(device(), "dout", dout, s.misalign);
  DeviceBuffer<float> d_out(device(), "out", s.size(), s.misalign), d_dx(device(), "dx", s.size(), s.misalign);
  ops().silu_forward(d_out.data(), d_x.data(), s.size());
  ops().silu_backward(d_dx.data(), d_dout.data(), d_x.data(), s.size());
  expect_close(d_out.download("silu_forward").data(), widen(out), kGeluTol, "silu");
  expect_close(d_dx.download("silu_backward").data(), widen(dx), kGeluTol, "silu backward");

  // Squared error of B*T rows of C; the prediction becomes its gradient 2 (out - target), exact.
  std::vector<float> pred = x, losses(s.rows());
  cpu::squared_error_forward(losses.data(), pred.data(), target.data(), static_cast<int>(s.rows()), s.C);
  auto d_pred = on_device(device(), "pred", x, s.misalign), d_target = on_device(device(), "target", target, s.misalign);
  DeviceBuffer<float> d_losses(device(), "losses", s.rows(), s.misalign);
  ops().squared_error_forward(d_losses.data(), d_pred.data(), d_target.data(), static_cast<int>(s.rows()), s.C);
  expect_close(d_losses.download("squared_error").data(), widen(losses), fp32_pair(s.C + 2), "squared error");
  expect_same_bits(d_pred.download("squared_error"), pred, "squared error gradient");

  // The rows of x (C wide) into rows ld apart at column ld - C, and back: the joins and splits of
  // the text and image streams. The columns not copied keep their values.
  std::vector<float> wide = uniform_vector(s.rows() * s.ld, 74);
  for (size_t r = 0; r < s.rows(); r++)
    std::copy(x.begin() + r * s.C, x.begin() + (r + 1) * s.C, wide.begin() + r * s.ld + (s.ld - s.C));
  auto d_wide = on_device(device(), "wide", uniform_vector(s.rows() * s.ld, 74), s.misalign);
  ops().copy_rows(d_wide.data() + (s.ld - s.C), s.ld, d_x.data(), s.C, static_cast<int>(s.rows()), s.C);
  expect_same_bits(d_wide.download("copy_rows"), wide, "copy_rows into wide rows");
  DeviceBuffer<float> d_back(device(), "back", s.size(), s.misalign);
  ops().copy_rows(d_back.data(), s.C, d_wide.data() + (s.ld - s.C), s.ld, static_cast<int>(s.rows()), s.C);
  expect_same_bits(d_back.download("copy_rows"), x, "copy_rows out of wide rows");
}

INSTANTIATE_TEST_SUITE_P(Shapes, DitLayersTest,
                         ::testing::Values(DitShape{1, 1, 1, 2, 0}, DitShape{2, 7, 5, 15, 0},
                                           DitShape{3, 33, 40, 120, 1}, DitShape{2, 300, 96, 576, 0},
                                           DitShape{1, 1030, 256, 768, 1}),  // more rows than one column-sum chunk
                         ShapeName());

// The interface's own promises: device() is the device the ops were made for, and their work is
// queued on its compute stream, in order with its copies: a copy to the host right after an op
// sees the op's result with no synchronisation in between. 64 MiB makes a kernel on another
// stream (or not yet finished) show as stale data.
class CudaOpsTest : public GpuSuite<::testing::Test> {};
TEST_F(CudaOpsTest, OpsRunInOrderOnTheDevicesComputeStream) {
  EXPECT_EQ(&ops().device(), static_cast<Device*>(&device()));
  const size_t n = size_t{16} << 20;
  std::vector<float> values(n);
  for (size_t i = 0; i < n; i++) values[i] = static_cast<float>(i % 1000 + 1);
  DeviceArray<float> x(device(), n), y(device(), n);
  device().copy_to_device(x.data(), values.data(), x.bytes());
  ops().scale(x.data(), n, 2.0f);                          // x = 2 v
  ops().residual_forward(y.data(), x.data(), x.data(), n);  // y = 4 v, exact for these integers
  std::vector<float> back(n, -1.0f);
  device().copy_to_host(back.data(), y.data(), y.bytes());
  size_t wrong = 0;
  for (size_t i = 0; i < n; i++) wrong += back[i] != 4.0f * values[i];
  EXPECT_EQ(wrong, 0u) << "elements of 2 v + 2 v not equal to 4 v";
}

}  // namespace
