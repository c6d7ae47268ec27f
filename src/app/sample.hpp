// `shardtrain sample`: images from a diffusion-transformer checkpoint (model.arch=flux; docs/flux.md,
// "Sampling"). Every rank loads its shards into an inference FSDP engine (any rank count) and runs
// the same forwards, the parameters gathered block by block as in training. The flow-matching Euler
// sampler integrates dx/dsigma = v from pure noise at sigma = 1 to sigma = 0 over --steps steps:
// x <- x + (sigma_next - sigma) v(x, sigma), on FLUX's schedule (sigmas linear from 1 to 1/steps,
// then shifted: as the family's diffusers pipeline does, by a fixed factor, or not), the
// guidance value fed to a guidance-embedding model, and classifier-free guidance against negative
// prompts (v = v_neg + cfg (v - v_neg)), and for a Kontext model its condition images (clean
// tokens after the target's, ids (1, row, col)). The prompts are text embeddings (tools/encode_images.py
// prompts or data synth-images writes them); the output, the packed latents of each image, is an
// HDF5 file that tools/encode_images.py decode turns into PNG files -- or, for a pixel-space model,
// PNG files written beside it (docs/images.md). Each image's starting noise is a pure
// function of (--seed, its prompt's index): the same images on any rank count and batch size.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/runtime.hpp"
#include "data/pixel_image.hpp"
#include "model/config.hpp"
#include "model/families/flux/flux_family.hpp"

namespace shardtrain {

class FsdpEngine;
template <typename Real>
class TransformerModel;

// The noise levels of the sampler's `steps` steps and the final 0: linear from 1 to 1/steps, each
// shifted by sigma' = s sigma / (1 + (s - 1) sigma) (s = 1: none). FLUX.1-dev's pipeline uses s =
// exp(mu), mu linear from 0.5 at 256 image tokens to 1.15 at 4096 (flux_resolution_shift); FLUX.2's
// pipeline an empirical mu of the image tokens and the step count (flux2_empirical_shift).
std::vector<double> flow_sigmas(int steps, double shift);
double flux_resolution_shift(int image_tokens);
double flux2_empirical_shift(int image_tokens, int steps);
// The shift `--shift auto` and training's samples use: the model family's pipeline's.
double auto_sampling_shift(const ModelConfig& model, int image_tokens, int steps);

// Prompts as text embeddings: `count` of them, each `tokens` tokens of the model's context_dim and
// a pooled vector.
struct Prompts {
  std::vector<float> text, pooled;
  int count = 0, tokens = 0;
};
// An HDF5 file's encoder_hidden_states (P, L, context_dim) and pooled_projections (P, pooled_dim);
// DataError naming `option` and the file unless they fit the model.
Prompts read_prompts(const std::string& path, const ModelConfig& model, const std::string& option);
// The prompts' captions (an HDF5 file's `captions` strings: what data synth-images writes), for a
// model conditioned by a text encoder in the job; DataError naming `option` and the file.
std::vector<std::string> read_prompt_captions(const std::string& path, const std::string& option);

// Kontext's condition images as packed latents: `count` sets of them (one for every prompt, or one
// per prompt), each `tokens` tokens of in_channels: one image (FLUX.1 Kontext) or several reference
// images (FLUX.2) on their `grids`, concatenated; clean, after the target's tokens, with the
// position ids fill_flux_ids gives them.
struct ConditionImages {
  std::vector<float> latents;
  int count = 0, tokens = 0;
  std::vector<PackedGrid> grids;
};
// An HDF5 file's condition_latents (P, M, in_channels) with condition_grid_rows and
// condition_grid_cols, scalars or one per image (what tools/encode_images.py writes with
// --condition-images); DataError naming `option` and the file unless they fit the model, UsageError
// unless they are one, or one for each of `prompts`.
ConditionImages read_condition_images(const std::string& path, const ModelConfig& model, const std::string& option,
                                      int prompts);

// How the sampler steps.
struct SamplerSettings {
  int rows = 0, cols = 0, steps = 28;  // the packed latent grid
  double guidance = 3.5, cfg = 1.0, shift = 1.0;
  uint64_t seed = 0;
};

// The flow-matching Euler sampler over a model's prediction (Predictor), through an engine that
// holds its parameters (training's or an inference one): batches of the model's batch() prompts,
// the last filled with copies of its last prompt. Collective over the engine's groups.
class FlowSampler {
 public:
  FlowSampler(FsdpEngine& engine, TransformerModel<float>& model, const ModelConfig& config,
              const SamplerSettings& settings);
  // The images of every prompt: count x (rows x cols) x in_channels, host memory. `negative`:
  // one prompt, or one per prompt, for classifier-free guidance (settings.cfg > 1), else null.
  // `condition`: Kontext's condition images (the model's condition_len tokens each), else null.
  std::vector<float> draw(const Prompts& prompts, const Prompts* negative, const ConditionImages* condition = nullptr);

 private:
  FsdpEngine& engine_;
  TransformerModel<float>& model_;
  ModelConfig config_;
  SamplerSettings settings_;
};

// A pixel-space model's images (model.pixel_patch > 0) as 8-bit RGB, and side by side (8 a row, 2
// black pixels apart).
std::vector<RgbImage> sampled_images(const std::vector<float>& latents, int count, const ModelConfig& model,
                                     const SamplerSettings& settings);
RgbImage sampled_grid(const std::vector<RgbImage>& images);
// Rank 0 writes `latents` (count images of `model`) with the grid and the settings as attributes,
// committed by a rename. A pixel-space model's images (model.pixel_patch > 0) also go to PNG files:
// all of them side by side in PATH's stem + ".png" (sampled_grid), and with `each_png` one file per
// image, STEM_images/NNNN.png. Returns what it wrote (for the log); UsageError naming the path
// when it cannot.
std::string write_sampled_images(const std::string& path, const std::vector<float>& latents, int count,
                                 const ModelConfig& model, const SamplerSettings& settings, const std::string& checkpoint,
                                 bool each_png);

// The `sample` command: parses `args` (after the word "sample"), samples, writes. Collective;
// returns the exit code. Throws InputError (agreed by every rank) on bad input.
int run_sample(Runtime& rt, const std::vector<std::string>& args);

}  // namespace shardtrain
