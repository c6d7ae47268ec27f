// One micro-batch in host memory, as a family's data source fills it and its model reads it:
// named tensors with shapes -- a language model's "tokens" and "targets" (B x T ids), a diffusion
// transformer's latents, text embeddings and noise levels. The engine passes it through untouched;
// only the data source and the model know the names.
#pragma once

#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "core/error.hpp"

namespace shardtrain {

class Batch {
 public:
  // The tensor `name` with this shape (zeros when new or reshaped), for the data source to fill.
  template <typename T>
  T* put(const std::string& name, const std::vector<int64_t>& shape) {
    Tensor& t = tensors_[name];
    const size_t n = numel_of(shape);
    if (t.shape != shape || t.is_int != is_int<T>()) {
      t.shape = shape, t.is_int = is_int<T>();
      t.bytes.assign(n * sizeof(T), 0);
    }
    return reinterpret_cast<T*>(t.bytes.data());
  }
  // The tensor `name`, which the model requires with `numel` elements of T.
  template <typename T>
  const T* get(const std::string& name, size_t numel) const {
    auto it = tensors_.find(name);
    SHARD_CHECK(it != tensors_.end(), "the micro-batch has no tensor '%s'", name.c_str());
    const Tensor& t = it->second;
    SHARD_CHECK(t.is_int == is_int<T>() && numel_of(t.shape) == numel,
                "the micro-batch's '%s' holds %zu %s, the model reads %zu %s", name.c_str(), numel_of(t.shape),
                t.is_int ? "ints" : "floats", numel, is_int<T>() ? "ints" : "floats");
    return reinterpret_cast<const T*>(t.bytes.data());
  }
  // The same, to fill in place (the data source's rows).
  template <typename T>
  T* at(const std::string& name, size_t numel) {
    return const_cast<T*>(static_cast<const Batch*>(this)->get<T>(name, numel));
  }
  bool has(const std::string& name) const { return tensors_.count(name) > 0; }
  const std::vector<int64_t>& shape(const std::string& name) const {
    auto it = tensors_.find(name);
    SHARD_CHECK(it != tensors_.end(), "the micro-batch has no tensor '%s'", name.c_str());
    return it->second.shape;
  }

 private:
  template <typename T>
  static constexpr bool is_int() {
    static_assert(std::is_same_v<T, int32_t> || std::is_same_v<T, float>, "a batch holds int32 or float tensors");
    return std::is_same_v<T, int32_t>;
  }
  static size_t numel_of(const std::vector<int64_t>& shape) {
    size_t n = 1;
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    return n;
  }
  struct Tensor {
    std::vector<int64_t> shape;
    bool is_int = false;
    std::vector<unsigned char> bytes;
  };
  std::map<std::string, Tensor> tensors_;
};

// A language model's micro-batch: B sequences of T token ids and, for each position, the id that
// follows it.
inline constexpr const char* BATCH_TOKENS = "tokens";
inline constexpr const char* BATCH_TARGETS = "targets";
// Packed documents (data.document_masking): for each position, the first position of its document
// in the sequence (B x T ids); attention stays within a document. Absent: one document per row.
inline constexpr const char* BATCH_DOC_STARTS = "doc_starts";
// With data.restart_positions: each token's position counted from its document's start (B x T).
// Absent: its place in the sequence.
inline constexpr const char* BATCH_POSITIONS = "positions";
// A flow-matching sample's noise level sigma in [0, 1] (B): a diffusion family's input, and what the
// trainer buckets the loss by.
inline constexpr const char* BATCH_NOISE_LEVEL = "timestep";
// A target the loss leaves out (a prompt's token under a loss mask): no loss, no gradient. The
// step's loss averages over the other targets (DataSource::trained_targets).
inline constexpr int IGNORED_TARGET = -1;

}  // namespace shardtrain
