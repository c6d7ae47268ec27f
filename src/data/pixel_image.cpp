// See pixel_image.hpp.
#include "data/pixel_image.hpp"

#include <png.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <new>

#include "core/error.hpp"
#include "core/format.hpp"

namespace shardtrain {

std::vector<float> patches_from_pixels(const float* rgb, int rows, int cols, int patch) {
  const int width = cols * patch, channels = 3 * patch * patch;
  std::vector<float> tokens(static_cast<size_t>(rows) * cols * channels);
  for (int r = 0; r < rows; r++)
    for (int c = 0; c < cols; c++) {
      float* token = tokens.data() + (static_cast<size_t>(r) * cols + c) * channels;
      for (int ch = 0; ch < 3; ch++)
        for (int ph = 0; ph < patch; ph++)
          for (int pw = 0; pw < patch; pw++) {
            const size_t pixel = static_cast<size_t>(r * patch + ph) * width + (c * patch + pw);
            token[(ch * patch + ph) * patch + pw] = 2.0f * rgb[3 * pixel + ch] - 1.0f;
          }
    }
  return tokens;
}

std::vector<float> pixels_from_patches(const float* tokens, int rows, int cols, int patch) {
  const int width = cols * patch, channels = 3 * patch * patch;
  std::vector<float> rgb(static_cast<size_t>(rows) * patch * width * 3);
  for (int r = 0; r < rows; r++)
    for (int c = 0; c < cols; c++) {
      const float* token = tokens + (static_cast<size_t>(r) * cols + c) * channels;
      for (int ch = 0; ch < 3; ch++)
        for (int ph = 0; ph < patch; ph++)
          for (int pw = 0; pw < patch; pw++) {
            const size_t pixel = static_cast<size_t>(r * patch + ph) * width + (c * patch + pw);
            rgb[3 * pixel + ch] = std::clamp(0.5f * (token[(ch * patch + ph) * patch + pw] + 1.0f), 0.0f, 1.0f);
          }
    }
  return rgb;
}

RgbImage rgb_from_patches(const float* tokens, int rows, int cols, int patch) {
  const std::vector<float> rgb = pixels_from_patches(tokens, rows, cols, patch);
  RgbImage image{cols * patch, rows * patch, std::vector<uint8_t>(rgb.size())};
  for (size_t i = 0; i < rgb.size(); i++) image.pixels[i] = static_cast<uint8_t>(std::lround(255.0f * rgb[i]));
  return image;
}

RgbImage image_grid(const std::vector<RgbImage>& images, int columns, int gap) {
  SHARD_CHECK(!images.empty() && columns > 0, "a grid of %zu images, %d columns", images.size(), columns);
  const int w = images[0].width, h = images[0].height, n = static_cast<int>(images.size());
  const int across = std::min(columns, n), down = (n + columns - 1) / columns;
  RgbImage grid{across * w + (across - 1) * gap, down * h + (down - 1) * gap, {}};
  grid.pixels.assign(static_cast<size_t>(grid.width) * grid.height * 3, 0);
  for (int i = 0; i < n; i++) {
    SHARD_CHECK(images[i].width == w && images[i].height == h, "grid images of different sizes");
    const int x0 = (i % columns) * (w + gap), y0 = (i / columns) * (h + gap);
    for (int y = 0; y < h; y++)
      std::memcpy(&grid.pixels[(static_cast<size_t>(y0 + y) * grid.width + x0) * 3],
                  &images[i].pixels[static_cast<size_t>(y) * w * 3], static_cast<size_t>(w) * 3);
  }
  return grid;
}

namespace {

void append_bytes(png_structp png, png_bytep data, png_size_t length) {
  bool appended = true;
  try {  // no C++ exception may unwind through libpng's C frames
    static_cast<std::string*>(png_get_io_ptr(png))->append(reinterpret_cast<const char*>(data), length);
  } catch (const std::bad_alloc&) {
    appended = false;
  }
  if (!appended) png_error(png, "out of memory");
}

void no_flush(png_structp) {}

// The image's PNG stream appended to `out`; false when libpng fails. libpng reports errors by
// longjmp to the setjmp here: no local of this function has a destructor.
bool encode_png(std::string* out, const RgbImage& image) {
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  if (!png) return false;
  png_infop info = png_create_info_struct(png);
  if (!info) {
    png_destroy_write_struct(&png, nullptr);
    return false;
  }
  if (setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, &info);
    return false;
  }
  png_set_write_fn(png, out, append_bytes, no_flush);
  png_set_IHDR(png, info, image.width, image.height, 8, PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE,
               PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  png_write_info(png, info);
  for (int y = 0; y < image.height; y++)
    png_write_row(png, const_cast<png_bytep>(&image.pixels[static_cast<size_t>(y) * image.width * 3]));
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  return true;
}

}  // namespace

std::string png_bytes(const RgbImage& image) {
  SHARD_CHECK(image.pixels.size() == static_cast<size_t>(image.width) * image.height * 3, "an RGB image's bytes");
  std::string out;
  if (!encode_png(&out, image)) throw UsageError(strprintf("libpng cannot encode a %dx%d image", image.width, image.height));
  return out;
}

void write_png(const std::string& path, const RgbImage& image) {
  const std::string bytes = png_bytes(image), tmp = path + ".tmp";
  FILE* file = std::fopen(tmp.c_str(), "wb");
  if (!file) throw UsageError("cannot write the image '" + printable_text(path) + "': " + std::strerror(errno));
  const bool written = std::fwrite(bytes.data(), 1, bytes.size(), file) == bytes.size();
  const bool closed = std::fclose(file) == 0;
  if (!written || !closed || std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    std::remove(tmp.c_str());
    throw UsageError("cannot write the image '" + printable_text(path) + "': " + why);
  }
}

}  // namespace shardtrain
