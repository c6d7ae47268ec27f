// The Trainer's checkpoints (trainer_impl.hpp): the resume policy (checkpoint.resume: latest,
// auto's fallback past unusable files, a path), checkpoint.init_from and adapter.init_from, the
// checks a resumed checkpoint gets (same inputs, the adapters' base), and saving.
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
    if (text_encoder_ && state.text_encoder_checksum && state.text_encoder_checksum != text_encoder_->checksum())
      throw UsageError("checkpoint '" + path + "' was trained with a text encoder of checksum " +
                       checksum_text(state.text_encoder_checksum) + ", text_encoder.source='" +
                       cfg_.text_encoder.source + "' has " + checksum_text(text_encoder_->checksum()) +
                       ": resume with the same text encoder (or start a new run)");
    if (text_encoder_ && !state.text_encoder.empty() &&
        parse_hidden_layers(state.text_encoder_layers, text_encoder_->config().n_layer) != text_encoder_->layers())
      throw UsageError("checkpoint '" + path + "' was trained on the text encoder's hidden states " +
                       state.text_encoder_layers + ", text_encoder.layers=" + cfg_.text_encoder.layers +
                       " asks for others: resume with text_encoder.layers=" + state.text_encoder_layers);
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
  if (text_encoder_) {  // what sample needs to condition the model the same way
    state.text_encoder = cfg_.text_encoder.source, state.text_encoder_layers = cfg_.text_encoder.layers;
    state.text_encoder_tokenizer = text_encoder_->tokenizer().path();
    const QuantConfig quant = text_encoder_quant(cfg_);
    state.text_encoder_dtype = quant_type_name(quant.type);
    state.text_encoder_quant_block = static_cast<int64_t>(quant.block), state.text_encoder_all_linear = quant.all_linear;
    state.text_encoder_checksum = text_encoder_->checksum();
  }
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

}  // namespace shardtrain
