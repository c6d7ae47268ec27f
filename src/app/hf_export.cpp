// See hf_export.hpp.
#include "app/hf_export.hpp"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>

#include "ckpt/checkpoint_io.hpp"
#include "ckpt/checkpoint_manager.hpp"
#include "ckpt/hf_model.hpp"
#include "ckpt/peft.hpp"
#include "core/counted.hpp"
#include "core/format.hpp"

namespace shardtrain {
namespace {

// Writes `text` to `path` through a temporary name, synced before the rename.
void write_file_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  std::string error = CheckpointManager::write_file_synced(tmp, text);
  if (error.empty() && std::rename(tmp.c_str(), path.c_str()) != 0)
    error = "cannot write '" + path + "': " + std::strerror(errno);
  if (!error.empty()) {
    std::remove(tmp.c_str());
    throw CheckpointError(error);
  }
}

// A base weight's values, with its adapter folded in where it has one: W + s B A (PEFT's merge).
std::vector<float> merged_weight(const CheckpointReader& reader, const ParamTable& adapted, const ParamInfo& p) {
  std::vector<float> w = reader.read(p, adapted.units()[p.unit].name, CheckpointReader::TENSOR_PARAMS);
  if (adapted.adapter().type == ADAPTER_NONE || p.unit == ROOT_UNIT) return w;
  const int layer = p.unit - block_unit(0);
  const std::vector<LinearSite> sites = linear_sites(adapted.config());
  for (size_t k = 0; k < sites.size(); k++) {
    const int a = adapted.adapter_param(layer, static_cast<int>(k));
    if (a < 0 || adapted.param(p.unit, sites[k].weight).id != p.id) continue;
    auto read = [&](int q) { return reader.read(adapted.param(p.unit, q), adapted.units()[p.unit].name,
                                                CheckpointReader::TENSOR_PARAMS); };
    const std::vector<float> A = read(a), B = read(a + 1);
    const int r = adapted.adapter().rank, in = sites[k].in, out = sites[k].out;
    const double s = adapted.adapter().scaling();
    const bool dora = adapted.adapter().type == ADAPTER_DORA;
    const std::vector<float> magnitude = dora ? read(a + 2) : std::vector<float>();
    std::vector<double> row(in);
    for (int o = 0; o < out; o++) {
      double norm = 0;
      for (int j = 0; j < in; j++) {
        double delta = 0;
        for (int m = 0; m < r; m++) delta += static_cast<double>(B[o * r + m]) * A[m * in + j];
        row[j] = w[static_cast<size_t>(o) * in + j] + s * delta;
        norm += row[j] * row[j];
      }
      // DoRA: the row rescaled to its magnitude, m / ||W + s B A||.
      const double gain = dora ? magnitude[o] / std::sqrt(norm) : 1.0;
      for (int j = 0; j < in; j++) w[static_cast<size_t>(o) * in + j] = static_cast<float>(gain * row[j]);
    }
  }
  return w;
}

}  // namespace

void export_hf_folder(const Runtime& rt, const std::string& checkpoint, const std::string& out_dir, DType dtype,
                      uint64_t max_file_bytes, bool merge) {
  std::unique_ptr<CheckpointReader> reader;
  rt.agree_on([&] { reader = std::make_unique<CheckpointReader>(checkpoint); });
  if (rt.is_root() && !reader->state().warning.empty()) std::fprintf(stderr, "warning: %s\n", reader->state().warning.c_str());
  const ModelConfig& model = reader->state().model;
  const AdapterConfig& adapter = reader->state().adapter;
  if (reader->state().adapters_only)
    throw UsageError("checkpoint '" + checkpoint + "' holds adapters alone (checkpoint.adapters_only), without their "
                     "base model: export them with --adapter (a PEFT folder, for PEFT to load or merge onto the "
                     "base), or resume it with checkpoint.adapters_only=false to write a full checkpoint");
  if (adapter.type != ADAPTER_NONE && !merge)
    throw UsageError("checkpoint '" + checkpoint + "' holds " + adapter_type_name(adapter.type) +
                     " adapters on its base model: export them with --adapter (a PEFT folder), or fold them into "
                     "the weights with --merge");
  if (adapter.type == ADAPTER_NONE && merge)
    throw UsageError("--merge folds adapters into the weights, but checkpoint '" + checkpoint + "' has none");
  const ParamTable table(model), adapted(model, {}, adapter);
  const HfExportPlan plan = hf_export_plan(table, dtype, max_file_bytes);
  auto path_of = [&](const HfExportFile& f) { return out_dir + "/" + f.name; };
  auto remove_temporaries = [&] {
    if (rt.is_root())
      for (const HfExportFile& f : plan.files) std::remove((path_of(f) + ".tmp").c_str());
  };
  rt.agree_on([&] {
    if (!rt.is_root()) return;
    std::error_code error;
    std::filesystem::create_directories(out_dir, error);
    if (error) throw UsageError("export --output '" + out_dir + "': cannot create the folder: " + error.message());
    for (const HfExportFile& f : plan.files) create_safetensors_file(path_of(f) + ".tmp", f.layout);
  });
  try {
    rt.agree_on([&] {
      std::vector<std::unique_ptr<SafetensorsWriter>> writers;
      for (const HfExportFile& f : plan.files)
        writers.push_back(std::make_unique<SafetensorsWriter>(path_of(f) + ".tmp", f.layout));
      for (const ParamInfo& p : table.params()) {
        if (p.id % rt.world() != rt.rank()) continue;
        const std::vector<float> values = to_hf_order(model.arch, p, merged_weight(*reader, adapted, p));
        const auto [file, entry] = plan.where[p.id];
        writers[file]->write_fp32(entry, 0, values.size(), values.data());
      }
      for (auto& w : writers) w->finish();
    });
    rt.agree_on([&] {
      if (!rt.is_root()) return;
      // The weights first, then the index and config.json that point at them.
      for (const HfExportFile& f : plan.files)
        if (std::rename((path_of(f) + ".tmp").c_str(), path_of(f).c_str()) != 0)
          throw CheckpointError("cannot write '" + path_of(f) + "': " + std::strerror(errno));
      if (plan.files.size() > 1) write_file_atomically(out_dir + "/model.safetensors.index.json", plan.index_json());
      write_file_atomically(out_dir + "/config.json", hf_config_json(model, dtype));
      const std::string synced = CheckpointManager::fsync_path(out_dir);
      if (!synced.empty()) throw CheckpointError(synced);
    });
  } catch (const InputError&) {
    remove_temporaries();
    throw;
  }
  rt.info("wrote %s: Hugging Face %s (config.json, %s, %s in %s, %s) from step %lld, written by %s",
          out_dir.c_str(), hf_architecture(model.arch),
          plan.files.size() == 1 ? "model.safetensors" : "model.safetensors.index.json",
          counted(static_cast<long long>(table.params().size()), "tensor").c_str(),
          counted(static_cast<long long>(plan.files.size()), "file").c_str(),
          human_bytes(static_cast<double>(plan.tensor_bytes)).c_str(), static_cast<long long>(reader->state().step),
          counted(rt.world(), "rank").c_str());
}

void export_peft_folder(const Runtime& rt, const std::string& checkpoint, const std::string& out_dir, DType dtype) {
  std::unique_ptr<CheckpointReader> reader;
  rt.agree_on([&] { reader = std::make_unique<CheckpointReader>(checkpoint); });
  const CheckpointState& state = reader->state();
  if (state.adapter.type == ADAPTER_NONE)
    throw UsageError("export --adapter: checkpoint '" + checkpoint +
                     "' has no adapters (adapter.type=none); export the model with --format hf");
  const ParamTable table(state.model, {}, state.adapter);
  const std::vector<PeftTensor> tensors = peft_tensors(table);
  std::vector<SafetensorsEntry> entries;
  for (const PeftTensor& t : tensors) {
    const ParamInfo& p = table.params()[t.id];
    entries.push_back({t.name, dtype, std::vector<int64_t>(p.shape.begin(), p.shape.end())});
  }
  const SafetensorsLayout layout(entries, {{"format", "pt"}});
  const std::string weights = out_dir + "/adapter_model.safetensors";
  rt.agree_on([&] {  // small: rank 0 writes it all
    if (!rt.is_root()) return;
    try {
      std::error_code error;
      std::filesystem::create_directories(out_dir, error);
      if (error) throw UsageError("export --output '" + out_dir + "': cannot create the folder: " + error.message());
      create_safetensors_file(weights + ".tmp", layout);
      SafetensorsWriter writer(weights + ".tmp", layout);
      for (size_t i = 0; i < tensors.size(); i++) {
        const ParamInfo& p = table.params()[tensors[i].id];
        const std::vector<float> values = reader->read(p, table.units()[p.unit].name, CheckpointReader::TENSOR_PARAMS);
        writer.write_fp32(i, 0, values.size(), values.data());
      }
      writer.finish();
      if (std::rename((weights + ".tmp").c_str(), weights.c_str()) != 0)
        throw CheckpointError("cannot write '" + weights + "': " + std::strerror(errno));
      write_file_atomically(out_dir + "/adapter_config.json", peft_adapter_config_json(table));
      const std::string synced = CheckpointManager::fsync_path(out_dir);
      if (!synced.empty()) throw CheckpointError(synced);
    } catch (const InputError&) {
      std::remove((weights + ".tmp").c_str());
      throw;
    }
  });
  rt.info("wrote %s: PEFT %s adapter (adapter_config.json, adapter_model.safetensors: %s) from step %lld",
          out_dir.c_str(), adapter_type_name(state.adapter.type),
          counted(static_cast<long long>(tensors.size()), "tensor").c_str(), static_cast<long long>(state.step));
}

}  // namespace shardtrain
