// `shardtrain inspect FILE`: what a checkpoint holds -- format, step, the data files it trained on
// (names and sizes, what a resume compares), the saved configuration and
// every parameter with its shape, size and norms -- read one tensor at a time, without building
// the model. A file that training would refuse (CheckpointReader's validation) is an error.
#pragma once

#include <string>

namespace shardtrain {

void inspect_checkpoint(const std::string& path);

}  // namespace shardtrain
