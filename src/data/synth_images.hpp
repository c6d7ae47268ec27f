// The synthetic captioned image world of `shardtrain data synth-images` and `data check-images`
// (docs/images.md): a first text-to-image run that trains in minutes on a laptop and can be graded
// without a person. Each image is one object on a black background: a colour (6), a shape (circle,
// square, triangle), a size (small, large) and a position on a 3 x 3 grid (top/middle/bottom,
// left/centre/right), drawn with a little jitter of place and size; its caption names all four
// ("a small red circle at the top left"). Some colour-shape pairs never appear in training: the
// held-out prompts ask for them. The captions' text embeddings come from a fixed word-embedding
// encoder (every word of the world's vocabulary a seeded Gaussian vector; the pooled vector their
// mean; the empty caption all zeros, which is also what flow.caption_dropout feeds). The checker
// reads an image back into the four attributes: the largest connected bright region, its mean
// colour against the palette, the shape whose ideal drawing over the region's bounding box overlaps
// it most (intersection over union), the box's extent and its centre. Everything is a pure function of the seed (core/random.hpp).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace shardtrain {

// One object's attributes, each an index into its list below.
struct ShapeLabel {
  int colour = 0, shape = 0, size = 0, row = 0, col = 0;
  bool operator==(const ShapeLabel& o) const {
    return colour == o.colour && shape == o.shape && size == o.size && row == o.row && col == o.col;
  }
};
constexpr int SHAPE_WORLD_COLOURS = 6, SHAPE_WORLD_SHAPES = 3, SHAPE_WORLD_SIZES = 2, SHAPE_WORLD_CELLS = 3;
extern const char* const SHAPE_COLOUR_NAMES[SHAPE_WORLD_COLOURS];
extern const char* const SHAPE_NAMES[SHAPE_WORLD_SHAPES];
extern const char* const SHAPE_SIZE_NAMES[SHAPE_WORLD_SIZES];
extern const char* const SHAPE_ROW_NAMES[SHAPE_WORLD_CELLS];
extern const char* const SHAPE_COL_NAMES[SHAPE_WORLD_CELLS];

// The world's sizes: images of image_size pixels a side, captions of caption_tokens words, each a
// vector of text_dim floats (the pooled vector too).
struct ShapeWorld {
  int image_size = 32, caption_tokens = 8, text_dim = 32;
  uint64_t seed = 1;  // the word embeddings' (the drawings use their own keys)
};

// True when the colour-shape pair is held out of training (asked for only by held-out prompts).
bool held_out_pair(int colour, int shape);
// "a small red circle at the top left".
std::string shape_caption(const ShapeLabel& label);
// The caption's embeddings: caption_tokens x text_dim (words in order, zero rows after them) and the
// pooled vector (their mean). The empty caption (label null) is all zeros.
void encode_shape_caption(const ShapeWorld& world, const ShapeLabel* label, float* tokens, float* pooled);
// The picture of `label`, image_size^2 x 3 values in [0, 1], jittered by `key`.
std::vector<float> draw_shape(const ShapeWorld& world, const ShapeLabel& label, uint64_t key);

// What the checker reads from an image (values in [0, 1], size x size x 3): found is false when no
// bright region of at least a few pixels exists (every attribute then counts as wrong).
struct ShapeReading {
  bool found = false;
  ShapeLabel label;
};
ShapeReading read_shape(const float* rgb, int size);

// The most pixel bytes `data synth-images` builds in memory (its files are written whole).
constexpr double SYNTH_IMAGES_MAX_BYTES = 8.0 * (1 << 30);

// `data synth-images`: writes DIR/shapes_train.h5 and shapes_val.h5 (latent datasets of pixel
// patches, docs/flux.md's layout plus labels and captions), DIR/shapes_prompts.h5 (the held-out
// prompts' embeddings and labels: every held-out pair at every size and position, then as many seen
// combinations) and DIR/shapes_empty.h5 (the empty caption, for --negative). Prints what it wrote.
void data_synth_images(const std::string& out_dir, const ShapeWorld& world, int patch, uint64_t seed,
                       size_t train_images, size_t val_images);

// `data check-images`: reads the images of IMAGES (an HDF5 file with `latents` of pixel patches and
// grid_rows, grid_cols and pixel_patch: what `sample` writes, or a file of synth-images) and the labels of
// LABELS (its `labels`), grades each image and prints the accuracy per attribute (all images, and
// the held-out colour-shape pairs alone), one JSON line to `json_path` if not empty.
void data_check_images(const std::string& images, const std::string& labels, const std::string& json_path);

}  // namespace shardtrain
