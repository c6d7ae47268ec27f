// Linear layers and every other GEMM of the CUDA backend, through cuBLASLt.
//
// Row-major to column-major: cuBLASLt is column-major, and a row-major (R,C) matrix with leading
// dimension ld is the column-major (C,R) matrix with the same ld. So row-major C = op(A) op(B) is
// column-major C^T = op(B)^T op(A)^T: gemm_row_major() calls the column-major GEMM with A and B
// swapped, M and N swapped and the transpose flags kept. Callers then write exactly the calls of
// backend/cpu/gemm.hpp's gemm(): matmul and attention read like their CPU versions.
//
// Precision: fp32 operands, fp32 output, CUBLAS_COMPUTE_32F (true fp32 FMAs, no TF32) so that the
// GPU matches the CPU to fp32 reassociation error. With GemmContext::operands bf16 or fp16 (the
// GPU's meaning of fsdp.param_dtype) the fp32 operands are rounded to it first, as torch.autocast
// does, and the tensor cores multiply them with fp32 accumulation and output: the activations and
// every non-GEMM op stay fp32. An operand whose 16-bit copy the caller passes (a weight of the
// engine's gathered unit, or an activation saved in 16 bits, bound to the ops:
// LayerOps::bind_half_copy) is not rounded again: the copy is multiplied, the same bits.
// The rounded copies live in GemmContext::operand_scratch (the ops object's buffer from the
// caching allocator, so the memory is counted and reused). Should
// cuBLASLt have no 16-bit kernel for a shape and alignment, that GEMM runs in fp32 instead, with
// one warning.
//
// Alignment: cuBLASLt's heuristic assumes 256-byte aligned operands unless told otherwise, and a
// kernel picked under that assumption fails or misreads on less aligned pointers (views into flat
// buffers, test buffers with guard zones). Every call passes the true alignment of A, B, C and D
// (of the base pointer and of every batch stride) as the minimum-alignment preferences. The bias
// epilogue is used only for a 16-byte aligned bias (the epilogue kernels need it); otherwise the
// bias is written into C first and the GEMM accumulates onto it with beta = 1, as the CPU does.
// The heuristic's choice is a function of shapes and alignments, so a run with the same buffers
// gets the same kernels and the same bits.
//
// launch_gemm (LayerOps::gemm, the adapters' small products) is gemm_row_major's fp32 path with
// cblas's contract: any alpha and beta, K = 0 as C = beta C, and always fp32 operands
// (GemmContext::operands is ignored), so that adapters match the CPU to fp32 reassociation.
//
// The backward's bias gradient is a deterministic two-stage column sum (common.cuh), no atomics.
#include <algorithm>
#include <tuple>
#include <unordered_map>

#include "common.cuh"
#include "core/random.hpp"

namespace shardtrain::kernels {
namespace {

// Largest power of two up to 256 dividing the address and every batch offset in bytes.
uint32_t alignment_bytes(const void* p, long long stride_bytes) {
  const uintptr_t bits = reinterpret_cast<uintptr_t>(p) | static_cast<uintptr_t>(stride_bytes) | uintptr_t{256};
  return static_cast<uint32_t>(bits & (~bits + 1));  // lowest set bit
}

template <typename T>
void set_desc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute, const T& value) {
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, attribute, &value, sizeof value));
}
template <typename T>
void set_layout(cublasLtMatrixLayout_t layout, cublasLtMatrixLayoutAttribute_t attribute, const T& value) {
  CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout, attribute, &value, sizeof value));
}
template <typename T>
void set_preference(cublasLtMatmulPreference_t preference, cublasLtMatmulPreferenceAttributes_t attribute,
                    const T& value) {
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, attribute, &value, sizeof value));
}

// A (rows x cols) column-major layout with leading dimension ld, `batch` matrices `stride` apart.
cublasLtMatrixLayout_t make_layout(cudaDataType_t type, int rows, int cols, int ld, long long stride, int batch) {
  cublasLtMatrixLayout_t layout = nullptr;
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&layout, type, static_cast<uint64_t>(rows), static_cast<uint64_t>(cols),
                                          static_cast<int64_t>(ld)));
  if (batch > 1) {
    set_layout(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, static_cast<int32_t>(batch));
    set_layout(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, static_cast<int64_t>(stride));
  }
  return layout;
}

size_t type_bytes(cudaDataType_t type) { return type == CUDA_R_32F ? 4 : 2; }

}  // namespace

// What makes two GEMMs the same plan. Pointers enter only through their alignments, and the bias
// pointer through its presence (it is set on the descriptor per call). Compared and hashed field
// by field, never as bytes: padding between the fields holds no defined value.
struct GemmKey {
  bool trans_a = false, trans_b = false, bias = false;
  int m = 0, n = 0, k = 0, lda = 0, ldb = 0, ldc = 0, batch = 0;
  long long stride_a = 0, stride_b = 0, stride_c = 0;
  cudaDataType_t a_type = CUDA_R_32F, b_type = CUDA_R_32F;
  uint32_t align_a = 0, align_b = 0, align_c = 0;
  size_t workspace_bytes = 0;
  auto fields() const {
    return std::tie(trans_a, trans_b, bias, m, n, k, lda, ldb, ldc, batch, stride_a, stride_b, stride_c, a_type,
                    b_type, align_a, align_b, align_c, workspace_bytes);
  }
  bool operator==(const GemmKey& o) const { return fields() == o.fields(); }
};
struct GemmKeyHash {
  size_t operator()(const GemmKey& key) const {  // each field's value mixed into the hash in turn
    uint64_t h = 0;
    std::apply([&h](const auto&... field) { ((h = mix64(h ^ static_cast<uint64_t>(field))), ...); }, key.fields());
    return static_cast<size_t>(h);
  }
};
struct GemmPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool found = false;
};
struct GemmPlanCache {
  std::unordered_map<GemmKey, GemmPlan, GemmKeyHash> plans;
  bool warned_fp32_fallback = false;  // said once per ops object, not once per process
};

void GemmPlanCacheDeleter::operator()(GemmPlanCache* cache) const {
  for (auto& entry : cache->plans) {  // best effort, as every teardown of the backend
    (void)cublasLtMatrixLayoutDestroy(entry.second.c);
    (void)cublasLtMatrixLayoutDestroy(entry.second.b);
    (void)cublasLtMatrixLayoutDestroy(entry.second.a);
    (void)cublasLtMatmulDescDestroy(entry.second.desc);
  }
  delete cache;
}

std::unique_ptr<GemmPlanCache, GemmPlanCacheDeleter> make_gemm_plan_cache() {
  return std::unique_ptr<GemmPlanCache, GemmPlanCacheDeleter>(new GemmPlanCache);
}

namespace {

// Column-major D = alpha op(A) op(B) + beta C (+ bias per row of D) with D == C: the one place that
// talks to cuBLASLt. op(A) is (m,k), op(B) is (k,n), C is (m,n). Returns false only when
// cuBLASLt has no kernel for the combination (the caller may retry differently).
bool try_gemm_col_major(const GemmContext& ctx, bool trans_a, bool trans_b, int m, int n, int k, float alpha,
                        const void* A, cudaDataType_t a_type, int lda, long long stride_a, const void* B,
                        cudaDataType_t b_type, int ldb, long long stride_b, float beta, float* C, int ldc,
                        long long stride_c, int batch, const float* bias) {
  const long long batch_a = batch > 1 ? stride_a * static_cast<long long>(type_bytes(a_type)) : 0;
  const long long batch_b = batch > 1 ? stride_b * static_cast<long long>(type_bytes(b_type)) : 0;
  const long long batch_c = batch > 1 ? stride_c * 4LL : 0;
  GemmKey key;
  key.trans_a = trans_a, key.trans_b = trans_b, key.bias = bias != nullptr;
  key.m = m, key.n = n, key.k = k, key.lda = lda, key.ldb = ldb, key.ldc = ldc, key.batch = batch;
  key.stride_a = batch > 1 ? stride_a : 0, key.stride_b = batch > 1 ? stride_b : 0;
  key.stride_c = batch > 1 ? stride_c : 0;
  key.a_type = a_type, key.b_type = b_type;
  key.align_a = alignment_bytes(A, batch_a), key.align_b = alignment_bytes(B, batch_b);
  key.align_c = alignment_bytes(C, batch_c);
  key.workspace_bytes = ctx.workspace_bytes;

  GemmPlan fresh;
  GemmPlan* plan = &fresh;
  bool cached = false;
  if (ctx.plans) {
    auto it = ctx.plans->plans.find(key);
    cached = it != ctx.plans->plans.end();
    if (cached) plan = &it->second;
  }
  if (!cached) {
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    set_desc(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, static_cast<int32_t>(trans_a ? CUBLAS_OP_T : CUBLAS_OP_N));
    set_desc(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, static_cast<int32_t>(trans_b ? CUBLAS_OP_T : CUBLAS_OP_N));
    if (bias) set_desc(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, static_cast<uint32_t>(CUBLASLT_EPILOGUE_BIAS));
    // Stored shapes: op(A) = A^T means A is stored (k,m).
    plan->a = make_layout(a_type, trans_a ? k : m, trans_a ? m : k, lda, stride_a, batch);
    plan->b = make_layout(b_type, trans_b ? n : k, trans_b ? k : n, ldb, stride_b, batch);
    plan->c = make_layout(CUDA_R_32F, m, n, ldc, stride_c, batch);
    if (bias) set_desc(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(bias));

    cublasLtMatmulPreference_t preference = nullptr;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&preference));
    set_preference(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<uint64_t>(ctx.workspace_bytes));
    set_preference(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_a);
    set_preference(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_b);
    set_preference(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_c);
    set_preference(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_c);
    cublasLtMatmulHeuristicResult_t heuristic{};
    int found = 0;
    const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(ctx.handle, plan->desc, plan->a, plan->b, plan->c,
                                                                 plan->c, preference, 1, &heuristic, &found);
    if (status != CUBLAS_STATUS_SUCCESS && status != CUBLAS_STATUS_NOT_SUPPORTED) CUBLAS_CHECK(status);
    CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(preference));
    plan->found = status == CUBLAS_STATUS_SUCCESS && found > 0;
    plan->algo = heuristic.algo;
    if (ctx.plans) plan = &ctx.plans->plans.emplace(key, fresh).first->second;
  } else if (bias) {
    set_desc(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(bias));
  }
  const bool ok = plan->found;
  if (ok)
    CUBLAS_CHECK(cublasLtMatmul(ctx.handle, plan->desc, &alpha, A, plan->a, B, plan->b, &beta, C, plan->c, C, plan->c,
                                &plan->algo, ctx.workspace, ctx.workspace_bytes, ctx.launch.stream));
  if (!ctx.plans) {  // no cache: this call's plan dies with it
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(fresh.c));
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(fresh.b));
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(fresh.a));
    CUBLAS_CHECK(cublasLtMatmulDescDestroy(fresh.desc));
  }
  return ok;
}

// out(rows, cols) row-major, every row = bias(cols).
__global__ void fill_rows_kernel(float* out, const float* bias, int cols, int ld, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t r = i / cols;
    const int c = static_cast<int>(i % cols);
    out[r * ld + c] = bias[c];
  }
}

// C(M,N) = bias in every row: the bias term of a GEMM that then accumulates with beta = 1, as
// the CPU does, where the bias epilogue cannot be used.
void fill_bias_rows(float* C, const float* bias, int M, int N, int ldc, const LaunchContext& ctx) {
  const size_t n = static_cast<size_t>(M) * N;
  fill_rows_kernel<<<grid_for(n, 256, ctx), 256, 0, ctx.stream>>>(C, bias, N, ldc, n);
  CUDA_CHECK_LAUNCH();
}

struct BiasTerm {
  const float* dout;
  int OC;
  __device__ void operator()(int n, int c, float* t) const { t[0] = dout[static_cast<size_t>(n) * OC + c]; }
};

void check_gemm_args(int M, int N, int K, int batch) {
  SHARD_CHECK(M >= 0 && N >= 0 && K >= 0 && batch >= 1, "gemm: M=%d N=%d K=%d batch=%d", M, N, K, batch);
}

[[noreturn]] void no_gemm_kernel(bool trans_a, bool trans_b, int M, int N, int K, const void* A, int lda,
                                 const void* B, int ldb, const void* C, int ldc, int batch, const char* types) {
  fatal_internal(__FILE__, __LINE__, __func__,
                 strprintf("cuBLASLt has no kernel for the %s row-major GEMM %c%c M=%d N=%d K=%d batch=%d "
                           "(A %p lda %d, B %p ldb %d, C %p ldc %d)",
                           types, trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', M, N, K, batch, A, lda, B, ldb, C, ldc));
}

// Elements from a row-major operand's first to its last, all batches: rows x cols stored with
// leading dimension ld, `batch` matrices `stride` apart.
size_t operand_extent(int rows, int cols, int ld, long long stride, int batch) {
  return static_cast<size_t>(batch - 1) * static_cast<size_t>(stride) + static_cast<size_t>(rows - 1) * ld + cols;
}

// C = alpha op(A) op(B) + beta C with A and B rounded to ctx.operands first (the bias, if any,
// already in C with beta = 1); A16 or B16 non-null: that operand's copy in that type already (a
// bound weight or activation), used as it is. Returns false when cuBLASLt has no kernel for it.
bool try_gemm_rounded(const GemmContext& ctx, bool trans_a, bool trans_b, int M, int N, int K, float alpha,
                      const float* A, const uint16_t* A16, int lda, long long stride_a, const float* B,
                      const uint16_t* B16, int ldb, long long stride_b, float beta, float* C, int ldc,
                      long long stride_c, int batch) {
  const size_t na = A16 ? 0 : operand_extent(trans_a ? K : M, trans_a ? M : K, lda, stride_a, batch);
  const size_t nb = B16 ? 0 : operand_extent(trans_b ? N : K, trans_b ? K : N, ldb, stride_b, batch);
  const size_t bytes = gpu::gemm_operand_bytes(na, nb);  // what the carver below cuts: a, then b
  // Both operands bound: nothing to round, and no zero-byte allocation to make.
  void* base = bytes > 0 && ctx.operand_scratch ? ctx.operand_scratch(bytes) : nullptr;
  const bool pooled = bytes > 0 && base == nullptr;
  if (pooled) CUDA_CHECK(cudaMallocAsync(&base, bytes, ctx.launch.stream));
  WorkspaceCarver carver(base);
  uint16_t* a_copy = carver.take<uint16_t>(na);
  uint16_t* b_copy = carver.take<uint16_t>(nb);
  if (!A16) launch_to_half(a_copy, A, na, ctx.operands, ctx.launch);
  if (!B16) launch_to_half(b_copy, B, nb, ctx.operands, ctx.launch);
  const uint16_t* a = A16 ? A16 : a_copy;
  const uint16_t* b = B16 ? B16 : b_copy;
  const cudaDataType_t type = ctx.operands == DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_16F;
  const bool ok = try_gemm_col_major(ctx, trans_b, trans_a, N, M, K, alpha, b, type, ldb, stride_b, a, type, lda,
                                     stride_a, beta, C, ldc, stride_c, batch, nullptr);
  if (pooled) CUDA_CHECK(cudaFreeAsync(base, ctx.launch.stream));
  return ok;
}

}  // namespace

void gemm_row_major(const GemmContext& ctx, bool trans_a, bool trans_b, int M, int N, int K, float alpha,
                    const float* A, int lda, long long stride_a, const float* B, int ldb, long long stride_b, float beta,
                    float* C, int ldc, long long stride_c, int batch, const float* bias, const uint16_t* A16,
                    const uint16_t* B16) {
  check_gemm_args(M, N, K, batch);
  SHARD_CHECK(!bias || (beta == 0.0f && batch == 1), "gemm: a bias needs beta = 0 and batch = 1");
  if (M == 0 || N == 0 || (K == 0 && beta == 1.0f && !bias)) return;  // nothing to compute, or C += 0
  SHARD_CHECK(K > 0, "gemm: K = 0 is supported only as C += 0 (beta = 1, no bias)");
  // fp32 with a 16-byte aligned bias: cuBLASLt's bias epilogue, when it has a kernel for it.
  if (ctx.operands == DTYPE_FP32 && bias && aligned16(bias) &&
      try_gemm_col_major(ctx, trans_b, trans_a, N, M, K, alpha, B, CUDA_R_32F, ldb, stride_b, A, CUDA_R_32F, lda,
                         stride_a, beta, C, ldc, stride_c, batch, bias))
    return;
  if (bias) {  // C = bias in every row, then C = A B + C
    fill_bias_rows(C, bias, M, N, ldc, ctx.launch);
    beta = 1.0f;
  }
  if (ctx.operands != DTYPE_FP32) {
    if (try_gemm_rounded(ctx, trans_a, trans_b, M, N, K, alpha, A, A16, lda, stride_a, B, B16, ldb, stride_b, beta,
                         C, ldc, stride_c, batch))
      return;
    // A shape or alignment without a 16-bit kernel: exact fp32 instead, said once per plan cache.
    if (!ctx.plans || !ctx.plans->warned_fp32_fallback)
      std::fprintf(stderr, "warning: cuBLASLt has no %s kernel for a %c%c GEMM M=%d N=%d K=%d batch=%d; such GEMMs "
                   "run in fp32\n", dtype_name(ctx.operands), trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', M, N, K, batch);
    if (ctx.plans) ctx.plans->warned_fp32_fallback = true;
  }
  // A bound 16-bit copy is the operand: widened into a temporary, as its fp32 values may have no
  // memory behind them (a quantized base dequantized into the copy alone, FsdpEngine).
  float* widened = nullptr;
  if (ctx.operands != DTYPE_FP32 && (A16 || B16)) {
    const size_t na = A16 ? operand_extent(trans_a ? K : M, trans_a ? M : K, lda, stride_a, batch) : 0;
    const size_t nb = B16 ? operand_extent(trans_b ? N : K, trans_b ? K : N, ldb, stride_b, batch) : 0;
    CUDA_CHECK(cudaMallocAsync(&widened, (na + nb) * sizeof(float), ctx.launch.stream));
    if (A16) launch_from_half(widened, A16, na, ctx.operands, ctx.launch), A = widened;
    if (B16) launch_from_half(widened + na, B16, nb, ctx.operands, ctx.launch), B = widened + na;
  }
  const bool ok = try_gemm_col_major(ctx, trans_b, trans_a, N, M, K, alpha, B, CUDA_R_32F, ldb, stride_b, A,
                                     CUDA_R_32F, lda, stride_a, beta, C, ldc, stride_c, batch, nullptr);
  if (widened) CUDA_CHECK(cudaFreeAsync(widened, ctx.launch.stream));
  if (!ok) no_gemm_kernel(trans_a, trans_b, M, N, K, A, lda, B, ldb, C, ldc, batch, "fp32");
}

namespace {

// Row-major C(M,N) with leading dimension ld: C = beta * C, and beta = 0 writes 0 whatever C held
// (NaN included): cblas's result for K = 0.
__global__ void scale_rows_kernel(float* C, float beta, int cols, int ld, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float& c = C[(i / cols) * ld + i % cols];
    c = beta == 0.0f ? 0.0f : beta * c;
  }
}

}  // namespace

void launch_gemm(const GemmContext& ctx, bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A,
                 int lda, const float* B, int ldb, float beta, float* C, int ldc) {
  check_gemm_args(M, N, K, 1);
  // cblas's rule: each leading dimension at least the stored row length (and at least 1).
  SHARD_CHECK(lda >= std::max(1, trans_a ? M : K) && ldb >= std::max(1, trans_b ? K : N) && ldc >= std::max(1, N),
              "gemm %c%c M=%d N=%d K=%d: leading dimensions lda=%d ldb=%d ldc=%d shorter than their rows",
              trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', M, N, K, lda, ldb, ldc);
  if (M == 0 || N == 0) return;
  if (K == 0) {  // no product term: C = beta C, as cblas, with no GEMM; A and B unread
    if (beta != 1.0f) {
      const size_t n = static_cast<size_t>(M) * N;
      scale_rows_kernel<<<grid_for(n, 256, ctx.launch), 256, 0, ctx.launch.stream>>>(C, beta, N, ldc, n);
      CUDA_CHECK_LAUNCH();
    }
    return;
  }
  // fp32 operands whatever ctx.operands says: the gemm_row_major fp32 path, without its rounding.
  if (!try_gemm_col_major(ctx, trans_b, trans_a, N, M, K, alpha, B, CUDA_R_32F, ldb, 0, A, CUDA_R_32F, lda, 0, beta, C,
                          ldc, 0, 1, nullptr))
    no_gemm_kernel(trans_a, trans_b, M, N, K, A, lda, B, ldb, C, ldc, 1, "fp32");
}

void launch_matmul_forward(float* out, const float* inp, const uint16_t* inp16, const float* weight,
                           const uint16_t* weight16, const float* bias, int N, int C, int OC, const GemmContext& ctx) {
  SHARD_CHECK(N >= 0 && C >= 0 && OC >= 0, "matmul_forward: N=%d C=%d OC=%d", N, C, OC);
  // out(N,OC) = inp(N,C) @ weight(OC,C)^T + bias(OC)
  gemm_row_major(ctx, false, true, N, OC, C, 1.0f, inp, C, 0, weight, C, 0, 0.0f, out, OC, 0, 1, bias, inp16,
                 weight16);
}

namespace {

// The two backward products with 16-bit operands, each operand rounded once (dout feeds both; for
// the tied head it is N x V, the largest tensor of the step) and the weight or the input not at
// all when its copy comes bound (bound_weight16, bound_inp16). dout's copy keeps its rows
// gemm_padded_row(OC) apart, 16-byte aligned whatever OC: with GPT-2's 50257 logits per row the
// copy as it was ran the head's backward at 131 TFLOP/s on an H200. A null dinp or dweight skips
// its product and the rounding of the operand only it reads. False when cuBLASLt lacks a kernel.
bool try_matmul_backward_rounded(float* dinp, float* dweight, const float* dout, const float* inp,
                                 const uint16_t* bound_inp16, const float* weight, const uint16_t* bound_weight16,
                                 int N, int C, int OC, const GemmContext& ctx) {
  const int ld_dout = gpu::gemm_padded_row(OC);
  const size_t n_dout = static_cast<size_t>(N) * ld_dout;
  const size_t n_weight = bound_weight16 ? 0 : static_cast<size_t>(OC) * C;
  const size_t n_inp = bound_inp16 ? 0 : static_cast<size_t>(N) * C;
  // gpu_memory.hpp sizes what the carver cuts, in this order: dout, weight (unless bound), inp. A
  // bound input, last, leaves its tail of the request unused: an upper bound, as the plan counts it.
  WorkspaceCarver carver(ctx.operand_scratch(gpu::matmul_backward_operand_bytes(N, C, OC, !bound_weight16)));
  uint16_t* dout16 = carver.take<uint16_t>(n_dout);
  uint16_t* weight_copy = carver.take<uint16_t>(n_weight);
  uint16_t* inp_copy = carver.take<uint16_t>(n_inp);
  launch_to_half_rows(dout16, ld_dout, dout, N, OC, ctx.operands, ctx.launch);
  if (dinp && !bound_weight16) launch_to_half(weight_copy, weight, n_weight, ctx.operands, ctx.launch);
  if (dweight && !bound_inp16) launch_to_half(inp_copy, inp, n_inp, ctx.operands, ctx.launch);
  const uint16_t* weight16 = bound_weight16 ? bound_weight16 : weight_copy;
  const uint16_t* inp16 = bound_inp16 ? bound_inp16 : inp_copy;
  const cudaDataType_t type = ctx.operands == DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_16F;
  // As gemm_row_major maps them: row-major dinp(N,C) = dout(N,OC) @ weight(OC,C), and
  // dweight(OC,C) += dout^T @ inp(N,C), as column-major products with A and B swapped.
  if (dinp && !try_gemm_col_major(ctx, false, false, C, N, OC, 1.0f, weight16, type, C, 0, dout16, type, ld_dout, 0,
                                  0.0f, dinp, C, 0, 1, nullptr))
    return false;
  return !dweight || try_gemm_col_major(ctx, false, true, C, OC, N, 1.0f, inp16, type, C, 0, dout16, type, ld_dout, 0,
                                        1.0f, dweight, C, 0, 1, nullptr);
}

}  // namespace

void launch_matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                            const uint16_t* inp16, const float* weight, const uint16_t* weight16, int N, int C, int OC,
                            void* workspace, const GemmContext& ctx) {
  SHARD_CHECK(N >= 0 && C >= 0 && OC >= 0, "matmul_backward: N=%d C=%d OC=%d", N, C, OC);
  // Each of dinp, dweight, dbias may be null (no input gradient wanted; frozen weight or bias).
  const bool products = dinp || dweight;
  const bool rounded_once = products && ctx.operands != DTYPE_FP32 && ctx.operand_scratch && N > 0 && C > 0 &&
                            OC > 0 &&
                            try_matmul_backward_rounded(dinp, dweight, dout, inp, inp16, weight, weight16, N, C, OC,
                                                        ctx);
  if (products && !rounded_once) {  // fp32, or per-GEMM rounding (with its fp32 fallback)
    // dinp(N,C) = dout(N,OC) @ weight(OC,C)
    if (dinp)
      gemm_row_major(ctx, false, false, N, C, OC, 1.0f, dout, OC, 0, weight, C, 0, 0.0f, dinp, C, 0, 1, nullptr,
                     nullptr, weight16);
    // dweight(OC,C) += dout^T @ inp(N,C)
    if (dweight)
      gemm_row_major(ctx, true, false, OC, C, N, 1.0f, dout, OC, 0, inp, C, 0, 1.0f, dweight, C, 0, 1, nullptr,
                     nullptr, inp16);
  }
  // dbias(OC) += column sums of dout (its workspace: matmul_backward_workspace_bytes, only with a dbias)
  if (dbias)
    column_sums_accumulate<1>(ColumnTargets{{dbias, nullptr}}, static_cast<float*>(workspace), N, OC,
                              BiasTerm{dout, OC}, ctx.launch);
}

}  // namespace shardtrain::kernels
