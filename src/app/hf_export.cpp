// See hf_export.hpp.
#include "app/hf_export.hpp"

#include <fcntl.h>

#include <cerrno>
#include <csignal>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>

#include <nlohmann/json.hpp>

#include "app/options.hpp"
#include "ckpt/bnb_tensor.hpp"
#include "ckpt/checkpoint_io.hpp"
#include "ckpt/checkpoint_manager.hpp"
#include "ckpt/hf_model.hpp"
#include "ckpt/peft.hpp"
#include "core/counted.hpp"
#include "core/format.hpp"
#include "data/data_commands.hpp"
#include "data/tokenizer.hpp"
#include "model/oft.hpp"

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

// A re-export keeps what else the folder holds (a tokenizer, a README, ...): every entry of `old`
// that is not the model's own -- config.json and <weights>*.safetensors* (weights, shards, index;
// `weights` the family's base name) -- is hard-linked (or copied) into the new folder before the swap.
void carry_other_files(const std::string& old, const std::string& fresh, const std::string& weights) {
  namespace fs = std::filesystem;
  std::error_code error;
  if (!fs::is_directory(old, error)) return;
  for (const fs::directory_entry& e : fs::directory_iterator(old, error)) {
    const std::string name = e.path().filename().string();
    if (name == "config.json" || (name.rfind(weights, 0) == 0 && name.find(".safetensors") != std::string::npos))
      continue;
    fs::copy(e.path(), fresh + "/" + name, fs::copy_options::recursive | fs::copy_options::create_hard_links, error);
    if (error)  // another file system, say: a copy
      fs::copy(e.path(), fresh + "/" + name, fs::copy_options::recursive | fs::copy_options::overwrite_existing, error);
    if (error) throw CheckpointError("cannot keep '" + e.path().string() + "' in the new folder: " + error.message());
  }
}

// Puts the complete folder `staging` at `target`: a rename where there is none, else an atomic
// exchange (renameat2 RENAME_EXCHANGE) and the removal of the old one, now at `staging`. The test
// hook SHARDTRAIN_TEST_KILL_AT_COMMIT=before|after kills the process at either side of it.
void commit_folder(const std::string& staging, const std::string& target) {
  namespace fs = std::filesystem;
  const char* kill_at = std::getenv("SHARDTRAIN_TEST_KILL_AT_COMMIT");
  auto maybe_kill = [&](const char* when) {
    if (kill_at && std::strcmp(kill_at, when) == 0) std::raise(SIGKILL);
  };
  maybe_kill("before");
  std::error_code error;
  if (!fs::exists(target, error)) {
    if (std::rename(staging.c_str(), target.c_str()) != 0)
      throw CheckpointError("cannot write '" + target + "': " + std::strerror(errno));
  } else if (renameat2(AT_FDCWD, staging.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) != 0) {
    throw CheckpointError("cannot replace '" + target + "' (an atomic exchange of folders, renameat2): " +
                          std::strerror(errno));
  }
  maybe_kill("after");
  fs::remove_all(staging, error);  // the old folder, after an exchange
}

// W (out, in) with a LoHa, LoKr or OFT adapter folded in (PEFT's merge), in double: W + dW with
//   LoHa  dW = s (w1_a w1_b) (.) (w2_a w2_b)
//   LoKr  dW = s kron(w1, w2), each factor maybe a rank-r product (lokr_shape)
//   OFT   W' = W blockdiag(R_1, ..., R_nb)^T (model/oft.hpp's rotations; one R with block_share).
// param(i): the site's i-th adapter parameter, in the table's order.
template <typename Read>
void merge_weight_delta(const AdapterConfig& a, const LinearSite& site, std::vector<float>& w, Read param) {
  const int in = site.in, out = site.out, r = a.rank;
  const double s = a.scaling();
  // (m, n) = x (m, k) y (k, n), in double.
  auto product = [](const std::vector<float>& x, const std::vector<float>& y, int m, int k, int n) {
    std::vector<double> p(static_cast<size_t>(m) * n, 0.0);
    for (int i = 0; i < m; i++)
      for (int q = 0; q < k; q++) {
        const double xi = x[static_cast<size_t>(i) * k + q];
        for (int j = 0; j < n; j++) p[static_cast<size_t>(i) * n + j] += xi * y[static_cast<size_t>(q) * n + j];
      }
    return p;
  };
  auto as_double = [](const std::vector<float>& x) { return std::vector<double>(x.begin(), x.end()); };
  switch (a.type) {
    case ADAPTER_LOHA: {
      const std::vector<double> p1 = product(param(0), param(1), out, r, in), p2 = product(param(2), param(3), out, r, in);
      for (size_t e = 0; e < w.size(); e++) w[e] = static_cast<float>(w[e] + s * p1[e] * p2[e]);
      return;
    }
    case ADAPTER_LOKR: {
      const LokrShape k = lokr_shape(a, in, out);
      int next = 0;
      std::vector<double> w1, w2;
      if (k.w1_low_rank) {
        w1 = product(param(next), param(next + 1), k.a, r, k.c);
        next += 2;
      } else {
        w1 = as_double(param(next++));
      }
      w2 = k.w2_low_rank ? product(param(next), param(next + 1), k.b, r, k.d) : as_double(param(next));
      // kron(w1, w2)[i b + p, j d + q] = w1[i, j] w2[p, q]
      for (int i = 0; i < k.a; i++)
        for (int j = 0; j < k.c; j++) {
          const double x = s * w1[static_cast<size_t>(i) * k.c + j];
          for (int p = 0; p < k.b; p++)
            for (int q = 0; q < k.d; q++) {
              float& e = w[static_cast<size_t>(i * k.b + p) * in + j * k.d + q];
              e = static_cast<float>(e + x * w2[static_cast<size_t>(p) * k.d + q]);
            }
        }
      return;
    }
    case ADAPTER_OFT: {
      const int b = a.block_size, per_block = b * (b - 1) / 2;
      const std::vector<float> v = param(0);
      const OftRotation rotation{b, a.cayley_neumann, a.neumann_terms};
      std::vector<double> R(static_cast<size_t>(b) * b), row(b);
      for (int j = 0; j < in / b; j++) {
        const std::vector<double> params(v.begin() + (a.block_share ? 0 : j) * per_block,
                                         v.begin() + ((a.block_share ? 0 : j) + 1) * per_block);
        rotation.forward(params.data(), R.data());
        for (int o = 0; o < out; o++) {  // W'[o, j b + p] = sum_q W[o, j b + q] R[p, q]
          float* wo = w.data() + static_cast<size_t>(o) * in + j * b;
          for (int p = 0; p < b; p++) {
            double sum = 0;
            for (int q = 0; q < b; q++) sum += static_cast<double>(wo[q]) * R[static_cast<size_t>(p) * b + q];
            row[p] = sum;
          }
          for (int p = 0; p < b; p++) wo[p] = static_cast<float>(row[p]);
        }
      }
      return;
    }
    default: SHARD_CHECK(false, "merge_weight_delta for adapter.type=%s", adapter_type_name(a.type));
  }
}

// A base weight's values, with its adapter folded in where it has one, as PEFT's merge does:
// LoRA W + s B A, DoRA the same rescaled per row to m / ||W + s B A||, LoHa/LoKr/OFT above.
std::vector<float> merged_weight(const CheckpointReader& reader, const ParamTable& adapted, const ParamInfo& p) {
  std::vector<float> w = reader.read(p, adapted.units()[p.unit].name, CheckpointReader::TENSOR_PARAMS);
  if (adapted.adapter().type == ADAPTER_NONE || p.unit == ROOT_UNIT) return w;
  const int layer = p.unit - block_unit(0);
  const std::vector<LinearSite>& sites = adapted.block_sites(layer);
  for (size_t k = 0; k < sites.size(); k++) {
    const int a = adapted.adapter_param(layer, static_cast<int>(k));
    if (a < 0 || adapted.param(p.unit, sites[k].weight).id != p.id) continue;
    auto read = [&](int q) { return reader.read(adapted.param(p.unit, q), adapted.units()[p.unit].name,
                                                CheckpointReader::TENSOR_PARAMS); };
    if (adapted.adapter().weight_delta()) {
      merge_weight_delta(adapted.adapter(), sites[k], w, [&](int i) { return read(a + i); });
      continue;
    }
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

// A whole parameter written as its pieces of rows of the stored tensor: {first stored row, rows}.
void write_row_pieces(SafetensorsWriter& writer, size_t entry, const std::vector<std::pair<int64_t, int64_t>>& pieces,
                      size_t cols, const float* values) {
  for (const auto& [stored_row, rows] : pieces) {
    writer.write_fp32(entry, stored_row * cols, rows * cols, values);
    values += rows * cols;
  }
}

// A bitsandbytes 4-bit weight's tensors into its entries (HfExportPlan::quantized's order);
// `dtype` the export's, which its quant_state names.
void write_bnb_weight(SafetensorsWriter& writer, const std::vector<size_t>& entries, const Bnb4bitWeight& w,
                      DType dtype) {
  size_t k = 0;
  writer.write_bytes(entries[k++], 0, w.packed.size(), w.packed.data());
  float map[16];
  for (int c = 0; c < 16; c++) map[c] = quant4_code_value(w.type, c);
  if (w.double_quant()) {
    writer.write_bytes(entries[k++], 0, w.absmax_codes.size(), w.absmax_codes.data());
    writer.write_fp32(entries[k++], 0, 16, map);
    writer.write_fp32(entries[k++], 0, w.nested_absmax.size(), w.nested_absmax.data());
    writer.write_fp32(entries[k++], 0, 256, quant_dynamic_map());
  } else {
    writer.write_fp32(entries[k++], 0, w.absmax.size(), w.absmax.data());
    writer.write_fp32(entries[k++], 0, 16, map);
  }
  const std::string state = w.quant_state(torch_dtype_name(dtype));
  writer.write_bytes(entries[k], 0, state.size(), state.data());
}

}  // namespace

void export_hf_folder(const Runtime& rt, const std::string& checkpoint, const std::string& out_dir, DType dtype,
                      uint64_t max_file_bytes, bool merge, const HfQuantizedExport& quant) {
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
  if (quant.type != QUANT_NONE && !family_of(model).hf_bnb_4bit())
    throw UsageError(std::string("--quantize writes bitsandbytes 4-bit folders of transformers' nn.Linear models, "
                                 "and checkpoint '") + checkpoint + "' holds a " + family_of(model).name() +
                     " model, whose Hugging Face linear weights are not all nn.Linear: export it unquantized and "
                     "train on it with fsdp.frozen_dtype=" + quant_type_name(quant.type));
  const ParamTable table(model), adapted(model, {}, adapter);
  const HfExportPlan plan = hf_export_plan(table, dtype, max_file_bytes, quant);
  // The ranks share the parameters round-robin, each read whole from the checkpoint.
  write_hf_folder(rt, model, out_dir, dtype, plan, [&](std::vector<std::unique_ptr<SafetensorsWriter>>& writers) {
    for (const ParamInfo& p : table.params()) {
      if (p.id % rt.world() != rt.rank()) continue;
      const std::vector<float> values = to_hf_order(model, p, merged_weight(*reader, adapted, p));
      const auto [file, entry] = plan.where[p.id];
      // A double-quantized checkpoint's weight, unmerged, in its format: coded under its own tables,
      // so the folder holds the checkpoint's values.
      const CheckpointContent& held = reader->content();
      const bool as_held = quant.double_quant && held.nested && held.quant == quant.type && held.block == quant.block &&
                           !merge && !hf_tensor_of(model, p).transposed;
      if (!plan.quantized[p.id].empty())
        write_bnb_weight(*writers[file], plan.quantized[p.id],
                         Bnb4bitWeight(values.data(), hf_tensor_of(model, p).shape, quant.type, quant.block,
                                       quant.double_quant, as_held ? reader->nested_table(p) : std::vector<float>{}),
                         dtype);
      else if (plan.rows[p.id].empty())
        writers[file]->write_fp32(entry, 0, values.size(), values.data());
      else  // our rows, in pieces, of a tensor that others' rows share (Phi-3's qkv_proj)
        write_row_pieces(*writers[file], entry, plan.rows[p.id], p.numel / p.shape[0], values.data());
    }
  }, recorded_tokenizer(reader->state()));
  rt.info("wrote %s: Hugging Face %s (config.json, %s, %s in %s, %s) from step %lld, written by %s",
          out_dir.c_str(), family_of(model).hf_class_of(model),
          plan.entry_name().c_str(),
          counted(static_cast<long long>(plan.tensor_count()), "tensor").c_str(),
          counted(static_cast<long long>(plan.files.size()), "file").c_str(),
          human_bytes(static_cast<double>(plan.tensor_bytes)).c_str(), static_cast<long long>(reader->state().step),
          counted(rt.world(), "rank").c_str());
}

std::string recorded_tokenizer(const CheckpointState& state) {
  const auto run = ini_option_values(state.config_ini);
  const auto it = run.find("data.tokenizer");
  return it == run.end() ? "" : it->second;
}

namespace {

// Rank 0, inside the staging folder: the tokenizer's files beside the model (write_hf_folder).
// Returns its special ids for config.json; nullopt when the recorded file is gone (warned).
std::optional<HfSpecialIds> write_tokenizer_files(const std::string& tokenizer, const std::string& staging,
                                                  const ModelConfig& model) {
  namespace fs = std::filesystem;
  std::error_code error;
  if (!fs::is_regular_file(tokenizer, error)) {
    std::fprintf(stderr, "warning: the run's tokenizer '%s' (data.tokenizer) is gone: the folder has no tokenizer; "
                 "copy its tokenizer.json there yourself\n", tokenizer.c_str());
    return std::nullopt;
  }
  const Tokenizer loaded(tokenizer);
  HfSpecialIds ids;
  ids.eos = end_of_text_ids(loaded);
  ids.bos = begin_of_text_id(loaded);
  // A carried-over file may be a hard link into the previous folder: replace, never write through.
  auto place = [&](const fs::path& from, const std::string& name) {
    const std::string to = staging + "/" + name;
    fs::remove(to, error);
    fs::copy_file(from, to, error);
    if (error) throw CheckpointError("cannot copy '" + from.string() + "' into the folder: " + error.message());
  };
  auto write = [&](const std::string& name, const std::string& text) {
    fs::remove(staging + "/" + name, error);
    const std::string failed = CheckpointManager::write_file_synced(staging + "/" + name, text);
    if (!failed.empty()) throw CheckpointError(failed);
  };
  place(tokenizer, "tokenizer.json");
  const fs::path beside = fs::path(tokenizer).parent_path();
  // The folder's chat template comes along (tokenizer_config.json's, or newer transformers' own file).
  for (const char* name : {"tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"})
    if (fs::is_regular_file(beside / name, error)) place(beside / name, name);
  // A special token's text: its content (the tokenizer may have no decoder), found by its name.
  auto text_of = [&](uint32_t id) -> std::optional<std::string> {
    for (const char* name : known_special_tokens())
      if (loaded.is_special(name) && loaded.token_id(name) == id) return name;
    return std::nullopt;
  };
  if (!fs::is_regular_file(beside / "tokenizer_config.json", error)) {
    nlohmann::ordered_json config;
    config["tokenizer_class"] = "PreTrainedTokenizerFast";
    if (const auto bos = ids.bos ? text_of(*ids.bos) : std::nullopt) config["bos_token"] = *bos;
    if (const auto eos = ids.eos.empty() ? std::nullopt : text_of(ids.eos.front())) config["eos_token"] = *eos;
    config["model_max_length"] = model.max_seq_len;
    config["clean_up_tokenization_spaces"] = false;
    write("tokenizer_config.json", config.dump(2) + "\n");
  }
  if (!ids.eos.empty()) {
    nlohmann::ordered_json generation;
    generation["bos_token_id"] = ids.bos ? *ids.bos : ids.eos.front();
    if (ids.eos.size() == 1)
      generation["eos_token_id"] = ids.eos.front();
    else
      generation["eos_token_id"] = ids.eos;
    write("generation_config.json", generation.dump(2) + "\n");
  }
  return ids;
}

}  // namespace

void write_hf_folder(const Runtime& rt, const ModelConfig& model, const std::string& out_dir, DType dtype,
                     const HfExportPlan& plan, const std::function<void(SafetensorsWriters&)>& write_tensors,
                     const std::string& tokenizer) {
  namespace fs = std::filesystem;
  // The folder is written whole beside its place (<out>.partial) and committed by one rename, or,
  // over an existing folder, one atomic exchange: a reader -- or a kill at any moment -- sees the old
  // model or the new one, never a mix of both.
  const fs::path out = fs::absolute(out_dir).lexically_normal();
  const fs::path target = out.has_filename() ? out : out.parent_path();  // "dir/" names dir
  const std::string staging = target.string() + ".partial";
  auto path_of = [&](const HfExportFile& f) { return staging + "/" + f.name; };
  auto remove_staging = [&] {
    std::error_code ignored;
    if (rt.is_root()) fs::remove_all(staging, ignored);
  };
  rt.agree_on([&] {
    if (!rt.is_root()) return;
    std::error_code error;
    if (fs::exists(target, error) && !fs::is_directory(target, error))
      throw UsageError("--output '" + out_dir + "' is a file; a Hugging Face model is a folder: name the folder to write");
  });
  try {  // whatever fails from here on (a full disk in the first file or the last) leaves no staging folder
    rt.agree_on([&] {
      if (!rt.is_root()) return;
      std::error_code error;
      fs::remove_all(staging, error);  // what an export killed before its commit left
      fs::create_directories(staging, error);
      if (error) throw UsageError("--output '" + out_dir + "': cannot create '" + staging + "': " + error.message());
      for (const HfExportFile& f : plan.files) create_safetensors_file(path_of(f), f.layout);
    });
    rt.agree_on([&] {
      SafetensorsWriters writers;
      for (const HfExportFile& f : plan.files) writers.push_back(std::make_unique<SafetensorsWriter>(path_of(f), f.layout));
      write_tensors(writers);
      for (auto& w : writers) w->finish();
    });
    rt.agree_on([&] {
      if (!rt.is_root()) return;
      // Inside the folder that is committed whole, each file is written in place (and synced).
      auto write = [&](const char* name, const std::string& text) {
        const std::string error = CheckpointManager::write_file_synced(staging + "/" + name, text);
        if (!error.empty()) throw CheckpointError(error);
      };
      if (plan.files.size() > 1) write(plan.index_name.c_str(), plan.index_json());
      carry_other_files(target.string(), staging, family_of(model).hf_weights());
      const std::optional<HfSpecialIds> ids =
          tokenizer.empty() ? std::nullopt : write_tokenizer_files(tokenizer, staging, model);
      std::string config = hf_config_json(model, dtype, ids ? &*ids : nullptr);
      if (!plan.quantization_config.empty()) {
        nlohmann::ordered_json j = nlohmann::ordered_json::parse(config);
        j["quantization_config"] = nlohmann::ordered_json::parse(plan.quantization_config);
        config = j.dump(2) + "\n";
      }
      write("config.json", config);
      std::string synced = CheckpointManager::fsync_path(staging);
      if (!synced.empty()) throw CheckpointError(synced);
      commit_folder(staging, target.string());
      synced = CheckpointManager::fsync_path(target.parent_path().string());
      if (!synced.empty()) throw CheckpointError(synced);
    });
  } catch (const InputError&) {
    remove_staging();
    throw;
  }
}

void write_model_file(const Runtime& rt, const std::string& path, const HfExportPlan& plan,
                      const std::function<void(SafetensorsWriters&)>& write_tensors) {
  namespace fs = std::filesystem;
  // As a folder's: written whole beside its place (<path>.partial), then committed by one rename.
  const std::string partial = path + ".partial";
  const SafetensorsLayout& layout = plan.files.at(0).layout;
  try {
    rt.agree_on([&] {
      if (!rt.is_root()) return;
      std::error_code ignored;
      fs::remove(partial, ignored);  // what a write killed before its commit left
      create_safetensors_file(partial, layout);
    });
    rt.agree_on([&] {
      SafetensorsWriters writers;
      writers.push_back(std::make_unique<SafetensorsWriter>(partial, layout));
      write_tensors(writers);
      writers.back()->finish();
    });
    rt.agree_on([&] {
      if (!rt.is_root()) return;
      std::string synced = CheckpointManager::fsync_path(partial);
      if (!synced.empty()) throw CheckpointError(synced);
      std::error_code error;
      fs::rename(partial, path, error);
      if (error) throw CheckpointError("--output '" + path + "': cannot rename '" + partial + "' into place: " + error.message());
      synced = CheckpointManager::fsync_path(fs::absolute(path).parent_path().string());
      if (!synced.empty()) throw CheckpointError(synced);
    });
  } catch (const InputError&) {
    std::error_code ignored;
    if (rt.is_root()) fs::remove(partial, ignored);
    throw;
  }
}

namespace {

// diffusers' lora_adapter_metadata: the LoraConfig's keys under the component's prefix, as
// diffusers' save_lora_weights writes them (load_lora_weights builds its LoraConfig from them).
std::string diffusers_lora_metadata(const ParamTable& table) {
  const AdapterConfig& a = table.adapter();
  nlohmann::ordered_json j;
  j["transformer.bias"] = "none";
  j["transformer.lora_alpha"] = a.alpha;
  j["transformer.lora_dropout"] = a.dropout;
  j["transformer.peft_type"] = "LORA";
  j["transformer.r"] = a.rank;
  j["transformer.target_modules"] = a.targets;
  j["transformer.use_dora"] = false;
  return j.dump(2);
}

}  // namespace

void export_peft_folder(const Runtime& rt, const std::string& checkpoint, const std::string& out_dir, DType dtype) {
  std::unique_ptr<CheckpointReader> reader;
  rt.agree_on([&] { reader = std::make_unique<CheckpointReader>(checkpoint); });
  const CheckpointState& state = reader->state();
  if (state.adapter.type == ADAPTER_NONE)
    throw UsageError("export --adapter: checkpoint '" + checkpoint +
                     "' has no adapters (adapter.type=none); export the model with --format hf");
  const ModelFamily& family = family_of(state.model);
  if (family.hf_conv1d() && state.adapter.weight_delta())
    throw UsageError("export --adapter: checkpoint '" + checkpoint + "' holds " + adapter_type_name(state.adapter.type) +
                     " adapters on a " + state.model.arch + " model, and PEFT 0.21.2 cannot load " +
                     peft_type_name(state.adapter.type) + " on its Conv1D layers (it takes only LoRA and DoRA there); export the merged model with "
                     "--format hf --merge instead");
  const bool peft = family.peft_folder();
  if (!peft && state.adapter.type != ADAPTER_LORA)
    throw UsageError("export --adapter: checkpoint '" + checkpoint + "' holds " + adapter_type_name(state.adapter.type) +
                     " adapters on a " + state.model.arch + " model; diffusers' LoRA file (what this exports for it) "
                     "takes LoRA only: export the merged model with --format hf --merge instead");
  const ParamTable table(state.model, {}, state.adapter);
  const std::vector<PeftTensor> tensors = peft_tensors(table, peft ? "base_model.model." : "transformer.");
  std::vector<SafetensorsEntry> entries;
  for (const PeftTensor& t : tensors) {
    const ParamInfo& p = table.params()[t.id];
    entries.push_back({t.name, dtype, std::vector<int64_t>(p.shape.begin(), p.shape.end())});
  }
  std::map<std::string, std::string> metadata = {{"format", "pt"}};
  if (!peft) metadata["lora_adapter_metadata"] = diffusers_lora_metadata(table);
  const SafetensorsLayout layout(entries, metadata);
  const std::string weights = out_dir + (peft ? "/adapter_model.safetensors" : "/pytorch_lora_weights.safetensors");
  // The base the adapters were trained on, when the run started from a Hugging Face folder.
  const auto run = ini_option_values(state.config_ini);
  const auto init_from = run.find("checkpoint.init_from");
  const std::string base = init_from != run.end() && is_hf_model(init_from->second)
                               ? std::filesystem::absolute(init_from->second).lexically_normal().string()
                               : "";
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
      if (peft) write_file_atomically(out_dir + "/adapter_config.json", peft_adapter_config_json(table, base));
      const std::string synced = CheckpointManager::fsync_path(out_dir);
      if (!synced.empty()) throw CheckpointError(synced);
    } catch (const InputError&) {
      std::remove((weights + ".tmp").c_str());
      throw;
    }
  });
  rt.info("wrote %s: %s %s adapter (%s: %s) from step %lld", out_dir.c_str(), peft ? "PEFT" : "diffusers",
          adapter_type_name(state.adapter.type),
          peft ? "adapter_config.json, adapter_model.safetensors" : "pytorch_lora_weights.safetensors, the LoraConfig in "
                                                                   "its metadata",
          counted(static_cast<long long>(tensors.size()), "tensor").c_str(), static_cast<long long>(state.step));
}

}  // namespace shardtrain
