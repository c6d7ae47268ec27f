// "1 rank", "2 ranks": counts in messages read as English whatever the number.
#pragma once

#include <string>

namespace shardtrain {

// `n` and the noun, plural unless n is 1; `plural` for irregular nouns (default: singular + "s").
inline std::string counted(long long n, const std::string& singular, const std::string& plural = "") {
  return std::to_string(n) + " " + (n == 1 ? singular : plural.empty() ? singular + "s" : plural);
}

}  // namespace shardtrain
