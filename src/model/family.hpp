// A model family: everything about one architecture that the rest of the program asks, in one
// descriptor that its folder (model/families/<name>/) implements and model/families/registry.cpp
// lists once. Outside the families' folders nothing compares architectures: options, checkpoints,
// Hugging Face and PEFT files, the planner and the backends ask the family of the config
// (family_of) instead. docs/architecture.md, "Adding a model family", walks through adding one.
#pragma once

#include <algorithm>
#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "backend/dtype.hpp"
#include "backend/layer_ops.hpp"
#include "model/adapter.hpp"
#include "model/checkpointing.hpp"
#include "model/config.hpp"
#include "model/hf_config.hpp"

namespace shardtrain {

class ParamTable;
struct ParamInfo;
template <typename Real>
class TransformerModel;

// A parameter's tensor in a Hugging Face file: its canonical name (with the base model's prefix
// where transformers writes one), whether it is stored transposed, and its shape as stored.
struct HfTensor {
  std::string name;
  bool transposed = false;
  std::vector<int64_t> shape;
  // Our rows as pieces of the stored tensor's rows, in our order: {first stored row, rows} (a
  // single file's fused q | k | v, a modulation's halves stored swapped). Empty: the whole tensor.
  std::vector<std::pair<int64_t, int64_t>> rows;
};

// A safetensors file's tensors: name -> shape.
using TensorShapes = std::map<std::string, std::vector<int64_t>>;

enum NormKind { NORM_LAYER, NORM_RMS };

class ModelFamily {
 public:
  virtual ~ModelFamily() = default;

  // --- configuration ---
  // model.arch's value and the checkpoint attribute's: "gpt2".
  virtual const char* name() const = 0;
  // One line for model.arch's help: what sets it apart.
  virtual const char* description() const = 0;
  // The architecture and shape in one line for logs ("GPT-2 L=12 C=768 ...").
  virtual std::string summary(const ModelConfig& config) const = 0;
  // The model.* keys beyond the shape (model_shape_defect's) that this family reads; the others
  // must keep their defaults (options) under it.
  virtual std::vector<std::string> config_keys() const = 0;
  bool reads_key(const std::string& key) const {
    const std::vector<std::string> keys = config_keys();
    return std::find(keys.begin(), keys.end(), key) != keys.end();
  }
  // "" when the family can build this shape, else what is wrong, naming the key: the one check
  // that options, checkpoint attributes and Hugging Face config.json share.
  virtual std::string config_defect(const ModelConfig& config) const = 0;

  // --- parameters ---
  // Declares the units and parameters, in forward order (ParamTable::add_unit, add_param): the root
  // unit (made by the table) and blocks of one or several kinds, which the engine gathers one after
  // the other and the model runs by their index.
  virtual void add_params(ParamTable& table) const = 0;
  // Parameters of a block of this kind that are multiplied as one matrix (and so must be all frozen
  // or none): their positions in the block unit and a name for the message.
  struct FusedGroup {
    std::vector<int> params;
    const char* label;
  };
  virtual std::vector<FusedGroup> fused_groups(const ModelConfig&, const std::string& /*kind*/) const { return {}; }
  // Whether a quantized frozen base (fsdp.frozen_dtype) holds this linear layer's weight in its
  // format; the rest stay fp32.
  virtual bool quantizable(const LinearSite&) const { return true; }
  // Positions in the root unit of the parameters that take the input's gradient (the embedding
  // tables): when all are frozen, backward stops above the lowest trainable block.
  virtual std::vector<int> input_params() const = 0;
  // Model FLOPs per trained token at this sequence length.
  virtual double flops_per_token(const ParamTable& table, int seq_len) const = 0;

  // --- compute ---
  virtual std::unique_ptr<TransformerModel<float>> make_model(const ParamTable& table, int batch, int seq_len,
                                                              Checkpointing activation_checkpointing,
                                                              const LayerOps<float>& ops,
                                                              DType activation_dtype) const = 0;
  virtual std::unique_ptr<TransformerModel<double>> make_model(const ParamTable& table, int batch, int seq_len,
                                                               Checkpointing activation_checkpointing,
                                                               const LayerOps<double>& ops,
                                                               DType activation_dtype) const = 0;
  // Elements of each array the model allocates besides its saved tensors, tokens and targets, in
  // the order its constructor allocates them (the planner's allocation list), with its blocks'
  // saved tensors in activation_dtype (fsdp.activation_dtype).
  virtual std::vector<size_t> activation_arrays(const ModelConfig& config, int batch, int seq_len,
                                                Checkpointing activation_checkpointing,
                                                DType activation_dtype) const = 0;
  // Bytes of the integer arrays its model allocates besides those (a language model's token ids
  // and targets).
  virtual size_t id_bytes(const ModelConfig&, int /*batch*/, int /*seq_len*/) const { return 0; }
  // Elements of each of a layer's saved tensors (SavedActivations' sizes).
  virtual std::vector<size_t> saved_tensor_elements(const ModelConfig& config, int batch, int seq_len) const = 0;
  // Elements of a decode state (KvDecoder::begin_decode), its tokens and adapters aside.
  virtual size_t plan_decode_elements(const ModelConfig& config, int max_len, int max_chunk) const = 0;
  // The GEMMs of the blocks in forward order (each kind's once), then the LM head's.
  virtual std::vector<LinearShape> gemm_shapes(const ModelConfig& config) const = 0;
  virtual NormKind norm_kind() const = 0;

  // --- capabilities ---
  // Incremental decoding with a key/value cache (its models' kv_decoder()): what generate needs.
  virtual bool kv_decoding() const { return false; }
  // A vocabulary head (its models' token_logits()): what a distillation teacher and student need.
  virtual bool token_logits() const { return false; }
  // Hidden states a text encoder gives (its models' hidden_states()): what text_encoder.source needs.
  virtual bool hidden_states() const { return false; }
  // A regression head a flow-matching sampler steps with (its models' predictor()): `sample`.
  virtual bool samples_images() const { return false; }
  // The tokens one sample's attention sees in a micro-batch of seq_len-token samples: a decoder's
  // sequence; a diffusion transformer's joint [text; image] sequence.
  virtual int attention_tokens(const ModelConfig&, int seq_len) const { return seq_len; }
  // Whether model.max_seq_len is the model's own (a position table, max_position_embeddings), so
  // that a checkpoint or folder fixes it; else it only bounds a run's sequences (FLUX's image tokens).
  virtual bool fixes_max_seq_len() const { return true; }
  // Whether its activations stay within fp16's range, so that fsdp.activation_dtype may be fp16
  // (FLUX's residual streams outgrow 65504: diffusers clips them in fp16).
  virtual bool fp16_activations() const { return true; }
  // Whether it trains on token files (the language models) or on latent shards (data/latent_dataset.hpp).
  virtual bool token_data() const { return true; }

  // --- adapters ---
  // The linear layers of a block of this kind (UnitInfo::kind) that an adapter can target, in the
  // order the forward runs them.
  virtual std::vector<LinearSite> linear_sites(const ModelConfig& config, const std::string& kind) const = 0;
  // Hugging Face's module path of the site in block `block` (counted over every block, in forward
  // order): "model.layers.3.self_attn.q_proj".
  virtual std::string module_path(const ModelConfig& config, int block, const LinearSite& site) const = 0;
  // The most rows any of a block's products has in a micro-batch of `batch` x `seq_len` (what its
  // adapters' scratch and the GEMM workspace are sized for): a decoder's B x T; a diffusion
  // transformer's joint sequence.
  virtual int product_rows(const ModelConfig&, int batch, int seq_len) const { return batch * seq_len; }
  // The adapters' dropout keys in such a micro-batch (model/adapter_layers.hpp): one per row, or
  // (a diffusion transformer) a run per kind of row.
  virtual int adapter_key_rows(const ModelConfig& c, int batch, int seq_len) const {
    return product_rows(c, batch, seq_len);
  }
  // The GPU kernels' workspace requests of its layers in such a micro-batch (backend/gpu_memory.hpp's
  // sizes, with what asks) but the biased products' and DoRA's, which the memory plan adds from the
  // adapter sites: by default a decoder's embedding, causal attention and norm.
  struct KernelWorkspace {
    size_t bytes;
    const char* kernel;
  };
  virtual std::vector<KernelWorkspace> kernel_workspaces(const ModelConfig& config, int batch, int seq_len) const;

  // --- Hugging Face files ---
  // The transformers class ("LlamaForCausalLM") and whether a config.json's model_type is read by
  // this family.
  virtual const char* hf_class() const = 0;
  // The class a model of this configuration exports as (the family's, unless a setting needs
  // another: a Llama with a sliding window is a MistralForCausalLM).
  virtual const char* hf_class_of(const ModelConfig& config) const {
    (void)config;
    return hf_class();
  }
  virtual bool reads_model_type(const std::string& model_type) const = 0;
  // Whether this family reads a folder with this config.json: by its model_type (transformers), or
  // another key (diffusers' _class_name).
  virtual bool reads_hf_folder(const HfConfig& json) const { return reads_model_type(json.text("model_type", "")); }
  // The weight files' base name: model.safetensors (transformers), diffusion_pytorch_model.safetensors
  // (diffusers), with .index.json and -00001-of-00002 for several.
  virtual const char* hf_weights() const { return "model"; }
  // Where its adapters go (`export --adapter`): a PEFT folder (transformers' models: adapter_config.json,
  // adapter_model.safetensors, names under base_model.model.), or (false) diffusers' LoRA file
  // (pytorch_lora_weights.safetensors, names under transformer., the LoraConfig in the file's metadata).
  virtual bool peft_folder() const { return true; }
  // Whether config.json records the weights' dtype (transformers' torch_dtype; diffusers does not).
  virtual bool hf_torch_dtype() const { return true; }
  // The config config.json describes; HfConfig::fail for what the family does not implement.
  virtual ModelConfig read_hf_config(const HfConfig& json) const = 0;
  // config.json's keys for this config, as transformers writes them (torch_dtype aside).
  virtual void write_hf_config(const ModelConfig& config, nlohmann::ordered_json& json) const = 0;
  // transformers' base_model_prefix, which files may leave out: "model.".
  virtual const char* hf_prefix() const = 0;
  virtual HfTensor hf_tensor(const ModelConfig& config, const ParamInfo& param) const = 0;
  // Whether a tensor of a file (its name less the prefix) is no parameter and may be left over.
  virtual bool hf_ignorable(const std::string& key) const = 0;
  // Whether transformers' bitsandbytes 4-bit loading (load_in_4bit) replaces exactly the blocks'
  // linear layers, each stored whole as (out, in): what `export --quantize` writes.
  virtual bool hf_bnb_4bit() const { return false; }
  // Whether transformers stores the blocks' linear weights as Conv1D (in, out) (GPT-2), which PEFT
  // adapts with LoRA and DoRA only.
  virtual bool hf_conv1d() const { return false; }
  // Whether llm.c's GPT-2 files hold this family.
  virtual bool llmc_files() const { return false; }

  // --- a model's single safetensors file in its authors' layout (Black Forest Labs' FLUX.1) ---
  // Whether a file of these tensors (a common prefix such as ComfyUI's "model.diffusion_model."
  // already removed) is one; the model its shapes give (CheckpointError naming `path` where they
  // give none); each parameter's tensor there.
  // The layout's name ("Black Forest Labs' FLUX.1"), or null when the family has none; kohya's
  // LoRA files name their modules after it (ckpt/peft.hpp).
  virtual const char* single_file_layout() const { return nullptr; }
  virtual bool reads_single_file(const TensorShapes&) const { return false; }
  virtual ModelConfig read_single_file_config(const TensorShapes& tensors, const std::string& path) const;
  virtual HfTensor single_file_tensor(const ModelConfig& config, const ParamInfo& param) const;
};

// The registered families, in registry order (model/families/registry.cpp).
const std::vector<const ModelFamily*>& model_families();
// Adds a family that is not in the registry's list (the tests' own), for the rest of the process.
void register_model_family(const ModelFamily& family);
// The family of that name, or null.
const ModelFamily* find_model_family(const std::string& name);
// "gpt2, llama, qwen2": for messages.
std::string model_family_names();
// The family of a config whose arch was checked on the way in (options, checkpoint, config.json).
const ModelFamily& family_of(const ModelConfig& config);
// Throws UsageError (exit 2) when the config's family lacks the capability `use` needs: `use` is
// "generate" (kv_decoding), "distillation" (token_logits), "sample" (samples_images) or "text
// encoder" (hidden_states); `role` names the model in the message.
void require_capability(const ModelConfig& config, const std::string& use, const std::string& role);
// The architecture and shape in one line for logs (ModelFamily::summary).
inline std::string model_summary(const ModelConfig& config) { return family_of(config).summary(config); }

// A decoder language model's integer arrays (model/decoder_lm.hpp): tokens, targets, document
// starts and positions, B x T each.
inline size_t decoder_lm_id_bytes(int batch, int seq_len) { return 4 * static_cast<size_t>(batch) * seq_len * sizeof(int); }

}  // namespace shardtrain
