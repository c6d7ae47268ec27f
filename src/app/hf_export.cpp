// See hf_export.hpp.
#include "app/hf_export.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>

#include "app/memory_plan.hpp"
#include "ckpt/checkpoint_io.hpp"
#include "ckpt/hf_model.hpp"
#include "core/counted.hpp"

namespace shardtrain {
namespace {

// Writes `text` to `path` through a temporary name, synced before the rename.
void write_file_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  bool ok = fd >= 0 && ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()) && ::fsync(fd) == 0;
  const int saved = errno;
  if (fd >= 0) ok = ::close(fd) == 0 && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw CheckpointError("cannot write '" + path + "': " + std::strerror(ok ? errno : saved));
  }
}

void sync_folder(const std::string& folder) {
  const int fd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) ::fsync(fd), ::close(fd);
}

}  // namespace

void export_hf_folder(const Runtime& rt, const std::string& checkpoint, const std::string& out_dir, DType dtype) {
  std::unique_ptr<CheckpointReader> reader;
  rt.agree_on([&] { reader = std::make_unique<CheckpointReader>(checkpoint); });
  if (rt.is_root() && !reader->state().warning.empty()) std::fprintf(stderr, "warning: %s\n", reader->state().warning.c_str());
  const ModelConfig& model = reader->state().model;
  const ParamTable table(model);
  const SafetensorsLayout layout = hf_export_layout(table, dtype);
  const std::string file = out_dir + "/model.safetensors", tmp = file + ".tmp";
  rt.agree_on([&] {
    if (!rt.is_root()) return;
    std::error_code error;
    std::filesystem::create_directories(out_dir, error);
    if (error) throw UsageError("export --output '" + out_dir + "': cannot create the folder: " + error.message());
    create_safetensors_file(tmp, layout);
  });
  try {
    rt.agree_on([&] {
      SafetensorsWriter writer(tmp, layout);
      for (const ParamInfo& p : table.params()) {
        if (p.id % rt.world() != rt.rank()) continue;
        const std::vector<float> values =
            to_hf_order(p, reader->read(p, table.units()[p.unit].name, CheckpointReader::TENSOR_PARAMS));
        writer.write_fp32(static_cast<size_t>(p.id), 0, values.size(), values.data());
      }
      writer.finish();
    });
    rt.agree_on([&] {
      if (!rt.is_root()) return;
      if (std::rename(tmp.c_str(), file.c_str()) != 0)
        throw CheckpointError("cannot write '" + file + "': " + std::strerror(errno));
      write_file_atomically(out_dir + "/config.json", hf_config_json(model, dtype));
      sync_folder(out_dir);
    });
  } catch (const InputError&) {
    if (rt.is_root()) std::remove(tmp.c_str());
    throw;
  }
  rt.info("wrote %s: Hugging Face GPT-2 (config.json, model.safetensors %s, %zu tensors, %s) from step %lld, "
          "written by %s", out_dir.c_str(), dtype_name(dtype), table.params().size(),
          format_bytes(static_cast<double>(layout.file_bytes())).c_str(),
          static_cast<long long>(reader->state().step), counted(rt.world(), "rank").c_str());
}

}  // namespace shardtrain
