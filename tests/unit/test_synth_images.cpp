// The synthetic image world (data/synth_images.hpp) and pixel patches (data/pixel_image.hpp): the
// patch layout against the index formula written out, the checker against every drawing the
// world can make (and against noise, and a blank image), the captions' embeddings.
#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <vector>

#include "core/random.hpp"
#include "data/pixel_image.hpp"
#include "data/synth_images.hpp"

using namespace shardtrain;

TEST(PixelPatches, TokensHoldPatchesInChannelOrderCPhPw) {
  const int rows = 2, cols = 3, p = 2, H = rows * p, W = cols * p;
  std::vector<float> rgb(H * W * 3);
  for (size_t i = 0; i < rgb.size(); i++) rgb[i] = static_cast<float>(i) / rgb.size();
  const std::vector<float> tokens = patches_from_pixels(rgb.data(), rows, cols, p);
  ASSERT_EQ(tokens.size(), static_cast<size_t>(rows * cols * 3 * p * p));
  for (int y = 0; y < H; y++)
    for (int x = 0; x < W; x++)
      for (int c = 0; c < 3; c++) {
        const int token = (y / p) * cols + x / p, channel = c * p * p + (y % p) * p + x % p;
        EXPECT_FLOAT_EQ(tokens[token * 3 * p * p + channel], 2 * rgb[(y * W + x) * 3 + c] - 1);
      }
  const std::vector<float> back = pixels_from_patches(tokens.data(), rows, cols, p);
  for (size_t i = 0; i < rgb.size(); i++) EXPECT_NEAR(back[i], rgb[i], 1e-6);
}

TEST(PixelPatches, EightBitImagesRoundAndClamp) {
  const float tokens[3] = {-1.5f, 0.0f, 1.2f};  // one 1 x 1 patch: below black, middle, above white
  const RgbImage image = rgb_from_patches(tokens, 1, 1, 1);
  ASSERT_EQ(image.pixels.size(), 3u);
  EXPECT_EQ(image.pixels[0], 0);
  EXPECT_EQ(image.pixels[1], 128);  // 127.5 rounds away from zero
  EXPECT_EQ(image.pixels[2], 255);
  const RgbImage grid = image_grid({image, image, image}, 2, 1);
  EXPECT_EQ(grid.width, 3);
  EXPECT_EQ(grid.height, 3);
  EXPECT_EQ(grid.pixels[(1 * 3 + 1) * 3 + 1], 0);   // the gap between the first row's images is black
  EXPECT_EQ(grid.pixels[(2 * 3 + 0) * 3 + 2], 255);  // the third image starts the second row
}

class ShapeWorldSizes : public ::testing::TestWithParam<int> {};

TEST_P(ShapeWorldSizes, CheckerReadsEveryDrawingTheWorldMakes) {
  ShapeWorld world;
  world.image_size = GetParam();
  int drawings = 0;
  for (int colour = 0; colour < SHAPE_WORLD_COLOURS; colour++)
    for (int shape = 0; shape < SHAPE_WORLD_SHAPES; shape++)
      for (int size = 0; size < SHAPE_WORLD_SIZES; size++)
        for (int row = 0; row < SHAPE_WORLD_CELLS; row++)
          for (int col = 0; col < SHAPE_WORLD_CELLS; col++)
            for (uint64_t key = 0; key < 6; key++) {
              const ShapeLabel label{colour, shape, size, row, col};
              const std::vector<float> rgb = draw_shape(world, label, mix64(key * 7919 + colour));
              const ShapeReading got = read_shape(rgb.data(), world.image_size);
              ASSERT_TRUE(got.found) << shape_caption(label);
              ASSERT_EQ(got.label, label) << shape_caption(label) << " read as " << shape_caption(got.label);
              drawings++;
            }
  EXPECT_EQ(drawings, 6 * 3 * 2 * 9 * 6);
}

INSTANTIATE_TEST_SUITE_P(Pixels, ShapeWorldSizes, ::testing::Values(32, 40, 64, 128));

TEST(ShapeWorld, CheckerToleratesNoiseAndFindsNothingInTheDark) {
  const ShapeWorld world;
  int right = 0, total = 0;
  for (uint64_t i = 0; i < 216; i++) {  // every colour, shape, size and cell
    const ShapeLabel label{static_cast<int>(i % 6), static_cast<int>(i / 6 % 3), static_cast<int>(i / 18 % 2),
                           static_cast<int>(i / 36 % 3), static_cast<int>(i / 108 % 3)};
    std::vector<float> rgb = draw_shape(world, label, mix64(i));
    for (size_t k = 0; k < rgb.size(); k++) rgb[k] += 0.05f * static_cast<float>(counter_normal(mix64(i + 99), k));
    right += read_shape(rgb.data(), world.image_size).label == label;
    total++;
  }
  EXPECT_GE(right, total * 98 / 100);
  std::vector<float> dark(world.image_size * world.image_size * 3, 0.1f);
  EXPECT_FALSE(read_shape(dark.data(), world.image_size).found);
}

TEST(ShapeWorld, CaptionsNameTheAttributesAndEmbedWordByWord) {
  const ShapeWorld world;
  const ShapeLabel a{0, 0, 0, 0, 0}, b{1, 0, 1, 2, 2};
  EXPECT_EQ(shape_caption(a), "a small red circle at the top left");
  EXPECT_EQ(shape_caption(b), "a large green circle at the bottom right");
  const int L = world.caption_tokens, D = world.text_dim;
  std::vector<float> ta(L * D), pa(D), tb(L * D), pb(D), te(L * D, 1), pe(D, 1);
  encode_shape_caption(world, &a, ta.data(), pa.data());
  encode_shape_caption(world, &b, tb.data(), pb.data());
  encode_shape_caption(world, nullptr, te.data(), pe.data());
  // Word t of both captions: "a", size, colour, "circle", "at", "the", row, col.
  for (int t = 0; t < L; t++) {
    bool same = true;
    for (int j = 0; j < D; j++) same &= ta[t * D + j] == tb[t * D + j];
    EXPECT_EQ(same, t == 0 || t == 3 || t == 4 || t == 5) << "word " << t;
  }
  for (int j = 0; j < D; j++) {
    double mean = 0;
    for (int t = 0; t < L; t++) mean += ta[t * D + j] / L;
    EXPECT_NEAR(pa[j], mean, 1e-5);
    EXPECT_EQ(pe[j], 0.0f);
  }
  for (float v : te) EXPECT_EQ(v, 0.0f);
}

TEST(ShapeWorld, HeldOutPairsLeaveEveryColourAndShapeSeen) {
  std::set<int> colours, shapes;
  int held = 0;
  for (int c = 0; c < SHAPE_WORLD_COLOURS; c++)
    for (int s = 0; s < SHAPE_WORLD_SHAPES; s++)
      if (held_out_pair(c, s))
        held++;
      else
        colours.insert(c), shapes.insert(s);
  EXPECT_EQ(held, 4);
  EXPECT_EQ(colours.size(), static_cast<size_t>(SHAPE_WORLD_COLOURS));
  EXPECT_EQ(shapes.size(), static_cast<size_t>(SHAPE_WORLD_SHAPES));
}
