// See op_timer.hpp.
#include "backend/op_timer.hpp"

#include <algorithm>
#include <utility>

#include "core/error.hpp"

namespace shardtrain {

OpTimer::~OpTimer() {
  for (DeviceEvent* event : events_) device_.destroy_event(event);
}

void OpTimer::begin(const std::string& name) {
  if (calls_ == names_.size()) names_.emplace_back();
  names_[calls_] = name;
  if (device_.is_host()) {
    host_start_ = now_seconds();
    return;
  }
  while (events_.size() < 2 * (calls_ + 1)) events_.push_back(device_.create_timing_event());
  device_.record(events_[2 * calls_], device_.compute_stream());
}

void OpTimer::end() {
  if (device_.is_host()) {
    if (host_spans_.size() <= calls_) host_spans_.resize(calls_ + 1);
    host_spans_[calls_] = now_seconds() - host_start_;
  } else {
    device_.record(events_[2 * calls_ + 1], device_.compute_stream());
  }
  calls_++;
}

void OpTimer::read_step(bool count) {
  if (count) {
    for (size_t i = 0; i < calls_; i++) {
      Total& total = totals_[names_[i]];
      total.seconds += device_.is_host() ? host_spans_[i] : device_.elapsed_seconds(events_[2 * i], events_[2 * i + 1]);
      total.calls++;
    }
    steps_++;
  }
  calls_ = 0;
}

std::string op_time_table(const OpTimer& timer, int rows) {
  std::vector<std::pair<std::string, OpTimer::Total>> sorted(timer.totals().begin(), timer.totals().end());
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.second.seconds > b.second.seconds; });
  double all = 0;
  for (const auto& entry : sorted) all += entry.second.seconds;
  const double steps = std::max(1, timer.steps());
  std::string table = strprintf("%-44s %9s %11s %7s\n", "op (per step)", "calls", "ms", "share");
  OpTimer::Total rest;
  for (size_t i = 0; i < sorted.size(); i++) {
    const OpTimer::Total& t = sorted[i].second;
    if (static_cast<int>(i) >= rows) {
      rest.seconds += t.seconds, rest.calls += t.calls;
      continue;
    }
    table += strprintf("%-44s %9.1f %11.3f %6.1f%%\n", sorted[i].first.c_str(), t.calls / steps, 1e3 * t.seconds / steps,
                       all > 0 ? 100 * t.seconds / all : 0.0);
  }
  if (rest.calls)
    table += strprintf("%-44s %9.1f %11.3f %6.1f%%\n", "(the rest)", rest.calls / steps, 1e3 * rest.seconds / steps,
                       all > 0 ? 100 * rest.seconds / all : 0.0);
  table += strprintf("%-44s %9s %11.3f\n", "timed in all", "", 1e3 * all / steps);
  return table;
}

namespace {

class TimedLayerOps final : public LayerOps<float> {
 public:
  TimedLayerOps(const LayerOps<float>& inner, OpTimer& timer) : inner_(inner), timer_(timer) {}
  Device& device() const override { return inner_.device(); }

  void encoder_forward(float* out, const int* tokens, const float* wte, const float* wpe, int B, int T, int C,
                       const int* positions) const override {
    timed("encoder_forward", [&] { inner_.encoder_forward(out, tokens, wte, wpe, B, T, C, positions); });
  }
  void encoder_backward(float* dwte, float* dwpe, const float* dout, const int* tokens, int B, int T, int C,
                        const int* positions) const override {
    timed("encoder_backward", [&] { inner_.encoder_backward(dwte, dwpe, dout, tokens, B, T, C, positions); });
  }
  void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                         const float* bias, int N, int C) const override {
    timed("layernorm_forward", [&] { inner_.layernorm_forward(out, mean, rstd, inp, weight, bias, N, C); });
  }
  void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                          const float* weight, const float* mean, const float* rstd, int N, int C) const override {
    timed("layernorm_backward",
          [&] { inner_.layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C); });
  }
  void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int N, int C,
                      int OC) const override {
    timed(strprintf("matmul_forward %dx%d->%d", N, C, OC),
          [&] { inner_.matmul_forward(out, inp, weight, bias, N, C, OC); });
  }
  void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                       const float* weight, int N, int C, int OC) const override {
    timed(strprintf("matmul_backward %dx%d->%d", N, C, OC),
          [&] { inner_.matmul_backward(dinp, dweight, dbias, dout, inp, weight, N, C, OC); });
  }
  void gemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda, const float* B,
            int ldb, float beta, float* C, int ldc) const override {
    timed("gemm (adapters)", [&] { inner_.gemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc); });
  }
  void attention_forward(float* out, float* lse, const float* qkv, int B, int T, int NH, int KV, int HS,
                         const int* doc_start) const override {
    timed("attention_forward", [&] { inner_.attention_forward(out, lse, qkv, B, T, NH, KV, HS, doc_start); });
  }
  void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse, int B,
                          int T, int NH, int KV, int HS, const int* doc_start) const override {
    timed("attention_backward",
          [&] { inner_.attention_backward(dqkv, dout, qkv, out, lse, B, T, NH, KV, HS, doc_start); });
  }
  void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, float eps, int N,
                       int C) const override {
    timed("rmsnorm_forward", [&] { inner_.rmsnorm_forward(out, rstd, inp, weight, eps, N, C); });
  }
  void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                        const float* rstd, int N, int C) const override {
    timed("rmsnorm_backward", [&] { inner_.rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, N, C); });
  }
  void rope_forward(float* qkv, const float* cos, const float* sin, int B, int T, int NH, int KV, int HS,
                    const int* positions) const override {
    timed("rope_forward", [&] { inner_.rope_forward(qkv, cos, sin, B, T, NH, KV, HS, positions); });
  }
  void rope_backward(float* dqkv, const float* cos, const float* sin, int B, int T, int NH, int KV, int HS,
                     const int* positions) const override {
    timed("rope_backward", [&] { inner_.rope_backward(dqkv, cos, sin, B, T, NH, KV, HS, positions); });
  }
  void attention_decode(float* out, float* scratch, float* k_cache, float* v_cache, const float* qkv, int Q, int start,
                        int NH, int KV, int HS, int window) const override {
    timed("attention_decode",
          [&] { inner_.attention_decode(out, scratch, k_cache, v_cache, qkv, Q, start, NH, KV, HS, window); });
  }
  void bidirectional_attention_forward(float* out, float* lse, const float* qkv, int B, int T, int NH,
                                       int HS) const override {
    timed("bidirectional_attention_forward",
          [&] { inner_.bidirectional_attention_forward(out, lse, qkv, B, T, NH, HS); });
  }
  void bidirectional_attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                                        const float* lse, int B, int T, int NH, int HS) const override {
    timed("bidirectional_attention_backward",
          [&] { inner_.bidirectional_attention_backward(dqkv, dout, qkv, out, lse, B, T, NH, HS); });
  }
  void rope_pairs_forward(float* qkv, const float* cos, const float* sin, int B, int T, int NH, int KV,
                          int HS) const override {
    timed("rope_pairs_forward", [&] { inner_.rope_pairs_forward(qkv, cos, sin, B, T, NH, KV, HS); });
  }
  void rope_pairs_backward(float* dqkv, const float* cos, const float* sin, int B, int T, int NH, int KV,
                           int HS) const override {
    timed("rope_pairs_backward", [&] { inner_.rope_pairs_backward(dqkv, cos, sin, B, T, NH, KV, HS); });
  }
  void modulate_forward(float* out, float* mean, float* rstd, const float* inp, const float* shift,
                        const float* scale, int ld, int B, int T, int C, float eps) const override {
    timed("modulate_forward", [&] { inner_.modulate_forward(out, mean, rstd, inp, shift, scale, ld, B, T, C, eps); });
  }
  void modulate_backward(float* dinp, float* dshift, float* dscale, const float* dout, const float* inp,
                         const float* scale, const float* mean, const float* rstd, int ld, int B, int T,
                         int C) const override {
    timed("modulate_backward",
          [&] { inner_.modulate_backward(dinp, dshift, dscale, dout, inp, scale, mean, rstd, ld, B, T, C); });
  }
  void gate_forward(float* out, const float* resid, const float* y, const float* gate, int ld, int B, int T,
                    int C) const override {
    timed("gate_forward", [&] { inner_.gate_forward(out, resid, y, gate, ld, B, T, C); });
  }
  void gate_backward(float* dy, float* dgate, const float* dout, const float* y, const float* gate, int ld, int B,
                     int T, int C) const override {
    timed("gate_backward", [&] { inner_.gate_backward(dy, dgate, dout, y, gate, ld, B, T, C); });
  }
  void silu_forward(float* out, const float* inp, size_t n) const override {
    timed("silu_forward", [&] { inner_.silu_forward(out, inp, n); });
  }
  void silu_backward(float* dinp, const float* dout, const float* inp, size_t n) const override {
    timed("silu_backward", [&] { inner_.silu_backward(dinp, dout, inp, n); });
  }
  void squared_error_forward(float* losses, float* out_to_grad, const float* target, int N, int W) const override {
    timed("squared_error_forward", [&] { inner_.squared_error_forward(losses, out_to_grad, target, N, W); });
  }
  void copy_rows(float* dst, int ld_dst, const float* src, int ld_src, int rows, int cols) const override {
    timed("copy_rows", [&] { inner_.copy_rows(dst, ld_dst, src, ld_src, rows, cols); });
  }
  void swiglu_forward(float* out, const float* gate_up, int N, int I) const override {
    timed("swiglu_forward", [&] { inner_.swiglu_forward(out, gate_up, N, I); });
  }
  void swiglu_backward(float* dgate_up, const float* dout, const float* gate_up, int N, int I) const override {
    timed("swiglu_backward", [&] { inner_.swiglu_backward(dgate_up, dout, gate_up, N, I); });
  }
  void gelu_forward(float* out, const float* inp, size_t n) const override {
    timed("gelu_forward", [&] { inner_.gelu_forward(out, inp, n); });
  }
  void gelu_backward(float* dinp, const float* dout, const float* inp, size_t n) const override {
    timed("gelu_backward", [&] { inner_.gelu_backward(dinp, dout, inp, n); });
  }
  void residual_forward(float* out, const float* a, const float* b, size_t n) const override {
    timed("residual_forward", [&] { inner_.residual_forward(out, a, b, n); });
  }
  void row_norms(float* out, const float* x, int rows, int cols) const override {
    timed("row_norms", [&] { inner_.row_norms(out, x, rows, cols); });
  }
  void column_affine(float* y, int ld, int rows, int cols, const float* scale, const float* shift) const override {
    timed("column_affine", [&] { inner_.column_affine(y, ld, rows, cols, scale, shift); });
  }
  void scale_rows(float* y, int rows, int cols, const float* scale, float offset) const override {
    timed("scale_rows", [&] { inner_.scale_rows(y, rows, cols, scale, offset); });
  }
  void column_dot_accumulate(float* out, const float* a, int lda, const float* b, int ldb, int rows, int cols,
                             const float* divisor) const override {
    timed("column_dot_accumulate", [&] { inner_.column_dot_accumulate(out, a, lda, b, ldb, rows, cols, divisor); });
  }
  void divide(float* out, const float* a, const float* b, size_t n) const override {
    timed("divide", [&] { inner_.divide(out, a, b, n); });
  }
  void multiply(float* out, const float* a, const float* b, size_t n, float s) const override {
    timed("multiply", [&] { inner_.multiply(out, a, b, n, s); });
  }
  void kron(float* out, const float* A, int p, int q, const float* B, int r, int t, float s) const override {
    timed("kron", [&] { inner_.kron(out, A, p, q, B, r, t, s); });
  }
  void kron_backward(float* dA, float* dB, const float* dout, const float* A, int p, int q, const float* B, int r,
                     int t, float s) const override {
    timed("kron_backward", [&] { inner_.kron_backward(dA, dB, dout, A, p, q, B, r, t, s); });
  }
  void dropout(float* out, const float* inp, const uint64_t* row_keys, uint64_t site, int N, int C,
               float p) const override {
    timed("dropout", [&] { inner_.dropout(out, inp, row_keys, site, N, C, p); });
  }
  void softmax_crossentropy_forward(float* losses, float* logits_to_probs, const int* targets, int N,
                                    int V) const override {
    timed("softmax_crossentropy_forward",
          [&] { inner_.softmax_crossentropy_forward(losses, logits_to_probs, targets, N, V); });
  }
  void softmax_crossentropy_backward(float* probs_to_dlogits, const int* targets, float dloss, int N,
                                     int V) const override {
    timed("softmax_crossentropy_backward",
          [&] { inner_.softmax_crossentropy_backward(probs_to_dlogits, targets, dloss, N, V); });
  }
  void distill_loss_forward(float* losses, float* student_to_grad, const float* teacher, const int* targets, int N,
                            int V, float alpha, float temperature) const override {
    timed("distill_loss_forward",
          [&] { inner_.distill_loss_forward(losses, student_to_grad, teacher, targets, N, V, alpha, temperature); });
  }
  // Reductions returned to the host wait for the device: not timed (a span would hold the wait).
  double sum(const float* x, size_t n) const override { return inner_.sum(x, n); }
  double sum_squares(const float* x, size_t n) const override { return inner_.sum_squares(x, n); }
  size_t count_nonfinite(const float* x, size_t n) const override { return inner_.count_nonfinite(x, n); }
  void accumulate_sum(double* total, const float* x, size_t n) const override {
    timed("accumulate_sum", [&] { inner_.accumulate_sum(total, x, n); });
  }
  void accumulate_sum_squares(double* total, const float* x, size_t n) const override {
    timed("accumulate_sum_squares", [&] { inner_.accumulate_sum_squares(total, x, n); });
  }
  void scale(float* x, size_t n, float s) const override {
    timed("scale", [&] { inner_.scale(x, n, s); });
  }
  void round_to_half(float* values, uint16_t* half, size_t n, DType type) const override {
    timed("round_to_half", [&] { inner_.round_to_half(values, half, n, type); });
  }
  void widen_half(float* values, const uint16_t* half, size_t n, DType type) const override {
    timed("widen_half", [&] { inner_.widen_half(values, half, n, type); });
  }
  void bind_half_copy(const float* values, const uint16_t* half, size_t n, DType type) const override {
    inner_.bind_half_copy(values, half, n, type);
  }
  void unbind_half_copy(const float* values) const override { inner_.unbind_half_copy(values); }
  bool multiplies_half_copies(DType type) const override { return inner_.multiplies_half_copies(type); }
  void copy_operand(float* dst, const float* src, size_t n) const override {
    timed("copy_operand", [&] { inner_.copy_operand(dst, src, n); });
  }
  void documents_changed(const int* doc_start) const override { inner_.documents_changed(doc_start); }

 private:
  template <typename Call>
  void timed(const std::string& name, const Call& call) const {
    timer_.begin(name);
    call();
    timer_.end();
  }
  const LayerOps<float>& inner_;
  OpTimer& timer_;
};

}  // namespace

std::unique_ptr<LayerOps<float>> make_timed_layer_ops(const LayerOps<float>& inner, OpTimer& timer) {
  return std::make_unique<TimedLayerOps>(inner, timer);
}

}  // namespace shardtrain
