// See inspect.hpp.
#include "app/inspect.hpp"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <utility>
#include <vector>

#include "ckpt/checkpoint_io.hpp"
#include "core/counted.hpp"
#include "core/format.hpp"

namespace shardtrain {

static double l2_norm(const std::vector<float>& v) {
  double sum = 0;
  for (float x : v) sum += static_cast<double>(x) * x;
  return std::sqrt(sum);
}

// The data a run trained on, as the checkpoint records it (TokenDataset::identity: a line "<bytes>
// <path>" per file, in stream order): what a resume compares, by file name and size.
static void print_dataset_identity(const char* option, const std::string& identity) {
  std::vector<std::pair<unsigned long long, std::string>> files;
  unsigned long long total = 0;
  std::istringstream lines(identity);
  for (std::string line; std::getline(lines, line);) {
    const size_t space = line.find(' ');
    files.emplace_back(std::strtoull(line.substr(0, space).c_str(), nullptr, 10),
                       space == std::string::npos ? "" : line.substr(space + 1));
    total += files.back().first;
  }
  if (files.empty()) {
    std::printf("%s: none\n", option);
    return;
  }
  std::printf("%s: %s, %llu bytes\n", option, counted(static_cast<long long>(files.size()), "file").c_str(), total);
  for (const auto& [bytes, path] : files) std::printf("  %12llu  %s\n", bytes, path.c_str());
}

void inspect_checkpoint(const std::string& path) {
  CheckpointReader reader(path);  // validates the whole file first
  const CheckpointState& s = reader.state();
  if (!s.warning.empty()) std::fprintf(stderr, "warning: %s\n", s.warning.c_str());
  const ModelConfig& m = s.model;
  const ParamTable& table = reader.table();  // the model with the file's adapters
  std::printf("checkpoint %s\n", path.c_str());
  std::printf("format %s version %lld, layout %s\n", CKPT_FORMAT_NAME, static_cast<long long>(s.version),
              s.layout.c_str());
  std::printf("step %lld, tokens seen %lld, saved on %s (%s), seed %llu, sampler at step %lld\n",
              static_cast<long long>(s.step), static_cast<long long>(s.tokens_seen),
              counted(s.world_size, "rank").c_str(), s.strategy.c_str(), static_cast<unsigned long long>(s.seed),
              static_cast<long long>(s.sampler_step));
  const ParamTable base(m);
  std::printf("model: %s, %zu parameters (%.1f MiB fp32)\n", model_summary(m).c_str(), base.total_params(),
              base.total_params() * 4.0 / (1 << 20));
  if (s.adapter.type != ADAPTER_NONE) {
    std::string targets;
    for (const std::string& t : s.adapter.targets) targets += (targets.empty() ? "" : ",") + t;
    std::printf("adapters: %s on %s, %zu parameters\n", adapter_settings(s.adapter).c_str(), targets.c_str(),
                table.total_params() - base.total_params());
  }
  if (s.has_base_checksum)
    std::printf("base model checksum %s%s\n", checksum_text(s.base_checksum).c_str(),
                s.adapters_only ? " (not in the file)" : "");
  if (s.adapters_only)
    std::printf("adapter-only checkpoint: the adapters and their optimizer state alone; resume it with the base model "
                "of that checksum as checkpoint.init_from\n");
  if (!s.quantized_dtype.empty()) {
    size_t weights = 0, elements = 0;
    for (const ParamInfo& p : table.params())
      if (reader.content().in_records(p))
        weights++, elements += p.numel;
    QuantType type = QUANT_NONE;
    parse_quant_type(s.quantized_dtype, &type);
    const size_t block = static_cast<size_t>(s.quantized_block);
    const bool nested = s.quantized_double_quant == 1;
    std::printf("quantized frozen base: %s in %s%s (%s per element) as their records in /quantized%s, "
                "%s; the norms below are of the dequantized values\n",
                counted(static_cast<long long>(weights), "weight").c_str(), s.quantized_dtype.c_str(),
                nested ? " with double quantization" : "",
                strprintf("%zu-element blocks, %.4g bytes", block, quant_bytes_per_element(type, block, nested))
                    .c_str(),
                nested ? " and /quantized_nested" : "",
                human_bytes(elements * quant_bytes_per_element(type, block, nested)).c_str());
  }
  if (!s.text_encoder.empty())
    std::printf("text encoder in the job: %s, hidden states %s, held in %s, tokenizer %s, checksum %s (not in the "
                "file)\n",
                s.text_encoder.c_str(), s.text_encoder_layers.c_str(), s.text_encoder_dtype.c_str(),
                s.text_encoder_tokenizer.c_str(), checksum_text(s.text_encoder_checksum).c_str());
  if (s.has_dataset) {
    print_dataset_identity("data.train_file", s.dataset_train);
    print_dataset_identity("data.val_file", s.dataset_val);
  } else {
    std::printf("data files: not recorded (a checkpoint of an older build)\n");
  }
  std::printf("\nconfiguration at save time:\n%s\n", s.config_ini.c_str());
  std::printf("%-28s %-12s %10s %12s %12s %12s  %s\n", "parameter", "shape", "elements", "norm", "exp_avg",
              "exp_avg_sq", "dataset");
  for (const ParamInfo& p : table.params()) {
    if (!reader.holds(p)) continue;
    const std::string& unit = table.units()[p.unit].name;
    std::string shape;
    for (size_t d = 0; d < p.shape.size(); d++) shape += (d ? "x" : "") + std::to_string(p.shape[d]);
    double norms[3];
    for (int t = 0; t < 3; t++)
      norms[t] = l2_norm(reader.read(p, unit, static_cast<CheckpointReader::Tensor>(t)));
    std::printf("%-28s %-12s %10zu %12.5g %12.5g %12.5g  %s\n", p.name.c_str(), shape.c_str(), p.numel, norms[0],
                norms[1], norms[2], reader.dataset_path(p, unit, CheckpointReader::TENSOR_PARAMS).c_str());
  }
}

}  // namespace shardtrain
