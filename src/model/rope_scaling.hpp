// Scaled rotary embeddings (model.rope_scaling; Hugging Face's rope_scaling / rope_parameters):
// the rotary frequencies of a decoder stretched for contexts longer than it was pretrained on.
//   linear  every inverse frequency divided by factor (position interpolation);
//   llama3  Llama 3.1's rule: frequencies whose wavelength is below
//           original_max_position_embeddings / high_freq_factor stay, those above
//           original_max_position_embeddings / low_freq_factor are divided by factor, and the ones
//           between move smoothly from one to the other.
//   dynamic dynamic NTK: transformers raises theta only for a sequence longer than
//           max_position_embeddings, which ShardTrain's never are (model.max_seq_len is that), so
//           the frequencies are the plain ones; kept so that an export says what the folder said.
//   yarn    YaRN (Qwen's long-context setting): dimensions that turn more than beta_fast times
//           over original_max_position_embeddings positions keep their frequency, those turning
//           fewer than beta_slow times are divided by factor, a linear ramp between; cos and sin
//           are multiplied by attention_factor (by default 0.1 ln(factor) + 1, or the ratio that
//           config.json's mscale and mscale_all_dim give). truncate (1, transformers' default)
//           rounds the ramp's ends to whole dimensions.
// The text form, as model.rope_scaling and checkpoints hold it: "" (none), "linear:factor=F",
// "dynamic:factor=F",
// "llama3:factor=F,low_freq_factor=A,high_freq_factor=B,original_max_position_embeddings=N" or
// "yarn:factor=F,original_max_position_embeddings=N,attention_factor=M,beta_fast=32,beta_slow=1,
// truncate=1" (yarn's last four optional, taking those defaults).
// The arithmetic is transformers' (modeling_rope_utils), operation for operation in fp32: the
// same bits as its inv_freq (tests/unit/test_rope_scaling.cpp), up to torch's pow, which is not
// correctly rounded for every exponent (one unit in the last place, rarely).
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace shardtrain {

struct RopeScaling {
  enum Type { NONE, LINEAR, DYNAMIC, LLAMA3, YARN } type = NONE;
  double factor = 1.0;
  double low_freq_factor = 1.0, high_freq_factor = 4.0;  // llama3
  double original_max_position_embeddings = 8192;        // llama3, yarn (an integer)
  double attention_factor = 1.0, beta_fast = 32, beta_slow = 1, truncate = 1;  // yarn (truncate 0 or 1)

  // Parses the text form; on a defect returns false with *error naming it and the fix.
  static bool parse(const std::string& text, RopeScaling* out, std::string* error);
  // A scaling of a type from its settings by name (config.json's keys: yarn also takes mscale and
  // mscale_all_dim, which give its attention_factor), the optional ones taking their defaults; on a
  // defect returns false with *error naming it.
  static bool from_settings(const std::string& type, const std::map<std::string, double>& given, RopeScaling* out,
                            std::string* error);
  // Whether config.json's rope dict may hold this key for the type (its settings, and yarn's mscale,
  // mscale_all_dim).
  static bool reads(const std::string& type, const std::string& key);
  // What cos and sin are multiplied by: yarn's attention_factor, else 1.
  double attention_scaling() const { return type == YARN ? attention_factor : 1.0; }
  // The text form, exact (every number as %.17g) -- parse(text()) gives back the same settings.
  std::string text() const;
  // The settings a type takes, in the text form's order (linear, dynamic: factor; llama3: four; yarn: six),
  // or null for a type this build does not know.
  static const std::vector<std::string>* settings_of(const std::string& type);
  // This scaling's type as the text form and Hugging Face name it ("" for none), and its settings
  // with their values, in settings_of's order.
  std::string type_name() const;
  std::vector<std::pair<std::string, double>> settings() const;
};

// The inverse frequencies of a head of `head_size` dimensions, head_size / 2 of them:
// 1 / theta^(2i / head_size) in fp32, then scaled, as transformers computes its inv_freq.
std::vector<float> rope_inverse_frequencies(int head_size, double theta, const RopeScaling& scaling);

}  // namespace shardtrain
