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

std::vector<float> Bnb4bitTensor::nested_table() const {
  if (!nested_ || nested_blocksize_ != static_cast<int64_t>(QUANT_NESTED_BLOCK) ||
      !std::equal(nested_map_.begin(), nested_map_.end(), quant_dynamic_map(),
                  [](float a, float b) { return float_bits(a) == float_bits(b); }))
    return {};
  QuantType type = QUANT_NONE;
  parse_quant_type(quant_type_, &type);
  for (int c = 0; c < 16; c++)
    if (float_bits(quant_map_[c]) != float_bits(quant4_code_value(type, c))) return {};
  std::vector<float> table(1 + nested_absmax_.tensor->numel);
  table[0] = offset_;
  nested_absmax_.reader->read_raw(*nested_absmax_.tensor, "F32", 0, table.size() - 1, table.data() + 1);
  return table;
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
      absmax[b - b0] = product_rounded(nested_map_[codes[b - b0]], scales[b / nested_blocksize_ - n0]) + offset_;
    }
  }
  std::vector<uint8_t> bytes(last / 2 - first / 2 + 1);
  packed_.reader->read_raw(*packed_.tensor, "U8", first / 2, bytes.size(), bytes.data());
  for (uint64_t i = first; i <= last; i++) {
    const uint8_t pair = bytes[i / 2 - first / 2];
    out[i - first] = quant_map_[i % 2 ? pair & 15 : pair >> 4] * absmax[i / blocksize_ - b0];
  }
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
                      QUANT_NESTED_BLOCK, offset.c_str());
  return text + "}";
}

}  // namespace

Bnb4bitWeight::Bnb4bitWeight(const float* values, const std::vector<int64_t>& shape, QuantType type, size_t block,
                             bool double_quant, const std::vector<float>& nested_given)
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
  nested_absmax.resize(nested_groups(blocks));
  const bool given = !nested_given.empty();
  SHARD_CHECK(!given || nested_given.size() == 1 + nested_absmax.size(), "%zu nested values for %zu groups",
              nested_given.size(), nested_absmax.size());
  if (given)
    offset = nested_given[0], std::copy(nested_given.begin() + 1, nested_given.end(), nested_absmax.begin());
  else
    offset = nested_scales_of(absmax.data(), blocks, nested_absmax.data());
  absmax_codes.resize(blocks);
  for (size_t b = 0; b < blocks; b++) {
    const float scale = nested_absmax[b / QUANT_NESTED_BLOCK];
    absmax_codes[b] = given ? nested_code_of_decoded(absmax[b], offset, scale) : nested_code(absmax[b], offset, scale);
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
