// See hf_export.hpp.
#include "app/hf_export.hpp"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>

#include "ckpt/checkpoint_io.hpp"
#include "ckpt/checkpoint_manager.hpp"
#include "ckpt/hf_model.hpp"
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

}  // namespace

void export_hf_folder(const Runtime& rt, const std::string& checkpoint, const std::string& out_dir, DType dtype,
                      uint64_t max_file_bytes) {
  std::unique_ptr<CheckpointReader> reader;
  rt.agree_on([&] { reader = std::make_unique<CheckpointReader>(checkpoint); });
  if (rt.is_root() && !reader->state().warning.empty()) std::fprintf(stderr, "warning: %s\n", reader->state().warning.c_str());
  const ModelConfig& model = reader->state().model;
  const ParamTable table(model);
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
        const std::vector<float> values =
            to_hf_order(model.arch, p, reader->read(p, table.units()[p.unit].name, CheckpointReader::TENSOR_PARAMS));
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

}  // namespace shardtrain
