// The CPU backend behind the LayerOps/ShardOps interfaces: host memory, and the templates of
// backend/cpu/ops.hpp for the layers.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <type_traits>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

#include "backend/cpu/bf16_gemm.hpp"
#include "backend/cpu/gemm.hpp"
#include "backend/cpu/ops.hpp"
#include "backend/half_copies.hpp"
#include "backend/layer_ops.hpp"

namespace shardtrain {
namespace {

// fp32 <-> 16-bit over an array, one loop per format: with the format chosen per element the
// compiler keeps the loop scalar (3-4x slower on AVX2/AVX-512, which a bf16 step pays for every
// gathered unit).
template <typename Real>
void convert_to_half(uint16_t* out, const Real* in, size_t n, DType type, Real* rounded_back = nullptr) {
  auto convert = [&](auto to_half, auto to_float) {
    if (rounded_back) {
#pragma omp parallel for simd schedule(static)
      for (size_t i = 0; i < n; i++) out[i] = to_half(static_cast<float>(in[i])), rounded_back[i] = to_float(out[i]);
    } else {
#pragma omp parallel for simd schedule(static)
      for (size_t i = 0; i < n; i++) out[i] = to_half(static_cast<float>(in[i]));
    }
  };
  if (type == DTYPE_BF16)
    convert([](float f) { return float_to_bf16(f); }, [](uint16_t h) { return bf16_to_float(h); });
  else
    convert([](float f) { return float_to_fp16(f); }, [](uint16_t h) { return fp16_to_float(h); });
}
// values[i] = widen(round(values[i])): convert_to_half's rounding without its copy.
template <typename Real>
void round_in_place(Real* values, size_t n, DType type) {
  if (type == DTYPE_BF16) {
#pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; i++) values[i] = bf16_to_float(float_to_bf16(static_cast<float>(values[i])));
  } else {
#pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; i++) values[i] = fp16_to_float(float_to_fp16(static_cast<float>(values[i])));
  }
}
template <typename Real>
void convert_from_half(Real* out, const uint16_t* in, size_t n, DType type) {
  if (type == DTYPE_BF16) {
#pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; i++) out[i] = bf16_to_float(in[i]);
  } else {
#pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; i++) out[i] = fp16_to_float(in[i]);
  }
}

class HostDevice : public Device {
 public:
  DeviceKind kind() const override { return DEVICE_CPU; }
  const char* name() const override { return "cpu"; }
  void* allocate(size_t bytes) override {
    if (bytes == 0) return nullptr;
    void* p = std::calloc(1, bytes);
    if (!p) throw std::bad_alloc();
    return p;
  }
  void release(void* p, size_t) override { std::free(p); }
  void zero(void* p, size_t bytes) override {
    if (bytes) std::memset(p, 0, bytes);
  }
  // One anonymous mapping, inaccessible beyond the backed pages: a stray read there is a SIGSEGV
  // (the crash report names it), not a silent value. Untouched anonymous pages read as zero.
  void* allocate_backed_prefix(size_t backed, size_t bytes) override {
    void* p = mmap(nullptr, page_round(bytes), PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    if (backed && mprotect(p, page_round(backed), PROT_READ | PROT_WRITE) != 0) {
      munmap(p, page_round(bytes));
      throw std::bad_alloc();
    }
    return p;
  }
  void release_backed_prefix(void* p, size_t bytes) override { munmap(p, page_round(bytes)); }

 protected:
  void transfer(void* dst, const void* src, size_t bytes, CopyKind) override {
    if (bytes) std::memmove(dst, src, bytes);
  }
  void wait_for_work() override {}

 private:
  static size_t page_round(size_t bytes) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    return (bytes + page - 1) / page * page;
  }
};

template <typename Real>
class CpuLayerOps : public LayerOps<Real> {
 public:
  // bf16: the linear layers' products through it (float only; fsdp.param_dtype=bf16).
  explicit CpuLayerOps(cpu::Bf16Gemm* bf16 = nullptr) : bf16_(bf16) {}
  Device& device() const override { return host_device(); }
  void encoder_forward(Real* out, const int* tokens, const Real* wte, const Real* wpe, int B, int T, int C,
                       const int* positions) const override {
    cpu::encoder_forward(out, tokens, wte, wpe, B, T, C, positions);
  }
  void encoder_backward(Real* dwte, Real* dwpe, const Real* dout, const int* tokens, int B, int T, int C,
                        const int* positions) const override {
    cpu::encoder_backward(dwte, dwpe, dout, tokens, B, T, C, positions);
  }
  void layernorm_forward(Real* out, Real* mean, Real* rstd, const Real* inp, const Real* weight, const Real* bias,
                         int N, int C) const override {
    cpu::layernorm_forward(out, mean, rstd, inp, weight, bias, N, C);
  }
  void layernorm_backward(Real* dinp, Real* dweight, Real* dbias, const Real* dout, const Real* inp,
                          const Real* weight, const Real* mean, const Real* rstd, int N, int C) const override {
    cpu::layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
  }
  void matmul_forward(Real* out, const Real* inp, const Real* weight, const Real* bias, int N, int C,
                      int OC) const override {
    if constexpr (std::is_same_v<Real, float>)
      if (bf16_)
        return bf16_->forward(out, inp, half_copies_.find(inp, size_t(N) * C, DTYPE_BF16), weight,
                              half_copies_.find(weight, size_t(OC) * C, DTYPE_BF16), bias, N, C, OC);
    cpu::matmul_forward(out, inp, weight, bias, N, C, OC);
  }
  void matmul_backward(Real* dinp, Real* dweight, Real* dbias, const Real* dout, const Real* inp, const Real* weight,
                       int N, int C, int OC) const override {
    if constexpr (std::is_same_v<Real, float>)
      if (bf16_)
        return bf16_->backward(dinp, dweight, dbias, dout, inp, half_copies_.find(inp, size_t(N) * C, DTYPE_BF16),
                               weight, half_copies_.find(weight, size_t(OC) * C, DTYPE_BF16), N, C, OC);
    cpu::matmul_backward(dinp, dweight, dbias, dout, inp, weight, N, C, OC);
  }
  void gemm(bool trans_a, bool trans_b, int M, int N, int K, Real alpha, const Real* A, int lda, const Real* B,
            int ldb, Real beta, Real* C, int ldc) const override {
    cpu::gemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  }
  void attention_forward(Real* out, Real* lse, const Real* qkv, int B, int T, int NH, int KV, int HS,
                         const int* doc_start) const override {
    cpu::attention_forward(out, lse, qkv, B, T, NH, KV, HS, cpu::AttentionTiles(), true, doc_start);
  }
  void attention_backward(Real* dqkv, const Real* dout, const Real* qkv, const Real* out, const Real* lse, int B,
                          int T, int NH, int KV, int HS, const int* doc_start) const override {
    cpu::attention_backward(dqkv, dout, qkv, out, lse, B, T, NH, KV, HS, cpu::AttentionTiles(), true, doc_start);
  }
  void attention_decode(Real* out, Real* scratch, Real* k_cache, Real* v_cache, const Real* qkv, int Q, int start,
                        int NH, int KV, int HS, int window) const override {
    cpu::attention_decode(out, scratch, k_cache, v_cache, qkv, Q, start, NH, KV, HS, window);
  }
  void bidirectional_attention_forward(Real* out, Real* lse, const Real* qkv, int B, int T, int NH,
                                       int HS) const override {
    cpu::attention_forward(out, lse, qkv, B, T, NH, NH, HS, cpu::AttentionTiles(), false);
  }
  void bidirectional_attention_backward(Real* dqkv, const Real* dout, const Real* qkv, const Real* out,
                                        const Real* lse, int B, int T, int NH, int HS) const override {
    cpu::attention_backward(dqkv, dout, qkv, out, lse, B, T, NH, NH, HS, cpu::AttentionTiles(), false);
  }
  void rope_pairs_forward(Real* qkv, const Real* cos, const Real* sin, int B, int T, int NH, int KV,
                          int HS) const override {
    cpu::rope_pairs_forward(qkv, cos, sin, B, T, NH, KV, HS);
  }
  void rope_pairs_backward(Real* dqkv, const Real* cos, const Real* sin, int B, int T, int NH, int KV,
                           int HS) const override {
    cpu::rope_pairs_backward(dqkv, cos, sin, B, T, NH, KV, HS);
  }
  void modulate_forward(Real* out, Real* mean, Real* rstd, const Real* inp, const Real* shift, const Real* scale,
                        int ld, int B, int T, int C, Real eps) const override {
    cpu::modulate_forward(out, mean, rstd, inp, shift, scale, ld, B, T, C, eps);
  }
  void modulate_backward(Real* dinp, Real* dshift, Real* dscale, const Real* dout, const Real* inp, const Real* scale,
                         const Real* mean, const Real* rstd, int ld, int B, int T, int C) const override {
    cpu::modulate_backward(dinp, dshift, dscale, dout, inp, scale, mean, rstd, ld, B, T, C);
  }
  void gate_forward(Real* out, const Real* resid, const Real* y, const Real* gate, int ld, int B, int T,
                    int C) const override {
    cpu::gate_forward(out, resid, y, gate, ld, B, T, C);
  }
  void gate_backward(Real* dy, Real* dgate, const Real* dout, const Real* y, const Real* gate, int ld, int B, int T,
                     int C) const override {
    cpu::gate_backward(dy, dgate, dout, y, gate, ld, B, T, C);
  }
  void silu_forward(Real* out, const Real* inp, size_t n) const override { cpu::silu_forward(out, inp, n); }
  void silu_backward(Real* dinp, const Real* dout, const Real* inp, size_t n) const override {
    cpu::silu_backward(dinp, dout, inp, n);
  }
  void squared_error_forward(Real* losses, Real* out_to_grad, const Real* target, int N, int W) const override {
    cpu::squared_error_forward(losses, out_to_grad, target, N, W);
  }
  void copy_rows(Real* dst, int ld_dst, const Real* src, int ld_src, int rows, int cols) const override {
    cpu::copy_rows(dst, ld_dst, src, ld_src, rows, cols);
  }
  void rmsnorm_forward(Real* out, Real* rstd, const Real* inp, const Real* weight, Real eps, int N,
                       int C) const override {
    cpu::rmsnorm_forward(out, rstd, inp, weight, eps, N, C);
  }
  void rmsnorm_backward(Real* dinp, Real* dweight, const Real* dout, const Real* inp, const Real* weight,
                        const Real* rstd, int N, int C) const override {
    cpu::rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, N, C);
  }
  void rope_forward(Real* qkv, const Real* cos, const Real* sin, int B, int T, int NH, int KV, int HS,
                    const int* positions) const override {
    cpu::rope_forward(qkv, cos, sin, B, T, NH, KV, HS, positions);
  }
  void rope_backward(Real* dqkv, const Real* cos, const Real* sin, int B, int T, int NH, int KV, int HS,
                     const int* positions) const override {
    cpu::rope_backward(dqkv, cos, sin, B, T, NH, KV, HS, positions);
  }
  void swiglu_forward(Real* out, const Real* gate_up, int N, int I) const override {
    cpu::swiglu_forward(out, gate_up, N, I);
  }
  void swiglu_backward(Real* dgate_up, const Real* dout, const Real* gate_up, int N, int I) const override {
    cpu::swiglu_backward(dgate_up, dout, gate_up, N, I);
  }
  void gelu_forward(Real* out, const Real* inp, size_t n) const override { cpu::gelu_forward(out, inp, n); }
  void gelu_backward(Real* dinp, const Real* dout, const Real* inp, size_t n) const override {
    cpu::gelu_backward(dinp, dout, inp, n);
  }
  void row_norms(Real* out, const Real* x, int rows, int cols) const override { cpu::row_norms(out, x, rows, cols); }
  void column_affine(Real* y, int ld, int rows, int cols, const Real* scale, const Real* shift) const override {
    cpu::column_affine(y, ld, rows, cols, scale, shift);
  }
  void scale_rows(Real* y, int rows, int cols, const Real* scale, Real offset) const override {
    cpu::scale_rows(y, rows, cols, scale, offset);
  }
  void column_dot_accumulate(Real* out, const Real* a, int lda, const Real* b, int ldb, int rows, int cols,
                             const Real* divisor) const override {
    cpu::column_dot_accumulate(out, a, lda, b, ldb, rows, cols, divisor);
  }
  void divide(Real* out, const Real* a, const Real* b, size_t n) const override { cpu::divide(out, a, b, n); }
  void multiply(Real* out, const Real* a, const Real* b, size_t n, Real s) const override {
    cpu::multiply(out, a, b, n, s);
  }
  void kron(Real* out, const Real* A, int p, int q, const Real* B, int r, int t, Real s) const override {
    cpu::kron(out, A, p, q, B, r, t, s);
  }
  void kron_backward(Real* dA, Real* dB, const Real* dout, const Real* A, int p, int q, const Real* B, int r, int t,
                     Real s) const override {
    cpu::kron_backward(dA, dB, dout, A, p, q, B, r, t, s);
  }
  void residual_forward(Real* out, const Real* a, const Real* b, size_t n) const override {
    cpu::residual_forward(out, a, b, n);
  }
  void dropout(Real* out, const Real* inp, const uint64_t* row_keys, uint64_t site, int N, int C,
               float p) const override {
    cpu::dropout(out, inp, row_keys, site, N, C, p);
  }
  void softmax_crossentropy_forward(Real* losses, Real* logits_to_probs, const int* targets, int N,
                                    int V) const override {
    cpu::softmax_crossentropy_forward(losses, logits_to_probs, targets, N, V);
  }
  void softmax_crossentropy_backward(Real* probs_to_dlogits, const int* targets, Real dloss, int N,
                                     int V) const override {
    cpu::softmax_crossentropy_backward(probs_to_dlogits, targets, dloss, N, V);
  }
  void distill_loss_forward(Real* losses, Real* student_to_grad, const Real* teacher, const int* targets, int N,
                            int V, Real alpha, Real temperature) const override {
    cpu::distill_loss_forward(losses, student_to_grad, teacher, targets, N, V, alpha, temperature);
  }

  // The host is the device: "returning to the host" waits for nothing, but is counted as the
  // GPU's wait would be, so a step's synchronizations are checked on the CPU too.
  double sum(const Real* x, size_t n) const override {
    host_device().count_host_sync();
    return cpu::sum(x, n);
  }
  double sum_squares(const Real* x, size_t n) const override {
    host_device().count_host_sync();
    return cpu::sum_squares(x, n);
  }
  size_t count_nonfinite(const Real* x, size_t n) const override {
    host_device().count_host_sync();
    size_t bad = 0;
#pragma omp parallel for reduction(+ : bad) schedule(static)
    for (size_t i = 0; i < n; i++) bad += !std::isfinite(x[i]);
    return bad;
  }
  void accumulate_sum(double* total, const Real* x, size_t n) const override { *total += cpu::sum(x, n); }
  void accumulate_sum_squares(double* total, const Real* x, size_t n) const override {
    *total += cpu::sum_squares(x, n);
  }
  void scale(Real* x, size_t n, Real s) const override {
#pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; i++) x[i] *= s;
  }
  void round_to_half(Real* values, uint16_t* half, size_t n, DType type) const override {
    if (half) return convert_to_half(half, values, n, type, values);
    round_in_place(values, n, type);
  }
  void widen_half(Real* values, const uint16_t* half, size_t n, DType type) const override {
    convert_from_half(values, half, n, type);
  }
  void bind_half_copy(const Real* values, const uint16_t* half, size_t n, DType type) const override {
    if constexpr (std::is_same_v<Real, float>)
      if (bf16_) half_copies_.bind(values, half, n, type);
  }
  void unbind_half_copy(const Real* values) const override {
    if constexpr (std::is_same_v<Real, float>)
      if (bf16_) half_copies_.unbind(values);
  }
  bool multiplies_half_copies(DType type) const override { return bf16_ && bf16_->onednn() && type == DTYPE_BF16; }
  void copy_operand(Real* dst, const Real* src, size_t n) const override {
    if constexpr (std::is_same_v<Real, float>)
      if (const uint16_t* half = bf16_ ? half_copies_.find(src, n, DTYPE_BF16) : nullptr)
        return widen_half(dst, half, n, DTYPE_BF16);
    std::memcpy(dst, src, n * sizeof(Real));
  }

 private:
  cpu::Bf16Gemm* bf16_ = nullptr;
  mutable HalfCopies half_copies_;  // bf16: the weights' and activations' copies the GEMMs multiply
};

class CpuShardOps : public ShardOps {
 public:
  void to_half(uint16_t* out, const float* in, size_t n, DType type) const override {
    convert_to_half(out, in, n, type);
  }
  void from_half(float* out, const uint16_t* in, size_t n, DType type) const override {
    convert_from_half(out, in, n, type);
  }
  // Per block: the scale read (or decoded) once, 4-bit codes looked up in the block's 16 products
  // code x scale (the same products the element-wise definition forms), FP8 codes in a 256-entry
  // table, bf16 widened.
  void dequantize_blocks(float* out, uint16_t* half, DType half_type, const uint8_t* records, size_t blocks,
                         QuantType type, size_t block, const NestedScales& nested) const override {
    static const std::array<float, 256> e4m3 = [] {
      std::array<float, 256> t{};
      for (int c = 0; c < 256; c++) t[c] = e4m3_to_float(static_cast<uint8_t>(c));
      return t;
    }();
    const size_t record = quant_record_bytes(type, block, nested.map);
#pragma omp parallel for schedule(static)
    for (size_t b = 0; b < blocks; b++) {
      const uint8_t* codes = records + b * record;
      const float scale = record_scale(type, codes, block, nested, b);
      float* o = out ? out + b * block : nullptr;
      uint16_t* h = half ? half + b * block : nullptr;
      if (type == QUANT_FP8 && !o && half_type == DTYPE_BF16) {  // the 16-bit copy alone: one loop, no branches
        for (size_t i = 0; i < block; i++) h[i] = float_to_bf16(e4m3[codes[i]] * scale);
        continue;
      }
      if (type == QUANT_FP8 || type == QUANT_BF16) {
        for (size_t i = 0; i < block; i++) {
          float v = type == QUANT_FP8 ? e4m3[codes[i]] * scale : dequantize_code(type, codes, i, scale);
          if (h) h[i] = float_to_half(v, half_type), v = half_to_float(h[i], half_type);
          if (o) o[i] = v;
        }
        continue;
      }
      float value[16];
      uint16_t rounded[16];
      for (int c = 0; c < 16; c++) {
        value[c] = quant4_code_value(type, c) * scale;
        if (h) rounded[c] = float_to_half(value[c], half_type), value[c] = half_to_float(rounded[c], half_type);
      }
      for (size_t j = 0; j < block / 2; j++) {
        const int high = codes[j] >> 4, low = codes[j] & 15;
        if (o) o[2 * j] = value[high], o[2 * j + 1] = value[low];
        if (h) h[2 * j] = rounded[high], h[2 * j + 1] = rounded[low];
      }
    }
  }
  void adamw_multi(const AdamWSegment* segments, size_t count, const double* sums, const AdamWClip& clip,
                   const AdamWStep& step) const override {
    float multiplier = 0;
    if (!adamw_grad_multiplier(sums, clip, &multiplier)) return;
#pragma omp parallel for schedule(dynamic)
    for (size_t k = 0; k < count; k++) {
      const AdamWSegment& s = segments[k];
#pragma omp simd
      for (size_t i = 0; i < s.n; i++)
        adamw_update(&s.param[i], &s.m[i], &s.v[i], s.grad[i] * multiplier, s.decay, step);
    }
  }
};

}  // namespace

Device& host_device() {
  static HostDevice device;
  return device;
}

template <typename Real>
const LayerOps<Real>& cpu_layer_ops() {
  static const CpuLayerOps<Real> ops;
  return ops;
}
template const LayerOps<float>& cpu_layer_ops<float>();
template const LayerOps<double>& cpu_layer_ops<double>();

std::unique_ptr<LayerOps<float>> make_cpu_bf16_layer_ops(cpu::Bf16Gemm& gemm) {
  return std::make_unique<CpuLayerOps<float>>(&gemm);
}

const ShardOps& cpu_shard_ops() {
  static const CpuShardOps ops;
  return ops;
}

const Backend& cpu_backend() {
  static const Backend backend{&host_device(),         &host_device(),   &cpu_layer_ops<float>(),
                               &cpu_shard_ops(),       &cpu_layer_ops<float>(), &cpu_shard_ops()};
  return backend;
}

}  // namespace shardtrain
