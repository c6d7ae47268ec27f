// cuDNN SDPA through the backend graph API (cudnn_graph.h): the operation graphs are the
// composite flash-attention patterns cuDNN's fused attention engines recognise (cuDNN's Graph API
// guide, "Flash Fused Attention"), written out here operation by operation:
//
// forward   S = scale (Q K^T); S = S + bias (packed documents only: a (B,1,T,T) bf16 tensor, 0
//           within each query's document, -inf before it); S = causal(S) (row index >= column
//           index, else -inf; a diffusion transformer's joint attention leaves S unmasked);
//           M = rowmax S; E = exp(S - M); L = rowsum E; Stats = M + log L; O = (E / L) V
// backward  D = rowsum(dO * O); P = exp(causal(scale (Q K^T) [+ bias] - Stats)); dV = P^T dO;
//           dS = scale P (dO V^T - D); dK = dS^T Q; dQ = dS K
//
// with Q (B,NH,T,HS), K and V (B,KV,T,HS) as strided views of the bf16 qkv rows (query head h
// reads key/value head h / (NH/KV): the products broadcast the KV heads; dK and dV sum the group
// by a reduction from NH to KV heads). Stats is M + log L in natural log: the lse of the CPU.
// The backward's dQ is one product per query tile (no fp32 accumulator that cuDNN would add into
// with atomics): the deterministic form.
#include "backend/cuda/cudnn_attention.hpp"

#include <cudnn.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <limits>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "backend/cuda/cuda_handles.hpp"
#include "backend/gpu_memory.hpp"
#include "core/error.hpp"
#include "kernels/cuda_check.hpp"
#include "kernels/launch.hpp"

// The operation graph and the execution plan still take the handle (CUDNN_ATTR_*_HANDLE), which
// cuDNN 9 marks deprecated in favour of device-property descriptors meant for building plans
// without a GPU; we build on the GPU that runs them.
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

#define CUDNN_CHECK(call)                                                                           \
  do {                                                                                              \
    cudnnStatus_t cudnn_check_rc_ = (call);                                                         \
    if (cudnn_check_rc_ != CUDNN_STATUS_SUCCESS)                                                    \
      ::shardtrain::fatal_internal(__FILE__, __LINE__, __func__,                                    \
                                   ::shardtrain::strprintf("%s: %s (%s)", #call, cudnnGetErrorString(cudnn_check_rc_), \
                                                           last_cudnn_message().c_str()));          \
  } while (0)

namespace shardtrain {
namespace {

std::string last_cudnn_message() {
  char message[1024] = "";
  cudnnGetLastErrorString(message, sizeof(message));
  return message;
}

// A graph that cuDNN will not build or has no engine for: the shape falls back to the tiled kernels.
struct Unsupported : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Building steps: any failure means "cuDNN cannot run this graph here" (its reason kept).
void build_step(cudnnStatus_t status, const char* what) {
  if (status != CUDNN_STATUS_SUCCESS)
    throw Unsupported(strprintf("%s: %s (%s)", what, cudnnGetErrorString(status), last_cudnn_message().c_str()));
}

// One backend descriptor, destroyed with its owner.
class Descriptor {
 public:
  explicit Descriptor(cudnnBackendDescriptorType_t type) { build_step(cudnnBackendCreateDescriptor(type, &d_), "create"); }
  ~Descriptor() {
    if (d_) cudnnBackendDestroyDescriptor(d_);
  }
  Descriptor(Descriptor&& o) noexcept : d_(std::exchange(o.d_, nullptr)) {}
  Descriptor(const Descriptor&) = delete;
  Descriptor& operator=(const Descriptor&) = delete;
  Descriptor& operator=(Descriptor&&) = delete;
  cudnnBackendDescriptor_t get() const { return d_; }

  template <typename T>
  Descriptor& set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, const T* values, int64_t n = 1) {
    build_step(cudnnBackendSetAttribute(d_, name, type, n, values), "set attribute");
    return *this;
  }
  Descriptor& set(cudnnBackendAttributeName_t name, cudnnBackendDescriptor_t value) {
    return set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, &value);
  }
  void finalize(const char* what) { build_step(cudnnBackendFinalize(d_), what); }

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
};

using Dims = std::array<int64_t, 4>;
Dims compact_strides(const Dims& d) { return {d[1] * d[2] * d[3], d[2] * d[3], d[3], 1}; }

// The tensors that live in memory (variant pack ids). Virtual tensors get ids from kFirstVirtual.
enum Uid : int64_t {
  UID_Q = 1, UID_K, UID_V, UID_O, UID_STATS, UID_DO, UID_DQ, UID_DK, UID_DV, UID_ROW_SUMS,  // device memory
  UID_BIAS,                                                                                 // packed documents
  UID_SCALE, UID_NEG_INF, UID_ONE,                                                          // host scalars
  kFirstVirtual = 100
};

// Builds one operation graph: its tensors and operations, kept alive with the plan.
class GraphBuilder {
 public:
  explicit GraphBuilder(cudnnHandle_t handle) : handle_(handle) {}

  cudnnBackendDescriptor_t tensor(int64_t uid, cudnnDataType_t type, const Dims& dims, const Dims& strides,
                                  bool by_value = false) {
    return make_tensor(uid, type, dims, strides, false, by_value);
  }
  cudnnBackendDescriptor_t scalar(int64_t uid) { return tensor(uid, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}, true); }
  cudnnBackendDescriptor_t virtual_tensor(cudnnDataType_t type, const Dims& dims, const Dims& strides) {
    return make_tensor(next_virtual_++, type, dims, strides, true, false);
  }
  cudnnBackendDescriptor_t virtual_tensor(cudnnDataType_t type, const Dims& dims) {
    return virtual_tensor(type, dims, compact_strides(dims));
  }

  void matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c) {
    Descriptor& desc = keep(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    const cudnnDataType_t fp32 = CUDNN_DATA_FLOAT;
    desc.set(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, &fp32).finalize("matmul descriptor");
    Descriptor& op = keep(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    op.set(CUDNN_ATTR_OPERATION_MATMUL_ADESC, a).set(CUDNN_ATTR_OPERATION_MATMUL_BDESC, b);
    op.set(CUDNN_ATTR_OPERATION_MATMUL_CDESC, c).set(CUDNN_ATTR_OPERATION_MATMUL_DESC, desc.get());
    add_operation(op, "matmul");
  }
  // y = mode(x [, b [, t]]) elementwise, computed in `precision`; axis for GEN_INDEX.
  void pointwise(cudnnPointwiseMode_t mode, cudnnBackendDescriptor_t y, cudnnBackendDescriptor_t x,
                 cudnnBackendDescriptor_t b = nullptr, cudnnBackendDescriptor_t t = nullptr,
                 cudnnDataType_t precision = CUDNN_DATA_FLOAT, int64_t axis = -1) {
    Descriptor& desc = keep(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    desc.set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, &mode);
    desc.set(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, &precision);
    if (axis >= 0) desc.set(CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, &axis);
    desc.finalize("pointwise descriptor");
    Descriptor& op = keep(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    op.set(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, desc.get()).set(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x);
    if (b) op.set(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b);
    if (t) op.set(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t);
    op.set(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y);
    add_operation(op, "pointwise");
  }
  // y = x with the dimensions the output descriptor gives the size-1 or grouped axes (row sums,
  // row maxima, and the sum over each group's query heads).
  void reduce(cudnnReduceTensorOp_t mode, cudnnBackendDescriptor_t y, cudnnBackendDescriptor_t x) {
    Descriptor& desc = keep(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    const cudnnDataType_t fp32 = CUDNN_DATA_FLOAT;
    desc.set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, &mode);
    desc.set(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, &fp32).finalize("reduction descriptor");
    Descriptor& op = keep(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    op.set(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x).set(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y);
    op.set(CUDNN_ATTR_OPERATION_REDUCTION_DESC, desc.get());
    add_operation(op, "reduction");
  }
  // The same memory seen with other dimensions or strides (a transpose).
  void reshape(cudnnBackendDescriptor_t y, cudnnBackendDescriptor_t x) {
    Descriptor& op = keep(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    op.set(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x).set(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y);
    add_operation(op, "reshape");
  }
  // Scores where row index >= column index, -inf above the diagonal: the causal mask.
  cudnnBackendDescriptor_t causal_mask(cudnnBackendDescriptor_t scores, const Dims& dims, int64_t neg_inf_uid) {
    cudnnBackendDescriptor_t row = virtual_tensor(CUDNN_DATA_INT32, dims), col = virtual_tensor(CUDNN_DATA_INT32, dims);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, row, scores, nullptr, nullptr, CUDNN_DATA_INT32, 2);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, col, scores, nullptr, nullptr, CUDNN_DATA_INT32, 3);
    cudnnBackendDescriptor_t visible = virtual_tensor(CUDNN_DATA_BOOLEAN, dims);
    pointwise(CUDNN_POINTWISE_CMP_GE, visible, row, col, nullptr, CUDNN_DATA_BOOLEAN);
    cudnnBackendDescriptor_t masked = virtual_tensor(CUDNN_DATA_FLOAT, dims);
    pointwise(CUDNN_POINTWISE_BINARY_SELECT, masked, scores, scalar(neg_inf_uid), visible);
    return masked;
  }

  // Finalizes the operation graph and hands over everything built.
  std::deque<Descriptor> finish(cudnnBackendDescriptor_t* graph) {
    Descriptor& g = keep(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    g.set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, operations_.data(),
          static_cast<int64_t>(operations_.size()));
    g.set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, &handle_);
    g.finalize("operation graph");
    *graph = g.get();
    return std::move(kept_);
  }

 private:
  Descriptor& keep(cudnnBackendDescriptorType_t type) {
    kept_.emplace_back(type);
    return kept_.back();
  }
  void add_operation(Descriptor& op, const char* what) {
    op.finalize(what);
    operations_.push_back(op.get());
  }
  cudnnBackendDescriptor_t make_tensor(int64_t uid, cudnnDataType_t type, const Dims& dims, const Dims& strides,
                                       bool is_virtual, bool by_value) {
    Descriptor& t = keep(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    // 16 bytes: the bf16 views start at multiples of 8 elements (HS % 8 == 0), the fp32 statistics
    // are 16-byte aligned by the caller (staged otherwise).
    const int64_t alignment = 16;
    t.set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, &type);
    t.set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, dims.data(), 4);
    t.set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, strides.data(), 4);
    t.set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, &uid);
    t.set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, &alignment);
    t.set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, &is_virtual);
    if (by_value) t.set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, &by_value);
    t.finalize("tensor");
    return t.get();
  }

  cudnnHandle_t handle_;
  std::deque<Descriptor> kept_;  // a deque: references stay valid as it grows
  std::vector<cudnnBackendDescriptor_t> operations_;
  int64_t next_virtual_ = kFirstVirtual;
};

struct Shape {
  int B, T, NH, KV, HS;
  bool causal = true;      // false: every query row sees every key (no mask in either graph)
  bool documents = false;  // packed documents: the score bias of launch_document_bias (causal only)
  int64_t row() const { return static_cast<int64_t>(NH + 2 * KV) * HS; }
  int64_t C() const { return static_cast<int64_t>(NH) * HS; }
  size_t qkv_elements() const { return static_cast<size_t>(B) * T * row(); }
  size_t out_elements() const { return static_cast<size_t>(B) * T * C(); }
  size_t row_stats() const { return static_cast<size_t>(B) * NH * T; }
  auto key() const { return std::make_tuple(B, T, NH, KV, HS, causal, documents); }
  bool operator<(const Shape& o) const { return key() < o.key(); }
  std::string name() const {
    return strprintf("B=%d T=%d NH=%d KV=%d HS=%d%s%s", B, T, NH, KV, HS, causal ? "" : " (unmasked)",
                     documents ? " (packed documents)" : "");
  }

  // Views into the token-major rows (qkv: q heads | k heads | v heads; out: the NH heads).
  Dims q_dims() const { return {B, NH, T, HS}; }
  Dims kv_dims() const { return {B, KV, T, HS}; }
  Dims kv_transposed_dims() const { return {B, KV, HS, T}; }
  Dims qkv_strides() const { return {T * row(), HS, row(), 1}; }
  Dims qkv_transposed_strides() const { return {T * row(), HS, 1, row()}; }
  Dims out_strides() const { return {T * C(), HS, C(), 1}; }
  Dims scores_dims() const { return {B, NH, T, T}; }
  Dims bias_dims() const { return {B, 1, T, T}; }  // broadcast over the heads
  Dims bias_strides() const { return {int64_t(T) * T, int64_t(T) * T, T, 1}; }
  Dims transposed_scores_strides() const { return {int64_t(NH) * T * T, int64_t(T) * T, 1, T}; }
  Dims row_dims() const { return {B, NH, T, 1}; }
  // Element offsets of the k and v heads in a row.
  size_t k_offset() const { return static_cast<size_t>(NH) * HS; }
  size_t v_offset() const { return static_cast<size_t>(NH + KV) * HS; }
};

// dst (NH heads) = src summed over each group of NH/KV query heads, or written directly when KV = NH.
void group_product(GraphBuilder& g, const Shape& s, cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b,
                   cudnnBackendDescriptor_t dst) {
  if (s.KV == s.NH) {
    g.matmul(a, b, dst);
    return;
  }
  cudnnBackendDescriptor_t per_query_head = g.virtual_tensor(CUDNN_DATA_BFLOAT16, s.q_dims());
  g.matmul(a, b, per_query_head);
  g.reduce(CUDNN_REDUCE_TENSOR_ADD, dst, per_query_head);
}

// The scores plus the packed documents' bias (the scores themselves without documents).
cudnnBackendDescriptor_t document_bias(GraphBuilder& g, const Shape& s, cudnnBackendDescriptor_t scores) {
  if (!s.documents) return scores;
  cudnnBackendDescriptor_t bias = g.tensor(UID_BIAS, CUDNN_DATA_BFLOAT16, s.bias_dims(), s.bias_strides());
  cudnnBackendDescriptor_t biased = g.virtual_tensor(CUDNN_DATA_FLOAT, s.scores_dims());
  g.pointwise(CUDNN_POINTWISE_ADD, biased, scores, bias);
  return biased;
}

std::deque<Descriptor> forward_graph(GraphBuilder& g, const Shape& s, cudnnBackendDescriptor_t* graph) {
  const Dims S = s.scores_dims(), R = s.row_dims();
  cudnnBackendDescriptor_t q = g.tensor(UID_Q, CUDNN_DATA_BFLOAT16, s.q_dims(), s.qkv_strides());
  cudnnBackendDescriptor_t kt = g.tensor(UID_K, CUDNN_DATA_BFLOAT16, s.kv_transposed_dims(), s.qkv_transposed_strides());
  cudnnBackendDescriptor_t v = g.tensor(UID_V, CUDNN_DATA_BFLOAT16, s.kv_dims(), s.qkv_strides());
  cudnnBackendDescriptor_t o = g.tensor(UID_O, CUDNN_DATA_BFLOAT16, s.q_dims(), s.out_strides());
  cudnnBackendDescriptor_t stats = g.tensor(UID_STATS, CUDNN_DATA_FLOAT, R, compact_strides(R));

  cudnnBackendDescriptor_t products = g.virtual_tensor(CUDNN_DATA_FLOAT, S);
  g.matmul(q, kt, products);
  cudnnBackendDescriptor_t scores = g.virtual_tensor(CUDNN_DATA_FLOAT, S);
  g.pointwise(CUDNN_POINTWISE_MUL, scores, products, g.scalar(UID_SCALE));
  scores = document_bias(g, s, scores);
  cudnnBackendDescriptor_t masked = s.causal ? g.causal_mask(scores, S, UID_NEG_INF) : scores;
  cudnnBackendDescriptor_t row_max = g.virtual_tensor(CUDNN_DATA_FLOAT, R);
  g.reduce(CUDNN_REDUCE_TENSOR_MAX, row_max, masked);
  cudnnBackendDescriptor_t shifted = g.virtual_tensor(CUDNN_DATA_FLOAT, S);
  g.pointwise(CUDNN_POINTWISE_SUB, shifted, masked, row_max);
  cudnnBackendDescriptor_t exps = g.virtual_tensor(CUDNN_DATA_FLOAT, S);
  g.pointwise(CUDNN_POINTWISE_EXP, exps, shifted);
  cudnnBackendDescriptor_t row_sum = g.virtual_tensor(CUDNN_DATA_FLOAT, R);
  g.reduce(CUDNN_REDUCE_TENSOR_ADD, row_sum, exps);
  cudnnBackendDescriptor_t log_sum = g.virtual_tensor(CUDNN_DATA_FLOAT, R);
  g.pointwise(CUDNN_POINTWISE_LOG, log_sum, row_sum);
  g.pointwise(CUDNN_POINTWISE_ADD, stats, row_max, log_sum);  // lse = max + log(sum exp(s - max))
  cudnnBackendDescriptor_t probabilities = g.virtual_tensor(CUDNN_DATA_BFLOAT16, S);
  g.pointwise(CUDNN_POINTWISE_DIV, probabilities, exps, row_sum);
  g.matmul(probabilities, v, o);
  return g.finish(graph);
}

std::deque<Descriptor> backward_graph(GraphBuilder& g, const Shape& s, cudnnBackendDescriptor_t* graph) {
  const Dims S = s.scores_dims(), R = s.row_dims();
  cudnnBackendDescriptor_t q = g.tensor(UID_Q, CUDNN_DATA_BFLOAT16, s.q_dims(), s.qkv_strides());
  cudnnBackendDescriptor_t kt = g.tensor(UID_K, CUDNN_DATA_BFLOAT16, s.kv_transposed_dims(), s.qkv_transposed_strides());
  cudnnBackendDescriptor_t vt = g.tensor(UID_V, CUDNN_DATA_BFLOAT16, s.kv_transposed_dims(), s.qkv_transposed_strides());
  cudnnBackendDescriptor_t o = g.tensor(UID_O, CUDNN_DATA_BFLOAT16, s.q_dims(), s.out_strides());
  cudnnBackendDescriptor_t dout = g.tensor(UID_DO, CUDNN_DATA_BFLOAT16, s.q_dims(), s.out_strides());
  cudnnBackendDescriptor_t stats = g.tensor(UID_STATS, CUDNN_DATA_FLOAT, R, compact_strides(R));
  cudnnBackendDescriptor_t dq = g.tensor(UID_DQ, CUDNN_DATA_BFLOAT16, s.q_dims(), s.qkv_strides());
  cudnnBackendDescriptor_t dk = g.tensor(UID_DK, CUDNN_DATA_BFLOAT16, s.kv_dims(), s.qkv_strides());
  cudnnBackendDescriptor_t dv = g.tensor(UID_DV, CUDNN_DATA_BFLOAT16, s.kv_dims(), s.qkv_strides());
  cudnnBackendDescriptor_t row_sums = g.tensor(UID_ROW_SUMS, CUDNN_DATA_FLOAT, R, compact_strides(R));

  // D = rowsum(dO * O), the softmax backward's sum_s P dP, into device memory (cuDNN reads it per tile).
  cudnnBackendDescriptor_t dout_out = g.virtual_tensor(CUDNN_DATA_FLOAT, s.q_dims(), s.out_strides());
  g.pointwise(CUDNN_POINTWISE_MUL, dout_out, dout, o);
  cudnnBackendDescriptor_t d = g.virtual_tensor(CUDNN_DATA_FLOAT, R);
  g.reduce(CUDNN_REDUCE_TENSOR_ADD, d, dout_out);
  g.pointwise(CUDNN_POINTWISE_MUL, row_sums, d, g.scalar(UID_ONE));  // the pattern's (dropout) scale, 1

  // P = exp(causal(scale q k^T) - lse) (unmasked without the causal mask), recomputed from the
  // saved statistics.
  cudnnBackendDescriptor_t products = g.virtual_tensor(CUDNN_DATA_FLOAT, S);
  g.matmul(q, kt, products);
  cudnnBackendDescriptor_t scores = g.virtual_tensor(CUDNN_DATA_FLOAT, S);
  g.pointwise(CUDNN_POINTWISE_MUL, scores, products, g.scalar(UID_SCALE));
  scores = document_bias(g, s, scores);
  cudnnBackendDescriptor_t shifted = g.virtual_tensor(CUDNN_DATA_FLOAT, S);
  g.pointwise(CUDNN_POINTWISE_SUB, shifted, scores, stats);
  cudnnBackendDescriptor_t masked = s.causal ? g.causal_mask(shifted, S, UID_NEG_INF) : shifted;
  cudnnBackendDescriptor_t p = g.virtual_tensor(CUDNN_DATA_FLOAT, S);
  g.pointwise(CUDNN_POINTWISE_EXP, p, masked);

  // dV = P^T dO (summed over the group's query heads).
  cudnnBackendDescriptor_t pt = g.virtual_tensor(CUDNN_DATA_BFLOAT16, S, s.transposed_scores_strides());
  g.reshape(pt, p);
  group_product(g, s, pt, dout, dv);

  // dS = scale P (dO V^T - D).
  cudnnBackendDescriptor_t dp = g.virtual_tensor(CUDNN_DATA_FLOAT, S);
  g.matmul(dout, vt, dp);
  cudnnBackendDescriptor_t centered = g.virtual_tensor(CUDNN_DATA_FLOAT, S);
  g.pointwise(CUDNN_POINTWISE_SUB, centered, dp, row_sums);
  cudnnBackendDescriptor_t ds_unscaled = g.virtual_tensor(CUDNN_DATA_FLOAT, S);
  g.pointwise(CUDNN_POINTWISE_MUL, ds_unscaled, centered, p);
  cudnnBackendDescriptor_t ds = g.virtual_tensor(CUDNN_DATA_FLOAT, S);
  g.pointwise(CUDNN_POINTWISE_MUL, ds, ds_unscaled, g.scalar(UID_SCALE));

  // dK = dS^T Q (summed over the group), dQ = dS K straight into dQ: no fp32 accumulator.
  cudnnBackendDescriptor_t dst = g.virtual_tensor(CUDNN_DATA_BFLOAT16, S, s.transposed_scores_strides());
  g.reshape(dst, ds);
  group_product(g, s, dst, q, dk);
  cudnnBackendDescriptor_t k = g.virtual_tensor(CUDNN_DATA_BFLOAT16, s.kv_dims(), s.qkv_strides());
  g.reshape(k, kt);
  g.matmul(ds, k, dq);
  return g.finish(graph);
}

bool has_note(cudnnBackendDescriptor_t engine, cudnnBackendNumericalNote_t wanted) {
  cudnnBackendNumericalNote_t notes[CUDNN_NUMERICAL_NOTE_TYPE_COUNT];
  int64_t count = 0;
  build_step(cudnnBackendGetAttribute(engine, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                                      CUDNN_NUMERICAL_NOTE_TYPE_COUNT, &count, notes),
             "engine numerical notes");
  for (int64_t i = 0; i < count; i++)
    if (notes[i] == wanted) return true;
  return false;
}

// A finalized execution plan for one graph, or the reason there is none.
struct Plan {
  std::deque<Descriptor> graph_parts;  // tensors, operations and the graph the plan was built from
  std::unique_ptr<Descriptor> plan;
  int64_t workspace = 0;
  std::string unsupported;  // non-empty: no plan
};

// The first engine config of the heuristics (mode A, then the fallback list) that carries no
// non-determinism note and finalizes.
void choose_plan(Plan& result, cudnnHandle_t handle, cudnnBackendDescriptor_t graph) {
  std::string tried;
  for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
    Descriptor heuristics(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
    heuristics.set(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph).set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, &mode);
    heuristics.finalize("engine heuristics");
    int64_t count = 0;
    build_step(cudnnBackendGetAttribute(heuristics.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                        0, &count, nullptr),
               "engine heuristics count");
    std::vector<Descriptor> configs;
    std::vector<cudnnBackendDescriptor_t> raw;
    for (int64_t i = 0; i < count; i++) raw.push_back(configs.emplace_back(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR).get());
    build_step(cudnnBackendGetAttribute(heuristics.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                        count, &count, raw.data()),
               "engine heuristics results");
    for (int64_t i = 0; i < count; i++) {
      Descriptor engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
      cudnnBackendDescriptor_t engine_raw = engine.get();
      int64_t one = 0;
      build_step(cudnnBackendGetAttribute(raw[i], CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &one,
                                          &engine_raw),
                 "engine of a config");
      if (has_note(engine_raw, CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC)) {
        tried += " (a non-deterministic engine skipped)";
        continue;
      }
      auto plan = std::make_unique<Descriptor>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
      plan->set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, &handle);
      plan->set(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, raw[i]);
      const cudnnStatus_t status = cudnnBackendFinalize(plan->get());
      if (status != CUDNN_STATUS_SUCCESS) {
        tried = strprintf(" (last: %s, %s)", cudnnGetErrorString(status), last_cudnn_message().c_str());
        continue;
      }
      int64_t n = 0;
      build_step(cudnnBackendGetAttribute(plan->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1,
                                          &n, &result.workspace),
                 "plan workspace size");
      result.plan = std::move(plan);
      return;
    }
  }
  throw Unsupported("no deterministic engine config finalized" + tried);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

struct CudnnAttention::Impl {
  CudaDevice& device;
  cudnnHandle_t handle = nullptr;
  kernels::LaunchContext launch;
  std::map<Shape, Plan> forward_plans, backward_plans;
  // Grow-only device buffers from the caching allocator, reused in stream order; their sizes are
  // backend/gpu_memory.hpp's cudnn_attention_*_bytes, which the memory plan counts.
  struct Buffer {
    void* data = nullptr;
    size_t bytes = 0;
  };
  Buffer qkv16, out16, dout16, dqkv16, row_sums, lse_copy, bias, workspace;
  // The documents the bias buffer holds now (null: none built, or stale).
  const int* bias_docs = nullptr;
  int bias_B = 0, bias_T = 0;
  // By-value scalars the variant pack points at (read when a plan is executed).
  float scale = 1, neg_inf = -std::numeric_limits<float>::infinity(), one = 1;

  explicit Impl(CudaDevice& d) : device(d) {
    launch.stream = cuda_stream(device.compute_stream());
    CUDA_CHECK(cudaDeviceGetAttribute(&launch.sm_count, cudaDevAttrMultiProcessorCount, device.ordinal()));
    CUDNN_CHECK(cudnnCreate(&handle));
    CUDNN_CHECK(cudnnSetStream(handle, launch.stream));
  }
  ~Impl() {
    (void)cudaStreamSynchronize(launch.stream);  // queued work may still read the buffers
    forward_plans.clear();
    backward_plans.clear();
    for (Buffer* b : all_buffers())
      if (b->data) device.release(b->data, b->bytes);
    if (handle) cudnnDestroy(handle);
  }
  std::array<Buffer*, 8> all_buffers() {
    return {&qkv16, &out16, &dout16, &dqkv16, &row_sums, &lse_copy, &bias, &workspace};
  }

  template <typename T>
  T* grow(Buffer& b, size_t bytes) {
    if (bytes > b.bytes) {
      if (b.data) device.release(b.data, b.bytes);
      b.data = nullptr;
      b.bytes = 0;
      b.data = device.allocate(bytes);
      b.bytes = bytes;
    }
    return static_cast<T*>(b.data);
  }

  // The plan for a shape and direction, built on first use; null (after one printed line) when none.
  Descriptor* plan_for(const Shape& s, bool backward) {
    auto& plans = backward ? backward_plans : forward_plans;
    auto found = plans.find(s);
    if (found == plans.end()) {
      Plan& plan = plans[s];
      plan.unsupported = CudnnAttention::unsupported_reason(s.T, s.HS, backward);
      if (plan.unsupported.empty()) {
        try {
          GraphBuilder builder(handle);
          cudnnBackendDescriptor_t graph = nullptr;
          plan.graph_parts = backward ? backward_graph(builder, s, &graph) : forward_graph(builder, s, &graph);
          choose_plan(plan, handle, graph);
        } catch (const Unsupported& e) {
          plan.unsupported = e.what();
        }
      }
      if (!plan.unsupported.empty())
        std::fprintf(stderr, "%s train.attention=cudnn: no cuDNN %s attention for %s: %s; the tiled kernels run it\n",
                     rank_label().c_str(), backward ? "backward" : "forward", s.name().c_str(),
                     plan.unsupported.c_str());
      found = plans.find(s);
    }
    return found->second.plan.get();
  }

  void execute(Descriptor& plan, const std::vector<std::pair<int64_t, void*>>& tensors, int64_t workspace_size) {
    std::vector<int64_t> uids;
    std::vector<void*> pointers;
    for (const auto& [uid, pointer] : tensors) uids.push_back(uid), pointers.push_back(pointer);
    void* ws = workspace_size > 0 ? grow<char>(workspace, static_cast<size_t>(workspace_size)) : nullptr;
    cudnnBackendDescriptor_t pack = nullptr;
    CUDNN_CHECK(cudnnBackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &pack));
    CUDNN_CHECK(cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64,
                                         static_cast<int64_t>(uids.size()), uids.data()));
    CUDNN_CHECK(cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR,
                                         static_cast<int64_t>(pointers.size()), pointers.data()));
    CUDNN_CHECK(cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws));
    CUDNN_CHECK(cudnnBackendFinalize(pack));
    CUDNN_CHECK(cudnnBackendExecute(handle, plan.get(), pack));
    CUDNN_CHECK(cudnnBackendDestroyDescriptor(pack));
  }

  int64_t workspace_of(const Shape& s, bool backward) {
    return (backward ? backward_plans : forward_plans).at(s).workspace;
  }

  // An input of n elements in bf16: the caller's copy when cuDNN may read it (16-byte aligned, as
  // the tensors are declared), else rounded into `staging` (grown to `bytes`). Non-const for the
  // variant pack, which takes void*: cuDNN only reads it.
  uint16_t* bf16_input(const float* values, const uint16_t* copy, size_t n, Buffer& staging, size_t bytes) {
    if (copy && aligned16(copy)) return const_cast<uint16_t*>(copy);
    uint16_t* rounded = grow<uint16_t>(staging, bytes);
    kernels::launch_to_half(rounded, values, n, DTYPE_BF16, launch);
    return rounded;
  }
  uint16_t* bf16_qkv(const float* qkv, const uint16_t* copy, const Shape& s) {
    return bf16_input(qkv, copy, s.qkv_elements(), qkv16, gpu::cudnn_attention_qkv_bytes(s.B, s.T, s.NH, s.KV, s.HS));
  }
  void set_scalars(const Shape& s) { scale = 1.0f / std::sqrt(static_cast<float>(s.HS)); }
  // The variant pack's entries every call of shape s has beyond its own tensors: the causal mask's
  // fill, and the packed documents' bias built from doc_start.
  void add_masks(const Shape& s, const int* doc_start, std::vector<std::pair<int64_t, void*>>& tensors) {
    if (s.causal) tensors.push_back({UID_NEG_INF, &neg_inf});
    if (!s.documents) return;
    uint16_t* b = grow<uint16_t>(bias, gpu::cudnn_attention_bias_bytes(s.B, s.T));
    if (doc_start != bias_docs || s.B != bias_B || s.T != bias_T) {  // else still the bias of these documents
      kernels::launch_document_bias(b, doc_start, s.B, s.T, launch);
      bias_docs = doc_start, bias_B = s.B, bias_T = s.T;
    }
    tensors.push_back({UID_BIAS, b});
  }
};

CudnnAttention::CudnnAttention(CudaDevice& device) : impl_(std::make_unique<Impl>(device)) {}
CudnnAttention::~CudnnAttention() = default;

std::string CudnnAttention::unsupported_reason(int T, int HS, bool backward) {
  const std::string head_size = gpu::cudnn_attention_head_size_refusal(HS);  // multiples of 8 up to 128
  if (!head_size.empty()) return head_size;
  // Before 9.16 the backward needed an explicit padding mask when T is not a multiple of 128.
  if (backward && T % 128 != 0 && cudnnGetVersion() < 91600)
    return strprintf("cuDNN %zu's backward needs T (%d) a multiple of 128 (9.16 or newer does not)", cudnnGetVersion(),
                     T);
  return "";
}

bool CudnnAttention::forward(float* out, float* lse, const float* qkv, int B, int T, int NH, int KV, int HS,
                             const uint16_t* qkv_bf16, bool causal, const int* doc_start) {
  const Shape s{B, T, NH, KV, HS, causal, doc_start != nullptr};
  SHARD_CHECK(causal || !doc_start, "attention: packed documents without the causal mask");
  SHARD_CHECK(B > 0 && T > 0 && NH > 0 && KV > 0 && HS > 0 && NH % KV == 0, "attention: %s", s.name().c_str());
  Descriptor* plan = impl_->plan_for(s, false);
  if (!plan) return false;
  Impl& m = *impl_;
  m.set_scalars(s);
  uint16_t* q16 = m.bf16_qkv(qkv, qkv_bf16, s);
  uint16_t* o16 = m.grow<uint16_t>(m.out16, gpu::cudnn_attention_out_bytes(B, T, NH, HS));
  float* stats = aligned16(lse) ? lse : m.grow<float>(m.lse_copy, gpu::cudnn_attention_row_bytes(B, T, NH));
  std::vector<std::pair<int64_t, void*>> tensors = {{UID_Q, q16},         {UID_K, q16 + s.k_offset()},
                                                    {UID_V, q16 + s.v_offset()}, {UID_O, o16},
                                                    {UID_STATS, stats}, {UID_SCALE, &m.scale}};
  m.add_masks(s, doc_start, tensors);
  m.execute(*plan, tensors, m.workspace_of(s, false));
  if (stats != lse)
    CUDA_CHECK(cudaMemcpyAsync(lse, stats, s.row_stats() * sizeof(float), cudaMemcpyDeviceToDevice, m.launch.stream));
  kernels::launch_from_half(out, o16, s.out_elements(), DTYPE_BF16, m.launch);
  return true;
}

bool CudnnAttention::backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                              int B, int T, int NH, int KV, int HS, const uint16_t* qkv_bf16,
                              const uint16_t* out_bf16, bool causal, const int* doc_start) {
  const Shape s{B, T, NH, KV, HS, causal, doc_start != nullptr};
  SHARD_CHECK(causal || !doc_start, "attention: packed documents without the causal mask");
  SHARD_CHECK(B > 0 && T > 0 && NH > 0 && KV > 0 && HS > 0 && NH % KV == 0, "attention: %s", s.name().c_str());
  Descriptor* plan = impl_->plan_for(s, true);
  if (!plan) return false;
  Impl& m = *impl_;
  m.set_scalars(s);
  uint16_t* q16 = m.bf16_qkv(qkv, qkv_bf16, s);
  // out holds the forward's bf16 values widened (or the tiled kernels' fp32): rounding it again
  // (or reading its bound copy) gives cuDNN's forward output back bit for bit, without keeping a
  // bf16 copy per layer here.
  const size_t out_bytes = gpu::cudnn_attention_out_bytes(B, T, NH, HS);
  uint16_t* o16 = m.bf16_input(out, out_bf16, s.out_elements(), m.out16, out_bytes);
  uint16_t* do16 = m.bf16_input(dout, nullptr, s.out_elements(), m.dout16, out_bytes);
  uint16_t* dq16 = m.grow<uint16_t>(m.dqkv16, gpu::cudnn_attention_qkv_bytes(B, T, NH, KV, HS));
  float* sums = m.grow<float>(m.row_sums, gpu::cudnn_attention_row_bytes(B, T, NH));
  const float* stats = lse;
  if (!aligned16(lse)) {
    float* copy = m.grow<float>(m.lse_copy, gpu::cudnn_attention_row_bytes(B, T, NH));
    CUDA_CHECK(cudaMemcpyAsync(copy, lse, s.row_stats() * sizeof(float), cudaMemcpyDeviceToDevice, m.launch.stream));
    stats = copy;
  }
  std::vector<std::pair<int64_t, void*>> tensors = {
      {UID_Q, q16},         {UID_K, q16 + s.k_offset()},   {UID_V, q16 + s.v_offset()},
      {UID_O, o16},         {UID_DO, do16},                {UID_STATS, const_cast<float*>(stats)},
      {UID_DQ, dq16},       {UID_DK, dq16 + s.k_offset()}, {UID_DV, dq16 + s.v_offset()},
      {UID_ROW_SUMS, sums}, {UID_SCALE, &m.scale},         {UID_ONE, &m.one}};
  m.add_masks(s, doc_start, tensors);
  m.execute(*plan, tensors, m.workspace_of(s, true));
  kernels::launch_from_half(dqkv, dq16, s.qkv_elements(), DTYPE_BF16, m.launch);
  return true;
}

void CudnnAttention::documents_changed(const int* doc_start) {
  if (doc_start == impl_->bias_docs) impl_->bias_docs = nullptr;
}

size_t CudnnAttention::workspace_bytes() const { return impl_->workspace.bytes; }

size_t CudnnAttention::staging_bytes() const {
  size_t total = 0;
  for (Impl::Buffer* b : impl_->all_buffers())
    if (b != &impl_->workspace) total += b->bytes;
  return total;
}

}  // namespace shardtrain
