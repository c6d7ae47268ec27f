// The GPT-2 layer math on the CPU: OpenBLAS GEMMs plus OpenMP loops, templated on the element
// type and instantiated for float (training) and double (finite-difference gradient checks).
//
// Shapes follow llm.c: B batch, T time, C channels, OC output channels, NH heads, V vocabulary,
// N = B*T rows. Linear weights are (OC, C) row-major, out = inp @ weight^T + bias.
// Argument order: <op>_forward(outputs..., saved..., inputs..., params..., dims) and
// <op>_backward(d_inputs..., d_params..., d_out, inputs..., params..., saved..., dims).
// Accumulation rule: parameter gradients are ACCUMULATED (+=), so one buffer can collect the
// contributions of tied uses and of several micro-batches; activation gradients are WRITTEN (=),
// except layernorm_backward's dinp, which is accumulated because it adds onto the residual stream.
// Every loop has a fixed schedule and no atomics: same inputs and threads give the same bits.
#pragma once

#include <cstddef>

namespace shardtrain::cpu {

// out(B,T,C) = wte[tokens[b,t]] + wpe[t]
template <typename Real>
void encoder_forward(Real* out, const int* tokens, const Real* wte, const Real* wpe, int B, int T, int C);
// dwte(V,C) += scatter of dout by token; dwpe(maxT,C) += dout summed over batch.
template <typename Real>
void encoder_backward(Real* dwte, Real* dwpe, const Real* dout, const int* tokens, int B, int T, int C);

// out(N,C) = (inp - mean) * rstd * weight + bias, eps 1e-5; saves mean(N), rstd(N).
template <typename Real>
void layernorm_forward(Real* out, Real* mean, Real* rstd, const Real* inp, const Real* weight, const Real* bias,
                       int N, int C);
// dinp(N,C) +=, dweight(C) +=, dbias(C) +=.
template <typename Real>
void layernorm_backward(Real* dinp, Real* dweight, Real* dbias, const Real* dout, const Real* inp,
                        const Real* weight, const Real* mean, const Real* rstd, int N, int C);

// out(N,OC) = inp(N,C) @ weight(OC,C)^T + bias(OC); bias may be null.
template <typename Real>
void matmul_forward(Real* out, const Real* inp, const Real* weight, const Real* bias, int N, int C, int OC);
// dinp(N,C) = dout @ weight (skipped if dinp is null); dweight(OC,C) += dout^T @ inp;
// dbias(OC) += column sums of dout (skipped if null).
template <typename Real>
void matmul_backward(Real* dinp, Real* dweight, Real* dbias, const Real* dout, const Real* inp,
                     const Real* weight, int N, int C, int OC);

// Causal self-attention. qkv(B,T,3C) holds q|k|v, each (NH heads x C/NH); out(B,T,C);
// att(B,NH,T,T) saves the softmax probabilities (zero above the diagonal). Scale 1/sqrt(C/NH).
template <typename Real>
void attention_forward(Real* out, Real* att, const Real* qkv, int B, int T, int C, int NH);
// dqkv(B,T,3C) = gradient w.r.t. qkv. scratch: (B,NH,T,T) elements of workspace.
template <typename Real>
void attention_backward(Real* dqkv, Real* scratch, const Real* dout, const Real* qkv, const Real* att, int B,
                        int T, int C, int NH);

// out = gelu(inp), n elements (tanh approximation, backend/math.hpp).
template <typename Real>
void gelu_forward(Real* out, const Real* inp, size_t n);
// dinp = dout * gelu'(inp).
template <typename Real>
void gelu_backward(Real* dinp, const Real* dout, const Real* inp, size_t n);

// out = a + b, n elements (the residual stream).
template <typename Real>
void residual_forward(Real* out, const Real* a, const Real* b, size_t n);

// In place: logits(N,V) become softmax probabilities; losses(N) = -log prob[target].
template <typename Real>
void softmax_crossentropy_forward(Real* losses, Real* logits_to_probs, const int* targets, int N, int V);
// In place: probs(N,V) become dlogits = (probs - onehot(target)) * dloss, the same dloss for
// every row (the loss is a mean over all tokens of the global batch).
template <typename Real>
void softmax_crossentropy_backward(Real* probs_to_dlogits, const int* targets, Real dloss, int N, int V);

}  // namespace shardtrain::cpu
