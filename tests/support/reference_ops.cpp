// Naive double-precision GPT-2 layers, the oracle of tests/unit/test_layers.cpp. Each function is
// the textbook formula as loops; the gradient terms are named in comments. See reference_ops.hpp
// for shapes and the accumulation rule (parameters +=, activations =, layernorm dinp +=).
#include "support/reference_ops.hpp"

#include <cmath>
#include <vector>

namespace shardtrain::reference {

void encoder_forward(double* out, const int* tokens, const double* wte, const double* wpe, int B, int T, int C) {
  for (int b = 0; b < B; b++)
    for (int t = 0; t < T; t++) {
      const int token = tokens[b * T + t];
      for (int c = 0; c < C; c++)
        out[(static_cast<size_t>(b) * T + t) * C + c] = wte[static_cast<size_t>(token) * C + c] + wpe[t * C + c];
    }
}

void encoder_backward(double* dwte, double* dwpe, const double* dout, const int* tokens, int B, int T, int C) {
  for (int b = 0; b < B; b++)
    for (int t = 0; t < T; t++) {
      const int token = tokens[b * T + t];
      const double* d = dout + (static_cast<size_t>(b) * T + t) * C;
      for (int c = 0; c < C; c++) {
        dwte[static_cast<size_t>(token) * C + c] += d[c];  // d out / d wte[token] = 1
        dwpe[t * C + c] += d[c];                            // d out / d wpe[t] = 1
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
// Index helpers for attention: qkv(B,T,3C) and att(B,NH,T,T).
inline size_t qkv_at(int b, int t, int part, int h, int i, int T, int C, int hs) {
  return (static_cast<size_t>(b) * T + t) * 3 * C + static_cast<size_t>(part) * C + static_cast<size_t>(h) * hs + i;
}
inline size_t att_at(int b, int h, int t, int s, int NH, int T) {
  return ((static_cast<size_t>(b) * NH + h) * T + t) * T + s;
}
}  // namespace

void attention_forward(double* out, double* att, const double* qkv, int B, int T, int C, int NH) {
  const int hs = C / NH;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  std::vector<double> score(T);
  for (int b = 0; b < B; b++)
    for (int h = 0; h < NH; h++)
      for (int t = 0; t < T; t++) {
        // score[s] = q_t . k_s * scale for s <= t; softmax over s <= t; 0 above the diagonal.
        double maxval = -INFINITY;
        for (int s = 0; s <= t; s++) {
          double dot = 0;
          for (int i = 0; i < hs; i++) dot += qkv[qkv_at(b, t, 0, h, i, T, C, hs)] * qkv[qkv_at(b, s, 1, h, i, T, C, hs)];
          score[s] = dot * scale;
          if (score[s] > maxval) maxval = score[s];
        }
        double sum = 0;
        for (int s = 0; s <= t; s++) sum += std::exp(score[s] - maxval);
        for (int s = 0; s < T; s++)
          att[att_at(b, h, t, s, NH, T)] = s <= t ? std::exp(score[s] - maxval) / sum : 0.0;
        // out[b,t,h*hs+i] = sum_s att[t,s] * v_s[i]
        for (int i = 0; i < hs; i++) {
          double acc = 0;
          for (int s = 0; s <= t; s++) acc += att[att_at(b, h, t, s, NH, T)] * qkv[qkv_at(b, s, 2, h, i, T, C, hs)];
          out[(static_cast<size_t>(b) * T + t) * C + static_cast<size_t>(h) * hs + i] = acc;
        }
      }
}

void attention_backward(double* dqkv, const double* dout, const double* qkv, const double* att, int B, int T, int C,
                        int NH) {
  const int hs = C / NH;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  for (size_t j = 0; j < static_cast<size_t>(B) * T * 3 * C; j++) dqkv[j] = 0;  // written, not accumulated
  std::vector<double> datt(T), dscore(T);
  for (int b = 0; b < B; b++)
    for (int h = 0; h < NH; h++)
      for (int t = 0; t < T; t++) {
        const double* dy = dout + (static_cast<size_t>(b) * T + t) * C + static_cast<size_t>(h) * hs;
        // out_t = sum_s att[t,s] v_s:  datt[t,s] = dout_t . v_s;  dv_s += att[t,s] * dout_t.
        for (int s = 0; s <= t; s++) {
          const double a = att[att_at(b, h, t, s, NH, T)];
          double dot = 0;
          for (int i = 0; i < hs; i++) {
            dot += dy[i] * qkv[qkv_at(b, s, 2, h, i, T, C, hs)];
            dqkv[qkv_at(b, s, 2, h, i, T, C, hs)] += a * dy[i];
          }
          datt[s] = dot;
        }
        // softmax: dscore[s] = att[t,s] * (datt[s] - sum_r att[t,r] datt[r]).
        double weighted = 0;
        for (int s = 0; s <= t; s++) weighted += att[att_at(b, h, t, s, NH, T)] * datt[s];
        for (int s = 0; s <= t; s++) dscore[s] = att[att_at(b, h, t, s, NH, T)] * (datt[s] - weighted);
        // score[s] = scale * q_t . k_s:  dq_t += scale * dscore[s] * k_s;  dk_s += scale * dscore[s] * q_t.
        for (int s = 0; s <= t; s++)
          for (int i = 0; i < hs; i++) {
            dqkv[qkv_at(b, t, 0, h, i, T, C, hs)] += scale * dscore[s] * qkv[qkv_at(b, s, 1, h, i, T, C, hs)];
            dqkv[qkv_at(b, s, 1, h, i, T, C, hs)] += scale * dscore[s] * qkv[qkv_at(b, t, 0, h, i, T, C, hs)];
          }
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
    losses[n] = maxval + std::log(sum) - row[targets[n]];
    for (int v = 0; v < V; v++) row[v] = std::exp(row[v] - maxval) / sum;
  }
}

void softmax_crossentropy_backward(double* probs_to_dlogits, const int* targets, double dloss, int N, int V) {
  for (int n = 0; n < N; n++)
    for (int v = 0; v < V; v++) {
      double& p = probs_to_dlogits[static_cast<size_t>(n) * V + v];
      p = (p - (v == targets[n] ? 1.0 : 0.0)) * dloss;
    }
}

}  // namespace shardtrain::reference
