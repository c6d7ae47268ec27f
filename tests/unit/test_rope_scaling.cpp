// Scaled rotary embeddings (model/rope_scaling.hpp): the inverse frequencies against the bits
// transformers 5.24 computes (ROPE_INIT_FUNCTIONS, LlamaConfig of that shape; recorded once from
// it), and model.rope_scaling's text form.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "model/rope_scaling.hpp"

using namespace shardtrain;

namespace {

std::vector<uint32_t> bits_of(const std::vector<float>& values) {
  std::vector<uint32_t> bits(values.size());
  std::memcpy(bits.data(), values.data(), values.size() * sizeof(float));
  return bits;
}

RopeScaling parsed(const std::string& text) {
  RopeScaling s;
  std::string error;
  EXPECT_TRUE(RopeScaling::parse(text, &s, &error)) << error;
  return s;
}

std::string parse_error(const std::string& text) {
  RopeScaling s;
  std::string error;
  EXPECT_FALSE(RopeScaling::parse(text, &s, &error)) << text;
  return error;
}

}  // namespace

TEST(RopeScaling, Llama32InverseFrequenciesAreTransformersBits) {
  // Llama-3.2-1B: head size 64, rope_theta 500000, llama3 with factor 32: the first frequencies
  // kept, the middle ones blended, the last ones divided by 32.
  const std::vector<uint32_t> expected = {
      0x3f800000, 0x3f29e1c6, 0x3ee177bc, 0x3e959ee3, 0x3e4693b0, 0x3e03c6a0, 0x3daee4ad, 0x3d681e67,
      0x3d1a08c8, 0x3ccc6f49, 0x3c87a9c3, 0x3c340d6d, 0x3beef74f, 0x3b9e9402, 0x3b527720, 0x3aa9279b,
      0x39e13620, 0x38cb98f7, 0x37a3418d, 0x3758ac81, 0x370fc8f8, 0x36bed4f4, 0x367d45c3, 0x3628126b,
      0x35df10c4, 0x359406cb, 0x35447610, 0x35025f34, 0x34ad07a7, 0x3465a54d, 0x341864a7, 0x33ca41b0};
  const RopeScaling s =
      parsed("llama3:factor=32,low_freq_factor=1,high_freq_factor=4,original_max_position_embeddings=8192");
  EXPECT_EQ(bits_of(rope_inverse_frequencies(64, 500000.0, s)), expected);
}

TEST(RopeScaling, BlendedFrequenciesOfOtherShapesAreTransformersBits) {
  // Head size 128, theta 10000, factor 8 over 8192 positions; head size 64, theta 500000, factor 8
  // over 3000 positions (not a power of two): torch's division of a number by a tensor (the
  // reciprocal, times the number) shows in the blended frequencies.
  const std::vector<uint32_t> head128 = {
      0x3f800000, 0x3f5dafd7, 0x3f3ff911, 0x3f263de0, 0x3f0ff59a, 0x3ef953cf, 0x3ed7e89b, 0x3ebaf81b, 0x3ea1e89b,
      0x3e8c3504, 0x3e72d423, 0x3e5247ed, 0x3e361887, 0x3e1db040, 0x3e088d77, 0x3dec7fd6, 0x3dcccccd, 0x3db15978,
      0x3d99940d, 0x3d84fe4d, 0x3d6655c2, 0x3d47763f, 0x3d2cba15, 0x3d159348, 0x3d0186e3, 0x3ce054d2, 0x3cc2434f,
      0x3ca8398b, 0x3c91ad39, 0x3c7c4d33, 0x3c5a7bf2, 0x3c3d3311, 0x3c23d70a, 0x3c0de12d, 0x3bf5b9b0, 0x3bd4ca15,
      0x3bb8449c, 0x3b9f91cc, 0x3b8a2e77, 0x3b6f520e, 0x3b4f3e38, 0x3b1cf9a4, 0x3ae47c6e, 0x3aa553d9, 0x3a6d8ae2,
      0x3a291d20, 0x39ee0430, 0x39a4f64a, 0x395ffbd9, 0x3913adec, 0x38c4948c, 0x38aa3b44, 0x38936a16, 0x387f4fac,
      0x385d1725, 0x383f74d7, 0x3825cb60, 0x380f9272, 0x37f8a815, 0x37d753e4, 0x37ba7753, 0x37a17916, 0x378bd472,
      0x37722ce2};
  const std::vector<uint32_t> over3000 = {
      0x3f800000, 0x3f29e1c6, 0x3ee177bc, 0x3e959ee3, 0x3e4693b0, 0x3e03c6a0, 0x3daee4ad, 0x3d681e67,
      0x3d1a08c8, 0x3ccc6f49, 0x3c87a9c3, 0x3c340d6d, 0x3bcadc95, 0x3b20e297, 0x3a6c318e, 0x3991611b,
      0x39395d21, 0x38f603ea, 0x38a3418d, 0x3858ac81, 0x380fc8f8, 0x37bed4f4, 0x377d45c3, 0x3728126b,
      0x36df10c4, 0x369406cb, 0x36447610, 0x36025f34, 0x35ad07a7, 0x3565a54d, 0x351864a7, 0x34ca41b0};
  EXPECT_EQ(bits_of(rope_inverse_frequencies(
                128, 10000.0,
                parsed("llama3:factor=8,low_freq_factor=1,high_freq_factor=4,original_max_position_embeddings=8192"))),
            head128);
  EXPECT_EQ(bits_of(rope_inverse_frequencies(
                64, 500000.0,
                parsed("llama3:factor=8,low_freq_factor=1,high_freq_factor=4,original_max_position_embeddings=3000"))),
            over3000);
}

TEST(RopeScaling, SmallHeadsKeepBlendAndDivideAsTransformers) {
  // Head size 10, theta 10000: default; linear factor 2; llama3 factor 8 over 256 positions
  // (wavelengths 6.3 and 40 kept, 251 blended, 1579 and 9952 divided).
  const std::vector<uint32_t> plain = {0x3f800000, 0x3e224b06, 0x3ccdc613, 0x3b8273a4, 0x3a2566d4};
  const std::vector<uint32_t> linear = {0x3f000000, 0x3da24b06, 0x3c4dc613, 0x3b0273a4, 0x39a566d4};
  const std::vector<uint32_t> llama3 = {0x3f800000, 0x3e224b06, 0x3b59068b, 0x3a0273a4, 0x38a566d4};
  EXPECT_EQ(bits_of(rope_inverse_frequencies(10, 10000.0, RopeScaling())), plain);
  EXPECT_EQ(bits_of(rope_inverse_frequencies(10, 10000.0, parsed("linear:factor=2"))), linear);
  EXPECT_EQ(bits_of(rope_inverse_frequencies(
                10, 10000.0,
                parsed("llama3:factor=8,low_freq_factor=1,high_freq_factor=4,original_max_position_embeddings=256"))),
            llama3);
}

// YaRN as transformers 5.24's _compute_yarn_parameters computes it (bits and attention factor
// recorded from it): Qwen3's recommended setting on heads of 128, a small original context with the
// default betas, truncate false with betas of its own, and the attention factor from mscale and
// mscale_all_dim.
TEST(RopeScaling, YarnInverseFrequenciesAndAttentionFactorAreTransformers) {
  struct Case {
    int head;
    double theta;
    std::string text;
    double attention_factor;
    std::vector<uint32_t> bits;
    int pow_off = -1;  // the pair where torch's pow is one unit in the last place off the correctly rounded power
  };
  const std::vector<Case> cases = {
      {128, 1e6, "yarn:factor=4,original_max_position_embeddings=32768", 1.138629436111989,
       {0x3f800000, 0x3f4e4bad, 0x3f263de0, 0x3f05f6ef, 0x3ed7e89b, 0x3eadfcff, 0x3e8c3504, 0x3e61f835, 0x3e361887,
        0x3e12bd91, 0x3dec7fd6, 0x3dbe94c6, 0x3d99940d, 0x3d778513, 0x3d47763f, 0x3d20bc1d, 0x3d0186e3, 0x3cd0c1a8,
        0x3ca8398b, 0x3c879008, 0x3c5a7bf2, 0x3c301052, 0x3c0de12d, 0x3be4aa46, 0x3bb02377, 0x3b876388, 0x3b4fa550,
        0x3b1ed248, 0x3af241df, 0x3ab82bc0, 0x3a8b8207, 0x3a527db8, 0x3a1e0eb2, 0x39ec1968, 0x39af3d02, 0x39811c3e,
        0x393c93be, 0x39083e38, 0x38c23e9a, 0x38881d0a, 0x383a7753, 0x38164324, 0x37f22ce2, 0x37c327b5, 0x379d43a4,
        0x377d75d4, 0x374c3fbe, 0x372497ab, 0x3704a2b2, 0x36d5c441, 0x36ac431d, 0x368ad0ed, 0x365fba4f, 0x36344a0e,
        0x361148e3, 0x35ea2732, 0x35bcb0c1, 0x35980e02, 0x35751070, 0x35457bab, 0x351f23e4, 0x35003dec, 0x34ceaf79,
        0x34a68e4c},
       37},
      {64, 10000, "yarn:factor=8,original_max_position_embeddings=256", 1.2079441541679836,
       {0x3f800000, 0x3f330d39, 0x3ef92914, 0x3eac4fcb, 0x3e6ca2bc, 0x3e211b83, 0x3dd91d3f, 0x3d906e3e,
        0x3d3d0bd0, 0x3cf22e63, 0x3c969a88, 0x3c335ec6, 0x3bc745ac, 0x3b42434f, 0x3b11ad39, 0x3ada7bf2,
        0x3aa3d70a, 0x3a75b9b0, 0x3a38449c, 0x3a0a2e77, 0x39cf3e38, 0x399b690d, 0x39691528, 0x392ec98e,
        0x3903126f, 0x38c4948c, 0x38936a16, 0x385d1725, 0x3825cb60, 0x37f8a815, 0x37ba7753, 0x378bd472}},
      {10, 500000, "yarn:factor=2.5,original_max_position_embeddings=100,beta_fast=16,beta_slow=2,truncate=0",
       1.0916290731874154, {0x3f800000, 0x3ced7eec, 0x3b09b4a8, 0x391fb0a5, 0x37392f25}},
      // Qwen's setting untruncated: the ramp's ends fractional, pairs 24..39 other than truncated.
      {128, 1e6, "yarn:factor=4,original_max_position_embeddings=32768,truncate=0", 1.138629436111989,
       {0x3f800000, 0x3f4e4bad, 0x3f263de0, 0x3f05f6ef, 0x3ed7e89b, 0x3eadfcff, 0x3e8c3504, 0x3e61f835, 0x3e361887,
        0x3e12bd91, 0x3dec7fd6, 0x3dbe94c6, 0x3d99940d, 0x3d778513, 0x3d47763f, 0x3d20bc1d, 0x3d0186e3, 0x3cd0c1a8,
        0x3ca8398b, 0x3c879008, 0x3c5a7bf2, 0x3c301052, 0x3c0de12d, 0x3be4aa46, 0x3bb4ca38, 0x3b8ac05f, 0x3b54719c,
        0x3b222fe1, 0x3af6dfdc, 0x3abb3db8, 0x3a8d7535, 0x3a54c9f8, 0x3a1f3a76, 0x39ece3a5, 0x39aefda2, 0x398032c5,
        0x3939f57b, 0x39053534, 0x38bbdc7e, 0x3881c48a, 0x383a7753, 0x38164324, 0x37f22ce2, 0x37c327b5, 0x379d43a4,
        0x377d75d4, 0x374c3fbe, 0x372497ab, 0x3704a2b2, 0x36d5c441, 0x36ac431d, 0x368ad0ed, 0x365fba4f, 0x36344a0e,
        0x361148e3, 0x35ea2732, 0x35bcb0c1, 0x35980e02, 0x35751070, 0x35457bab, 0x351f23e4, 0x35003dec, 0x34ceaf79,
        0x34a68e4c},
       37},
  };
  for (const Case& c : cases) {
    const RopeScaling s = parsed(c.text);
    std::vector<uint32_t> bits = bits_of(rope_inverse_frequencies(c.head, c.theta, s)), want = c.bits;
    if (c.pow_off >= 0) {  // 1e6^(74/128): ours 2942.7273, torch's 2942.727; one unit apart after the blend too
      EXPECT_EQ(bits[c.pow_off] + 1, want[c.pow_off]) << c.text;
      bits[c.pow_off] = want[c.pow_off];
    }
    EXPECT_EQ(bits, want) << c.text;
    EXPECT_NEAR(s.attention_scaling(), c.attention_factor, 1e-15) << c.text;
  }
  // config.json's mscale and mscale_all_dim give the factor (DeepSeek's form); the text form keeps
  // the result, and an explicit attention_factor wins.
  RopeScaling s;
  std::string error;
  ASSERT_TRUE(RopeScaling::from_settings(
      "yarn", {{"factor", 16}, {"original_max_position_embeddings", 64}, {"mscale", 0.707}, {"mscale_all_dim", 1}}, &s,
      &error))
      << error;
  EXPECT_NEAR(s.attention_scaling(), 0.9363975061530204, 1e-15);
  EXPECT_EQ(bits_of(rope_inverse_frequencies(12, 10000, s)),
            (std::vector<uint32_t>{0x3f800000, 0x3dea6708, 0x3b3e1e95, 0x3a23d70a, 0x390d3169, 0x37f35a5c}));
  EXPECT_EQ(parsed(s.text()).attention_factor, s.attention_factor);
  EXPECT_EQ(parsed("yarn:factor=4,original_max_position_embeddings=64,attention_factor=0.5").attention_scaling(), 0.5);
  EXPECT_EQ(parsed("linear:factor=4").attention_scaling(), 1.0);
}

// Dynamic NTK changes nothing below max_position_embeddings, which bounds every sequence: the plain
// frequencies, the setting kept.
TEST(RopeScaling, DynamicKeepsThePlainFrequencies) {
  const RopeScaling dynamic = parsed("dynamic:factor=2.0");
  EXPECT_EQ(dynamic.text(), "dynamic:factor=2");
  EXPECT_EQ(bits_of(rope_inverse_frequencies(64, 500000, dynamic)), bits_of(rope_inverse_frequencies(64, 500000, {})));
  EXPECT_EQ(dynamic.attention_scaling(), 1.0);
}

TEST(RopeScaling, TheTextFormRoundTripsExactly) {
  EXPECT_EQ(parsed("").text(), "");
  EXPECT_EQ(parsed("linear:factor=2.0").text(), "linear:factor=2");
  const RopeScaling s =
      parsed("llama3:original_max_position_embeddings=8192,factor=0.1,high_freq_factor=4,low_freq_factor=1");
  EXPECT_EQ(s.text(),
            "llama3:factor=0.10000000000000001,low_freq_factor=1,high_freq_factor=4,original_max_position_embeddings=8192");
  EXPECT_EQ(parsed(s.text()).factor, 0.1);
  // yarn's optional settings written out with their defaults.
  EXPECT_EQ(parsed("yarn:original_max_position_embeddings=4096,factor=2").text(),
            "yarn:factor=2,original_max_position_embeddings=4096,attention_factor=1.0693147180559945,beta_fast=32,"
            "beta_slow=1,truncate=1");
}

TEST(RopeScaling, DefectsAreNamed) {
  EXPECT_NE(parse_error("longrope:factor=4").find("unknown type 'longrope'"), std::string::npos);
  EXPECT_NE(parse_error("linear").find("linear needs 'factor'"), std::string::npos);
  EXPECT_NE(parse_error("yarn:factor=4").find("yarn needs 'original_max_position_embeddings'"), std::string::npos);
  EXPECT_NE(parse_error("yarn:factor=4,original_max_position_embeddings=64,truncate=2").find("is not 0 or 1"),
            std::string::npos);
  EXPECT_NE(parse_error("yarn:factor=4,original_max_position_embeddings=64,mscale=1").find("not a setting of yarn"),
            std::string::npos);
  EXPECT_NE(parse_error("linear:factor=0").find("factor='0' is not a number in [1e-30, 1e30]"), std::string::npos);
  EXPECT_NE(parse_error("linear:factor=1e-40").find("factor='1e-40' is not a number in"), std::string::npos);  // 0 in fp32
  EXPECT_NE(parse_error("yarn:factor=4,original_max_position_embeddings=64,truncate=0.1").find("truncate='0.1' is not 0"),
            std::string::npos);  // the value as written, not 0.10000000000000001
  EXPECT_NE(parse_error("linear:factor=2,low_freq_factor=1").find("'low_freq_factor' is not a setting of linear"),
            std::string::npos);
  EXPECT_NE(parse_error("linear:factor=2,factor=3").find("given twice"), std::string::npos);
  EXPECT_NE(parse_error("llama3:factor=8,low_freq_factor=4,high_freq_factor=4,original_max_position_embeddings=8192")
                .find("high_freq_factor must be greater than low_freq_factor"),
            std::string::npos);
  EXPECT_NE(parse_error("llama3:factor=8,low_freq_factor=1,high_freq_factor=4,original_max_position_embeddings=81.5")
                .find("whole number"),
            std::string::npos);
  EXPECT_NE(parse_error("llama3:factor=8").find("llama3 needs 'low_freq_factor'"), std::string::npos);
}
