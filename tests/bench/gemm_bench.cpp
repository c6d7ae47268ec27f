// Which GEMM library for the CPU backend: OpenBLAS, BLIS and oneDNN (fp32, and oneDNN's bf16 with
// fp32 accumulation) on the products the trainer runs -- every linear layer of gpt2-124M and of
// the llama-135M shape, forward (out = inp W^T) and both backward products (dinp = dout W,
// dweight += dout^T inp), for N = B*T rows -- and a 2048^3 square, on 1 and 2 threads.
// Libraries are timed interleaved per repeat (one library's turn never all lands in a quiet or a
// busy moment of a shared machine); prints min and median GFLOP/s per case and library, and for
// every thread count after the first whether each library's C has the first one's bits.
//
//   build/gemm_bench [--threads 1,2] [--rows 256,1024,4096] [--repeats 5] [--quick]
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <oneapi/dnnl/dnnl.hpp>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/gemm.hpp"
#include "backend/dtype.hpp"
#include <x86_64-linux-gnu/blis-openmp/blis.h>

extern "C" void openblas_set_num_threads(int);
extern "C" char* openblas_get_config(void);

namespace {

using Clock = std::chrono::steady_clock;

// Row-major C(M,N) = op(A) op(B) (+ C when accumulate): the three products of one linear layer.
struct Product {
  std::string name;
  int M, N, K;
  bool trans_a, trans_b, accumulate;
};

struct Layer {
  std::string name;
  int in, out;  // weight (out, in)
};

std::vector<Product> layer_products(const std::string& model, const Layer& layer, int rows) {
  const std::string tag = model + " " + layer.name + " N=" + std::to_string(rows);
  return {{tag + " fwd", rows, layer.out, layer.in, false, true, false},
          {tag + " dinp", rows, layer.in, layer.out, false, false, false},
          {tag + " dW", layer.out, layer.in, rows, true, false, true}};
}

std::vector<int> parse_list(const char* text) {
  std::vector<int> out;
  for (const char* p = text; *p;) {
    out.push_back(std::atoi(p));
    while (*p && *p != ',') p++;
    if (*p == ',') p++;
  }
  return out;
}

struct Operands {
  std::vector<float> a, b, c;
  std::vector<uint16_t> a16, b16;
};

class OneDnnMatmul {
 public:
  OneDnnMatmul(const Product& p, bool bf16, dnnl::engine& engine) : engine_(engine) {
    using dt = dnnl::memory::data_type;
    const dt in_type = bf16 ? dt::bf16 : dt::f32;
    // op(A) is (M,K): row-major A is (M,K) strides {K,1}; transposed, A is (K,M) read as strides {1,M}.
    const dnnl::memory::dims a_strides = p.trans_a ? dnnl::memory::dims{1, p.M} : dnnl::memory::dims{p.K, 1};
    const dnnl::memory::dims b_strides = p.trans_b ? dnnl::memory::dims{1, p.K} : dnnl::memory::dims{p.N, 1};
    a_md_ = dnnl::memory::desc({p.M, p.K}, in_type, a_strides);
    b_md_ = dnnl::memory::desc({p.K, p.N}, in_type, b_strides);
    c_md_ = dnnl::memory::desc({p.M, p.N}, dt::f32, dnnl::memory::dims{p.N, 1});
    dnnl::primitive_attr attr;
    if (p.accumulate) {
      dnnl::post_ops ops;
      ops.append_sum(1.0f);
      attr.set_post_ops(ops);
    }
    auto pd = dnnl::matmul::primitive_desc(dnnl::matmul::desc(a_md_, b_md_, c_md_), attr, engine_);
    impl_ = pd.impl_info_str();
    matmul_ = dnnl::matmul(pd);
  }
  void run(dnnl::stream& stream, void* a, void* b, float* c) {
    dnnl::memory am(a_md_, engine_, a), bm(b_md_, engine_, b), cm(c_md_, engine_, c);
    matmul_.execute(stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
    stream.wait();
  }
  const std::string& impl() const { return impl_; }

 private:
  dnnl::engine& engine_;
  dnnl::memory::desc a_md_, b_md_, c_md_;
  dnnl::matmul matmul_;
  std::string impl_;
};

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

struct Stats {
  double min, median;
};
Stats stats(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v.front(), v[v.size() / 2]};
}

uint64_t fnv1a(const std::vector<float>& values) {
  uint64_t hash = 14695981039346656037ull;  // FNV-1a offset basis
  const auto* bytes = reinterpret_cast<const unsigned char*>(values.data());
  for (size_t i = 0; i < values.size() * sizeof(float); i++) hash = (hash ^ bytes[i]) * 1099511628211ull;
  return hash;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> threads{1, 2}, rows{256, 1024, 4096};
  int repeats = 5;
  bool quick = false;
  for (int i = 1; i < argc; i++) {
    if (!std::strcmp(argv[i], "--threads") && i + 1 < argc) threads = parse_list(argv[++i]);
    else if (!std::strcmp(argv[i], "--rows") && i + 1 < argc) rows = parse_list(argv[++i]);
    else if (!std::strcmp(argv[i], "--repeats") && i + 1 < argc) repeats = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--quick")) quick = true;
    else {
      std::fprintf(stderr, "usage: gemm_bench [--threads 1,2] [--rows 256,1024,4096] [--repeats N] [--quick]\n");
      return 2;
    }
  }
  const std::vector<Layer> gpt2{{"qkv", 768, 2304}, {"attproj", 768, 768}, {"fc", 768, 3072},
                                {"fcproj", 3072, 768}, {"lmhead", 768, 50257}};
  const std::vector<Layer> llama{{"qkv", 576, 960}, {"o", 576, 576}, {"gateup", 576, 3072},
                                 {"down", 1536, 576}, {"lmhead", 576, 49152}};
  std::vector<Product> products{{"square 2048^3", 2048, 2048, 2048, false, false, false}};
  for (int n : rows) {
    for (const Layer& l : gpt2)
      if (!quick || l.name != "lmhead")
        for (const Product& p : layer_products("gpt2-124M", l, n)) products.push_back(p);
    for (const Layer& l : llama)
      if (!quick || l.name != "lmhead")
        for (const Product& p : layer_products("llama-135M", l, n)) products.push_back(p);
  }

  dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  std::printf("oneDNN %d.%d.%d, effective ISA %d; OpenBLAS %s; BLIS %s\n", dnnl_version()->major,
              dnnl_version()->minor, dnnl_version()->patch, static_cast<int>(dnnl::get_effective_cpu_isa()),
              openblas_get_config(), bli_info_get_version_str());
  const char* libs[] = {"openblas", "blis", "onednn-f32", "onednn-bf16"};
  std::printf("%-34s %3s | %s\n", "product (M x N x K)", "thr",
              "GFLOP/s min/median: openblas | blis | onednn-f32 | onednn-bf16");
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  std::map<std::pair<std::string, int>, uint64_t> first_bits;  // (product, library) -> C's hash
  for (int t : threads) {
    omp_set_num_threads(t);
    openblas_set_num_threads(t);
    bli_thread_set_num_threads(t);
    for (const Product& p : products) {
      Operands op;
      op.a.resize(static_cast<size_t>(p.M) * p.K), op.b.resize(static_cast<size_t>(p.K) * p.N);
      op.c.assign(static_cast<size_t>(p.M) * p.N, 0.f);
      std::mt19937 rng(7);  // the same operands on every thread count, for the bits check
      for (float& x : op.a) x = uniform(rng);
      for (float& x : op.b) x = uniform(rng);
      op.a16.resize(op.a.size()), op.b16.resize(op.b.size());
      for (size_t i = 0; i < op.a.size(); i++) op.a16[i] = shardtrain::float_to_bf16(op.a[i]);
      for (size_t i = 0; i < op.b.size(); i++) op.b16[i] = shardtrain::float_to_bf16(op.b[i]);
      OneDnnMatmul f32(p, false, engine);
      // oneDNN has no bf16 matmul without AVX-512 (an AVX2 CPU): that column is then left out.
      std::optional<OneDnnMatmul> bf16;
      try {
        bf16.emplace(p, true, engine);
      } catch (const dnnl::error&) {
      }
      const int library_count = bf16 ? 4 : 3;
      const int lda = p.trans_a ? p.M : p.K, ldb = p.trans_b ? p.K : p.N;
      const float beta = p.accumulate ? 1.f : 0.f;
      auto run = [&](int lib) {
        switch (lib) {
          case 0:
            shardtrain::cpu::gemm(p.trans_a, p.trans_b, p.M, p.N, p.K, 1.f, op.a.data(), lda, op.b.data(), ldb,
                                  beta, op.c.data(), p.N);
            break;
          case 1: {
            float alpha = 1.f, b = beta;
            // BLIS's typed API takes general strides: row-major is (row stride ld, column stride 1).
            bli_sgemm(p.trans_a ? BLIS_TRANSPOSE : BLIS_NO_TRANSPOSE, p.trans_b ? BLIS_TRANSPOSE : BLIS_NO_TRANSPOSE,
                      p.M, p.N, p.K, &alpha, op.a.data(), lda, 1, op.b.data(), ldb, 1, &b, op.c.data(), p.N, 1);
            break;
          }
          case 2: f32.run(stream, op.a.data(), op.b.data(), op.c.data()); break;
          case 3: bf16->run(stream, op.a16.data(), op.b16.data(), op.c.data()); break;
        }
      };
      const double flop = 2.0 * p.M * p.N * p.K;
      // Enough calls per timing to last ~20 ms, so small products are not timer noise.
      std::vector<int> calls(4, 1);
      for (int lib = 0; lib < library_count; lib++) {
        run(lib);
        auto t0 = Clock::now();
        run(lib);
        calls[lib] = std::max(1, static_cast<int>(0.02 / std::max(seconds_since(t0), 1e-6)));
      }
      std::vector<std::vector<double>> gflops(4);
      for (int r = 0; r < repeats; r++)
        for (int lib = 0; lib < library_count; lib++) {
          auto t0 = Clock::now();
          for (int c = 0; c < calls[lib]; c++) run(lib);
          gflops[lib].push_back(flop * calls[lib] / seconds_since(t0) / 1e9);
        }
      char dims[64];
      std::snprintf(dims, sizeof dims, " (%dx%dx%d)", p.M, p.N, p.K);
      std::printf("%-34s %3d |", (p.name + (p.name.rfind("square", 0) == 0 ? "" : dims)).c_str(), t);
      for (int lib = 0; lib < library_count; lib++) {
        Stats s = stats(gflops[lib]);
        std::printf(" %s %.1f/%.1f", libs[lib], s.min, s.median);
      }
      // The bits of each library's C from zero, against the first thread count's: whether the
      // library's own split over threads leaves the result alone.
      std::string bits;
      for (int lib = 0; lib < library_count; lib++) {
        std::fill(op.c.begin(), op.c.end(), 0.f);
        run(lib);
        const uint64_t hash = fnv1a(op.c);
        const auto [first, inserted] = first_bits.emplace(std::make_pair(p.name, lib), hash);
        if (!inserted)
          bits += std::string(bits.empty() ? "" : ", ") + libs[lib] + (first->second == hash ? " =" : " differ");
      }
      if (!bits.empty()) std::printf(" | bits vs %d thread%s: %s", threads.front(), threads.front() == 1 ? "" : "s",
                                     bits.c_str());
      std::printf("\n");
      std::fflush(stdout);
      if (p.name.rfind("square", 0) == 0 && t == threads.front())
        std::printf("  oneDNN kernels: f32 %s, bf16 %s\n", f32.impl().c_str(),
                    bf16 ? bf16->impl().c_str() : "none on this CPU");
    }
  }
  return 0;
}
