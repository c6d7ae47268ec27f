// See bnb_tensor.hpp.
#include "ckpt/bnb_tensor.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>

#include "backend/quant.hpp"
#include "core/error.hpp"
#include "core/format.hpp"

namespace shardtrain {
namespace {

const char* STATE_PREFIX = ".quant_state.bitsandbytes__";

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s;
  for (int64_t d : shape) s += (s.empty() ? "" : ", ") + std::to_string(d);
  return "[" + s + "]";
}

}  // namespace

bool Bnb4bitTensor::present(const Lookup& find, const std::string& key) {
  return find(key + STATE_PREFIX + "nf4").tensor || find(key + STATE_PREFIX + "fp4").tensor;
}

Bnb4bitTensor::Bnb4bitTensor(const Lookup& find, const std::string& key, const std::vector<int64_t>& shape) {
  const SafetensorsPart weight = find(key);
  auto fail = [&](const std::string& why) {
    throw CheckpointError("safetensors file '" + (weight.reader ? weight.reader->path() : std::string("?")) +
                          "': bitsandbytes 4-bit tensor '" + (weight.tensor ? weight.tensor->name : key) + "': " +
                          why);
  };
  SafetensorsPart state;
  for (const char* type : {"nf4", "fp4"})
    if (SafetensorsPart p = find(key + STATE_PREFIX + type); p.tensor) state = p, quant_type_ = type;
  if (!weight.tensor) fail("its quant_state is there but not the packed weight");
  const std::string name = weight.tensor ? weight.tensor->name : key;  // as the file spells it
  auto part = [&](const std::string& suffix, const std::string& dtype, uint64_t numel) {
    const SafetensorsPart p = find(key + suffix);
    if (!p.tensor) fail("'" + name + suffix + "' is missing");
    if (p.tensor->dtype != dtype || p.tensor->numel != numel)
      fail(strprintf("'%s%s' is %s with %llu elements, where %s with %llu belong", name.c_str(), suffix.c_str(),
                     p.tensor->dtype.c_str(), static_cast<unsigned long long>(p.tensor->numel), dtype.c_str(),
                     static_cast<unsigned long long>(numel)));
    keys_.push_back(key + suffix);
    return p;
  };
  // The quant_state: JSON in a U8 tensor.
  std::string text(state.tensor->numel, '\0');
  if (state.tensor->dtype != "U8") fail("its quant_state is " + state.tensor->dtype + ", not U8 (JSON bytes)");
  state.reader->read_raw(*state.tensor, "U8", 0, state.tensor->numel, text.data());
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception&) {
    fail("its quant_state is not JSON");
  }
  auto integer = [&](const char* field) {
    if (!j.contains(field) || !j[field].is_number_integer()) fail(std::string("its quant_state lacks an integer ") + field);
    return j[field].get<int64_t>();
  };
  if (!j.contains("quant_type") || j["quant_type"] != quant_type_)
    fail("its quant_state's quant_type is not the '" + quant_type_ + "' its name says (nf4 and fp4 are read)");
  blocksize_ = integer("blocksize");
  if (!quant_block_ok(static_cast<int>(std::min<int64_t>(blocksize_, 1 << 20))))
    fail(strprintf("blocksize %lld is not one of bitsandbytes' (a power of two from 32 to 4096)",
                   static_cast<long long>(blocksize_)));
  if (!j.contains("shape") || !j["shape"].is_array()) fail("its quant_state has no shape");
  std::vector<int64_t> stored;
  for (const auto& d : j["shape"]) {
    if (!d.is_number_integer() || d.get<int64_t>() < 0) fail("its quant_state's shape is not a list of sizes");
    stored.push_back(d.get<int64_t>());
  }
  if (stored != shape)
    fail("its quant_state says shape " + shape_text(stored) + ", config.json's model needs " + shape_text(shape));
  uint64_t numel = 1;
  for (int64_t d : shape) numel *= static_cast<uint64_t>(d);
  const uint64_t blocks = (numel + blocksize_ - 1) / blocksize_;
  if (weight.tensor->dtype != "U8" || weight.tensor->numel != (numel + 1) / 2)
    fail(strprintf("the packed weight is %s with %llu elements, where U8 with %llu hold %llu 4-bit codes",
                   weight.tensor->dtype.c_str(), static_cast<unsigned long long>(weight.tensor->numel),
                   static_cast<unsigned long long>((numel + 1) / 2), static_cast<unsigned long long>(numel)));
  packed_ = weight;
  keys_.push_back(key);
  keys_.push_back(key + STATE_PREFIX + quant_type_);
  const SafetensorsPart map = part(".quant_map", "F32", 16);
  quant_map_.resize(16);
  map.reader->read_raw(*map.tensor, "F32", 0, 16, quant_map_.data());
  nested_ = j.contains("nested_blocksize");
  if (nested_) {
    nested_blocksize_ = integer("nested_blocksize");
    if (nested_blocksize_ <= 0 || nested_blocksize_ > (1 << 20)) fail("its nested_blocksize is not a block size");
    if (!j.contains("nested_offset") || !j["nested_offset"].is_number()) fail("its quant_state lacks nested_offset");
    offset_ = j["nested_offset"].get<float>();
    absmax_ = part(".absmax", "U8", blocks);
    nested_absmax_ = part(".nested_absmax", "F32", (blocks + nested_blocksize_ - 1) / nested_blocksize_);
    const SafetensorsPart nested_map = part(".nested_quant_map", "F32", 256);
    nested_map_.resize(256);
    nested_map.reader->read_raw(*nested_map.tensor, "F32", 0, 256, nested_map_.data());
  } else {
    absmax_ = part(".absmax", "F32", blocks);
  }
  for (float v : quant_map_) if (!std::isfinite(v)) fail("its quant_map holds a value that is not finite");
  for (float v : nested_map_) if (!std::isfinite(v)) fail("its nested_quant_map holds a value that is not finite");
  if (!std::isfinite(offset_)) fail("its nested_offset is not finite");
}

void Bnb4bitTensor::read(uint64_t first, uint64_t count, float* out) const {
  if (count == 0) return;
  const uint64_t last = first + count - 1, b0 = first / blocksize_, b1 = last / blocksize_;
  std::vector<float> absmax(b1 - b0 + 1);
  if (!nested_) {
    absmax_.reader->read_raw(*absmax_.tensor, "F32", b0, absmax.size(), absmax.data());
  } else {
    std::vector<uint8_t> codes(absmax.size());
    absmax_.reader->read_raw(*absmax_.tensor, "U8", b0, codes.size(), codes.data());
    const uint64_t n0 = b0 / nested_blocksize_, n1 = b1 / nested_blocksize_;
    std::vector<float> scales(n1 - n0 + 1);
    nested_absmax_.reader->read_raw(*nested_absmax_.tensor, "F32", n0, scales.size(), scales.data());
    for (uint64_t b = b0; b <= b1; b++) {
      // Rounded before the offset is added, as bitsandbytes' two steps do: no fused multiply-add.
      const volatile float decoded = nested_map_[codes[b - b0]] * scales[b / nested_blocksize_ - n0];
      absmax[b - b0] = decoded + offset_;
    }
  }
  std::vector<uint8_t> bytes(last / 2 - first / 2 + 1);
  packed_.reader->read_raw(*packed_.tensor, "U8", first / 2, bytes.size(), bytes.data());
  for (uint64_t i = first; i <= last; i++) {
    const uint8_t pair = bytes[i / 2 - first / 2];
    out[i - first] = quant_map_[i % 2 ? pair & 15 : pair >> 4] * absmax[i / blocksize_ - b0];
  }
}

const float* bnb_dynamic_map() {
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

std::string bnb_quant_state_suffix(QuantType type) { return STATE_PREFIX + std::string(quant_type_name(type)); }

namespace {

// bitsandbytes' QuantState.as_dict(packed=True) JSON (json.dumps' separators), the offset as text.
std::string quant_state_text(QuantType type, size_t block, const std::vector<int64_t>& shape, bool double_quant,
                             const std::string& offset, const char* dtype) {
  std::string dims;
  for (int64_t d : shape) dims += (dims.empty() ? "" : ", ") + std::to_string(d);
  std::string text = strprintf("{\"quant_type\": \"%s\", \"blocksize\": %zu, \"dtype\": \"%s\", \"shape\": [%s]",
                               quant_type_name(type), block, dtype, dims.c_str());
  if (double_quant)
    text += strprintf(", \"nested_blocksize\": %zu, \"nested_dtype\": \"float32\", \"nested_offset\": %s",
                      BNB_NESTED_BLOCK, offset.c_str());
  return text + "}";
}

}  // namespace

Bnb4bitWeight::Bnb4bitWeight(const float* values, const std::vector<int64_t>& shape, QuantType type, size_t block,
                             bool double_quant)
    : type(type), block(block), shape(shape) {
  SHARD_CHECK((type == QUANT_NF4 || type == QUANT_FP4) && quant_block_ok(static_cast<int>(block)),
              "Bnb4bitWeight of %s in blocks of %zu", quant_type_name(type), block);
  size_t numel = 1;
  for (int64_t d : shape) numel *= static_cast<size_t>(d);
  const size_t blocks = (numel + block - 1) / block;
  packed.resize((numel + 1) / 2);
  absmax.resize(blocks);
  std::vector<uint8_t> record(quant_record_bytes(type, block));
  for (size_t b = 0; b < blocks; b++) {
    const size_t first = b * block, valid = std::min(block, numel - first);
    quantize_block(type, values + first, valid, block, record.data());
    std::memcpy(packed.data() + first / 2, record.data(), (valid + 1) / 2);  // blocks are even: whole bytes
    absmax[b] = quant_scale(type, record.data(), block);
  }
  if (!double_quant) return;
  // The mean in double, rounded once; then absmax - offset in fp32, as torch subtracts.
  double sum = 0;
  for (float a : absmax) sum += a;
  offset = static_cast<float>(sum / static_cast<double>(blocks));
  const float* map = bnb_dynamic_map();
  absmax_codes.resize(blocks);
  for (size_t n0 = 0; n0 < blocks; n0 += BNB_NESTED_BLOCK) {
    const size_t n1 = std::min(blocks, n0 + BNB_NESTED_BLOCK);
    float top = 0;
    for (size_t b = n0; b < n1; b++) top = std::max(top, std::fabs(absmax[b] - offset));
    nested_absmax.push_back(top);
    for (size_t b = n0; b < n1; b++) {
      const float scaled = top > 0 ? std::clamp((absmax[b] - offset) / top, -1.0f, 1.0f) : 0.0f;
      // The nearest of the sorted map: the first value not below, or the one before it when nearer.
      const size_t above = std::lower_bound(map, map + 256, scaled) - map;
      size_t code = std::min<size_t>(above, 255);
      if (above > 0 && (above == 256 || scaled - map[above - 1] <= map[above] - scaled)) code = above - 1;
      absmax_codes[b] = static_cast<uint8_t>(code);
    }
  }
  absmax.clear();
}

std::string Bnb4bitWeight::quant_state(const char* dtype) const {
  char number[32];  // the shortest text that reads back as the same double: Python's repr of it
  const auto end = std::to_chars(number, number + sizeof number, static_cast<double>(offset)).ptr;
  std::string text = quant_state_text(type, block, shape, double_quant(), std::string(number, end), dtype);
  text.resize(quant_state_bytes(shape, double_quant()), ' ');
  return text;
}

size_t Bnb4bitWeight::quant_state_bytes(const std::vector<int64_t>& shape, bool double_quant) {
  // The longest offset to_chars writes: a sign, 17 digits, a point and a three-digit exponent.
  // The longest dtype, and blanks to a multiple of 8 bytes, which keeps the tensors after it aligned.
  const size_t longest = quant_state_text(QUANT_NF4, 4096, shape, double_quant, std::string(24, '9'), "bfloat16").size();
  return (longest + 7) / 8 * 8;
}

}  // namespace shardtrain
