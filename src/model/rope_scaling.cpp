// See rope_scaling.hpp.
#include "model/rope_scaling.hpp"

#include <cmath>
#include <cstdlib>

#include "core/error.hpp"

namespace shardtrain {
namespace {

const char* const LLAMA3_KEYS[] = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"};

double* llama3_field(RopeScaling& s, int k) {
  double* fields[] = {&s.factor, &s.low_freq_factor, &s.high_freq_factor, &s.original_max_position_embeddings};
  return fields[k];
}

}  // namespace

bool RopeScaling::parse(const std::string& text, RopeScaling* out, std::string* error) {
  RopeScaling s;
  auto fail = [&](const std::string& why) {
    *error = "model.rope_scaling='" + text + "': " + why +
             " (the forms: empty for none, 'linear:factor=F', 'llama3:factor=F,low_freq_factor=A,high_freq_factor=B,"
             "original_max_position_embeddings=N')";
    return false;
  };
  if (text.empty()) return *out = s, true;
  const size_t colon = text.find(':');
  const std::string type = text.substr(0, colon);
  if (type == "linear")
    s.type = LINEAR;
  else if (type == "llama3")
    s.type = LLAMA3;
  else
    return fail("unknown type '" + type + "'");
  const int keys = s.type == LINEAR ? 1 : 4;
  bool seen[4] = {false, false, false, false};
  size_t at = colon == std::string::npos ? text.size() : colon + 1;
  while (at < text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, comma - at);
    at = comma + 1;
    const size_t eq = item.find('=');
    const std::string key = item.substr(0, eq);
    int k = 0;
    while (k < keys && key != LLAMA3_KEYS[k]) k++;
    if (k == keys) return fail("'" + key + "' is not a setting of " + type);
    if (seen[k]) return fail("'" + key + "' is given twice");
    const std::string value = eq == std::string::npos ? "" : item.substr(eq + 1);
    char* end = nullptr;
    const double v = std::strtod(value.c_str(), &end);
    // Bounded so that every value and its fp32 rounding stay normal, finite and nonzero.
    if (value.empty() || *end != '\0' || !(v >= 1e-30 && v <= 1e30))
      return fail(key + "='" + value + "' is not a number in [1e-30, 1e30]");
    *llama3_field(s, k) = v, seen[k] = true;
  }
  for (int k = 0; k < keys; k++)
    if (!seen[k]) return fail(type + " needs " + LLAMA3_KEYS[k]);
  if (s.type == LLAMA3) {
    if (s.high_freq_factor <= s.low_freq_factor) return fail("high_freq_factor must be greater than low_freq_factor");
    const double n = s.original_max_position_embeddings;
    if (n != std::floor(n) || n > (1 << 24)) return fail("original_max_position_embeddings must be a whole number <= 2^24");
  }
  *out = s;
  return true;
}

std::string RopeScaling::text() const {
  if (type == NONE) return "";
  if (type == LINEAR) return strprintf("linear:factor=%.17g", factor);
  return strprintf("llama3:factor=%.17g,low_freq_factor=%.17g,high_freq_factor=%.17g,original_max_position_embeddings=%.17g",
                   factor, low_freq_factor, high_freq_factor, original_max_position_embeddings);
}

std::vector<float> rope_inverse_frequencies(int head_size, double theta, const RopeScaling& s) {
  std::vector<float> inv(head_size / 2);
  // transformers computes each step below in fp32, the Python numbers rounded to fp32 first; torch
  // divides a number by a tensor as the tensor's reciprocal times the number. Products that GCC would
  // fuse with the sum or difference after them into one multiply-add are rounded on their own (volatile).
  const float factor = static_cast<float>(s.factor);
  const float old_len = static_cast<float>(s.original_max_position_embeddings);
  const float low_wavelen = static_cast<float>(s.original_max_position_embeddings / s.low_freq_factor);
  const float high_wavelen = static_cast<float>(s.original_max_position_embeddings / s.high_freq_factor);
  const float low = static_cast<float>(s.low_freq_factor);
  const float span = static_cast<float>(s.high_freq_factor - s.low_freq_factor);
  for (size_t i = 0; i < inv.size(); i++) {
    // 1 / theta^(2i / d): the exponent in fp32, the power correctly rounded to fp32 (torch's pow of
    // an fp32 base is, but for an element in rare shapes: one unit in the last place), its reciprocal.
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(head_size);
    float f = 1.0f / static_cast<float>(std::pow(static_cast<double>(static_cast<float>(theta)), exponent));
    if (s.type == RopeScaling::LINEAR) f = f / factor;
    if (s.type == RopeScaling::LLAMA3) {
      const float wavelen = (1.0f / f) * static_cast<float>(2.0 * M_PI);
      const float kept = wavelen > low_wavelen ? f / factor : f;
      const volatile float periods = (1.0f / wavelen) * old_len;
      const float smooth = (periods - low) / span;
      const volatile float smooth_kept = smooth * kept;
      const float smoothed = (1.0f - smooth) * kept / factor + smooth_kept;
      f = !(wavelen < high_wavelen) && !(wavelen > low_wavelen) ? smoothed : kept;
    }
    inv[i] = f;
  }
  return inv;
}

}  // namespace shardtrain
