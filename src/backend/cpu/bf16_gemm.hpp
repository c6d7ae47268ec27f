// The CPU's linear layers with bf16 operands and fp32 accumulation (fsdp.param_dtype=bf16): what
// the GPU's tensor cores compute, at twice the fp32 rate on CPUs with bf16 dot-product
// instructions (AVX512-BF16, AMX). The weights come rounded: the engine gathers them in bf16 and
// the layer ops pass that copy (LayerOps::bind_half_copy), so they are multiplied as they are,
// never rounded again. The activations are rounded once per layer (dout feeds both backward
// products from one copy), then multiplied by oneDNN's matmul. Where the CPU has no bf16 dot products oneDNN only emulates
// them, slower than its own fp32 SGEMM (docs/performance.md), so there the same products run as
// OpenBLAS SGEMMs on the bf16-rounded operands, widened back to fp32 a half of K at a time: the
// same arithmetic (products of bf16 values are exact in fp32), in the same workspace; a weight
// that comes rounded is then read in place.
//
// The workspace -- the activations' operand copies and oneDNN's scratchpad (user mode: ours, so
// counted) -- is sized for the model's layers at construction, exactly as plan_workspace_bytes
// predicts; a product beyond it (a generation prompt longer than the training rows, or a weight
// that comes unrounded) grows it, and workspace_bytes() says so.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/layer_ops.hpp"

namespace shardtrain::cpu {

using shardtrain::LinearShape;  // backend/layer_ops.hpp

class Bf16Gemm {
 public:
  // The workspace for these layers' products with `rows` input rows, allocated now. `onednn`:
  // oneDNN's bf16 kernels, or the SGEMMs on rounded operands (what runs where native_bf16() is
  // false; the tests take both on any CPU).
  Bf16Gemm(const std::vector<LinearShape>& layers, int rows, bool onednn = native_bf16());
  // The bytes that constructor allocates, on this CPU (oneDNN's scratchpad depends on its kernels).
  static size_t plan_workspace_bytes(const std::vector<LinearShape>& layers, int rows);
  ~Bf16Gemm();
  Bf16Gemm(const Bf16Gemm&) = delete;
  Bf16Gemm& operator=(const Bf16Gemm&) = delete;

  // The semantics of cpu::matmul_forward / matmul_backward (backend/cpu/ops.hpp), float only.
  // weight16, inp16: that operand's bf16 copy (the operand must equal its widening), multiplied
  // instead of rounding the operand; null: the operand is rounded here.
  void forward(float* out, const float* inp, const uint16_t* inp16, const float* weight, const uint16_t* weight16,
               const float* bias, int N, int C, int OC);
  void backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp, const uint16_t* inp16,
                const float* weight, const uint16_t* weight16, int N, int C, int OC);
  // Weight elements rounded here so far (weights that came without their copy): 0 in a run whose
  // weights the engine gathers in bf16.
  size_t weight_elements_rounded() const;

  // Bytes held now: the operand copies and oneDNN's scratchpad.
  size_t workspace_bytes() const;
  // For the start line: "oneDNN 2.6.3 bf16 (avx512_core_bf16)" or "OpenBLAS SGEMM on bf16-rounded
  // operands (this CPU has no bf16 dot products)".
  std::string describe() const;
  // Whether this instance multiplies with oneDNN's kernels (else SGEMMs on rounded operands).
  bool onednn() const;
  // Whether oneDNN's bf16 kernels run (the CPU has bf16 dot products and DNNL_MAX_CPU_ISA allows them).
  static bool native_bf16();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shardtrain::cpu

namespace shardtrain {
template <typename Real>
class LayerOps;
// The CPU's layer operations with the linear layers' products through `gemm` (which must outlive them).
std::unique_ptr<LayerOps<float>> make_cpu_bf16_layer_ops(cpu::Bf16Gemm& gemm);
}  // namespace shardtrain
