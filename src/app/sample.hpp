// `shardtrain sample`: images from a diffusion-transformer checkpoint (model.arch=flux; docs/flux.md,
// "Sampling"). Every rank loads its shards into an inference FSDP engine (any rank count) and runs
// the same forwards, the parameters gathered block by block as in training. The flow-matching Euler
// sampler integrates dx/dsigma = v from pure noise at sigma = 1 to sigma = 0 over --steps steps:
// x <- x + (sigma_next - sigma) v(x, sigma), on FLUX.1's schedule (sigmas linear from 1 to 1/steps,
// then shifted: by the image size as FLUX.1-dev's pipeline does, by a fixed factor, or not), the
// guidance value fed to a guidance-embedding model, and classifier-free guidance against negative
// prompts (v = v_neg + cfg (v - v_neg)). The prompts are text embeddings (tools/encode_images.py
// prompts writes them); the output, the packed latents of each image, is an HDF5 file that
// tools/encode_images.py decode turns into PNG files. Each image's starting noise is a pure
// function of (--seed, its prompt's index): the same images on any rank count and batch size.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/runtime.hpp"

namespace shardtrain {

// The noise levels of the sampler's `steps` steps and the final 0: linear from 1 to 1/steps, each
// shifted by sigma' = s sigma / (1 + (s - 1) sigma) (s = 1: none). FLUX.1-dev's pipeline uses s =
// exp(mu), mu linear from 0.5 at 256 image tokens to 1.15 at 4096 (flux_resolution_shift).
std::vector<double> flow_sigmas(int steps, double shift);
double flux_resolution_shift(int image_tokens);

// The `sample` command: parses `args` (after the word "sample"), samples, writes. Collective;
// returns the exit code. Throws InputError (agreed by every rank) on bad input.
int run_sample(Runtime& rt, const std::vector<std::string>& args);

}  // namespace shardtrain
