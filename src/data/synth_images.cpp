// See synth_images.hpp.
#include "data/synth_images.hpp"

#include <hdf5.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "ckpt/h5.hpp"
#include "core/error.hpp"
#include "core/format.hpp"
#include "core/random.hpp"
#include "data/pixel_image.hpp"

namespace shardtrain {

const char* const SHAPE_COLOUR_NAMES[SHAPE_WORLD_COLOURS] = {"red", "green", "blue", "yellow", "magenta", "cyan"};
const char* const SHAPE_NAMES[SHAPE_WORLD_SHAPES] = {"circle", "square", "triangle"};
const char* const SHAPE_SIZE_NAMES[SHAPE_WORLD_SIZES] = {"small", "large"};
const char* const SHAPE_ROW_NAMES[SHAPE_WORLD_CELLS] = {"top", "middle", "bottom"};
const char* const SHAPE_COL_NAMES[SHAPE_WORLD_CELLS] = {"left", "centre", "right"};

namespace {

constexpr float PALETTE[SHAPE_WORLD_COLOURS][3] = {{0.90f, 0.15f, 0.15f}, {0.15f, 0.80f, 0.20f}, {0.20f, 0.35f, 0.95f},
                                                  {0.95f, 0.85f, 0.15f}, {0.85f, 0.20f, 0.85f}, {0.15f, 0.80f, 0.85f}};
// The colour-shape pairs training never shows: each colour and each shape is still seen otherwise.
constexpr int HELD_OUT[][2] = {{0, 2}, {1, 0}, {2, 1}, {5, 2}};  // red triangle, green circle, blue square, cyan triangle

constexpr uint64_t WORD_DOMAIN = 0x73686170652d7764ull;   // "shape-wd"
constexpr uint64_t DRAW_DOMAIN = 0x73686170652d6472ull;   // "shape-dr"
constexpr uint64_t LABEL_DOMAIN = 0x73686170652d6c62ull;  // "shape-lb"

// The geometry, as fractions of the image's side: the cells' centres sit 0.22 from the middle, a
// small object's half-extent is 0.16 and a large one's 0.25, each jittered by up to 0.03 (place)
// and 10% (size). The checker's thresholds sit between these.
constexpr double CELL_OFFSET = 0.22, SMALL_HALF = 0.16, LARGE_HALF = 0.25, PLACE_JITTER = 0.03, SIZE_JITTER = 0.10;
constexpr int SUPERSAMPLE = 4;     // 4 x 4 samples a pixel: edges anti-aliased
constexpr float BRIGHT = 0.35f;    // a pixel whose brightest channel exceeds this belongs to an object
constexpr int MIN_REGION = 6;      // fewer bright pixels than this: nothing was drawn

// The vocabulary: the caption's words, in the order of their embeddings' keys.
std::vector<std::string> vocabulary() {
  std::vector<std::string> words = {"a", "at", "the"};
  for (const char* w : SHAPE_SIZE_NAMES) words.push_back(w);
  for (const char* w : SHAPE_COLOUR_NAMES) words.push_back(w);
  for (const char* w : SHAPE_NAMES) words.push_back(w);
  for (const char* w : SHAPE_ROW_NAMES) words.push_back(w);
  for (const char* w : SHAPE_COL_NAMES) words.push_back(w);
  return words;
}

std::vector<std::string> caption_words(const ShapeLabel& l) {
  return {"a", SHAPE_SIZE_NAMES[l.size], SHAPE_COLOUR_NAMES[l.colour], SHAPE_NAMES[l.shape], "at", "the",
          SHAPE_ROW_NAMES[l.row], SHAPE_COL_NAMES[l.col]};
}

// Whether the point (x, y), in pixels, lies in the shape centred at (cx, cy) of half-extent h.
bool inside(int shape, double x, double y, double cx, double cy, double h) {
  const double dx = x - cx, dy = y - cy;
  if (shape == 0) return dx * dx + dy * dy <= h * h;         // circle
  if (shape == 1) return std::abs(dx) <= h && std::abs(dy) <= h;  // square
  // triangle, apex up: at height dy from the top (-h) the half-width grows from 0 to h at the base
  return dy >= -h && dy <= h && std::abs(dx) <= (dy + h) / 2;
}

int cell_of(double centre, int size) {
  const double offset = (centre - size / 2.0) / (CELL_OFFSET * size);  // -1, 0, 1 at the cells' centres
  return offset < -0.5 ? 0 : offset > 0.5 ? 2 : 1;
}

ShapeLabel random_label(uint64_t key, bool training) {
  for (uint64_t attempt = 0;; attempt++) {
    const uint64_t k = mix64(key ^ mix64(attempt));
    auto pick = [&](int counter, int n) { return std::min(n - 1, static_cast<int>(counter_uniform(k, counter) * n)); };
    ShapeLabel l{pick(0, SHAPE_WORLD_COLOURS), pick(1, SHAPE_WORLD_SHAPES), pick(2, SHAPE_WORLD_SIZES),
                 pick(3, SHAPE_WORLD_CELLS), pick(4, SHAPE_WORLD_CELLS)};
    if (!training || !held_out_pair(l.colour, l.shape)) return l;
  }
}

// One file of records: the pixel patches, the captions' embeddings, the labels and the captions.
void write_shape_file(const std::string& path, const ShapeWorld& world, int patch, const std::vector<ShapeLabel>& labels,
                      uint64_t draw_key) {
  const int grid = world.image_size / patch, N = grid * grid, IN = 3 * patch * patch;
  const int L = world.caption_tokens, D = world.text_dim;
  const size_t R = labels.size();
  std::vector<float> latents(R * N * IN), text(R * L * D), pooled(R * D);
  std::vector<int32_t> label_values(R * 5);
  constexpr size_t CAPTION_BYTES = 64;
  std::vector<char> captions(R * CAPTION_BYTES, '\0');
  for (size_t r = 0; r < R; r++) {
    const ShapeLabel& l = labels[r];
    const std::vector<float> rgb = draw_shape(world, l, mix64(draw_key ^ mix64(r)));
    const std::vector<float> tokens = patches_from_pixels(rgb.data(), grid, grid, patch);
    std::copy(tokens.begin(), tokens.end(), latents.begin() + r * N * IN);
    encode_shape_caption(world, &l, text.data() + r * L * D, pooled.data() + r * D);
    const int32_t values[5] = {l.colour, l.shape, l.size, l.row, l.col};
    std::copy(values, values + 5, label_values.begin() + r * 5);
    const std::string caption = shape_caption(l);
    std::copy_n(caption.begin(), std::min(caption.size(), CAPTION_BYTES - 1), captions.begin() + r * CAPTION_BYTES);
  }
  H5QuietErrors quiet;
  const std::string tmp = path + ".tmp";
  {
    H5Id file(h5_check_id(H5Fcreate(tmp.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), tmp, "H5Fcreate"), H5Fclose);
    const hsize_t r = R;
    h5_write_dataset(file, "latents", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, {r, hsize_t(N), hsize_t(IN)}, latents.data(), tmp);
    h5_write_dataset(file, "encoder_hidden_states", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, {r, hsize_t(L), hsize_t(D)},
                     text.data(), tmp);
    h5_write_dataset(file, "pooled_projections", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, {r, hsize_t(D)}, pooled.data(), tmp);
    h5_write_dataset(file, "labels", H5T_STD_I32LE, H5T_NATIVE_INT32, {r, 5}, label_values.data(), tmp);
    H5Id string_type(H5Tcopy(H5T_C_S1), H5Tclose);
    H5Tset_size(string_type, CAPTION_BYTES);
    H5Tset_strpad(string_type, H5T_STR_NULLTERM);
    h5_write_dataset(file, "captions", string_type, string_type, {r}, captions.data(), tmp);
    h5_write_attr_i64(file, "grid_rows", grid, tmp);
    h5_write_attr_i64(file, "grid_cols", grid, tmp);
    h5_write_attr_i64(file, "pixel_patch", patch, tmp);
    h5_write_attr_str(file, "labels_order", "colour, shape, size, row, col", tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    throw UsageError("cannot write '" + printable_text(path) + "': " + std::strerror(errno));
}

std::string join_dims(const std::vector<hsize_t>& dims) {
  std::string s;
  for (hsize_t d : dims) s += (s.empty() ? "" : ", ") + std::to_string(d);
  return s;
}

}  // namespace

bool held_out_pair(int colour, int shape) {
  for (const auto& pair : HELD_OUT)
    if (pair[0] == colour && pair[1] == shape) return true;
  return false;
}

std::string shape_caption(const ShapeLabel& label) {
  std::string caption;
  for (const std::string& w : caption_words(label)) caption += (caption.empty() ? "" : " ") + w;
  return caption;
}

void encode_shape_caption(const ShapeWorld& world, const ShapeLabel* label, float* tokens, float* pooled) {
  const int L = world.caption_tokens, D = world.text_dim;
  std::fill(tokens, tokens + static_cast<size_t>(L) * D, 0.0f);
  std::fill(pooled, pooled + D, 0.0f);
  if (!label) return;
  const std::vector<std::string> vocab = vocabulary(), words = caption_words(*label);
  SHARD_CHECK(static_cast<int>(words.size()) <= L, "a caption of %zu words in %d tokens", words.size(), L);
  for (size_t t = 0; t < words.size(); t++) {
    const uint64_t word = std::find(vocab.begin(), vocab.end(), words[t]) - vocab.begin();
    const uint64_t key = mix64(mix64(world.seed ^ WORD_DOMAIN) ^ mix64(word));
    for (int j = 0; j < D; j++) {
      const float v = static_cast<float>(counter_normal(key, j));
      tokens[t * D + j] = v;
      pooled[j] += v / static_cast<float>(words.size());
    }
  }
}

std::vector<float> draw_shape(const ShapeWorld& world, const ShapeLabel& l, uint64_t key) {
  const int S = world.image_size;
  const uint64_t k = mix64(key ^ DRAW_DOMAIN);
  auto jitter = [&](int counter) { return 2 * counter_uniform(k, counter) - 1; };  // in [-1, 1)
  const double cx = S / 2.0 + (l.col - 1) * CELL_OFFSET * S + jitter(0) * PLACE_JITTER * S;
  const double cy = S / 2.0 + (l.row - 1) * CELL_OFFSET * S + jitter(1) * PLACE_JITTER * S;
  const double h = (l.size ? LARGE_HALF : SMALL_HALF) * S * (1 + SIZE_JITTER * jitter(2));
  std::vector<float> rgb(static_cast<size_t>(S) * S * 3, 0.0f);
  for (int y = 0; y < S; y++)
    for (int x = 0; x < S; x++) {
      int hits = 0;
      for (int sy = 0; sy < SUPERSAMPLE; sy++)
        for (int sx = 0; sx < SUPERSAMPLE; sx++)
          hits += inside(l.shape, x + (sx + 0.5) / SUPERSAMPLE, y + (sy + 0.5) / SUPERSAMPLE, cx, cy, h);
      const float cover = static_cast<float>(hits) / (SUPERSAMPLE * SUPERSAMPLE);
      for (int c = 0; c < 3; c++) rgb[(static_cast<size_t>(y) * S + x) * 3 + c] = cover * PALETTE[l.colour][c];
    }
  return rgb;
}

ShapeReading read_shape(const float* rgb, int S) {
  // The largest 4-connected region of bright pixels.
  std::vector<int> region(static_cast<size_t>(S) * S, -1), stack;
  auto bright = [&](int p) { return std::max({rgb[3 * p], rgb[3 * p + 1], rgb[3 * p + 2]}) > BRIGHT; };
  int best = -1, best_count = 0;
  for (int start = 0, id = 0; start < S * S; start++) {
    if (region[start] >= 0 || !bright(start)) continue;
    int count = 0;
    stack.assign(1, start);
    region[start] = id;
    while (!stack.empty()) {
      const int p = stack.back();
      stack.pop_back();
      count++;
      const int x = p % S, y = p / S;
      const int next[4][2] = {{x - 1, y}, {x + 1, y}, {x, y - 1}, {x, y + 1}};
      for (const auto& [nx, ny] : next) {
        const int q = ny * S + nx;
        if (nx < 0 || ny < 0 || nx >= S || ny >= S || region[q] >= 0 || !bright(q)) continue;
        region[q] = id;
        stack.push_back(q);
      }
    }
    if (count > best_count) best = id, best_count = count;
    id++;
  }
  ShapeReading reading;
  if (best_count < MIN_REGION) return reading;
  int x0 = S, y0 = S, x1 = -1, y1 = -1;
  double colour[3] = {0, 0, 0};
  for (int p = 0; p < S * S; p++) {
    if (region[p] != best) continue;
    x0 = std::min(x0, p % S), x1 = std::max(x1, p % S), y0 = std::min(y0, p / S), y1 = std::max(y1, p / S);
    for (int c = 0; c < 3; c++) colour[c] += rgb[3 * p + c];
  }
  // Colour: the nearest palette entry after both are scaled to a brightest channel of 1 (a faint
  // drawing has the right hue).
  const double top = std::max({colour[0], colour[1], colour[2]});
  double nearest = INFINITY;
  for (int i = 0; i < SHAPE_WORLD_COLOURS; i++) {
    const double ptop = std::max({PALETTE[i][0], PALETTE[i][1], PALETTE[i][2]});
    double d = 0;
    for (int c = 0; c < 3; c++) d += std::pow(colour[c] / top - PALETTE[i][c] / ptop, 2);
    if (d < nearest) nearest = d, reading.label.colour = i;
  }
  const int w = x1 - x0 + 1, h = y1 - y0 + 1;
  // Shape: the one whose ideal drawing, stretched over the region's bounding box, overlaps the
  // region most (intersection over union of the pixels whose centres it covers).
  const double cx = (x0 + x1 + 1) / 2.0, cy = (y0 + y1 + 1) / 2.0, hx = w / 2.0, hy = h / 2.0;
  double best_iou = -1;
  for (int shape = 0; shape < SHAPE_WORLD_SHAPES; shape++) {
    int both = 0, either = 0;
    for (int y = y0; y <= y1; y++)
      for (int x = x0; x <= x1; x++) {
        // The ideal shape of half-extent 1 in coordinates scaled by the box's half-width and height.
        const bool ideal = inside(shape, (x + 0.5 - cx) / hx, (y + 0.5 - cy) / hy, 0, 0, 1);
        const bool drawn = region[y * S + x] == best;
        both += ideal && drawn, either += ideal || drawn;
      }
    const double iou = either ? static_cast<double>(both) / either : 0;
    if (iou > best_iou) best_iou = iou, reading.label.shape = shape;
  }
  reading.label.size = std::max(w, h) > (SMALL_HALF + LARGE_HALF) * S ? 1 : 0;
  reading.label.col = cell_of((x0 + x1 + 1) / 2.0, S);
  reading.label.row = cell_of((y0 + y1 + 1) / 2.0, S);
  reading.found = true;
  return reading;
}

void data_synth_images(const std::string& out_dir, const ShapeWorld& world, int patch, uint64_t seed,
                       size_t train_images, size_t val_images) {
  // Each file is built in memory: its patches are (images x image_size^2 x 3) floats.
  const double bytes = (static_cast<double>(train_images) + val_images) * world.image_size * world.image_size * 3 * 4;
  if (bytes > SYNTH_IMAGES_MAX_BYTES)
    throw UsageError(strprintf("data synth-images: %zu + %zu images of %dx%d pixels are %.1f GiB of pixels, more than the "
                               "%.0f GiB it builds in memory; ask for fewer (--train-images, --val-images) or smaller "
                               "(--image-size) images",
                               train_images, val_images, world.image_size, world.image_size, bytes / (1 << 30),
                               SYNTH_IMAGES_MAX_BYTES / (1 << 30)));
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec) throw UsageError("cannot create --out-dir='" + printable_text(out_dir) + "': " + ec.message());
  const uint64_t labels_key = mix64(seed ^ LABEL_DOMAIN), draw_key = mix64(seed ^ DRAW_DOMAIN);
  auto split = [&](size_t count, uint64_t salt) {
    std::vector<ShapeLabel> labels(count);
    for (size_t i = 0; i < count; i++) labels[i] = random_label(mix64(labels_key ^ salt) ^ mix64(i), true);
    return labels;
  };
  // The held-out prompts: every held-out pair at every size and position, then as many seen ones.
  std::vector<ShapeLabel> prompts;
  for (const auto& pair : HELD_OUT)
    for (int size = 0; size < SHAPE_WORLD_SIZES; size++)
      for (int row = 0; row < SHAPE_WORLD_CELLS; row++)
        for (int col = 0; col < SHAPE_WORLD_CELLS; col++) prompts.push_back({pair[0], pair[1], size, row, col});
  const std::vector<ShapeLabel> seen = split(prompts.size(), 3);
  prompts.insert(prompts.end(), seen.begin(), seen.end());
  const std::string base = out_dir + "/shapes_";
  write_shape_file(base + "train.h5", world, patch, split(train_images, 1), mix64(draw_key ^ 1));
  if (val_images > 0) write_shape_file(base + "val.h5", world, patch, split(val_images, 2), mix64(draw_key ^ 2));
  write_shape_file(base + "prompts.h5", world, patch, prompts, mix64(draw_key ^ 3));
  // The empty caption: the unconditional input for classifier-free guidance.
  {
    H5QuietErrors quiet;
    const std::string path = base + "empty.h5", tmp = path + ".tmp";
    std::vector<float> text(static_cast<size_t>(world.caption_tokens) * world.text_dim), pooled(world.text_dim);
    encode_shape_caption(world, nullptr, text.data(), pooled.data());
    {
      H5Id file(h5_check_id(H5Fcreate(tmp.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), tmp, "H5Fcreate"), H5Fclose);
      h5_write_dataset(file, "encoder_hidden_states", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT,
                       {1, hsize_t(world.caption_tokens), hsize_t(world.text_dim)}, text.data(), tmp);
      h5_write_dataset(file, "pooled_projections", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, {1, hsize_t(world.text_dim)},
                       pooled.data(), tmp);
      H5Id string_type(H5Tcopy(H5T_C_S1), H5Tclose);  // and as text, for a text encoder in the job
      H5Tset_size(string_type, 1);
      H5Tset_strpad(string_type, H5T_STR_NULLTERM);
      const char empty[1] = {'\0'};
      h5_write_dataset(file, "captions", string_type, string_type, {1}, empty, tmp);
    }
    if (std::rename(tmp.c_str(), path.c_str()) != 0)
      throw UsageError("cannot write '" + printable_text(path) + "': " + std::strerror(errno));
  }
  const int grid = world.image_size / patch;
  std::printf("data synth-images: %s (%zu images), %s (%zu), %s (%zu held-out prompts with their real images, %zu of "
              "colour-shape pairs never trained on), %s (the empty caption)\n"
              "  %dx%d RGB images as %dx%d patches of %d: model.pixel_patch=%d model.in_channels=%d "
              "model.context_len=%d model.context_dim=%d model.pooled_dim=%d train.seq_len=%d\n",
              (base + "train.h5").c_str(), train_images, (base + "val.h5").c_str(), val_images,
              (base + "prompts.h5").c_str(), prompts.size(), prompts.size() - seen.size(), (base + "empty.h5").c_str(),
              world.image_size, world.image_size, grid, grid, patch, patch, 3 * patch * patch, world.caption_tokens,
              world.text_dim, world.text_dim, grid * grid);
}

void data_check_images(const std::string& images, const std::string& labels_path, const std::string& json_path) {
  const std::string hint = " (shardtrain sample and data synth-images write them)";
  std::vector<hsize_t> dims, label_dims;
  const std::vector<float> latents = h5_read_floats(images, "latents", &dims, hint);
  int64_t rows = 0, cols = 0, patch = 0;
  {
    H5QuietErrors quiet;
    H5Id file(H5Fopen(images.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
    for (const auto& [name, value] : {std::pair{"grid_rows", &rows}, {"grid_cols", &cols}, {"pixel_patch", &patch}}) {
      if (!h5_has_attr(file, name))
        throw DataError("--images='" + images + "' has no attribute '" + name +
                        "': give the images of a pixel-space model (model.pixel_patch > 0)");
      *value = h5_read_attr_i64(file, name, images);
    }
  }
  if (dims.size() != 3 || rows < 1 || cols < 1 || patch < 1 || rows != cols ||
      dims[1] != static_cast<hsize_t>(rows * cols) || dims[2] != static_cast<hsize_t>(3 * patch * patch))
    throw DataError(strprintf("--images='%s': latents of shape (%s) are not square images of %lldx%lld patches of "
                              "%lld pixels",
                              images.c_str(), join_dims(dims).c_str(), static_cast<long long>(rows),
                              static_cast<long long>(cols), static_cast<long long>(patch)));
  const std::vector<int32_t> labels = h5_read_ints(labels_path, "labels", &label_dims, hint);
  if (label_dims.size() != 2 || label_dims[1] != 5 || label_dims[0] != dims[0])
    throw DataError(strprintf("--labels='%s': labels of shape (%s); the %llu images need (%llu, 5)", labels_path.c_str(),
                              join_dims(label_dims).c_str(), static_cast<unsigned long long>(dims[0]),
                              static_cast<unsigned long long>(dims[0])));
  // Counts of correct readings: colour, shape, size, position, all four; over all images and the
  // held-out pairs.
  int correct[2][5] = {}, counted_images[2] = {0, 0};
  const size_t image = dims[1] * dims[2];
  for (size_t i = 0; i < dims[0]; i++) {
    const int32_t* v = labels.data() + 5 * i;
    const ShapeLabel want{v[0], v[1], v[2], v[3], v[4]};
    const std::vector<float> rgb = pixels_from_patches(latents.data() + i * image, static_cast<int>(rows),
                                                       static_cast<int>(cols), static_cast<int>(patch));
    const ShapeReading got = read_shape(rgb.data(), static_cast<int>(rows * patch));
    const bool right[5] = {got.found && got.label.colour == want.colour, got.found && got.label.shape == want.shape,
                           got.found && got.label.size == want.size,
                           got.found && got.label.row == want.row && got.label.col == want.col,
                           got.found && got.label == want};
    for (int group = 0; group < 2; group++) {
      if (group == 1 && !held_out_pair(want.colour, want.shape)) continue;
      counted_images[group]++;
      for (int a = 0; a < 5; a++) correct[group][a] += right[a];
    }
  }
  const char* names[5] = {"colour", "shape", "size", "position", "all four"};
  auto rate = [&](int group, int a) { return counted_images[group] ? double(correct[group][a]) / counted_images[group] : NAN; };
  std::printf("check-images: %s against the labels of %s\n%-10s %14s %26s\n", images.c_str(), labels_path.c_str(),
              "attribute", strprintf("all (%d)", counted_images[0]).c_str(),
              strprintf("held-out pairs (%d)", counted_images[1]).c_str());
  nlohmann::ordered_json json{{"images", images}, {"labels", labels_path}, {"count", counted_images[0]},
                              {"held_out_count", counted_images[1]}};
  for (int a = 0; a < 5; a++) {
    std::printf("%-10s %13.1f%% %25.1f%%\n", names[a], 100 * rate(0, a), 100 * rate(1, a));
    json[names[a]] = rate(0, a);
    json[std::string("held_out_") + names[a]] = counted_images[1] ? nlohmann::json(rate(1, a)) : nlohmann::json();
  }
  if (!json_path.empty()) {
    std::ofstream out(json_path);
    out << json.dump() << "\n";
    if (!out) throw UsageError("cannot write --json='" + printable_text(json_path) + "'");
  }
}

}  // namespace shardtrain
