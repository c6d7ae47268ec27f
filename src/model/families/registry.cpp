// The registry of model families (model/family.hpp): adding a family is its folder and one line here.
#include "backend/gpu_memory.hpp"
#include "core/error.hpp"
#include "model/param_table.hpp"
#include "model/families/flux/flux_family.hpp"
#include "model/families/gpt2/gpt2_family.hpp"
#include "model/families/llama/llama_family.hpp"
#include "model/families/phi3/phi3_family.hpp"
#include "model/families/qwen2/qwen2_family.hpp"
#include "model/families/qwen3/qwen3_family.hpp"
#include "model/families/smollm3/smollm3_family.hpp"
#include "model/family.hpp"

namespace shardtrain {

namespace {

std::vector<const ModelFamily*>& registry() {
  static std::vector<const ModelFamily*> families = {
      &gpt2_family(),
      &llama_family(),
      &qwen2_family(),
      &qwen3_family(),
      &smollm3_family(),
      &phi3_family(),
      &flux_family(),
      &flux2_family(),
  };
  return families;
}

}  // namespace

const std::vector<const ModelFamily*>& model_families() { return registry(); }

void register_model_family(const ModelFamily& family) {
  SHARD_CHECK(!find_model_family(family.name()), "model family '%s' registered twice", family.name());
  registry().push_back(&family);
}

const ModelFamily* find_model_family(const std::string& name) {
  for (const ModelFamily* f : model_families())
    if (name == f->name()) return f;
  return nullptr;
}

std::string model_family_names() {
  std::string names;
  for (const ModelFamily* f : model_families()) names += (names.empty() ? "" : ", ") + std::string(f->name());
  return names;
}

const ModelFamily& family_of(const ModelConfig& config) {
  const ModelFamily* f = find_model_family(config.arch);
  SHARD_CHECK(f, "model.arch '%s' is no registered family (%s)", config.arch.c_str(), model_family_names().c_str());
  return *f;
}

std::vector<ModelFamily::KernelWorkspace> ModelFamily::kernel_workspaces(const ModelConfig& c, int B, int T) const {
  const int N = product_rows(c, B, T);
  return {{gpu::encoder_backward_workspace_estimate(B, T), "encoder backward"},
          {gpu::attention_backward_workspace_bytes(B, T, c.n_head, c.kv_heads(), c.head_size()), "attention backward"},
          norm_kind() == NORM_RMS
              ? KernelWorkspace{gpu::rmsnorm_backward_workspace_bytes(N, c.n_embd), "rmsnorm backward"}
              : KernelWorkspace{gpu::layernorm_backward_workspace_bytes(N, c.n_embd), "layernorm backward"}};
}

// Called only for a family whose reads_single_file accepted the file.
ModelConfig ModelFamily::read_single_file_config(const TensorShapes&, const std::string& path) const {
  fatal_internal(__FILE__, __LINE__, __func__, strprintf("family %s reads no single file ('%s')", name(), path.c_str()));
}
HfTensor ModelFamily::single_file_tensor(const ModelConfig&, const ParamInfo& param) const {
  fatal_internal(__FILE__, __LINE__, __func__,
                 strprintf("family %s reads no single file (parameter %s)", name(), param.name.c_str()));
}

void require_capability(const ModelConfig& config, const std::string& use, const std::string& role) {
  const bool generate = use == "generate", sample = use == "sample", encoder = use == "text encoder";
  SHARD_CHECK(generate || sample || encoder || use == "distillation", "unknown use '%s'", use.c_str());
  const auto has = [&](const ModelFamily* f) {
    return generate ? f->kv_decoding() : sample ? f->samples_images() : encoder ? f->hidden_states() : f->token_logits();
  };
  if (has(&family_of(config))) return;
  std::string able;
  for (const ModelFamily* f : model_families())
    if (has(f)) able += (able.empty() ? "" : ", ") + std::string(f->name());
  throw UsageError(role + " is a '" + config.arch + "' model, which " +
                   (generate ? "has no key/value-cache decoding: generate draws text from language models ("
                    : sample ? "predicts no image: sample draws images from diffusion transformers ("
                    : encoder ? "gives no hidden states of text: a text encoder is a language model ("
                             : "has no vocabulary head: distillation compares the token distributions of language "
                               "models (") +
                   able + ")");
}

}  // namespace shardtrain
