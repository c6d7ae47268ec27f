// A JSON file read whole (Hugging Face's config.json, PEFT's adapter_config.json).
#pragma once

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "core/error.hpp"

namespace shardtrain {

// Throws CheckpointError "<what> '<path>': cannot open" or "...: malformed JSON: ...".
inline nlohmann::json read_json(const std::string& path, const std::string& what) {
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

}  // namespace shardtrain
