#include "data/bpe.hpp"

#include <queue>

namespace shardtrain {

void BpeMerges::add(uint32_t left, uint32_t right, uint32_t merged) {
  merges_[key(left, right)] = Merge{next_rank_++, merged};
}

const BpeMerges::Merge* BpeMerges::find(uint32_t left, uint32_t right) const {
  auto it = merges_.find(key(left, right));
  return it == merges_.end() ? nullptr : &it->second;
}

void BpeMerges::apply(std::vector<uint32_t>& symbols) const {
  const int n = static_cast<int>(symbols.size());
  if (n < 2) return;
  // A doubly linked list over the symbols; a merged-away symbol is marked dead.
  std::vector<int> prev(n), next(n);
  std::vector<char> dead(n, 0);
  for (int i = 0; i < n; i++) {
    prev[i] = i - 1;
    next[i] = i + 1 < n ? i + 1 : -1;
  }
  struct Candidate {
    uint32_t rank;
    int pos;
    uint32_t merged;
    bool operator<(const Candidate& o) const {  // priority_queue pops the largest: invert
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::priority_queue<Candidate> queue;
  for (int i = 0; i + 1 < n; i++)
    if (const Merge* m = find(symbols[i], symbols[i + 1])) queue.push({m->rank, i, m->merged});
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    if (dead[top.pos] || next[top.pos] < 0) continue;
    const int right = next[top.pos];
    // A stale entry: the pair at pos changed since it was queued.
    const Merge* now = find(symbols[top.pos], symbols[right]);
    if (now == nullptr || now->merged != top.merged) continue;
    symbols[top.pos] = top.merged;
    dead[right] = 1;
    next[top.pos] = next[right];
    if (next[right] >= 0) prev[next[right]] = top.pos;
    if (prev[top.pos] >= 0)
      if (const Merge* m = find(symbols[prev[top.pos]], symbols[top.pos])) queue.push({m->rank, prev[top.pos], m->merged});
    if (next[top.pos] >= 0)
      if (const Merge* m = find(symbols[top.pos], symbols[next[top.pos]])) queue.push({m->rank, top.pos, m->merged});
  }
  int out = 0;
  for (int i = 0; i < n; i++)
    if (!dead[i]) symbols[out++] = symbols[i];
  symbols.resize(out);
}

}  // namespace shardtrain
