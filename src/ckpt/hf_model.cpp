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

#include "ckpt/json_file.hpp"
#include "core/error.hpp"

namespace shardtrain {
namespace {

// Layer-norm epsilon of our GPT-2 kernels (backend/cpu/layernorm.cpp, kernels/layernorm.cu).
constexpr double OUR_LAYER_NORM_EPS = 1e-5;
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

// This rank's host view of a unit shard: the shard itself on the host, else a copy (download) that
// upload() puts back.
class HostShard {
 public:
  explicit HostShard(DeviceArray<float>& params) : params_(params) {
    if (params.on_host()) return;
    copy_.resize(params.size());
    params.device()->copy_to_host(copy_.data(), params.data(), params.bytes());
  }
  float* data() { return params_.on_host() ? params_.data() : copy_.data(); }
  void upload() {
    if (!params_.on_host()) params_.device()->copy_to_device(params_.data(), copy_.data(), params_.bytes());
  }

 private:
  DeviceArray<float>& params_;
  std::vector<float> copy_;
};

// The prefix of the base model's tensors (transformers' base_model_prefix), which files may leave
// out (a GPT2Model's or LlamaModel's own save); Llama's lm_head.weight never has it.
const char* hf_prefix(ModelArch arch) { return arch == ARCH_LLAMA ? "model." : "transformer."; }

bool ends_with(const std::string& name, const std::string& suffix) {
  return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// A tensor's name in a file, less the base model's prefix: the key we look parameters up by.
std::string hf_key(ModelArch arch, const std::string& name) {
  const std::string prefix = hf_prefix(arch);
  return name.rfind(prefix, 0) == 0 ? name.substr(prefix.size()) : name;
}

// Tensors of real files that are not parameters: GPT-2's causal-mask buffers and its tied head;
// Llama's rotary inv_freq buffers (older files) and a tied model's lm_head.weight (an untied
// model's is a parameter, so never left over).
bool ignorable(ModelArch arch, const std::string& key) {
  if (key == "lm_head.weight") return true;
  if (arch == ARCH_LLAMA) return ends_with(key, ".self_attn.rotary_emb.inv_freq");
  return ends_with(key, ".attn.bias") || ends_with(key, ".attn.masked_bias");
}

// The tensors of a folder: key (hf_key) -> the file that holds it.
struct HfFiles {
  std::vector<std::unique_ptr<SafetensorsReader>> readers;
  std::map<std::string, std::pair<const SafetensorsReader*, const SafetensorsTensor*>> tensors;
};

HfFiles open_hf_files(const std::string& folder, ModelArch arch) {
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
    for (const SafetensorsTensor& t : r.tensors())
      if (!files.tensors.emplace(hf_key(arch, t.name), std::make_pair(&r, &t)).second)
        throw CheckpointError("Hugging Face folder '" + folder + "': tensor '" + t.name + "' appears twice");
  }
  return files;
}

// config.json's values, each checked for its type; a key that is absent (or null, where a null
// means "the default" to transformers too) takes the default given.
class HfConfig {
 public:
  explicit HfConfig(const std::string& folder)
      : path_(folder + "/config.json"), j_(read_json(path_, "Hugging Face config")) {
    if (!j_.is_object()) fail("not a JSON object");
  }
  [[noreturn]] void fail(const std::string& why) const {
    throw CheckpointError("Hugging Face config '" + path_ + "': " + why);
  }
  // The value of `key`, or null when absent.
  const nlohmann::json& operator[](const char* key) const {
    static const nlohmann::json null;
    return j_.contains(key) ? j_[key] : null;
  }
  bool present(const char* key) const { return j_.contains(key); }
  bool has(const char* key) const { return !(*this)[key].is_null(); }
  // A positive whole number; required when `fallback` is 0.
  int whole(const char* key, int fallback = 0) const {
    const nlohmann::json& v = (*this)[key];
    if (v.is_null() && fallback > 0) return fallback;
    if (!v.is_number_integer() || v.get<int64_t>() < 1 || v.get<int64_t>() > (1 << 30))
      fail(std::string(key) + (v.is_null() ? " is missing" : " " + v.dump() + " is not a positive whole number"));
    return static_cast<int>(v.get<int64_t>());
  }
  double positive(const char* key, double fallback) const {
    const nlohmann::json& v = (*this)[key];
    if (v.is_null()) return fallback;
    if (!v.is_number() || !(v.get<double>() > 0) || !std::isfinite(v.get<double>()))
      fail(std::string(key) + " " + v.dump() + " is not a positive number");
    return v.get<double>();
  }
  bool flag(const char* key, bool fallback) const {
    const nlohmann::json& v = (*this)[key];
    if (v.is_null()) return fallback;
    if (!v.is_boolean()) fail(std::string(key) + " " + v.dump() + " is not true or false");
    return v.get<bool>();
  }
  std::string text(const char* key, const std::string& fallback) const {
    const nlohmann::json& v = (*this)[key];
    if (v.is_null()) return fallback;
    if (!v.is_string()) fail(std::string(key) + " " + v.dump() + " is not a string");
    return v.get<std::string>();
  }

 private:
  std::string path_;
  nlohmann::json j_;
};

ModelConfig gpt2_model_config(const HfConfig& j) {
  ModelConfig m;
  m.n_layer = j.whole("n_layer");
  m.n_embd = j.whole("n_embd");
  m.n_head = j.whole("n_head");
  m.vocab_size = j.whole("vocab_size");
  m.max_seq_len = j.has("n_positions") || !j.has("n_ctx") ? j.whole("n_positions") : j.whole("n_ctx");
  const std::string act = j.text("activation_function", "gelu_new");
  if (act != "gelu_new" && act != "gelu_pytorch_tanh")
    j.fail("activation_function '" + act + "' is not implemented; ShardTrain's GPT-2 uses the tanh GELU (gelu_new)");
  if (j.has("n_inner") && j["n_inner"] != 4 * m.n_embd)
    j.fail("n_inner " + j["n_inner"].dump() + " is not implemented; ShardTrain's MLP is 4 x n_embd");
  if (!j.flag("tie_word_embeddings", true))
    j.fail("tie_word_embeddings false is not implemented; ShardTrain ties the LM head to wte");
  if (std::fabs(j.positive("layer_norm_epsilon", OUR_LAYER_NORM_EPS) - OUR_LAYER_NORM_EPS) > 1e-12)
    j.fail("layer_norm_epsilon " + j["layer_norm_epsilon"].dump() + " is not implemented; ShardTrain uses 1e-05");
  for (const char* key : {"scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"})
    if (j.flag(key, false)) j.fail(std::string(key) + " true is not implemented");
  if (!j.flag("scale_attn_weights", true)) j.fail("scale_attn_weights false is not implemented");
  if (m.n_embd % m.n_head != 0) j.fail("n_embd is not a multiple of n_head");
  return m;
}

// LlamaConfig's keys, absent ones taking its defaults (MistralConfig's for a mistral folder). The
// rotary settings may also come as transformers 5's rope_parameters; either dict may only name the
// plain rotary embedding (rope_type default) and its theta.
ModelConfig llama_model_config(const HfConfig& j, bool mistral) {
  ModelConfig m;
  m.arch = ARCH_LLAMA;
  m.n_layer = j.whole("num_hidden_layers");
  m.n_embd = j.whole("hidden_size");
  m.n_head = j.whole("num_attention_heads");
  // Null means "as many as the query heads" to both; MistralConfig's default when absent is 8.
  m.n_kv_head = mistral && !j.present("num_key_value_heads") ? 8 : j.whole("num_key_value_heads", m.n_head);
  m.intermediate_size = j.whole("intermediate_size");
  m.vocab_size = j.whole("vocab_size");
  m.max_seq_len = j.whole("max_position_embeddings", mistral ? 4096 * 32 : 2048);
  m.rope_theta = j.positive("rope_theta", 10000.0);
  m.norm_eps = j.positive("rms_norm_eps", 1e-6);
  m.tie_embeddings = j.flag("tie_word_embeddings", false);
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    const nlohmann::json& rope = j[key];
    if (rope.is_null()) continue;
    if (!rope.is_object()) j.fail(std::string(key) + " " + rope.dump() + " is not a JSON object or null");
    const nlohmann::json type =
        rope.contains("rope_type") ? rope["rope_type"] : rope.value("type", nlohmann::json("default"));
    for (const auto& item : rope.items())
      if (type != "default" || (item.key() != "rope_type" && item.key() != "type" && item.key() != "rope_theta"))
        j.fail(std::string(key) + " " + rope.dump() +
               " is not implemented; ShardTrain's rotary embedding is the plain one (rope_type default, rope_theta)");
    if (rope.contains("rope_theta")) {
      if (!rope["rope_theta"].is_number() || !(rope["rope_theta"].get<double>() > 0))
        j.fail(std::string(key) + ".rope_theta " + rope["rope_theta"].dump() + " is not a positive number");
      m.rope_theta = rope["rope_theta"].get<double>();
    }
  }
  const std::string act = j.text("hidden_act", "silu");
  if (act != "silu" && act != "swish")
    j.fail("hidden_act '" + act + "' is not implemented; ShardTrain's Llama MLP uses silu");
  for (const char* key : {"attention_bias", "mlp_bias"})
    if (j.flag(key, false)) j.fail(std::string(key) + " true is not implemented; ShardTrain's Llama has no biases");
  if (m.n_embd % m.n_head != 0) j.fail("hidden_size is not a multiple of num_attention_heads");
  if (j.has("head_dim") && j.whole("head_dim") != m.head_size())
    j.fail(strprintf("head_dim %d is not implemented; ShardTrain's head size is hidden_size / num_attention_heads = %d",
                     j.whole("head_dim"), m.head_size()));
  if (m.head_size() % 2 != 0)
    j.fail(strprintf("hidden_size / num_attention_heads = %d is odd; rotary embeddings turn pairs of dimensions",
                     m.head_size()));
  if (m.n_head % m.n_kv_head != 0) j.fail("num_attention_heads is not a multiple of num_key_value_heads");
  // Mistral's window masks keys sliding_window or more positions back; one that no sequence
  // reaches changes nothing.
  if (mistral) {
    const bool absent = !j.present("sliding_window");  // MistralConfig's default is 4096
    const int window = absent ? 4096 : j.has("sliding_window") ? j.whole("sliding_window") : 0;
    if (window > 0 && window < m.max_seq_len)
      j.fail(strprintf("sliding_window %d%s is not implemented; ShardTrain's attention sees every earlier position "
                       "(null, or at least max_position_embeddings = %d, is read)",
                       window, absent ? " (MistralConfig's default, the key being absent)" : "", m.max_seq_len));
  }
  return m;
}

}  // namespace

const char* hf_architecture(ModelArch arch) { return arch == ARCH_LLAMA ? "LlamaForCausalLM" : "GPT2LMHeadModel"; }

bool is_hf_model_folder(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode) && ::stat((path + "/config.json").c_str(), &st) == 0;
}

ModelConfig read_hf_model_config(const std::string& folder) {
  const HfConfig j(folder);
  const std::string type = j.text("model_type", "");
  if (type != "gpt2" && type != "llama" && type != "mistral")
    j.fail("model_type '" + type + "' is not implemented; ShardTrain reads gpt2, llama and mistral models");
  const ModelConfig m = type == "gpt2" ? gpt2_model_config(j) : llama_model_config(j, type == "mistral");
  const std::string shape = model_shape_defect(m.n_layer, m.n_embd, m.n_head, m.vocab_size, m.max_seq_len,
                                               m.intermediate_size);
  if (!shape.empty()) j.fail(shape + ": not a shape this program holds");
  return m;
}

HfTensor hf_tensor_of(ModelArch arch, const ParamInfo& p) {
  HfTensor t;
  for (int d : p.shape) t.shape.push_back(d);
  if (arch == ARCH_LLAMA) {  // Hugging Face's names less the prefix, nn.Linear's (out, in) as ours
    t.name = p.name == "lm_head.weight" ? p.name : hf_prefix(arch) + p.name;
    return t;
  }
  static const std::pair<const char*, const char*> renames[] = {
      {".attn.qkv.", ".attn.c_attn."}, {".attn.proj.", ".attn.c_proj."}, {".mlp.fc.", ".mlp.c_fc."},
      {".mlp.proj.", ".mlp.c_proj."}};
  t.name = p.name == "wte" || p.name == "wpe" ? p.name + ".weight" : p.name;
  for (const auto& [ours, theirs] : renames) {
    const size_t at = t.name.find(ours);
    if (at == std::string::npos) continue;
    t.name.replace(at, std::string(ours).size(), theirs);
    t.transposed = p.shape.size() == 2;  // Conv1D weights; biases are vectors either way
  }
  if (t.transposed) std::swap(t.shape[0], t.shape[1]);
  t.name = hf_prefix(arch) + t.name;
  return t;
}

void load_hf_shards(const std::string& folder, FsdpEngine& engine) {
  const ParamTable& table = engine.table();
  const ModelArch arch = table.config().arch;
  const HfFiles files = open_hf_files(folder, arch);
  // Each parameter's tensor in the files, checked before anything is read.
  struct Source {
    const SafetensorsReader* reader;
    const SafetensorsTensor* tensor;
    bool transposed;
  };
  std::vector<Source> sources;
  std::set<std::string> used;
  for (const ParamInfo& p : table.params()) {
    if (p.adapter) {  // the base model's folder has none: they keep their initial values
      sources.push_back({nullptr, nullptr, false});
      continue;
    }
    const HfTensor want = hf_tensor_of(arch, p);
    const std::string key = hf_key(arch, want.name);
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
    if (!used.count(key) && !ignorable(arch, key))
      throw CheckpointError("safetensors file '" + where.first->path() + "': unexpected tensor '" + where.second->name +
                            "' (not part of a " +
                            hf_architecture(arch) + " of config.json's shape)");

  for (size_t u = 0; u < engine.shards().size(); u++) {
    UnitShard& s = engine.shards()[u];
    HostShard values(s.params);  // what the file lacks (adapters, padding) keeps its value
    std::vector<float> block;
    for (int id : table.units()[u].params) {
      const ParamInfo& p = table.params()[id];
      const UnitLayout::Local local = s.layout.local_part(p.range());
      const FlatRange part = local.range;
      if (part.empty() || p.adapter) continue;
      const auto [reader, tensor, transposed] = sources[p.id];
      float* slice = values.data() + local.index;
      const size_t first = part.begin - p.offset, count = part.size();
      if (!transposed) {
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
        throw CheckpointError(strprintf("safetensors file '%s': tensor '%s' holds %g: the file is damaged or comes "
                                        "from a run that diverged; use another model",
                                        reader->path().c_str(), tensor->name.c_str(), *bad));
    }
    values.upload();
  }
}

void write_hf_shards(FsdpEngine& engine, const HfExportPlan& plan,
                     std::vector<std::unique_ptr<SafetensorsWriter>>& writers) {
  const ParamTable& table = engine.table();
  std::vector<float> run;
  for (size_t u = 0; u < engine.shards().size(); u++) {
    UnitShard& s = engine.shards()[u];
    HostShard values(s.params);
    for (int id : table.units()[u].params) {
      const ParamInfo& p = table.params()[id];
      const UnitLayout::Local own = s.layout.local_part(p.range(), true);
      if (own.range.empty()) continue;
      const float* slice = values.data() + own.index;
      const size_t first = own.range.begin - p.offset, count = own.range.size();
      SafetensorsWriter& writer = *writers[plan.where[p.id].first];
      const size_t entry = plan.where[p.id].second;
      if (!hf_tensor_of(table.config().arch, p).transposed) {
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

std::string hf_config_json(const ModelConfig& m, DType dtype) {
  nlohmann::ordered_json j;
  if (m.arch == ARCH_LLAMA) {
    // LlamaForCausalLM as transformers 4 writes it. The token ids are not known to a checkpoint:
    // null, rather than absent, which LlamaConfig would read as its own defaults 1 and 2.
    j["architectures"] = {hf_architecture(m.arch)};
    j["model_type"] = "llama";
    j["hidden_size"] = m.n_embd;
    j["intermediate_size"] = m.mlp_size();
    j["num_hidden_layers"] = m.n_layer;
    j["num_attention_heads"] = m.n_head;
    j["num_key_value_heads"] = m.kv_heads();
    j["head_dim"] = m.head_size();
    j["vocab_size"] = m.vocab_size;
    j["max_position_embeddings"] = m.max_seq_len;
    j["hidden_act"] = "silu";
    j["rms_norm_eps"] = m.norm_eps;
    j["rope_theta"] = m.rope_theta;
    j["rope_scaling"] = nullptr;
    j["attention_bias"] = false;
    j["attention_dropout"] = 0.0;
    j["mlp_bias"] = false;
    j["pretraining_tp"] = 1;
    j["tie_word_embeddings"] = m.tie_embeddings;
    j["bos_token_id"] = nullptr;
    j["eos_token_id"] = nullptr;
    j["initializer_range"] = 0.02;
    j["use_cache"] = true;
  } else {
    j["architectures"] = {hf_architecture(m.arch)};
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
  }
  j["torch_dtype"] = dtype == DTYPE_FP32 ? "float32" : dtype == DTYPE_BF16 ? "bfloat16" : "float16";
  return j.dump(2) + "\n";
}

HfExportPlan hf_export_plan(const ParamTable& table, DType dtype, uint64_t max_file_bytes) {
  std::vector<std::vector<SafetensorsEntry>> groups(1);
  HfExportPlan plan;
  uint64_t in_group = 0;
  for (const ParamInfo& p : table.params()) {
    const HfTensor t = hf_tensor_of(table.config().arch, p);
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

std::vector<float> to_hf_order(ModelArch arch, const ParamInfo& p, const std::vector<float>& values) {
  if (!hf_tensor_of(arch, p).transposed) return values;
  const size_t out = p.shape[0], in = p.shape[1];
  std::vector<float> t(values.size());
  for (size_t o = 0; o < out; o++)
    for (size_t i = 0; i < in; i++) t[i * out + o] = values[o * in + i];
  return t;
}

}  // namespace shardtrain
