// See llmc.hpp.
#include "ckpt/llmc.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "ckpt/checkpoint_io.hpp"
#include "core/error.hpp"
#include "model/families/gpt2/gpt2_family.hpp"  // llm.c files hold GPT-2s

namespace shardtrain {

int llmc_padded_vocab(int vocab_size) { return (vocab_size + 127) / 128 * 128; }

size_t llmc_element_offset(const ParamTable& table, const ParamInfo& param) {
  const ModelConfig& c = table.config();
  const size_t C = c.n_embd, L = c.n_layer;
  const size_t wte = static_cast<size_t>(llmc_padded_vocab(c.vocab_size)) * C, wpe = c.max_seq_len * C;
  const ParamInfo& block0 = table.params()[table.units()[1].params[0]];
  if (param.unit == ROOT_UNIT) {
    size_t blocks = 0;
    for (int id : table.units()[1].params) blocks += L * table.params()[id].numel;
    switch (param.id) {
      case 0: return 0;                              // wte
      case 1: return wte;                            // wpe
      case 2: return wte + wpe + blocks;             // ln_f.weight
      default: return wte + wpe + blocks + C;        // ln_f.bias
    }
  }
  // Block tensors are stacked over layers, in the same order as our Gpt2BlockParam.
  const int layer = param.unit - 1;
  const int kind = param.id - (block0.id + layer * BLOCK_PARAM_COUNT);
  size_t offset = wte + wpe;
  for (int k = 0; k < kind; k++) offset += L * table.params()[table.units()[1].params[k]].numel;
  return offset + layer * param.numel;
}

void export_llmc(const std::string& checkpoint_path, const std::string& out_path) {
  CheckpointReader reader(checkpoint_path);
  if (!reader.state().warning.empty()) std::fprintf(stderr, "warning: %s\n", reader.state().warning.c_str());
  const ModelConfig& m = reader.state().model;
  if (!family_of(m).llmc_files())
    throw UsageError("checkpoint '" + checkpoint_path + "' holds a " + m.arch +
                     " model; llm.c's file format is GPT-2's: export it with --format hf");
  if (reader.state().adapter.type != ADAPTER_NONE)
    throw UsageError("checkpoint '" + checkpoint_path + "' holds adapters, which llm.c's format cannot: export "
                     "them with --adapter, or the merged model with --format hf --merge");
  ParamTable table(m);
  int header[256] = {0};
  header[0] = LLMC_MAGIC, header[1] = LLMC_VERSION_FP32, header[2] = m.max_seq_len, header[3] = m.vocab_size;
  header[4] = m.n_layer, header[5] = m.n_head, header[6] = m.n_embd, header[7] = llmc_padded_vocab(m.vocab_size);
  const std::string tmp = out_path + ".tmp";
  std::FILE* out = std::fopen(tmp.c_str(), "wb");
  if (!out) throw UsageError("cannot write '" + out_path + "': " + std::strerror(errno));
  bool ok = std::fwrite(header, sizeof header, 1, out) == 1;
  // Write in llm.c order: sort our parameters by their llm.c offset.
  std::vector<std::pair<size_t, int>> order;
  for (const ParamInfo& p : table.params()) order.emplace_back(llmc_element_offset(table, p), p.id);
  std::sort(order.begin(), order.end());
  for (auto [offset, id] : order) {
    const ParamInfo& p = table.params()[id];
    std::vector<float> values = reader.read(p, table.units()[p.unit].name, CheckpointReader::TENSOR_PARAMS);
    if (id == 0) values.resize(static_cast<size_t>(header[7]) * m.n_embd, 0.0f);  // zero rows up to Vp
    ok = ok && std::fwrite(values.data(), sizeof(float), values.size(), out) == values.size();
  }
  ok = (std::fclose(out) == 0) && ok;
  if (!ok || std::rename(tmp.c_str(), out_path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw UsageError("cannot write '" + out_path + "': " + std::strerror(errno) + " (disk full?)");
  }
  std::printf("wrote %s (llm.c GPT-2 fp32: L=%d C=%d H=%d V=%d padded to %d, max_seq_len %d)\n", out_path.c_str(),
              m.n_layer, m.n_embd, m.n_head, m.vocab_size, header[7], m.max_seq_len);
}

static void read_llmc_shards(const std::string& path, FsdpEngine& engine) {
  const ParamTable& table = engine.table();
  const ModelConfig& m = table.config();
  const ParamTable base(m);  // the file's layout: the model without adapters (theirs come after, by id)
  if (!family_of(m).llmc_files())
    throw UsageError("checkpoint.init_from '" + path + "' is an llm.c file, which holds GPT-2 weights, but "
                     "model.arch=" + m.arch + "; give a Hugging Face folder instead");
  std::FILE* in = std::fopen(path.c_str(), "rb");
  if (!in) throw CheckpointError("checkpoint.init_from '" + path + "': cannot open: " + std::strerror(errno));
  struct Closer {
    std::FILE* f;
    ~Closer() { std::fclose(f); }
  } closer{in};
  int header[256];
  if (std::fread(header, sizeof header, 1, in) != 1)
    throw CheckpointError("checkpoint.init_from '" + path + "': shorter than the 1024-byte llm.c header");
  if (header[0] != LLMC_MAGIC || header[1] != LLMC_VERSION_FP32)
    throw CheckpointError(strprintf("checkpoint.init_from '%s': magic %d version %d, expected an llm.c fp32 "
                                    "checkpoint (magic %d, version %d)", path.c_str(), header[0], header[1],
                                    LLMC_MAGIC, LLMC_VERSION_FP32));
  const int expected[5] = {m.max_seq_len, m.vocab_size, m.n_layer, m.n_head, m.n_embd};
  const char* names[5] = {"model.max_seq_len", "model.vocab_size", "model.n_layer", "model.n_head", "model.n_embd"};
  for (int i = 0; i < 5; i++)
    if (header[2 + i] != expected[i])
      throw CheckpointError(strprintf("checkpoint.init_from '%s' holds %s=%d but the configuration says %d",
                                      path.c_str(), names[i], header[2 + i], expected[i]));
  if (header[7] != llmc_padded_vocab(m.vocab_size) && header[7] < m.vocab_size)
    throw CheckpointError("checkpoint.init_from '" + path + "': padded vocabulary smaller than the vocabulary");
  // Offsets assume our padding rule; llm.c files always use a multiple of 128 (50304 for GPT-2).
  const long long vocab_extra = static_cast<long long>(header[7] - llmc_padded_vocab(m.vocab_size)) * m.n_embd;
  engine.fill_base_shards([&](const ParamInfo& p, float* slice, const FlatRange& part) {
    const size_t from = part.begin, to = part.end;
    long long element = static_cast<long long>(llmc_element_offset(base, base.params()[p.id])) +
                        (p.id == 0 ? 0 : vocab_extra) + static_cast<long long>(from - p.offset);
    if (std::fseek(in, 1024 + element * 4, SEEK_SET) != 0 || std::fread(slice, sizeof(float), to - from, in) != to - from)
      throw CheckpointError("checkpoint.init_from '" + path + "': file too short (truncated?) while reading " + p.name);
    // Caught here, not steps later as a divergence. Each rank checks its slice; the caller agrees.
    const float* bad = std::find_if(slice, slice + (to - from), [](float x) { return !std::isfinite(x); });
    if (bad != slice + (to - from))
      throw CheckpointError(strprintf("checkpoint.init_from '%s': tensor %s holds %g at element %zu: the file is "
                                      "damaged or comes from a run that diverged; use another file",
                                      path.c_str(), p.name.c_str(), *bad, from - p.offset + (bad - slice)));
  });
}

void load_llmc_shards(const std::string& path, FsdpEngine& engine) {
  engine.load_base([&] { read_llmc_shards(path, engine); });
}

}  // namespace shardtrain
