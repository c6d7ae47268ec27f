// Self-attention with grouped-query heads (causal, or over every position: a diffusion
// transformer's joint attention), its one-query-row form against a key/value cache
// (generation), and the rotary embeddings applied to its q and k (rotate_half pairs, FLUX's
// interleaved pairs).
//
// Training attention is tiled (flash-attention's algorithm) so that no T x T matrix exists: memory
// is O(T) -- the output, each query row's log-sum-exp, and per-thread tiles.
// Forward: one (batch, query head, query tile) per task. For the key tiles up to the diagonal in
// order: scores S = scale q k^T (a GEMM), an online softmax (running row max m and sum l; when m
// grows, the partial output and l are rescaled by exp(m_old - m_new)), out += P v (a GEMM). At the
// end out /= l and lse = m + log(l) is saved.
// Backward: D = rowsum(dout * out) per query row, then two passes that each recompute the
// probabilities P = exp(S - lse) of their tiles: dK and dV by key tiles (one task per (batch,
// query head, key tile), summing all later query tiles in a fixed order), and dQ by query tiles
// (one task per (batch, query head, query tile), summing the key tiles in order). dS = P * (dP - D)
// with dP = dout v^T. One pass does both with a task per (batch, query head): it walks the key
// tiles in order and adds each tile pair's dQ share as it goes, 5 products a pair instead of 7,
// with the two passes' very products. The heads that fill whole rounds of the threads take one
// pass, the rest two (their small tasks share out the last round). Grouped heads share dK and dV:
// each query head's share goes to its own rows (the group's first head straight into dqkv, the
// others into a buffer of (NH - KV) heads), summed over the group in head order at the end.
// Every output element is computed by one task in a fixed order (a grouped dK or dV: by its heads'
// tasks, then summed in head order by a fixed reduction), with single-threaded GEMMs inside the
// parallel loop: no atomics, the same bits for any thread count (the tasks are scheduled
// dynamically, largest first, for the causal imbalance; which thread runs a task does not change
// its arithmetic).
// Decode: one (new token, query head) pair per iteration, scores, softmax and the weighted sum of v
// as plain loops over the cached positions (a row, not a matrix: no GEMM to gain from).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "backend/cpu/gemm.hpp"
#include "backend/cpu/ops.hpp"
#include "backend/math.hpp"
#include "core/error.hpp"

namespace shardtrain::cpu {
namespace {

// Where one (batch, head) lives in the token-major rows: qkv's q|k|v (row elements apart) and the
// (B,T,NH*HS) output and its gradient (C apart), lse and D (B,NH,T).
struct HeadView {
  int T, NH, KV, HS, row, C, group;
  size_t q_offset(int b, int h) const { return static_cast<size_t>(b) * T * row + static_cast<size_t>(h) * HS; }
  size_t k_offset(int b, int kv) const { return q_offset(b, NH + kv); }
  size_t v_offset(int b, int kv) const { return q_offset(b, NH + KV + kv); }
  size_t y_offset(int b, int h) const { return static_cast<size_t>(b) * T * C + static_cast<size_t>(h) * HS; }
  size_t stat_offset(int b, int h) const { return (static_cast<size_t>(b) * NH + h) * T; }
};

HeadView head_view(int T, int NH, int KV, int HS) {
  SHARD_CHECK(T >= 0 && NH > 0 && KV > 0 && HS > 0 && NH % KV == 0, "attention: T=%d NH=%d KV=%d HS=%d", T, NH, KV,
              HS);
  return {T, NH, KV, HS, (NH + 2 * KV) * HS, NH * HS, NH / KV};
}

int tiles_of(int n, int tile) { return (n + tile - 1) / tile; }

// Which keys each query row of one sequence sees: causally s <= t, and with documents (`first`,
// the sequence's T entries of doc_start) s >= first[t], the first position of row t's document.
struct RowMask {
  bool causal;
  const int* first;  // nullptr: no documents
  int lo(int t) const { return first ? first[t] : 0; }
  // The visible keys [begin, end) of row t within the tile of keys [k0, k0 + nk), as tile columns.
  int begin(int t, int k0, int nk) const { return first ? std::clamp(first[t] - k0, 0, nk) : 0; }
  int end(int t, int k0, int nk) const { return causal ? std::clamp(t - k0 + 1, 0, nk) : nk; }
};

// The keys a query tile [t0, t0 + nq) attends to: from its first row's document (documents only
// move forward along a sequence), to its last row's position, causally. The first key tile starts
// on a tile boundary, so that without documents the tiles are those of [0, end).
int keys_begin(const RowMask& mask, int t0, int BK) { return mask.lo(t0) / BK * BK; }
int keys_end(int t0, int nq, int T, bool causal) { return causal ? t0 + nq : T; }

// P = exp(S - lse_t) on the visible keys of each of the nq rows of the (nq, nk) tile, 0 elsewhere.
template <typename Real>
void probabilities(Real* p, int nq, int nk, int t0, int k0, const Real* lse, const RowMask& mask) {
  for (int i = 0; i < nq; i++) {
    Real* r = p + static_cast<size_t>(i) * nk;
    const int a = mask.begin(t0 + i, k0, nk), e = std::max(a, mask.end(t0 + i, k0, nk));
    const Real shift = lse[i];
    for (int j = 0; j < a; j++) r[j] = 0;
#pragma omp simd
    for (int j = a; j < e; j++) r[j] = exp_fast(r[j] - shift);
    for (int j = e; j < nk; j++) r[j] = 0;
  }
}

// dS = P * (dP - D_t) in place on dP (P is 0 where masked, so dS is too).
template <typename Real>
void score_gradient(Real* dp, const Real* p, int nq, int nk, const Real* D) {
  for (int i = 0; i < nq; i++) {
    Real* d = dp + static_cast<size_t>(i) * nk;
    const Real* r = p + static_cast<size_t>(i) * nk;
    const Real Di = D[i];
#pragma omp simd
    for (int j = 0; j < nk; j++) d[j] = r[j] * (d[j] - Di);
  }
}

}  // namespace

template <typename Real>
void attention_forward(Real* out, Real* lse, const Real* qkv, int B, int T, int NH, int KV, int HS,
                       AttentionTiles tiles, bool causal, const int* doc_start) {
  SHARD_CHECK(causal || !doc_start, "attention_forward: documents need the causal mask");
  const HeadView V = head_view(T, NH, KV, HS);
  const Real scale = Real(1) / std::sqrt(Real(HS));
  const int BQ = tiles.query, BK = tiles.key, q_tiles = tiles_of(T, BQ), tasks = B * NH * q_tiles;
#pragma omp parallel
  {
    std::vector<Real> s(static_cast<size_t>(BQ) * BK), acc(static_cast<size_t>(BQ) * HS), m(BQ), l(BQ);
    std::vector<char> started(BQ);
#pragma omp for schedule(dynamic, 1)
    for (int task = 0; task < tasks; task++) {
      const int qt = q_tiles - 1 - task % q_tiles, bh = task / q_tiles, b = bh / NH, h = bh % NH;  // last tiles first
      const int t0 = qt * BQ, nq = std::min(BQ, T - t0), kv = h / V.group;
      const RowMask mask{causal, doc_start ? doc_start + static_cast<size_t>(b) * T : nullptr};
      const Real* q = qkv + V.q_offset(b, h) + static_cast<size_t>(t0) * V.row;
      const Real* k = qkv + V.k_offset(b, kv);
      const Real* v = qkv + V.v_offset(b, kv);
      std::fill(acc.begin(), acc.begin() + static_cast<size_t>(nq) * HS, Real(0));
      std::fill(started.begin(), started.end(), 0);
      const int k_end = keys_end(t0, nq, T, causal);  // causally, keys past the tile's last query are masked
      for (int k0 = keys_begin(mask, t0, BK); k0 < k_end; k0 += BK) {
        const int nk = std::min(BK, k_end - k0);
        gemm(false, true, nq, nk, HS, scale, q, V.row, k + static_cast<size_t>(k0) * V.row, V.row, Real(0), s.data(),
             nk);
        for (int i = 0; i < nq; i++) {
          Real* r = s.data() + static_cast<size_t>(i) * nk;
          const int a = mask.begin(t0 + i, k0, nk), n = mask.end(t0 + i, k0, nk);
          if (a >= n) {  // a tile before this row's document (or past it): nothing seen, m and l stay
            std::fill(r, r + nk, Real(0));
            continue;
          }
          // A row's first tile with a visible key makes m finite. Without documents that is the
          // first key tile, which holds key 0.
          Real row_max = started[i] ? m[i] : r[a];
#pragma omp simd reduction(max : row_max)
          for (int j = a; j < n; j++) row_max = std::max(row_max, r[j]);
          Real sum = 0;
          for (int j = 0; j < a; j++) r[j] = 0;
#pragma omp simd reduction(+ : sum)
          for (int j = a; j < n; j++) {
            r[j] = exp_fast(r[j] - row_max);
            sum += r[j];
          }
          for (int j = n; j < nk; j++) r[j] = 0;
          if (!started[i]) {
            l[i] = sum;
            started[i] = 1;
          } else {
            const Real rescale = exp_fast(m[i] - row_max);
            l[i] = l[i] * rescale + sum;
            Real* o = acc.data() + static_cast<size_t>(i) * HS;
            for (int d = 0; d < HS; d++) o[d] *= rescale;
          }
          m[i] = row_max;
        }
        gemm(false, false, nq, HS, nk, Real(1), s.data(), nk, v + static_cast<size_t>(k0) * V.row, V.row, Real(1),
             acc.data(), HS);
      }
      Real* o = out + V.y_offset(b, h) + static_cast<size_t>(t0) * V.C;
      Real* row_lse = lse + V.stat_offset(b, h) + t0;
      for (int i = 0; i < nq; i++) {
        const Real inv = Real(1) / l[i];
        for (int d = 0; d < HS; d++) o[static_cast<size_t>(i) * V.C + d] = acc[static_cast<size_t>(i) * HS + d] * inv;
        row_lse[i] = m[i] + std::log(l[i]);
      }
    }
  }
}

namespace {

// A tile pair's probabilities P = exp(S - lse) (into p) and score gradients dS = P * (dP - D) (into
// dp), (nq, nk) each: what every backward pass recomputes from q, k, v, dy and the forward's lse.
template <typename Real>
void tile_gradients(Real* p, Real* dp, const Real* q, const Real* dy, const Real* k, const Real* v, int nq, int nk,
                    int t0, int k0, const Real* lse, const Real* D, const RowMask& mask, const HeadView& V,
                    Real scale) {
  gemm(false, true, nq, nk, V.HS, scale, q, V.row, k, V.row, Real(0), p, nk);
  probabilities(p, nq, nk, t0, k0, lse, mask);
  gemm(false, true, nq, nk, V.HS, Real(1), dy, V.C, v, V.row, Real(0), dp, nk);  // dP = dy v^T
  score_gradient(dp, p, nq, nk, D);
}

// rows x n of src (rows src_stride apart) into, or with add onto, dst (dst_stride apart).
template <typename Real>
void put_rows(Real* dst, size_t dst_stride, const Real* src, size_t src_stride, int rows, int n, bool add) {
  for (int i = 0; i < rows; i++) {
    Real* d = dst + i * dst_stride;
    const Real* r = src + i * src_stride;
    if (!add) {
      std::memcpy(d, r, n * sizeof(Real));
      continue;
    }
#pragma omp simd
    for (int j = 0; j < n; j++) d[j] += r[j];
  }
}

// How many of the B * NH (sequence, query head) tasks take one pass; the rest take two. One pass
// makes 5 products of a tile pair where two make 7 (and one exp where two make two), but its task
// is a whole head: the heads that would leave threads idle in a last, partial round take two
// passes instead, whose tasks (a key tile or a query tile of a head) are small enough to share
// out over every thread. Both give the same bits, so the split may follow the thread count.
int one_pass_heads(int tasks, int threads, AttentionTiles tiles) {
  if (tiles.key % tiles.query != 0) return 0;  // its query tiles must be the dQ pass's
  if (tiles.passes != AttentionTiles::Passes::automatic) return tiles.passes == AttentionTiles::Passes::one ? tasks : 0;
  return tasks / threads * threads;
}

}  // namespace

template <typename Real>
void attention_backward(Real* dqkv, const Real* dout, const Real* qkv, const Real* out, const Real* lse, int B, int T,
                        int NH, int KV, int HS, AttentionTiles tiles, bool causal, const int* doc_start) {
  SHARD_CHECK(causal || !doc_start, "attention_backward: documents need the causal mask");
  const HeadView V = head_view(T, NH, KV, HS);
  const Real scale = Real(1) / std::sqrt(Real(HS));
  const int BQ = tiles.query, BK = tiles.key;
  // D[b,h,t] = dout . out of that head's row: the softmax backward's per-row sum, sum_s P dP.
  std::vector<Real> D(static_cast<size_t>(B) * NH * T);
#pragma omp parallel for collapse(2) schedule(static)
  for (int b = 0; b < B; b++)
    for (int h = 0; h < NH; h++)
      for (int t = 0; t < T; t++) {
        const Real* dy = dout + V.y_offset(b, h) + static_cast<size_t>(t) * V.C;
        const Real* y = out + V.y_offset(b, h) + static_cast<size_t>(t) * V.C;
        Real dot = 0;
        for (int d = 0; d < HS; d++) dot += dy[d] * y[d];
        D[V.stat_offset(b, h) + t] = dot;
      }

  const int k_tiles = tiles_of(T, BK), q_tiles = tiles_of(T, BQ);
  const int heads = B * NH, whole = one_pass_heads(heads, omp_get_max_threads(), tiles);
  // dK and dV shares of each group's heads after its first, (B, KV, group - 1, T, HS) each: every
  // row is written before it is summed.
  const size_t others = static_cast<size_t>(B) * (NH - KV) * T * HS;
  const std::unique_ptr<Real[]> dk_others(new Real[others]), dv_others(new Real[others]);
  const auto other_rows = [&](Real* base, int b, int h) {
    const int kv = h / V.group, g = h % V.group;
    return base + ((static_cast<size_t>(b) * KV + kv) * (V.group - 1) + (g - 1)) * T * HS;
  };
#pragma omp parallel
  {
    std::vector<Real> p(static_cast<size_t>(BQ) * BK), dp(p.size());
    std::vector<Real> dk(static_cast<size_t>(BK) * HS), dv(dk.size());
    // dq of a query tile (in dqkv) += dS k scale, the first of its key tiles writing it.
    const auto add_dq = [&](Real* dq, const Real* ds, const Real* k, int nq, int nk, bool first) {
      gemm(false, false, nq, HS, nk, scale, ds, nk, k, V.row, first ? Real(0) : Real(1), dq, V.row);
    };
    // Query head h's share of dK, dV of key tile [k0, k0 + nk), into dk and dv: every query tile with
    // a row that sees it (causally t >= k0; with documents, up to the first row whose document
    // starts after the tile). In one pass, each of those tile pairs also adds its share to dQ of the
    // query tile, straight into dqkv: the task owns the head of its sequence, and visits each query
    // tile's key tiles in the dQ pass's order. OpenBLAS's bits depend on a product's shape, so both
    // passes make every tile's products whole, masked rows and columns included: one pass then
    // repeats the two passes' products exactly.
    const auto key_tile = [&](int b, int h, int kt, bool with_dq) {
      const int k0 = kt * BK, nk = std::min(BK, T - k0), kv = h / V.group;
      const RowMask mask{causal, doc_start ? doc_start + static_cast<size_t>(b) * T : nullptr};
      int t_end = T;
      if (mask.first) t_end = static_cast<int>(std::lower_bound(mask.first, mask.first + T, k0 + nk) - mask.first);
      const Real* k = qkv + V.k_offset(b, kv) + static_cast<size_t>(k0) * V.row;
      const Real* v = qkv + V.v_offset(b, kv) + static_cast<size_t>(k0) * V.row;
      const int t_begin = causal ? k0 : 0;
      if (t_begin >= t_end) {  // no row sees the tile (only with documents): its gradients are 0
        std::fill(dk.begin(), dk.end(), Real(0));
        std::fill(dv.begin(), dv.end(), Real(0));
      }
      for (int t0 = t_begin; t0 < t_end; t0 += BQ) {
        const int nq = std::min(BQ, T - t0);
        const Real beta = t0 == t_begin ? Real(0) : Real(1);  // the first product writes dk, dv; the rest add
        const Real* q = qkv + V.q_offset(b, h) + static_cast<size_t>(t0) * V.row;
        const Real* dy = dout + V.y_offset(b, h) + static_cast<size_t>(t0) * V.C;
        tile_gradients(p.data(), dp.data(), q, dy, k, v, nq, nk, t0, k0, lse + V.stat_offset(b, h) + t0,
                       D.data() + V.stat_offset(b, h) + t0, mask, V, scale);
        gemm(true, false, nk, HS, nq, Real(1), p.data(), nk, dy, V.C, beta, dv.data(), HS);  // dv += P^T dy
        gemm(true, false, nk, HS, nq, scale, dp.data(), nk, q, V.row, beta, dk.data(), HS);  // dk += dS^T q scale
        if (with_dq)
          add_dq(dqkv + V.q_offset(b, h) + static_cast<size_t>(t0) * V.row, dp.data(), k, nq, nk,
                 k0 == keys_begin(mask, t0, BK));
      }
      // The share's rows: the group's first head's into dqkv, the others' into their own.
      const bool first = h % V.group == 0;
      const size_t stride = first ? V.row : HS, rows = static_cast<size_t>(k0) * stride;
      put_rows((first ? dqkv + V.k_offset(b, kv) : other_rows(dk_others.get(), b, h)) + rows, stride, dk.data(), HS,
               nk, HS, false);
      put_rows((first ? dqkv + V.v_offset(b, kv) : other_rows(dv_others.get(), b, h)) + rows, stride, dv.data(), HS,
               nk, HS, false);
    };
    // One pass for the first `whole` (sequence, head) tasks; threads that finish go on to the rest.
#pragma omp for schedule(dynamic, 1) nowait
    for (int task = 0; task < whole; task++)
      for (int kt = 0; kt < k_tiles; kt++) key_tile(task / NH, task % NH, kt, true);
    // Two passes for the rest: dK and dV by key tiles (first tiles first), then dQ of query tile
    // [t0, t0 + nq) from the key tiles it sees (causally up to the diagonal), in order.
#pragma omp for schedule(dynamic, 1) nowait
    for (int task = 0; task < (heads - whole) * k_tiles; task++) {
      const int bh = whole + task / k_tiles;
      key_tile(bh / NH, bh % NH, task % k_tiles, false);
    }
#pragma omp for schedule(dynamic, 1)
    for (int task = 0; task < (heads - whole) * q_tiles; task++) {
      const int qt = q_tiles - 1 - task % q_tiles, bh = whole + task / q_tiles, b = bh / NH, h = bh % NH;  // last first
      const int t0 = qt * BQ, nq = std::min(BQ, T - t0), kv = h / V.group;
      const RowMask mask{causal, doc_start ? doc_start + static_cast<size_t>(b) * T : nullptr};
      const Real* q = qkv + V.q_offset(b, h) + static_cast<size_t>(t0) * V.row;
      const Real* dy = dout + V.y_offset(b, h) + static_cast<size_t>(t0) * V.C;
      const int k_begin = keys_begin(mask, t0, BK), k_end = keys_end(t0, nq, T, causal);
      for (int k0 = k_begin; k0 < k_end; k0 += BK) {
        const int nk = std::min(BK, T - k0);
        const Real* k = qkv + V.k_offset(b, kv) + static_cast<size_t>(k0) * V.row;
        tile_gradients(p.data(), dp.data(), q, dy, k, qkv + V.v_offset(b, kv) + static_cast<size_t>(k0) * V.row, nq,
                       nk, t0, k0, lse + V.stat_offset(b, h) + t0, D.data() + V.stat_offset(b, h) + t0, mask, V,
                       scale);
        add_dq(dqkv + V.q_offset(b, h) + static_cast<size_t>(t0) * V.row, dp.data(), k, nq, nk, k0 == k_begin);
      }
    }
    // dK, dV of a grouped key/value head: its first query head's share plus the others', in order
    // (after the barrier that ends the dQ loop, which every thread reaches only after its share of
    // the loops before it).
    if (V.group > 1) {
#pragma omp for schedule(static)
      for (int task = 0; task < B * KV * k_tiles; task++) {
        const int bkv = task / k_tiles, b = bkv / KV, kv = bkv % KV, k0 = task % k_tiles * BK;
        const int nk = std::min(BK, T - k0);
        const size_t at = static_cast<size_t>(k0) * HS;
        for (int h = kv * V.group + 1; h < (kv + 1) * V.group; h++) {
          put_rows(dqkv + V.k_offset(b, kv) + static_cast<size_t>(k0) * V.row, V.row,
                   other_rows(dk_others.get(), b, h) + at, HS, nk, HS, true);
          put_rows(dqkv + V.v_offset(b, kv) + static_cast<size_t>(k0) * V.row, V.row,
                   other_rows(dv_others.get(), b, h) + at, HS, nk, HS, true);
        }
      }
    }
  }
}

template <typename Real>
void attention_decode(Real* out, Real* scratch, Real* k_cache, Real* v_cache, const Real* qkv, int Q, int start,
                      int NH, int KV, int HS, int window) {
  const int row = (NH + 2 * KV) * HS, group = NH / KV, C = NH * HS, KVC = KV * HS, T = start + Q;
  const Real scale = Real(1) / std::sqrt(Real(HS));
  for (int i = 0; i < Q; i++) {
    std::memcpy(k_cache + static_cast<size_t>(start + i) * KVC, qkv + static_cast<size_t>(i) * row + C,
                KVC * sizeof(Real));
    std::memcpy(v_cache + static_cast<size_t>(start + i) * KVC, qkv + static_cast<size_t>(i) * row + C + KVC,
                KVC * sizeof(Real));
  }
#pragma omp parallel for collapse(2) schedule(static)
  for (int i = 0; i < Q; i++) {
    for (int h = 0; h < NH; h++) {
      const int len = start + i + 1, kv = h / group, first = window > 0 ? std::max(0, len - window) : 0;
      const Real* q = qkv + static_cast<size_t>(i) * row + h * HS;
      Real* s = scratch + (static_cast<size_t>(i) * NH + h) * T;
      Real max = -std::numeric_limits<Real>::infinity();
      for (int p = first; p < len; p++) {
        const Real* k = k_cache + static_cast<size_t>(p) * KVC + kv * HS;
        Real dot = 0;
        for (int d = 0; d < HS; d++) dot += q[d] * k[d];
        s[p] = dot * scale;
        max = s[p] > max ? s[p] : max;
      }
      Real sum = 0;
      for (int p = first; p < len; p++) {
        s[p] = std::exp(s[p] - max);
        sum += s[p];
      }
      const Real inv = Real(1) / sum;
      Real* o = out + static_cast<size_t>(i) * C + h * HS;
      for (int d = 0; d < HS; d++) o[d] = 0;
      for (int p = first; p < len; p++) {
        const Real a = s[p] * inv;
        const Real* v = v_cache + static_cast<size_t>(p) * KVC + kv * HS;
        for (int d = 0; d < HS; d++) o[d] += a * v[d];
      }
    }
  }
}

// Turns every q and k head vector of each token by its position's angles; sign = -1 turns back.
// Element i < HS/2 pairs with i + HS/2 (Hugging Face's rotate_half), or (interleaved) element 2i
// with 2i + 1 (FLUX's).
template <typename Real>
void rope_turn(Real* qkv, const Real* cos, const Real* sin, int B, int T, int NH, int KV, int HS, Real sign,
               bool interleaved, const int* positions = nullptr) {
  const int row = (NH + 2 * KV) * HS, half = HS / 2;
  const int step = interleaved ? 2 : 1, partner = interleaved ? 1 : half;
#pragma omp parallel for schedule(static)
  for (int bt = 0; bt < B * T; bt++) {
    const size_t t = static_cast<size_t>(positions ? positions[bt] : bt % T);
    const Real* c = cos + t * half;
    const Real* s = sin + t * half;
    Real* r = qkv + static_cast<size_t>(bt) * row;
    for (int head = 0; head < NH + KV; head++) {  // the query heads, then the key heads
      Real* x = r + head * HS;
      for (int i = 0; i < half; i++) {
        Real& a = x[i * step];
        Real& b = x[i * step + partner];
        const Real lo = a, hi = b, si = sign * s[i];
        a = lo * c[i] - hi * si;
        b = hi * c[i] + lo * si;
      }
    }
  }
}

template <typename Real>
void rope_forward(Real* qkv, const Real* cos, const Real* sin, int B, int T, int NH, int KV, int HS,
                  const int* positions) {
  rope_turn(qkv, cos, sin, B, T, NH, KV, HS, Real(1), false, positions);
}

template <typename Real>
void rope_backward(Real* dqkv, const Real* cos, const Real* sin, int B, int T, int NH, int KV, int HS,
                   const int* positions) {
  rope_turn(dqkv, cos, sin, B, T, NH, KV, HS, Real(-1), false, positions);
}

template <typename Real>
void rope_pairs_forward(Real* qkv, const Real* cos, const Real* sin, int B, int T, int NH, int KV, int HS) {
  rope_turn(qkv, cos, sin, B, T, NH, KV, HS, Real(1), true);
}

template <typename Real>
void rope_pairs_backward(Real* dqkv, const Real* cos, const Real* sin, int B, int T, int NH, int KV, int HS) {
  rope_turn(dqkv, cos, sin, B, T, NH, KV, HS, Real(-1), true);
}

#define INSTANTIATE(Real)                                                                                       \
  template void attention_forward<Real>(Real*, Real*, const Real*, int, int, int, int, int, AttentionTiles, bool,  \
                                        const int*);                                                            \
  template void attention_backward<Real>(Real*, const Real*, const Real*, const Real*, const Real*, int, int, int, \
                                         int, int, AttentionTiles, bool, const int*);                           \
  template void attention_decode<Real>(Real*, Real*, Real*, Real*, const Real*, int, int, int, int, int, int);         \
  template void rope_forward<Real>(Real*, const Real*, const Real*, int, int, int, int, int, const int*);        \
  template void rope_backward<Real>(Real*, const Real*, const Real*, int, int, int, int, int, const int*);       \
  template void rope_pairs_forward<Real>(Real*, const Real*, const Real*, int, int, int, int, int);              \
  template void rope_pairs_backward<Real>(Real*, const Real*, const Real*, int, int, int, int, int);
INSTANTIATE(float)
INSTANTIATE(double)
#undef INSTANTIATE

}  // namespace shardtrain::cpu
