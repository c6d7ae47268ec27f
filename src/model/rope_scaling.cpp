// See rope_scaling.hpp.
#include "model/rope_scaling.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "core/error.hpp"

namespace shardtrain {
namespace {

const std::vector<std::string> LINEAR_SETTINGS = {"factor"};
const std::vector<std::string> LLAMA3_SETTINGS = {"factor", "low_freq_factor", "high_freq_factor",
                                                  "original_max_position_embeddings"};

// Setting k of either type (linear's one setting is llama3's first).
double* setting_field(RopeScaling& s, size_t k) {
  double* fields[] = {&s.factor, &s.low_freq_factor, &s.high_freq_factor, &s.original_max_position_embeddings};
  return fields[k];
}

}  // namespace

const std::vector<std::string>* RopeScaling::settings_of(const std::string& type) {
  return type == "linear" ? &LINEAR_SETTINGS : type == "llama3" ? &LLAMA3_SETTINGS : nullptr;
}

std::string RopeScaling::type_name() const { return type == LINEAR ? "linear" : type == LLAMA3 ? "llama3" : ""; }

std::vector<std::pair<std::string, double>> RopeScaling::settings() const {
  std::vector<std::pair<std::string, double>> list;
  const std::vector<std::string>* names = settings_of(type_name());
  RopeScaling copy = *this;
  for (size_t k = 0; names && k < names->size(); k++) list.emplace_back((*names)[k], *setting_field(copy, k));
  return list;
}

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
  const std::vector<std::string>* keys = settings_of(type);
  if (!keys) return fail("unknown type '" + type + "'");
  s.type = type == "linear" ? LINEAR : LLAMA3;
  std::vector<bool> seen(keys->size());
  size_t at = colon == std::string::npos ? text.size() : colon + 1;
  while (at < text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, comma - at);
    at = comma + 1;
    const size_t eq = item.find('=');
    const std::string key = item.substr(0, eq);
    const size_t k = std::find(keys->begin(), keys->end(), key) - keys->begin();
    if (k == keys->size()) return fail("'" + key + "' is not a setting of " + type);
    if (seen[k]) return fail("'" + key + "' is given twice");
    const std::string value = eq == std::string::npos ? "" : item.substr(eq + 1);
    char* end = nullptr;
    const double v = std::strtod(value.c_str(), &end);
    // Bounded so that every value and its fp32 rounding stay normal, finite and nonzero.
    if (value.empty() || *end != '\0' || !(v >= 1e-30 && v <= 1e30))
      return fail(key + "='" + value + "' is not a number in [1e-30, 1e30]");
    *setting_field(s, k) = v, seen[k] = true;
  }
  for (size_t k = 0; k < keys->size(); k++)
    if (!seen[k]) return fail(type + " needs " + (*keys)[k]);
  if (s.type == LLAMA3) {
    if (s.high_freq_factor <= s.low_freq_factor) return fail("high_freq_factor must be greater than low_freq_factor");
    const double n = s.original_max_position_embeddings;
    if (n != std::floor(n) || n > (1 << 24)) return fail("original_max_position_embeddings must be a whole number <= 2^24");
  }
  *out = s;
  return true;
}

std::string RopeScaling::text() const {
  std::string t = type_name();
  const char* separator = ":";
  for (const auto& [name, value] : settings()) t += separator + name + "=" + strprintf("%.17g", value), separator = ",";
  return t;
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
