// Quantized storage of frozen matrices (docs/quantization.md): NF4 and FP4 exactly as bitsandbytes
// stores them, FP8 e4m3 with a scale per block, and bf16. A tensor is cut into blocks of `block`
// elements of its row-major flattening, the last one partial; each block is one record:
//   codes  block * bits / 8 bytes -- 4-bit codes two per byte, element 2j in the high nibble and
//          2j + 1 in the low one (bitsandbytes' packing), FP8 one byte each, bf16 two (little-endian);
//   scale  one fp32: the block's absmax (NF4, FP4: value = code_value * absmax) or absmax / 448
//          (FP8: value = e4m3(code) * scale); bf16 has none (value = the bf16 number).
// Elements past a partial block's end are encoded as zeros. The arithmetic follows bitsandbytes
// 0.50's quantize_4bit (the default kernel its CPU backend uses): a full block is scaled by
// multiplying with 1 / absmax, a partial one by dividing by absmax clamped to 1e-38 (which is what
// it stores), and a scaled value goes to the bucket between the codes' fp32 midpoints, a value on
// a midpoint to the lower bucket (torch.bucketize). HOST_DEVICE so the CUDA kernels share them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "backend/dtype.hpp"

namespace shardtrain {

enum QuantType { QUANT_NONE, QUANT_NF4, QUANT_FP4, QUANT_FP8, QUANT_BF16 };
constexpr QuantType QUANT_TYPES[] = {QUANT_NONE, QUANT_NF4, QUANT_FP4, QUANT_FP8, QUANT_BF16};

// The format table: name (as fsdp.frozen_dtype and checkpoints spell it), bits per code, and the
// block sizes it takes.
inline const char* quant_type_name(QuantType t) {
  switch (t) {
    case QUANT_NONE: return "fp32";
    case QUANT_NF4: return "nf4";
    case QUANT_FP4: return "fp4";
    case QUANT_FP8: return "fp8";
    case QUANT_BF16: return "bf16";
  }
  return "?";
}
inline bool parse_quant_type(const std::string& name, QuantType* out) {
  for (QuantType t : QUANT_TYPES)
    if (name == quant_type_name(t)) return *out = t, true;
  return false;
}
HOST_DEVICE inline int quant_bits(QuantType t) {
  return t == QUANT_FP8 ? 8 : (t == QUANT_BF16 ? 16 : (t == QUANT_NONE ? 32 : 4));
}
HOST_DEVICE inline bool quant_has_scale(QuantType t) { return t != QUANT_BF16; }
// bitsandbytes' block sizes (powers of two 32..4096); FP8 takes the same.
inline bool quant_block_ok(int block) { return block >= 32 && block <= 4096 && (block & (block - 1)) == 0; }
HOST_DEVICE inline size_t quant_code_bytes(QuantType t, size_t block) { return block * quant_bits(t) / 8; }
// Double quantization (bitsandbytes' compress_statistics, NF4 and FP4 only): a record's absmax is
// one byte, the code of absmax - offset over bitsandbytes' signed dynamic map in groups of
// QUANT_NESTED_BLOCK records of one weight, each group with an fp32 scale (its largest
// |absmax - offset|) and each weight with its offset (the mean of its absmax). The offsets and group
// scales are not in the records: a unit's nested table (NestedScales) holds them.
constexpr size_t QUANT_NESTED_BLOCK = 256;
HOST_DEVICE inline bool quant_nestable(QuantType t) { return t == QUANT_NF4 || t == QUANT_FP4; }
HOST_DEVICE inline size_t quant_record_bytes(QuantType t, size_t block, bool nested = false) {
  return quant_code_bytes(t, block) + (nested ? 1 : (quant_has_scale(t) ? sizeof(float) : 0));
}
// Bytes per element of a quantized tensor (codes and scales): 0.5625 for NF4 in blocks of 64, 2 for
// bf16; nested, 0.515625 plus the nested table's 4 bytes per group (its fixed part, the map and
// 32 bytes per weight, not counted).
inline double quant_bytes_per_element(QuantType t, size_t block, bool nested = false) {
  return static_cast<double>(quant_record_bytes(t, block, nested)) / static_cast<double>(block) +
         (nested ? static_cast<double>(sizeof(float)) / static_cast<double>(block * QUANT_NESTED_BLOCK) : 0.0);
}

// fsdp.frozen_dtype and fsdp.quant_block: the format of the frozen linear weights (QUANT_NONE: fp32
// master shards like every other parameter) and its block size.
struct QuantConfig {
  QuantType type = QUANT_NONE;
  size_t block = 64;
  bool all_linear = false;  // also the layers a family keeps in full precision (FLUX's modulation)
  bool inference = false;   // a model that never trains (a distillation teacher): its linear weights are frozen
  const char* option = "fsdp.frozen_dtype";  // what sets it, for messages
  bool nested = false;  // double quantization of the absmax (fsdp.double_quant; NF4 and FP4)
};

// NF4's 16 values (bitsandbytes' table, as fp32), sorted; FP4's are e2m1's values over 12 in
// bitsandbytes' code order (sign bit 8), unsorted.
HOST_DEVICE inline float quant4_code_value(QuantType t, int code) {
  const uint32_t nf4[16] = {0xbf800000u, 0xbf3239b1u, 0xbf066b30u, 0xbeca32a0u, 0xbe91a24du, 0xbe3d353fu,
                            0xbdba7871u, 0x00000000u, 0x3da2faffu, 0x3e24cae3u, 0x3e7c04ddu, 0x3ead033au,
                            0x3ee1a4b8u, 0x3f1007abu, 0x3f3913b3u, 0x3f800000u};
  const uint32_t fp4[16] = {0x00000000u, 0x3baaaaabu, 0x3f2aaaabu, 0x3f800000u, 0x3eaaaaabu, 0x3f000000u,
                            0x3e2aaaabu, 0x3e800000u, 0x00000000u, 0xbbaaaaabu, 0xbf2aaaabu, 0xbf800000u,
                            0xbeaaaaabu, 0xbf000000u, 0xbe2aaaabu, 0xbe800000u};
  return bits_float(t == QUANT_NF4 ? nf4[code] : fp4[code]);
}

// The code of a scaled value s in [-1, 1]: the number of midpoints below s (torch.bucketize, so a
// value on a midpoint takes the lower bucket), mapped to FP4's code order.
HOST_DEVICE inline int quant4_encode(QuantType t, float s) {
  const uint32_t nf4_bounds[15] = {0xbf591cd8u, 0xbf1c5270u, 0xbeeb8480u, 0xbeadea76u, 0xbe703cecu,
                                   0xbe0d38bcu, 0xbd3a7871u, 0x3d22faffu, 0x3df64862u, 0x3e5067e0u,
                                   0x3e9582d4u, 0x3ec753f9u, 0x3f006d04u, 0x3f248dafu, 0x3f5c89dau};
  const uint32_t fp4_bounds[15] = {0xbf555556u, 0xbf155556u, 0xbed55556u, 0xbe955556u, 0xbe555556u,
                                   0xbdb00000u, 0xbb2aaaabu, 0x00000000u, 0x3b2aaaabu, 0x3db00000u,
                                   0x3e555556u, 0x3e955556u, 0x3ed55556u, 0x3f155556u, 0x3f555556u};
  const int fp4_order[16] = {11, 10, 13, 12, 15, 14, 9, 0, 8, 1, 6, 7, 4, 5, 2, 3};
  const uint32_t* bounds = t == QUANT_NF4 ? nf4_bounds : fp4_bounds;
  int bucket = 0;
  while (bucket < 15 && bits_float(bounds[bucket]) < s) bucket++;
  return t == QUANT_NF4 ? bucket : fp4_order[bucket];
}

// float8 e4m3fn (no infinities, 0x7F NaN, largest 448): round to nearest even, as torch's
// conversion to float8_e4m3fn; |x| must be <= 448.
HOST_DEVICE inline uint8_t float_to_e4m3(float x) {
  const uint32_t u = float_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t abs = u & 0x7FFFFFFFu;
  if (abs < 0x3C800000u) {  // below 2^-6: subnormal, in units of 2^-9 (nearbyint rounds to even)
    const float units = bits_float(abs) * 512.0f;
    float whole = static_cast<float>(static_cast<int>(units));
    const float rest = units - whole;
    if (rest > 0.5f || (rest == 0.5f && static_cast<int>(whole) % 2 == 1)) whole += 1.0f;
    return sign | static_cast<uint8_t>(whole);  // 8 units is the smallest normal, 0x08: the same bits
  }
  const uint32_t rounded = abs + 0x7FFFFu + ((abs >> 20) & 1u);  // mantissa to 3 bits, nearest even
  const uint32_t code = (((rounded >> 23) - 120u) << 3) | ((rounded >> 20) & 7u);  // rebias 127 -> 7
  return sign | static_cast<uint8_t>(code > 0x7Eu ? 0x7Eu : code);
}
HOST_DEVICE inline float e4m3_to_float(uint8_t c) {
  const int exponent = (c >> 3) & 15, mantissa = c & 7;
  const float magnitude = exponent == 0 ? static_cast<float>(mantissa) * 0.001953125f  // m * 2^-9
                                        : bits_float(static_cast<uint32_t>(exponent + 120) << 23 |
                                                     static_cast<uint32_t>(mantissa) << 20);
  return c & 0x80 ? -magnitude : magnitude;
}

// One block: `valid` elements of x (valid <= block; the rest are encoded as zeros) into its record.
HOST_DEVICE inline void quantize_block(QuantType t, const float* x, size_t valid, size_t block, uint8_t* record) {
  float absmax = 0.0f;
  for (size_t i = 0; i < valid; i++) {
    const float a = x[i] < 0.0f ? -x[i] : x[i];
    absmax = a > absmax ? a : absmax;
  }
  const bool full = valid == block;
  if (t == QUANT_BF16) {  // rounded to nearest even, as every fp32 -> bf16 here (backend/dtype.hpp)
    for (size_t i = 0; i < block; i++) {
      const uint16_t h = float_to_bf16(i < valid ? x[i] : 0.0f);
      std::memcpy(record + 2 * i, &h, sizeof h);
    }
    return;
  }
  if (t == QUANT_FP8) {
    const float scale = absmax / 448.0f;
    for (size_t i = 0; i < block; i++) {
      float v = i < valid && scale > 0.0f ? x[i] / scale : 0.0f;
      v = v > 448.0f ? 448.0f : (v < -448.0f ? -448.0f : v);
      record[i] = float_to_e4m3(v);
    }
    std::memcpy(record + block, &scale, sizeof scale);
    return;
  }
  const float clamped = absmax > 1e-38f ? absmax : 1e-38f;
  const float inverse = 1.0f / clamped;
  for (size_t i = 0; i < block; i += 2) {
    int code[2];
    for (int k = 0; k < 2; k++) {
      float s = 0.0f;
      if (i + k < valid) s = full ? x[i + k] * inverse : x[i + k] / clamped;
      s = s > 1.0f ? 1.0f : (s < -1.0f ? -1.0f : s);
      code[k] = quant4_encode(t, s);
    }
    record[i / 2] = static_cast<uint8_t>(code[0] << 4 | code[1]);
  }
  const float stored = full ? absmax : clamped;
  std::memcpy(record + block / 2, &stored, sizeof stored);
}

HOST_DEVICE inline float quant_scale(QuantType t, const uint8_t* record, size_t block) {
  if (!quant_has_scale(t)) return 1.0f;
  float scale;
  std::memcpy(&scale, record + quant_code_bytes(t, block), sizeof scale);
  return scale;
}

// Element i of a block from its record and the block's scale.
HOST_DEVICE inline float dequantize_code(QuantType t, const uint8_t* record, size_t i, float scale) {
  if (t == QUANT_BF16) {
    uint16_t h;
    std::memcpy(&h, record + 2 * i, sizeof h);
    return bf16_to_float(h);
  }
  if (t == QUANT_FP8) return e4m3_to_float(record[i]) * scale;
  const uint8_t pair = record[i / 2];
  return quant4_code_value(t, i % 2 ? pair & 15 : pair >> 4) * scale;
}

// Element i of a block from its record.
HOST_DEVICE inline float dequantize_element(QuantType t, const uint8_t* record, size_t block, size_t i) {
  return dequantize_code(t, record, i, quant_scale(t, record, block));
}

// A rounded product that no compiler fuses into a multiply-add: bitsandbytes rounds the absmax's
// product before adding the offset.
HOST_DEVICE inline float product_rounded(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  const volatile float p = a * b;
  return p;
#endif
}

// One weight of a unit's quantized space under double quantization: its records (unit record
// indices [first_record, first_record + records)), its first group in the table's scales and its
// offset.
struct NestedWeight {
  uint64_t first_record = 0, records = 0, first_group = 0;
  float offset = 0;
  uint32_t unused = 0;
  HOST_DEVICE bool holds(uint64_t record) const { return record - first_record < records; }  // (wraps below)
  HOST_DEVICE uint64_t group_of(uint64_t record) const {
    return first_group + (record - first_record) / QUANT_NESTED_BLOCK;
  }
};
// The groups of a weight of `records` records.
HOST_DEVICE inline uint64_t nested_groups(uint64_t records) {
  return (records + QUANT_NESTED_BLOCK - 1) / QUANT_NESTED_BLOCK;
}

// A unit's nested table as the dequantization reads it (`map` null: the records hold their fp32
// absmax). The table's bytes (nested_table_bytes) are the map's 256 floats, `count` NestedWeights and
// the group scales, replicated on every rank; `first_record` is the unit record index of the
// first record handed to a dequantization (a rank's shard starts past 0).
struct NestedScales {
  const float* map = nullptr;
  const NestedWeight* weights = nullptr;
  const float* group_scale = nullptr;
  size_t count = 0;
  size_t first_record = 0;
};
inline size_t nested_table_bytes(size_t weights, size_t groups) {
  return 256 * sizeof(float) + weights * sizeof(NestedWeight) + groups * sizeof(float);
}
inline NestedScales nested_scales(const uint8_t* table, size_t weights, size_t first_record = 0) {
  NestedScales n;
  n.map = reinterpret_cast<const float*>(table);
  n.weights = reinterpret_cast<const NestedWeight*>(table + 256 * sizeof(float));
  n.group_scale = reinterpret_cast<const float*>(table + 256 * sizeof(float) + weights * sizeof(NestedWeight));
  n.count = weights;
  n.first_record = first_record;
  return n;
}

// The weight record r (counted from n.first_record) belongs to, or null (padding after the weights).
HOST_DEVICE inline const NestedWeight* nested_weight(const NestedScales& n, size_t r) {
  for (size_t w = 0; w < n.count; w++)
    if (n.weights[w].holds(n.first_record + r)) return &n.weights[w];
  return nullptr;
}
// The scale of record r's group (its weight x's).
HOST_DEVICE inline float nested_group_scale(const NestedScales& n, const NestedWeight& x, size_t r) {
  return n.group_scale[x.group_of(n.first_record + r)];
}

// The absmax of record r whose absmax code is `code`, as bitsandbytes dequantizes it: map[code] x
// scale, rounded, plus the offset. 0 for padding after the weights.
HOST_DEVICE inline float nested_absmax(const NestedScales& n, size_t r, uint8_t code) {
  const NestedWeight* x = nested_weight(n, r);
  return x ? product_rounded(n.map[code], nested_group_scale(n, *x, r)) + x->offset : 0.0f;
}

// The scale of record r: its fp32 absmax or scale, or (nested) its decoded absmax.
HOST_DEVICE inline float record_scale(QuantType t, const uint8_t* record, size_t block, const NestedScales& n,
                                      size_t r) {
  return n.map ? nested_absmax(n, r, record[quant_code_bytes(t, block)]) : quant_scale(t, record, block);
}

// bitsandbytes' signed 8-bit dynamic map (functional.create_dynamic_map()), 256 values ascending.
const float* quant_dynamic_map();
// The code of an absmax in a group of `scale` around `offset`: the nearest map value of
// (absmax - offset) / scale clamped to [-1, 1] (the first of two as near; 0 for a scale of 0).
uint8_t nested_code(float absmax, float offset, float scale);
// The code among the nearest to `target` and its two neighbours that decodes to it exactly, or -1.
int nested_code_decoding_to(float target, float offset, float scale);
// nested_code, except that a code which decodes to `absmax` exactly is taken: an absmax that came
// from a code (a file's) gets that code's value back, however its producer searched.
uint8_t nested_code_of_decoded(float absmax, float offset, float scale);
// Double quantization of one weight's n absmax: returns the offset (their mean, summed in double
// and rounded once) and writes the scale of each group of QUANT_NESTED_BLOCK into `scales`.
float nested_scales_of(const float* absmax, size_t n, float* scales);
// Writes a nested table (nested_table_bytes(weights.size(), scales.size()) bytes at `table`): the
// map, the weights, the group scales.
void write_nested_table(uint8_t* table, const std::vector<NestedWeight>& weights, const std::vector<float>& scales);
// The nested table of a lone weight of `records` records from its offset and group scales as files
// store them (offset first): nested_scales(table.data(), 1) reads it.
std::vector<uint8_t> lone_weight_nested_table(const std::vector<float>& offset_and_scales, uint64_t records);

}  // namespace shardtrain
