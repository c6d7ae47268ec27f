// What the Comm implementations (comm/mpi_comm.cpp, comm/cuda/nccl_comm.cpp) share; not for
// users of Comm.
#pragma once

#include <climits>
#include <cstddef>
#include <vector>

#include "core/error.hpp"

namespace shardtrain {

// `n` as the int count of an MPI call.
inline int checked_count(size_t n) {
  SHARD_CHECK(n <= static_cast<size_t>(INT_MAX), "message of %zu elements exceeds MPI's int count", n);
  return static_cast<int>(n);
}

// The handle of a started collective is its slot in `pending`, a vector of entries whose `what`
// is null while the slot is free. Takes the first free slot, or appends fresh() when none is,
// and marks it used by `what`.
template <typename Pending, typename Fresh>
size_t take_slot(std::vector<Pending>& pending, const char* what, Fresh fresh) {
  size_t slot = 0;
  while (slot < pending.size() && pending[slot].what) slot++;
  if (slot == pending.size()) pending.push_back(fresh());
  pending[slot].what = what;
  return slot;
}

}  // namespace shardtrain
