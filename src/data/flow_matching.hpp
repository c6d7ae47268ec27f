// Rectified-flow training of a diffusion transformer (docs/flux.md): a clean latent x0 and noise
// e ~ N(0, 1) make x_sigma = (1 - sigma) x0 + sigma e at a noise level sigma in (0, 1); the model
// predicts the velocity e - x0, trained with the mean squared error. sigma is drawn uniform or
// logit-normal (sigmoid of N(mean, std)), then optionally shifted towards noise:
//   sigma' = s sigma / (1 + (s - 1) sigma),
// with s fixed (flow.shift) or FLUX's resolution-dependent exp(mu), mu on the line through
// (256 image tokens, 0.5) and (4096, 1.15). Every draw is a pure function of (train.seed, the
// sample's number): the same on any rank count and in a resumed run. Validation uses fixed noise
// levels (0.25, 0.5, 0.75 in turn) and its own noise stream.
#pragma once

#include <cstdint>
#include <string>

namespace shardtrain {

enum SigmaSampling { SIGMA_UNIFORM, SIGMA_LOGIT_NORMAL };
const char* sigma_sampling_name(SigmaSampling s);

struct FlowOptions {
  SigmaSampling sigma_sampling = SIGMA_UNIFORM;
  double logit_mean = 0, logit_std = 1;  // logit_normal's
  double shift = 1;                      // 1 = none
  bool resolution_shift = false;         // FLUX's shift by image size (replaces flow.shift)
  double guidance = 1;                   // the guidance value a guidance-embedding model is trained with
  // The probability of training a sample on the empty caption (its text and pooled embeddings all
  // zero) instead of its own, drawn from the sample's key: the unconditional model that sampling
  // with classifier-free guidance (--cfg against an all-zero --negative) needs.
  double caption_dropout = 0;
  // Pictures while it learns: every sample_every steps (0: never) the model draws sample_prompts'
  // images (app/sample.hpp), sample_steps Euler steps at sample_guidance, on the data's grid.
  int sample_every = 0;
  std::string sample_prompts;
  std::string sample_condition;  // a Kontext model's images to edit, one or one per prompt
  int sample_steps = 20;
  double sample_guidance = 3.5;
  double sample_cfg = 1;  // > 1: classifier-free guidance against the empty caption
};

// The key of one sample's draws.
uint64_t flow_sample_key(uint64_t seed, uint64_t sample, bool validation);
// Its noise level for an image of `image_tokens` tokens.
double draw_sigma(const FlowOptions& options, uint64_t key, int image_tokens, uint64_t sample, bool validation);
// The noise level training sample `sample` is drawn at, as the model gets it (fp32): what
// LatentDataset fills and the trainer's loss by noise level buckets.
float train_sigma(const FlowOptions& options, uint64_t seed, int image_tokens, uint64_t sample);
// The sample key's counters: 0 the uniform sigma, 2 and 3 the logit-normal one, this one caption dropout.
constexpr uint64_t FLOW_CAPTION_DROPOUT_COUNTER = 4;
// Element i of its noise: counter_normal(noise key, i).
uint64_t flow_noise_key(uint64_t key);

}  // namespace shardtrain
