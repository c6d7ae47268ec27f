// DoRA's per-output-feature arithmetic on the GPU (backend/cpu/ops.hpp's row_norms, column_affine
// and column_dot_accumulate; divide is pointwise.cu's elementwise template): the weight's row
// norms, the gains applied to a column slice of a fused product, and the magnitude's gradient.
//
// Deterministic, no atomics; sums in double as on the CPU, of widened floats, whose products are
// exact in double (24 + 24 bits), so the only difference from the CPU is double reassociation
// (~1e-16 relative) before the one rounding to float: the results agree with the CPU's but for
// a last-bit tie in rare elements, and repeat bit for bit.
//  - row_norms: one block of 256 threads per row; thread t adds columns t, t + 256, ... in order,
//    then block_sum's fixed shuffle tree (common.cuh); sqrt in double, one rounding to float.
//  - column_dot_accumulate: column_sums_accumulate's two stages (common.cuh) in double: rows cut
//    into column_chunks(rows) (a function of rows only), 32 columns x 8 row-lanes per block, lane
//    y adding rows y, y + 8, ... of its chunk, lanes combined in order into a double partial per
//    (chunk, column) in the caller's workspace; then lane y adds chunks y, y + 8, ... in order,
//    the lanes in order, and the total / divisor (double) is rounded once and added to out.
//  - column_affine: one thread per column, looping over rows (scale and shift stay in registers);
//    y = fmaf(scale, y - shift, shift): the CPU's expression as GCC contracts it with
//    -march=native on FMA hardware (the C++ default -ffp-contract=fast).
//  - scale_rows: one thread per element (grid-stride), (scale[r] + offset) * y: two roundings, as
//    the CPU's (a sum, then a product: nothing to contract), so the bits are the CPU's.
// Strided operands (ld > cols: a column slice of a wider product) need only 4-byte alignment:
// scalar loads, a warp reading 32 consecutive floats of a row.
#include "common.cuh"

namespace shardtrain::kernels {
namespace {

constexpr int kRowThreads = 256;
constexpr int kAffineMaxThreads = 256;

__global__ void row_norms_kernel(float* out, const float* x, int cols) {
  __shared__ double shared[kWarpSize];
  const float* row = x + static_cast<size_t>(blockIdx.x) * cols;
  double acc = 0.0;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    const double v = static_cast<double>(row[c]);
    acc += v * v;
  }
  acc = block_sum(acc, shared);
  if (threadIdx.x == 0) out[blockIdx.x] = __double2float_rn(sqrt(acc));
}

// y[r*ld + c] = scale[c] * (y[r*ld + c] - b) + b, b = shift ? shift[c] : 0 (+0, as the CPU's, so
// a -0 product still becomes +0). Rows blockIdx.y, blockIdx.y + gridDim.y, ...
__global__ void column_affine_kernel(float* y, int ld, int rows, int cols, const float* scale, const float* shift) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  const float s = scale[c], b = shift ? shift[c] : 0.0f;
  for (int r = blockIdx.y; r < rows; r += gridDim.y) {
    float* p = y + static_cast<size_t>(r) * ld + c;
    *p = fmaf(s, __fsub_rn(*p, b), b);
  }
}

// y[r*cols + c] = (scale[r] + offset) * y[r*cols + c], grid-stride over the rows*cols elements.
__global__ void scale_rows_kernel(float* y, size_t n, int cols, const float* scale, float offset) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    y[i] = __fmul_rn(__fadd_rn(scale[i / cols], offset), y[i]);
}

// Stage 1: partial[chunk * cols + c] = sum over the chunk's rows of a[r, c] * b[r, c] (double).
__global__ void column_dot_partial_kernel(double* partial, const float* a, int lda, const float* b, int ldb, int rows,
                                          int cols, int rows_per_chunk) {
  __shared__ double lanes[kColumnSumRowLanes][kWarpSize];
  const int c = blockIdx.x * kWarpSize + threadIdx.x;
  const int chunk = blockIdx.y;
  const int lo = chunk * rows_per_chunk, hi = min(rows, lo + rows_per_chunk);
  double acc = 0.0;
  if (c < cols)
    for (int r = lo + threadIdx.y; r < hi; r += kColumnSumRowLanes)
      acc += static_cast<double>(a[static_cast<size_t>(r) * lda + c]) *
             static_cast<double>(b[static_cast<size_t>(r) * ldb + c]);
  lanes[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    double total = 0.0;
    for (int lane = 0; lane < kColumnSumRowLanes; lane++) total += lanes[lane][threadIdx.x];
    partial[static_cast<size_t>(chunk) * cols + c] = total;
  }
}

// Stage 2: out[c] += float(sum of the chunks' partials / divisor[c]), the CPU's roundings: the
// quotient in double, rounded once to float, then one float addition.
__global__ void column_dot_finish_kernel(float* out, const double* partial, int chunks, int cols,
                                         const float* divisor) {
  __shared__ double lanes[kColumnSumRowLanes][kWarpSize];
  const int c = blockIdx.x * kWarpSize + threadIdx.x;
  double acc = 0.0;
  if (c < cols)
    for (int chunk = threadIdx.y; chunk < chunks; chunk += kColumnSumRowLanes)
      acc += partial[static_cast<size_t>(chunk) * cols + c];
  lanes[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    double total = 0.0;
    for (int lane = 0; lane < kColumnSumRowLanes; lane++) total += lanes[lane][threadIdx.x];
    const float quotient = __double2float_rn(__ddiv_rn(total, static_cast<double>(divisor[c])));
    out[c] = __fadd_rn(out[c], quotient);
  }
}

}  // namespace

void launch_row_norms(float* out, const float* x, int rows, int cols, const LaunchContext& ctx) {
  SHARD_CHECK(rows >= 0 && cols >= 0, "row_norms: rows=%d cols=%d", rows, cols);
  if (rows == 0) return;
  row_norms_kernel<<<static_cast<unsigned>(rows), kRowThreads, 0, ctx.stream>>>(out, x, cols);
  CUDA_CHECK_LAUNCH();
}

void launch_column_affine(float* y, int ld, int rows, int cols, const float* scale, const float* shift,
                          const LaunchContext& ctx) {
  SHARD_CHECK(rows >= 0 && cols >= 0 && ld >= cols, "column_affine: rows=%d cols=%d ld=%d", rows, cols, ld);
  if (rows == 0 || cols == 0) return;
  // A block covers up to 256 consecutive columns (fewer for a narrow slice); enough row blocks to
  // fill the device. Every element is computed the same way whatever the grid.
  const int threads = static_cast<int>(std::min<size_t>(kAffineMaxThreads, ceil_div(cols, kWarpSize) * kWarpSize));
  const unsigned col_blocks = static_cast<unsigned>(ceil_div(cols, threads));
  const size_t fill = ceil_div(static_cast<size_t>(std::max(1, ctx.sm_count)) * 8, col_blocks);
  const unsigned row_blocks = static_cast<unsigned>(std::min<size_t>({static_cast<size_t>(rows), fill, 65535}));
  column_affine_kernel<<<dim3(col_blocks, row_blocks), threads, 0, ctx.stream>>>(y, ld, rows, cols, scale, shift);
  CUDA_CHECK_LAUNCH();
}

void launch_scale_rows(float* y, int rows, int cols, const float* scale, float offset, const LaunchContext& ctx) {
  SHARD_CHECK(rows >= 0 && cols >= 0, "scale_rows: rows=%d cols=%d", rows, cols);
  const size_t n = static_cast<size_t>(rows) * cols;
  if (n == 0) return;
  const size_t blocks = std::min<size_t>(ceil_div(n, kRowThreads), static_cast<size_t>(std::max(1, ctx.sm_count)) * 32);
  scale_rows_kernel<<<static_cast<unsigned>(blocks), kRowThreads, 0, ctx.stream>>>(y, n, cols, scale, offset);
  CUDA_CHECK_LAUNCH();
}

void launch_column_dot_accumulate(float* out, const float* a, int lda, const float* b, int ldb, int rows, int cols,
                                  const float* divisor, void* workspace, const LaunchContext& ctx) {
  SHARD_CHECK(rows >= 0 && cols >= 0 && lda >= cols && ldb >= cols,
              "column_dot_accumulate: rows=%d cols=%d lda=%d ldb=%d", rows, cols, lda, ldb);
  if (cols == 0) return;
  // rows = 0 still adds 0 / divisor[c] to out[c], as the CPU does (one chunk of no rows).
  const ColumnChunks ch = column_chunks(rows);
  double* partial = static_cast<double*>(workspace);
  const dim3 block(kWarpSize, kColumnSumRowLanes);
  const dim3 grid(static_cast<unsigned>(ceil_div(static_cast<size_t>(cols), kWarpSize)),
                  static_cast<unsigned>(ch.chunks));
  column_dot_partial_kernel<<<grid, block, 0, ctx.stream>>>(partial, a, lda, b, ldb, rows, cols, ch.rows_per_chunk);
  CUDA_CHECK_LAUNCH();
  column_dot_finish_kernel<<<grid.x, block, 0, ctx.stream>>>(out, partial, ch.chunks, cols, divisor);
  CUDA_CHECK_LAUNCH();
}

}  // namespace shardtrain::kernels
