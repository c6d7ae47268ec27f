// The test oracle for the GPT-2 and Llama layer ops of backend/cpu/ops.hpp: obvious, naive loops in
// double precision, written from the math (no BLAS, no OpenMP, no shared code with src/backend/), so
// a bug in the fast ops cannot hide in the reference. Not for training: it is slow on purpose.
//
// Shapes, argument order and the accumulation rule are those of ops.hpp: parameter gradients are
// accumulated (+=), activation gradients are written (=), except layernorm_backward's and
// rmsnorm_backward's dinp, which are accumulated. GPT-2 numerics: LayerNorm eps 1e-5 with the
// biased (1/C) variance; tanh-GELU; loss = -log softmax(logits)[target]. Causal grouped-query
// attention with scale 1/sqrt(HS) over qkv rows [q (NH heads) | k (KV heads) | v (KV heads)] of HS
// each, query head h reading key/value head h / (NH/KV). Llama numerics: RMSNorm with a given eps;
// rotary embedding in Hugging Face's rotate_half layout (element i pairs with i + HS/2); SwiGLU
// silu(gate) * up with silu(x) = x sigmoid(x).
// The difference from ops.hpp: attention keeps the whole T x T probabilities (att), ops.hpp only
// each row's log-sum-exp.
#pragma once

#include <cstddef>

namespace shardtrain::reference {

// out(B,T,C) = wte[tokens[b,t]] + wpe[p], p = positions[b,t] (t when null); wpe may be null (no
// position table).
void encoder_forward(double* out, const int* tokens, const double* wte, const double* wpe, int B, int T, int C,
                     const int* positions = nullptr);
// dwte(V,C) += dout scattered by token; dwpe(T..,C) += dout scattered by position (skipped if null).
void encoder_backward(double* dwte, double* dwpe, const double* dout, const int* tokens, int B, int T, int C,
                      const int* positions = nullptr);

// out(N,C) = (inp - mean) * rstd * weight + bias, rstd = 1/sqrt(biased var + 1e-5); saves mean(N), rstd(N).
void layernorm_forward(double* out, double* mean, double* rstd, const double* inp, const double* weight,
                       const double* bias, int N, int C);
// dinp(N,C) +=, dweight(C) +=, dbias(C) +=; uses the given mean and rstd.
void layernorm_backward(double* dinp, double* dweight, double* dbias, const double* dout, const double* inp,
                        const double* weight, const double* mean, const double* rstd, int N, int C);

// out(N,C) = inp * rstd * weight, rstd = 1/sqrt(mean_c(inp^2) + eps); saves rstd(N).
void rmsnorm_forward(double* out, double* rstd, const double* inp, const double* weight, double eps, int N, int C);
// dinp(N,C) +=, dweight(C) +=; uses the given rstd.
void rmsnorm_backward(double* dinp, double* dweight, const double* dout, const double* inp, const double* weight,
                      const double* rstd, int N, int C);

// out(N,OC) = inp(N,C) @ weight(OC,C)^T + bias(OC); bias may be null.
void matmul_forward(double* out, const double* inp, const double* weight, const double* bias, int N, int C, int OC);
// dinp(N,C) = dout @ weight (skipped if null); dweight(OC,C) += dout^T @ inp; dbias(OC) += sum_n dout
// (skipped if null).
void matmul_backward(double* dinp, double* dweight, double* dbias, const double* dout, const double* inp,
                     const double* weight, int N, int C, int OC);

// qkv(B,T,(NH+2KV)*HS); out(B,T,NH*HS), att(B,NH,T,T) softmax probabilities, exactly 0 above the diagonal
// (the naive materialised form, unlike ops.hpp's); lse(B,NH,T) each row's log sum_{s<=t} exp(score)
// (skipped if null).
void attention_forward(double* out, double* att, double* lse, const double* qkv, int B, int T, int NH, int KV,
                       int HS);
// dqkv(B,T,(NH+2KV)*HS) = gradient w.r.t. qkv (written), given the saved att.
void attention_backward(double* dqkv, const double* dout, const double* qkv, const double* att, int B, int T, int NH,
                        int KV, int HS);

// The rotary tables (T, HS/2): angle[t][i] = t * theta^(-2i/HS), cos and sin of it.
void rope_tables(double* cos, double* sin, int T, int HS, double theta);
// In place on the q and k heads of qkv(B,T,(NH+2KV)*HS), v untouched: each head vector x at position
// t becomes x * cat(cos[t], cos[t]) + rotate_half(x) * cat(sin[t], sin[t]), rotate_half(x) = cat(-x2, x1).
// positions[b,t], if given, replace t.
void rope_forward(double* qkv, const double* cos, const double* sin, int B, int T, int NH, int KV, int HS,
                  const int* positions = nullptr);
// In place on dqkv: the transpose of rope_forward's linear map, formed column by column by applying
// rope_forward to unit vectors (so it shares no formula with the forward), then multiplied out.
void rope_backward(double* dqkv, const double* cos, const double* sin, int B, int T, int NH, int KV, int HS,
                   const int* positions = nullptr);

// out(N,I) = silu(gate) * up over rows gate_up(N,2I) = [gate (I) | up (I)]; silu(x) = x sigmoid(x).
void swiglu_forward(double* out, const double* gate_up, int N, int I);
// dgate_up(N,2I) = gradient w.r.t. gate_up (written).
void swiglu_backward(double* dgate_up, const double* dout, const double* gate_up, int N, int I);

// out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), n elements.
void gelu_forward(double* out, const double* inp, size_t n);
// dinp = dout * gelu'(inp).
void gelu_backward(double* dinp, const double* dout, const double* inp, size_t n);

// out = a + b.
void residual_forward(double* out, const double* a, const double* b, size_t n);

// In place: logits(N,V) -> softmax probabilities; losses(N) = -log prob[target].
void softmax_crossentropy_forward(double* losses, double* logits_to_probs, const int* targets, int N, int V);
// In place: probs(N,V) -> (probs - onehot(target)) * dloss.
void softmax_crossentropy_backward(double* probs_to_dlogits, const int* targets, double dloss, int N, int V);

}  // namespace shardtrain::reference
