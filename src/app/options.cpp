// Declares every `train` option once (name, field, default, meaning) and derives from that one
// list the Boost parser, --help and the resolved INI. See options.hpp.
#include "app/options.hpp"

#include <algorithm>
#include <boost/program_options.hpp>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <iterator>
#include <map>
#include <set>
#include <sstream>
#include <type_traits>

#include "app/memory_plan.hpp"
#include "backend/gpu_memory.hpp"
#include "ckpt/checkpoint_manager.hpp"
#include "ckpt/hf_model.hpp"
#include "comm/runtime.hpp"
#include "core/error.hpp"
#include "data/token_file.hpp"
#include "shard/fsdp_engine.hpp"

namespace po = boost::program_options;

namespace shardtrain {
namespace {

// Text options hold paths and names; bounded so the resolved INI stays small enough for a checkpoint.
constexpr size_t MAX_OPTION_TEXT = 4096;
constexpr size_t MAX_RUN_NAME = 200;      // a folder name, with room for suffixes such as ".log"
constexpr size_t MAX_CONFIG_FILE = 16 << 20;

// The names of `choices`, comma-separated, for help texts and messages.
template <typename E, size_t N>
std::string choice_list(const E (&choices)[N], const char* (*choice_name)(E)) {
  std::string allowed;
  for (E e : choices) allowed += std::string(allowed.empty() ? "" : ", ") + choice_name(e);
  return allowed;
}

// The choice whose name is `text`; a UsageError naming `option` and what is allowed otherwise.
template <typename E, size_t N>
E choice_from_text(const std::string& text, const std::string& option, const E (&choices)[N],
                   const char* (*choice_name)(E)) {
  for (E e : choices)
    if (text == choice_name(e)) return e;
  throw UsageError(option + "='" + printable_text(text) + "' is not allowed; allowed: " +
                   choice_list(choices, choice_name));
}

struct OptionList {
  po::options_description desc{"train options (INI section.key, or --section.key=value)"};
  std::vector<std::pair<std::string, std::function<std::string()>>> printers;
  std::vector<std::pair<const char*, const double*>> reals;       // must be finite
  std::vector<std::pair<const char*, const std::string*>> texts;  // at most MAX_OPTION_TEXT bytes

  // 10 significant digits and true/false: readable in --help and exact enough in the INI record.
  template <typename T>
  static std::string text(const T& value) {
    std::ostringstream s;
    s << std::setprecision(10) << std::boolalpha << value;
    return s.str();
  }

  template <typename T>
  void add(const char* name, T* field, const char* help) {
    desc.add_options()(name, po::value<T>(field)->default_value(*field, text(*field)), help);
    printers.emplace_back(name, [field] { return text(*field); });
    if constexpr (std::is_same_v<T, double>) reals.emplace_back(name, field);
    if constexpr (std::is_same_v<T, std::string>) texts.emplace_back(name, field);
  }

  // Boost reads "-1" into an unsigned option as 2^64-1, so unsigned options are parsed strictly here.
  void add(const char* name, uint64_t* field, const char* help) {
    auto parse = [name, field](const std::string& v) { *field = parse_whole_number(v, name, 0, UINT64_MAX); };
    desc.add_options()(name, po::value<std::string>()->default_value(text(*field))->notifier(parse), help);
    printers.emplace_back(name, [field] { return text(*field); });
  }

  void add(const char* name, MemorySize* field, const char* help) {
    auto parse = [name, field](const std::string& v) { *field = parse_memory_limit(v, name); };
    desc.add_options()(name, po::value<std::string>()->default_value(field->text)->notifier(parse), help);
    printers.emplace_back(name, [field] { return field->text; });
  }

  // model.arch: the name of a registered model family (model/family.hpp); the help lists them.
  void add_family(const char* name, std::string* field) {
    auto parse = [name, field](const std::string& v) {
      if (!find_model_family(v))
        throw UsageError(std::string(name) + "='" + printable_text(v) + "' is not allowed; allowed: " +
                         model_family_names());
      *field = v;
    };
    std::string help = model_family_names() + ": the model family:";
    for (const ModelFamily* f : model_families()) help += std::string(" ") + f->name() + " = " + f->description() + ";";
    help.back() = '.';
    desc.add_options()(name, po::value<std::string>()->default_value(*field)->notifier(parse), help.c_str());
    printers.emplace_back(name, [field] { return *field; });
  }

  // One of `choices`, each written as name(choice); the help lists them.
  template <typename E, size_t N>
  void add_choice(const char* name, E* field, const E (&choices)[N], const char* (*choice_name)(E),
                  const std::string& help) {
    auto parse = [=](const std::string& v) { *field = choice_from_text(v, name, choices, choice_name); };
    desc.add_options()(name, po::value<std::string>()->default_value(choice_name(*field))->notifier(parse),
                       (choice_list(choices, choice_name) + ": " + help).c_str());
    printers.emplace_back(name, [field, choice_name] { return std::string(choice_name(*field)); });
  }
};

constexpr ShardingStrategy STRATEGIES[] = {SHARDING_FULL_SHARD, SHARDING_SHARD_GRAD_OP, SHARDING_NO_SHARD,
                                           SHARDING_HYBRID_SHARD};
constexpr DType DTYPES[] = {DTYPE_FP32, DTYPE_BF16, DTYPE_FP16};
constexpr SigmaSampling SIGMA_SAMPLINGS[] = {SIGMA_UNIFORM, SIGMA_LOGIT_NORMAL};
constexpr LrSchedule LR_SCHEDULES[] = {LR_COSINE, LR_LINEAR, LR_CONSTANT, LR_WSD};
constexpr BackwardPrefetch PREFETCHES[] = {BACKWARD_PREFETCH_NONE, BACKWARD_PREFETCH_PRE, BACKWARD_PREFETCH_POST};

// The single list of options. `c` holds the defaults on entry and receives parsed values.
void declare_options(OptionList& o, Config& c) {
  o.add_family("model.arch", &c.model.arch);
  o.add("model.n_layer", &c.model.n_layer, "transformer blocks (L)");
  o.add("model.n_embd", &c.model.n_embd, "width (C); a multiple of model.n_head");
  o.add("model.n_head", &c.model.n_head, "attention heads (H)");
  o.add("model.vocab_size", &c.model.vocab_size,
        "vocabulary size (V), at most 2^24 (token files hold 16-bit ids up to 65536, 32-bit ids above)");
  o.add("model.max_seq_len", &c.model.max_seq_len,
        "longest sequence: gpt2's rows of the position-embedding table, llama's max_position_embeddings");
  o.add("model.n_kv_head", &c.model.n_kv_head,
        "llama: key/value heads, a divisor of model.n_head (grouped-query attention); 0 = model.n_head");
  o.add("model.intermediate_size", &c.model.intermediate_size, "llama: width of the SwiGLU MLP; 0 = 4 x model.n_embd");
  o.add("model.head_dim", &c.model.head_dim,
        "llama: attention head size when not model.n_embd / model.n_head (Mistral-Nemo: 128 on 5120 / 32); 0 = that");
  o.add("model.rope_theta", &c.model.rope_theta, "llama, flux: base of the rotary embedding's frequencies");
  o.add("model.rope_scaling", &c.model.rope_scaling,
        "llama: scaled rotary frequencies (config.json's rope_scaling): empty for none, 'linear:factor=F', "
        "'dynamic:factor=F' (the plain frequencies at every length ShardTrain trains), "
        "'llama3:factor=F,low_freq_factor=A,high_freq_factor=B,original_max_position_embeddings=N' (Llama 3.1+) or "
        "'yarn:factor=F,original_max_position_embeddings=N' (optional attention_factor, beta_fast, beta_slow, "
        "truncate; Qwen's long context)");
  o.add("model.nope_layers", &c.model.nope_layers,
        "smollm3: the blocks without rotary embeddings (NoPE), comma-separated indices from 0 (SmolLM3: every "
        "fourth, 3,7,11,...); empty for none");
  o.add("model.sliding_window", &c.model.sliding_window,
        "llama families: each query sees itself and the model.sliding_window - 1 positions before it in every block "
        "(Mistral 7B v0.1: 4096); 0 = every earlier position");
  o.add("model.norm_eps", &c.model.norm_eps,
        "llama: RMSNorm epsilon; flux: its LayerNorms' and q/k RMSNorms' (FLUX.1: 1e-6); gpt2's LayerNorm has 1e-5");
  o.add("model.tie_embeddings", &c.model.tie_embeddings,
        "llama: the LM head is the token embedding (true) or its own lm_head.weight (false); gpt2 is tied");
  o.add("model.n_single_layer", &c.model.n_single_layer,
        "flux: single-stream blocks after the model.n_layer double-stream ones (FLUX.1: 19 + 38)");
  o.add("model.in_channels", &c.model.in_channels, "flux: channels of a packed latent token (16 VAE channels x 2 x 2)");
  o.add("model.context_dim", &c.model.context_dim, "flux: width of the text encoder's embeddings (T5-XXL: 4096)");
  o.add("model.context_len", &c.model.context_len, "flux: text tokens per sample (FLUX.1-dev 512, schnell 256)");
  o.add("model.pooled_dim", &c.model.pooled_dim, "flux: width of the pooled text vector (CLIP-L: 768)");
  o.add("model.pixel_patch", &c.model.pixel_patch,
        "flux: 0 for VAE latents; P > 0 for a pixel-space model whose tokens are P x P RGB patches "
        "(model.in_channels = 3 P^2; sample writes PNG files)");
  o.add("model.condition_len", &c.model.condition_len,
        "flux: Kontext's condition-image tokens per sample, after the train.seq_len target tokens (0: text to image)");
  o.add("model.guidance_embeds", &c.model.guidance_embeds,
        "flux: a guidance embedder (dev, Kontext: true; schnell: false)");
  o.add("model.rope_axes", &c.model.rope_axes,
        "flux: widths of the three rotary axes, adding up to the head size (FLUX.1: 16,56,56)");
  o.add_choice("flow.sigma_sampling", &c.flow.sigma_sampling, SIGMA_SAMPLINGS, sigma_sampling_name,
               "flux: how a sample's noise level is drawn (uniform in (0, 1), or the sigmoid of "
               "N(flow.logit_mean, flow.logit_std))");
  o.add("flow.logit_mean", &c.flow.logit_mean, "flux: logit_normal's mean");
  o.add("flow.logit_std", &c.flow.logit_std, "flux: logit_normal's standard deviation");
  o.add("flow.shift", &c.flow.shift,
        "flux: shifts noise levels towards noise, s sigma / (1 + (s - 1) sigma); 1 = none (SD3: 3)");
  o.add("flow.resolution_shift", &c.flow.resolution_shift,
        "flux: FLUX's shift by image size, exp(mu) with mu from 0.5 at 256 to 1.15 at 4096 image tokens "
        "(replaces flow.shift)");
  o.add("flow.guidance", &c.flow.guidance,
        "flux: the guidance value a model with a guidance embedder is trained with (FLUX.1-dev fine-tuning: 1)");
  o.add("flow.caption_dropout", &c.flow.caption_dropout,
        "flux: probability of training a sample on the empty caption (all-zero text and pooled embeddings), for "
        "classifier-free guidance (sample --cfg against an all-zero --negative; flow.sample_cfg); 0 = never");
  o.add("flow.sample_every", &c.flow.sample_every,
        "flux: draw flow.sample_prompts' images every N steps and at the end, into <checkpoint.dir>/samples/ "
        "(latents for tools/encode_images.py decode; a pixel-space model's also as a PNG grid); 0 = never");
  o.add("flow.sample_prompts", &c.flow.sample_prompts,
        "flux: HDF5 file of prompt embeddings (tools/encode_images.py prompts), model.context_len tokens each");
  o.add("flow.sample_condition", &c.flow.sample_condition,
        "flux, a Kontext model (model.condition_len > 0): HDF5 file of the images those samples edit, "
        "condition_latents of model.condition_len tokens (one, or one per prompt; tools/encode_images.py encode "
        "--condition-images writes them, and a Kontext latent shard holds them)");
  o.add("flow.sample_steps", &c.flow.sample_steps, "flux: Euler steps of those samples");
  o.add("flow.sample_guidance", &c.flow.sample_guidance, "flux: the guidance value of those samples");
  o.add("flow.sample_cfg", &c.flow.sample_cfg,
        "flux: classifier-free guidance scale of those samples against the empty caption (all zeros, what "
        "flow.caption_dropout trains); 1 = none");
  o.add("train.steps", &c.train.steps, "optimizer steps");
  o.add("train.epochs", &c.train.epochs,
        "instead of train.steps: passes over the training data (may be fractional); the steps are "
        "ceil(epochs x windows / global_batch), counted from the data at start");
  o.add("train.global_batch", &c.train.global_batch,
        "sequences per optimizer step; a multiple of micro_batch x ranks (the rest is gradient accumulation)");
  o.add("train.micro_batch", &c.train.micro_batch, "sequences per rank per forward/backward");
  o.add("train.seq_len", &c.train.seq_len, "tokens per training sequence, <= model.max_seq_len");
  o.add("train.lr", &c.train.lr, "peak learning rate");
  o.add_choice("train.lr_schedule", &c.train.lr_schedule, LR_SCHEDULES, lr_schedule_name,
               "after the warmup: cosine or linear from lr down to lr * min_lr_ratio at the last step, constant, or "
               "wsd (warmup-stable-decay: lr until the last train.decay_steps, a cosine down from there)");
  o.add("train.min_lr_ratio", &c.train.min_lr_ratio, "final learning rate of the decay, as a fraction of lr");
  o.add("train.warmup_steps", &c.train.warmup_steps, "linear warmup steps");
  o.add("train.decay_steps", &c.train.decay_steps,
        "lr_schedule=wsd: steps of the final decay (0 = a fifth of the steps after the warmup)");
  o.add("train.weight_decay", &c.train.weight_decay, "AdamW decoupled weight decay (not on norms and biases)");
  o.add("train.beta1", &c.train.beta1, "AdamW beta1");
  o.add("train.beta2", &c.train.beta2, "AdamW beta2");
  o.add("train.eps", &c.train.eps, "AdamW epsilon");
  o.add("train.grad_clip", &c.train.grad_clip, "clip the global gradient norm to this; 0 disables");
  o.add("train.seed", &c.train.seed, "seed of initialization and data order");
  o.add("train.eval_every", &c.train.eval_every, "validation every N steps and at the end; 0 = never");
  o.add("train.eval_batches", &c.train.eval_batches, "global batches per validation");
  o.add("train.metrics_file", &c.train.metrics_file,
        "JSON Lines metrics written by rank 0; empty = <run folder>/metrics.jsonl (the run folder is checkpoint.dir)");
  o.add("train.tensorboard_dir", &c.train.tensorboard_dir,
        "folder for TensorBoard event files written by rank 0 (loss, val loss, lr, grad norm, tokens/s, MFU, "
        "memory); empty = none");
  o.add("train.log_every", &c.train.log_every, "print a step line every N steps (and the first and last)");
  o.add("train.run_name", &c.train.run_name, "name of the run, used in logs");
  o.add("train.threads", &c.train.threads, "threads per rank; 0 = the cores available to the rank");
  o.add("train.op_times", &c.train.op_times,
        "time every layer op (GEMMs by shape, attention, norms, ...) on the device's clock and print rank 0's "
        "table per step at the end, from the second step on (true/false); costs two events or clock reads a call");
  o.add("train.peak_gflops", &c.train.peak_gflops,
        "per-rank peak GFLOP/s for MFU; 0 = measure SGEMM at start (cpu), the card's dense bf16 peak (cuda)");
  o.add("train.freeze", &c.train.freeze,
        "parameters not trained: comma-separated glob patterns over parameter names (fnmatch: * ? [0-5]), "
        "e.g. wte,h.[0-5].* (docs/freezing.md); frozen parameters get no gradients and no optimizer state");
  o.add("train.device", &c.train.device,
        "cpu (OpenBLAS + MPI) or cuda (one GPU per rank by node-local rank, NCCL; needs a make CUDA=1 build)");
  o.add_choice("train.attention", &c.train.attention, ATTENTION_KERNELS, attention_kernel_name,
               "train.device=cuda: the tiled fp32 attention kernels or cuDNN's fused scaled-dot-product attention "
               "(bf16 inputs, fp32 statistics); auto = cudnn with a 16-bit fsdp.param_dtype, tiled in fp32. The CPU has "
               "the tiled kernels only");
  o.add("data.train_file", &c.data.train_file,
        "training tokens: an llm.c .bin file, or comma-separated files and glob patterns read as one stream "
        "(docs/data.md)");
  o.add("data.val_file", &c.data.val_file, "validation tokens, the same forms; empty = no validation");
  o.add("data.tokenizer", &c.data.tokenizer,
        "the tokenizer.json the data was encoded with (data encode --tokenizer), recorded in checkpoints for "
        "'shardtrain generate'; checked at start (it must load, its ids within model.vocab_size); empty = bytes");
  o.add("data.documents", &c.data.documents,
        "sequences pack several documents: each position attends only to its own document's earlier positions "
        "(docs/data.md, \"Packed documents\"); false lets attention run across document boundaries, as llm.c does");
  o.add("data.document_start", &c.data.document_start,
        "with data.documents: the token id every document starts with; -1 = the one 'data encode' puts before "
        "each with data.tokenizer (its separator, or its template's BOS)");
  o.add("data.restart_positions", &c.data.restart_positions,
        "with data.documents: positions count from each document's start (GPT-2's position table, Llama's rotary "
        "angles), so a packed document is computed as if it were alone; false counts from the window's start");
  o.add_choice("adapter.type", &c.adapter.type, ADAPTER_TYPES, adapter_type_name,
               "adapters on the frozen base model, Hugging Face PEFT's LoRA, DoRA, LoHa, LoKr or OFT "
               "(docs/adapters.md); none trains the model itself");
  o.add("adapter.targets", &c.adapter.targets,
        "the linear layers adapted: comma-separated Hugging Face module paths or their dotted suffixes, e.g. "
        "attn.c_attn,mlp.c_fc (gpt2) or self_attn.q_proj,self_attn.v_proj (llama)");
  o.add("adapter.rank", &c.adapter.rank,
        "rank r of the low-rank factors: LoRA's A is (r, in), B is (out, r); LoHa's and LoKr's factors alike "
        "(OFT has none)");
  o.add("adapter.alpha", &c.adapter.alpha, "the adapter's output or weight delta is scaled by alpha / rank (not OFT)");
  o.add("adapter.dropout", &c.adapter.dropout, "LoRA: dropout probability on the adapter's input, in training");
  o.add("adapter.decompose_both", &c.adapter.decompose_both,
        "LoKr: the first Kronecker factor may be a low-rank product too (PEFT's decompose_both)");
  o.add("adapter.decompose_factor", &c.adapter.decompose_factor,
        "LoKr: the first factor's dimensions divide the layer's by this (PEFT's decompose_factor); -1 = nearest "
        "the square root");
  o.add("adapter.block_size", &c.adapter.block_size,
        "OFT: inputs per rotation block (PEFT's oft_block_size); it must divide every adapted layer's inputs");
  o.add("adapter.cayley_neumann", &c.adapter.cayley_neumann,
        "OFT: each rotation is the Cayley-Neumann series (PEFT's default) rather than the exact Cayley transform");
  o.add("adapter.neumann_terms", &c.adapter.neumann_terms, "OFT: terms of the Cayley-Neumann series");
  o.add("adapter.block_share", &c.adapter.block_share, "OFT: one rotation shared by all blocks of a layer");
  o.add("adapter.init_from", &c.adapter.init_from,
        "a Hugging Face PEFT LoRA folder (adapter_config.json, adapter_model.safetensors; flux: a diffusers LoRA "
        "file, pytorch_lora_weights.safetensors) to start the adapters from, with the same rank, alpha and layers; "
        "empty = PEFT's initialisation (A uniform, B zero)");
  o.add("distill.teacher", &c.distill.teacher,
        "knowledge distillation from this frozen teacher, sharded beside the student: a ShardTrain checkpoint or a "
        "Hugging Face model folder with the student's vocabulary (docs/distillation.md); empty = none");
  o.add("distill.alpha", &c.distill.alpha,
        "the loss is alpha CE + (1 - alpha) T^2 KL(teacher_T || student_T): the cross-entropy's weight, in [0, 1]");
  o.add("distill.temperature", &c.distill.temperature, "T of the distillation loss's softened distributions, > 0");
  o.add_choice("distill.teacher_dtype", &c.distill.teacher_dtype, QUANT_TYPES, quant_type_name,
               "the format the teacher's linear weights are held, gathered and dequantized in: nf4, fp4, fp8, bf16 "
               "or fp32 (docs/quantization.md; blocks of fsdp.quant_block)");
  o.add("text_encoder.source", &c.text_encoder.source,
        "a frozen text encoder in the job, sharded beside the model: a language model (ShardTrain checkpoint or "
        "Hugging Face folder: Llama, Qwen2, GPT-2) whose hidden states of the captions condition a FLUX model "
        "(docs/images.md); empty = the data files' cached embeddings");
  o.add("text_encoder.tokenizer", &c.text_encoder.tokenizer,
        "its tokenizer.json; empty = the folder's tokenizer.json, or the checkpoint's recorded data.tokenizer");
  o.add("text_encoder.layers", &c.text_encoder.layers,
        "its hidden states to condition on, side by side: indices as Hugging Face's output_hidden_states (0 the "
        "embeddings, -1 the final norm's output; e.g. 10,20,30)");
  o.add("text_encoder.sharding_strategy", &c.text_encoder.sharding_strategy,
        "how its weights are split: FULL_SHARD (over every rank) or NO_SHARD (whole on each rank, no gathers); "
        "empty = the model's shard groups");
  o.add_choice("text_encoder.dtype", &c.text_encoder.dtype, QUANT_TYPES, quant_type_name,
               "the format its linear weights are held, gathered and dequantized in: nf4, fp4, fp8, bf16 or fp32 "
               "(docs/quantization.md; blocks of fsdp.quant_block)");
  o.add_choice("fsdp.sharding_strategy", &c.fsdp.sharding_strategy, STRATEGIES, sharding_strategy_name,
               "ZeRO-3, ZeRO-2, DDP, or FULL_SHARD within groups replicated across them");
  o.add("fsdp.shard_group_size", &c.fsdp.shard_group_size,
        "HYBRID_SHARD: ranks per shard group, dividing the rank count; 0 = the ranks of one node");
  o.add("fsdp.reduce_every_microbatch", &c.fsdp.reduce_every_microbatch,
        "reduce-scatter gradients after every micro-batch (less memory); false = accumulate unsharded gradients "
        "and reduce once per step (less traffic)");
  o.add("fsdp.activation_checkpointing", &c.fsdp.activation_checkpointing,
        "keep only each block's input and recompute the block in backward (less activation memory, ~1/3 more "
        "compute)");
  o.add("fsdp.checkpoint_blocks", &c.fsdp.checkpoint_blocks,
        "with fsdp.activation_checkpointing: recompute only the first N blocks (FLUX: double, then single), "
        "the rest keep their activations -- each recomputed block frees about one block's; 0 = every block "
        "('shardtrain plan' finds the fewest that fit)");
  o.add_choice("fsdp.param_dtype", &c.fsdp.param_dtype, DTYPES, dtype_name,
               "the type parameters are gathered and communicated in (fp32 master weights and moments; on the "
               "CPU, compute widens to fp32); fp16 turns on dynamic loss scaling");
  o.add_choice("fsdp.reduce_dtype", &c.fsdp.reduce_dtype, DTYPES, dtype_name,
               "the type gradients are reduce-scattered in (replica all-reduces stay fp32)");
  o.add_choice("fsdp.activation_dtype", &c.fsdp.activation_dtype, ACTIVATION_DTYPES, activation_dtype_name,
               "the type activations are stored in for backward, each rounded where it is produced: a decoder's "
               "saved tensors (statistics, softmax and the residual stream stay fp32), FLUX's block inputs (the "
               "residual streams checkpointing keeps); auto = fsdp.param_dtype");
  o.add("fsdp.forward_prefetch", &c.fsdp.forward_prefetch,
        "start the next block's all-gather before the current block's forward computes");
  o.add_choice("fsdp.backward_prefetch", &c.fsdp.backward_prefetch, PREFETCHES, backward_prefetch_name,
               "start the next block's all-gather before the current block's backward (PRE), after it (POST), "
               "or not");
  o.add("fsdp.cpu_offload", &c.fsdp.cpu_offload,
        "keep the fp32 master shards, their gradients and the AdamW moments in (pinned) host memory and step the "
        "optimizer on the CPU: less device memory, a copy of each shard per gather and per step");
  o.add_choice("fsdp.keep_half_shard", &c.fsdp.keep_half_shard, KEEP_HALF_CHOICES, keep_half_shard_name,
               "with a 16-bit param_dtype, keep each rank's shard also in that type, rounded once after each "
               "optimizer step instead of at every gather (2 bytes more per shard element, on the compute device; "
               "on one rank nothing is rounded or copied per gather); auto = true on the CPU without cpu_offload");
  o.add("fsdp.limit_all_gathers", &c.fsdp.limit_all_gathers,
        "unsharded blocks held at once (FULL_SHARD, HYBRID_SHARD): 2 lets one all-gather run ahead, each more "
        "costs one block of memory; 1 disables prefetching");
  o.add("fsdp.memory_limit", &c.fsdp.memory_limit,
        "per-rank memory budget (e.g. 24GiB, 512MiB): a configuration that would exceed it stops before "
        "allocating, with the need by category; empty = no limit");
  o.add("fsdp.comm_timeout", &c.fsdp.comm_timeout,
        "seconds a collective may wait before all ranks are aborted; 0 disables the watchdog");
  o.add_choice("fsdp.comm_backend", &c.fsdp.comm_backend, COMM_BACKENDS, comm_backend_name,
               "collectives on device buffers: nccl (one GPU per rank) or mpi (host MPI; on GPUs through host "
               "staging buffers, so several ranks may share one GPU); auto = nccl on cuda, mpi on cpu");
  o.add_choice("fsdp.frozen_dtype", &c.fsdp.frozen_dtype, QUANT_TYPES, quant_type_name,
               "the format of the frozen linear weights (the base under adapters, frozen blocks): nf4 or fp4 as "
               "bitsandbytes stores them, fp8 (e4m3, a scale per block), bf16; held and gathered in it, "
               "dequantized into each gathered block (docs/quantization.md); fp32 = full precision");
  o.add("fsdp.quant_block", &c.fsdp.quant_block,
        "fsdp.frozen_dtype's block: elements sharing one scale, a power of two from 32 to 4096");
  o.add("fsdp.double_quant", &c.fsdp.double_quant,
        "nf4 and fp4 store each block's absmax as an 8-bit code, as bitsandbytes' bnb_4bit_use_double_quant: "
        "0.516 bytes per element instead of 0.5625 in blocks of 64 (docs/quantization.md)");
  o.add("fsdp.quantize_all_linear", &c.fsdp.quantize_all_linear,
        "fsdp.frozen_dtype also holds the linear layers a family keeps in full precision by default (FLUX's "
        "modulation, 27 % of FLUX.1's parameters)");
  o.add("checkpoint.dir", &c.checkpoint.dir, "checkpoint folder; empty = checkpoints/<train.run_name>");
  o.add("checkpoint.every", &c.checkpoint.every, "save every N steps; 0 = only at the end");
  o.add("checkpoint.format", &c.checkpoint.format,
        "sharded (each unit's flat shards + index) or gathered (one dataset per parameter, full shape)");
  o.add("checkpoint.resume", &c.checkpoint.resume,
        "auto (newest valid checkpoint in checkpoint.dir, if any), none, or a checkpoint file");
  o.add("checkpoint.keep", &c.checkpoint.keep, "newest complete checkpoints kept; older ones are removed");
  o.add("checkpoint.init_from", &c.checkpoint.init_from,
        "weights to start from: a ShardTrain checkpoint (.h5, the same model.*), an llm.c GPT-2 checkpoint "
        "(.bin) or a Hugging Face GPT-2 or Llama folder (config.json + safetensors; it also gives model.*)");
  o.add("checkpoint.save", &c.checkpoint.save, "write checkpoints (true/false)");
  o.add("checkpoint.keep_best", &c.checkpoint.keep_best,
        "save a checkpoint at each evaluation whose validation loss is the best so far, name it in <run "
        "folder>/best and keep it beside the checkpoint.keep newest (needs data.val_file and train.eval_every)");
  o.add("checkpoint.allow_data_change", &c.checkpoint.allow_data_change,
        "resume even though the files of data.train_file or data.val_file (names, sizes) or "
        "checkpoint.init_from differ from the checkpoint's (true/false)");
  o.add("checkpoint.adapters_only", &c.checkpoint.adapters_only,
        "with adapters: checkpoints hold the adapters and their optimizer state alone, and the base model's "
        "checksum; a resume takes the base from checkpoint.init_from and refuses another (true/false)");
  o.add("debug.stall_rank", &c.debug.stall_rank, "testing only: this rank sleeps stall_seconds at stall_step");
  o.add("debug.stall_step", &c.debug.stall_step,
        "testing only: step of the injected stall; -1: during start-up, before the data files are opened");
  o.add("debug.stall_seconds", &c.debug.stall_seconds, "testing only: length of the injected stall");
  o.add("debug.inject_inf_step", &c.debug.inject_inf_step, "testing only: poison this step's gradient with inf");
  o.add("debug.skip_communication", &c.debug.skip_communication,
        "benchmarks only: the engine's collectives move no data (wrong results; measures exposed communication)");
}

void require(bool ok, const std::string& message) {
  if (!ok) throw UsageError(message);
}

// Boost's error_with_option_name::what() replaces each %placeholder% of its template until none is left,
// which never ends when a value or option name holds one itself (--model.n_layer=%value%). The same
// formatting from the same fields, in one pass (the derived class only grants access to them).
struct BoostErrorFields : po::error_with_option_name {
  static std::string format(const po::error_with_option_name& e) {
    std::map<std::string, std::string> values = e.*(&BoostErrorFields::m_substitutions);
    values["canonical_option"] = e.get_option_name();
    values["prefix"] = (e.*(&BoostErrorFields::get_canonical_option_prefix))();
    std::string message = e.m_error_template;
    for (const auto& [name, from_to] : e.*(&BoostErrorFields::m_substitution_defaults)) {
      if (!values[name].empty()) continue;  // e.g. "option '%canonical_option%'" -> "option" without a name
      for (size_t at = 0; (at = message.find(from_to.first, at)) != std::string::npos; at += from_to.second.size())
        message.replace(at, from_to.first.size(), from_to.second);
    }
    std::string out;
    for (size_t i = 0; i < message.size();) {
      const size_t end = message[i] == '%' ? message.find('%', i + 1) : std::string::npos;
      const auto value = end == std::string::npos ? values.end() : values.find(message.substr(i + 1, end - i - 1));
      if (value == values.end()) {
        out += message[i++];
      } else {
        out += printable_text(value->second);
        i = end + 1;
      }
    }
    return out;
  }
};

std::string trim(const std::string& s) {
  const size_t begin = s.find_first_not_of(" \t\r");
  return begin == std::string::npos ? "" : s.substr(begin, s.find_last_not_of(" \t\r") - begin + 1);
}

// The config file's text for Boost. A leading UTF-8 byte order mark (some editors write one) is dropped;
// NUL bytes and invisible characters in keys or section names are named with their line, since Boost
// would cut the name at a NUL or print a name that looks right but matches no option.
std::string read_config_text(const std::string& path) {
  const std::string file = "config file '" + printable_text(path) + "' (--config)";
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) throw UsageError(file + " is a directory; give an INI file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UsageError("cannot read " + file + ": check the path");
  const uintmax_t size = std::filesystem::file_size(path, ec);
  if (!ec && size > MAX_CONFIG_FILE)
    throw UsageError(strprintf("%s is %ju bytes, more than an INI file has (at most %zu); check the path",
                               file.c_str(), size, MAX_CONFIG_FILE));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw UsageError("cannot read " + file + ": read error");
  if (text.compare(0, 3, "\xEF\xBB\xBF") == 0) text.erase(0, 3);
  std::istringstream lines(text);
  size_t number = 0;
  for (std::string line; std::getline(lines, line);) {
    number++;
    if (line.find('\0') != std::string::npos)
      throw UsageError(strprintf("%s line %zu contains a NUL byte: not a text file (binary, or UTF-16?); save it "
                                 "as UTF-8 text", file.c_str(), number));
    const std::string key = trim(line.substr(0, std::min(line.find('#'), line.find('='))));
    for (size_t i = 0; i < key.size();) {
      uint32_t cp = 0;
      const size_t n = utf8_char(key, i, &cp);
      if (n == 1 && !invisible(cp)) {
        i++;
        continue;
      }
      throw UsageError(strprintf("%s line %zu: '%s' contains %s, which no option name has (they are ASCII "
                                 "letters, digits, '_' and '.'); retype it",
                                 file.c_str(), number, printable_text(key).c_str(),
                                 n == 0 ? strprintf("the byte 0x%02X", static_cast<unsigned char>(key[i])).c_str()
                                        : strprintf("the character U+%04X", cp).c_str()));
    }
  }
  return text;
}

// A key given twice on the command line: the last one wins, so scripts can append overrides.
void keep_last_occurrence(std::vector<po::option>& options) {
  std::set<std::string> seen;
  std::vector<po::option> kept;
  for (auto o = options.rbegin(); o != options.rend(); ++o)
    if (o->string_key.empty() || seen.insert(o->string_key).second) kept.push_back(*o);
  options.assign(kept.rbegin(), kept.rend());
}

// train.run_name names the folder checkpoints/<run_name>/ (and the Slurm scripts' log files).
void check_run_name(const std::string& name) {
  const std::string option = "train.run_name='" + printable_text(name) + "'";
  require(!name.empty() && name.size() <= MAX_RUN_NAME,
          strprintf("train.run_name is %zu bytes long; give a name of 1 to %zu bytes (it names the run's folder)",
                    name.size(), MAX_RUN_NAME));
  require(name != "." && name != ".." && name.find('/') == std::string::npos,
          option + " must be a folder name, without '/': it names checkpoints/<run_name>/ (checkpoint.dir takes "
                   "a path)");
  require(std::none_of(name.begin(), name.end(), [](unsigned char ch) { return ch < 0x20 || ch == 0x7f; }),
          option + " contains a control character; use letters, digits, '-', '_' and '.'");
}

}  // namespace

std::string option_error_text(const po::error& e) {
  const auto* named = dynamic_cast<const po::error_with_option_name*>(&e);
  if (!named) return e.what();  // a fixed text
  std::string text = BoostErrorFields::format(*named);
  if (const auto* ambiguous = dynamic_cast<const po::ambiguous_option*>(&e)) {
    for (size_t i = 0; i < ambiguous->alternatives().size(); i++)
      text += (i ? ", " : ": could be ") + printable_text(ambiguous->alternatives()[i]);
  }
  return text;
}

void reject_stray_words(const std::vector<std::string>& words, const std::string& command) {
  if (words.empty()) return;
  const std::string word = printable_text(words.front());
  const size_t eq = word.find('=');
  const std::string fix = eq != std::string::npos && eq > 0 && word[0] != '-'
                              ? "options take two dashes: --" + word
                              : "options are written --name=value";
  throw UsageError("unexpected argument '" + word + "': " + fix + "; see 'shardtrain " + command + " --help'");
}

DType parse_dtype_option(const std::string& text, const std::string& option) {
  return choice_from_text(text, option, DTYPES, dtype_name);
}

MemorySize parse_memory_limit(const std::string& text, const char* option) {
  if (text.empty()) return {};
  const std::string usage = std::string(option) + "='" + printable_text(text) +
                            "' is not a size: write a number with a unit, e.g. 24GiB, 512MiB, 1.5GB (empty = no limit)";
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  const std::string unit(end);
  const struct {
    const char* name;
    double scale;
  } units[] = {{"B", 1},           {"KiB", 0x1p10}, {"MiB", 0x1p20}, {"GiB", 0x1p30}, {"TiB", 0x1p40},
               {"PiB", 0x1p50},    {"EiB", 0x1p60}, {"KB", 1e3},     {"MB", 1e6},     {"GB", 1e9},
               {"TB", 1e12},       {"PB", 1e15},    {"EB", 1e18}};  // the largest units, so 9EiB is too large, not unknown
  // A number without a unit, or under a byte, would silently mean no limit at all.
  for (const auto& u : units) {
    if (unit != u.name || end == text.c_str() || !std::isfinite(value) || !(value * u.scale >= 1)) continue;
    // 2^63 bytes (8 EiB) is beyond any machine and still converts to size_t without overflow.
    require(value * u.scale < 9223372036854775808.0,
            std::string(option) + "='" + printable_text(text) + "' is larger than any machine; write a size below 8 EiB");
    return {static_cast<size_t>(value * u.scale), text};
  }
  throw UsageError(usage);
}

uint64_t parse_whole_number(const std::string& text, const std::string& option, uint64_t min, uint64_t max) {
  uint64_t value = 0;
  const char* end = text.data() + text.size();
  const auto [stop, ec] = std::from_chars(text.data(), end, value);
  if (text.empty() || ec != std::errc() || stop != end || value < min || value > max)
    throw UsageError(strprintf("%s='%s' must be a whole number from %ju to %ju", option.c_str(),
                               printable_text(text).c_str(), static_cast<uintmax_t>(min),
                               static_cast<uintmax_t>(max)));
  return value;
}

namespace {

// A Hugging Face folder in checkpoint.init_from brings its model's architecture and shape
// (config.json): model.* keys left at their defaults take it; keys the configuration sets must agree
// with it. The llama keys come from a llama folder only (a gpt2 folder leaves them to validation).
void take_model_shape_from_hf_folder(const po::variables_map& vm, Config& c) {
  if (c.checkpoint.init_from.empty() || !is_hf_model(c.checkpoint.init_from)) return;
  const ModelConfig hf = read_hf_model_config(c.checkpoint.init_from);
  // Where the shape comes from: a folder's config.json, or a single file's tensors.
  const std::string source =
      std::filesystem::is_directory(c.checkpoint.init_from) ? "config.json" : "the file's tensors";
  std::string mismatches;
  auto take = [&](const char* key, auto* field, auto value, auto show) {
    if (vm[key].defaulted())
      *field = value;
    else if (*field != value)
      mismatches += std::string(mismatches.empty() ? "" : ", ") + key + "=" + show(*field) + " but " + source +
                    " says " + show(value);
  };
  auto whole = [](int v) { return std::to_string(v); };
  auto real = [](double v) { return strprintf("%.10g", v); };
  take("model.arch", &c.model.arch, hf.arch, [](const std::string& a) { return a; });
  take("model.n_layer", &c.model.n_layer, hf.n_layer, whole);
  take("model.n_embd", &c.model.n_embd, hf.n_embd, whole);
  take("model.n_head", &c.model.n_head, hf.n_head, whole);
  take("model.vocab_size", &c.model.vocab_size, hf.vocab_size, whole);
  if (family_of(hf).fixes_max_seq_len()) take("model.max_seq_len", &c.model.max_seq_len, hf.max_seq_len, whole);
  auto reads = [&](const char* key) { return family_of(hf).reads_key(key); };
  canonicalize(c.model);  // on the folder's shape, taken above: head_dim's usual size, nope_layers' blocks
  // 0 means n_head key/value heads and an MLP of 4 n_embd: compare what they mean.
  if (reads("model.n_kv_head")) {
    if (c.model.n_kv_head == 0) c.model.n_kv_head = c.model.n_head;
    take("model.n_kv_head", &c.model.n_kv_head, hf.n_kv_head, whole);
  }
  if (reads("model.intermediate_size")) {
    if (c.model.intermediate_size == 0) c.model.intermediate_size = 4 * c.model.n_embd;
    take("model.intermediate_size", &c.model.intermediate_size, hf.intermediate_size, whole);
  }
  if (reads("model.head_dim"))  // as the head size it means
    take("model.head_dim", &c.model.head_dim, hf.head_dim,
         [&](int v) { return std::to_string(v > 0 ? v : hf.n_embd / hf.n_head); });
  if (reads("model.rope_theta")) take("model.rope_theta", &c.model.rope_theta, hf.rope_theta, real);
  if (reads("model.norm_eps")) take("model.norm_eps", &c.model.norm_eps, hf.norm_eps, real);
  auto flag = [](bool b) { return std::string(b ? "true" : "false"); };
  if (reads("model.tie_embeddings")) take("model.tie_embeddings", &c.model.tie_embeddings, hf.tie_embeddings, flag);
  // The families' integer keys: flux's shape (model.context_len is the data's, not the folder's), the window.
  const std::pair<const char*, int ModelConfig::*> family_ints[] = {
      {"model.n_single_layer", &ModelConfig::n_single_layer}, {"model.in_channels", &ModelConfig::in_channels},
      {"model.context_dim", &ModelConfig::context_dim}, {"model.pooled_dim", &ModelConfig::pooled_dim},
      {"model.sliding_window", &ModelConfig::sliding_window}};
  for (const auto& [key, field] : family_ints)
    if (reads(key)) take(key, &(c.model.*field), hf.*field, whole);
  if (reads("model.guidance_embeds")) take("model.guidance_embeds", &c.model.guidance_embeds, hf.guidance_embeds, flag);
  if (reads("model.rope_axes"))
    take("model.rope_axes", &c.model.rope_axes, hf.rope_axes, [](const std::string& a) { return a; });
  if (reads("model.rope_scaling"))
    take("model.rope_scaling", &c.model.rope_scaling, hf.rope_scaling,
         [](const std::string& a) { return a.empty() ? std::string("none") : a; });
  if (reads("model.nope_layers"))
    take("model.nope_layers", &c.model.nope_layers, hf.nope_layers,
         [](const std::string& a) { return a.empty() ? std::string("''") : a; });
  require(mismatches.empty(), "checkpoint.init_from='" + printable_text(c.checkpoint.init_from) + "': " + mismatches +
                                  "; the shape comes from " + source + ": remove these model.* keys from the "
                                  "configuration (or set them to its values)");
}

}  // namespace

ParsedTrainArgs parse_train_args(const std::vector<std::string>& raw_args, const char* command) {
  // "--key=" (an empty value, e.g. --data.val_file= to switch validation off) becomes
  // "--key" "", which Boost accepts.
  std::vector<std::string> args;
  for (const std::string& a : raw_args) {
    if (a.size() > 3 && a.compare(0, 2, "--") == 0 && a.back() == '=') {
      args.push_back(a.substr(0, a.size() - 1));
      args.emplace_back();
    } else {
      args.push_back(a);
    }
  }
  ParsedTrainArgs parsed;
  OptionList options;
  declare_options(options, parsed.config);
  po::options_description cli;
  cli.add_options()("help,h", "print the options")("config", po::value<std::string>(&parsed.config.config_file),
                                                   "INI file with [model] [train] [data] [fsdp] [checkpoint] [adapter] [distill] sections");
  cli.add(options.desc);
  po::variables_map vm;
  std::string where = "on the command line";
  std::set<std::string> cli_keys;
  try {
    int style = po::command_line_style::default_style & ~po::command_line_style::allow_guessing;
    po::parsed_options from_cli = po::command_line_parser(args).options(cli).style(style).run();
    reject_stray_words(po::collect_unrecognized(from_cli.options, po::include_positional), "train");
    keep_last_occurrence(from_cli.options);
    for (const po::option& o : from_cli.options) cli_keys.insert(o.string_key);
    po::store(from_cli, vm);
    if (vm.count("help")) {
      parsed.help = true;
      return parsed;
    }
    if (vm.count("config")) {
      const std::string path = vm["config"].as<std::string>();
      std::istringstream text(read_config_text(path));
      where = "in " + printable_text(path);
      // The command line wins: drop the file's values for keys given there.
      po::parsed_options from_file = po::parse_config_file(text, options.desc);
      auto& opts = from_file.options;
      opts.erase(std::remove_if(opts.begin(), opts.end(),
                                [&](const po::option& o) {
                                  for (const po::option& c : from_cli.options)
                                    if (c.string_key == o.string_key) return true;
                                  return false;
                                }),
                 opts.end());
      po::store(from_file, vm);
    }
    where.clear();
    po::notify(vm);
  } catch (const po::error& e) {
    throw UsageError(option_error_text(e) + (where.empty() ? "" : " (" + where + ")") +
                     "; see 'shardtrain " + command + " --help'");
  }
  canonicalize(parsed.config.model);
  take_model_shape_from_hf_folder(vm, parsed.config);
  // A Hugging Face folder brings its tokenizer too, unless the configuration names one ("" included).
  std::string& tokenizer = parsed.config.data.tokenizer;
  const std::string& init_from = parsed.config.checkpoint.init_from;
  if (vm["data.tokenizer"].defaulted() && !init_from.empty() && is_hf_model(init_from) &&
      std::filesystem::is_regular_file(std::filesystem::path(init_from) / "tokenizer.json"))
    tokenizer = (std::filesystem::path(init_from) / "tokenizer.json").string();
  // Recorded in checkpoints for generate, which may run from another folder: an absolute path.
  if (!tokenizer.empty() && std::filesystem::path(tokenizer).is_relative())
    tokenizer = (std::filesystem::current_path() / tokenizer).lexically_normal().string();
  // train.steps and train.epochs both set the run's length: from one source (the command line, or
  // the file) that is a contradiction; from both, the command line's wins, as for any key.
  if (!vm["train.epochs"].defaulted() && !vm["train.steps"].defaulted()) {
    const bool steps_cli = cli_keys.count("train.steps") > 0, epochs_cli = cli_keys.count("train.epochs") > 0;
    if (steps_cli == epochs_cli)
      throw UsageError(std::string("train.steps and train.epochs both set the length of the run ") +
                       (steps_cli ? "on the command line" : "in the configuration file") + "; give one");
    if (steps_cli) parsed.config.train.epochs = 0;
  }
  return parsed;
}

namespace {

// The keys the family does not read (ModelFamily::config_keys) must keep their defaults (or what
// they mean: n_head key/value heads, an MLP of 4 n_embd); then the family checks the shape.
void validate_architecture(const ModelConfig& m) {
  const ModelFamily& family = family_of(m);
  const ModelConfig d;
  const std::pair<const char*, bool> family_keys[] = {
      {"model.n_kv_head", m.n_kv_head != d.n_kv_head && m.n_kv_head != m.n_head},
      {"model.intermediate_size", m.intermediate_size != d.intermediate_size && m.intermediate_size != 4 * m.n_embd},
      {"model.head_dim", m.head_dim != d.head_dim && m.head_dim != m.n_embd / m.n_head},
      {"model.rope_theta", m.rope_theta != d.rope_theta},
      {"model.norm_eps", m.norm_eps != d.norm_eps},
      {"model.tie_embeddings", m.tie_embeddings != d.tie_embeddings},
      {"model.n_single_layer", m.n_single_layer != d.n_single_layer},
      {"model.in_channels", m.in_channels != d.in_channels},
      {"model.context_dim", m.context_dim != d.context_dim},
      {"model.context_len", m.context_len != d.context_len},
      {"model.pooled_dim", m.pooled_dim != d.pooled_dim},
      {"model.condition_len", m.condition_len != d.condition_len},
      {"model.pixel_patch", m.pixel_patch != d.pixel_patch},
      {"model.guidance_embeds", m.guidance_embeds != d.guidance_embeds},
      {"model.rope_axes", m.rope_axes != d.rope_axes},
      {"model.rope_scaling", m.rope_scaling != d.rope_scaling},
      {"model.nope_layers", m.nope_layers != d.nope_layers},
      {"model.sliding_window", m.sliding_window != d.sliding_window}};
  for (const auto& [key, set] : family_keys) {
    if (!set || family.reads_key(key)) continue;
    std::string takers;
    for (const ModelFamily* f : model_families())
      if (f->reads_key(key)) takers += (takers.empty() ? "" : ", ") + std::string(f->name());
    require(false, std::string(key) + " is not a " + m.arch + " option (" + takers + " take it); remove it, or set " +
                       "model.arch=" + takers.substr(0, takers.find(',')));
  }
  const std::string defect = family.config_defect(m);
  require(defect.empty(), defect);
}

}  // namespace

void validate_config(const Config& c, int world) {
  const ModelConfig& m = c.model;
  const TrainOptions& t = c.train;
  Config copy = c;
  OptionList options;
  declare_options(options, copy);
  for (const auto& [name, value] : options.reals)
    require(std::isfinite(*value), strprintf("%s=%g must be a finite number", name, *value));
  check_run_name(t.run_name);
  for (const auto& [name, value] : options.texts)
    require(value->size() <= MAX_OPTION_TEXT, strprintf("%s is %zu bytes long; at most %zu (paths and names)", name,
                                                        value->size(), MAX_OPTION_TEXT));
  require(m.n_layer >= 1, "model.n_layer must be >= 1");
  require(m.n_head >= 1, "model.n_head must be >= 1");
  require(m.n_embd >= 1 && m.n_embd % m.n_head == 0,
          strprintf("model.n_embd=%d must be a positive multiple of model.n_head=%d", m.n_embd, m.n_head));
  require(m.vocab_size >= 2 && m.vocab_size <= MAX_VOCAB_SIZE,
          strprintf("model.vocab_size=%d must be in [2, %d]", m.vocab_size, MAX_VOCAB_SIZE));
  require(m.max_seq_len >= 1, "model.max_seq_len must be >= 1");
  const std::string shape = model_shape_defect(m.n_layer, m.n_embd, m.n_head, m.vocab_size, m.max_seq_len,
                                               m.intermediate_size);
  require(shape.empty(), shape + ": not a shape this program holds");
  validate_architecture(m);
  require(c.fsdp.activation_dtype != ACTIVATIONS_FP16 || family_of(m).fp16_activations(),
          "fsdp.activation_dtype=fp16: model.arch=" + m.arch + "'s residual streams outgrow fp16's range (65504); use "
          "bf16 or fp32");
  {  // the [flow] keys act on flow-matching families only: elsewhere a set one would do nothing
    const FlowOptions d, &f = c.flow;
    const bool set = f.sigma_sampling != d.sigma_sampling || f.logit_mean != d.logit_mean || f.logit_std != d.logit_std ||
                     f.shift != d.shift || f.resolution_shift != d.resolution_shift || f.guidance != d.guidance ||
                     f.sample_every != d.sample_every || !f.sample_prompts.empty() || !f.sample_condition.empty() ||
                     f.sample_steps != d.sample_steps || f.sample_guidance != d.sample_guidance ||
                     f.caption_dropout != d.caption_dropout || f.sample_cfg != d.sample_cfg;
    require(!set || !family_of(m).token_data(),
            "a flow.* key is set, but model.arch=" + m.arch + " trains on tokens, not with flow matching: remove it "
            "(the [flow] section is FLUX's)");
  }
  require(!c.data.restart_positions || c.data.documents,
          "data.restart_positions counts positions within packed documents: it needs data.documents=true");
  require(!c.data.documents || family_of(m).token_data(),
          "data.documents packs token sequences; model.arch=" + m.arch + " trains on latents: remove it");
  require(c.flow.logit_std > 0, "flow.logit_std must be > 0");
  require(c.flow.sample_every >= 0 && c.flow.sample_steps >= 1, "flow.sample_every must be >= 0 and flow.sample_steps >= 1");
  if (c.flow.sample_every > 0) {
    require(family_of(m).samples_images(),
            "flow.sample_every: model.arch=" + m.arch + " draws no images (a FLUX model does); set it to 0");
    require(!c.flow.sample_prompts.empty(),
            "flow.sample_every needs flow.sample_prompts, prompt embeddings from tools/encode_images.py prompts");
    require(m.condition_len == 0 || !c.flow.sample_condition.empty(),
            "flow.sample_every: a Kontext model (model.condition_len > 0) edits images: name them, "
            "flow.sample_condition=FILE.h5 (condition_latents, as tools/encode_images.py encode --condition-images "
            "writes them)");
  }
  require(c.flow.sample_condition.empty() || (c.flow.sample_every > 0 && m.condition_len > 0),
          "flow.sample_condition is the images a Kontext model's samples edit: it needs flow.sample_every > 0 and "
          "model.condition_len > 0; remove it");
  require(c.flow.shift > 0, "flow.shift must be > 0 (1 = no shift)");
  require(c.flow.caption_dropout >= 0 && c.flow.caption_dropout <= 1, "flow.caption_dropout must be in [0, 1]");
  require(c.flow.sample_cfg >= 1, "flow.sample_cfg must be >= 1 (1 = no classifier-free guidance)");
  require(quant_block_ok(c.fsdp.quant_block),
          strprintf("fsdp.quant_block=%d must be a power of two from 32 to 4096 (bitsandbytes' block sizes; 64 is "
                    "theirs by default)", c.fsdp.quant_block));
  require(t.seq_len >= 1 && t.seq_len <= m.max_seq_len,
          strprintf("train.seq_len=%d must be in [1, model.max_seq_len=%d]", t.seq_len, m.max_seq_len));
  require(t.steps >= 1, "train.steps must be >= 1");
  require(t.micro_batch >= 1, "train.micro_batch must be >= 1");
  const int64_t per_pass = int64_t{t.micro_batch} * world;  // 64-bit: the int product overflows
  require(t.global_batch >= 1 && t.global_batch % per_pass == 0,
          strprintf("train.global_batch=%d must be a multiple of train.micro_batch x ranks = %d x %d = %lld "
                    "(global_batch / (micro_batch x ranks) is the gradient accumulation)",
                    t.global_batch, t.micro_batch, world, static_cast<long long>(per_pass)));
  require(t.lr > 0, "train.lr must be > 0");
  require(t.min_lr_ratio >= 0 && t.min_lr_ratio <= 1, "train.min_lr_ratio must be in [0, 1]");
  require(t.warmup_steps >= 0, "train.warmup_steps must be >= 0");
  require(t.decay_steps >= 0, "train.decay_steps must be >= 0");
  require(t.decay_steps == 0 || t.lr_schedule == LR_WSD,
          "train.decay_steps applies to train.lr_schedule=wsd (the other schedules decay over every step after the "
          "warmup)");
  require(t.lr_schedule != LR_WSD || t.decay_steps <= t.steps - t.warmup_steps || t.epochs > 0,
          strprintf("train.decay_steps=%d is more than the %d steps after the warmup (train.steps=%d, "
                    "train.warmup_steps=%d)", t.decay_steps, t.steps - t.warmup_steps, t.steps, t.warmup_steps));
  require(t.epochs >= 0 && t.epochs <= 1e6, "train.epochs must be in [0, 1e6] (0 = train.steps decides)");
  require(t.weight_decay >= 0, "train.weight_decay must be >= 0");
  require(t.beta1 >= 0 && t.beta1 < 1 && t.beta2 >= 0 && t.beta2 < 1, "train.beta1 and train.beta2 must be in [0, 1)");
  require(t.eps > 0, "train.eps must be > 0");
  require(t.grad_clip >= 0, "train.grad_clip must be >= 0 (0 disables clipping)");
  require(t.eval_every >= 0, "train.eval_every must be >= 0");
  require(t.eval_batches >= 1, "train.eval_batches must be >= 1");
  require(t.log_every >= 1, "train.log_every must be >= 1");
  require(t.threads >= 0, "train.threads must be >= 0 (0 = automatic)");
  require(t.peak_gflops >= 0, "train.peak_gflops must be >= 0 (0 = measure)");
  require(c.data.document_start >= -1 && c.data.document_start < c.model.vocab_size,
          strprintf("data.document_start=%d must be a token id below model.vocab_size=%d, or -1 (data.tokenizer's)",
                    c.data.document_start, c.model.vocab_size));
  require(!c.data.documents || c.data.document_start >= 0 || !c.data.tokenizer.empty(),
          "data.documents needs the token documents start with: set data.document_start=ID, or data.tokenizer to the "
          "tokenizer.json the data was encoded with");
  require(!c.data.train_file.empty(),
          "data.train_file is empty: name the token files to train on (--data.train_file=FILES; 'shardtrain data "
          "encode' writes them), and --data.val_file=FILES for validation");
  require(t.device == "cpu" || t.device == "cuda",
          "train.device='" + printable_text(t.device) + "' is not a device; allowed: cpu, cuda");
  require(t.device == "cuda" || c.fsdp.comm_backend != COMM_NCCL,
          "fsdp.comm_backend=nccl needs train.device=cuda; on the CPU collectives are MPI's (use auto or mpi)");
  require(t.device == "cuda" || c.train.attention != ATTENTION_CUDNN,
          "train.attention=cudnn needs train.device=cuda; the CPU has the tiled kernels (use auto or tiled)");
  require(t.device != "cuda" || m.head_size() <= gpu::kTiledAttentionMaxHeadSize,
          strprintf("train.device=cuda: the head size %d is over %d, the most the GPU's attention kernels take",
                    m.head_size(), gpu::kTiledAttentionMaxHeadSize));
  require(t.device == "cpu" || !c.debug.skip_communication,
          "debug.skip_communication is implemented for train.device=cpu only; remove it");
  require(c.fsdp.shard_group_size >= 0, "fsdp.shard_group_size must be >= 0 (0 = the ranks of one node)");
  require(c.fsdp.sharding_strategy == SHARDING_HYBRID_SHARD || c.fsdp.shard_group_size == 0,
          "fsdp.shard_group_size is only meaningful with fsdp.sharding_strategy=HYBRID_SHARD; remove it or "
          "switch the strategy");
  require(c.fsdp.shard_group_size == 0 || world % c.fsdp.shard_group_size == 0,
          strprintf("fsdp.shard_group_size=%d must divide the rank count %d", c.fsdp.shard_group_size, world));
  require(c.checkpoint.every >= 0, "checkpoint.every must be >= 0 (0 = only at the end)");
  require(c.checkpoint.format == "sharded" || c.checkpoint.format == "gathered",
          "checkpoint.format='" + printable_text(c.checkpoint.format) +
              "' is not a format; allowed: sharded, gathered");
  require(!c.checkpoint.resume.empty(), "checkpoint.resume must be auto, none or a checkpoint file");
  require(c.checkpoint.keep >= 1, "checkpoint.keep must be >= 1");
  require(!c.checkpoint.keep_best || (!c.data.val_file.empty() && c.train.eval_every > 0 && c.checkpoint.save),
          "checkpoint.keep_best needs validation and saves: set data.val_file, train.eval_every > 0 and "
          "checkpoint.save=true");
  require(!c.checkpoint.adapters_only || c.adapter.type != ADAPTER_NONE,
          "checkpoint.adapters_only=true saves the adapters alone, but adapter.type=none: there are none; set "
          "adapter.type (lora) or remove checkpoint.adapters_only");
  require(!c.checkpoint.adapters_only || !c.checkpoint.init_from.empty(),
          "checkpoint.adapters_only=true leaves the base model out of the checkpoints, so a resume must load it "
          "from checkpoint.init_from, which is empty: set it to the base model (a Hugging Face folder, llm.c "
          "file or ShardTrain checkpoint)");
  require(c.fsdp.limit_all_gathers >= 1, "fsdp.limit_all_gathers must be >= 1 (1 disables prefetching)");
  require(c.fsdp.checkpoint_blocks == 0 || c.fsdp.activation_checkpointing,
          strprintf("fsdp.checkpoint_blocks=%d chooses which blocks activation checkpointing recomputes, but "
                    "fsdp.activation_checkpointing=false: set it to true, or remove fsdp.checkpoint_blocks",
                    c.fsdp.checkpoint_blocks));
  require(c.fsdp.comm_timeout >= 0, "fsdp.comm_timeout must be >= 0 seconds (0 disables the watchdog)");
  const AdapterOptions& a = c.adapter;
  require(a.rank >= 1, "adapter.rank must be >= 1");
  require(a.alpha > 0, "adapter.alpha must be > 0");
  // alpha / rank scales every adapter's output: far above PEFT's usual 1 to 2 it only overflows.
  require(a.type == ADAPTER_OFT || a.alpha / a.rank <= 1e4,
          strprintf("adapter.alpha=%g scales the adapters' output by alpha / rank = %g: at most 1e4 (PEFT's usual "
                    "alpha is rank to 2 x rank); lower adapter.alpha",
                    a.alpha, a.alpha / a.rank));
  require(a.dropout >= 0 && a.dropout < 1, "adapter.dropout must be in [0, 1)");
  require(!changes_weight(a.type) || a.dropout == 0,
          std::string("adapter.dropout is LoRA's input dropout; adapter.type=") + adapter_type_name(a.type) +
              " has none (PEFT's rank and module dropout of LoHa and LoKr are not implemented): set "
              "adapter.dropout=0");
  require(a.decompose_factor == -1 || a.decompose_factor >= 1, "adapter.decompose_factor must be -1 or >= 1");
  require(a.block_size >= 2, "adapter.block_size must be >= 2 (OFT rotates blocks of at least two inputs)");
  // Each term is a product of every OFT block per layer and step: 1000 terms took a minute a step on
  // the tiny model. PEFT's default is 5; the series' terms shrink geometrically, so 50 is plenty.
  require(a.neumann_terms >= 1 && a.neumann_terms <= 50,
          strprintf("adapter.neumann_terms=%d must be in [1, 50] (PEFT's default is 5)", a.neumann_terms));
  require(a.type != ADAPTER_NONE || (a.targets.empty() && a.init_from.empty()),
          "adapter.targets or adapter.init_from is set but adapter.type=none: set adapter.type (lora) or remove "
          "them");
  require(c.distill.alpha >= 0 && c.distill.alpha <= 1, "distill.alpha must be in [0, 1]");
  require(!c.distill.teacher.empty() ||
              (c.distill.alpha == DistillOptions{}.alpha && c.distill.temperature == DistillOptions{}.temperature),
          "distill.alpha or distill.temperature is set but distill.teacher is empty, so there is no distillation: "
          "set distill.teacher (a ShardTrain checkpoint or Hugging Face folder) or remove them");
  require(c.distill.temperature > 0, "distill.temperature must be > 0");
  require(!c.distill.teacher.empty() || c.distill.teacher_dtype == QUANT_NONE,
          "distill.teacher_dtype is set but distill.teacher is empty: set distill.teacher or remove it");
  require(c.fsdp.frozen_dtype != QUANT_NONE || c.distill.teacher_dtype != QUANT_NONE ||
              c.text_encoder.dtype != QUANT_NONE ||
              (c.fsdp.quant_block == FsdpOptions{}.quant_block && !c.fsdp.quantize_all_linear),
          "fsdp.quant_block or fsdp.quantize_all_linear is set but nothing is quantized (fsdp.frozen_dtype and "
          "distill.teacher_dtype and text_encoder.dtype are fp32): set one of those or remove them");
  for (const auto& [t, key] : {std::pair{c.fsdp.frozen_dtype, "fsdp.frozen_dtype"},
                                std::pair{c.distill.teacher_dtype, "distill.teacher_dtype"}})
    require(!c.fsdp.double_quant || t == QUANT_NONE || quant_nestable(t),
            strprintf("fsdp.double_quant=true codes the absmax of nf4 and fp4 blocks, and %s=%s has none: use nf4 "
                      "or fp4, or remove fsdp.double_quant", key, quant_type_name(t)));
  require(!c.fsdp.double_quant || c.fsdp.frozen_dtype != QUANT_NONE || c.distill.teacher_dtype != QUANT_NONE,
          "fsdp.double_quant=true is set but neither fsdp.frozen_dtype nor distill.teacher_dtype quantizes: set "
          "fsdp.frozen_dtype=nf4 or remove it");
  {
    const TextEncoderOptions d, &e = c.text_encoder;
    require(e.sharding_strategy.empty() || e.sharding_strategy == "FULL_SHARD" || e.sharding_strategy == "NO_SHARD",
            "text_encoder.sharding_strategy='" + e.sharding_strategy +
                "' is not one the text encoder takes: FULL_SHARD, NO_SHARD, or empty for the model's shard groups");
    require(e.enabled() || (e.tokenizer == d.tokenizer && e.layers == d.layers && e.dtype == d.dtype &&
                            e.sharding_strategy == d.sharding_strategy),
            "a text_encoder.* key is set but text_encoder.source is empty, so there is no text encoder: set "
            "text_encoder.source or remove them");
    require(!e.enabled() || family_of(m).samples_images(),
            "text_encoder.source conditions a diffusion transformer on captions; model.arch=" + m.arch +
                " trains on tokens: remove it");
  }
  const int blocks = config_param_table(c).block_count();  // and train.freeze's patterns, adapter.targets
  require(c.fsdp.checkpoint_blocks >= 0 && c.fsdp.checkpoint_blocks <= blocks,
          strprintf("fsdp.checkpoint_blocks=%d is not a count of the model's %d blocks: use 1 to %d, or 0 for every "
                    "block", c.fsdp.checkpoint_blocks, blocks, blocks));
}

AdapterConfig adapter_config(const Config& c) {
  AdapterConfig a;
  a.type = c.adapter.type;
  a.targets = split_comma_list(c.adapter.targets);
  a.rank = c.adapter.rank, a.alpha = c.adapter.alpha, a.dropout = c.adapter.dropout;
  a.decompose_both = c.adapter.decompose_both, a.decompose_factor = c.adapter.decompose_factor;
  a.block_size = c.adapter.block_size, a.cayley_neumann = c.adapter.cayley_neumann;
  a.neumann_terms = c.adapter.neumann_terms, a.block_share = c.adapter.block_share;
  return a;
}

ParamTable config_param_table(const Config& c) {
  return ParamTable(c.model, split_comma_list(c.train.freeze), adapter_config(c),
                    QuantConfig{c.fsdp.frozen_dtype, static_cast<size_t>(c.fsdp.quant_block),
                                c.fsdp.quantize_all_linear, false, "fsdp.frozen_dtype",
                                c.fsdp.double_quant && quant_nestable(c.fsdp.frozen_dtype)});
}

QuantConfig teacher_quant(const Config& c) {
  return QuantConfig{c.distill.teacher_dtype, static_cast<size_t>(c.fsdp.quant_block), c.fsdp.quantize_all_linear,
                     false, "distill.teacher_dtype", c.fsdp.double_quant && quant_nestable(c.distill.teacher_dtype)};
}

QuantConfig text_encoder_quant(const Config& c) {
  return QuantConfig{c.text_encoder.dtype, static_cast<size_t>(c.fsdp.quant_block), c.fsdp.quantize_all_linear, true,
                     "text_encoder.dtype"};
}

int text_encoder_shard_size(const Config& c, int world) {
  const std::string& s = c.text_encoder.sharding_strategy;
  return s == "FULL_SHARD" ? world : s == "NO_SHARD" ? 1 : 0;
}

std::string train_help() {
  Config defaults;
  OptionList options;
  declare_options(options, defaults);
  std::ostringstream s;
  s << "usage: shardtrain train [--config FILE] [--section.key=value ...]\n\n"
    << "  --config FILE     INI file with [model] [train] [data] [fsdp] [checkpoint] [adapter] [distill]\n"
    << "                    sections; the command line wins\n"
    << "  --help            this text\n\n"
    << options.desc;
  return s.str();
}

EngineOptions engine_options(const Config& c) {
  EngineOptions o;
  o.strategy = c.fsdp.sharding_strategy;
  o.reduce_every_microbatch = c.fsdp.reduce_every_microbatch;
  o.param_dtype = c.fsdp.param_dtype;
  o.reduce_dtype = c.fsdp.reduce_dtype;
  o.forward_prefetch = c.fsdp.forward_prefetch;
  o.backward_prefetch = c.fsdp.backward_prefetch;
  o.limit_all_gathers = c.fsdp.limit_all_gathers;
  o.cpu_offload = c.fsdp.cpu_offload;
  o.keep_half_shard = c.fsdp.keep_half_shard == KEEP_HALF_ON ||
                      (c.fsdp.keep_half_shard == KEEP_HALF_AUTO && !compute_options(c).gpu() && !c.fsdp.cpu_offload);
  o.nccl = compute_options(c).nccl();
  o.linear_weights_in_half_only = gemms_multiply_half_copies(compute_options(c));
  o.overlap_reduce_scatter = o.nccl;  // NCCL progresses on its own stream; MPI does not
  return o;
}

Checkpointing checkpointing_of(const Config& c) {
  if (!c.fsdp.activation_checkpointing) return false;
  return c.fsdp.checkpoint_blocks == 0 ? Checkpointing(true) : Checkpointing::first(c.fsdp.checkpoint_blocks);
}

ComputeOptions compute_options(const Config& c) {
  ComputeOptions o;
  o.device = c.train.device;
  o.compute_dtype = c.fsdp.param_dtype;
  switch (c.fsdp.activation_dtype) {
    case ACTIVATIONS_AUTO:  // the compute dtype, unless fp16 and the family's activations outgrow it
      o.activation_dtype = c.fsdp.param_dtype == DTYPE_FP16 && !family_of(c.model).fp16_activations()
                               ? DTYPE_FP32
                               : c.fsdp.param_dtype;
      break;
    case ACTIVATIONS_FP32: o.activation_dtype = DTYPE_FP32; break;
    case ACTIVATIONS_BF16: o.activation_dtype = DTYPE_BF16; break;
    case ACTIVATIONS_FP16: o.activation_dtype = DTYPE_FP16; break;
  }
  o.comm = c.fsdp.comm_backend;
  o.attention = c.train.attention;
  o.packed_documents = c.data.documents;
  return o;
}

std::map<std::string, std::string> ini_option_values(const std::string& ini_text) {
  std::istringstream in(ini_text);
  std::map<std::string, std::string> values;
  for (const po::option& o : po::parse_config_file(in, po::options_description(), true).options)
    if (!o.value.empty()) values.emplace(o.string_key, o.value.front());
  return values;
}

std::string checkpoint_dir(const Config& config) {
  return config.checkpoint.dir.empty() ? "checkpoints/" + config.train.run_name : config.checkpoint.dir;
}

std::string resolved_ini(const Config& config) {
  Config copy = config;
  OptionList options;
  declare_options(options, copy);
  std::ostringstream s;
  std::string section;
  for (const auto& [name, print] : options.printers) {
    // The run's length is one of the two: the text reads back as the same run.
    if (name == (config.train.epochs > 0 ? "train.steps" : "train.epochs")) continue;
    std::string sec = name.substr(0, name.find('.'));
    if (sec != section) s << (section.empty() ? "" : "\n") << "[" << (section = sec) << "]\n";
    s << name.substr(name.find('.') + 1) << " = " << print() << "\n";
  }
  return s.str();
}

std::string checkpoint_file_or_newest(const Runtime& rt, Comm& comm, const std::string& path, const std::string& option,
                                      Watchdog* watchdog) {
  bool folder = false;
  rt.agree_on([&] {
    std::error_code ec;
    if (!std::filesystem::exists(path, ec))
      throw UsageError(option + "='" + printable_text(path) + "': no such file or folder");
    folder = std::filesystem::is_directory(path, ec);
  });
  if (!folder) return path;
  CheckpointManager manager(rt, comm, path, 1, watchdog);
  const std::vector<std::string> candidates = manager.candidates();
  if (candidates.empty())
    throw UsageError(option + "='" + printable_text(path) +
                     "' is a folder without a complete checkpoint (ckpt-*.h5); name a checkpoint file or a run folder");
  return candidates.front();
}

bool parse_command_options(const Runtime& rt, const std::vector<std::string>& args, const po::options_description& desc,
                           const std::string& command, po::variables_map& vm) {
  try {
    const int style = po::command_line_style::default_style & ~po::command_line_style::allow_guessing;
    po::parsed_options parsed = po::command_line_parser(args).options(desc).style(style).run();
    po::store(parsed, vm);
    if (vm.count("help")) {
      if (rt.is_root()) std::cout << desc << "\n";
      return false;
    }
    reject_stray_words(po::collect_unrecognized(parsed.options, po::include_positional), command);
    po::notify(vm);
  } catch (const po::error& e) {
    throw UsageError(option_error_text(e) + "; see 'shardtrain " + command + " --help'");
  }
  return true;
}

double parse_real(const std::string& text, const std::string& option, const std::string& allowed, double min,
                  double max, bool min_included, const std::string& command) {
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  const bool number = !text.empty() && end == text.c_str() + text.size() && std::isfinite(value);
  if (!number || value > max || value < min || (!min_included && value == min))
    throw UsageError(strprintf("--%s='%s' is not allowed: %s; see 'shardtrain %s --help'", option.c_str(),
                               printable_text(text).c_str(), allowed.c_str(), command.c_str()));
  return value;
}

}  // namespace shardtrain
