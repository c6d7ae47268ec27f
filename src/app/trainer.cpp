// The training loop (see trainer.hpp). Batch semantics (docs/architecture.md): a step covers
// train.global_batch sequences; rank r's micro-batch m holds sequences (m*ranks + r)*B .. +B-1 of
// the step, so the rank count only changes how the same sequences are split. The loss is the
// mean over every token of the global batch: each token's loss gets weight 1/(global_batch*T)
// before the reduce-scatter sums the ranks.
#include "app/trainer.hpp"

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

// The stop marker: its presence tells a batch script that the run stopped on a signal after
// saving, and should be requeued (launchers do not always pass exit code 3 through).
std::string stop_marker_path(const std::string& dir) { return dir + "/STOPPED"; }

// train.metrics_file, or metrics.jsonl beside the run's checkpoints: each run keeps its own record.
std::string metrics_path(const Config& config) {
  return config.train.metrics_file.empty() ? checkpoint_dir(config) + "/metrics.jsonl" : config.train.metrics_file;
}

// A path made comparable across working directories ("" stays "").
std::string comparable_path(const std::string& path) {
  if (path.empty()) return path;
  std::error_code ec;
  std::filesystem::path p = std::filesystem::weakly_canonical(path, ec);
  return ec ? path : p.string();
}

std::string format_duration(double seconds) {
  long s = std::lround(std::max(0.0, seconds));
  if (s >= 3600) return strprintf("%ldh%02ldm", s / 3600, (s / 60) % 60);
  if (s >= 60) return strprintf("%ldm%02lds", s / 60, s % 60);
  return strprintf("%lds", s);
}

// What every rank contributes to the one MAX all-reduce at the end of a step: peak bytes per
// memory category and in total, the stop signal, resident growth, bytes sent.
// DEVICE_RESERVED: what the GPU's caching allocator took at most (0 on the CPU backend).
// HELD: the most the device's arrays held at once, counted at allocation (the plan's check).
// HOST_SYNCS: the times the host waited for the compute device during the step (Device::host_syncs).
// PHASE_SECONDS + p: the seconds of the step's phase p (backend/phase_timer.hpp) on the slowest rank.
constexpr int PEAK_TOTAL = MEM_CATEGORY_COUNT, STOP_SIGNAL = MEM_CATEGORY_COUNT + 1,
              RSS_GROWTH = MEM_CATEGORY_COUNT + 2, COMM_BYTES = MEM_CATEGORY_COUNT + 3,
              DEVICE_RESERVED = MEM_CATEGORY_COUNT + 4, HELD = MEM_CATEGORY_COUNT + 5,
              HOST_SYNCS = MEM_CATEGORY_COUNT + 6, PHASE_SECONDS = MEM_CATEGORY_COUNT + 7;
using StepMaxima = std::array<double, PHASE_SECONDS + PHASE_COUNT>;

// A field of /proc/self/status in bytes (VmRSS, VmHWM), or 0.
double proc_status_bytes(const char* field) {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.compare(0, std::strlen(field), field) == 0 && line[std::strlen(field)] == ':')
      return std::atof(line.c_str() + std::strlen(field) + 1) * 1024;  // reported in kB
  return 0;
}

// Memory this node can still give: MemAvailable, or less where a cgroup limit says so; 0 if unknown.
double node_available_bytes() {
  double available = 0;
  std::ifstream meminfo("/proc/meminfo");
  for (std::string key; meminfo >> key;) {
    double kib = 0;
    meminfo >> kib;
    meminfo.ignore(64, '\n');
    if (key == "MemAvailable:") available = kib * 1024;
  }
  std::ifstream max_file("/sys/fs/cgroup/memory.max"), current_file("/sys/fs/cgroup/memory.current");
  std::string max_text;
  double current = 0;
  if (max_file >> max_text && max_text != "max" && current_file >> current) {
    const double cgroup_left = std::atof(max_text.c_str()) - current;
    if (available <= 0 || cgroup_left < available) available = std::max(0.0, cgroup_left);
  }
  return available;
}

// `comm_buffers`: the communicators' own buffers outside the device's count (Comm::uncounted_buffer_bytes).
StepMaxima local_step_maxima(const MemoryTracker& m, double rss_at_start, const Device& device, size_t comm_buffers) {
  StepMaxima p{};
  for (int c = 0; c < MEM_CATEGORY_COUNT; c++) p[c] = static_cast<double>(m.peak(static_cast<MemCategory>(c)));
  p[PEAK_TOTAL] = static_cast<double>(m.total_peak());
  p[STOP_SIGNAL] = stop_signal_received();
  p[RSS_GROWTH] = proc_status_bytes("VmHWM") - rss_at_start;
  p[DEVICE_RESERVED] = static_cast<double>(device.peak_reserved_bytes());
  p[HELD] = static_cast<double>(device.peak_live_bytes() + comm_buffers);
  return p;
}

// The step's record in the metrics file (docs/monitoring.md): one JSON object. A loss or norm that
// is not finite is null; byte counts are whole numbers.
nlohmann::ordered_json step_record(int step, const StepMaxima& p, double loss, double lr, double grad_norm,
                                   double tokens_per_s, double mfu, double seconds, double planned_bytes) {
  auto finite_or_null = [](double x) { return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(); };
  auto bytes = [](double x) { return static_cast<int64_t>(x); };
  nlohmann::ordered_json j;
  j["kind"] = "step";
  j["step"] = step;
  j["loss"] = finite_or_null(loss);
  j["lr"] = lr;
  j["grad_norm"] = finite_or_null(grad_norm);
  j["tokens_per_s"] = tokens_per_s;
  j["mfu"] = mfu;
  j["step_seconds"] = seconds;
  // planned: the plan's peak; held: what the device counted at allocation (the two are equal on the CPU).
  j["peak_mem_bytes"] = bytes(planned_bytes);
  j["planned_mem_bytes"] = bytes(planned_bytes);
  j["held_mem_bytes"] = bytes(p[HELD]);
  nlohmann::ordered_json categories;
  for (int c = 0; c < MEM_CATEGORY_COUNT; c++) categories[mem_category_name(static_cast<MemCategory>(c))] = bytes(p[c]);
  j["peak_mem"] = categories;
  j["rss_growth_bytes"] = bytes(p[RSS_GROWTH]);
  j["comm_bytes"] = bytes(p[COMM_BYTES]);
  j["device_reserved_bytes"] = bytes(p[DEVICE_RESERVED]);
  j["host_syncs"] = bytes(p[HOST_SYNCS]);
  nlohmann::ordered_json phases;  // the slowest rank's seconds per phase of the step
  for (int phase = 0; phase < PHASE_COUNT; phase++)
    phases[step_phase_name(static_cast<StepPhase>(phase))] = p[PHASE_SECONDS + phase];
  j["phase_seconds"] = phases;
  return j;
}

class Trainer {
 public:
  Trainer(const Runtime& rt, const Config& config);
  int run();

 private:
  void open_data();
  // The plan is what was allocated: `held`, the peak the device counted at allocation
  // (Device::peak_live_bytes) and the communicators' own buffers, after the first step, equals it.
  void check_plan_is_allocated(double held) const;
  void print_summary();
  // Loads the checkpoint that checkpoint.resume selects; returns its step (0: fresh start).
  int resume();
  int resume_auto();
  // Loads one checkpoint; returns its step, or -1 when fall_back and the file is unusable.
  int try_load(const std::string& path, bool fall_back);
  // The weights of checkpoint.init_from (base_loaded_ says they are in place).
  void load_init_from();
  // An adapter-only checkpoint goes onto its base: loads checkpoint.init_from (if not yet) and
  // compares its checksum with the file's. UsageError when there is no base or another one.
  void check_adapter_base(const std::string& path, const CheckpointState& state);
  void warn_config_changes(const CheckpointState& state);
  // An InputError when the checkpoint was trained on other data or model files (unless allowed).
  void check_same_inputs(const std::string& path, const CheckpointState& state);
  void save(int step);

  struct StepOutcome {
    double loss = 0, grad_norm = 0, lr = 0, seconds = 0, loss_scale = 1;
    bool finite = true, skipped = false;
    StepMaxima maxima{};
  };
  // One optimizer step: micro-batches, gradient reduction, norm, update (or an fp16 skip).
  StepOutcome run_step(int step);
  // Writes the step's metrics record; prints its console line when `print`.
  void report_step(int step, const StepOutcome& out, double eta_seconds, bool print);
  void warn_if_ctrl_c_cannot_save(double save_seconds);
  void steps_from_epochs();
  double last_step_seconds_ = 0;
  bool warned_stop_grace_ = false;
  // Saves (unless step's checkpoint exists or saving is off) and leaves the STOPPED marker.
  void stop_on_signal(int step, int signal, bool saved_already);
  uint64_t bytes_sent() const;
  size_t uncounted_comm_buffer_bytes() const;
  // The micro-batches' gradients, and the sum of their token losses added to step_sums_[0] (with
  // cpu_offload brought to host_sums_[0] as well).
  void accumulate_gradients(int step);
  double evaluate();
  // flow.sample_every: the model draws flow.sample_prompts' images into <run folder>/samples/.
  void sample_images(int step);
  // What a step's summed loss is divided by: the output units its loss averages over, on every rank
  // and micro-batch of the step (Loss::units_per_row).
  double loss_normaliser();
  // What the loss of step `step` averages over: loss_normaliser(), or with a loss mask
  // (DataSource::masks_targets) the step's trained targets on every rank, counted before it runs.
  double step_loss_normaliser(int step);
  uint64_t sample_of(int micro, int b) const;
  double step_normaliser_ = 1;

  const Runtime& rt_;
  const Config& cfg_;
  int steps_;  // train.steps, or what train.epochs makes of the data
  double rss_at_start_;
  const int B_, T_, G_, accum_;
  int threads_ = 1;
  double peak_gflops_ = 0;
  std::string peak_source_;  // where peak_gflops_ comes from, for the start line and the warning
  // The CPU's arithmetic peak in the precision in use (measure_fma_peak): hardware MFU's denominator, 0 if unknown.
  double hardware_peak_gflops_ = 0;
  std::string hardware_peak_unit_;
  Watchdog watchdog_;
  ShardingStrategy strategy_;
  std::optional<ParamTable> teacher_table_;  // distill.teacher's, for the plan and the GEMM workspace
  GemmWorkload gemm_workload_;               // what the compute backend's GEMM workspace is sized for
  ComputeBackend compute_;
  std::unique_ptr<Comm> comm_;  // MPI on host memory: agreement, metrics, checkpoints
  std::unique_ptr<Comm> shard_comm_, replica_comm_;  // on the compute device's memory
  // The step's sums where the optimizer reads them: over the world on the device's memory (a GPU's
  // communicator); null where that is comm_ (the CPU backend, and cpu_offload's host-side step).
  std::unique_ptr<Comm> step_comm_;
  std::unique_ptr<DataSource> train_data_, val_data_;  // the family's: token files or latent shards
  std::unique_ptr<SequenceSampler> sampler_;
  MemoryPlan plan_;  // checked against fsdp.memory_limit before anything below is allocated
  double planned_peak_ = 0;  // the plan's bytes in the compute device's memory, offloaded state included on the CPU
  ParamTable table_;
  MemoryTracker memory_;
  FsdpEngine engine_;
  PhaseTimer phase_timer_;  // the step's phases on the compute device (its events die before it)
  OptimConfig optim_config_;
  AdamW optimizer_;
  // train.op_times: the timer and the ops the model computes with through it (before model_,
  // which holds them).
  std::unique_ptr<OpTimer> op_timer_;
  std::unique_ptr<LayerOps<float>> timed_ops_;
  int steps_run_ = 0;  // in this process: the first one's op times are not counted (warm-up)
  std::unique_ptr<TransformerModel<float>> model_;
  std::unique_ptr<Teacher> teacher_;  // distill.teacher, beside the student
  std::unique_ptr<DistillationLoss<float>> distill_loss_;  // the student's loss against it
  std::optional<Prompts> sample_prompts_;  // flow.sample_prompts, read once
  // The step's summed loss and squared gradient norm (then the validation loss) in the compute
  // device's memory, read once at the end of a step into host_sums_; with cpu_offload the
  // optimizer reads them from offloaded_sums_ (the backend's host memory).
  DeviceArray<double> step_sums_, offloaded_sums_;
  double host_sums_[2] = {0, 0};
  Batch batch_;                         // this rank's micro-batch: tokens and targets
  std::vector<uint64_t> dropout_keys_;  // per token of a micro-batch: dropout_token_key
  CheckpointManager checkpoints_;
  std::unique_ptr<MetricsWriter> metrics_;  // opened by run() once the resume step is known
  std::unique_ptr<TensorBoardWriter> tensorboard_;
  LossScaler loss_scaler_;  // fp16's dynamic loss scale (1 without fp16)
  bool base_loaded_ = false;  // checkpoint.init_from's weights are in the engine (and nothing overwrote them)
};

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

// distill.teacher's parameter table (read from its file once, agreed), or none.
std::optional<ParamTable> read_teacher_table(const Runtime& rt, const Config& c) {
  std::optional<ParamTable> teacher;
  if (!c.distill.teacher.empty())
    rt.agree_on([&] { teacher.emplace(teacher_param_table(c.distill.teacher, teacher_quant(c))); });
  return teacher;
}

// The GEMMs of the student and, when distilling, the teacher.
GemmWorkload run_gemm_workload(const Config& c, const std::optional<ParamTable>& teacher) {
  return gemm_workload(c.model, teacher ? &teacher->config() : nullptr, c.train.micro_batch, c.train.seq_len);
}

// The rank's planned bytes; an InputError (agreed) when they exceed fsdp.memory_limit.
MemoryPlan checked_memory_plan(const Runtime& rt, const Config& c, ShardingStrategy strategy, const Comm& shard,
                               const Comm& replica, const ComputeBackend& compute, const GemmWorkload& gemms,
                               const std::optional<ParamTable>& teacher) {
  GroupShape groups{shard.size(), shard.rank(), replica.size(), replica.rank()};
  MemoryPlan plan = plan_rank_memory(config_param_table(c), groups, engine_options(c), c.train.micro_batch,
                                     c.train.seq_len, c.fsdp.activation_checkpointing, compute.options(), gemms,
                                     teacher ? &*teacher : nullptr);
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
          "each) (%s); shard over more ranks or nodes, or use fsdp.activation_checkpointing=true or a smaller "
          "train.micro_batch -- 'shardtrain plan' lists what fits",
          rt.rank(), human_bytes(host_need).c_str(), human_bytes(available).c_str(), rt.local_size(),
          rt.local_size() == 1 ? "" : "s", human_bytes(available / rt.local_size()).c_str(), plan.describe().c_str()));
    const size_t limit = c.fsdp.memory_limit.bytes;
    if (limit && plan.total() > limit)
      throw UsageError(strprintf(
          "out of memory: rank %d needs %s > fsdp.memory_limit=%s (%s); try a sharding strategy that shards "
          "more (FULL_SHARD), fsdp.activation_checkpointing=true or a smaller train.micro_batch -- 'shardtrain "
          "plan' lists what fits",
          rt.rank(), human_bytes(static_cast<double>(plan.total())).c_str(), c.fsdp.memory_limit.text.c_str(),
          plan.describe().c_str()));
    // The GPU's own limit, checked the same way (plan.total() includes the GPU backend's own memory).
    if (compute.on_gpu() && plan.total() > compute.gpu_free_bytes())
      throw UsageError(strprintf(
          "out of GPU memory: rank %d needs %s but %s has %s free of %s (%s); try a sharding strategy that shards "
          "more (FULL_SHARD), fsdp.activation_checkpointing=true, fsdp.cpu_offload=true or a smaller "
          "train.micro_batch -- 'shardtrain plan --memory-limit' lists what fits",
          rt.rank(), human_bytes(static_cast<double>(plan.total())).c_str(), compute.describe().c_str(),
          human_bytes(static_cast<double>(compute.gpu_free_bytes())).c_str(),
          human_bytes(static_cast<double>(compute.gpu_total_bytes())).c_str(), plan.describe().c_str()));
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
      teacher_table_(read_teacher_table(rt, config)),
      gemm_workload_(run_gemm_workload(config, teacher_table_)),
      compute_(compute_options(config), rt, gemm_workload_),
      comm_(make_mpi_comm(rt.world_comm(), &watchdog_)),
      shard_comm_(make_shard_comm(rt, config, strategy_, compute_, &watchdog_)),
      replica_comm_(make_replica_comm(rt, config, strategy_, compute_, &watchdog_)),
      step_comm_(compute_.on_gpu() && !config.fsdp.cpu_offload ? compute_.make_comm(rt.world_comm(), &watchdog_)
                                                                : nullptr),
      plan_(checked_memory_plan(rt, config, strategy_, *shard_comm_, *replica_comm_, compute_, gemm_workload_,
                                  teacher_table_)),
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
  model_ = make_model<float>(table_, B_, T_, cfg_.fsdp.activation_checkpointing,
                             timed_ops_ ? *timed_ops_ : *compute_.backend().ops,
                             compute_.options().activation_dtype);
  memory_.add(MEM_ACTIVATIONS, model_->activation_bytes());
  memory_.add(MEM_WORKSPACE, compute_.gemm_workspace_bytes());
  step_sums_ = DeviceArray<double>(*compute_.backend().device, 2);
  memory_.add(MEM_WORKSPACE, step_sums_.bytes());
  if (cfg_.fsdp.cpu_offload) offloaded_sums_ = DeviceArray<double>(*compute_.backend().host, 2);
  if (!cfg_.distill.teacher.empty()) {
    require_capability(cfg_.model, "distillation", "the student (model.arch)");
    teacher_ = std::make_unique<Teacher>(rt, *comm_, *shard_comm_, *replica_comm_, compute_, engine_options(config),
                                         cfg_.distill.teacher, teacher_quant(config), cfg_.model, B_, T_, &watchdog_);
    distill_loss_ = std::make_unique<DistillationLoss<float>>(
        [this](const Batch& batch) { return teacher_->logits(batch); }, static_cast<float>(cfg_.distill.alpha),
        static_cast<float>(cfg_.distill.temperature));
    model_->set_loss(distill_loss_.get());
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
  auto open = [&](const char* option, const std::string& value) {
    std::unique_ptr<DataSource> data;
    rt_.agree_on([&] {
      if (!tokens) {
        data = std::make_unique<LatentDataset>(option, value, cfg_.model, T_, cfg_.train.seed, cfg_.flow);
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
    for (int l = 0; l < table_.block_count(); l++)
      for (size_t k = 0; k < table_.block_sites(l).size(); k++)
        layers += table_.adapter_param(l, static_cast<int>(k)) >= 0;
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
    std::array<size_t, MEM_CATEGORY_COUNT> teacher_bytes{};
    for (int c = 0; c < MEM_CATEGORY_COUNT; c++) teacher_bytes[c] = teacher_->memory().current(static_cast<MemCategory>(c));
    const std::string tmem = describe_categories(teacher_bytes);
    rt_.info("distillation: teacher %s (%s, %.2fM parameters, checksum %s), frozen and sharded beside the student | "
             "loss %g CE + %g T^2 KL at T = %g | teacher memory per rank: %s | total %s",
             cfg_.distill.teacher.c_str(), model_summary(teacher_->config()).c_str(),
             teacher_->table().total_params() / 1e6, checksum_text(teacher_->checksum()).c_str(), cfg_.distill.alpha,
             1 - cfg_.distill.alpha, cfg_.distill.temperature, tmem.c_str(),
             human_bytes(teacher_->memory().total_current()).c_str());
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

void Trainer::warn_config_changes(const CheckpointState& state) {
  auto before = ini_option_values(state.config_ini), now = ini_option_values(resolved_ini(cfg_));
  std::string changed;
  for (const auto& [key, value] : now) {
    auto it = before.find(key);
    if (it != before.end() && it->second != value && key != "checkpoint.resume")
      changed += strprintf("%s%s: %s -> %s", changed.empty() ? "" : ", ", key.c_str(), it->second.c_str(), value.c_str());
  }
  if (!changed.empty()) rt_.warn("resuming with a changed configuration: %s", changed.c_str());
}

void Trainer::check_same_inputs(const std::string& path, const CheckpointState& state) {
  if (cfg_.checkpoint.allow_data_change) return;
  auto before = ini_option_values(state.config_ini), now = ini_option_values(resolved_ini(cfg_));
  std::string changed;
  auto add = [&](const std::string& what) { changed += (changed.empty() ? "" : "; ") + what; };
  // An adapter-only checkpoint's base is compared by its contents (check_adapter_base), wherever it lies.
  std::vector<const char*> by_path;
  if (!state.adapters_only) by_path.push_back("checkpoint.init_from");
  if (state.has_dataset) {  // the data by their files' names and sizes
    const std::tuple<const char*, const std::string&, const DataSource*> data[2] = {
        {"data.train_file", state.dataset_train, train_data_.get()}, {"data.val_file", state.dataset_val, val_data_.get()}};
    for (const auto& [key, recorded, dataset] : data) {
      const std::string difference = dataset_difference(recorded, dataset ? dataset->identity() : "");
      if (!difference.empty()) add(strprintf("%s: %s", key, difference.c_str()));
    }
  } else {
    rt_.warn("checkpoint '%s' records no dataset identity (written by an older build): its data are compared by the "
             "data.* paths only", path.c_str());
    by_path.insert(by_path.begin(), {"data.train_file", "data.val_file"});
  }
  for (const char* key : by_path) {
    auto it = before.find(key);
    if (it != before.end() && comparable_path(it->second) != comparable_path(now[key]))
      add(strprintf("%s was '%s', now '%s'", key, it->second.c_str(), now[key].c_str()));
  }
  if (!changed.empty())
    throw UsageError("checkpoint '" + path + "' was trained on other inputs: " + changed +
                     "; use another checkpoint.dir (or train.run_name) for a new run, or set "
                     "checkpoint.allow_data_change=true to continue on the new inputs");
}

int Trainer::try_load(const std::string& path, bool fall_back) {
  CheckpointState state;
  try {
    rt_.agree_on([&] { state = read_checkpoint_state(path); });
    // The same file's metadata on every rank: the verdict is identical without an agreement.
    std::string mismatch = model_mismatch(path, state.model, cfg_.model);
    if (mismatch.empty()) mismatch = adapter_mismatch(path, state.adapter, table_.adapter());
    if (!mismatch.empty()) throw UsageError(mismatch);
    check_same_inputs(path, state);
    if (teacher_ && state.teacher_checksum && state.teacher_checksum != teacher_->checksum())
      throw UsageError("checkpoint '" + path + "' was distilled from a teacher with checksum " +
                       checksum_text(state.teacher_checksum) + ", distill.teacher='" + cfg_.distill.teacher +
                       "' has " + checksum_text(teacher_->checksum()) +
                       ": resume with the same teacher (or start a new run)");
    if (state.step > steps_)
      throw UsageError(strprintf("checkpoint '%s' is at step %lld, past train.steps=%d; raise train.steps",
                                 path.c_str(), static_cast<long long>(state.step), steps_));
    if (state.adapters_only) check_adapter_base(path, state);
    rt_.agree_on([&] { state = checkpoints_.load(path, engine_, optimizer_); });  // each collective timed on its own
  } catch (const UsageError&) {
    throw;
  } catch (const InputError& e) {
    if (!fall_back) throw;
    rt_.warn("skipping unusable checkpoint: %s", e.what());
    // A failed load of a full checkpoint may have overwritten part of the base; an adapter-only one
    // writes the adapters alone.
    if (!state.adapters_only) base_loaded_ = false;
    return -1;
  }
  warn_config_changes(state);
  loss_scaler_.restore(state.loss_scale_log2, state.loss_scale_good_steps);
  rt_.info("resumed from %s at step %lld (saved on %s, %s layout%s)", path.c_str(), static_cast<long long>(state.step),
           counted(state.world_size, "rank").c_str(), state.layout.c_str(),
           state.adapters_only ? ", adapters only: on the base from checkpoint.init_from, whose checksum matches" : "");
  return static_cast<int>(state.step);
}

void Trainer::check_adapter_base(const std::string& path, const CheckpointState& state) {
  const std::string& from = cfg_.checkpoint.init_from;
  if (from.empty())
    throw UsageError("checkpoint '" + path + "' holds adapters alone (checkpoint.adapters_only), without the base "
                     "model they were trained on (base checksum " + checksum_text(state.base_checksum) +
                     "): give that base as checkpoint.init_from");
  if (!base_loaded_) {
    try {
      load_init_from();
    } catch (const InputError& e) {  // the base's own problem, not this checkpoint's: never skipped
      throw UsageError(e.what());
    }
  }
  const uint64_t base = base_model_checksum(engine_, *comm_);
  if (base != state.base_checksum)
    throw UsageError(base_mismatch(path, state.base_checksum, base, "checkpoint.init_from='" + from + "'"));
}

void Trainer::load_init_from() {
  const std::string& from = cfg_.checkpoint.init_from;
  std::string step;
  if (is_hdf5_file(from)) {  // a ShardTrain checkpoint: its weights, not its optimizer state or step
    CheckpointState state;
    rt_.agree_on([&] { state = read_checkpoint_state(from); });
    std::string mismatch = model_mismatch(from, state.model, cfg_.model);
    if (!mismatch.empty()) throw UsageError(mismatch);
    if (state.adapters_only)
      throw UsageError("checkpoint.init_from='" + from + "' holds adapters alone (checkpoint.adapters_only), no base "
                       "model: give the base model as checkpoint.init_from and this file as checkpoint.resume");
    step = strprintf(" (its step %lld; optimizer state from zero)", static_cast<long long>(state.step));
  }
  const std::string loaded = load_base_weights(rt_, checkpoints_, from, engine_, "checkpoint.init_from");
  rt_.info("initialised the weights from %s%s", loaded.c_str(), step.c_str());
  base_loaded_ = true;
}

int Trainer::resume() {
  const std::string& mode = cfg_.checkpoint.resume;
  int step = 0;
  // An adapter-only checkpoint loads checkpoint.init_from first (check_adapter_base): its base.
  if (mode != "none") step = mode == "auto" ? resume_auto() : try_load(mode, false);
  if (step == 0 && !cfg_.checkpoint.init_from.empty() && !base_loaded_) load_init_from();
  if (step == 0) init_dora_magnitudes(engine_, *comm_);  // from the base now in place
  if (step == 0 && !cfg_.adapter.init_from.empty()) {
    rt_.agree_on([&] { load_peft_adapter(cfg_.adapter.init_from, engine_); });
    rt_.info("initialised the adapters from %s %s",
             family_of(cfg_.model).peft_folder() ? "PEFT folder" : "diffusers LoRA file", cfg_.adapter.init_from.c_str());
  }
  return step;
}

int Trainer::resume_auto() {
  std::vector<std::string> candidates = checkpoints_.candidates();
  for (const std::string& path : candidates)
    if (int step = try_load(path, true); step >= 0) return step;
  if (!candidates.empty()) {
    rt_.warn("no usable checkpoint in %s; starting from scratch", checkpoints_.dir().c_str());
    engine_.init_parameters(cfg_.train.seed);  // a failed load may have overwritten part of the state
    optimizer_.zero_state();
    base_loaded_ = false;
  }
  return 0;
}

void Trainer::save(int step) {
  CheckpointState state;
  state.layout = cfg_.checkpoint.format;
  state.step = step;
  state.tokens_seen = static_cast<int64_t>(step) * G_ * T_;
  state.seed = cfg_.train.seed;
  state.sampler_step = step;
  state.world_size = rt_.world();
  state.strategy = sharding_strategy_name(cfg_.fsdp.sharding_strategy);
  state.config_ini = resolved_ini(cfg_);
  state.loss_scale_log2 = loss_scaler_.scale_log2();
  state.loss_scale_good_steps = loss_scaler_.good_steps();
  state.dataset_train = train_data_->identity();
  state.dataset_val = val_data_ ? val_data_->identity() : "";
  state.adapters_only = cfg_.checkpoint.adapters_only;
  state.teacher_checksum = teacher_ ? teacher_->checksum() : 0;
  const double t0 = now_seconds();
  std::string path = checkpoints_.save(state, engine_, optimizer_);
  const double seconds = now_seconds() - t0;
  rt_.info("saved %s (%s%s, %.2f s)", path.c_str(), state.layout.c_str(), state.adapters_only ? ", adapters only" : "",
           seconds);
  warn_if_ctrl_c_cannot_save(seconds);
}

// Once mpirun is signalled it stops relaying output, so the advice comes now, while it is read.
void Trainer::warn_if_ctrl_c_cannot_save(double save_seconds) {
  const double grace = mpirun_stop_grace_seconds(), needed = last_step_seconds_ + save_seconds;
  if (warned_stop_grace_ || grace < 0 || needed <= grace || stop_signal_received()) return;
  warned_stop_grace_ = true;
  rt_.warn("under mpirun a Ctrl-C leaves the ranks %g s (odls_base_sigkill_timeout) before it kills them, and a "
           "step plus a save take %.1f s here: a Ctrl-C would lose the steps since the last checkpoint; stop with "
           "'kill -USR1 <mpirun pid>', or start mpirun with --mca odls_base_sigkill_timeout %.0f",
           grace, needed, std::ceil(2 * needed + 1));
}

// The step holds the host to one wait for the device (docs/architecture.md, "One host
// synchronization per step"): the loss and the gradient norm are summed on the device, all-reduced
// there, clipping and the inf/NaN skip decided there by the fused AdamW, and only then both read.
// With cpu_offload the wait is the gradient shards' copy to the host, which brings the loss along.
Trainer::StepOutcome Trainer::run_step(int step) {
  comm_->barrier("barrier(step start)");  // time the step between barriers
  const double t0 = now_seconds();
  const uint64_t bytes_before = bytes_sent();
  Device& device = *compute_.backend().device;
  const uint64_t syncs_before = device.host_syncs();
  step_sums_.zero();
  phase_timer_.begin_step();
  if (op_timer_) op_timer_->read_step(false);  // what ran between steps (evaluation) is not the step's
  accumulate_gradients(step);
  if (rt_.rank() == cfg_.debug.stall_rank && step == cfg_.debug.stall_step)
    usleep(static_cast<useconds_t>(cfg_.debug.stall_seconds * 1e6));
  if (rt_.is_root() && step + 1 == cfg_.debug.inject_inf_step) {
    const float inf = INFINITY;
    for (UnitShard& shard : engine_.shards())  // the first gradient it has (frozen units have none)
      if (shard.grads.size() > 0) {
        shard.grads.device()->copy_to_device(shard.grads.data(), &inf, sizeof inf);
        break;
      }
  }
  const bool offload = cfg_.fsdp.cpu_offload;
  double* sums = offload ? offloaded_sums_.data() : step_sums_.data();  // where the optimizer's shards are
  if (offload) offloaded_sums_[1] = 0;
  optimizer_.accumulate_grad_sq_norm(sums + 1);
  (step_comm_ ? *step_comm_ : *comm_).all_reduce_sum(Span<double>(sums, 2), "all_reduce(loss, grad norm)");
  const double lr = optimizer_.step(step, sums, loss_scaler_.scale());
  phase_timer_.end(PHASE_OPTIMIZER);
  if (offload)
    std::copy_n(offloaded_sums_.data(), 2, host_sums_);
  else
    device.copy_to_host(host_sums_, step_sums_.data(), step_sums_.bytes());  // the step's one wait
  StepOutcome out;
  out.loss = host_sums_[0] / step_normaliser_;
  out.grad_norm = std::sqrt(host_sums_[1]) / loss_scaler_.scale();
  out.loss_scale = loss_scaler_.scale();
  out.finite = std::isfinite(out.loss) && std::isfinite(out.grad_norm);  // else the update was skipped
  if (loss_scaler_.update(out.finite)) {
    // fp16 overflow: the update was skipped (the data of this step is consumed).
    out.skipped = true, out.finite = true;
    rt_.info("step %d: inf/NaN gradients at fp16 loss scale %g: update skipped, loss scale halved to %g", step + 1,
             out.loss_scale, loss_scaler_.scale());
  } else if (out.finite) {
    out.lr = lr;
  }
  const double host_syncs = static_cast<double>(device.host_syncs() - syncs_before);
  out.maxima = local_step_maxima(memory_, rss_at_start_, *compute_.backend().device, uncounted_comm_buffer_bytes());
  if (steps_run_ == 0) check_plan_is_allocated(out.maxima[HELD]);
  out.maxima[COMM_BYTES] = static_cast<double>(bytes_sent() - bytes_before);
  out.maxima[HOST_SYNCS] = host_syncs;
  const std::array<double, PHASE_COUNT> phases = phase_timer_.seconds();  // after the step's wait
  std::copy(phases.begin(), phases.end(), out.maxima.begin() + PHASE_SECONDS);
  if (op_timer_) op_timer_->read_step(steps_run_ > 0);
  steps_run_++;
  comm_->all_reduce_max(Span<double>(out.maxima.data(), out.maxima.size()), "all_reduce(step maxima)");
  out.seconds = now_seconds() - t0;
  return out;
}

void Trainer::report_step(int step, const StepOutcome& out, double eta_seconds, bool print) {
  last_step_seconds_ = out.seconds;
  const double tokens_per_s = G_ * T_ / out.seconds;
  const double achieved_gflops = table_.flops_per_token(T_) * tokens_per_s / rt_.world() / 1e9;  // per rank
  if (peak_gflops_ > 0 && achieved_gflops > peak_gflops_) {
    // A peak measured under load (or given too low) is no peak: the run itself is the better bound.
    rt_.warn("the model ran at %.1f GFLOP/s per rank, above the %s peak of %.1f: MFU is now measured against "
             "%.1f (set train.peak_gflops to the machine's real peak)", achieved_gflops, peak_source_.c_str(),
             peak_gflops_, achieved_gflops);
    peak_gflops_ = achieved_gflops;
    peak_source_ = "the run's own best rate";
  }
  const double mfu = peak_gflops_ > 0 ? achieved_gflops / peak_gflops_ : 0;
  const double hardware_mfu = hardware_peak_gflops_ > 0 ? achieved_gflops / hardware_peak_gflops_ : 0;
  const std::string reserved =
      compute_.on_gpu() ? ", GPU reserved " + human_bytes(out.maxima[DEVICE_RESERVED]) : std::string();
  if (print)
    rt_.info("step %5d/%d | loss %.4f | lr %.2e | norm %.3f | %.0f tok/s | MFU %.1f%% | mem %s held, %s planned%s "
             "| eta %s%s",
             step + 1, steps_, out.loss, out.lr, out.grad_norm, tokens_per_s, 100 * mfu,
             human_bytes(out.maxima[HELD]).c_str(), human_bytes(planned_peak_).c_str(), reserved.c_str(),
             std::isfinite(eta_seconds) ? format_duration(eta_seconds).c_str() : "-", out.skipped ? " | SKIPPED" : "");
  for (const auto& [tag, value] : {std::pair<const char*, double>{"train/loss", out.loss}, {"train/lr", out.lr},
                                   {"train/grad_norm", out.grad_norm}, {"perf/tokens_per_s", tokens_per_s},
                                   {"perf/mfu", mfu}, {"perf/hardware_mfu", hardware_mfu},
                                   {"memory/held_bytes", out.maxima[HELD]},
                                   {"memory/planned_bytes", planned_peak_}})
    tensorboard_->scalar(tag, step + 1, value);
  for (int c = 0; c < MEM_CATEGORY_COUNT; c++)
    tensorboard_->scalar(std::string("memory/") + mem_category_name(static_cast<MemCategory>(c)) + "_bytes", step + 1,
                         out.maxima[c]);
  nlohmann::ordered_json record = step_record(step + 1, out.maxima, out.loss, out.lr, out.grad_norm, tokens_per_s,
                                               mfu, out.seconds, planned_peak_);
  record["loss_scale"] = out.loss_scale;
  record["skipped"] = out.skipped;
  record["peak_gflops"] = peak_gflops_;
  record["hardware_mfu"] = hardware_mfu;
  record["hardware_peak_gflops"] = hardware_peak_gflops_;
  metrics_->write_line(record.dump());
}

void Trainer::stop_on_signal(int step, int signal, bool saved_already) {
  if (!cfg_.checkpoint.save) {
    rt_.info("stopped at step %d on %s; checkpoint.save=false, so nothing was saved; exit code %d", step,
             signal_origin(signal), EXIT_CODE_SIGNALLED);
    return;
  }
  if (!saved_already) {
    rt_.info("stopping on %s after step %d: saving a checkpoint", signal_origin(signal), step);
    save(step);
  }
  // The marker tells a batch script to requeue the job; a marker that cannot be written is an error.
  std::string error;
  if (rt_.is_root()) {
    const std::string marker = stop_marker_path(checkpoints_.dir());
    error = CheckpointManager::write_file_synced(marker, strprintf("step %d\nsignal %s\n", step, signal_name(signal)));
    if (!error.empty()) error = "cannot write the stop marker: " + error;
  }
  rt_.agree(error);
  rt_.info("stopped at step %d on %s; exit code %d (the next start with checkpoint.resume=auto continues from step "
           "%d)", step, signal_origin(signal), EXIT_CODE_SIGNALLED, step);
  // mpirun relays nothing after its Ctrl-C and then exits 1: rank 0 tells the terminal what happened.
  if (rt_.is_root() && stopped_by_mpirun(signal))
    write_to_terminal(strprintf(
        "shardtrain: stopped at step %d on %s; the checkpoint of step %d is saved in %s (and STOPPED written). mpirun "
        "shows no more output and exits with code 1 in about %.0f s, after its kill sequence: that is expected. The "
        "next start with checkpoint.resume=auto continues from step %d.",
        step, signal_origin(signal), step, checkpoints_.dir().c_str(), 2 * mpirun_stop_grace_seconds(), step));
}

uint64_t Trainer::bytes_sent() const {
  return comm_->bytes_sent() + shard_comm_->bytes_sent() + replica_comm_->bytes_sent();
}

size_t Trainer::uncounted_comm_buffer_bytes() const {
  return comm_->uncounted_buffer_bytes() + shard_comm_->uncounted_buffer_bytes() +
         replica_comm_->uncounted_buffer_bytes() + (step_comm_ ? step_comm_->uncounted_buffer_bytes() : 0);
}

double Trainer::loss_normaliser() {
  const double micro_batches = G_ / B_;  // over every rank and accumulation step
  return micro_batches * model_->output_rows() * model_->loss().units_per_row(model_->output_width());
}

// The step's sample `seq` of this rank's micro-batch `micro`, slot `b`.
uint64_t Trainer::sample_of(int micro, int b) const {
  return static_cast<uint64_t>(micro * rt_.world() + rt_.rank()) * B_ + b;
}

double Trainer::step_loss_normaliser(int step) {
  if (!train_data_->masks_targets()) return loss_normaliser();
  double trained = 0;
  for (int micro = 0; micro < accum_; micro++)
    for (int b = 0; b < B_; b++)
      trained += static_cast<double>(train_data_->trained_targets(sampler_->window(step, sample_of(micro, b))));
  comm_->all_reduce_sum(Span<double>(&trained, 1), "all_reduce(trained targets)");
  return std::max(trained, 1.0);  // a step of prompts only: loss 0, no gradient
}

void Trainer::accumulate_gradients(int step) {
  engine_.zero_grads();
  step_normaliser_ = step_loss_normaliser(step);
  const float dloss = static_cast<float>(loss_scaler_.scale() / step_normaliser_);
  for (int micro = 0; micro < accum_; micro++) {
    train_data_->begin(batch_, B_);
    for (int b = 0; b < B_; b++) {
      uint64_t seq = sample_of(micro, b);
      train_data_->fill(batch_, b, sampler_->window(step, seq), static_cast<uint64_t>(step) * G_ + seq, false);
      for (int t = 0; t < T_; t++)  // the dropout stream: by (seed, step, sequence, position)
        dropout_keys_[static_cast<size_t>(b) * T_ + t] = dropout_token_key(cfg_.train.seed, step, seq, t);
    }
    model_->set_dropout_keys(dropout_keys_.data());
    engine_.train_micro_batch(*model_, batch_, dloss, step_sums_.data());
  }
  model_->set_dropout_keys(nullptr);
  if (cfg_.fsdp.cpu_offload)  // the loss comes down with the gradient shards, in finish_step's one wait
    compute_.backend().device->start_copy_to_host(offloaded_sums_.data(), step_sums_.data(), sizeof(double));
  engine_.finish_step();
  phase_timer_.end(PHASE_GRAD_SYNC);
}

double Trainer::evaluate() {
  model_->set_loss(nullptr);  // validation: the student's own loss (cross-entropy), not distillation's
  step_sums_.zero();
  const bool masked = val_data_->masks_targets();
  double sums[2] = {0, 0};  // the loss, and the trained targets under a loss mask
  for (int batch = 0; batch < cfg_.train.eval_batches; batch++) {
    for (int micro = 0; micro < accum_; micro++) {
      val_data_->begin(batch_, B_);
      for (int b = 0; b < B_; b++) {
        uint64_t seq = static_cast<uint64_t>(batch) * G_ + sample_of(micro, b);
        val_data_->fill(batch_, b, seq % val_data_->records(), seq, true);
        if (masked) sums[1] += static_cast<double>(val_data_->trained_targets(seq % val_data_->records()));
      }
      engine_.eval_micro_batch(*model_, batch_, step_sums_.data());
    }
  }
  compute_.backend().device->copy_to_host(&sums[0], step_sums_.data(), sizeof sums[0]);
  comm_->all_reduce_sum(Span<double>(sums, masked ? 2 : 1), "all_reduce(val loss)");
  const double normaliser = masked ? std::max(sums[1], 1.0) : cfg_.train.eval_batches * loss_normaliser();
  model_->set_loss(distill_loss_.get());
  return sums[0] / normaliser;
}

void Trainer::sample_images(int step) {
  if (!sample_prompts_) {
    rt_.agree_on([&] {
      sample_prompts_ = read_prompts(cfg_.flow.sample_prompts, cfg_.model, "flow.sample_prompts");
      if (sample_prompts_->tokens != cfg_.model.context_len)
        throw UsageError(strprintf("flow.sample_prompts='%s' holds prompts of %d tokens; the model is trained on %d "
                                   "(model.context_len): encode them with --max-sequence-length %d",
                                   cfg_.flow.sample_prompts.c_str(), sample_prompts_->tokens, cfg_.model.context_len,
                                   cfg_.model.context_len));
    });
  }
  const auto [rows, cols] = train_data_->image_grid();
  SamplerSettings settings;
  settings.rows = rows, settings.cols = cols, settings.steps = cfg_.flow.sample_steps;
  settings.guidance = cfg_.flow.sample_guidance, settings.seed = cfg_.train.seed;
  settings.shift = flux_resolution_shift(rows * cols);
  const double t0 = now_seconds();
  const std::vector<float> latents = FlowSampler(engine_, *model_, cfg_.model, settings).draw(*sample_prompts_, nullptr);
  const std::string folder = checkpoints_.dir() + "/samples";
  const std::string path = folder + strprintf("/step-%08d.h5", step + 1);
  rt_.agree_on([&] {
    if (!rt_.is_root()) return;
    std::error_code ec;
    std::filesystem::create_directories(folder, ec);
    if (ec) throw UsageError("cannot create '" + folder + "' for flow.sample_every: " + ec.message());
    write_sampled_latents(path, latents, sample_prompts_->count, cfg_.model.in_channels, settings,
                          strprintf("step %d of run %s", step + 1, cfg_.train.run_name.c_str()));
  });
  rt_.info("sample %5d/%d | %s in %.2f s: %s (tools/encode_images.py decode turns them into PNG files)", step + 1,
           steps_, counted(sample_prompts_->count, "image").c_str(), now_seconds() - t0, path.c_str());
}

int Trainer::run() {
  print_summary();
  checkpoints_.check_dir();  // a file where the run folder should be: exit 2 on every rank, before any use
  const int start = resume();
  const int steps = steps_;
  if (rt_.is_root()) std::filesystem::remove(stop_marker_path(checkpoints_.dir()));
  if (start == steps) {
    rt_.info("run '%s' already finished: the checkpoint in %s is at train.steps=%d, nothing to train (raise "
             "train.steps to continue it; set checkpoint.resume=none or another train.run_name to start over)",
             cfg_.train.run_name.c_str(), checkpoints_.dir().c_str(), steps);
    return EXIT_CODE_OK;
  }
  if (cfg_.train.metrics_file.empty() || cfg_.checkpoint.save) {  // metrics, STOPPED and checkpoints live there
    std::string error;
    std::error_code ec;
    if (rt_.is_root() && !std::filesystem::is_directory(checkpoints_.dir(), ec)) {
      std::filesystem::create_directories(checkpoints_.dir(), ec);
      if (ec)
        error = "cannot create the run folder '" + checkpoints_.dir() + "' (checkpoint.dir): " + ec.message() +
                "; name a folder that can be created, or set train.metrics_file";
    }
    // The effective configuration of this attempt (defaults and overrides resolved), beside its
    // checkpoints: what reproduces the run.
    if (error.empty() && rt_.is_root()) {
      std::string ini = resolved_ini(cfg_);
      if (cfg_.train.epochs > 0)
        ini = strprintf("# train.epochs=%g makes %d steps of this data\n", cfg_.train.epochs, steps_) + ini;
      error = CheckpointManager::write_file_synced(checkpoints_.dir() + "/config.ini", ini);
    }
    rt_.agree(error);
  }
  rt_.agree_on([&] {
    metrics_ = std::make_unique<MetricsWriter>(metrics_path(cfg_), rt_.is_root(), start > 0 ? start : -1);
    tensorboard_ = std::make_unique<TensorBoardWriter>(cfg_.train.tensorboard_dir, rt_.is_root(), start > 0 ? start : -1);
  });
  // A signal during start-up (MPI, data, resume) stops here, before any work: the newest
  // checkpoint (if any) is already the state to resume from.
  double early_signal = stop_signal_received();
  comm_->all_reduce_max(Span<double>(&early_signal, 1), "all_reduce(stop signal)");
  if (early_signal != 0) {
    stop_on_signal(start, static_cast<int>(early_signal), true);
    return EXIT_CODE_SIGNALLED;
  }
  const int every = cfg_.checkpoint.every;
  // checkpoint.keep_best: the best validation loss so far (a resumed run's from `best`).
  double best_val_loss = cfg_.checkpoint.keep_best && start > 0 ? checkpoints_.best_val_loss() : INFINITY;
  const double wall_start = now_seconds();
  double elapsed = 0, last_loss = NAN, last_val_loss = NAN;
  for (int step = start; step < steps; step++) {
    const StepOutcome out = run_step(step);
    if (!out.finite) {
      // Adapters scaled far beyond PEFT's usual alpha / rank are the likelier cause than the rate.
      const double scaling = table_.adapter().type != ADAPTER_NONE && table_.adapter().type != ADAPTER_OFT
                                 ? table_.adapter().scaling()
                                 : 0;
      const std::string cause = scaling > 8 ? strprintf("lower adapter.alpha: it scales the adapters' output by alpha / "
                                                        "rank = %g; or lower train.lr",
                                                        scaling)
                                            : "lower train.lr or raise train.warmup_steps";
      rt_.info("error: step %d: loss %g, gradient norm %g are not finite; the run diverged (%s)", step + 1, out.loss,
               out.grad_norm, cause.c_str());
      return EXIT_CODE_INTERNAL;
    }
    if (step > start || steps == start + 1) elapsed += out.seconds;  // the first step pays for page faults
    const double avg = elapsed / std::max(1, step - start + (steps == start + 1 ? 1 : 0));
    const bool print = step == start || step + 1 == steps || (step + 1) % cfg_.train.log_every == 0;
    // No estimate before a step without the first one's page faults has been timed.
    report_step(step, out, elapsed > 0 ? avg * (steps - step - 1) : step + 1 == steps ? 0 : NAN, print);
    last_loss = out.loss;
    bool best = false;
    if (val_data_ && cfg_.train.eval_every > 0 && ((step + 1) % cfg_.train.eval_every == 0 || step + 1 == steps)) {
      last_val_loss = evaluate();
      rt_.info("eval  %5d/%d | val loss %.4f", step + 1, steps, last_val_loss);
      metrics_->write_line(nlohmann::ordered_json{{"kind", "eval"}, {"step", step + 1}, {"val_loss", last_val_loss}}.dump());
      tensorboard_->scalar("val/loss", step + 1, last_val_loss);
      best = cfg_.checkpoint.keep_best && last_val_loss < best_val_loss;
    }
    if (cfg_.flow.sample_every > 0 && ((step + 1) % cfg_.flow.sample_every == 0 || step + 1 == steps))
      sample_images(step);
    // Rank 0 writes the records; a failed write (a full disk) stops every rank together.
    rt_.agree_on([&] {
      metrics_->check();
      tensorboard_->flush();
    });
    if (const int signal = static_cast<int>(out.maxima[STOP_SIGNAL])) {
      stop_on_signal(step + 1, signal, false);
      return EXIT_CODE_SIGNALLED;
    }
    if (best || (cfg_.checkpoint.save && ((every > 0 && (step + 1) % every == 0) || step + 1 == steps)))
      save(step + 1);
    if (best) {
      checkpoints_.mark_best(step + 1, last_val_loss);
      rt_.info("best validation loss so far (%.4f): %s, named in %s/best", last_val_loss,
               CheckpointManager::file_name(step + 1).c_str(), checkpoints_.dir().c_str());
      best_val_loss = last_val_loss;
    }
  }
  const double wall = now_seconds() - wall_start;
  if (op_timer_ && op_timer_->steps() > 0)
    rt_.info("op times on rank 0 (train.op_times), per step over steps %d..%d:\n%s", start + 2, steps,
             op_time_table(*op_timer_, 40).c_str());
  // A language model's yardstick: the loss of guessing every token uniformly.
  const std::string baseline = family_of(cfg_.model).token_data()
                                   ? strprintf(" | uniform-guess loss ln(V) = %.4f", std::log(cfg_.model.vocab_size))
                                   : "";
  rt_.info("done: %s in %s | final loss %.4f | val loss %s | %.0f tok/s%s", counted(steps - start, "step").c_str(),
           format_duration(wall).c_str(), last_loss,
           std::isfinite(last_val_loss) ? strprintf("%.4f", last_val_loss).c_str() : "-",
           static_cast<double>(steps - start) * G_ * T_ / wall, baseline.c_str());
  return EXIT_CODE_OK;
}

}  // namespace

int run_training(const Runtime& rt, const Config& config) {
  Trainer trainer(rt, config);
  return trainer.run();
}

}  // namespace shardtrain
