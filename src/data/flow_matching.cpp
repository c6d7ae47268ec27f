// See flow_matching.hpp.
#include "data/flow_matching.hpp"

#include <cmath>

#include "core/random.hpp"

namespace shardtrain {

namespace {

constexpr uint64_t FLOW_DOMAIN = 0x666c6f776d617463ull;  // "flowmatc": apart from the other users of the seed
constexpr uint64_t VALIDATION_SALT = 0x76616c6964617465ull;
constexpr uint64_t NOISE_SALT = 0x6e6f697365ull;
constexpr double VALIDATION_SIGMAS[3] = {0.25, 0.5, 0.75};

}  // namespace

const char* sigma_sampling_name(SigmaSampling s) { return s == SIGMA_UNIFORM ? "uniform" : "logit_normal"; }

uint64_t flow_sample_key(uint64_t seed, uint64_t sample, bool validation) {
  return mix64(mix64(seed ^ FLOW_DOMAIN) ^ mix64(sample) ^ (validation ? VALIDATION_SALT : 0));
}

uint64_t flow_noise_key(uint64_t key) { return mix64(key ^ NOISE_SALT); }

double draw_sigma(const FlowOptions& o, uint64_t key, int image_tokens, uint64_t sample, bool validation) {
  if (validation) return VALIDATION_SIGMAS[sample % 3];
  double sigma = o.sigma_sampling == SIGMA_UNIFORM
                     ? counter_uniform(key, 0)
                     : 1.0 / (1.0 + std::exp(-(o.logit_mean + o.logit_std * counter_normal(key, 1))));
  double shift = o.shift;
  if (o.resolution_shift) {
    const double mu = 0.5 + (1.15 - 0.5) / (4096 - 256) * (image_tokens - 256);
    shift = std::exp(mu);
  }
  return shift * sigma / (1 + (shift - 1) * sigma);
}

float train_sigma(const FlowOptions& o, uint64_t seed, int image_tokens, uint64_t sample) {
  return static_cast<float>(draw_sigma(o, flow_sample_key(seed, sample, false), image_tokens, sample, false));
}

}  // namespace shardtrain
