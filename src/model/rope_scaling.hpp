// Scaled rotary embeddings (model.rope_scaling; Hugging Face's rope_scaling / rope_parameters):
// the rotary frequencies of a decoder stretched for contexts longer than it was pretrained on.
//   linear  every inverse frequency divided by factor (position interpolation);
//   llama3  Llama 3.1's rule: frequencies whose wavelength is below
//           original_max_position_embeddings / high_freq_factor stay, those above
//           original_max_position_embeddings / low_freq_factor are divided by factor, and the ones
//           between move smoothly from one to the other.
// The text form, as model.rope_scaling and checkpoints hold it: "" (none), "linear:factor=F" or
// "llama3:factor=F,low_freq_factor=A,high_freq_factor=B,original_max_position_embeddings=N".
// The arithmetic is transformers' (modeling_rope_utils), operation for operation in fp32: the
// same bits as its inv_freq (tests/unit/test_rope_scaling.cpp), up to torch's pow, which is not
// correctly rounded for every exponent (one unit in the last place, rarely).
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace shardtrain {

struct RopeScaling {
  enum Type { NONE, LINEAR, LLAMA3 } type = NONE;
  double factor = 1.0;
  double low_freq_factor = 1.0, high_freq_factor = 4.0;  // llama3
  double original_max_position_embeddings = 8192;        // llama3 (an integer)

  // Parses the text form; on a defect returns false with *error naming it and the fix.
  static bool parse(const std::string& text, RopeScaling* out, std::string* error);
  // The text form, exact (every number as %.17g) -- parse(text()) gives back the same settings.
  std::string text() const;
  // The settings a type takes, in the text form's order (linear: factor; llama3: four), or null for
  // a type this build does not know.
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
