// The byte-pair-encoding merge loop of a Hugging Face BPE model, on token ids: merges have ranks
// (their order in the file) and the loop always applies the lowest-ranked adjacent pair first, the
// leftmost on ties, re-checking each queued pair before merging it — the order the reference
// (`tokenizers`' Word::merge_all) uses, so hand-made merge lists that are not "trained-looking"
// give the same tokens too.
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

namespace shardtrain {

class BpeMerges {
 public:
  // Adds the merge (left, right) -> merged with the next rank. A pair given twice keeps the later
  // rank, as the reference's hash map does.
  void add(uint32_t left, uint32_t right, uint32_t merged);
  size_t size() const { return merges_.size(); }

  // Merges `symbols` (the ids of a word's characters, in order) in place.
  void apply(std::vector<uint32_t>& symbols) const;

 private:
  struct Merge {
    uint32_t rank;
    uint32_t merged;
  };
  static uint64_t key(uint32_t left, uint32_t right) { return (uint64_t{left} << 32) | right; }
  const Merge* find(uint32_t left, uint32_t right) const;

  std::unordered_map<uint64_t, Merge> merges_;
  uint32_t next_rank_ = 0;
};

}  // namespace shardtrain
