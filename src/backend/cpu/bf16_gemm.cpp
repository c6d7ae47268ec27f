// See bf16_gemm.hpp.
#include "backend/cpu/bf16_gemm.hpp"

#include <algorithm>
#include <map>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <tuple>
#include <vector>

#include "backend/cpu/gemm.hpp"
#include "backend/cpu/ops.hpp"
#include "backend/device.hpp"
#include "backend/dtype.hpp"
#include "backend/layer_ops.hpp"
#include "core/error.hpp"

namespace shardtrain::cpu {
namespace {

// Row-major C(M,N) = op(A)(M,K) op(B)(K,N) (+ C when accumulate), leading dimensions given.
struct Product {
  bool trans_a, trans_b;
  int M, N, K, lda, ldb, ldc;
  bool accumulate;
  auto key() const { return std::make_tuple(trans_a, trans_b, M, N, K, lda, ldb, ldc, accumulate); }
};

dnnl::matmul::primitive_desc describe_product(const Product& p, const dnnl::engine& engine) {
  using dt = dnnl::memory::data_type;
  using dims = dnnl::memory::dims;
  // A transposed operand is the same memory read with swapped strides.
  const dnnl::memory::desc a({p.M, p.K}, dt::bf16, p.trans_a ? dims{1, p.lda} : dims{p.lda, 1});
  const dnnl::memory::desc b({p.K, p.N}, dt::bf16, p.trans_b ? dims{1, p.ldb} : dims{p.ldb, 1});
  const dnnl::memory::desc c({p.M, p.N}, dt::f32, dims{p.ldc, 1});
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (p.accumulate) {
    dnnl::post_ops sum;
    sum.append_sum(1.0f);
    attr.set_post_ops(sum);
  }
  return dnnl::matmul::primitive_desc(dnnl::matmul::desc(a, b, c), attr, engine);
}

// The products of one linear layer out(N,OC) = inp(N,C) weight(OC,C)^T: the forward (onto a bias
// or not), the backward's dinp = dout weight and dweight += dout^T inp.
enum ProductKind { FORWARD, FORWARD_ONTO_BIAS, DINP, DWEIGHT, PRODUCT_KINDS };
Product layer_product(ProductKind kind, int N, int C, int OC) {
  switch (kind) {
    case FORWARD: return {false, true, N, OC, C, C, C, OC, false};
    case FORWARD_ONTO_BIAS: return {false, true, N, OC, C, C, C, OC, true};
    case DINP: return {false, false, N, C, OC, OC, C, C, false};
    default: return {true, false, OC, C, N, OC, C, C, true};
  }
}

std::vector<Product> model_products(const std::vector<LinearShape>& layers, int rows) {
  std::vector<Product> all;
  for (const LinearShape& l : layers)
    for (int kind = 0; kind < PRODUCT_KINDS; kind++)
      all.push_back(layer_product(static_cast<ProductKind>(kind), rows, l.in, l.out));
  return all;
}

void round_to_bf16(uint16_t* out, const float* in, size_t n) { cpu_shard_ops().to_half(out, in, n, DTYPE_BF16); }

// Columns [k0, k0 + k) of a rows x K matrix X, each element rounded to bf16 and widened back, into
// dst in X's own orientation: (rows, k) row-major, or (k, rows) where X is stored transposed.
void round_column_block(float* dst, const float* X, int ld, bool transposed, int rows, int k0, int k) {
  const int outer = transposed ? k : rows, inner = transposed ? rows : k;
#pragma omp parallel for schedule(static)
  for (int i = 0; i < outer; i++)
    for (int j = 0; j < inner; j++) {
      const float x = transposed ? X[static_cast<size_t>(k0 + i) * ld + j] : X[static_cast<size_t>(i) * ld + k0 + j];
      dst[static_cast<size_t>(i) * inner + j] = bf16_to_float(float_to_bf16(x));
    }
}

// 16-bit operand elements the largest layer needs: the backward's dout (rows x out) and input
// (rows x in) copies -- the weights come rounded. Without oneDNN's kernels the same bytes hold fp32
// halves of K of the rounded operand(s): at most the dweight product's dout and input halves.
size_t operand_elements(const std::vector<LinearShape>& layers, int rows) {
  size_t most = 0;
  for (const LinearShape& l : layers) most = std::max(most, static_cast<size_t>(rows) * (l.in + l.out));
  return most;
}

}  // namespace

struct Bf16Gemm::Impl {
  explicit Impl(bool onednn) : native(onednn) {}
  bool native;
  // Host DeviceArrays, so that the memory the run reports as held counts them.
  DeviceArray<uint16_t> operands;   // the 16-bit copies (or, without oneDNN's kernels, fp32 halves of K)
  DeviceArray<uint8_t> scratchpad;  // oneDNN's, the largest any cached product asked for
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  std::map<decltype(Product{}.key()), dnnl::matmul> cache;
  std::mutex mutex;

  // Scratch of at least `n` elements (its old contents are not kept).
  template <typename T>
  static T* grow(DeviceArray<T>& array, size_t n) {
    if (array.size() < n) array = DeviceArray<T>(host_device(), n);  // beyond the plan: generation's prefill
    return array.data();
  }
  uint16_t* reserve(size_t elements) { return grow(operands, elements); }

  dnnl::matmul& primitive(const Product& p) {
    auto it = cache.find(p.key());
    if (it == cache.end()) {
      auto pd = describe_product(p, engine);
      grow(scratchpad, pd.scratchpad_desc().get_size());
      it = cache.emplace(p.key(), dnnl::matmul(pd)).first;
    }
    return it->second;
  }

  // C = op(A16) op(B16) (+ C) with oneDNN; A16, B16 already rounded.
  void run_native(const Product& p, const uint16_t* a, const uint16_t* b, float* c) {
    dnnl::matmul& matmul = primitive(p);
    dnnl::matmul::primitive_desc desc(const_cast<dnnl_primitive_desc_t>(matmul.get_primitive_desc()));
    dnnl::memory am(desc.src_desc(), engine, const_cast<uint16_t*>(a));
    dnnl::memory bm(desc.weights_desc(), engine, const_cast<uint16_t*>(b));
    dnnl::memory cm(desc.dst_desc(), engine, c);
    dnnl::memory sm(desc.scratchpad_desc(), engine, scratchpad.data());
    matmul.execute(stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm},
                                {DNNL_ARG_SCRATCHPAD, sm}});
    stream.wait();
  }

  // The same product from fp32 operands as SGEMMs on their bf16-rounded values, K split in halves
  // so that the widened blocks fit the workspace the 16-bit copies would have used. a_rounded,
  // b_rounded: that operand's values are bf16 already (it came with its copy), read in place.
  void run_emulated(const Product& p, const float* A, bool a_rounded, const float* B, bool b_rounded, float* C) {
    const int kb = std::max(1, p.K / 2);
    const size_t block_elements = static_cast<size_t>(kb) * ((a_rounded ? 0 : p.M) + (b_rounded ? 0 : p.N));
    float* block = reinterpret_cast<float*>(reserve(block_elements * 2));
    for (int k0 = 0; k0 < p.K; k0 += kb) {
      const int k = std::min(kb, p.K - k0);
      // op(A)[:, k0:k0+k] in A's orientation: rows k0.. of A where trans_a, else its columns k0..
      const float* a = p.trans_a ? A + static_cast<size_t>(k0) * p.lda : A + k0;
      int lda = p.lda;
      float* free_block = block;
      if (!a_rounded) {
        round_column_block(free_block, A, p.lda, p.trans_a, p.M, k0, k);
        a = free_block, lda = p.trans_a ? p.M : k;
        free_block += static_cast<size_t>(p.M) * k;
      }
      // Rows k0.. of op(B): columns k0.. of B where trans_b, else its rows k0..
      const float* b = p.trans_b ? B + k0 : B + static_cast<size_t>(k0) * p.ldb;
      int ldb = p.ldb;
      if (!b_rounded) {
        round_column_block(free_block, B, p.ldb, !p.trans_b, p.N, k0, k);
        b = free_block, ldb = p.trans_b ? k : p.N;
      }
      const float beta = (p.accumulate || k0 > 0) ? 1.0f : 0.0f;
      gemm(p.trans_a, p.trans_b, p.M, p.N, k, 1.0f, a, lda, b, ldb, beta, C, p.ldc);
    }
  }

  size_t weights_rounded = 0;  // elements, for weight_elements_rounded()
  // The bf16 weight to multiply: the given copy, or the weight rounded into `scratch`.
  const uint16_t* weight_operand(const float* weight, const uint16_t* weight16, size_t n, uint16_t* scratch) {
    if (weight16) return weight16;
    round_to_bf16(scratch, weight, n);
    weights_rounded += n;
    return scratch;
  }
};

bool Bf16Gemm::native_bf16() {
  const auto isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
  const auto bf16 = static_cast<unsigned>(dnnl::cpu_isa::avx512_core_bf16);
  return (isa & bf16) == bf16;
}

Bf16Gemm::Bf16Gemm(const std::vector<LinearShape>& layers, int rows, bool onednn)
    : impl_(std::make_unique<Impl>(onednn)) {
  impl_->reserve(operand_elements(layers, rows));
  if (impl_->native)  // every kernel now: the scratchpad reaches its size at start-up
    for (const Product& p : model_products(layers, rows)) impl_->primitive(p);
}

size_t Bf16Gemm::plan_workspace_bytes(const std::vector<LinearShape>& layers, int rows) {
  size_t scratchpad = 0;
  if (native_bf16()) {
    dnnl::engine engine(dnnl::engine::kind::cpu, 0);
    for (const Product& p : model_products(layers, rows))
      scratchpad = std::max(scratchpad, describe_product(p, engine).scratchpad_desc().get_size());
  }
  return operand_elements(layers, rows) * sizeof(uint16_t) + scratchpad;
}

Bf16Gemm::~Bf16Gemm() = default;

void Bf16Gemm::forward(float* out, const float* inp, const uint16_t* inp16, const float* weight,
                       const uint16_t* weight16, const float* bias, int N, int C, int OC) {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  if (bias) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) std::copy(bias, bias + OC, out + static_cast<size_t>(n) * OC);
  }
  const Product p = layer_product(bias ? FORWARD_ONTO_BIAS : FORWARD, N, C, OC);
  const size_t n_inp = static_cast<size_t>(N) * C, n_weight = static_cast<size_t>(OC) * C;
  if (!impl_->native) {
    if (!weight16) impl_->weights_rounded += n_weight;
    impl_->run_emulated(p, inp, inp16 != nullptr, weight, weight16 != nullptr, out);
    return;
  }
  uint16_t* scratch = impl_->reserve((inp16 ? 0 : n_inp) + (weight16 ? 0 : n_weight));
  if (!inp16) {
    round_to_bf16(scratch, inp, n_inp);
    inp16 = scratch, scratch += n_inp;
  }
  impl_->run_native(p, inp16, impl_->weight_operand(weight, weight16, n_weight, scratch), out);
}

void Bf16Gemm::backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const uint16_t* inp16, const float* weight, const uint16_t* weight16, int N, int C, int OC) {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  const size_t n_dout = static_cast<size_t>(N) * OC, n_weight = static_cast<size_t>(OC) * C,
               n_inp = static_cast<size_t>(N) * C;
  if (!impl_->native) {
    if (dinp) {
      if (!weight16) impl_->weights_rounded += n_weight;
      impl_->run_emulated(layer_product(DINP, N, C, OC), dout, false, weight, weight16 != nullptr, dinp);
    }
    if (dweight)
      impl_->run_emulated(layer_product(DWEIGHT, N, C, OC), dout, false, inp, inp16 != nullptr, dweight);
  } else {
    const bool copy_weight = dinp && !weight16, copy_inp = dweight && !inp16;
    uint16_t* dout16 = impl_->reserve(n_dout + (copy_inp ? n_inp : 0) + (copy_weight ? n_weight : 0));
    uint16_t* scratch = dout16 + n_dout;
    if (dinp || dweight) round_to_bf16(dout16, dout, n_dout);
    if (copy_inp) {
      round_to_bf16(scratch, inp, n_inp);
      inp16 = scratch, scratch += n_inp;
    }
    if (dinp)
      impl_->run_native(layer_product(DINP, N, C, OC), dout16, impl_->weight_operand(weight, weight16, n_weight, scratch),
                        dinp);
    if (dweight) impl_->run_native(layer_product(DWEIGHT, N, C, OC), dout16, inp16, dweight);
  }
  // The bias gradient is a sum, not a product: fp32, as without bf16.
  if (dbias) matmul_backward<float>(nullptr, nullptr, dbias, dout, nullptr, nullptr, N, C, OC);
}

size_t Bf16Gemm::weight_elements_rounded() const { return impl_->weights_rounded; }

bool Bf16Gemm::onednn() const { return impl_->native; }

size_t Bf16Gemm::workspace_bytes() const {
  return impl_->operands.bytes() + impl_->scratchpad.bytes();
}

std::string Bf16Gemm::describe() const {
  const dnnl_version_t* v = dnnl_version();
  if (!impl_->native)
    return "OpenBLAS SGEMM on bf16-rounded operands (this CPU has no bf16 dot products: oneDNN would only "
           "emulate them, slower)";
  return strprintf("oneDNN %d.%d.%d bf16 matmul", v->major, v->minor, v->patch);
}

}  // namespace shardtrain::cpu
