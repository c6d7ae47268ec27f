// The training loop (see trainer.hpp; the Trainer in trainer_impl.hpp): a step's micro-batches,
// gradient reduction and update with one host wait, its report, evaluation, image samples, and
// stopping on a signal with a save.
#include "app/trainer.hpp"
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
  (step_comm_ ? *step_comm_ : *comm_)
      .all_reduce_sum(Span<double>(sums, step_sums_.size()), "all_reduce(loss, grad norm, loss by noise level)");
  const double lr = optimizer_.step(step, sums, loss_scaler_.scale());
  phase_timer_.end(PHASE_OPTIMIZER);
  if (offload)
    std::copy_n(offloaded_sums_.data(), host_sums_.size(), host_sums_.data());
  else
    device.copy_to_host(host_sums_.data(), step_sums_.data(), step_sums_.bytes());  // the step's one wait
  StepOutcome out;
  out.loss = host_sums_[0] / step_normaliser_;
  out.grad_norm = std::sqrt(host_sums_[1]) / loss_scaler_.scale();
  if (host_sums_.size() > 2) loss_by_sigma(step, host_sums_.data() + 2, out);
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
  if (!out.loss_by_sigma.empty()) {  // null where no sample of the step fell in the bucket
    nlohmann::ordered_json buckets = nlohmann::ordered_json::array();
    for (double v : out.loss_by_sigma) buckets.push_back(std::isfinite(v) ? nlohmann::ordered_json(v) : nullptr);
    record["loss_by_sigma"] = buckets;
    record["sigma_samples"] = out.sigma_samples;
  }
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

void Trainer::add_loss_by_sigma() {
  const float* sigma = batch_.get<float>(BATCH_NOISE_LEVEL, B_);
  const int rows = model_->output_rows() / B_;  // a sample's output rows (its image tokens)
  const float* losses = model_->predictor()->row_losses();
  for (int b = 0; b < B_; b++)
    compute_.backend().ops->accumulate_sum(step_sums_.data() + 2 + flow_loss_bucket(sigma[b]),
                                           losses + static_cast<size_t>(b) * rows, rows);
}

void Trainer::loss_by_sigma(int step, const double* bucket_sums, StepOutcome& out) const {
  // Every sample of the step, on every rank: its noise level is a function of (seed, sample) alone.
  out.sigma_samples.assign(FLOW_LOSS_BUCKETS, 0);
  for (int seq = 0; seq < G_; seq++)
    out.sigma_samples[flow_loss_bucket(
        train_sigma(cfg_.flow, cfg_.train.seed, T_, static_cast<uint64_t>(step) * G_ + seq))]++;
  out.loss_by_sigma.assign(FLOW_LOSS_BUCKETS, NAN);
  const double per_sample = step_normaliser_ / G_;  // what one sample's loss is averaged over
  for (int k = 0; k < FLOW_LOSS_BUCKETS; k++)
    if (out.sigma_samples[k] > 0) out.loss_by_sigma[k] = bucket_sums[k] / (out.sigma_samples[k] * per_sample);
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
    if (text_encoder_) text_encoder_->encode(batch_);  // the captions' embeddings
    model_->set_dropout_keys(dropout_keys_.data());
    engine_.train_micro_batch(*model_, batch_, dloss, step_sums_.data());
    if (step_sums_.size() > 2) add_loss_by_sigma();
  }
  model_->set_dropout_keys(nullptr);
  if (cfg_.fsdp.cpu_offload)  // the loss comes down with the gradient shards, in finish_step's one wait
    compute_.backend().device->start_copy_to_host(offloaded_sums_.data(), step_sums_.data(), step_sums_.bytes());
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
      if (text_encoder_) text_encoder_->encode(batch_);
      engine_.eval_micro_batch(*model_, batch_, step_sums_.data());
    }
  }
  compute_.backend().device->copy_to_host(&sums[0], step_sums_.data(), sizeof sums[0]);
  comm_->all_reduce_sum(Span<double>(sums, masked ? 2 : 1), "all_reduce(val loss)");
  const double normaliser = masked ? std::max(sums[1], 1.0) : cfg_.train.eval_batches * loss_normaliser();
  model_->set_loss(distill_loss_.get());
  return sums[0] / normaliser;
}

// flow.sample_every's inputs, read (and checked) at start-up rather than at the first sample.
void Trainer::load_sample_inputs() {
  if (text_encoder_) {  // the prompts' captions, encoded once
    std::vector<std::string> captions;
    rt_.agree_on([&] { captions = read_prompt_captions(cfg_.flow.sample_prompts, "flow.sample_prompts"); });
    sample_prompts_ = text_encoder_->encode_captions(captions, "flow.sample_prompts='" + cfg_.flow.sample_prompts + "'");
  } else {
    rt_.agree_on([&] {
      sample_prompts_ = read_prompts(cfg_.flow.sample_prompts, cfg_.model, "flow.sample_prompts");
      if (sample_prompts_->tokens != cfg_.model.context_len)
        throw UsageError(strprintf("flow.sample_prompts='%s' holds prompts of %d tokens; the model is trained on %d "
                                   "(model.context_len): encode them with --max-sequence-length %d",
                                   cfg_.flow.sample_prompts.c_str(), sample_prompts_->tokens, cfg_.model.context_len,
                                   cfg_.model.context_len));
    });
  }
  if (cfg_.model.condition_len > 0) {
    rt_.agree_on([&] {
      ConditionImages c = read_condition_images(cfg_.flow.sample_condition, cfg_.model, "flow.sample_condition",
                                                sample_prompts_->count);
      if (c.tokens != cfg_.model.condition_len)
        throw UsageError(strprintf("flow.sample_condition='%s' holds condition images of %d tokens; the model is "
                                   "trained on %d (model.condition_len): encode them at the training data's size",
                                   cfg_.flow.sample_condition.c_str(), c.tokens, cfg_.model.condition_len));
      sample_condition_ = std::move(c);
    });
  }
}

void Trainer::sample_images(int step) {
  const auto [rows, cols] = train_data_->image_grid();
  SamplerSettings settings;
  settings.rows = rows, settings.cols = cols, settings.steps = cfg_.flow.sample_steps;
  settings.guidance = cfg_.flow.sample_guidance, settings.seed = cfg_.train.seed, settings.cfg = cfg_.flow.sample_cfg;
  settings.shift = auto_sampling_shift(cfg_.model, rows * cols, settings.steps);
  const double t0 = now_seconds();
  // The empty caption, as flow.caption_dropout trains it: zeros, or the text encoder's "".
  Prompts empty;
  if (text_encoder_ && settings.cfg > 1) {
    empty = text_encoder_->encode_captions({""}, "the empty caption");
  } else {
    empty.count = 1, empty.tokens = sample_prompts_->tokens;
    empty.text.assign(static_cast<size_t>(empty.tokens) * cfg_.model.context_dim, 0.0f);
    empty.pooled.assign(cfg_.model.pooled_dim, 0.0f);
  }
  const std::vector<float> latents =
      FlowSampler(engine_, *model_, cfg_.model, settings)
          .draw(*sample_prompts_, settings.cfg > 1 ? &empty : nullptr,
                sample_condition_ ? &*sample_condition_ : nullptr);
  const std::string folder = checkpoints_.dir() + "/samples";
  const std::string path = folder + strprintf("/step-%08d.h5", step + 1);
  std::string wrote;
  rt_.agree_on([&] {
    if (!rt_.is_root()) return;
    std::error_code ec;
    std::filesystem::create_directories(folder, ec);
    if (ec) throw UsageError("cannot create '" + folder + "' for flow.sample_every: " + ec.message());
    wrote = write_sampled_images(path, latents, sample_prompts_->count, cfg_.model, settings,
                                 strprintf("step %d of run %s", step + 1, cfg_.train.run_name.c_str()), false);
    if (cfg_.model.pixel_patch > 0 && tensorboard_->enabled()) {  // TensorBoard's Images tab: the same grid
      const RgbImage grid = sampled_grid(sampled_images(latents, sample_prompts_->count, cfg_.model, settings));
      tensorboard_->image("samples", step + 1, grid.height, grid.width, png_bytes(grid));
    }
  });
  rt_.info("sample %5d/%d | %s in %.2f s: %s%s", step + 1, steps_, counted(sample_prompts_->count, "image").c_str(),
           now_seconds() - t0, wrote.c_str(),
           cfg_.model.pixel_patch ? "" : " (tools/encode_images.py decode turns them into PNG files)");
}

int Trainer::run() {
  print_summary();
  checkpoints_.check_dir();  // a file where the run folder should be: exit 2 on every rank, before any use
  if (cfg_.flow.sample_every > 0) load_sample_inputs();
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


int run_training(const Runtime& rt, const Config& config) {
  Trainer trainer(rt, config);
  return trainer.run();
}

}  // namespace shardtrain
