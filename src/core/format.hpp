// Text formatting shared by every layer.
#pragma once

#include <string>

namespace shardtrain {

// A byte count for people: "512 B", "1.5 KiB", "3.2 GiB" (binary units, one decimal above bytes).
std::string human_bytes(double bytes);

}  // namespace shardtrain
