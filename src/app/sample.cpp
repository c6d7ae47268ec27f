// See sample.hpp.
#include "app/sample.hpp"

#include <hdf5.h>

#include <boost/program_options.hpp>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>

#include "app/compute_backend.hpp"
#include "app/inference.hpp"
#include "app/options.hpp"
#include "app/perf.hpp"
#include "app/text_encoder.hpp"
#include "ckpt/checkpoint_io.hpp"
#include "ckpt/checkpoint_manager.hpp"
#include "ckpt/h5.hpp"
#include "comm/comm.hpp"
#include "comm/watchdog.hpp"
#include "core/clock.hpp"
#include "core/counted.hpp"
#include "core/format.hpp"
#include "core/random.hpp"
#include "data/flow_matching.hpp"
#include "data/latent_dataset.hpp"
#include "model/families/flux/flux_family.hpp"
#include "model/family.hpp"
#include "model/model.hpp"
#include "shard/fsdp_engine.hpp"

namespace shardtrain {

namespace po = boost::program_options;

std::vector<double> flow_sigmas(int steps, double shift) {
  std::vector<double> sigmas;
  for (int i = 0; i < steps; i++) {
    const double sigma = steps == 1 ? 1.0 : 1.0 - (1.0 - 1.0 / steps) * i / (steps - 1);
    sigmas.push_back(shift * sigma / (1 + (shift - 1) * sigma));
  }
  sigmas.push_back(0.0);
  return sigmas;
}

double flux_resolution_shift(int image_tokens) {
  return std::exp(0.5 + (1.15 - 0.5) / (4096 - 256) * (image_tokens - 256));
}

double flux2_empirical_shift(int image_tokens, int steps) {
  // mu's fit at 10 and at 200 steps, each linear in the image tokens; between them linear in the
  // steps, and past 4300 tokens the 200-step line alone (diffusers' compute_empirical_mu).
  const double at_200 = 0.00016927 * image_tokens + 0.45666666;
  if (image_tokens > 4300) return std::exp(at_200);
  const double at_10 = 8.73809524e-05 * image_tokens + 1.89833333;
  const double slope = (at_200 - at_10) / 190.0;
  return std::exp(at_200 + slope * (steps - 200));
}

double auto_sampling_shift(const ModelConfig& model, int image_tokens, int steps) {
  return is_flux2(model) ? flux2_empirical_shift(image_tokens, steps) : flux_resolution_shift(image_tokens);
}

namespace {

constexpr const char* USAGE_LINE =
    "shardtrain sample --checkpoint CKPT|RUN_DIR --prompts FILE.h5 --output FILE.h5 --grid ROWSxCOLS [--steps N] "
    "[--guidance G] [--cfg S --negative FILE.h5] [--condition FILE.h5] [--shift auto|S] [--seed N] [--batch B]";

struct SampleOptions {
  std::string checkpoint, prompts, negative, condition, output, shift = "auto", device = "cpu", base, text_encoder;
  int rows = 0, cols = 0, steps = 28, batch = 1, threads = 0;
  double guidance = 3.5, cfg = 1.0, comm_timeout = 300;
  uint64_t seed = 0;
};

// Domain of the starting noise, apart from the other users of the seed.
constexpr uint64_t SAMPLE_DOMAIN = 0x73616d706c696e67ull;  // "sampling"

bool parse_sample_args(const Runtime& rt, const std::vector<std::string>& args, SampleOptions& o) {
  std::string grid, steps = "28", guidance = "3.5", cfg = "1", seed = "0", batch = "1", threads = "0", timeout = "300";
  po::options_description desc(std::string("usage: ") + USAGE_LINE + "\n\nsample options");
  desc.add_options()  // one option per line
      ("help,h", "print the options")
      ("checkpoint", po::value(&o.checkpoint)->required(),
       "a model.arch=flux checkpoint (.h5; adapters, if it holds them, applied), or a run folder (its newest)")
      ("base", po::value(&o.base), BASE_HELP)
      ("prompts", po::value(&o.prompts)->required(),
       "HDF5 file of the prompts' text embeddings: encoder_hidden_states (P, L, context_dim) and pooled_projections "
       "(P, pooled_dim), as tools/encode_images.py prompts writes them; for a model trained with a text encoder in "
       "its run, their captions (a `captions` dataset of strings), which that encoder turns into embeddings")
      ("text-encoder", po::value(&o.text_encoder),
       "that text encoder (a ShardTrain checkpoint or Hugging Face folder) if it moved: default the run's recorded "
       "text_encoder.source; its weights must be the ones the model was trained with")
      ("output", po::value(&o.output)->required(),
       "HDF5 file to write: latents (P, rows x cols, in_channels) and grid_rows, grid_cols, for tools/encode_images.py "
       "decode")
      ("grid", po::value(&grid)->required(), "the packed latent grid ROWSxCOLS (1024 x 1024 pixels: 64x64)")
      ("steps", po::value(&steps)->default_value(steps), "Euler steps from noise to image")
      ("guidance", po::value(&guidance)->default_value(guidance),
       "the guidance value a guidance-embedding model (FLUX.1-dev) is given; ignored without one")
      ("cfg", po::value(&cfg)->default_value(cfg),
       "classifier-free guidance scale against --negative (1 = none): v = v_neg + cfg (v - v_neg)")
      ("negative", po::value(&o.negative),
       "HDF5 file of the negative prompts' embeddings (one, or one per prompt), for --cfg; with a text encoder their "
       "captions, by default the empty caption")
      ("condition", po::value(&o.condition),
       "a Kontext model's images to edit: HDF5 file of condition_latents (one, or one per prompt) with "
       "condition_grid_rows and condition_grid_cols, as tools/encode_images.py encode --condition-images writes them")
      ("shift", po::value(&o.shift)->default_value(o.shift),
       "the schedule's shift: auto (by the image size as FLUX.1-dev's pipeline does; FLUX.2 by the image size "
       "and --steps, as its pipeline does), or a factor s (1 = none; FLUX.1-schnell: 1)")
      ("seed", po::value(&seed)->default_value(seed), "the starting noise: a seed gives the same images on any rank count")
      ("batch", po::value(&batch)->default_value(batch), "prompts per forward")
      ("device", po::value(&o.device)->default_value(o.device), "cpu or cuda (one GPU per rank)")
      ("threads", po::value(&threads)->default_value(threads), "threads per rank; 0 = the cores available to the rank")
      ("comm-timeout", po::value(&timeout)->default_value(timeout),
       "seconds before a stuck collective aborts every rank; 0 = off");
  po::variables_map vm;
  if (!parse_command_options(rt, args, desc, "sample", vm)) return false;
  const size_t x = grid.find('x');
  if (x == std::string::npos) throw UsageError("--grid='" + printable_text(grid) + "' is not ROWSxCOLS (e.g. 64x64)");
  o.rows = static_cast<int>(parse_whole_number(grid.substr(0, x), "--grid's rows", 1, 1 << 12));
  o.cols = static_cast<int>(parse_whole_number(grid.substr(x + 1), "--grid's columns", 1, 1 << 12));
  o.steps = static_cast<int>(parse_whole_number(steps, "--steps", 1, 10000));
  o.batch = static_cast<int>(parse_whole_number(batch, "--batch", 1, 1 << 16));
  o.threads = static_cast<int>(parse_whole_number(threads, "--threads", 0, 1 << 16));
  o.seed = parse_whole_number(seed, "--seed", 0, UINT64_MAX);
  o.guidance = parse_real(guidance, "guidance", "give a number >= 0", 0, 1e6, true, "sample");
  o.cfg = parse_real(cfg, "cfg", "give a number >= 1 (1 = none)", 1, 1e6, true, "sample");
  o.comm_timeout = parse_real(timeout, "comm-timeout", "give seconds >= 0 (0 = off)", 0, 1e9, true, "sample");
  if (o.shift != "auto") parse_real(o.shift, "shift", "auto, or a factor > 0 (1 = none)", 0, 1e6, false, "sample");
  if (o.device != "cpu" && o.device != "cuda")
    throw UsageError("--device='" + printable_text(o.device) + "' is not a device; allowed: cpu, cuda");
  return true;
}

}  // namespace

namespace {

// `read()`, its DataError (which names the file) prefixed with the option that named the file.
template <typename Read>
auto naming_option(const std::string& option, Read read) {
  try {
    return read();
  } catch (const DataError& e) {
    throw DataError(option + ": " + e.what());
  }
}

}  // namespace

std::vector<std::string> read_prompt_captions(const std::string& path, const std::string& option) {
  return naming_option(option, [&] {
    std::vector<std::string> captions =
        h5_read_strings(path, "captions", " (shardtrain data synth-images writes prompts with their captions)");
    if (captions.empty()) throw DataError("'" + path + "' holds no captions");
    return captions;
  });
}

Prompts read_prompts(const std::string& path, const ModelConfig& m, const std::string& option) {
  Prompts p;
  std::vector<hsize_t> td, pd;
  const std::string hint = " (tools/encode_images.py prompts and shardtrain data synth-images write them)";
  p.text = naming_option(option, [&] { return h5_read_floats(path, FLUX_ENCODER_HIDDEN_STATES, &td, hint); });
  if (m.pooled_dim > 0)
    p.pooled = naming_option(option, [&] { return h5_read_floats(path, FLUX_POOLED, &pd, hint); });
  else if (td.size() == 3)  // FLUX.2 reads none
    pd = {td[0], 0};
  if (m.pooled_dim == 0 && (td.size() != 3 || td[0] < 1 || td[2] != hsize_t(m.context_dim)))
    throw DataError(strprintf("%s='%s': encoder_hidden_states must be (P, L, %d) for this model (model.context_dim), "
                              "one row per prompt",
                              option.c_str(), path.c_str(), m.context_dim));
  if (td.size() != 3 || pd.size() != 2 || td[0] != pd[0] || td[0] < 1 || td[2] != hsize_t(m.context_dim) ||
      pd[1] != hsize_t(m.pooled_dim))
    throw DataError(strprintf("%s='%s': encoder_hidden_states and pooled_projections must be (P, L, %d) and (P, %d) "
                              "for this model (model.context_dim, model.pooled_dim), one row per prompt",
                              option.c_str(), path.c_str(), m.context_dim, m.pooled_dim));
  p.count = static_cast<int>(td[0]), p.tokens = static_cast<int>(td[1]);
  return p;
}

ConditionImages read_condition_images(const std::string& path, const ModelConfig& m, const std::string& option,
                                      int prompts) {
  ConditionImages c;
  std::vector<hsize_t> dims;
  c.latents = naming_option(option, [&] {
    return h5_read_floats(path, "condition_latents", &dims,
                          " (tools/encode_images.py encode --condition-images writes condition latents)");
  });
  if (dims.size() != 3 || dims[0] < 1 || dims[1] < 1 || dims[2] != hsize_t(m.in_channels))
    throw DataError(strprintf("%s='%s': condition_latents must be (P, M, %d) for this model (model.in_channels): one "
                              "condition image, or one per prompt",
                              option.c_str(), path.c_str(), m.in_channels));
  c.count = static_cast<int>(dims[0]), c.tokens = static_cast<int>(dims[1]);
  if (c.count != 1 && c.count != prompts)
    throw UsageError(strprintf("%s='%s' holds %d condition images; give one, or one per prompt (%d)", option.c_str(),
                               path.c_str(), c.count, prompts));
  H5QuietErrors quiet;
  H5Id file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  c.grids = packed_condition_grids(file, path, option + "='" + path + "'", m, c.tokens);
  return c;
}

FlowSampler::FlowSampler(FsdpEngine& engine, TransformerModel<float>& model, const ModelConfig& config,
                         const SamplerSettings& settings)
    : engine_(engine), model_(model), config_(config), settings_(settings) {}

std::vector<float> FlowSampler::draw(const Prompts& prompts, const Prompts* negative, const ConditionImages* condition) {
  const SamplerSettings& o = settings_;
  const ModelConfig& m = config_;
  const int N = o.rows * o.cols, B = model_.batch(), IN = m.in_channels, L = prompts.tokens;
  const int M = condition ? condition->tokens : 0;
  SHARD_CHECK(model_.seq_len() == N && m.context_len == L && m.condition_len == M,
              "a sampler of %d tokens, %d text tokens and %d condition tokens, the model %d, %d and %d", N, L, M,
              model_.seq_len(), m.context_len, m.condition_len);
  const std::vector<double> sigmas = flow_sigmas(o.steps, o.shift);
  Batch batch;
  const int A = flux_id_axes(m);
  fill_flux_ids(m, batch.put<float>(FLUX_IMG_IDS, {N + M, A}), batch.put<float>(FLUX_TXT_IDS, {L, A}), N, o.cols,
                condition ? condition->grids : std::vector<PackedGrid>{});
  const size_t image = static_cast<size_t>(N) * IN, text = static_cast<size_t>(L) * m.context_dim;
  std::vector<float> latents(static_cast<size_t>(prompts.count) * image), velocity(B * image), negative_v(B * image);
  // The velocity of `x` (B samples of the prompts `images`: their condition images) at noise level
  // sigma with the prompts `which` of `from`, into v.
  auto predict = [&](const std::vector<float>& x, double sigma, const Prompts& from, const std::vector<int>& which,
                     const std::vector<int>& images, std::vector<float>& v) {
    float* hidden = batch.put<float>(FLUX_HIDDEN_STATES, {B, N + M, IN});
    const size_t clean = static_cast<size_t>(M) * IN;
    for (int b = 0; b < B; b++) {  // each sample's noisy target, then its clean condition image
      std::copy_n(x.begin() + b * image, image, hidden + b * (image + clean));
      if (M > 0)
        std::copy_n(condition->latents.begin() + (condition->count == 1 ? 0 : images[b]) * clean, clean,
                    hidden + b * (image + clean) + image);
    }
    float* t = batch.put<float>(FLUX_ENCODER_HIDDEN_STATES, {B, L, m.context_dim});
    float* p = batch.put<float>(FLUX_POOLED, {B, m.pooled_dim});
    float* s = batch.put<float>(FLUX_TIMESTEP, {B});
    float* g = batch.put<float>(FLUX_GUIDANCE, {B});
    for (int b = 0; b < B; b++) {
      const int k = which[b];
      std::copy_n(from.text.data() + k * text, text, t + b * text);
      std::copy_n(from.pooled.data() + static_cast<size_t>(k) * m.pooled_dim, m.pooled_dim, p + b * m.pooled_dim);
      s[b] = static_cast<float>(sigma), g[b] = static_cast<float>(o.guidance);
    }
    const float* out = engine_.forward_prediction(model_, batch);
    engine_.compute_device().copy_to_host(v.data(), out, v.size() * sizeof(float));
  };
  for (int first = 0; first < prompts.count; first += B) {
    std::vector<int> which(B), negative_which(B);
    std::vector<float> x(B * image);
    for (int b = 0; b < B; b++) {
      which[b] = std::min(first + b, prompts.count - 1);
      negative_which[b] = negative && negative->count == 1 ? 0 : which[b];
      const uint64_t key = mix64(mix64(o.seed ^ SAMPLE_DOMAIN) ^ mix64(which[b]));
      for (size_t i = 0; i < image; i++) x[b * image + i] = static_cast<float>(counter_normal(key, i));
    }
    for (int step = 0; step < o.steps; step++) {
      predict(x, sigmas[step], prompts, which, which, velocity);
      if (negative && o.cfg > 1) {
        predict(x, sigmas[step], *negative, negative_which, which, negative_v);
        for (size_t i = 0; i < velocity.size(); i++)
          velocity[i] = negative_v[i] + static_cast<float>(o.cfg) * (velocity[i] - negative_v[i]);
      }
      const float dt = static_cast<float>(sigmas[step + 1] - sigmas[step]);
      for (size_t i = 0; i < x.size(); i++) x[i] += dt * velocity[i];
    }
    for (int b = 0; b < B && first + b < prompts.count; b++)
      std::copy_n(x.data() + b * image, image, latents.data() + (first + b) * image);
  }
  return latents;
}

std::vector<RgbImage> sampled_images(const std::vector<float>& latents, int count, const ModelConfig& model,
                                     const SamplerSettings& o) {
  const size_t image = static_cast<size_t>(o.rows) * o.cols * model.in_channels;
  std::vector<RgbImage> images;
  for (int i = 0; i < count; i++)
    images.push_back(rgb_from_patches(latents.data() + i * image, o.rows, o.cols, model.pixel_patch));
  return images;
}

RgbImage sampled_grid(const std::vector<RgbImage>& images) { return image_grid(images, 8, 2); }

std::string write_sampled_images(const std::string& path, const std::vector<float>& latents, int count,
                                 const ModelConfig& model, const SamplerSettings& o, const std::string& checkpoint,
                                 bool each_png) {
  H5QuietErrors quiet;
  const int channels = model.in_channels;
  const std::string tmp = path + ".tmp";
  {
    H5Id file(h5_check_id(H5Fcreate(tmp.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), tmp, "H5Fcreate"), H5Fclose);
    const hsize_t dims[3] = {hsize_t(count), hsize_t(o.rows) * o.cols, hsize_t(channels)};
    H5Id space(h5_check_id(H5Screate_simple(3, dims, nullptr), tmp, "H5Screate_simple"), H5Sclose);
    H5Id set(h5_check_id(H5Dcreate2(file, "latents", H5T_IEEE_F32LE, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
                         tmp, "H5Dcreate2"),
             H5Dclose);
    h5_check(H5Dwrite(set, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, latents.data()), tmp, "H5Dwrite");
    h5_write_attr_i64(file, "grid_rows", o.rows, tmp);
    h5_write_attr_i64(file, "grid_cols", o.cols, tmp);
    h5_write_attr_i64(file, "steps", o.steps, tmp);
    h5_write_attr_u64(file, "seed", o.seed, tmp);
    h5_write_attr_f64(file, "guidance", o.guidance, tmp);
    h5_write_attr_f64(file, "cfg", o.cfg, tmp);
    h5_write_attr_f64(file, "shift", o.shift, tmp);
    h5_write_attr_str(file, "checkpoint", checkpoint, tmp);
    if (model.pixel_patch > 0) h5_write_attr_i64(file, "pixel_patch", model.pixel_patch, tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    throw UsageError("cannot write the samples '" + printable_text(path) + "': " + std::strerror(errno));
  if (model.pixel_patch == 0) return path;
  // Pixel-space: PNG files too.
  const std::string stem = path.size() > 3 && path.compare(path.size() - 3, 3, ".h5") == 0 ? path.substr(0, path.size() - 3)
                                                                                            : path;
  const std::vector<RgbImage> images = sampled_images(latents, count, model, o);
  write_png(stem + ".png", sampled_grid(images));
  std::string wrote = path + " and " + stem + ".png";
  if (each_png) {
    const std::string folder = stem + "_images";
    std::error_code ec;
    std::filesystem::create_directories(folder, ec);
    if (ec) throw UsageError("cannot create '" + printable_text(folder) + "' for the images: " + ec.message());
    for (int i = 0; i < count; i++) write_png(folder + strprintf("/%04d.png", i), images[i]);
    wrote += ", " + folder + "/NNNN.png";
  }
  return wrote;
}

namespace {

int sample(const Runtime& rt, const SampleOptions& o) {
  Watchdog watchdog(o.comm_timeout, "--comm-timeout");
  ComputeBackend compute(ComputeOptions{o.device}, rt);
  auto comm = make_mpi_comm(rt.world_comm(), &watchdog);
  const int threads = o.threads > 0 ? o.threads : default_threads_per_rank(rt.local_size());
  set_compute_threads(threads);
  const std::string path = checkpoint_file_or_newest(rt, *comm, o.checkpoint, "--checkpoint", &watchdog);
  CheckpointState state;
  Prompts prompts, negative;
  ConditionImages condition;
  // A model trained with a text encoder in its run: the prompts are captions, encoded by it below.
  std::vector<std::string> captions, negative_captions;
  bool encoded = false;
  rt.agree_on([&] {
    state = read_checkpoint_state(path);
    require_capability(state.model, "sample", "checkpoint '" + path + "'");
    encoded = !state.text_encoder.empty();
    if (!encoded && !o.text_encoder.empty())
      throw UsageError("--text-encoder: checkpoint '" + path + "' was trained on cached text embeddings, not with a "
                       "text encoder in its run: remove it and give the prompts' embeddings");
    if (o.cfg > 1 && o.negative.empty() && !encoded)
      throw UsageError(strprintf("--cfg=%g needs --negative (the negative prompts' embeddings); or --cfg=1", o.cfg));
    if (encoded) {
      captions = read_prompt_captions(o.prompts, "--prompts");
      negative_captions = o.negative.empty() ? std::vector<std::string>{""} : read_prompt_captions(o.negative, "--negative");
      if (negative_captions.size() != 1 && negative_captions.size() != captions.size())
        throw UsageError(strprintf("--negative='%s' holds %zu captions; give one, or one per prompt (%zu)",
                                   o.negative.c_str(), negative_captions.size(), captions.size()));
      prompts.count = static_cast<int>(captions.size()), prompts.tokens = state.model.context_len;
    } else {
      prompts = read_prompts(o.prompts, state.model, "--prompts");
    }
    if (!encoded && !o.negative.empty()) {
      negative = read_prompts(o.negative, state.model, "--negative");
      if (negative.tokens != prompts.tokens || (negative.count != 1 && negative.count != prompts.count))
        throw UsageError(strprintf("--negative='%s' holds %d prompts of %d tokens; give one, or one per prompt (%d), "
                                   "of --prompts' %d tokens",
                                   o.negative.c_str(), negative.count, negative.tokens, prompts.count, prompts.tokens));
    }
    if (state.model.condition_len > 0 && o.condition.empty())
      throw UsageError("checkpoint '" + path + "' is a Kontext model (model.condition_len=" +
                       std::to_string(state.model.condition_len) +
                       "): give the images to edit, --condition FILE.h5 (condition_latents, as tools/encode_images.py "
                       "encode --condition-images writes them)");
    if (state.model.condition_len == 0 && !o.condition.empty())
      throw UsageError("--condition: checkpoint '" + path + "' is no Kontext model (it was trained with "
                       "model.condition_len=0): sample it without --condition");
    if (!o.condition.empty()) {
      condition = read_condition_images(o.condition, state.model, "--condition", prompts.count);
    }
  });
  // The run's sizes: the prompts' text length, the grid's image tokens.
  ModelConfig m = state.model;
  m.context_len = prompts.tokens;
  m.condition_len = condition.tokens;
  const int N = o.rows * o.cols, B = o.batch;
  m.max_seq_len = std::max(m.max_seq_len, N);
  const ParamTable table(m, {}, state.adapter);  // a model trained with adapters: with them
  InferenceWeights weights(rt, compute, *comm, watchdog, table, path, o.base);
  FsdpEngine& engine = weights.engine;
  MemoryTracker& memory = weights.memory;
  auto model = make_model<float>(table, B, N, true, *compute.backend().ops);
  std::unique_ptr<TextEncoder> encoder;
  if (encoded) {
    TextEncoderOptions e;
    e.source = o.text_encoder.empty() ? state.text_encoder : o.text_encoder;
    e.layers = state.text_encoder_layers;
    // The recorded tokenizer, unless it is gone with a moved encoder: then the new source's.
    if (o.text_encoder.empty() || std::filesystem::exists(state.text_encoder_tokenizer))
      e.tokenizer = state.text_encoder_tokenizer;
    std::shared_ptr<const CaptionTokenizer> tokenizer;
    rt.agree_on([&] { tokenizer = text_encoder_tokenizer(e, m.context_len); });
    QuantConfig quant{QUANT_NONE, static_cast<size_t>(state.text_encoder_quant_block),
                      state.text_encoder_all_linear == 1, true, "text_encoder.dtype"};
    parse_quant_type(state.text_encoder_dtype, &quant.type);  // checked when the file was read
    encoder = std::make_unique<TextEncoder>(rt, *comm, *weights.shard_comm, *weights.replica_comm, compute,
                                            inference_options(rt, compute), e, quant, tokenizer, m, B, &watchdog);
    rt.agree_on([&] {
      if (encoder->checksum() != state.text_encoder_checksum)
        throw UsageError(strprintf("the text encoder '%s' has checksum %s; checkpoint '%s' was trained with one of "
                                   "checksum %s: give that encoder (--text-encoder)",
                                   e.source.c_str(), checksum_text(encoder->checksum()).c_str(), path.c_str(),
                                   checksum_text(state.text_encoder_checksum).c_str()));
    });
    prompts = encoder->encode_captions(captions, "--prompts='" + o.prompts + "'");
    if (o.cfg > 1)
      negative = encoder->encode_captions(negative_captions, o.negative.empty() ? "the empty caption"
                                                                                 : "--negative='" + o.negative + "'");
  }
  const double shift = o.shift == "auto" ? auto_sampling_shift(m, N, o.steps) : std::strtod(o.shift.c_str(), nullptr);
  if (rt.is_root())
    std::fprintf(stderr,
                 "sample: %s (step %lld) | %s | %s, %s | %d %s of %d x %d latent tokens, %d steps, shift %.4g, guidance "
                 "%g, cfg %g | memory per rank %s\n",
                 path.c_str(), static_cast<long long>(state.step), model_summary(m).c_str(),
                 counted(rt.world(), "rank").c_str(), counted(threads, "thread").c_str(), prompts.count,
                 prompts.count == 1 ? "image" : "images", o.rows, o.cols, o.steps, shift, o.guidance, o.cfg,
                 human_bytes(static_cast<double>(memory.total_current() + model->activation_bytes() +
                                                 (encoder ? encoder->memory().total_current() : 0)))
                     .c_str());

  SamplerSettings settings;
  settings.rows = o.rows, settings.cols = o.cols, settings.steps = o.steps, settings.guidance = o.guidance;
  settings.cfg = o.cfg, settings.shift = shift, settings.seed = o.seed;
  FlowSampler sampler(engine, *model, m, settings);
  comm->barrier("barrier(sample start)");
  const double t0 = now_seconds();
  const std::vector<float> latents =
      sampler.draw(prompts, negative.count > 0 ? &negative : nullptr, condition.tokens > 0 ? &condition : nullptr);
  const double t1 = now_seconds();
  std::string wrote;
  rt.agree_on([&] {
    if (rt.is_root()) wrote = write_sampled_images(o.output, latents, prompts.count, m, settings, path, true);
  });
  if (rt.is_root())
    std::fprintf(stderr, "sample: wrote %s: %s in %.2f s (%.3g ms per image and forward)\n", wrote.c_str(),
                 counted(prompts.count, "image").c_str(), t1 - t0,
                 1e3 * (t1 - t0) / std::max(1, prompts.count * o.steps * (o.cfg > 1 ? 2 : 1)));
  return EXIT_CODE_OK;
}

}  // namespace

int run_sample(Runtime& rt, const std::vector<std::string>& args) {
  SampleOptions options;
  bool go = true;
  rt.agree_on([&] { go = parse_sample_args(rt, args, options); });
  if (!go) return EXIT_CODE_OK;
  rt.set_collective_timeout({options.comm_timeout, "--comm-timeout"});
  return sample(rt, options);
}

}  // namespace shardtrain
