// The quantized formats (backend/quant.hpp) against bitsandbytes' and torch's own results:
// tests/fixtures/bnb/quant.safetensors holds bitsandbytes 0.50's quantize_4bit and dequantize_4bit
// of awkward tensors for every block size (written by make_fixture.py beside it) and torch's
// float8_e4m3fn rounding of every kind of value, so equality here is bit-equality with them.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "backend/layer_ops.hpp"
#include "backend/quant.hpp"
#include "ckpt/bnb_tensor.hpp"
#include "ckpt/safetensors.hpp"

namespace shardtrain {
namespace {

const char* FIXTURE = "tests/fixtures/bnb/quant.safetensors";

template <typename T>
std::vector<T> read(const SafetensorsReader& file, const std::string& name, const std::string& dtype) {
  const SafetensorsTensor* t = file.find(name);
  if (!t) throw std::runtime_error("fixture lacks " + name);
  std::vector<T> out(t->numel);
  file.read_raw(*t, dtype, 0, t->numel, out.data());
  return out;
}

TEST(Quant, FourBitCodesAndScalesAreBitsandbytesOwn) {
  SafetensorsReader file(FIXTURE);
  int cases = 0;
  for (QuantType type : {QUANT_NF4, QUANT_FP4})
    for (size_t block = 32; block <= 4096; block *= 2)
      for (const char* label : {"odd", "tiny", "ties"}) {
        const std::string key = std::string(quant_type_name(type)) + "." + std::to_string(block) + "." + label;
        const std::vector<float> x = read<float>(file, key + ".input", "F32");
        // bitsandbytes' tensor layout (codes of the whole flattening, the absmax of each block)
        // made from our records.
        const Bnb4bitWeight w(x.data(), {static_cast<int64_t>(x.size())}, type, block, false);
        const std::vector<uint8_t> want_packed = read<uint8_t>(file, key + ".packed", "U8");
        const std::vector<float> want_absmax = read<float>(file, key + ".absmax", "F32");
        ASSERT_EQ(w.packed, want_packed) << key;
        ASSERT_EQ(w.absmax.size(), want_absmax.size()) << key;
        for (size_t i = 0; i < w.absmax.size(); i++)
          ASSERT_EQ(float_bits(w.absmax[i]), float_bits(want_absmax[i])) << key << " block " << i;
        cases++;
      }
  EXPECT_EQ(cases, 48);
}

// Double quantization (compress_statistics): the fixture's 301 blocks of 64 in two nested blocks.
// The 4-bit codes and the dynamic map are bitsandbytes' own. The offset is the mean correctly
// rounded, which torch's fp32 reduction gives or misses by one unit in the last place; each absmax
// code is the nearest of the map, which bitsandbytes' CPU search is not always: where the codes
// differ, ours must be strictly nearer. Dequantized, the absmax are within a code's step of the
// true ones, and the weights within the 4-bit error the plain absmax give.
TEST(Quant, DoubleQuantizationIsBitsandbytesLayoutWithTheNearestCodes) {
  SafetensorsReader file(FIXTURE);
  const float* map = quant_dynamic_map();
  EXPECT_EQ(std::vector<float>(map, map + 256), read<float>(file, "nf4.nested.nested_quant_map", "F32"));
  for (QuantType type : {QUANT_NF4, QUANT_FP4}) {
    const std::string key = std::string(quant_type_name(type)) + ".nested";
    const std::vector<float> x = read<float>(file, key + ".input", "F32");
    const Bnb4bitWeight plain(x.data(), {static_cast<int64_t>(x.size())}, type, 64, false);
    const Bnb4bitWeight w(x.data(), {static_cast<int64_t>(x.size())}, type, 64, true);
    ASSERT_TRUE(w.double_quant());
    EXPECT_EQ(w.packed, read<uint8_t>(file, key + ".packed", "U8")) << key;
    const float want_offset = read<float>(file, key + ".offset", "F32")[0];
    EXPECT_LE(std::abs(static_cast<int64_t>(float_bits(w.offset)) - static_cast<int64_t>(float_bits(want_offset))), 1)
        << key;
    double sum = 0;
    for (float a : plain.absmax) sum += a;
    EXPECT_EQ(w.offset, static_cast<float>(sum / plain.absmax.size())) << key;
    const std::vector<uint8_t> want_codes = read<uint8_t>(file, key + ".absmax", "U8");
    ASSERT_EQ(w.absmax_codes.size(), want_codes.size());
    ASSERT_EQ(w.nested_absmax.size(), 2u);
    int differ = 0;
    for (size_t b = 0; b < want_codes.size(); b++) {
      const float scaled = (plain.absmax[b] - w.offset) / w.nested_absmax[b / 256];
      const float ours = std::fabs(scaled - map[w.absmax_codes[b]]), theirs = std::fabs(scaled - map[want_codes[b]]);
      EXPECT_LE(ours, theirs) << key << " block " << b;
      if (w.absmax_codes[b] != want_codes[b]) {
        EXPECT_LT(ours, theirs) << key << " block " << b;
        differ++;
      }
      const float step = map[std::min(w.absmax_codes[b] + 1, 255)] - map[std::max(w.absmax_codes[b] - 1, 0)];
      EXPECT_LE(std::fabs(map[w.absmax_codes[b]] * w.nested_absmax[b / 256] + w.offset - plain.absmax[b]),
                step * w.nested_absmax[b / 256]) << key << " block " << b;
    }
    EXPECT_LE(differ, 2) << key;  // one in the NF4 case, none in the FP4 one
    for (size_t i = 0; i < x.size(); i++) {  // each element as bitsandbytes' dequantize_4bit decodes it
      const float scale = map[w.absmax_codes[i / 64]] * w.nested_absmax[i / 64 / 256] + w.offset;
      const float value = quant4_code_value(type, i % 2 ? w.packed[i / 2] & 15 : w.packed[i / 2] >> 4) * scale;
      ASSERT_LE(std::fabs(value - x[i]), 0.6f * plain.absmax[i / 64] + 1e-6f) << key << " element " << i;
    }
  }
}

// Double quantization held as records (codes, then one absmax code) and a nested table: bitsandbytes'
// own codes, group scales and offset from the fixture, laid out so, decode through the backend's
// kernel to bitsandbytes' dequantized values bit for bit -- from the first record, and from a record
// past a group boundary as a rank's shard starts (NestedScales::first_record).
TEST(Quant, NestedRecordsDecodeAsBitsandbytesDoubleQuantization) {
  SafetensorsReader file(FIXTURE);
  for (QuantType type : {QUANT_NF4, QUANT_FP4}) {
    const std::string key = std::string(quant_type_name(type)) + ".nested";
    const std::vector<uint8_t> packed = read<uint8_t>(file, key + ".packed", "U8");
    const std::vector<uint8_t> codes = read<uint8_t>(file, key + ".absmax", "U8");
    std::vector<float> table_values = {read<float>(file, key + ".offset", "F32")[0]};
    for (float s : read<float>(file, key + ".nested_absmax", "F32")) table_values.push_back(s);
    const std::vector<float> want = read<float>(file, key + ".dequant", "F32");
    const size_t block = 64, blocks = codes.size(), record = quant_record_bytes(type, block, true);
    ASSERT_EQ(record, 33u);
    std::vector<uint8_t> records(blocks * record, 0);
    for (size_t b = 0; b < blocks; b++) {
      for (size_t j = 0; j < block / 2 && b * block / 2 + j < packed.size(); j++)
        records[b * record + j] = packed[b * block / 2 + j];
      records[b * record + block / 2] = codes[b];
    }
    const std::vector<uint8_t> table = lone_weight_nested_table(table_values, blocks);
    for (size_t first : {size_t{0}, size_t{259}}) {
      std::vector<float> out((blocks - first) * block);
      cpu_shard_ops().dequantize_blocks(out.data(), nullptr, DTYPE_FP32, records.data() + first * record,
                                        blocks - first, type, block, nested_scales(table.data(), 1, first));
      for (size_t i = first * block; i < want.size(); i++)
        ASSERT_EQ(float_bits(out[i - first * block]), float_bits(want[i])) << key << " from " << first << ", " << i;
    }
  }
  // A record past the weights (a shard's padding) decodes to zero.
  const std::vector<uint8_t> table = lone_weight_nested_table({0.5f, 2.0f}, 3);
  EXPECT_EQ(nested_absmax(nested_scales(table.data(), 1, 3), 0, 200), 0.0f);
  EXPECT_EQ(nested_absmax(nested_scales(table.data(), 1, 2), 0, 255), 1.0f * 2.0f + 0.5f);
}

TEST(Quant, FourBitDequantizationIsBitsandbytesOwnInFp32AndBf16) {
  SafetensorsReader file(FIXTURE);
  for (QuantType type : {QUANT_NF4, QUANT_FP4})
    for (size_t block = 32; block <= 4096; block *= 2)
      for (const char* label : {"odd", "tiny", "ties"}) {
        const std::string key = std::string(quant_type_name(type)) + "." + std::to_string(block) + "." + label;
        const std::vector<float> x = read<float>(file, key + ".input", "F32");
        const std::vector<float> want = read<float>(file, key + ".dequant", "F32");
        const std::vector<uint16_t> want_bf16 = read<uint16_t>(file, key + ".dequant_bf16", "BF16");
        std::vector<uint8_t> record(quant_record_bytes(type, block));
        for (size_t b = 0; b * block < x.size(); b++) {
          const size_t valid = std::min(block, x.size() - b * block);
          quantize_block(type, x.data() + b * block, valid, block, record.data());
          for (size_t i = 0; i < valid; i++) {
            const float v = dequantize_element(type, record.data(), block, i);
            ASSERT_EQ(float_bits(v), float_bits(want[b * block + i])) << key << " element " << b * block + i;
            ASSERT_EQ(float_to_bf16(v), want_bf16[b * block + i]) << key << " element " << b * block + i;
          }
        }
      }
}

TEST(Quant, Fp8RoundsAsTorchFloat8E4m3fn) {
  SafetensorsReader file(FIXTURE);
  const std::vector<float> x = read<float>(file, "fp8.input", "F32");
  const std::vector<uint8_t> want = read<uint8_t>(file, "fp8.bytes", "U8");
  ASSERT_GT(x.size(), 8000u);
  for (size_t i = 0; i < x.size(); i++) ASSERT_EQ(float_to_e4m3(x[i]), want[i]) << "x = " << x[i];
  // Every code decodes to the value its bits name (sign, 4 exponent bits bias 7, 3 mantissa bits).
  for (int c = 0; c < 256; c++) {
    if ((c & 0x7F) == 0x7F) continue;  // NaN
    const int e = (c >> 3) & 15, m = c & 7;
    const double magnitude = e == 0 ? m * std::ldexp(1.0, -9) : (1.0 + m / 8.0) * std::ldexp(1.0, e - 7);
    EXPECT_EQ(static_cast<double>(e4m3_to_float(static_cast<uint8_t>(c))), c & 0x80 ? -magnitude : magnitude) << c;
    EXPECT_EQ(float_to_e4m3(e4m3_to_float(static_cast<uint8_t>(c))), c == 0x80 ? 0x80 : c) << c;
  }
}

TEST(Quant, Fp8BlocksScaleByAbsmaxOver448) {
  const size_t block = 64;
  std::vector<float> x(block);
  for (size_t i = 0; i < block; i++) x[i] = std::sin(0.7 * i) * 0.3f;
  x[5] = -1.5f;  // the absmax, negative
  std::vector<uint8_t> record(quant_record_bytes(QUANT_FP8, block));
  quantize_block(QUANT_FP8, x.data(), block, block, record.data());
  EXPECT_EQ(quant_scale(QUANT_FP8, record.data(), block), 1.5f / 448.0f);
  EXPECT_EQ(dequantize_element(QUANT_FP8, record.data(), block, 5), -448.0f * (1.5f / 448.0f));
  for (size_t i = 0; i < block; i++)  // e4m3 keeps 3 mantissa bits: relative error <= 2^-4
    EXPECT_NEAR(dequantize_element(QUANT_FP8, record.data(), block, i), x[i], std::fabs(x[i]) / 16 + 1.5 / 448 / 512);
  // A partial block: the rest reads as zeros, the scale from the valid elements alone.
  quantize_block(QUANT_FP8, x.data(), 3, block, record.data());
  EXPECT_EQ(quant_scale(QUANT_FP8, record.data(), block), std::fabs(x[2]) / 448.0f);
  for (size_t i = 3; i < block; i++) EXPECT_EQ(dequantize_element(QUANT_FP8, record.data(), block, i), 0.0f);
}

TEST(Quant, Bf16BlocksAreTheRoundedValues) {
  const size_t block = 32;
  std::vector<float> x(block);
  for (size_t i = 0; i < block; i++) x[i] = std::sin(1.3 * i) * 1000.0f + 1e-3f * i;
  std::vector<uint8_t> record(quant_record_bytes(QUANT_BF16, block));
  quantize_block(QUANT_BF16, x.data(), 20, block, record.data());
  for (size_t i = 0; i < block; i++)
    EXPECT_EQ(float_bits(dequantize_element(QUANT_BF16, record.data(), block, i)),
              float_bits(i < 20 ? bf16_to_float(float_to_bf16(x[i])) : 0.0f)) << i;
}

TEST(Quant, RecordSizesAreTheFormulas) {
  EXPECT_EQ(quant_record_bytes(QUANT_NF4, 64), 36u);  // 0.5625 bytes per element
  EXPECT_DOUBLE_EQ(quant_bytes_per_element(QUANT_NF4, 64), 0.5625);
  EXPECT_EQ(quant_record_bytes(QUANT_FP8, 64), 68u);
  EXPECT_EQ(quant_record_bytes(QUANT_BF16, 64), 128u);  // no scale
  EXPECT_TRUE(quant_block_ok(32) && quant_block_ok(4096) && !quant_block_ok(48) && !quant_block_ok(16));
}

}  // namespace
}  // namespace shardtrain

namespace shardtrain {
namespace {

// The CPU backend's gather-side kernel against the element-wise definition, in fp32 and with the
// bf16 copy the GEMMs read (values then its widening).
TEST(Quant, BackendDequantizationIsTheDefinition) {
  for (QuantType type : {QUANT_NF4, QUANT_FP4, QUANT_FP8, QUANT_BF16})
    for (size_t block : {32u, 64u, 256u}) {
      const size_t blocks = 5, record = quant_record_bytes(type, block);
      std::vector<float> x(blocks * block);
      for (size_t i = 0; i < x.size(); i++) x[i] = std::sin(0.37 * i) * (1 + i % 7);
      std::vector<uint8_t> records(blocks * record);
      for (size_t b = 0; b < blocks; b++)
        quantize_block(type, x.data() + b * block, b == 3 ? block / 2 + 1 : block, block, records.data() + b * record);
      std::vector<float> out(x.size()), widened(x.size());
      std::vector<uint16_t> half(x.size());
      cpu_shard_ops().dequantize_blocks(out.data(), nullptr, DTYPE_FP32, records.data(), blocks, type, block, {});
      cpu_shard_ops().dequantize_blocks(widened.data(), half.data(), DTYPE_BF16, records.data(), blocks, type, block,
                                        {});
      // Into the 16-bit copy alone (the gather where the GEMMs take it): the same copy.
      std::vector<uint16_t> half_only(x.size());
      cpu_shard_ops().dequantize_blocks(nullptr, half_only.data(), DTYPE_BF16, records.data(), blocks, type, block, {});
      EXPECT_EQ(half_only, half) << quant_type_name(type) << " " << block;
      for (size_t i = 0; i < x.size(); i++) {
        const float want = dequantize_element(type, records.data() + i / block * record, block, i % block);
        ASSERT_EQ(float_bits(out[i]), float_bits(want)) << quant_type_name(type) << " " << block << " " << i;
        ASSERT_EQ(half[i], float_to_bf16(want)) << quant_type_name(type) << " " << i;
        ASSERT_EQ(float_bits(widened[i]), float_bits(bf16_to_float(half[i]))) << quant_type_name(type) << " " << i;
      }
    }
}

}  // namespace
}  // namespace shardtrain
