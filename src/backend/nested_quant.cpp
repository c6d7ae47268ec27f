// Double quantization's host side (backend/quant.hpp): bitsandbytes' dynamic map, the absmax codes
// and the offsets and group scales of one weight.
#include <algorithm>
#include <cmath>

#include "backend/quant.hpp"
#include "core/error.hpp"

namespace shardtrain {

const float* quant_dynamic_map() {
  // functional.create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8) as fp32 bits:
  // 10^(i-6) times the midpoints of linspace(0.1, 1, 2^i + 1) for i = 0..6, both signs, 0 and 1.
  static const uint32_t bits[256] = {
      0xbf7e3333u, 0xbf7a999au, 0xbf770000u, 0xbf736666u, 0xbf6fcccdu, 0xbf6c3333u, 0xbf68999au, 0xbf650000u,
      0xbf616666u, 0xbf5dcccdu, 0xbf5a3333u, 0xbf56999au, 0xbf530000u, 0xbf4f6666u, 0xbf4bcccdu, 0xbf483333u,
      0xbf44999au, 0xbf410000u, 0xbf3d6666u, 0xbf39cccdu, 0xbf363334u, 0xbf32999au, 0xbf2f0000u, 0xbf2b6666u,
      0xbf27cccdu, 0xbf243334u, 0xbf20999au, 0xbf1d0000u, 0xbf196666u, 0xbf15cccdu, 0xbf123334u, 0xbf0e999au,
      0xbf0b0000u, 0xbf076666u, 0xbf03ccccu, 0xbf003333u, 0xbef93332u, 0xbef20000u, 0xbeeaccccu, 0xbee3999au,
      0xbedc6666u, 0xbed53333u, 0xbece0000u, 0xbec6ccccu, 0xbebf999au, 0xbeb86666u, 0xbeb13333u, 0xbeaa0000u,
      0xbea2ccccu, 0xbe9b999au, 0xbe946666u, 0xbe8d3334u, 0xbe860000u, 0xbe7d9999u, 0xbe6f3333u, 0xbe60cccdu,
      0xbe526666u, 0xbe440000u, 0xbe35999au, 0xbe273333u, 0xbe18cccdu, 0xbe0a6666u, 0xbdf80000u, 0xbddb3334u,
      0xbdc9eb85u, 0xbdc428f7u, 0xbdbe6667u, 0xbdb8a3d7u, 0xbdb2e148u, 0xbdad1eb8u, 0xbda75c2au, 0xbda1999au,
      0xbd9bd70au, 0xbd96147bu, 0xbd9051ebu, 0xbd8a8f5du, 0xbd84cccdu, 0xbd7e147bu, 0xbd728f5du, 0xbd670a3du,
      0xbd5b851fu, 0xbd500000u, 0xbd447ae1u, 0xbd38f5c3u, 0xbd2d70a3u, 0xbd21eb85u, 0xbd166667u, 0xbd0ae148u,
      0xbcfeb852u, 0xbce7ae15u, 0xbcd0a3d7u, 0xbcb9999au, 0xbca28f5du, 0xbc8b851fu, 0xbc68f5c3u, 0xbc3ae148u,
      0xbc1f3b64u, 0xbc160418u, 0xbc0ccccdu, 0xbc039581u, 0xbbf4bc6au, 0xbbe24dd3u, 0xbbcfdf3bu, 0xbbbd70a4u,
      0xbbab020du, 0xbb989374u, 0xbb8624ddu, 0xbb676c8au, 0xbb428f5cu, 0xbb1db22du, 0xbaf1a9fcu, 0xbaa7ef9du,
      0xba7765ffu, 0xba59e83eu, 0xba3c6a80u, 0xba1eecc1u, 0xba016f01u, 0xb9c7e283u, 0xb98ce705u, 0xb923d70bu,
      0xb8ba1f4bu, 0xb88aefb3u, 0xb8378034u, 0xb7b24206u, 0xb70205ffu, 0xb65a1a94u, 0xb513a3b7u, 0x00000000u,
      0x3513a3b7u, 0x365a1a94u, 0x370205ffu, 0x37b24206u, 0x38378034u, 0x388aefb3u, 0x38ba1f4bu, 0x3923d70bu,
      0x398ce705u, 0x39c7e283u, 0x3a016f01u, 0x3a1eecc1u, 0x3a3c6a80u, 0x3a59e83eu, 0x3a7765ffu, 0x3aa7ef9du,
      0x3af1a9fcu, 0x3b1db22du, 0x3b428f5cu, 0x3b676c8au, 0x3b8624ddu, 0x3b989374u, 0x3bab020du, 0x3bbd70a4u,
      0x3bcfdf3bu, 0x3be24dd3u, 0x3bf4bc6au, 0x3c039581u, 0x3c0ccccdu, 0x3c160418u, 0x3c1f3b64u, 0x3c3ae148u,
      0x3c68f5c3u, 0x3c8b851fu, 0x3ca28f5du, 0x3cb9999au, 0x3cd0a3d7u, 0x3ce7ae15u, 0x3cfeb852u, 0x3d0ae148u,
      0x3d166667u, 0x3d21eb85u, 0x3d2d70a3u, 0x3d38f5c3u, 0x3d447ae1u, 0x3d500000u, 0x3d5b851fu, 0x3d670a3du,
      0x3d728f5du, 0x3d7e147bu, 0x3d84cccdu, 0x3d8a8f5du, 0x3d9051ebu, 0x3d96147bu, 0x3d9bd70au, 0x3da1999au,
      0x3da75c2au, 0x3dad1eb8u, 0x3db2e148u, 0x3db8a3d7u, 0x3dbe6667u, 0x3dc428f7u, 0x3dc9eb85u, 0x3ddb3334u,
      0x3df80000u, 0x3e0a6666u, 0x3e18cccdu, 0x3e273333u, 0x3e35999au, 0x3e440000u, 0x3e526666u, 0x3e60cccdu,
      0x3e6f3333u, 0x3e7d9999u, 0x3e860000u, 0x3e8d3334u, 0x3e946666u, 0x3e9b999au, 0x3ea2ccccu, 0x3eaa0000u,
      0x3eb13333u, 0x3eb86666u, 0x3ebf999au, 0x3ec6ccccu, 0x3ece0000u, 0x3ed53333u, 0x3edc6666u, 0x3ee3999au,
      0x3eeaccccu, 0x3ef20000u, 0x3ef93332u, 0x3f003333u, 0x3f03ccccu, 0x3f076666u, 0x3f0b0000u, 0x3f0e999au,
      0x3f123334u, 0x3f15cccdu, 0x3f196666u, 0x3f1d0000u, 0x3f20999au, 0x3f243334u, 0x3f27cccdu, 0x3f2b6666u,
      0x3f2f0000u, 0x3f32999au, 0x3f363334u, 0x3f39cccdu, 0x3f3d6666u, 0x3f410000u, 0x3f44999au, 0x3f483333u,
      0x3f4bcccdu, 0x3f4f6666u, 0x3f530000u, 0x3f56999au, 0x3f5a3333u, 0x3f5dcccdu, 0x3f616666u, 0x3f650000u,
      0x3f68999au, 0x3f6c3333u, 0x3f6fcccdu, 0x3f736666u, 0x3f770000u, 0x3f7a999au, 0x3f7e3333u, 0x3f800000u};
  static const float* values = [] {
    static float v[256];
    for (int i = 0; i < 256; i++) v[i] = bits_float(bits[i]);
    return v;
  }();
  return values;
}

uint8_t nested_code(float absmax, float offset, float scale) {
  const float* map = quant_dynamic_map();
  // absmax - offset in fp32, as torch subtracts, then divided by the group's scale.
  const float scaled = scale > 0 ? std::clamp((absmax - offset) / scale, -1.0f, 1.0f) : 0.0f;
  // The nearest of the sorted map: the first value not below, or the one before it when nearer.
  const size_t above = std::lower_bound(map, map + 256, scaled) - map;
  size_t code = std::min<size_t>(above, 255);
  if (above > 0 && (above == 256 || scaled - map[above - 1] <= map[above] - scaled)) code = above - 1;
  return static_cast<uint8_t>(code);
}

void write_nested_table(uint8_t* table, const std::vector<NestedWeight>& weights, const std::vector<float>& scales) {
  std::memcpy(table, quant_dynamic_map(), 256 * sizeof(float));
  std::memcpy(table + 256 * sizeof(float), weights.data(), weights.size() * sizeof(NestedWeight));
  std::memcpy(table + 256 * sizeof(float) + weights.size() * sizeof(NestedWeight), scales.data(),
              scales.size() * sizeof(float));
}

std::vector<uint8_t> lone_weight_nested_table(const std::vector<float>& offset_and_scales, uint64_t records) {
  SHARD_CHECK(!offset_and_scales.empty(), "a nested table without its offset");
  NestedWeight w;
  w.records = records;
  w.offset = offset_and_scales[0];
  const std::vector<float> scales(offset_and_scales.begin() + 1, offset_and_scales.end());
  std::vector<uint8_t> table(nested_table_bytes(1, scales.size()));
  write_nested_table(table.data(), {w}, scales);
  return table;
}

int nested_code_decoding_to(float target, float offset, float scale) {
  const float* map = quant_dynamic_map();
  const int nearest = nested_code(target, offset, scale);
  for (int code : {nearest, nearest - 1, nearest + 1})
    if (code >= 0 && code < 256 && product_rounded(map[code], scale) + offset == target) return code;
  return -1;
}

uint8_t nested_code_of_decoded(float absmax, float offset, float scale) {
  const int exact = nested_code_decoding_to(absmax, offset, scale);
  return static_cast<uint8_t>(exact >= 0 ? exact : nested_code(absmax, offset, scale));
}

float nested_scales_of(const float* absmax, size_t n, float* scales) {
  double sum = 0;
  for (size_t b = 0; b < n; b++) sum += absmax[b];
  const float offset = static_cast<float>(sum / static_cast<double>(n));
  for (size_t g = 0; g * QUANT_NESTED_BLOCK < n; g++) {
    float top = 0;
    for (size_t b = g * QUANT_NESTED_BLOCK; b < std::min(n, (g + 1) * QUANT_NESTED_BLOCK); b++)
      top = std::max(top, std::fabs(absmax[b] - offset));
    scales[g] = top;
  }
  return offset;
}

}  // namespace shardtrain
