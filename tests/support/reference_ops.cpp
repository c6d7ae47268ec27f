// Naive double-precision GPT-2 and Llama layers, the oracle of tests/unit/test_layers.cpp. Each
// function is the textbook formula as loops; the gradient terms are named in comments. See
// reference_ops.hpp for shapes and the accumulation rule (parameters +=, activations =, layernorm
// and rmsnorm dinp +=).
#include "support/reference_ops.hpp"

#include <cmath>
#include <vector>

namespace shardtrain::reference {

void encoder_forward(double* out, const int* tokens, const double* wte, const double* wpe, int B, int T, int C,
                     const int* positions) {
  for (int b = 0; b < B; b++)
    for (int t = 0; t < T; t++) {
      const int token = tokens[b * T + t], p = positions ? positions[b * T + t] : t;
      for (int c = 0; c < C; c++)
        out[(static_cast<size_t>(b) * T + t) * C + c] =
            wte[static_cast<size_t>(token) * C + c] + (wpe ? wpe[p * C + c] : 0.0);
    }
}

void encoder_backward(double* dwte, double* dwpe, const double* dout, const int* tokens, int B, int T, int C,
                      const int* positions) {
  for (int b = 0; b < B; b++)
    for (int t = 0; t < T; t++) {
      const int token = tokens[b * T + t], p = positions ? positions[b * T + t] : t;
      const double* d = dout + (static_cast<size_t>(b) * T + t) * C;
      for (int c = 0; c < C; c++) {
        dwte[static_cast<size_t>(token) * C + c] += d[c];  // d out / d wte[token] = 1
        if (dwpe) dwpe[p * C + c] += d[c];                  // d out / d wpe[p] = 1
      }
    }
}

void layernorm_forward(double* out, double* mean, double* rstd, const double* inp, const double* weight,
                       const double* bias, int N, int C) {
  const double eps = 1e-5;
  for (int n = 0; n < N; n++) {
    const double* x = inp + static_cast<size_t>(n) * C;
    double mu = 0;
    for (int c = 0; c < C; c++) mu += x[c];
    mu /= C;
    double var = 0;  // biased: divide by C, not C-1
    for (int c = 0; c < C; c++) var += (x[c] - mu) * (x[c] - mu);
    var /= C;
    const double s = 1.0 / std::sqrt(var + eps);
    for (int c = 0; c < C; c++) out[static_cast<size_t>(n) * C + c] = (x[c] - mu) * s * weight[c] + bias[c];
    mean[n] = mu;
    rstd[n] = s;
  }
}

void layernorm_backward(double* dinp, double* dweight, double* dbias, const double* dout, const double* inp,
                        const double* weight, const double* mean, const double* rstd, int N, int C) {
  for (int n = 0; n < N; n++) {
    const double* x = inp + static_cast<size_t>(n) * C;
    const double* dy = dout + static_cast<size_t>(n) * C;
    // y = xhat * w + b with xhat = (x - mean) * rstd.
    // dxhat = dy * w; dx = rstd * (dxhat - mean_c(dxhat) - xhat * mean_c(dxhat * xhat)).
    double mean_dxhat = 0, mean_dxhat_xhat = 0;
    for (int c = 0; c < C; c++) {
      const double xhat = (x[c] - mean[n]) * rstd[n];
      mean_dxhat += dy[c] * weight[c];
      mean_dxhat_xhat += dy[c] * weight[c] * xhat;
    }
    mean_dxhat /= C;
    mean_dxhat_xhat /= C;
    for (int c = 0; c < C; c++) {
      const double xhat = (x[c] - mean[n]) * rstd[n];
      const double dxhat = dy[c] * weight[c];
      dinp[static_cast<size_t>(n) * C + c] += rstd[n] * (dxhat - mean_dxhat - xhat * mean_dxhat_xhat);
      dweight[c] += dy[c] * xhat;
      dbias[c] += dy[c];
    }
  }
}

void rmsnorm_forward(double* out, double* rstd, const double* inp, const double* weight, double eps, int N, int C) {
  for (int n = 0; n < N; n++) {
    const double* x = inp + static_cast<size_t>(n) * C;
    double ms = 0;  // mean of squares
    for (int c = 0; c < C; c++) ms += x[c] * x[c];
    ms /= C;
    const double s = 1.0 / std::sqrt(ms + eps);
    for (int c = 0; c < C; c++) out[static_cast<size_t>(n) * C + c] = x[c] * s * weight[c];
    rstd[n] = s;
  }
}

void rmsnorm_backward(double* dinp, double* dweight, const double* dout, const double* inp, const double* weight,
                      const double* rstd, int N, int C) {
  for (int n = 0; n < N; n++) {
    const double* x = inp + static_cast<size_t>(n) * C;
    const double* dy = dout + static_cast<size_t>(n) * C;
    const double s = rstd[n];
    // y_c = x_c s w_c with s = (mean(x^2) + eps)^(-1/2), so ds/dx_j = -s^3 x_j / C and
    // dx_j = dy_j w_j s + sum_c dy_c w_c x_c * ds/dx_j = s dy_j w_j - (s^3 / C) x_j sum_c dy_c w_c x_c.
    double dot = 0;
    for (int c = 0; c < C; c++) dot += dy[c] * weight[c] * x[c];
    for (int c = 0; c < C; c++) {
      dinp[static_cast<size_t>(n) * C + c] += s * dy[c] * weight[c] - s * s * s / C * x[c] * dot;
      dweight[c] += dy[c] * x[c] * s;  // dy_c / dw_c = x_c s
    }
  }
}

void matmul_forward(double* out, const double* inp, const double* weight, const double* bias, int N, int C, int OC) {
  for (int n = 0; n < N; n++)
    for (int o = 0; o < OC; o++) {
      double sum = bias ? bias[o] : 0.0;
      for (int c = 0; c < C; c++) sum += inp[static_cast<size_t>(n) * C + c] * weight[static_cast<size_t>(o) * C + c];
      out[static_cast<size_t>(n) * OC + o] = sum;
    }
}

void matmul_backward(double* dinp, double* dweight, double* dbias, const double* dout, const double* inp,
                     const double* weight, int N, int C, int OC) {
  if (dinp) {
    // dinp[n,c] = sum_o dout[n,o] * weight[o,c]
    for (int n = 0; n < N; n++)
      for (int c = 0; c < C; c++) {
        double sum = 0;
        for (int o = 0; o < OC; o++)
          sum += dout[static_cast<size_t>(n) * OC + o] * weight[static_cast<size_t>(o) * C + c];
        dinp[static_cast<size_t>(n) * C + c] = sum;
      }
  }
  // dweight[o,c] += sum_n dout[n,o] * inp[n,c]
  for (int o = 0; o < OC; o++)
    for (int c = 0; c < C; c++) {
      double sum = 0;
      for (int n = 0; n < N; n++) sum += dout[static_cast<size_t>(n) * OC + o] * inp[static_cast<size_t>(n) * C + c];
      dweight[static_cast<size_t>(o) * C + c] += sum;
    }
  if (dbias) {
    // dbias[o] += sum_n dout[n,o]
    for (int o = 0; o < OC; o++) {
      double sum = 0;
      for (int n = 0; n < N; n++) sum += dout[static_cast<size_t>(n) * OC + o];
      dbias[o] += sum;
    }
  }
}

namespace {
// Index helpers for attention: qkv(B,T,(NH+2KV)*HS) with part 0 = q (NH heads), 1 = k, 2 = v (KV
// heads each), and att(B,NH,T,T).
struct QkvLayout {
  int T, NH, KV, HS;
  size_t at(int b, int t, int part, int head, int i) const {
    const int row = (NH + 2 * KV) * HS;
    const int first = part == 0 ? 0 : part == 1 ? NH : NH + KV;  // the part's first head in the row
    return (static_cast<size_t>(b) * T + t) * row + static_cast<size_t>(first + head) * HS + i;
  }
  // The key/value head that query head h reads: NH/KV consecutive query heads share one.
  int kv_of(int h) const { return h / (NH / KV); }
};
inline size_t att_at(int b, int h, int t, int s, int NH, int T) {
  return ((static_cast<size_t>(b) * NH + h) * T + t) * T + s;
}
}  // namespace

void attention_forward(double* out, double* att, double* lse, const double* qkv, int B, int T, int NH, int KV,
                       int HS) {
  const QkvLayout L{T, NH, KV, HS};
  const double scale = 1.0 / std::sqrt(static_cast<double>(HS));
  std::vector<double> score(T);
  for (int b = 0; b < B; b++)
    for (int h = 0; h < NH; h++) {
      const int g = L.kv_of(h);
      for (int t = 0; t < T; t++) {
        // score[s] = q_t . k_s * scale for s <= t; softmax over s <= t; 0 above the diagonal.
        double maxval = -INFINITY;
        for (int s = 0; s <= t; s++) {
          double dot = 0;
          for (int i = 0; i < HS; i++) dot += qkv[L.at(b, t, 0, h, i)] * qkv[L.at(b, s, 1, g, i)];
          score[s] = dot * scale;
          if (score[s] > maxval) maxval = score[s];
        }
        double sum = 0;
        for (int s = 0; s <= t; s++) sum += std::exp(score[s] - maxval);
        if (lse) lse[(static_cast<size_t>(b) * NH + h) * T + t] = maxval + std::log(sum);
        for (int s = 0; s < T; s++)
          att[att_at(b, h, t, s, NH, T)] = s <= t ? std::exp(score[s] - maxval) / sum : 0.0;
        // out[b,t,h*HS+i] = sum_s att[t,s] * v_s[i]
        for (int i = 0; i < HS; i++) {
          double acc = 0;
          for (int s = 0; s <= t; s++) acc += att[att_at(b, h, t, s, NH, T)] * qkv[L.at(b, s, 2, g, i)];
          out[(static_cast<size_t>(b) * T + t) * NH * HS + static_cast<size_t>(h) * HS + i] = acc;
        }
      }
    }
}

void attention_backward(double* dqkv, const double* dout, const double* qkv, const double* att, int B, int T, int NH,
                        int KV, int HS) {
  const QkvLayout L{T, NH, KV, HS};
  const double scale = 1.0 / std::sqrt(static_cast<double>(HS));
  for (size_t j = 0; j < static_cast<size_t>(B) * T * (NH + 2 * KV) * HS; j++) dqkv[j] = 0;  // written, not +=
  std::vector<double> datt(T), dscore(T);
  // Every query head adds its share into the k and v of the key/value head it reads (a sum over
  // the group of NH/KV heads), exactly as a shared input's gradient sums over its uses.
  for (int b = 0; b < B; b++)
    for (int h = 0; h < NH; h++) {
      const int g = L.kv_of(h);
      for (int t = 0; t < T; t++) {
        const double* dy = dout + (static_cast<size_t>(b) * T + t) * NH * HS + static_cast<size_t>(h) * HS;
        // out_t = sum_s att[t,s] v_s:  datt[t,s] = dout_t . v_s;  dv_s += att[t,s] * dout_t.
        for (int s = 0; s <= t; s++) {
          const double a = att[att_at(b, h, t, s, NH, T)];
          double dot = 0;
          for (int i = 0; i < HS; i++) {
            dot += dy[i] * qkv[L.at(b, s, 2, g, i)];
            dqkv[L.at(b, s, 2, g, i)] += a * dy[i];
          }
          datt[s] = dot;
        }
        // softmax: dscore[s] = att[t,s] * (datt[s] - sum_r att[t,r] datt[r]).
        double weighted = 0;
        for (int s = 0; s <= t; s++) weighted += att[att_at(b, h, t, s, NH, T)] * datt[s];
        for (int s = 0; s <= t; s++) dscore[s] = att[att_at(b, h, t, s, NH, T)] * (datt[s] - weighted);
        // score[s] = scale * q_t . k_s:  dq_t += scale * dscore[s] * k_s;  dk_s += scale * dscore[s] * q_t.
        for (int s = 0; s <= t; s++)
          for (int i = 0; i < HS; i++) {
            dqkv[L.at(b, t, 0, h, i)] += scale * dscore[s] * qkv[L.at(b, s, 1, g, i)];
            dqkv[L.at(b, s, 1, g, i)] += scale * dscore[s] * qkv[L.at(b, t, 0, h, i)];
          }
      }
    }
}

void rope_tables(double* cos, double* sin, int T, int HS, double theta) {
  const int half = HS / 2;
  for (int t = 0; t < T; t++)
    for (int i = 0; i < half; i++) {
      const double inv_freq = std::pow(theta, -2.0 * i / HS);
      cos[static_cast<size_t>(t) * half + i] = std::cos(t * inv_freq);
      sin[static_cast<size_t>(t) * half + i] = std::sin(t * inv_freq);
    }
}

namespace {
// Hugging Face's apply_rotary_pos_emb on one head vector x(HS) at one position:
// x * cat(cos, cos) + rotate_half(x) * cat(sin, sin), rotate_half(x) = cat(-x[half:], x[:half]).
void rope_vector(double* x, const double* cos_t, const double* sin_t, int HS) {
  const int half = HS / 2;
  std::vector<double> rotated(HS), cos_full(HS), sin_full(HS), y(HS);
  for (int i = 0; i < half; i++) {
    rotated[i] = -x[i + half];
    rotated[i + half] = x[i];
    cos_full[i] = cos_full[i + half] = cos_t[i];
    sin_full[i] = sin_full[i + half] = sin_t[i];
  }
  for (int i = 0; i < HS; i++) y[i] = x[i] * cos_full[i] + rotated[i] * sin_full[i];
  for (int i = 0; i < HS; i++) x[i] = y[i];
}
}  // namespace

void rope_forward(double* qkv, const double* cos, const double* sin, int B, int T, int NH, int KV, int HS,
                  const int* positions) {
  const QkvLayout L{T, NH, KV, HS};
  const size_t half = HS / 2;
  for (int b = 0; b < B; b++)
    for (int t = 0; t < T; t++) {
      const size_t p = positions ? positions[b * T + t] : t;
      for (int h = 0; h < NH; h++) rope_vector(qkv + L.at(b, t, 0, h, 0), cos + p * half, sin + p * half, HS);
      for (int h = 0; h < KV; h++) rope_vector(qkv + L.at(b, t, 1, h, 0), cos + p * half, sin + p * half, HS);
    }
}

void rope_backward(double* dqkv, const double* cos, const double* sin, int B, int T, int NH, int KV, int HS,
                   const int* positions) {
  const QkvLayout L{T, NH, KV, HS};
  const size_t half = HS / 2;
  // The forward at position t is a linear map M_t on each head vector; its column j is M_t e_j.
  // The gradient before rope is M_t^T g: (M_t^T g)_j = sum_i M_t[i][j] g_i = (M_t e_j) . g.
  std::vector<double> column(HS), g(HS);
  auto transpose_apply = [&](double* x, int t) {
    for (int i = 0; i < HS; i++) g[i] = x[i];
    for (int j = 0; j < HS; j++) {
      for (int i = 0; i < HS; i++) column[i] = i == j ? 1.0 : 0.0;
      rope_vector(column.data(), cos + t * half, sin + t * half, HS);
      double dot = 0;
      for (int i = 0; i < HS; i++) dot += column[i] * g[i];
      x[j] = dot;
    }
  };
  for (int b = 0; b < B; b++)
    for (int t = 0; t < T; t++) {
      const int p = positions ? positions[b * T + t] : t;
      for (int h = 0; h < NH; h++) transpose_apply(dqkv + L.at(b, t, 0, h, 0), p);
      for (int h = 0; h < KV; h++) transpose_apply(dqkv + L.at(b, t, 1, h, 0), p);
    }
}

namespace {
const double kGeluScale = std::sqrt(2.0 / M_PI);
const double kGeluCubic = 0.044715;
}  // namespace

void gelu_forward(double* out, const double* inp, size_t n) {
  for (size_t i = 0; i < n; i++) {
    const double x = inp[i];
    out[i] = 0.5 * x * (1.0 + std::tanh(kGeluScale * (x + kGeluCubic * x * x * x)));
  }
}

void gelu_backward(double* dinp, const double* dout, const double* inp, size_t n) {
  for (size_t i = 0; i < n; i++) {
    // d/dx 0.5 x (1 + tanh u) = 0.5 (1 + tanh u) + 0.5 x sech^2(u) u',  u' = sqrt(2/pi) (1 + 3 * 0.044715 x^2).
    const double x = inp[i];
    const double th = std::tanh(kGeluScale * (x + kGeluCubic * x * x * x));
    const double du = kGeluScale * (1.0 + 3.0 * kGeluCubic * x * x);
    dinp[i] = dout[i] * (0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * du);
  }
}

namespace {
// sigmoid(x) = (1 + tanh(x/2)) / 2: the tanh form, so it shares no formula with backend/math.hpp's
// 1 / (1 + exp(-x)).
double sigmoid(double x) { return 0.5 * (1.0 + std::tanh(0.5 * x)); }
}  // namespace

void swiglu_forward(double* out, const double* gate_up, int N, int I) {
  for (int n = 0; n < N; n++)
    for (int i = 0; i < I; i++) {
      const double g = gate_up[static_cast<size_t>(n) * 2 * I + i];
      const double u = gate_up[static_cast<size_t>(n) * 2 * I + I + i];
      out[static_cast<size_t>(n) * I + i] = g * sigmoid(g) * u;
    }
}

void swiglu_backward(double* dgate_up, const double* dout, const double* gate_up, int N, int I) {
  for (int n = 0; n < N; n++)
    for (int i = 0; i < I; i++) {
      const double g = gate_up[static_cast<size_t>(n) * 2 * I + i];
      const double u = gate_up[static_cast<size_t>(n) * 2 * I + I + i];
      const double dy = dout[static_cast<size_t>(n) * I + i];
      // out = silu(g) u; silu'(g) = sigmoid(g) + g sigmoid'(g), sigmoid' = sigmoid (1 - sigmoid).
      const double sg = sigmoid(g);
      dgate_up[static_cast<size_t>(n) * 2 * I + i] = dy * u * (sg + g * sg * (1.0 - sg));
      dgate_up[static_cast<size_t>(n) * 2 * I + I + i] = dy * g * sg;
    }
}

void residual_forward(double* out, const double* a, const double* b, size_t n) {
  for (size_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}

void softmax_crossentropy_forward(double* losses, double* logits_to_probs, const int* targets, int N, int V) {
  for (int n = 0; n < N; n++) {
    double* row = logits_to_probs + static_cast<size_t>(n) * V;
    double maxval = -INFINITY;
    for (int v = 0; v < V; v++)
      if (row[v] > maxval) maxval = row[v];
    double sum = 0;
    for (int v = 0; v < V; v++) sum += std::exp(row[v] - maxval);
    // -log softmax[target] = log(sum_v exp(l_v)) - l_target, written without forming the small prob.
    // An ignored target (< 0, a loss mask's): no loss.
    losses[n] = targets[n] < 0 ? 0.0 : maxval + std::log(sum) - row[targets[n]];
    for (int v = 0; v < V; v++) row[v] = std::exp(row[v] - maxval) / sum;
  }
}

void softmax_crossentropy_backward(double* probs_to_dlogits, const int* targets, double dloss, int N, int V) {
  for (int n = 0; n < N; n++)
    for (int v = 0; v < V; v++) {
      double& p = probs_to_dlogits[static_cast<size_t>(n) * V + v];
      p = targets[n] < 0 ? 0.0 : (p - (v == targets[n] ? 1.0 : 0.0)) * dloss;  // ignored: no gradient
    }
}

}  // namespace shardtrain::reference
