// Images of a pixel-space diffusion transformer (model.pixel_patch = p > 0; docs/images.md): an
// RGB image of rows*p x cols*p pixels travels as rows x cols tokens of 3 p^2 channels, each token
// one p x p patch in channel order (c, ph, pw) -- FLUX's packing of VAE latents, applied to pixels
// -- with values in [-1, 1] (black -1, full intensity +1). PNG files are written by libpng.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shardtrain {

// An 8-bit RGB image, row-major, 3 bytes a pixel.
struct RgbImage {
  int width = 0, height = 0;
  std::vector<uint8_t> pixels;
};

// Patch tokens (rows * cols tokens of 3 p^2 channels) from an image of values in [0, 1] (height x
// width x 3, row-major); height = rows * p, width = cols * p.
std::vector<float> patches_from_pixels(const float* rgb, int rows, int cols, int patch);
// The image of patch tokens: values in [-1, 1] mapped to [0, 1] (clamped), height x width x 3.
std::vector<float> pixels_from_patches(const float* tokens, int rows, int cols, int patch);
// The same as 8-bit RGB (each value rounded to the nearest of 0..255).
RgbImage rgb_from_patches(const float* tokens, int rows, int cols, int patch);

// Images side by side, `columns` a row, `gap` black pixels between them; all of one size.
RgbImage image_grid(const std::vector<RgbImage>& images, int columns, int gap);

// The bytes of `image` as an 8-bit RGB PNG file (libpng); UsageError when libpng fails.
std::string png_bytes(const RgbImage& image);
// Writes them to `path` through a temporary file and a rename; UsageError naming the path when it
// cannot.
void write_png(const std::string& path, const RgbImage& image);

}  // namespace shardtrain
