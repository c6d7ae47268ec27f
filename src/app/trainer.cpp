// The training loop (see trainer.hpp). Batch semantics are those of DESIGN.md: a step covers
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
#include <cstring>
#include <map>
#include <memory>
#include <sstream>

#include "app/compute_backend.hpp"
#include "app/memory_plan.hpp"
#include "app/metrics.hpp"
#include "app/perf.hpp"
#include "app/signals.hpp"
#include "ckpt/checkpoint_manager.hpp"
#include "ckpt/llmc.hpp"
#include "comm/comm.hpp"
#include "comm/watchdog.hpp"
#include "data/sampler.hpp"
#include "data/token_file.hpp"
#include "optim/adamw.hpp"
#include "shard/fsdp_engine.hpp"

namespace shardtrain {
namespace {

// The stop marker: its presence tells a batch script that the run stopped on a signal after
// saving, and should be requeued (launchers do not always pass exit code 3 through).
std::string stop_marker_path(const std::string& dir) { return dir + "/STOPPED"; }

// A JSON number; JSON has no inf or NaN, so those become null.
std::string json_number(double x) { return std::isfinite(x) ? strprintf("%.9g", x) : "null"; }

std::string format_duration(double seconds) {
  long s = std::lround(std::max(0.0, seconds));
  if (s >= 3600) return strprintf("%ldh%02ldm", s / 3600, (s / 60) % 60);
  if (s >= 60) return strprintf("%ldm%02lds", s / 60, s % 60);
  return strprintf("%lds", s);
}

// Peak bytes per memory category and in total, plus the stop signal, as one vector for a single
// MAX all-reduce per step.
// DEVICE_RESERVED: what the GPU's caching allocator took at most (0 on the CPU backend).
constexpr int PEAK_TOTAL = MEM_CATEGORY_COUNT, STOP_SIGNAL = MEM_CATEGORY_COUNT + 1,
              RSS_GROWTH = MEM_CATEGORY_COUNT + 2, COMM_BYTES = MEM_CATEGORY_COUNT + 3,
              DEVICE_RESERVED = MEM_CATEGORY_COUNT + 4;
using MemoryPeaks = std::array<double, MEM_CATEGORY_COUNT + 5>;

// fp16 dynamic loss scaling: start at 2^16, halve on overflow, double after this many good steps.
constexpr double INITIAL_LOSS_SCALE = 65536;
constexpr int LOSS_SCALE_GROWTH_INTERVAL = 200;

// A field of /proc/self/status in bytes (VmRSS, VmHWM), or 0.
double proc_status_bytes(const char* field) {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.compare(0, std::strlen(field), field) == 0 && line[std::strlen(field)] == ':')
      return std::atof(line.c_str() + std::strlen(field) + 1) * 1024;  // reported in kB
  return 0;
}

MemoryPeaks local_memory_peaks(const MemoryTracker& m, double rss_at_start, const Device& device) {
  MemoryPeaks p{};
  for (int c = 0; c < MEM_CATEGORY_COUNT; c++) p[c] = static_cast<double>(m.peak(static_cast<MemCategory>(c)));
  p[PEAK_TOTAL] = static_cast<double>(m.total_peak());
  p[STOP_SIGNAL] = stop_signal_received();
  p[RSS_GROWTH] = proc_status_bytes("VmHWM") - rss_at_start;
  p[DEVICE_RESERVED] = static_cast<double>(device.peak_reserved_bytes());
  return p;
}

std::string memory_json(const MemoryPeaks& p) {
  std::string s = "{";
  for (int c = 0; c < MEM_CATEGORY_COUNT; c++)
    s += strprintf("%s\"%s\":%.0f", c ? "," : "", mem_category_name(static_cast<MemCategory>(c)), p[c]);
  return s + "}";
}

class Trainer {
 public:
  Trainer(const Runtime& rt, const Config& config);
  int run();

 private:
  void open_data();
  void print_summary();
  // Loads the checkpoint that checkpoint.resume selects; returns its step (0: fresh start).
  int resume();
  int resume_auto();
  // Loads one checkpoint; returns its step, or -1 when fall_back and the file is unusable.
  int try_load(const std::string& path, bool fall_back);
  void warn_config_changes(const CheckpointState& state);
  void save(int step);

  struct StepOutcome {
    double loss = 0, grad_norm = 0, lr = 0, seconds = 0, loss_scale = 1;
    bool finite = true, skipped = false;
    MemoryPeaks peaks{};
  };
  // One optimizer step: micro-batches, gradient reduction, norm, update (or an fp16 skip).
  StepOutcome optimizer_step(int step);
  void report_step(int step, const StepOutcome& out, double eta_seconds, MetricsWriter& metrics);
  void stop_on_signal(int step, int signal);
  uint64_t bytes_sent() const;
  // Sum of the token losses of this rank's micro-batches.
  double train_step(int step);
  double evaluate();

  const Runtime& rt_;
  const Config& cfg_;
  double rss_at_start_;
  const int B_, T_, G_, accum_;
  int threads_ = 1;
  double peak_gflops_ = 0;
  Watchdog watchdog_;
  ShardingStrategy strategy_;
  ComputeBackend compute_;
  std::unique_ptr<Comm> comm_;  // MPI on host memory: agreement, metrics, checkpoints
  std::unique_ptr<Comm> shard_comm_, replica_comm_;  // on the compute device's memory
  std::unique_ptr<TokenFile> train_file_, val_file_;
  std::unique_ptr<SequenceSampler> sampler_;
  MemoryPlan plan_;  // checked against fsdp.memory_limit before anything below is allocated
  ParamTable table_;
  MemoryTracker memory_;
  FsdpEngine engine_;
  OptimConfig optim_config_;
  AdamW optimizer_;
  std::unique_ptr<GptModel<float>> model_;
  std::vector<int> tokens_, targets_;
  CheckpointManager checkpoints_;
  bool loss_scaling_;
  double loss_scale_;
  int64_t good_steps_ = 0;
};

ShardingStrategy strategy_from(const Config& config) {
  ShardingStrategy s = SHARDING_FULL_SHARD;
  parse_sharding_strategy(config.fsdp.sharding_strategy, &s);  // validated by validate_config
  return s;
}

// Ranks per shard group: all for FULL_SHARD/SHARD_GRAD_OP, one for NO_SHARD, and for
// HYBRID_SHARD fsdp.shard_group_size or the ranks of one node.
int shard_group_size(const Runtime& rt, const Config& config, ShardingStrategy s) {
  if (s == SHARDING_NO_SHARD) return 1;
  if (s != SHARDING_HYBRID_SHARD) return rt.world();
  int size = config.fsdp.shard_group_size > 0 ? config.fsdp.shard_group_size : rt.local_size();
  if (rt.world() % size != 0)
    throw UsageError(strprintf("HYBRID_SHARD: %d ranks per node do not divide the %d ranks; set fsdp.shard_group_size "
                               "to a divisor of the rank count", size, rt.world()));
  return size;
}

// Shard groups are consecutive ranks (one node under the usual block placement); replica
// groups take the same position in every shard group.
std::unique_ptr<Comm> split_comm(const ComputeBackend& compute, int color, int key, Watchdog* watchdog) {
  MPI_Comm comm;
  MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, color, key, &comm));
  return compute.make_comm(comm, watchdog);
}

std::unique_ptr<Comm> make_shard_comm(const Runtime& rt, const Config& c, ShardingStrategy s,
                                      const ComputeBackend& compute, Watchdog* watchdog) {
  const int size = shard_group_size(rt, c, s);
  auto comm = split_comm(compute, rt.rank() / size, rt.rank(), watchdog);
  return c.debug.skip_communication ? make_silent_comm(*comm) : std::move(comm);
}

std::unique_ptr<Comm> make_replica_comm(const Runtime& rt, const Config& c, ShardingStrategy s,
                                        const ComputeBackend& compute, Watchdog* watchdog) {
  const int size = shard_group_size(rt, c, s);
  auto comm = split_comm(compute, rt.rank() % size, rt.rank(), watchdog);
  return c.debug.skip_communication ? make_silent_comm(*comm) : std::move(comm);
}

// The rank's planned bytes; an InputError (agreed) when they exceed fsdp.memory_limit.
MemoryPlan checked_memory_plan(const Runtime& rt, const Config& c, ShardingStrategy strategy, const Comm& shard,
                               const Comm& replica, const ComputeBackend& compute) {
  GroupShape groups{shard.size(), shard.rank(), replica.size(), replica.rank()};
  MemoryPlan plan = plan_rank_memory(c.model, groups, engine_options(c), c.train.micro_batch, c.train.seq_len, c.fsdp.activation_checkpointing);
  rt.agree_on([&] {
    size_t limit = parse_memory_size(c.fsdp.memory_limit, "fsdp.memory_limit");
    if (limit && plan.total() > limit)
      throw UsageError(strprintf(
          "out of memory: rank %d needs %s > fsdp.memory_limit=%s (%s); try a sharding strategy that shards "
          "more (FULL_SHARD), fsdp.activation_checkpointing=true or a smaller train.micro_batch -- 'shardtrain "
          "plan' lists what fits",
          rt.rank(), format_bytes(static_cast<double>(plan.total())).c_str(), c.fsdp.memory_limit.c_str(),
          plan.describe().c_str()));
    // The GPU's own limit, checked the same way (the backend's workspaces come on top of the plan).
    if (compute.on_gpu() && plan.total() > compute.gpu_free_bytes())
      throw UsageError(strprintf(
          "out of GPU memory: rank %d needs %s but %s has %s free of %s (%s); try a sharding strategy that shards "
          "more (FULL_SHARD), fsdp.activation_checkpointing=true, fsdp.cpu_offload=true or a smaller "
          "train.micro_batch -- 'shardtrain plan --memory-limit' lists what fits",
          rt.rank(), format_bytes(static_cast<double>(plan.total())).c_str(), compute.describe().c_str(),
          format_bytes(static_cast<double>(compute.gpu_free_bytes())).c_str(),
          format_bytes(static_cast<double>(compute.gpu_total_bytes())).c_str(), plan.describe().c_str()));
  });
  return plan;
}

OptimConfig optim_config_from(const TrainOptions& t) {
  OptimConfig o;
  o.lr = t.lr;
  o.min_lr_ratio = t.min_lr_ratio;
  o.warmup_steps = t.warmup_steps;
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
      rss_at_start_(proc_status_bytes("VmRSS")),
      B_(config.train.micro_batch),
      T_(config.train.seq_len),
      G_(config.train.global_batch),
      accum_(config.train.global_batch / (config.train.micro_batch * rt.world())),
      watchdog_(config.fsdp.comm_timeout, strprintf("[rank %d/%d %s]", rt.rank(), rt.world(), rt.host().c_str())),
      strategy_(strategy_from(config)),
      compute_(config.train.device, engine_options(config).param_dtype, rt),
      comm_(make_mpi_comm(rt.world_comm(), &watchdog_)),
      shard_comm_(make_shard_comm(rt, config, strategy_, compute_, &watchdog_)),
      replica_comm_(make_replica_comm(rt, config, strategy_, compute_, &watchdog_)),
      plan_(checked_memory_plan(rt, config, strategy_, *shard_comm_, *replica_comm_, compute_)),
      table_(config.model),
      engine_(table_, *shard_comm_, *replica_comm_, memory_, engine_options(config), compute_.backend()),
      optim_config_(optim_config_from(config.train)),
      optimizer_(optim_config_, engine_, memory_),
      checkpoints_(rt, *comm_, checkpoint_dir(config), config.checkpoint.keep),
      loss_scaling_(engine_options(config).param_dtype == DTYPE_FP16 || engine_options(config).reduce_dtype == DTYPE_FP16),
      loss_scale_(loss_scaling_ ? INITIAL_LOSS_SCALE : 1.0) {
  threads_ = cfg_.train.threads > 0 ? cfg_.train.threads : default_threads_per_rank(rt.local_size());
  set_compute_threads(threads_);
  open_data();
  model_ = std::make_unique<GptModel<float>>(table_, B_, T_, cfg_.fsdp.activation_checkpointing,
                                             *compute_.backend().ops);
  memory_.add(MEM_ACTIVATIONS, model_->activation_bytes());
  for (int c = 0; c < MEM_CATEGORY_COUNT; c++)  // the planner is exact: it is what was allocated
    SHARD_CHECK(memory_.current(static_cast<MemCategory>(c)) == plan_.bytes[c], "%s: tracked %zu, planned %zu",
                mem_category_name(static_cast<MemCategory>(c)), memory_.current(static_cast<MemCategory>(c)),
                plan_.bytes[c]);
  tokens_.resize(static_cast<size_t>(B_) * T_);
  targets_.resize(tokens_.size());
  engine_.init_parameters(cfg_.train.seed);
  if (cfg_.train.peak_gflops > 0) {
    peak_gflops_ = cfg_.train.peak_gflops;
  } else if (compute_.on_gpu()) {
    peak_gflops_ = compute_.gpu_peak_gflops();
    if (peak_gflops_ <= 0)
      rt_.warn("unknown GPU '%s': MFU is not reported; set train.peak_gflops to its dense bf16 peak in GFLOP/s",
               compute_.describe().c_str());
  } else {
    comm_->barrier("barrier(sgemm peak)");  // every rank measures at once: the peak under shared load
    double peak = measure_sgemm_gflops(2048, 5);
    comm_->all_reduce_max(Span<double>(&peak, 1), "all_reduce(sgemm peak)");
    peak_gflops_ = peak;
  }
}

void Trainer::open_data() {
  const int V = cfg_.model.vocab_size;
  auto open = [&](const std::string& path, const char* option) {
    std::unique_ptr<TokenFile> file;
    rt_.agree_on([&] { file = std::make_unique<TokenFile>(path); });
    // Each rank scans a disjoint part for out-of-range tokens; the verdict is agreed.
    rt_.agree(check_token_range(*file, V, rt_.rank(), rt_.world()));
    (void)option;
    return file;
  };
  train_file_ = open(cfg_.data.train_file, "data.train_file");
  rt_.agree_on([&] {
    sampler_ = std::make_unique<SequenceSampler>(cfg_.train.seed, train_file_->num_tokens(), T_, G_, train_file_->path());
  });
  if (!cfg_.data.val_file.empty()) {
    val_file_ = open(cfg_.data.val_file, "data.val_file");
    rt_.agree_on([&] {
      if (val_file_->num_tokens() < static_cast<size_t>(T_) + 1)
        throw DataError(strprintf("data file '%s': %zu tokens, too short for one sequence of train.seq_len=%d + 1",
                                  val_file_->path().c_str(), val_file_->num_tokens(), T_));
    });
  }
}

void Trainer::print_summary() {
  const ModelConfig& m = cfg_.model;
  const size_t total = table_.total_params();
  rt_.info("shardtrain train: run '%s' on %d ranks x %d threads, %s (shard group %d, replicas %d)",
           cfg_.train.run_name.c_str(), rt_.world(), threads_, sharding_strategy_name(strategy_), shard_comm_->size(),
           replica_comm_->size());
  rt_.info("model: GPT-2 L=%d C=%d H=%d V=%d max_seq_len=%d | %.2fM parameters in %zu units (root + %d blocks) | "
           "%.2fM per rank",
           m.n_layer, m.n_embd, m.n_head, m.vocab_size, m.max_seq_len, total / 1e6, table_.units().size(), m.n_layer,
           engine_.local_param_count() / 1e6);
  rt_.info("batch: %d sequences x %d tokens = %d tokens/step | micro_batch %d per rank | gradient accumulation %d",
           G_, T_, G_ * T_, B_, accum_);
  std::string mem;
  for (int c = 0; c < MEM_CATEGORY_COUNT; c++) {
    size_t bytes = memory_.current(static_cast<MemCategory>(c));
    if (bytes) mem += strprintf("%s%s %s", mem.empty() ? "" : ", ", mem_category_name(static_cast<MemCategory>(c)),
                                format_bytes(bytes).c_str());
  }
  rt_.info("memory per rank: %s | total %s", mem.c_str(), format_bytes(memory_.total_current()).c_str());
  if (compute_.on_gpu())
    rt_.info("compute: %s | peak %.1f GFLOP/s per rank (%s) | %.1f MFLOP per token", compute_.describe().c_str(),
             peak_gflops_, cfg_.train.peak_gflops > 0 ? "given" : "dense bf16 of the card", table_.flops_per_token(T_) / 1e6);
  else
    rt_.info("compute: OpenBLAS %s | SGEMM peak %.1f GFLOP/s per rank (%s) | %.1f MFLOP per token",
             blas_description().c_str(), peak_gflops_, cfg_.train.peak_gflops > 0 ? "given" : "measured",
             table_.flops_per_token(T_) / 1e6);
  rt_.info("data: %s (%zu tokens)%s", train_file_->path().c_str(), train_file_->num_tokens(),
           val_file_ ? strprintf(" | val %s (%zu tokens)", val_file_->path().c_str(), val_file_->num_tokens()).c_str()
                     : "");
}

// Parses "[section]\nkey = value" lines into section.key -> value.
std::map<std::string, std::string> parse_ini(const std::string& text) {
  std::map<std::string, std::string> values;
  std::istringstream in(text);
  std::string line, section;
  while (std::getline(in, line)) {
    if (line.size() > 2 && line.front() == '[') {
      section = line.substr(1, line.find(']') - 1);
    } else if (size_t eq = line.find(" = "); eq != std::string::npos) {
      values[section + "." + line.substr(0, eq)] = line.substr(eq + 3);
    }
  }
  return values;
}

void Trainer::warn_config_changes(const CheckpointState& state) {
  auto before = parse_ini(state.config_ini), now = parse_ini(resolved_ini(cfg_));
  std::string changed;
  for (const auto& [key, value] : now) {
    auto it = before.find(key);
    if (it != before.end() && it->second != value && key != "checkpoint.resume")
      changed += strprintf("%s%s: %s -> %s", changed.empty() ? "" : ", ", key.c_str(), it->second.c_str(), value.c_str());
  }
  if (!changed.empty()) rt_.warn("resuming with a changed configuration: %s", changed.c_str());
}

int Trainer::try_load(const std::string& path, bool fall_back) {
  CheckpointState state;
  try {
    rt_.agree_on([&] { state = read_checkpoint_state(path); });
    // The same file's metadata on every rank: the verdict is identical without an agreement.
    std::string mismatch = model_mismatch(path, state.model, cfg_.model);
    if (!mismatch.empty()) throw UsageError(mismatch);
    if (state.step > cfg_.train.steps)
      throw UsageError(strprintf("checkpoint '%s' is at step %lld, past train.steps=%d; raise train.steps",
                                 path.c_str(), static_cast<long long>(state.step), cfg_.train.steps));
    Watchdog::Scope scope(&watchdog_, "checkpoint load");  // HDF5's collectives are not ours to time
    rt_.agree_on([&] { state = load_checkpoint(path, engine_, optimizer_, MPI_COMM_WORLD); });
  } catch (const UsageError&) {
    throw;
  } catch (const InputError& e) {
    if (!fall_back) throw;
    rt_.warn("skipping unusable checkpoint: %s", e.what());
    return -1;
  }
  warn_config_changes(state);
  if (loss_scaling_) {
    loss_scale_ = std::ldexp(1.0, static_cast<int>(state.loss_scale_log2));
    good_steps_ = state.loss_scale_good_steps;
  }
  rt_.info("resumed from %s at step %lld (saved on %lld ranks, %s layout)", path.c_str(),
           static_cast<long long>(state.step), static_cast<long long>(state.world_size), state.layout.c_str());
  return static_cast<int>(state.step);
}

int Trainer::resume() {
  const std::string& mode = cfg_.checkpoint.resume;
  int step = 0;
  if (mode != "none") step = mode == "auto" ? resume_auto() : try_load(mode, false);
  if (step == 0 && !cfg_.checkpoint.init_from.empty()) {
    rt_.agree_on([&] { load_llmc_shards(cfg_.checkpoint.init_from, engine_); });
    rt_.info("initialised the weights from llm.c checkpoint %s", cfg_.checkpoint.init_from.c_str());
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
  state.strategy = cfg_.fsdp.sharding_strategy;
  state.config_ini = resolved_ini(cfg_);
  state.loss_scale_log2 = std::lround(std::log2(loss_scale_));
  state.loss_scale_good_steps = good_steps_;
  const double t0 = MPI_Wtime();
  Watchdog::Scope scope(&watchdog_, "checkpoint save");
  std::string path = checkpoints_.save(state, engine_, optimizer_);
  rt_.info("saved %s (%s, %.2f s)", path.c_str(), state.layout.c_str(), MPI_Wtime() - t0);
}

Trainer::StepOutcome Trainer::optimizer_step(int step) {
  comm_->barrier("barrier(step start)");  // time the step between barriers
  const double t0 = MPI_Wtime();
  const uint64_t bytes_before = bytes_sent();
  double sums[2] = {train_step(step), 0.0};
  if (rt_.rank() == cfg_.debug.stall_rank && step == cfg_.debug.stall_step)
    usleep(static_cast<useconds_t>(cfg_.debug.stall_seconds * 1e6));
  if (rt_.is_root() && step + 1 == cfg_.debug.inject_inf_step) {
    const float inf = INFINITY;
    DeviceArray<float>& grads = engine_.shards()[ROOT_UNIT].grads;
    grads.device()->copy(grads.data(), &inf, sizeof inf);
  }
  sums[1] = optimizer_.local_grad_sq_norm();
  comm_->all_reduce_sum(Span<double>(sums, 2), "all_reduce(loss, grad norm)");
  StepOutcome out;
  out.loss = sums[0] / (static_cast<double>(G_) * T_);
  out.grad_norm = std::sqrt(sums[1]) / loss_scale_;
  out.loss_scale = loss_scale_;
  out.finite = std::isfinite(out.loss) && std::isfinite(out.grad_norm);
  if (!out.finite && loss_scaling_) {
    // fp16 overflow: skip the update, halve the scale (the data of this step is consumed).
    out.skipped = true, out.finite = true;
    loss_scale_ /= 2, good_steps_ = 0;
    rt_.info("step %d: inf/NaN gradients at fp16 loss scale %g: update skipped, loss scale halved to %g", step + 1,
             out.loss_scale, loss_scale_);
  } else if (out.finite) {
    out.lr = optimizer_.step(step, out.grad_norm, loss_scale_);
    if (loss_scaling_ && ++good_steps_ % LOSS_SCALE_GROWTH_INTERVAL == 0) loss_scale_ *= 2;
  }
  compute_.backend().device->synchronize();  // a GPU's queued optimizer step belongs to this step's time
  out.peaks = local_memory_peaks(memory_, rss_at_start_, *compute_.backend().device);
  out.peaks[COMM_BYTES] = static_cast<double>(bytes_sent() - bytes_before);
  comm_->all_reduce_max(Span<double>(out.peaks.data(), out.peaks.size()), "all_reduce(memory peaks)");
  out.seconds = MPI_Wtime() - t0;
  return out;
}

void Trainer::report_step(int step, const StepOutcome& out, double eta_seconds, MetricsWriter& metrics) {
  const double tokens_per_s = G_ * T_ / out.seconds;
  const double mfu =
      peak_gflops_ > 0 ? table_.flops_per_token(T_) * G_ * T_ / out.seconds / (rt_.world() * peak_gflops_ * 1e9) : 0;
  const std::string reserved =
      compute_.on_gpu() ? " (GPU reserved " + format_bytes(out.peaks[DEVICE_RESERVED]) + ")" : std::string();
  rt_.info("step %5d/%d | loss %.4f | lr %.2e | norm %.3f | %.0f tok/s | MFU %.1f%% | peak mem %s%s | eta %s%s",
           step + 1, cfg_.train.steps, out.loss, out.lr, out.grad_norm, tokens_per_s, 100 * mfu,
           format_bytes(out.peaks[PEAK_TOTAL]).c_str(), reserved.c_str(), format_duration(eta_seconds).c_str(),
           out.skipped ? " | SKIPPED" : "");
  metrics.write_line(strprintf(
      "{\"kind\":\"step\",\"step\":%d,\"loss\":%s,\"lr\":%.9g,\"grad_norm\":%s,\"tokens_per_s\":%.6g,\"mfu\":%.6g,"
      "\"step_seconds\":%.6g,\"peak_mem_bytes\":%.0f,\"peak_mem\":%s,\"rss_growth_bytes\":%.0f,"
      "\"comm_bytes\":%.0f,\"device_reserved_bytes\":%.0f,\"loss_scale\":%g,\"skipped\":%s}",
      step + 1, json_number(out.loss).c_str(), out.lr, json_number(out.grad_norm).c_str(), tokens_per_s, mfu,
      out.seconds, out.peaks[PEAK_TOTAL],
      memory_json(out.peaks).c_str(), out.peaks[RSS_GROWTH], out.peaks[COMM_BYTES], out.peaks[DEVICE_RESERVED],
      out.loss_scale,
      out.skipped ? "true" : "false"));
}

void Trainer::stop_on_signal(int step, int signal) {
  rt_.info("stopping on %s after step %d: saving a checkpoint", signal_name(signal), step);
  save(step);
  if (rt_.is_root())
    std::ofstream(stop_marker_path(checkpoints_.dir())) << "step " << step << "\nsignal " << signal_name(signal) << "\n";
  rt_.info("stopped at step %d on %s; checkpoint saved, exit code %d (resume with checkpoint.resume=auto)", step,
           signal_name(signal), EXIT_CODE_SIGNALLED);
}

uint64_t Trainer::bytes_sent() const {
  return comm_->bytes_sent() + shard_comm_->bytes_sent() + replica_comm_->bytes_sent();
}

double Trainer::train_step(int step) {
  engine_.zero_grads();
  const float dloss = static_cast<float>(loss_scale_ / (static_cast<double>(G_) * T_));
  double loss_sum = 0;
  for (int micro = 0; micro < accum_; micro++) {
    for (int b = 0; b < B_; b++) {
      uint64_t seq = static_cast<uint64_t>(micro * rt_.world() + rt_.rank()) * B_ + b;
      sampler_->fill(*train_file_, step, seq, &tokens_[static_cast<size_t>(b) * T_], &targets_[static_cast<size_t>(b) * T_]);
    }
    loss_sum += engine_.train_micro_batch(*model_, tokens_.data(), targets_.data(), dloss);
  }
  engine_.finish_step();
  return loss_sum;
}

double Trainer::evaluate() {
  const size_t windows = (val_file_->num_tokens() - 1) / T_;
  const uint16_t* data = val_file_->tokens();
  double loss_sum = 0;
  for (int batch = 0; batch < cfg_.train.eval_batches; batch++) {
    for (int micro = 0; micro < accum_; micro++) {
      for (int b = 0; b < B_; b++) {
        uint64_t seq = static_cast<uint64_t>(batch) * G_ + static_cast<uint64_t>(micro * rt_.world() + rt_.rank()) * B_ + b;
        const uint16_t* start = data + (seq % windows) * T_;
        for (int t = 0; t < T_; t++) {
          tokens_[static_cast<size_t>(b) * T_ + t] = start[t];
          targets_[static_cast<size_t>(b) * T_ + t] = start[t + 1];
        }
      }
      loss_sum += engine_.eval_micro_batch(*model_, tokens_.data(), targets_.data());
    }
  }
  comm_->all_reduce_sum(Span<double>(&loss_sum, 1), "all_reduce(val loss)");
  return loss_sum / (static_cast<double>(cfg_.train.eval_batches) * G_ * T_);
}

int Trainer::run() {
  print_summary();
  const int start = resume();
  if (rt_.is_root()) std::filesystem::remove(stop_marker_path(checkpoints_.dir()));
  if (start == cfg_.train.steps)
    rt_.info("the checkpoint is already at train.steps=%d: nothing to train (raise train.steps, or set "
             "checkpoint.resume=none to start over)", start);
  std::unique_ptr<MetricsWriter> metrics;
  rt_.agree_on([&] {
    metrics = std::make_unique<MetricsWriter>(cfg_.train.metrics_file, rt_.is_root(), start > 0 ? start : -1);
  });
  const int steps = cfg_.train.steps;
  const int every = cfg_.checkpoint.every;
  double elapsed = 0;
  for (int step = start; step < steps; step++) {
    const StepOutcome out = optimizer_step(step);
    if (!out.finite) {
      rt_.info("error: step %d: loss %g, gradient norm %g are not finite; the run diverged (lower train.lr or "
               "raise train.warmup_steps)", step + 1, out.loss, out.grad_norm);
      return EXIT_CODE_INTERNAL;
    }
    if (step > start || steps == start + 1) elapsed += out.seconds;  // the first step pays for page faults
    const double avg = elapsed / std::max(1, step - start + (steps == start + 1 ? 1 : 0));
    report_step(step, out, avg * (steps - step - 1), *metrics);
    if (val_file_ && cfg_.train.eval_every > 0 && ((step + 1) % cfg_.train.eval_every == 0 || step + 1 == steps)) {
      double val_loss = evaluate();
      rt_.info("eval  %5d/%d | val loss %.4f", step + 1, steps, val_loss);
      metrics->write_line(strprintf("{\"kind\":\"eval\",\"step\":%d,\"val_loss\":%.9g}", step + 1, val_loss));
    }
    if (const int signal = static_cast<int>(out.peaks[STOP_SIGNAL])) {
      stop_on_signal(step + 1, signal);
      return EXIT_CODE_SIGNALLED;
    }
    if (cfg_.checkpoint.save && ((every > 0 && (step + 1) % every == 0) || step + 1 == steps)) save(step + 1);
  }
  rt_.info("done: %d steps, %.1f s, uniform-guess loss ln(V) = %.4f", steps, elapsed, std::log(cfg_.model.vocab_size));
  return EXIT_CODE_OK;
}

}  // namespace

int run_training(const Runtime& rt, const Config& config) {
  install_stop_signal_handlers();
  Trainer trainer(rt, config);
  return trainer.run();
}

}  // namespace shardtrain
