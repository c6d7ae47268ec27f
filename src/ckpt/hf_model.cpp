// See hf_model.hpp.
#include "ckpt/hf_model.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/error.hpp"

namespace shardtrain {
namespace {

constexpr const char* PREFIX = "transformer.";

// Layer-norm epsilon of our kernels (backend/cpu/layernorm.cpp, kernels/layernorm.cu).
constexpr double OUR_LAYER_NORM_EPS = 1e-5;

nlohmann::json read_json(const std::string& path, const std::string& what) {
  std::ifstream in(path);
  if (!in) throw CheckpointError(what + " '" + path + "': cannot open");
  std::stringstream text;
  text << in.rdbuf();
  try {
    return nlohmann::json::parse(text.str());
  } catch (const nlohmann::json::exception& e) {
    throw CheckpointError(what + " '" + path + "': malformed JSON: " + e.what());
  }
}

// The tensors of a folder: name -> the file that holds it.
struct HfFiles {
  std::vector<std::unique_ptr<SafetensorsReader>> readers;
  std::map<std::string, std::pair<const SafetensorsReader*, const SafetensorsTensor*>> tensors;
};

HfFiles open_hf_files(const std::string& folder) {
  HfFiles files;
  const std::string single = folder + "/model.safetensors", index = folder + "/model.safetensors.index.json";
  std::vector<std::string> names;
  struct stat st {};
  if (::stat(index.c_str(), &st) == 0) {
    const nlohmann::json j = read_json(index, "safetensors index");
    if (!j.contains("weight_map") || !j["weight_map"].is_object())
      throw CheckpointError("safetensors index '" + index + "': no weight_map object");
    std::set<std::string> unique;
    for (const auto& [tensor, file] : j["weight_map"].items()) {
      if (!file.is_string() || file.get<std::string>().find('/') != std::string::npos)
        throw CheckpointError("safetensors index '" + index + "': tensor '" + tensor + "' names no file of the folder");
      unique.insert(file.get<std::string>());
    }
    names.assign(unique.begin(), unique.end());
  } else if (::stat(single.c_str(), &st) == 0) {
    names.push_back("model.safetensors");
  } else {
    throw CheckpointError("Hugging Face folder '" + folder +
                          "': neither model.safetensors nor model.safetensors.index.json (only safetensors weights "
                          "are read; convert .bin files with transformers' save_pretrained(safe_serialization=True))");
  }
  for (const std::string& name : names) {
    files.readers.push_back(std::make_unique<SafetensorsReader>(folder + "/" + name));
    const SafetensorsReader& r = *files.readers.back();
    for (const SafetensorsTensor& t : r.tensors()) {
      std::string key = t.name.rfind(PREFIX, 0) == 0 ? t.name.substr(std::string(PREFIX).size()) : t.name;
      if (!files.tensors.emplace(key, std::make_pair(&r, &t)).second)
        throw CheckpointError("Hugging Face folder '" + folder + "': tensor '" + t.name + "' appears twice");
    }
  }
  return files;
}

// Buffers of older GPT-2 files that are not parameters.
bool ignorable(const std::string& name) {
  auto ends_with = [&](const char* suffix) {
    const std::string s(suffix);
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  return ends_with(".attn.bias") || ends_with(".attn.masked_bias") || name == "lm_head.weight";
}

}  // namespace

bool is_hf_model_folder(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode) && ::stat((path + "/config.json").c_str(), &st) == 0;
}

ModelConfig read_hf_model_config(const std::string& folder) {
  const std::string path = folder + "/config.json";
  const nlohmann::json j = read_json(path, "Hugging Face config");
  auto fail = [&](const std::string& why) { throw CheckpointError("Hugging Face config '" + path + "': " + why); };
  if (!j.is_object()) fail("not a JSON object");
  const std::string type = j.value("model_type", "");
  if (type != "gpt2")
    fail("model_type '" + type + "' is not implemented; ShardTrain reads gpt2 models");
  auto whole = [&](const char* key, const char* alternative) -> int {
    const nlohmann::json* v = j.contains(key) ? &j[key] : (alternative && j.contains(alternative) ? &j[alternative] : nullptr);
    if (!v || !v->is_number_integer() || v->get<int64_t>() < 1 || v->get<int64_t>() > (1 << 30))
      fail(std::string(key) + " is missing or not a positive whole number");
    return static_cast<int>(v->get<int64_t>());
  };
  ModelConfig m;
  m.n_layer = whole("n_layer", nullptr);
  m.n_embd = whole("n_embd", nullptr);
  m.n_head = whole("n_head", nullptr);
  m.vocab_size = whole("vocab_size", nullptr);
  m.max_seq_len = whole("n_positions", "n_ctx");
  const std::string act = j.value("activation_function", "gelu_new");
  if (act != "gelu_new" && act != "gelu_pytorch_tanh")
    fail("activation_function '" + act + "' is not implemented; ShardTrain's GPT-2 uses the tanh GELU (gelu_new)");
  if (j.contains("n_inner") && !j["n_inner"].is_null() && j["n_inner"] != 4 * m.n_embd)
    fail("n_inner " + j["n_inner"].dump() + " is not implemented; ShardTrain's MLP is 4 x n_embd");
  if (!j.value("tie_word_embeddings", true))
    fail("tie_word_embeddings false is not implemented; ShardTrain ties the LM head to wte");
  if (j.contains("layer_norm_epsilon") && (!j["layer_norm_epsilon"].is_number() ||
                                           std::fabs(j["layer_norm_epsilon"].get<double>() - OUR_LAYER_NORM_EPS) > 1e-12))
    fail("layer_norm_epsilon " + j["layer_norm_epsilon"].dump() + " is not implemented; ShardTrain uses 1e-05");
  for (const char* key : {"scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"})
    if (j.value(key, false)) fail(std::string(key) + " true is not implemented");
  if (!j.value("scale_attn_weights", true)) fail("scale_attn_weights false is not implemented");
  if (m.n_embd % m.n_head != 0) fail("n_embd is not a multiple of n_head");
  return m;
}

HfTensor hf_tensor_of(const ParamInfo& p) {
  static const std::pair<const char*, const char*> renames[] = {
      {".attn.qkv.", ".attn.c_attn."}, {".attn.proj.", ".attn.c_proj."}, {".mlp.fc.", ".mlp.c_fc."},
      {".mlp.proj.", ".mlp.c_proj."}};
  HfTensor t;
  t.name = p.name == "wte" || p.name == "wpe" ? p.name + ".weight" : p.name;
  for (const auto& [ours, theirs] : renames) {
    const size_t at = t.name.find(ours);
    if (at == std::string::npos) continue;
    t.name.replace(at, std::string(ours).size(), theirs);
    t.transposed = p.shape.size() == 2;  // Conv1D weights; biases are vectors either way
  }
  for (int d : p.shape) t.shape.push_back(d);
  if (t.transposed) std::swap(t.shape[0], t.shape[1]);
  t.name = PREFIX + t.name;
  return t;
}

void load_hf_shards(const std::string& folder, FsdpEngine& engine) {
  const ParamTable& table = engine.table();
  const HfFiles files = open_hf_files(folder);
  // Each parameter's tensor in the files, checked before anything is read.
  struct Source {
    const SafetensorsReader* reader;
    const SafetensorsTensor* tensor;
    bool transposed;
  };
  std::vector<Source> sources;
  std::set<std::string> used;
  for (const ParamInfo& p : table.params()) {
    const HfTensor want = hf_tensor_of(p);
    const std::string key = want.name.substr(std::string(PREFIX).size());
    auto it = files.tensors.find(key);
    if (it == files.tensors.end())
      throw CheckpointError("Hugging Face folder '" + folder + "': tensor '" + want.name + "' is missing");
    const SafetensorsTensor& t = *it->second.second;
    if (t.shape != want.shape) {
      std::string got, expected;
      for (int64_t d : t.shape) got += (got.empty() ? "" : ", ") + std::to_string(d);
      for (int64_t d : want.shape) expected += (expected.empty() ? "" : ", ") + std::to_string(d);
      throw CheckpointError("safetensors file '" + it->second.first->path() + "': tensor '" + t.name + "' has shape [" +
                            got + "], config.json's model needs [" + expected + "]");
    }
    if (t.dtype != "F32" && t.dtype != "BF16" && t.dtype != "F16")
      throw CheckpointError("safetensors file '" + it->second.first->path() + "': tensor '" + t.name + "' is " +
                            t.dtype + "; ShardTrain reads F32, BF16 and F16 weights");
    used.insert(key);
    sources.push_back({it->second.first, it->second.second, want.transposed});
  }
  for (const auto& [key, where] : files.tensors)
    if (!used.count(key) && !ignorable(key))
      throw CheckpointError("safetensors file '" + where.first->path() + "': unexpected tensor '" + where.second->name +
                            "' (not part of a GPT-2 of config.json's shape)");

  for (size_t u = 0; u < engine.shards().size(); u++) {
    UnitShard& s = engine.shards()[u];
    std::vector<float> values(s.layout.shard_numel, 0.0f);  // read on the host, then to the shard's device
    std::vector<float> block;
    for (int id : table.units()[u].params) {
      const ParamInfo& p = table.params()[id];
      const FlatRange part = intersect(s.layout.shard_range(), p.range());
      if (part.empty()) continue;
      const auto [reader, tensor, transposed] = sources[p.id];
      float* slice = values.data() + (part.begin - s.layout.begin);
      const size_t first = part.begin - p.offset, count = part.size();
      if (!transposed) {
        reader->read_fp32(*tensor, first, count, slice);
      } else {
        // Ours is (out, in), the file's (in, out): our rows [o0, o1] are the file's columns, read
        // as one contiguous run per file row.
        const size_t in = p.shape[1], out = p.shape[0];
        const size_t o0 = first / in, o1 = (first + count - 1) / in, width = o1 - o0 + 1;
        block.resize(in * width);
        for (size_t i = 0; i < in; i++) reader->read_fp32(*tensor, i * out + o0, width, block.data() + i * width);
        for (size_t k = 0; k < count; k++) {
          const size_t flat = first + k;
          slice[k] = block[(flat % in) * width + (flat / in - o0)];
        }
      }
      const float* bad = std::find_if(slice, slice + count, [](float x) { return !std::isfinite(x); });
      if (bad != slice + count)
        throw CheckpointError(strprintf("safetensors file '%s': tensor '%s' holds %g: the file is damaged or comes "
                                        "from a run that diverged; use another model",
                                        reader->path().c_str(), tensor->name.c_str(), *bad));
    }
    s.params.device()->copy(s.params.data(), values.data(), s.params.bytes());
  }
}

std::string hf_config_json(const ModelConfig& m, DType dtype) {
  nlohmann::ordered_json j;
  j["architectures"] = {"GPT2LMHeadModel"};
  j["model_type"] = "gpt2";
  j["n_layer"] = m.n_layer;
  j["n_embd"] = m.n_embd;
  j["n_head"] = m.n_head;
  j["vocab_size"] = m.vocab_size;
  j["n_positions"] = m.max_seq_len;
  j["n_ctx"] = m.max_seq_len;
  j["n_inner"] = nullptr;
  j["activation_function"] = "gelu_new";
  j["layer_norm_epsilon"] = OUR_LAYER_NORM_EPS;
  j["tie_word_embeddings"] = true;
  j["scale_attn_weights"] = true;
  j["resid_pdrop"] = 0.0;
  j["embd_pdrop"] = 0.0;
  j["attn_pdrop"] = 0.0;
  j["torch_dtype"] = dtype == DTYPE_FP32 ? "float32" : dtype == DTYPE_BF16 ? "bfloat16" : "float16";
  return j.dump(2) + "\n";
}

HfExportPlan hf_export_plan(const ParamTable& table, DType dtype, uint64_t max_file_bytes) {
  std::vector<std::vector<SafetensorsEntry>> groups(1);
  HfExportPlan plan;
  uint64_t in_group = 0;
  for (const ParamInfo& p : table.params()) {
    const HfTensor t = hf_tensor_of(p);
    const uint64_t bytes = p.numel * dtype_bytes(dtype);
    if (max_file_bytes && in_group > 0 && in_group + bytes > max_file_bytes) groups.emplace_back(), in_group = 0;
    plan.where.emplace_back(groups.size() - 1, groups.back().size());
    groups.back().push_back({t.name, dtype, t.shape});
    in_group += bytes;
    plan.tensor_bytes += bytes;
  }
  for (size_t f = 0; f < groups.size(); f++) {
    const std::string name = groups.size() == 1 ? "model.safetensors"
                                                : strprintf("model-%05zu-of-%05zu.safetensors", f + 1, groups.size());
    plan.files.push_back({name, SafetensorsLayout(groups[f], {{"format", "pt"}})});
  }
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

std::vector<float> to_hf_order(const ParamInfo& p, const std::vector<float>& values) {
  if (!hf_tensor_of(p).transposed) return values;
  const size_t out = p.shape[0], in = p.shape[1];
  std::vector<float> t(values.size());
  for (size_t o = 0; o < out; o++)
    for (size_t i = 0; i < in; i++) t[i * out + o] = values[o * in + i];
  return t;
}

}  // namespace shardtrain
