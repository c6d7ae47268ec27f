// A weight a Hugging Face folder holds quantized by bitsandbytes (a Linear4bit's, as transformers'
// save_pretrained writes it under quantization_config load_in_4bit):
//   <name>                                  U8, the packed 4-bit codes (two per byte, the first in the high nibble)
//   <name>.absmax                           F32 per block, or with double quantization U8 codes of
//                                           absmax - offset, decoded by
//   <name>.nested_absmax, .nested_quant_map F32 per block of nested_blocksize absmax, and the 256 values
//   <name>.quant_map                        F32[16], the 4-bit codes' values
//   <name>.quant_state.bitsandbytes__<type> U8, JSON: quant_type, blocksize, dtype, shape, and with
//                                           double quantization nested_blocksize and nested_offset
// read as bitsandbytes' dequantize_4bit computes it in float32: quant_map[code] x absmax, the
// absmax itself nested_quant_map[q] x nested_absmax + offset. Every part is checked against the
// others and the shape the model needs before anything is read.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "ckpt/safetensors.hpp"

namespace shardtrain {

struct SafetensorsPart {
  const SafetensorsReader* reader = nullptr;
  const SafetensorsTensor* tensor = nullptr;
};

class Bnb4bitTensor {
 public:
  // The tensor of a key (the folder's name less the base model's prefix), or {} when absent.
  using Lookup = std::function<SafetensorsPart(const std::string& key)>;
  // Whether `key` is stored this way (its quant_state is there).
  static bool present(const Lookup& find, const std::string& key);
  // Throws CheckpointError naming the tensor and the defect.
  Bnb4bitTensor(const Lookup& find, const std::string& key, const std::vector<int64_t>& shape);
  // Elements [first, first + count) of the row-major flattening, dequantized.
  void read(uint64_t first, uint64_t count, float* out) const;
  // The keys of the tensors it consists of.
  const std::vector<std::string>& keys() const { return keys_; }
  const std::string& quant_type() const { return quant_type_; }
  int64_t blocksize() const { return blocksize_; }

 private:
  SafetensorsPart packed_, absmax_, nested_absmax_;
  std::vector<float> quant_map_, nested_map_;
  std::string quant_type_;
  int64_t blocksize_ = 0, nested_blocksize_ = 0;
  float offset_ = 0;
  bool nested_ = false;
  std::vector<std::string> keys_;
};

}  // namespace shardtrain
