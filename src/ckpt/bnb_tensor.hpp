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
// others and the shape the model needs before anything is read. Bnb4bitWeight makes those parts
// (`shardtrain export --quantize`).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "backend/quant.hpp"
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
  // Under double quantization in bitsandbytes' own layout (nested blocks of 256 over its dynamic map,
  // the quant_map the type's), the offset and the nested absmax as a run's nested table takes them
  // (HostShard::upload); else empty.
  std::vector<float> nested_table() const;

 private:
  SafetensorsPart packed_, absmax_, nested_absmax_;
  std::vector<float> quant_map_, nested_map_;
  std::string quant_type_;
  int64_t blocksize_ = 0, nested_blocksize_ = 0;
  float offset_ = 0;
  bool nested_ = false;
  std::vector<std::string> keys_;
};

// One weight quantized as bitsandbytes' quantize_4bit stores it (the tensors above), made from its
// fp32 values: the codes and absmax of backend/quant.hpp's blocks, which are bitsandbytes' bit for
// bit. With double quantization (compress_statistics) the absmax are stored as 8-bit codes of
// absmax - offset in blocks of 256 over bitsandbytes' signed dynamic map (nested_quant_map): the
// offset is their mean rounded once to fp32 (torch's fp32 reduction can differ in the last bit),
// and each code is the nearest value of the map (the first of two as near). bitsandbytes' CPU
// kernel searches the map inexactly and sometimes takes the one below: such a file still
// dequantizes as written, in bitsandbytes as here (docs/quantization.md).
struct Bnb4bitWeight {
  // `nested_given` (double quantization): the offset and group scales to code the absmax under, as
  // a double-quantized checkpoint holds them -- its values then come back exactly; empty: computed.
  Bnb4bitWeight(const float* values, const std::vector<int64_t>& shape, QuantType type, size_t block,
                bool double_quant, const std::vector<float>& nested_given = {});
  QuantType type;
  size_t block;
  std::vector<int64_t> shape;
  std::vector<uint8_t> packed;        // (numel + 1) / 2 bytes
  std::vector<float> absmax;          // per block (without double quantization)
  std::vector<uint8_t> absmax_codes;  // per block (with it), and:
  std::vector<float> nested_absmax;   // per block of QUANT_NESTED_BLOCK absmax
  float offset = 0;
  bool double_quant() const { return !absmax_codes.empty(); }
  // The quant_state's JSON as bitsandbytes packs it -- `dtype` the weights' torch dtype
  // ("float32", "bfloat16", "float16") -- padded with blanks to quant_state_bytes() (which JSON
  // allows), so that a file's layout is known before any weight is quantized.
  std::string quant_state(const char* dtype) const;
  static size_t quant_state_bytes(const std::vector<int64_t>& shape, bool double_quant);
};

// The JSON key of a weight's quant_state tensor: "<weight>.quant_state.bitsandbytes__nf4".
std::string bnb_quant_state_suffix(QuantType type);

}  // namespace shardtrain
