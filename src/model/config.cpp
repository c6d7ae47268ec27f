// See config.hpp.
#include "model/config.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "data/token_file.hpp"
#include "model/rope_scaling.hpp"

namespace shardtrain {

void canonicalize(ModelConfig& m) {
  if (m.n_head > 0 && m.head_dim == m.n_embd / m.n_head) m.head_dim = 0;
  RopeScaling scaling;
  std::string defect;
  if (RopeScaling::parse(m.rope_scaling, &scaling, &defect)) m.rope_scaling = scaling.text();
  std::vector<bool> without;
  if (parse_nope_layers(m.nope_layers, m.n_layer, &without, &defect)) m.nope_layers = nope_layers_text(without);
  // A window no sequence of the model reaches is no window (Mistral's default 4096 on a shorter
  // model; what checkpoints before the window recorded as none).
  if (m.sliding_window >= m.max_seq_len) m.sliding_window = 0;  // a negative one is left to be named
}

bool parse_nope_layers(const std::string& text, int n_layer, std::vector<bool>* without, std::string* error) {
  without->assign(std::max(n_layer, 0), false);
  size_t at = 0;
  while (at < text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, comma - at);
    at = comma + 1;
    if (comma + 1 == text.size())
      return *error = strprintf("model.nope_layers='%s' ends with a comma", text.c_str()), false;
    const bool digits = !item.empty() && item.size() <= 9 &&
                        std::all_of(item.begin(), item.end(), [](char c) { return c >= '0' && c <= '9'; });
    const long l = digits ? std::stol(item) : -1;
    if (!digits || l >= n_layer)
      return *error = strprintf("model.nope_layers='%s': '%s' is not a block index in [0, %d)", text.c_str(),
                                item.c_str(), n_layer),
             false;
    if ((*without)[l])
      return *error = strprintf("model.nope_layers='%s': block %ld is given twice", text.c_str(), l), false;
    (*without)[l] = true;
  }
  return true;
}

std::string nope_layers_text(const std::vector<bool>& without) {
  std::string text;
  for (size_t l = 0; l < without.size(); l++)
    if (without[l]) text += (text.empty() ? "" : ",") + std::to_string(l);
  return text;
}

std::string model_shape_defect(int64_t L, int64_t C, int64_t H, int64_t V, int64_t P, int64_t I) {
  const auto ll = [](int64_t x) { return static_cast<long long>(x); };
  if (L < 1 || L > (1 << 16)) return strprintf("model.n_layer=%lld is not in [1, 65536]", ll(L));
  if (H < 1 || H > (1 << 20)) return strprintf("model.n_head=%lld is not in [1, 2^20]", ll(H));
  if (C < 1 || C > (1 << 20) || C % H)
    return strprintf("model.n_embd=%lld is not a multiple of model.n_head=%lld in [1, 2^20]", ll(C), ll(H));
  if (V < 2 || V > MAX_VOCAB_SIZE) return strprintf("model.vocab_size=%lld is not in [2, %d]", ll(V), MAX_VOCAB_SIZE);
  if (P < 1 || P > (1 << 24)) return strprintf("model.max_seq_len=%lld is not in [1, 2^24]", ll(P));
  if (I < 0 || I > (1 << 24)) return strprintf("model.intermediate_size=%lld is not in [0, 2^24]", ll(I));
  const double mlp = I > 0 ? static_cast<double>(I) : 4.0 * C;
  if (static_cast<double>(L) * C * (4.0 * C + 3 * mlp) + static_cast<double>(V) * C > 1e13)
    return strprintf("model.n_layer=%lld, n_embd=%lld and vocab_size=%lld make more than 10^13 parameters", ll(L),
                     ll(C), ll(V));
  return "";
}

}  // namespace shardtrain
