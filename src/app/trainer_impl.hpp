// The Trainer behind run_training (trainer.hpp), its methods split by concern: trainer_setup.cpp
// (construction: communicators, data, the memory plan, the start-up summary),
// trainer_checkpoints.cpp (the resume policy, checkpoint.init_from, saving) and trainer.cpp (the
// loop: a step, its report, evaluation, stopping on a signal). Batch semantics (docs/architecture.md):
// a step covers train.global_batch sequences; rank r's micro-batch m holds sequences
// (m*ranks + r)*B .. +B-1 of the step, so the rank count only changes how the same sequences are
// split. The loss is the mean over every token of the global batch: each token's loss gets weight
// 1/(global_batch*T) before the reduce-scatter sums the ranks.
#pragma once

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "app/compute_backend.hpp"
#include "app/loss_scaler.hpp"
#include "app/memory_plan.hpp"
#include "app/metrics.hpp"
#include "app/options.hpp"
#include "app/sample.hpp"
#include "app/step_report.hpp"
#include "app/teacher.hpp"
#include "app/text_encoder.hpp"
#include "app/tensorboard.hpp"
#include "backend/op_timer.hpp"
#include "ckpt/checkpoint_manager.hpp"
#include "comm/comm.hpp"
#include "comm/runtime.hpp"
#include "comm/watchdog.hpp"
#include "data/data_source.hpp"
#include "data/sampler.hpp"
#include "model/batch.hpp"
#include "model/loss.hpp"
#include "model/model.hpp"
#include "optim/adamw.hpp"
#include "shard/fsdp_engine.hpp"

namespace shardtrain {

// The stop marker: its presence tells a batch script that the run stopped on a signal after
// saving, and should be requeued (launchers do not always pass exit code 3 through).
inline std::string stop_marker_path(const std::string& dir) { return dir + "/STOPPED"; }

// train.metrics_file, or metrics.jsonl beside the run's checkpoints: each run keeps its own record.
inline std::string metrics_path(const Config& config) {
  return config.train.metrics_file.empty() ? checkpoint_dir(config) + "/metrics.jsonl" : config.train.metrics_file;
}

// A path made comparable across working directories ("" stays "").
inline std::string comparable_path(const std::string& path) {
  if (path.empty()) return path;
  std::error_code ec;
  std::filesystem::path p = std::filesystem::weakly_canonical(path, ec);
  return ec ? path : p.string();
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
    // A flow model's mean loss per noise-level bucket (NaN: no sample) and the step's samples in each.
    std::vector<double> loss_by_sigma;
    std::vector<int> sigma_samples;
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
  void load_sample_inputs();
  void sample_images(int step);
  // What a step's summed loss is divided by: the output units its loss averages over, on every rank
  // and micro-batch of the step (Loss::units_per_row).
  double loss_normaliser();
  // What the loss of step `step` averages over: loss_normaliser(), or with a loss mask
  // (DataSource::masks_targets) the step's trained targets on every rank, counted before it runs.
  double step_loss_normaliser(int step);
  uint64_t sample_of(int micro, int b) const;
  // A flow model's micro-batch loss, row by row, into step_sums_'s noise-level buckets.
  void add_loss_by_sigma();
  // The step's mean loss per bucket from the summed ones (out.loss_by_sigma), over every rank's
  // samples of step `step` (out.sigma_samples).
  void loss_by_sigma(int step, const double* bucket_sums, StepOutcome& out) const;
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
  std::vector<FrozenCompanion> frozen_;  // the teacher's and text encoder's tables, for the plan and the GEMM workspace
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
  std::shared_ptr<const CaptionTokenizer> captions_;  // text_encoder.source's tokenizer, for the data
  std::unique_ptr<TextEncoder> text_encoder_;          // text_encoder.source, beside the model
  std::optional<Prompts> sample_prompts_;  // flow.sample_prompts, read once
  std::optional<ConditionImages> sample_condition_;  // flow.sample_condition, read once
  // The step's summed loss and squared gradient norm (then the validation loss) in the compute
  // device's memory, read once at the end of a step into host_sums_; with cpu_offload the
  // optimizer reads them from offloaded_sums_ (the backend's host memory).
  DeviceArray<double> step_sums_, offloaded_sums_;
  std::vector<double> host_sums_;  // the same on the host (step_sums_bytes: with a flow model's buckets)
  Batch batch_;                         // this rank's micro-batch: tokens and targets
  std::vector<uint64_t> dropout_keys_;  // per token of a micro-batch: dropout_token_key
  CheckpointManager checkpoints_;
  std::unique_ptr<MetricsWriter> metrics_;  // opened by run() once the resume step is known
  std::unique_ptr<TensorBoardWriter> tensorboard_;
  LossScaler loss_scaler_;  // fp16's dynamic loss scale (1 without fp16)
  bool base_loaded_ = false;  // checkpoint.init_from's weights are in the engine (and nothing overwrote them)
};

}  // namespace shardtrain
