// A Hugging Face config.json read for a model family (model/family.hpp): each value checked for
// its type, failures as CheckpointError naming the file and the key.
#pragma once

#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "ckpt/json_file.hpp"
#include "core/error.hpp"

namespace shardtrain {

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

}  // namespace shardtrain
