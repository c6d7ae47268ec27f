// See adapter.hpp.
#include "model/adapter.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "model/param_table.hpp"

namespace shardtrain {

const char* adapter_type_name(AdapterType type) {
  switch (type) {
    case ADAPTER_LORA: return "lora";
    case ADAPTER_DORA: return "dora";
    case ADAPTER_LOHA: return "loha";
    case ADAPTER_LOKR: return "lokr";
    case ADAPTER_OFT: return "oft";
    case ADAPTER_NONE: break;
  }
  return "none";
}

bool parse_adapter_type(const std::string& name, AdapterType* out) {
  for (AdapterType t : ADAPTER_TYPES)
    if (name == adapter_type_name(t)) return *out = t, true;
  return false;
}

std::pair<int, int> lokr_factorization(int dim, int factor) {
  if (factor > 0 && dim % factor == 0) return {factor, dim / factor};  // as given, not sorted
  if (factor <= 0) factor = dim;
  int m = 1, n = dim;
  while (m < n) {
    int next = m + 1;
    while (dim % next != 0) next++;
    if (next > factor) break;
    m = next, n = dim / next;
  }
  return {std::min(m, n), std::max(m, n)};
}

std::string adapter_settings(const AdapterConfig& a) {
  const std::string name = adapter_type_name(a.type);
  switch (a.type) {
    case ADAPTER_LORA:
    case ADAPTER_DORA: return name + strprintf(" rank %d alpha %g dropout %g", a.rank, a.alpha, a.dropout);
    case ADAPTER_LOHA: return name + strprintf(" rank %d alpha %g", a.rank, a.alpha);
    case ADAPTER_LOKR:
      return name + strprintf(" rank %d alpha %g decompose_both %s decompose_factor %d", a.rank, a.alpha,
                              a.decompose_both ? "true" : "false", a.decompose_factor);
    case ADAPTER_OFT:  // no rank, no scaling
      return name + strprintf(" block_size %d rotation %s block_share %s", a.block_size,
                              a.cayley_neumann ? strprintf("cayley-neumann %d terms", a.neumann_terms).c_str()
                                               : "exact",
                              a.block_share ? "true" : "false");
    case ADAPTER_NONE: break;
  }
  return name;
}

LokrShape lokr_shape(const AdapterConfig& adapter, int in, int out) {
  const auto [a, b] = lokr_factorization(out, adapter.decompose_factor);
  const auto [c, d] = lokr_factorization(in, adapter.decompose_factor);
  // PEFT: "r < max(...) / 2" in real numbers.
  return {a, b, c, d, adapter.decompose_both && 2 * adapter.rank < std::max(a, c), 2 * adapter.rank < std::max(b, d)};
}

bool target_matches(const std::string& target, const std::string& path) {
  if (target == path) return true;
  return path.size() > target.size() && path.compare(path.size() - target.size(), target.size(), target) == 0 &&
         path[path.size() - target.size() - 1] == '.';
}

}  // namespace shardtrain
