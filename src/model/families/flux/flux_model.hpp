// FLUX.1's and FLUX.2's transformer (flux_family.hpp) on explicit buffers, model/model.hpp's interface. Blocks
// 0..n_layer-1 are double-stream, the rest single-stream; the root unit holds the embedders and
// the output layers. The micro-batch (flux_family.hpp's names) enters in embed_forward; head_forward
// predicts the image tokens' values and hands them to the loss (a squared error against the
// batch's target unless set). docs/flux.md has the equations.
#pragma once

#include <array>
#include <vector>

#include "model/adapter_layers.hpp"
#include "model/families/flux/flux_family.hpp"
#include "model/model.hpp"

namespace shardtrain {

template <typename Real>
class FluxModel final : public TransformerModel<Real>, public Predictor<Real> {
 public:
  using Array = DeviceArray<Real>;
  // batch samples of image_tokens target tokens (the predicted ones), then config.condition_len
  // condition tokens (Kontext), and config.context_len text tokens each. activation_dtype: how the
  // activations the backward reads -- the block inputs (the residual streams between blocks, what
  // checkpointing keeps) and the tensors inside each block -- are kept (fsdp.activation_dtype: fp32,
  // or bf16 | fp16 rounded where each is made).
  FluxModel(const ParamTable& table, int batch, int image_tokens, Checkpointing activation_checkpointing,
            const LayerOps<Real>& ops, DType activation_dtype = DTYPE_FP32);

  // The elements of every array the constructor allocates, in its order, in Reals (a 16-bit
  // array's counted as the Reals its bytes fill): the planner's list (the same function lays out
  // both).
  static std::vector<size_t> buffer_elements(const ModelConfig& config, int batch, int image_tokens,
                                             Checkpointing activation_checkpointing,
                                             DType activation_dtype = DTYPE_FP32);
  // Adapter dropout's keys: a run per kind of row (the image tokens, the text tokens, the joint
  // sequence, the samples).
  static int dropout_key_rows(const ModelConfig& config, int batch, int image_tokens);

  int batch() const override { return d_.B; }
  int seq_len() const override { return d_.T; }
  size_t activation_bytes() const override { return bytes_ + adapter_bytes_; }
  int output_rows() const override { return d_.B * d_.T; }
  int output_width() const override { return d_.IN; }

  void embed_forward(const Real* root, const Batch& batch) override;
  void block_forward(int block, const Real* weights) override;
  void head_forward(const Real* root, const Batch& batch, double* loss_total) override;
  void head_backward(Real* root_grad, const Real* root, Real dloss) override;
  void block_backward(int block, Real* grads, const Real* weights) override;
  void embed_backward(Real* root_grad) override;
  // Adapter dropout: the trainer's keys (one per target token) expanded to every kind of row.
  void set_dropout_keys(const uint64_t* keys) override;
  Predictor<Real>* predictor() override { return this; }
  const Real* row_losses() const override { return buf_.losses.data(); }
  // The target tokens' predicted velocity (B*T x in_channels), the output layers after the blocks.
  const Real* predict(const Real* root) override;

 protected:
  Loss<Real>& own_loss() override { return squared_error_; }

 private:
  // T target (predicted) image tokens and N image tokens in all (with Kontext's condition tokens),
  // L text tokens, S = L + N joint tokens per sample.
  // F the MLPs' hidden width, FH their first product's (F; FLUX.2's gate | up: 2F), SW a single
  // block's MLP (FLUX.2: fused q|k|v|MLP) input product's, A the position ids' coordinates.
  struct Dims {
    int B, T, N, L, S, C, H, D, IN, X, P, F, FH, SW, A, double_blocks, single_blocks;
    bool guidance, flux2;
    Real eps;
  };
  static Dims dims_of(const ModelConfig& c, int batch, int image_tokens);
  // Adapter dropout's keys (flux_model.cpp's FluxKeyRun): where a kind of row's start, and the
  // selection of a product's before its adapters run.
  size_t dropout_key_first(int run) const;
  void select_dropout_keys(int block, int product);

  // An array of a block's activations. Each block's arrays are carved from regions (Carver): one
  // working set shared by every block -- the double and the single blocks are never live at once,
  // as each block's backward begins by recomputing or widening back its own -- and, for each block
  // that keeps its activations (does not recompute), its own fp32 and 16-bit regions for what its
  // backward reads. `half`: a kept tensor's 16-bit copy (16-bit activations of a keeping block).
  struct Span {
    Real* ptr = nullptr;
    size_t n = 0;
    uint16_t* half = nullptr;
    Real* data() const { return ptr; }
    size_t size() const { return n; }
  };
  // q, k, v of a stream (before the q/k norms), the normed q and k and the norms' statistics.
  struct Attention {
    Span q, k, v, qn, kn, q_rstd, k_rstd;
  };
  // One stream (image or text) of a double-stream block: its modulation, normed inputs, attention
  // inputs, its rows of the attention output, the gated sums and the MLP.
  struct Stream {
    Span mod, xn, mean1, rstd1;
    Attention att;
    Span y, a, x2, xn2, mean2, rstd2, h, g, f;
  };
  // `kept`: the tensors the backward reads, in carving order (Carver::kept).
  struct DoubleLayer {
    Stream s[2];  // image, text
    Span qkv, y, lse;  // the joint sequence [text; image]
    std::vector<Span> kept;
  };
  // m: the MLP's input product (FLUX.2: its gate | up columns of the fused product); cat: the
  // output product's input [attention | MLP]
  struct SingleLayer {
    Span mod, hn, mean, rstd;
    Attention att;
    Span qkv, y, lse, m, cat, p;
    std::vector<Span> kept;
  };
  // Carves one block's arrays, by what the backward does with them:
  //   scratch(n): only the forward reads it (or the backward makes it again): the shared working set;
  //   stat(n): a small fp32 array the backward reads (row statistics, FLUX.1's modulations);
  //   kept(n): a large tensor the backward reads, rounded where it is made in 16 bits (keep()).
  // A recomputing block's are all scratch (its backward recomputes it first). A keeping block's
  // stat and fp32 kept tensors are its own; a 16-bit kept tensor computes in the working set and
  // keeps a copy in the block's 16-bit region. Null bases count sizes only.
  struct Carver {
    Real* shared = nullptr;
    Real* own = nullptr;
    uint16_t* own_half = nullptr;
    bool recomputing = false, half = false;
    std::vector<Span>* kept_list = nullptr;
    size_t shared_used = 0, own_used = 0, half_used = 0;
    Span scratch(size_t n) { return take(shared, shared_used, n); }
    Span stat(size_t n) { return recomputing ? scratch(n) : take(own, own_used, n); }
    Span kept(size_t n);

   private:
    static Span take(Real* base, size_t& used, size_t n);
  };
  static void carve(DoubleLayer& a, const Dims& d, Carver& take);
  static void carve(SingleLayer& a, const Dims& d, Carver& take);
  // A stream's block inputs (index i: block i's input; the last, the last block's output). In
  // fp32 an array per index. In 16 bits two fp32 arrays that the blocks alternate between (block
  // i reads i % 2 and writes the other) and a 16-bit copy per index but the last: an output is
  // rounded where it is made (the next block computes from the numbers its backward will see, as a
  // network in 16 bits does) and widened back before its block's backward. The last index is no
  // block's input (the head's, or the double blocks' output, which the joined sequence's first
  // index rounds and keeps): neither rounded nor kept.
  struct BlockInputs {
    std::vector<Array> work;
    std::vector<DeviceArray<uint16_t>> half;
  };
  // Every array, laid out by lay_out.
  struct Buffers {
    Array in_img, in_txt, in_pooled, t_proj, g_proj, target, rope_cos, rope_sin;
    Array t_h, t_a, g_h, g_a, p_h, p_a, part, temb, temb_silu;
    Array shared_mod[3], d_shared_mod[3];  // FLUX.2: the root's modulations (image, text, single) and their gradients
    BlockInputs img, txt, joint;
    std::vector<Array> regions;          // the shared working set, then each block's own (Carver)
    std::vector<DeviceArray<uint16_t>> half_regions;  // each block's 16-bit copies
    std::vector<DoubleLayer> doubles;    // one per keeping block, one shared by the recomputing blocks
    std::vector<SingleLayer> singles;
    Array x_final, mod_out, xo, xo_mean, xo_rstd, out, losses;
    // backward scratch, shared by every block (d_h and d_g also the single blocks' forward scratch;
    // d_gate_up: FLUX.2's single blocks' MLP gradient before it joins the fused product's). Arrays
    // never live at once share memory, in a block's backward in this order: d_cat (until d_y and
    // d_g are copied out of it), d_qkv (the attention's gradient until d_q, d_k and d_v are copied
    // out of it) and d_gate_up in d_wide; d_y (until the attention's backward has read it), then
    // d_q.
    Array d_img, d_txt, d_joint, d_mod, d_silu, d_small, d_small2, d_a, d_y, d_k, d_v, d_q_pre, d_k_pre, d_xn, d_tmp,
        d_h, d_g, d_wide, d_xo, d_final;
    Span d_q, d_qkv, d_cat, d_gate_up;
  };
  // Assigns every array of `b` in one fixed order from take(elements) and take_half(elements):
  // the constructor's allocation and buffer_elements' count.
  template <typename Take, typename TakeHalf>
  static void lay_out(Buffers& b, const Dims& d, Checkpointing checkpointing, DType activation_dtype, Take&& take,
                      TakeHalf&& take_half);
  // The Reals a 16-bit array of n elements is counted as, and the elements it is allocated with
  // (as many as fill those Reals: the planner's bytes exactly).
  static size_t half_as_reals(size_t n) { return (2 * n + sizeof(Real) - 1) / sizeof(Real); }
  // Block input i of a stream (BlockInputs), where its producer writes and its block reads.
  Real* input(BlockInputs& s, int i) { return s.half.empty() ? s.work[i].data() : s.work[i % 2].data(); }
  // Input i has been written: with 16 bits, rounded and kept (but the last). restore: widened back
  // before its block's backward. Both no-ops in fp32.
  void keep_input(BlockInputs& s, int i);
  void restore_input(BlockInputs& s, int i);

  // A kept tensor has been written: in 16 bits, rounded in place (and its copy kept, in a keeping
  // block), so the forward goes on from the numbers the backward will see. fp32: nothing.
  void keep(const Span& s);
  // Before a keeping block's backward: its kept tensors widened back into the working
  // set (16 bits; nothing in fp32, where they are the block's own).
  void restore(const std::vector<Span>& kept);
  DoubleLayer& double_layer(int l) { return buf_.doubles[doubles_.set(l)]; }
  SingleLayer& single_layer(int j) { return buf_.singles[singles_.set(j)]; }
  // Host floats of the batch's tensor `name` (numel elements) into a device array.
  void upload(Array& dst, const Batch& batch, const char* name);
  // The sinusoid of 1000 x each sample's value of `name` into dst (B x 256).
  void upload_sinusoid(Array& dst, const Batch& batch, const char* name);
  void upload_rope(const Batch& batch);
  // Joins (B, n, C) rows of a stream into the (B, joint_rows, C') rows of a joint sequence (0: the
  // S of [text; image]) at `offset` within the sequence and `column` within a row, or splits them
  // back out.
  void join(Real* joint, int joint_width, int column, const Real* stream, int n, int offset, int joint_rows = 0);
  void split(Real* stream, const Real* joint, int joint_width, int column, int n, int offset, int joint_rows = 0);

  // recompute: checkpointing's second forward of the block, in its backward (its output is not
  // kept again, the joined streams not joined again).
  void double_forward(int l, const Real* w, bool recompute = false);
  void single_forward(int j, const Real* w, bool recompute = false);
  void double_backward(int l, Real* g, const Real* w);
  void single_backward(int j, Real* g, const Real* w);
  // A parameter of a unit by its position in the layout (null where the variant has none), and its gradient.
  const Real* at(const Real* w, int unit, int position) const;
  Real* grad_at(Real* g, int unit, int position) const;
  // Block `block`'s linear layer `product` (`lin`: its weight's and bias's positions in the unit) on
  // `rows` rows of x, with its adapters: out (rows, width).
  void linear_forward(int block, int product, Real* out, const Real* x, int rows, int in, int width, const Real* w,
                      FluxLinear lin);
  // Its backward: dx (rows, in) written, the adapters' part added; parameter gradients accumulate.
  void linear_backward(int block, int product, Real* dx, const Real* x, const Real* dout, int rows, int in, int width,
                       Real* g, const Real* w, FluxLinear lin);
  // A root linear layer without adapters, and its backward.
  void root_linear_forward(Real* out, const Real* x, int rows, int in, int width, FluxLinear lin);
  void root_linear_backward(Real* dx, const Real* x, const Real* dout, int rows, int in, int width, Real* g,
                            FluxLinear lin);
  // The q/k norms of a stream: att.q and att.k (rows, C), kept, normed per head into att.qn, att.kn.
  void qk_norm_forward(int block, Attention& att, int rows, const Real* w, int norm_q, int norm_k);
  // Their backward from d_q, d_k into d_q_pre, d_k_pre.
  void qk_norm_backward(int block, const Attention& att, int rows, Real* g, const Real* w, int norm_q, int norm_k);
  // q, k, v of `x` (rows), q and k normed per head: the attention inputs of a stream (products
  // q_product, +1, +2).
  void qkv_forward(int block, int q_product, Attention& att, const Real* x, int rows, const Real* w,
                   const FluxLayout::Stream& lin);
  // Their backward from d_q, d_k, d_v (the normed q, k and v's gradients): d_xn = the input's.
  void qkv_backward(int block, int q_product, const Real* x, const Attention& att, int rows, Real* g, const Real* w,
                    const FluxLayout::Stream& lin);
  // The modulation product's gradient into its weights and the conditioning's (d_silu +=).
  void modulation_backward(int block, int product, const Real* d_mod, int width, Real* g, const Real* w,
                           FluxLinear lin);
  // The MLP's activation (GELU; FLUX.2: SwiGLU of gate | up) of `rows` rows of h (FH wide) into g (F wide),
  // rounded as a kept tensor (keep()): the backward makes it again rather than keeping it.
  void mlp_activation_forward(const Span& g, const Real* h, int rows);
  void mlp_activation_backward(Real* dh, const Real* dg, const Real* h, int rows);
  // A modulation's rows: stream s's of a double block (0 image, 1 text) or a single block's (s = 2).
  const Real* modulation(int s, const Real* own) const { return d_.flux2 ? buf_.shared_mod[s].data() : own; }
  void single_fused_forward(SingleLayer& a, int block, const Real* w);
  // A single block's output product's input cat = [y | the MLP's activation of m], in the forward
  // and again before its backward (the activation rounded as a kept tensor).
  void join_cat(SingleLayer& a);
  void single_fused_backward(SingleLayer& a, int block, Real* g, const Real* w);

  const ParamTable& table_;
  const LayerOps<Real>& ops_;
  Dims d_;
  FluxLayout lay_;  // where each layer's parameters are
  CheckpointedRun doubles_, singles_;  // which double and single blocks recompute, where each keeps its set
  DType activation_dtype_;
  size_t bytes_ = 0, adapter_bytes_ = 0;
  ModelAdapters<Real> adapters_;  // around every linear layer of the blocks (model/adapter_layers.hpp)
  Buffers buf_;
  const Real* root_ = nullptr;  // the root unit, gathered from embed_forward to embed_backward
  std::vector<int> rope_axis_;      // per pair of head dimensions: its axis of the position ids
  std::vector<double> rope_freq_;   // and its frequency
  std::vector<float> rope_ids_;     // the ids the rotary tables hold ([text; image], 3 each)
  SquaredErrorLoss<Real> squared_error_;
  std::vector<uint64_t> dropout_keys_;  // host: every kind of row's keys, uploaded by set_dropout_keys
};

}  // namespace shardtrain
