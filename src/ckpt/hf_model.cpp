// See hf_model.hpp.
#include "ckpt/hf_model.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "ckpt/bnb_tensor.hpp"
#include "ckpt/json_file.hpp"
#include "core/error.hpp"
#include "core/format.hpp"
#include "model/family.hpp"
#include "model/hf_config.hpp"

namespace shardtrain {
namespace {

// Elements of a transposed (Conv1D) weight moved through one buffer: the bound of what reading or
// writing one beside the shards holds (16 MiB).
constexpr size_t TRANSPOSE_CHUNK = 1 << 22;

// Calls f(first, count) for consecutive pieces of our flat elements [first, first + count) of a
// matrix of `cols` columns, each of at most TRANSPOSE_CHUNK / cols rows (whole rows but the first
// and last), so a transposed piece fits in a bounded buffer.
template <typename F>
void for_row_pieces(size_t first, size_t count, size_t cols, F f) {
  const size_t rows = std::max<size_t>(1, TRANSPOSE_CHUNK / cols);
  for (size_t at = first, end = first + count; at < end;) {
    const size_t piece_end = std::min(end, (at / cols + rows) * cols);
    f(at, piece_end - at);
    at = piece_end;
  }
}

// A tensor's name in a file, less the base model's prefix (transformers' base_model_prefix, which
// files may leave out: a GPT2Model's or LlamaModel's own save): the key we look parameters up by.
std::string hf_key(const ModelFamily& family, const std::string& name) {
  const std::string prefix = family.hf_prefix();
  return name.rfind(prefix, 0) == 0 ? name.substr(prefix.size()) : name;
}

// The tensors of a folder: key (hf_key) -> the file that holds it.
struct HfFiles {
  std::vector<std::unique_ptr<SafetensorsReader>> readers;
  std::map<std::string, std::pair<const SafetensorsReader*, const SafetensorsTensor*>> tensors;
};

HfFiles open_hf_files(const std::string& folder, const ModelFamily& family) {
  HfFiles files;
  const std::string base = family.hf_weights();
  const std::string single = folder + "/" + base + ".safetensors", index = folder + "/" + base + ".safetensors.index.json";
  std::vector<std::string> names;
  struct stat st {};
  if (::stat(index.c_str(), &st) == 0) {
    const nlohmann::json j = read_json(index, "safetensors index");
    if (!j.contains("weight_map") || !j["weight_map"].is_object())
      throw CheckpointError("safetensors index '" + index + "': no weight_map object");
    std::set<std::string> unique;
    for (const auto& [tensor, file] : j["weight_map"].items()) {
      const std::string name = file.is_string() ? file.get<std::string>() : "";
      if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos)
        throw CheckpointError("safetensors index '" + index + "': tensor '" + printable_text(tensor) +
                              "' names no file of the folder ('" + printable_text(file.dump()) + "')");
      unique.insert(file.get<std::string>());
    }
    names.assign(unique.begin(), unique.end());
  } else if (::stat(single.c_str(), &st) == 0) {
    names.push_back(base + ".safetensors");
  } else {
    throw CheckpointError("Hugging Face folder '" + folder + "': neither " + base + ".safetensors nor " + base +
                          ".safetensors.index.json (only safetensors weights are read; convert .bin files with "
                          "save_pretrained(safe_serialization=True))");
  }
  for (const std::string& name : names) {
    files.readers.push_back(std::make_unique<SafetensorsReader>(folder + "/" + name));
    const SafetensorsReader& r = *files.readers.back();
    for (const SafetensorsTensor& t : r.tensors())
      if (!files.tensors.emplace(hf_key(family, t.name), std::make_pair(&r, &t)).second)
        throw CheckpointError("Hugging Face folder '" + folder + "': tensor '" + printable_text(t.name) + "' appears twice");
  }
  return files;
}

// A model's single file (ModelFamily::reads_single_file): its tensors by name, less a prefix every
// name shares that ComfyUI's copies add.
constexpr const char* SINGLE_FILE_PREFIX = "model.diffusion_model.";

HfFiles open_single_file(const std::string& path) {
  HfFiles files;
  files.readers.push_back(std::make_unique<SafetensorsReader>(path));
  const SafetensorsReader& r = *files.readers.back();
  const std::string prefix = SINGLE_FILE_PREFIX;
  bool prefixed = !r.tensors().empty();
  for (const SafetensorsTensor& t : r.tensors()) prefixed = prefixed && t.name.rfind(prefix, 0) == 0;
  for (const SafetensorsTensor& t : r.tensors())
    if (!files.tensors.emplace(prefixed ? t.name.substr(prefix.size()) : t.name, std::make_pair(&r, &t)).second)
      throw CheckpointError("safetensors file '" + path + "': tensor '" + printable_text(t.name) + "' appears twice");
  return files;
}

TensorShapes shapes_of(const HfFiles& files) {
  TensorShapes shapes;
  for (const auto& [key, where] : files.tensors) shapes[key] = where.second->shape;
  return shapes;
}

// The family whose single-file layout a regular .safetensors file is in, or null.
const ModelFamily* single_file_family(const std::string& path, TensorShapes* shapes = nullptr) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || path.size() < 12 ||
      path.compare(path.size() - 12, 12, ".safetensors") != 0)
    return nullptr;
  const TensorShapes found = shapes_of(open_single_file(path));
  for (const ModelFamily* f : model_families())
    if (f->reads_single_file(found)) {
      if (shapes) *shapes = found;
      return f;
    }
  return nullptr;
}

// The config's checks that options and checkpoint attributes get too; `fail` reports a defect.
template <typename Fail>
void check_model_shape(const ModelConfig& m, const ModelFamily& family, Fail fail) {
  std::string shape = model_shape_defect(m.n_layer, m.n_embd, m.n_head, m.vocab_size, m.max_seq_len,
                                         m.intermediate_size);
  if (shape.empty()) shape = family.config_defect(m);
  if (!shape.empty()) fail(shape + ": not a shape this program holds");
}

}  // namespace

bool is_hf_model(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return false;
  if (S_ISDIR(st.st_mode)) return ::stat((path + "/config.json").c_str(), &st) == 0;
  try {
    return single_file_family(path) != nullptr;
  } catch (const CheckpointError&) {  // not a readable safetensors file: no model (the caller names what it is)
    return false;
  }
}

ModelConfig read_hf_model_config(const std::string& path) {
  TensorShapes shapes;
  if (const ModelFamily* single = single_file_family(path, &shapes)) {
    ModelConfig m = single->read_single_file_config(shapes, path);
    m.arch = single->name();
    check_model_shape(m, *single, [&](const std::string& why) {
      throw CheckpointError("safetensors file '" + path + "': its tensors make " + why);
    });
    return m;
  }
  const std::string& folder = path;
  const HfConfig j(folder);
  const ModelFamily* family = nullptr;
  for (const ModelFamily* f : model_families())
    if (f->reads_hf_folder(j)) family = f;
  if (!family)
    j.fail("model_type '" + j.text("model_type", "") + "' (_class_name '" + j.text("_class_name", "") +
           "') is not implemented; ShardTrain reads the model families " + model_family_names() +
           " (mistral folders as llama, diffusers' FluxTransformer2DModel as flux and Flux2Transformer2DModel as "
           "flux2)");
  ModelConfig m = family->read_hf_config(j);
  m.arch = family->name();
  check_model_shape(m, *family, [&](const std::string& why) { j.fail(why); });
  return m;
}

HfTensor hf_tensor_of(const ModelConfig& config, const ParamInfo& p) { return family_of(config).hf_tensor(config, p); }

static void read_hf_shards(const std::string& path, FsdpEngine& engine) {
  const ParamTable& table = engine.table();
  const ModelFamily& family = family_of(table.config());
  // A folder, or the family's single file: where each parameter lies, by the file's key.
  const bool single = single_file_family(path) != nullptr;
  const HfFiles files = single ? open_single_file(path) : open_hf_files(path, family);
  auto tensor_of = [&](const ParamInfo& p) {
    return single ? family.single_file_tensor(table.config(), p) : family.hf_tensor(table.config(), p);
  };
  const std::string source = std::string(single ? "safetensors file '" : "Hugging Face folder '") + path + "'";
  // Each parameter's tensor in the files, checked before anything is read.
  struct Source {
    const SafetensorsReader* reader;
    const SafetensorsTensor* tensor;
    bool transposed;
    std::shared_ptr<const Bnb4bitTensor> quantized;  // stored quantized by bitsandbytes (ckpt/bnb_tensor.hpp)
    std::vector<std::pair<int64_t, int64_t>> rows;   // HfTensor::rows: pieces of the stored rows
  };
  std::vector<Source> sources;
  std::set<std::string> used;
  const Bnb4bitTensor::Lookup lookup = [&](const std::string& key) {
    auto it = files.tensors.find(key);
    return it == files.tensors.end() ? SafetensorsPart{} : SafetensorsPart{it->second.first, it->second.second};
  };
  for (const ParamInfo& p : table.params()) {
    if (p.adapter) {  // the base model's folder has none: they keep their initial values
      sources.push_back({nullptr, nullptr, false, nullptr, {}});
      continue;
    }
    const HfTensor want = tensor_of(p);
    const std::string key = single ? want.name : hf_key(family, want.name);
    auto it = files.tensors.find(key);
    if (it == files.tensors.end()) throw CheckpointError(source + ": tensor '" + want.name + "' is missing");
    if (Bnb4bitTensor::present(lookup, key)) {
      if (want.transposed || !want.rows.empty())
        throw CheckpointError(source + ": tensor '" + want.name + "' is stored quantized by bitsandbytes, which "
                              "ShardTrain reads for whole (out, in) linear weights only; use the original weights");
      auto quantized = std::make_shared<const Bnb4bitTensor>(lookup, key, want.shape);
      used.insert(quantized->keys().begin(), quantized->keys().end());
      sources.push_back({nullptr, nullptr, false, quantized, {}});
      continue;
    }
    const SafetensorsTensor& t = *it->second.second;
    if (t.shape != want.shape) {
      std::string got, expected;
      for (int64_t d : t.shape) got += (got.empty() ? "" : ", ") + std::to_string(d);
      for (int64_t d : want.shape) expected += (expected.empty() ? "" : ", ") + std::to_string(d);
      throw CheckpointError("safetensors file '" + it->second.first->path() + "': tensor '" + printable_text(t.name) +
                            "' has shape [" + got + "], " + (single ? "the model its other tensors make" : "config.json's model") +
                            " needs [" + expected + "]");
    }
    if (t.dtype != "F32" && t.dtype != "BF16" && t.dtype != "F16")
      throw CheckpointError("safetensors file '" + it->second.first->path() + "': tensor '" + printable_text(t.name) + "' is " +
                            t.dtype + "; ShardTrain reads F32, BF16 and F16 weights" +
                            (lookup(key + ".SCB").tensor ? " and bitsandbytes' 4-bit ones, not its 8-bit (LLM.int8) "
                                                           "format: use a 4-bit or the original folder"
                                                         : ""));
    int64_t covered = 0;
    for (const auto& [stored_row, piece_rows] : want.rows) {
      SHARD_CHECK(stored_row >= 0 && stored_row + piece_rows <= t.shape[0], "%s: rows %lld+%lld of %lld",
                  p.name.c_str(), static_cast<long long>(stored_row), static_cast<long long>(piece_rows),
                  static_cast<long long>(t.shape[0]));
      covered += piece_rows;
    }
    SHARD_CHECK(want.rows.empty() || (!want.transposed && covered == p.shape[0]), "%s: pieces of %lld rows",
                p.name.c_str(), static_cast<long long>(covered));
    used.insert(key);
    sources.push_back({it->second.first, it->second.second, want.transposed, nullptr, want.rows});
  }
  for (const auto& [key, where] : files.tensors)
    if (!used.count(key) && !family.hf_ignorable(key))
      throw CheckpointError("safetensors file '" + where.first->path() + "': unexpected tensor '" +
                            printable_text(where.second->name) + "' (not part of a " + family.hf_class() + " of " +
                            (single ? "the other tensors'" : "config.json's") + " shape)");

  // A run double-quantizing as a bitsandbytes folder did codes its absmax under the folder's
  // offsets and group scales, which gives the folder's values back (HostShard::upload).
  std::vector<std::vector<std::vector<float>>> nested_given(engine.shards().size());
  const QuantConfig& quant = table.quant();
  for (size_t u = 0; u < nested_given.size(); u++)
    for (int id : table.units()[u].params)
      if (const auto& q = sources[id].quantized; table.params()[id].quantized && quant.nested)
        nested_given[u].push_back(q && q->quant_type() == quant_type_name(quant.type) &&
                                          q->blocksize() == static_cast<int64_t>(quant.block)
                                      ? q->nested_table()
                                      : std::vector<float>{});
  std::vector<float> block;
  engine.fill_base_shards([&](const ParamInfo& p, float* slice, const FlatRange& part) {
    const auto& [reader, tensor, transposed, quantized, rows] = sources[p.id];
    const size_t first = part.begin - p.offset, count = part.size();
    if (quantized) {
      quantized->read(first, count, slice);
    } else if (!rows.empty()) {
      // Our elements of each piece of rows, read from where the piece lies in the stored tensor.
      const size_t cols = p.numel / p.shape[0];
      size_t ours = 0;  // our first element of the piece
      for (const auto& [stored_row, piece_rows] : rows) {
        const size_t piece = static_cast<size_t>(piece_rows) * cols;
        const size_t lo = std::max(first, ours), hi = std::min(first + count, ours + piece);
        if (lo < hi) reader->read_fp32(*tensor, stored_row * cols + (lo - ours), hi - lo, slice + (lo - first));
        ours += piece;
      }
    } else if (!transposed) {
      reader->read_fp32(*tensor, first, count, slice);
    } else {
      // Ours is (out, in), the file's (in, out): our rows [o0, o1] are the file's columns, read
      // as one contiguous run per file row, a bounded piece of rows at a time.
      const size_t in = p.shape[1], out = p.shape[0];
      for_row_pieces(first, count, in, [&](size_t pf, size_t pc) {
        const size_t o0 = pf / in, o1 = (pf + pc - 1) / in, width = o1 - o0 + 1;
        block.resize(in * width);
        for (size_t i = 0; i < in; i++) reader->read_fp32(*tensor, i * out + o0, width, block.data() + i * width);
        for (size_t flat = pf; flat < pf + pc; flat++)
          slice[flat - first] = block[(flat % in) * width + (flat / in - o0)];
      });
    }
    const float* bad = std::find_if(slice, slice + count, [](float x) { return !std::isfinite(x); });
    if (bad != slice + count)
      throw CheckpointError(strprintf("%s '%s': tensor '%s' holds %g: the file is damaged or comes from a run "
                                      "that diverged; use another model",
                                      reader ? "safetensors file" : "Hugging Face folder",
                                      (reader ? reader->path() : path).c_str(),
                                      (tensor ? tensor->name : tensor_of(p).name).c_str(), *bad));
  }, &nested_given);
}

void load_hf_shards(const std::string& path, FsdpEngine& engine) {
  engine.load_base([&] { read_hf_shards(path, engine); });
}

void write_hf_shards(FsdpEngine& engine, const HfExportPlan& plan,
                     std::vector<std::unique_ptr<SafetensorsWriter>>& writers) {
  const ParamTable& table = engine.table();
  std::vector<float> run;
  for (size_t u = 0; u < engine.shards().size(); u++) {
    UnitShard& s = engine.shards()[u];
    HostShard values = engine.host_shard(static_cast<int>(u));
    for (int id : table.units()[u].params) {
      const ParamInfo& p = table.params()[id];
      const UnitLayout::Local own = s.layout.local_part(p.range(), true);
      if (own.range.empty()) continue;
      const float* slice = values.data() + own.index;
      const size_t first = own.range.begin - p.offset, count = own.range.size();
      SafetensorsWriter& writer = *writers[plan.where[p.id].first];
      const size_t entry = plan.where[p.id].second;
      if (!plan.rows[p.id].empty()) {  // our rows' pieces of a fused tensor (load_hf_shards' reading, reversed)
        const size_t cols = p.numel / p.shape[0];
        size_t ours = 0;
        for (const auto& [stored_row, piece_rows] : plan.rows[p.id]) {
          const size_t piece = static_cast<size_t>(piece_rows) * cols;
          const size_t lo = std::max(first, ours), hi = std::min(first + count, ours + piece);
          if (lo < hi) writer.write_fp32(entry, stored_row * cols + (lo - ours), hi - lo, slice + (lo - first));
          ours += piece;
        }
        continue;
      }
      if (!hf_tensor_of(table.config(), p).transposed) {
        writer.write_fp32(entry, first, count, slice);
        continue;
      }
      // Ours (out, in) -> the file's (in, out): per file row i, the run of our rows that this rank
      // owns in column i (the first and last of our rows may be partly another rank's).
      const size_t in = p.shape[1], out = p.shape[0];
      for_row_pieces(first, count, in, [&](size_t pf, size_t pc) {
        const size_t o0 = pf / in, o1 = (pf + pc - 1) / in, c0 = pf % in, c1 = (pf + pc - 1) % in;
        for (size_t i = 0; i < in; i++) {
          const size_t begin = o0 + (i < c0 ? 1 : 0), end = o1 + (i <= c1 ? 1 : 0);  // rows [begin, end)
          if (begin >= end) continue;
          run.resize(end - begin);
          for (size_t o = begin; o < end; o++) run[o - begin] = slice[o * in + i - first];
          writer.write_fp32(entry, i * out + begin, run.size(), run.data());
        }
      });
    }
  }
}

std::string hf_config_json(const ModelConfig& m, DType dtype, const HfSpecialIds* ids) {
  nlohmann::ordered_json j;
  family_of(m).write_hf_config(m, j);
  if (ids && !ids->eos.empty()) {
    j["bos_token_id"] = ids->bos ? *ids->bos : ids->eos.front();  // GPT-2's own: one token for both
    j["eos_token_id"] = ids->eos.front();
  }
  if (family_of(m).hf_torch_dtype())
    j["torch_dtype"] = torch_dtype_name(dtype);
  return j.dump(2) + "\n";
}

HfExportPlan hf_export_plan(const ParamTable& table, DType dtype, uint64_t max_file_bytes,
                            const HfQuantizedExport& quant) {
  const std::string base = family_of(table.config()).hf_weights();
  std::vector<std::vector<SafetensorsEntry>> groups(1);
  HfExportPlan plan;
  plan.index_name = base + ".safetensors.index.json";
  plan.quant = quant;
  std::vector<bool> quantized(table.params().size(), false);
  if (quant.type != QUANT_NONE)
    for (int l = 0; l < table.block_count(); l++)
      for (const LinearSite& site : table.block_sites(l)) quantized[table.param(block_unit(l), site.weight).id] = true;
  plan.quantized.resize(table.params().size());
  uint64_t in_group = 0;
  std::map<std::string, std::pair<size_t, size_t>> fused;  // a fused tensor's (file, entry), once placed
  for (const ParamInfo& p : table.params()) {
    const HfTensor t = hf_tensor_of(table.config(), p);
    if (!t.rows.empty() && !quantized[p.id]) {  // our rows of a tensor that others' rows share (Phi-3's qkv_proj)
      if (auto it = fused.find(t.name); it != fused.end()) {
        plan.where.push_back(it->second);
        plan.rows.push_back(t.rows);
        continue;
      }
    }
    std::vector<SafetensorsEntry> entries;
    if (!quantized[p.id]) {
      entries.push_back({t.name, dtype, t.shape});
    } else {
      SHARD_CHECK(!t.transposed && t.rows.empty(), "a bitsandbytes tensor for %s, stored transposed or in pieces",
                  p.name.c_str());
      const int64_t blocks = static_cast<int64_t>((p.numel + quant.block - 1) / quant.block);
      auto bytes = [](const std::string& name, int64_t n) { return SafetensorsEntry{name, DTYPE_FP32, {n}, true}; };
      entries.push_back({t.name, DTYPE_FP32, {static_cast<int64_t>((p.numel + 1) / 2), 1}, true});
      if (quant.double_quant) {
        entries.push_back(bytes(t.name + ".absmax", blocks));
        entries.push_back({t.name + ".quant_map", DTYPE_FP32, {16}});
        entries.push_back({t.name + ".nested_absmax", DTYPE_FP32,
                           {static_cast<int64_t>(nested_groups(static_cast<uint64_t>(blocks)))}});
        entries.push_back({t.name + ".nested_quant_map", DTYPE_FP32, {256}});
      } else {
        entries.push_back({t.name + ".absmax", DTYPE_FP32, {blocks}});
        entries.push_back({t.name + ".quant_map", DTYPE_FP32, {16}});
      }
      entries.push_back(bytes(t.name + bnb_quant_state_suffix(quant.type),
                              static_cast<int64_t>(Bnb4bitWeight::quant_state_bytes(t.shape, quant.double_quant))));
    }
    uint64_t bytes = 0;
    for (const SafetensorsEntry& e : entries) {
      uint64_t numel = 1;
      for (int64_t d : e.shape) numel *= static_cast<uint64_t>(d);
      bytes += numel * (e.bytes ? 1 : dtype_bytes(e.dtype));
    }
    if (max_file_bytes && in_group > 0 && in_group + bytes > max_file_bytes) groups.emplace_back(), in_group = 0;
    if (quantized[p.id])
      for (size_t k = 0; k < entries.size(); k++) plan.quantized[p.id].push_back(groups.back().size() + k);
    plan.where.emplace_back(groups.size() - 1, groups.back().size());
    plan.rows.push_back(quantized[p.id] ? std::vector<std::pair<int64_t, int64_t>>{} : t.rows);
    if (!t.rows.empty()) fused.emplace(t.name, plan.where.back());
    groups.back().insert(groups.back().end(), entries.begin(), entries.end());
    in_group += bytes;
    plan.tensor_bytes += bytes;
  }
  // Each file's entries by element size, largest first (stable), and the plan's indices with them.
  auto element = [](const SafetensorsEntry& e) { return e.bytes ? 1 : dtype_bytes(e.dtype); };
  std::vector<std::vector<size_t>> moved(groups.size());
  for (size_t f = 0; f < groups.size(); f++) {
    std::vector<size_t> order(groups[f].size());
    for (size_t i = 0; i < order.size(); i++) order[i] = i;
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return element(groups[f][a]) > element(groups[f][b]); });
    std::vector<SafetensorsEntry> sorted;
    moved[f].resize(order.size());
    for (size_t i = 0; i < order.size(); i++) sorted.push_back(groups[f][order[i]]), moved[f][order[i]] = i;
    groups[f] = std::move(sorted);
  }
  for (size_t id = 0; id < plan.where.size(); id++) {
    auto& [file, entry] = plan.where[id];
    for (size_t& e : plan.quantized[id]) e = moved[file][e];
    entry = moved[file][entry];
  }
  for (size_t f = 0; f < groups.size(); f++) {
    const std::string name = groups.size() == 1
                                 ? base + ".safetensors"
                                 : strprintf("%s-%05zu-of-%05zu.safetensors", base.c_str(), f + 1, groups.size());
    plan.files.push_back({name, SafetensorsLayout(groups[f], {{"format", "pt"}})});
  }
  if (quant.type != QUANT_NONE) {
    // As transformers 5 writes BitsAndBytesConfig(load_in_4bit=True, ...).
    nlohmann::ordered_json q;
    q["_load_in_4bit"] = true;
    q["_load_in_8bit"] = false;
    q["bnb_4bit_compute_dtype"] = torch_dtype_name(dtype);
    q["bnb_4bit_quant_storage"] = "uint8";
    q["bnb_4bit_quant_type"] = quant_type_name(quant.type);
    q["bnb_4bit_use_double_quant"] = quant.double_quant;
    q["llm_int8_enable_fp32_cpu_offload"] = false;
    q["llm_int8_has_fp16_weight"] = false;
    q["llm_int8_skip_modules"] = nullptr;
    q["llm_int8_threshold"] = 6.0;
    q["load_in_4bit"] = true;
    q["load_in_8bit"] = false;
    q["quant_method"] = "bitsandbytes";
    plan.quantization_config = q.dump();
  }
  return plan;
}

HfExportPlan single_file_export_plan(const ParamTable& table, DType dtype, const std::string& name) {
  const ModelFamily& family = family_of(table.config());
  HfExportPlan plan;
  std::vector<SafetensorsEntry> entries;
  std::map<std::string, size_t> entry_of;
  for (const ParamInfo& p : table.params()) {
    const HfTensor t = family.single_file_tensor(table.config(), p);
    auto [it, added] = entry_of.emplace(t.name, entries.size());
    if (added) {
      entries.push_back({t.name, dtype, t.shape});
      uint64_t numel = 1;
      for (int64_t d : t.shape) numel *= static_cast<uint64_t>(d);
      plan.tensor_bytes += numel * dtype_bytes(dtype);
    }
    plan.where.emplace_back(0, it->second);
    plan.rows.push_back(t.rows);
  }
  plan.files.push_back({name, SafetensorsLayout(entries, {{"format", "pt"}})});
  return plan;
}

std::string HfExportPlan::index_json() const {
  if (files.size() == 1) return "";
  nlohmann::ordered_json j;
  j["metadata"] = {{"total_size", tensor_bytes}};
  nlohmann::ordered_json map = nlohmann::ordered_json::object();
  for (const HfExportFile& f : files)
    for (const SafetensorsEntry& e : f.layout.entries()) map[e.name] = f.name;
  j["weight_map"] = map;
  return j.dump(2) + "\n";
}

std::vector<float> to_hf_order(const ModelConfig& config, const ParamInfo& p, const std::vector<float>& values) {
  if (!hf_tensor_of(config, p).transposed) return values;
  const size_t out = p.shape[0], in = p.shape[1];
  std::vector<float> t(values.size());
  for (size_t o = 0; o < out; o++)
    for (size_t i = 0; i < in; i++) t[i * out + o] = values[o * in + i];
  return t;
}

}  // namespace shardtrain
