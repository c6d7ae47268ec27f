// The Trainer's construction (trainer_impl.hpp): the communicators, the data, the memory plan
// checked before anything is allocated, the engine, model and optimizer, and the start-up summary.
#include "app/trainer_impl.hpp"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <array>
#include <cmath>
#include <limits>
#include <cstring>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <tuple>

#include "app/compute_backend.hpp"
#include "app/inference.hpp"
#include "app/loss_scaler.hpp"
#include "app/memory_plan.hpp"
#include "app/metrics.hpp"
#include "app/perf.hpp"
#include "app/signals.hpp"
#include "app/sample.hpp"
#include "app/teacher.hpp"
#include "app/text_encoder.hpp"
#include "app/tensorboard.hpp"
#include "app/version.hpp"
#include "backend/op_timer.hpp"
#include "ckpt/checkpoint_manager.hpp"
#include "ckpt/peft.hpp"
#include "core/clock.hpp"
#include "core/counted.hpp"
#include "core/format.hpp"
#include "core/random.hpp"
#include "comm/comm.hpp"
#include "comm/watchdog.hpp"
#include "data/data_commands.hpp"
#include "data/dataset.hpp"
#include "data/latent_dataset.hpp"
#include "data/sampler.hpp"
#include "data/tokenizer.hpp"
#include "model/family.hpp"
#include "optim/adamw.hpp"
#include "shard/fsdp_engine.hpp"


namespace shardtrain {
namespace {

// Ranks per shard group: all for FULL_SHARD/SHARD_GRAD_OP, one for NO_SHARD, and for HYBRID_SHARD
// fsdp.shard_group_size, where 0 means the ranks of one node.
int shard_group_size(const Runtime& rt, const Config& config, ShardingStrategy s) {
  if (s == SHARDING_NO_SHARD) return 1;
  if (s != SHARDING_HYBRID_SHARD) return rt.world();
  return config.fsdp.shard_group_size;
}

// The groups follow the nodes (Runtime::shard_group_comm: node by node, whatever the rank order), and
// nodes with different rank counts for a node-sized group stop every rank before the split; replica
// groups take the same position in every shard group.
std::unique_ptr<Comm> make_shard_comm(const Runtime& rt, const Config& c, ShardingStrategy s,
                                      const ComputeBackend& compute, Watchdog* watchdog) {
  auto comm = compute.make_comm(rt.shard_group_comm(shard_group_size(rt, c, s)), watchdog);
  return c.debug.skip_communication ? make_silent_comm(*comm) : std::move(comm);
}

std::unique_ptr<Comm> make_replica_comm(const Runtime& rt, const Config& c, ShardingStrategy s,
                                        const ComputeBackend& compute, Watchdog* watchdog) {
  auto comm = compute.make_comm(rt.replica_group_comm(shard_group_size(rt, c, s)), watchdog);
  return c.debug.skip_communication ? make_silent_comm(*comm) : std::move(comm);
}

// The frozen companions' tables (distill.teacher's, text_encoder.source's), read from their files
// once, agreed.
std::vector<FrozenCompanion> read_frozen_companions(const Runtime& rt, const Config& c) {
  std::vector<FrozenCompanion> frozen;
  rt.agree_on([&] { frozen = frozen_companions(c, rt.world()); });
  return frozen;
}

// What recomputing more would take, for the out-of-memory messages: turning activation
// checkpointing on, or recomputing more blocks than fsdp.checkpoint_blocks; empty when every block
// already recomputes (`blocks`: the model's).
std::string recompute_more(const Config& c, int blocks) {
  if (!c.fsdp.activation_checkpointing) return "fsdp.activation_checkpointing=true or ";
  if (c.fsdp.checkpoint_blocks > 0 && c.fsdp.checkpoint_blocks < blocks)
    return strprintf("a larger fsdp.checkpoint_blocks (now %d; 0 = every block) or ", c.fsdp.checkpoint_blocks);
  return "";
}

// The rank's planned bytes; an InputError (agreed) when they exceed fsdp.memory_limit.
MemoryPlan checked_memory_plan(const Runtime& rt, const Config& c, ShardingStrategy strategy, const Comm& shard,
                               const Comm& replica, const ComputeBackend& compute, const GemmWorkload& gemms,
                               const std::vector<FrozenCompanion>& frozen) {
  GroupShape groups{shard.size(), shard.rank(), replica.size(), replica.rank()};
  const ParamTable table = config_param_table(c);
  MemoryPlan plan = plan_rank_memory(table, groups, engine_options(c), c.train.micro_batch, c.train.seq_len,
                                     checkpointing_of(c), compute.options(), gemms, frozen);
  const std::string recompute_hint = recompute_more(c, table.block_count());
  rt.agree_on([&] {
    // Host memory: the whole plan on the CPU backend, the offloaded state on a GPU. Checked against
    // what the node has available, shared by its ranks, so a model that cannot fit stops here
    // with the numbers instead of failing an allocation (or waking the OOM killer) later.
    const double host_need =
        static_cast<double>((compute.on_gpu() ? 0 : plan.total()) + plan.offloaded_bytes + plan.staging_bytes);
    const double available = node_available_bytes();
    if (available > 0 && host_need * rt.local_size() > available)
      throw UsageError(strprintf(
          "out of memory: rank %d needs %s of host memory and this node has %s available for its %d rank%s (%s "
          "each) (%s); shard over more ranks or nodes, or use %sa smaller train.micro_batch -- 'shardtrain plan' "
          "lists what fits",
          rt.rank(), human_bytes(host_need).c_str(), human_bytes(available).c_str(), rt.local_size(),
          rt.local_size() == 1 ? "" : "s", human_bytes(available / rt.local_size()).c_str(), plan.describe().c_str(),
          recompute_hint.c_str()));
    const size_t limit = c.fsdp.memory_limit.bytes;
    if (limit && plan.total() > limit)
      throw UsageError(strprintf(
          "out of memory: rank %d needs %s > fsdp.memory_limit=%s (%s); try a sharding strategy that shards "
          "more (FULL_SHARD), %sa smaller train.micro_batch -- 'shardtrain plan' lists what fits",
          rt.rank(), human_bytes(static_cast<double>(plan.total())).c_str(), c.fsdp.memory_limit.text.c_str(),
          plan.describe().c_str(), recompute_hint.c_str()));
    // The GPU's own limit, checked the same way (plan.total() includes the GPU backend's own memory).
    if (compute.on_gpu() && plan.total() > compute.gpu_free_bytes())
      throw UsageError(strprintf(
          "out of GPU memory: rank %d needs %s but %s has %s free of %s (%s); try a sharding strategy that shards "
          "more (FULL_SHARD), %sfsdp.cpu_offload=true or a smaller train.micro_batch -- 'shardtrain plan "
          "--memory-limit' lists what fits",
          rt.rank(), human_bytes(static_cast<double>(plan.total())).c_str(), compute.describe().c_str(),
          human_bytes(static_cast<double>(compute.gpu_free_bytes())).c_str(),
          human_bytes(static_cast<double>(compute.gpu_total_bytes())).c_str(), plan.describe().c_str(),
          recompute_hint.c_str()));
  });
  return plan;
}

OptimConfig optim_config_from(const TrainOptions& t) {
  OptimConfig o;
  o.lr = t.lr;
  o.schedule = t.lr_schedule;
  o.min_lr_ratio = t.min_lr_ratio;
  o.warmup_steps = t.warmup_steps;
  o.decay_steps = t.decay_steps;
  o.total_steps = t.steps;
  o.weight_decay = t.weight_decay;
  o.beta1 = t.beta1;
  o.beta2 = t.beta2;
  o.eps = t.eps;
  o.grad_clip = t.grad_clip;
  return o;
}

}  // namespace


Trainer::Trainer(const Runtime& rt, const Config& config)
    : rt_(rt),
      cfg_(config),
      steps_(config.train.steps),
      rss_at_start_(proc_status_bytes("VmRSS")),
      B_(config.train.micro_batch),
      T_(config.train.seq_len),
      G_(config.train.global_batch),
      accum_(config.train.global_batch / (config.train.micro_batch * rt.world())),
      watchdog_(config.fsdp.comm_timeout),
      strategy_(config.fsdp.sharding_strategy),
      frozen_(read_frozen_companions(rt, config)),
      gemm_workload_(gemm_workload(config.model, frozen_, config.train.micro_batch, config.train.seq_len)),
      compute_(compute_options(config), rt, gemm_workload_),
      comm_(make_mpi_comm(rt.world_comm(), &watchdog_)),
      shard_comm_(make_shard_comm(rt, config, strategy_, compute_, &watchdog_)),
      replica_comm_(make_replica_comm(rt, config, strategy_, compute_, &watchdog_)),
      step_comm_(compute_.on_gpu() && !config.fsdp.cpu_offload ? compute_.make_comm(rt.world_comm(), &watchdog_)
                                                                : nullptr),
      plan_(checked_memory_plan(rt, config, strategy_, *shard_comm_, *replica_comm_, compute_, gemm_workload_,
                                  frozen_)),
      table_(config_param_table(config)),
      engine_(table_, *shard_comm_, *replica_comm_, memory_, engine_options(config), compute_.backend()),
      phase_timer_(*compute_.backend().device),
      optim_config_(optim_config_from(config.train)),
      optimizer_(optim_config_, engine_, memory_),
      checkpoints_(rt, *comm_, checkpoint_dir(config), config.checkpoint.keep, &watchdog_),
      loss_scaler_(engine_options(config).param_dtype == DTYPE_FP16 ||
                   engine_options(config).reduce_dtype == DTYPE_FP16) {
  threads_ = cfg_.train.threads > 0 ? cfg_.train.threads : default_threads_per_rank(rt.local_size());
  set_compute_threads(threads_);
  if (rt.rank() == cfg_.debug.stall_rank && cfg_.debug.stall_step < 0)  // the tests' start-up stall
    usleep(static_cast<useconds_t>(cfg_.debug.stall_seconds * 1e6));
  open_data();
  engine_.set_phase_timer(&phase_timer_);
  if (cfg_.train.op_times) {
    op_timer_ = std::make_unique<OpTimer>(*compute_.backend().device);
    timed_ops_ = make_timed_layer_ops(*compute_.backend().ops, *op_timer_);
  }
  model_ = make_model<float>(table_, B_, T_, checkpointing_of(cfg_),
                             timed_ops_ ? *timed_ops_ : *compute_.backend().ops,
                             compute_.options().activation_dtype);
  memory_.add(MEM_ACTIVATIONS, model_->activation_bytes());
  memory_.add(MEM_WORKSPACE, compute_.gemm_workspace_bytes());
  const size_t sums = 2 + step_loss_buckets(cfg_.model);
  host_sums_.assign(sums, 0.0);
  step_sums_ = DeviceArray<double>(*compute_.backend().device, sums);
  memory_.add(MEM_WORKSPACE, step_sums_.bytes());
  if (cfg_.fsdp.cpu_offload) offloaded_sums_ = DeviceArray<double>(*compute_.backend().host, sums);
  if (!cfg_.distill.teacher.empty()) {
    require_capability(cfg_.model, "distillation", "the student (model.arch)");
    teacher_ = std::make_unique<Teacher>(rt, *comm_, *shard_comm_, *replica_comm_, compute_, engine_options(config),
                                         cfg_.distill.teacher, teacher_quant(config), cfg_.model, B_, T_, &watchdog_);
    distill_loss_ = std::make_unique<DistillationLoss<float>>(
        [this](const Batch& batch) { return teacher_->logits(batch); }, static_cast<float>(cfg_.distill.alpha),
        static_cast<float>(cfg_.distill.temperature));
    model_->set_loss(distill_loss_.get());
  }
  if (cfg_.text_encoder.enabled()) {
    // Its groups: the model's, or with its own shard size the model's replica group as its shard
    // group (FULL_SHARD beside NO_SHARD and back): no communicators of its own.
    const int size = text_encoder_shard_size(config, rt.world());
    const bool swapped = size != 0 && size != shard_comm_->size();
    rt.agree(!swapped || size == replica_comm_->size()
                 ? ""
                 : strprintf("text_encoder.sharding_strategy=%s beside fsdp.sharding_strategy=%s: the text encoder "
                             "takes the model's shard groups or its replica groups; leave it empty under "
                             "HYBRID_SHARD",
                             config.text_encoder.sharding_strategy.c_str(),
                             sharding_strategy_name(config.fsdp.sharding_strategy)),
             'U');
    text_encoder_ = std::make_unique<TextEncoder>(
        rt, *comm_, swapped ? *replica_comm_ : *shard_comm_, swapped ? *shard_comm_ : *replica_comm_, compute_,
        engine_options(config), cfg_.text_encoder, text_encoder_quant(config), captions_, cfg_.model, B_, &watchdog_);
  }
  dropout_keys_.resize(static_cast<size_t>(B_) * T_);
  // What "held" counts: the device's arrays and the communicators' own buffers -- on a GPU not the
  // backend's workspaces (GPU reserved shows those) but the host staging of fsdp.comm_backend=mpi.
  planned_peak_ = static_cast<double>(compute_.on_gpu() ? plan_.total() - plan_.gpu.total() + plan_.staging_bytes
                                                        : plan_.total() + plan_.offloaded_bytes);
  engine_.init_parameters(cfg_.train.seed);
  if (cfg_.train.peak_gflops > 0) {
    peak_gflops_ = cfg_.train.peak_gflops;
    peak_source_ = "given (train.peak_gflops)";
  } else if (compute_.on_gpu()) {
    peak_gflops_ = compute_.gpu_peak_gflops();
    peak_source_ = "card's dense bf16";
    if (peak_gflops_ <= 0)
      rt_.warn("unknown GPU '%s': MFU is not reported; set train.peak_gflops to its dense bf16 peak in GFLOP/s",
               compute_.describe().c_str());
  } else {
    // Every rank measures at once: the peaks under shared load. The GEMM and the hardware peak are
    // of the precision the GEMMs run in: bf16 dot products where the CPU has them and
    // fsdp.param_dtype=bf16 asks for them, fp32 otherwise.
    const bool bf16 = compute_.cpu_bf16_gemms();
    comm_->barrier("barrier(gemm peak)");
    double peaks[2] = {bf16 ? measure_bf16_gemm_gflops(2048, 5) : measure_sgemm_gflops(2048, 5), 0};
    host_device().restart_peak_count();  // the probe's bf16 workspace is not the run's memory
    const FmaPeak hardware = measure_fma_peak(compute_.cpu_bf16_dot_products());
    peaks[1] = hardware.gflops;
    comm_->all_reduce_max(Span<double>(peaks, 2), "all_reduce(gemm peak)");
    peak_gflops_ = peaks[0];
    peak_source_ = bf16 ? "measured bf16 GEMM" : "measured SGEMM";
    hardware_peak_gflops_ = peaks[1];
    hardware_peak_unit_ = hardware.unit;
  }
}

void Trainer::open_data() {
  const int V = cfg_.model.vocab_size;
  const bool tokens = family_of(cfg_.model).token_data();
  // data.tokenizer is recorded for generate: it must load, and the model must take every id it writes.
  // With data.documents, the token that starts each document: given, or data.tokenizer's (rank 0's).
  int64_t document_start = cfg_.data.document_start;
  if (tokens && !cfg_.data.tokenizer.empty())
    rt_.agree_on([&] {
      if (!rt_.is_root()) return;
      const Tokenizer tokenizer(cfg_.data.tokenizer);
      const uint32_t ids = tokenizer.vocab_size();
      if (ids > static_cast<uint32_t>(V))
        throw UsageError(strprintf("data.tokenizer='%s' has ids up to %u, beyond model.vocab_size=%d: the model could "
                                   "not take every token it writes; set model.vocab_size to at least %u, or give the "
                                   "tokenizer the data was encoded with",
                                   printable_text(cfg_.data.tokenizer).c_str(), ids - 1, V, ids));
      if (!cfg_.data.documents || document_start >= 0) return;
      const std::optional<uint32_t> start = document_start_token(tokenizer);
      if (!start)
        throw UsageError(strprintf("data.documents: data.tokenizer='%s' puts no token before its documents (no "
                                   "end-of-text token, no BOS template); set data.document_start=ID",
                                   printable_text(cfg_.data.tokenizer).c_str()));
      document_start = *start;
    });
  if (cfg_.data.documents) {
    comm_->broadcast(Span<char>(reinterpret_cast<char*>(&document_start), sizeof document_start), 0,
                     "broadcast(data.document_start)");
    rt_.info("data.documents: attention stays within documents, each starting at token %lld%s",
             static_cast<long long>(document_start),
             cfg_.data.restart_positions ? "; positions restart with each" : "");
  }
  // With a text encoder in the job the files hold captions, which its tokenizer turns into ids.
  if (cfg_.text_encoder.enabled())
    rt_.agree_on([&] { captions_ = text_encoder_tokenizer(cfg_.text_encoder, cfg_.model.context_len); });
  auto open = [&](const char* option, const std::string& value) {
    std::unique_ptr<DataSource> data;
    rt_.agree_on([&] {
      if (!tokens) {
        data = std::make_unique<LatentDataset>(option, value, cfg_.model, T_, cfg_.train.seed, cfg_.flow, captions_);
        return;
      }
      auto token_data = std::make_unique<TokenDataset>(option, value, T_);
      token_data->set_vocab_size(V);
      if (cfg_.data.documents) token_data->set_document_start(document_start, cfg_.data.restart_positions);
      data = std::move(token_data);
    });
    // Every rank must read the same files: a glob could expand differently on another node.
    std::string identity = data->identity();
    uint64_t length = identity.size();
    comm_->broadcast(Span<char>(reinterpret_cast<char*>(&length), sizeof length), 0, "broadcast(data files)");
    std::string first(length, '\0');
    if (rt_.is_root()) first = identity;
    comm_->broadcast(Span<char>(first.data(), first.size()), 0, "broadcast(data files)");
    const std::string differs = dataset_difference(first, identity);
    rt_.agree(differs.empty() ? "" : strprintf("%s: rank %d does not see the files rank 0 sees: %s; every rank must "
                                               "read the same data",
                                               option, rt_.rank(), differs.c_str()));
    // Each rank checks a disjoint part of the data (tokens in range, latents finite); the verdict is agreed.
    rt_.agree(data->check(rt_.rank(), rt_.world()));
    const std::string skipped = data->skipped_warning();
    if (!skipped.empty()) rt_.warn("%s", skipped.c_str());
    return data;
  };
  train_data_ = open("data.train_file", cfg_.data.train_file);
  rt_.agree_on([&] {
    train_data_->require_records(static_cast<uint64_t>(G_), strprintf("one batch of train.global_batch=%d sequences", G_),
                                 "use more data or a smaller train.seq_len or train.global_batch");
    sampler_ = std::make_unique<SequenceSampler>(cfg_.train.seed, train_data_->records(), G_);
  });
  if (!cfg_.data.val_file.empty()) {
    val_data_ = open("data.val_file", cfg_.data.val_file);
    rt_.agree_on([&] { val_data_->require_records(1, "one sequence", "use more data or a smaller train.seq_len"); });
  }
  if (cfg_.train.epochs > 0) steps_from_epochs();
}

// train.epochs: the steps that take that many passes over the training windows (the sampler's
// epochs: sequence g of the run is window g mod W of epoch g / W), the last step possibly partial.
void Trainer::steps_from_epochs() {
  const TrainOptions& t = cfg_.train;
  const double windows = static_cast<double>(train_data_->records());
  const double steps = std::ceil(t.epochs * windows / G_);
  rt_.agree_on([&] {
    if (steps > std::numeric_limits<int>::max() / 2)
      throw UsageError(strprintf("train.epochs=%g is %.3g steps of train.global_batch=%d over %.0f windows: more than "
                                 "a run can count; use fewer epochs", t.epochs, steps, G_, windows));
    const int after_warmup = static_cast<int>(steps) - t.warmup_steps;
    if (t.lr_schedule == LR_WSD && t.decay_steps > after_warmup)
      throw UsageError(strprintf("train.decay_steps=%d is more than the %d steps after the warmup (train.epochs=%g "
                                 "makes %.0f steps, train.warmup_steps=%d)",
                                 t.decay_steps, after_warmup, t.epochs, steps, t.warmup_steps));
  });
  steps_ = static_cast<int>(steps);
  optimizer_.set_total_steps(steps_);
  rt_.info("train.epochs=%g: %d steps (%.0f windows of train.seq_len=%d, train.global_batch=%d per step)", t.epochs,
           steps_, windows, T_, G_);
}

// On a GPU the backend's own buffers are not the device's arrays; tools/gpu_check.sh compares the
// plan with what the card reserved instead.
void Trainer::check_plan_is_allocated(double held) const {
  if (compute_.on_gpu()) return;
  SHARD_CHECK(held == planned_peak_, "the memory plan is not what was allocated: %.0f bytes planned (%s), %.0f held",
              planned_peak_, plan_.describe().c_str(), held);
}

void Trainer::print_summary() {
  const ModelConfig& m = cfg_.model;
  const size_t total = table_.total_params();
  rt_.info("shardtrain train: run '%s' on %s x %s, %s (shard group %d, replicas %d)", cfg_.train.run_name.c_str(),
           counted(rt_.world(), "rank").c_str(), counted(threads_, "thread").c_str(),
           sharding_strategy_name(strategy_), shard_comm_->size(), replica_comm_->size());
  rt_.info("model: %s | %.2fM parameters in %s (root + %s) | %.2fM per rank", model_summary(m).c_str(), total / 1e6,
           counted(static_cast<long long>(table_.units().size()), "unit").c_str(), counted(table_.block_count(), "block").c_str(),
           engine_.local_param_count() / 1e6);
  if (table_.adapter().type != ADAPTER_NONE) {
    const AdapterConfig& a = table_.adapter();
    size_t layers = 0;
    table_.for_each_adapted_site([&](int, const LinearSite&, int) { layers++; });
    rt_.info("adapters: %s on %s (%s) | %.3fM trainable parameters, the base's %.2fM frozen",
             adapter_settings(a).c_str(), counted(static_cast<long long>(layers), "layer").c_str(),
             cfg_.adapter.targets.c_str(), table_.trainable_params() / 1e6,
             (table_.total_params() - table_.trainable_params()) / 1e6);
  } else if (table_.any_frozen()) {
    size_t frozen_tensors = 0;
    for (const ParamInfo& p : table_.params()) frozen_tensors += p.frozen;
    // A tied LM head is the token embedding (the root's first parameter in both architectures):
    // freezing one freezes the other.
    const bool head = m.tie_embeddings && table_.frozen(ROOT_UNIT, 0);
    rt_.info("frozen (train.freeze=%s): %s, %.2fM parameters; %.2fM trainable%s", cfg_.train.freeze.c_str(),
             counted(static_cast<long long>(frozen_tensors), "tensor").c_str(),
             (table_.total_params() - table_.trainable_params()) / 1e6, table_.trainable_params() / 1e6,
             head ? " | the LM head is the tied token embedding: frozen with it" : "");
  }
  rt_.info("batch: %d sequences x %d tokens = %d tokens/step | micro_batch %d per rank | gradient accumulation %d",
           G_, T_, G_ * T_, B_, accum_);
  std::string mem;
  for (int c = 0; c < MEM_CATEGORY_COUNT; c++) {
    size_t bytes = memory_.current(static_cast<MemCategory>(c));
    if (bytes) mem += strprintf("%s%s %s", mem.empty() ? "" : ", ", mem_category_name(static_cast<MemCategory>(c)),
                                human_bytes(bytes).c_str());
  }
  const Device& device = *compute_.backend().device;
  rt_.info("memory per rank, planned: %s | total %s | held before the first step (counted; the communicators' "
           "buffers come with their first use): %s", mem.c_str(), human_bytes(memory_.total_current()).c_str(),
           human_bytes(static_cast<double>(device.live_bytes() + uncounted_comm_buffer_bytes())).c_str());
  if (teacher_) {
    const std::string tmem = describe_categories(tracked_categories(teacher_->memory()));
    rt_.info("distillation: teacher %s (%s, %.2fM parameters, checksum %s), frozen and sharded beside the student | "
             "loss %g CE + %g T^2 KL at T = %g | teacher memory per rank: %s | total %s",
             cfg_.distill.teacher.c_str(), model_summary(teacher_->config()).c_str(),
             teacher_->table().total_params() / 1e6, checksum_text(teacher_->checksum()).c_str(), cfg_.distill.alpha,
             1 - cfg_.distill.alpha, cfg_.distill.temperature, tmem.c_str(),
             human_bytes(teacher_->memory().total_current()).c_str());
  }
  if (text_encoder_) {
    const TextEncoder& e = *text_encoder_;
    std::string layers;
    for (int l : e.layers()) layers += (layers.empty() ? "" : ",") + std::to_string(l);
    rt_.info("text encoder: %s (%s, %.2fM parameters, checksum %s), frozen and sharded beside the model | hidden "
             "states %s of 0..%d, %d tokens per caption (tokenizer %s) | its memory per rank: %s | total %s",
             cfg_.text_encoder.source.c_str(), model_summary(e.config()).c_str(), e.table().total_params() / 1e6,
             checksum_text(e.checksum()).c_str(), layers.c_str(), e.config().n_layer, cfg_.model.context_len,
             e.tokenizer().path().c_str(), describe_categories(tracked_categories(e.memory())).c_str(),
             human_bytes(e.memory().total_current()).c_str());
  }
  if (plan_.offloaded_bytes)
    rt_.info("fsdp.cpu_offload: %s of master shards, gradients and moments in host memory%s",
             human_bytes(plan_.offloaded_bytes).c_str(),
             compute_.on_gpu() ? "" : "; on the CPU backend the host is the device, so this saves nothing");
  if (compute_.on_gpu())
    rt_.info("compute: %s | activations %s | attention %s | collectives %s | peak %.1f GFLOP/s per rank (%s) | %.1f "
             "MFLOP per token",
             compute_.describe().c_str(), dtype_name(compute_.options().activation_dtype),
             attention_kernel_name(compute_.options().attention_kernel()), compute_.comm_description().c_str(),
             peak_gflops_, peak_source_.c_str(), table_.flops_per_token(T_) / 1e6);
  else
    rt_.info("compute: GEMMs %s | activations %s | OpenBLAS %s | built for %s | %s peak %.1f GFLOP/s per rank (%s)%s "
             "| %.1f MFLOP per token",
             compute_.gemm_description().c_str(), dtype_name(compute_.options().activation_dtype),
             blas_description().c_str(), SHARDTRAIN_MARCH,
             compute_.cpu_bf16_gemms() ? "bf16 GEMM" : "SGEMM",
             peak_gflops_, peak_source_.c_str(),
             hardware_peak_gflops_ > 0 ? strprintf(" | hardware peak %.1f GFLOP/s per rank (%s, measured)",
                                                   hardware_peak_gflops_, hardware_peak_unit_.c_str()).c_str()
                                       : "",
             table_.flops_per_token(T_) / 1e6);
  rt_.info("run folder: %s | metrics: %s", checkpoint_dir(cfg_).c_str(), metrics_path(cfg_).c_str());
  rt_.info("data: %s%s", train_data_->describe().c_str(),
           val_data_ ? strprintf(" | val %s", val_data_->describe().c_str()).c_str() : "");
}

}  // namespace shardtrain
