// See rope_scaling.hpp.
#include "model/rope_scaling.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "core/error.hpp"

namespace shardtrain {
namespace {

const std::vector<std::string> FACTOR_SETTINGS = {"factor"};  // linear, dynamic
const std::vector<std::string> LLAMA3_SETTINGS = {"factor", "low_freq_factor", "high_freq_factor",
                                                  "original_max_position_embeddings"};
const std::vector<std::string> YARN_SETTINGS = {"factor",    "original_max_position_embeddings", "attention_factor",
                                                "beta_fast", "beta_slow",                        "truncate"};

double* setting_field(RopeScaling& s, const std::string& name) {
  const std::pair<const char*, double*> fields[] = {
      {"factor", &s.factor},
      {"low_freq_factor", &s.low_freq_factor},
      {"high_freq_factor", &s.high_freq_factor},
      {"original_max_position_embeddings", &s.original_max_position_embeddings},
      {"attention_factor", &s.attention_factor},
      {"beta_fast", &s.beta_fast},
      {"beta_slow", &s.beta_slow},
      {"truncate", &s.truncate}};
  for (const auto& [key, field] : fields)
    if (name == key) return field;
  return nullptr;
}

// transformers' get_mscale: YaRN's attention factor for a context stretched by `scale`.
double yarn_mscale(double scale, double mscale) { return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0; }

}  // namespace

const std::vector<std::string>* RopeScaling::settings_of(const std::string& type) {
  return type == "linear" || type == "dynamic" ? &FACTOR_SETTINGS
         : type == "llama3"                     ? &LLAMA3_SETTINGS
         : type == "yarn"                       ? &YARN_SETTINGS
                                                : nullptr;
}

bool RopeScaling::reads(const std::string& type, const std::string& key) {
  const std::vector<std::string>* names = settings_of(type);
  return (names && std::find(names->begin(), names->end(), key) != names->end()) ||
         (type == "yarn" && (key == "mscale" || key == "mscale_all_dim"));
}

std::string RopeScaling::type_name() const {
  const char* names[] = {"", "linear", "dynamic", "llama3", "yarn"};  // by Type
  return names[type];
}

std::vector<std::pair<std::string, double>> RopeScaling::settings() const {
  std::vector<std::pair<std::string, double>> list;
  const std::vector<std::string>* names = settings_of(type_name());
  RopeScaling copy = *this;
  for (size_t k = 0; names && k < names->size(); k++) list.emplace_back((*names)[k], *setting_field(copy, (*names)[k]));
  return list;
}

bool RopeScaling::from_settings(const std::string& type, const std::map<std::string, double>& given, RopeScaling* out,
                                std::string* error) {
  RopeScaling s;
  const std::vector<std::string>* names = settings_of(type);
  if (!names) return *error = "unknown type '" + type + "'", false;
  s.type = type == "linear" ? LINEAR : type == "dynamic" ? DYNAMIC : type == "llama3" ? LLAMA3 : YARN;
  auto value = [&](const std::string& key, double fallback) {
    const auto it = given.find(key);
    return it == given.end() ? fallback : it->second;
  };
  for (const auto& [key, v] : given) {
    if (!reads(type, key)) return *error = "'" + key + "' is not a setting of " + type, false;
    // Bounded so that every value and its fp32 rounding stay normal, finite and nonzero.
    if (key == "truncate" ? v != 0 && v != 1 : !(v >= 1e-30 && v <= 1e30))
      return *error = key + "='" + strprintf("%g", v) +
                      (key == "truncate" ? "' is not 0 or 1 (false or true)" : "' is not a number in [1e-30, 1e30]"),
             false;
  }
  const bool yarn = s.type == YARN;
  for (const std::string& name : *names) {
    const bool optional = yarn && name != "factor" && name != "original_max_position_embeddings";
    if (!given.count(name) && !optional) return *error = "rope_type " + type + " needs '" + name + "'", false;
  }
  for (const std::string& name : *names) *setting_field(s, name) = value(name, *setting_field(s, name));
  if (yarn && !given.count("attention_factor")) {
    // transformers: the mscale ratio when both are given (and nonzero), else from factor alone.
    const double mscale = value("mscale", 0), all_dim = value("mscale_all_dim", 0);
    s.attention_factor = mscale != 0 && all_dim != 0 ? yarn_mscale(s.factor, mscale) / yarn_mscale(s.factor, all_dim)
                                                     : yarn_mscale(s.factor, 1);
  }
  if (s.type == LLAMA3 && s.high_freq_factor <= s.low_freq_factor)
    return *error = "high_freq_factor must be greater than low_freq_factor", false;
  const double n = s.original_max_position_embeddings;
  if ((s.type == LLAMA3 || s.type == YARN) && (n != std::floor(n) || n > (1 << 24)))
    return *error = "original_max_position_embeddings must be a whole number <= 2^24", false;
  *out = s;
  return true;
}

bool RopeScaling::parse(const std::string& text, RopeScaling* out, std::string* error) {
  auto fail = [&](const std::string& why) {
    *error = "model.rope_scaling='" + text + "': " + why +
             " (the forms: empty for none, 'linear:factor=F', 'dynamic:factor=F', "
             "'llama3:factor=F,low_freq_factor=A,high_freq_factor=B,"
             "original_max_position_embeddings=N', 'yarn:factor=F,original_max_position_embeddings=N' with optional "
             "attention_factor, beta_fast, beta_slow, truncate)";
    return false;
  };
  if (text.empty()) return *out = RopeScaling(), true;
  const size_t colon = text.find(':');
  const std::string type = text.substr(0, colon);
  const std::vector<std::string>* keys = settings_of(type);
  if (!keys) return fail("unknown type '" + type + "'");
  std::map<std::string, double> given;
  size_t at = colon == std::string::npos ? text.size() : colon + 1;
  while (at < text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, comma - at);
    at = comma + 1;
    const size_t eq = item.find('=');
    const std::string key = item.substr(0, eq);
    if (std::find(keys->begin(), keys->end(), key) == keys->end())
      return fail("'" + key + "' is not a setting of " + type);
    if (given.count(key)) return fail("'" + key + "' is given twice");
    const std::string value = eq == std::string::npos ? "" : item.substr(eq + 1);
    char* end = nullptr;
    const double v = std::strtod(value.c_str(), &end);
    if (value.empty() || *end != '\0' || !std::isfinite(v))
      return fail(key + "='" + value + "' is not a number");
    given[key] = v;
  }
  std::string defect;
  if (!from_settings(type, given, out, &defect)) return fail(defect);
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
  // yarn: the dimensions (of head_size) that turn beta_fast and beta_slow times over the original
  // context, in double as transformers' find_correction_range, then its ramp over the pairs in fp32.
  const double d = head_size;
  auto correction_dim = [&](double turns) {
    return d * std::log(s.original_max_position_embeddings / (turns * 2 * M_PI)) / (2 * std::log(theta));
  };
  double ramp_low = correction_dim(s.beta_fast), ramp_high = correction_dim(s.beta_slow);
  if (s.truncate != 0) ramp_low = std::floor(ramp_low), ramp_high = std::ceil(ramp_high);
  ramp_low = std::max(ramp_low, 0.0), ramp_high = std::min(ramp_high, d - 1);
  if (ramp_low == ramp_high) ramp_high += 0.001;  // as transformers, against a division by zero
  for (size_t i = 0; i < inv.size(); i++) {
    // 1 / theta^(2i / d): the exponent in fp32, the power correctly rounded to fp32 (torch's pow of
    // an fp32 base is, but for an element in rare shapes: one unit in the last place), its reciprocal.
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(head_size);
    const float power = static_cast<float>(std::pow(static_cast<double>(static_cast<float>(theta)), exponent));
    float f = 1.0f / power;
    if (s.type == RopeScaling::LINEAR) f = f / factor;
    if (s.type == RopeScaling::YARN) {
      const float interpolated = 1.0f / (factor * power);
      const float ramp = std::clamp((static_cast<float>(i) - static_cast<float>(ramp_low)) /
                                        static_cast<float>(ramp_high - ramp_low),
                                    0.0f, 1.0f);
      const float kept = 1.0f - ramp;  // transformers' inv_freq_extrapolation_factor
      const volatile float scaled_part = interpolated * (1.0f - kept);
      const volatile float kept_part = f * kept;
      f = scaled_part + kept_part;
    }
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
