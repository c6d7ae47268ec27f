// The model's shape: the five numbers that fix every parameter's shape (docs/architecture.md).
#pragma once

namespace shardtrain {

struct ModelConfig {
  int n_layer = 2;
  int n_embd = 32;
  int n_head = 4;
  int vocab_size = 256;
  int max_seq_len = 64;  // rows of the position table
};

}  // namespace shardtrain
