"""Images end to end in pixel space (docs/images.md): `data synth-images` and `data check-images`,
a pixel-space FLUX model (model.pixel_patch) trained on them, its PNG files, caption dropout.
Oracles: the synthetic world's rules written out here in numpy (palette, captions, held-out
pairs, where each object sits), Pillow reading the PNG files against the HDF5 latents converted
in numpy, another rank count, and the same run on data whose captions were zeroed by hand."""
import json
import os
import subprocess

import h5py
import numpy as np

import harness
from harness import ROOT, read_metrics, run, tempdir
from test_bad_input import expect_usage_error
from test_flux import latent_file, ok

SHAPES_INI = os.path.join(ROOT, "inputs", "flux-shapes.ini")
COLOURS = ["red", "green", "blue", "yellow", "magenta", "cyan"]
PALETTE = np.array([[0.90, 0.15, 0.15], [0.15, 0.80, 0.20], [0.20, 0.35, 0.95], [0.95, 0.85, 0.15],
                    [0.85, 0.20, 0.85], [0.15, 0.80, 0.85]])
SHAPES, SIZES = ["circle", "square", "triangle"], ["small", "large"]
ROWS, COLS = ["top", "middle", "bottom"], ["left", "centre", "right"]
HELD_OUT = {(0, 2), (1, 0), (2, 1), (5, 2)}  # red triangle, green circle, blue square, cyan triangle
SIZE, PATCH = 32, 8  # the tests' world: 32 x 32 images, a 4 x 4 grid of 192-channel tokens


def unpatch(tokens, patch=PATCH):
    """(N, 3 p^2) tokens in channel order (c, ph, pw) -> an image in [0, 1], (H, W, 3)."""
    g = int(round(np.sqrt(tokens.shape[0])))
    image = tokens.reshape(g, g, 3, patch, patch).transpose(0, 3, 1, 4, 2).reshape(g * patch, g * patch, 3)
    return np.clip((image + 1) / 2, 0, 1)


WORLD = {}


def world():
    """The tests' synthetic world, written once."""
    if not WORLD:
        folder = tempdir()
        proc = ok(run(1, ["data", "synth-images", "--out-dir", folder, "--image-size", str(SIZE), "--patch", str(PATCH),
                          "--train-images", "96", "--val-images", "16", "--seed", "5"]))
        assert "model.pixel_patch=8 model.in_channels=192" in proc.stdout, proc.stdout
        WORLD.update({k: os.path.join(folder, f"shapes_{k}.h5") for k in ("train", "val", "prompts", "empty")})
    return WORLD


def shape_args(*overrides):
    w = world()
    options = {"--data.train_file": w["train"], "--data.val_file": w["val"], "--flow.sample_prompts": w["prompts"],
               "--checkpoint.dir": tempdir(), "--train.steps": "4", "--train.eval_every": "2", "--train.log_every": "1",
               "--train.seq_len": "16", "--model.n_embd": "32", "--model.n_head": "2",
               "--model.pixel_patch": "8", "--model.in_channels": "192", "--model.rope_axes": "4,6,6",
               "--train.global_batch": "8", "--train.micro_batch": "4", "--flow.sample_every": "0",
               "--train.peak_gflops": "100", "--train.threads": "1"}
    for item in overrides:
        key, _, value = item.partition("=")
        options[key] = value
    return ["train", "--config", SHAPES_INI, *(f"{k}={v}" for k, v in options.items())]


def test_synth_images_draw_what_their_captions_say():
    w = world()
    with h5py.File(w["train"], "r") as f:
        assert f["latents"].shape == (96, 16, 192) and f["encoder_hidden_states"].shape == (96, 8, 32)
        assert f["pooled_projections"].shape == (96, 32) and f["labels"].shape == (96, 5)
        assert (int(f.attrs["grid_rows"]), int(f.attrs["grid_cols"]), int(f.attrs["pixel_patch"])) == (4, 4, 8)
        labels, captions = f["labels"][()], [c.decode() for c in f["captions"][()]]
        latents, text, pooled = f["latents"][()], f["encoder_hidden_states"][()], f["pooled_projections"][()]
    assert not any((c, s) in HELD_OUT for c, s, *_ in labels), "a held-out colour-shape pair in training"
    for (c, s, z, r, k), caption, tokens, image in zip(labels, captions, latents, [unpatch(t) for t in latents]):
        assert caption == f"a {SIZES[z]} {COLOURS[c]} {SHAPES[s]} at the {ROWS[r]} {COLS[k]}"
        bright = image.max(axis=2) > 0.35
        ys, xs = np.nonzero(bright)
        mean = image[bright].mean(axis=0)
        assert np.argmin(((mean / mean.max() - PALETTE / PALETTE.max(1, keepdims=True)) ** 2).sum(1)) == c, caption
        centre = ((xs.min() + xs.max() + 1) / 2, (ys.min() + ys.max() + 1) / 2)
        assert [int(v // (SIZE / 3)) for v in centre] == [k, r], (caption, centre)
    # One embedding per word: "a", "at" and "the" (words 0, 4, 5) are the same rows in every
    # caption; the pooled vector is the mean of the 8 words.
    for t in (0, 4, 5):
        assert (text[:, t] == text[0, t]).all()
    np.testing.assert_allclose(pooled, text.mean(axis=1), atol=1e-5)
    with h5py.File(w["prompts"], "r") as f:
        labels = f["labels"][()]
    held = [(c, s) in HELD_OUT for c, s, *_ in labels]
    assert sum(held) == 4 * 2 * 9 and len(held) == 2 * 4 * 2 * 9  # every held-out pair everywhere, then as many seen
    with h5py.File(w["empty"], "r") as f:
        assert not f["encoder_hidden_states"][()].any() and not f["pooled_projections"][()].any()


def check(images, labels=None):
    out = os.path.join(tempdir(), "check.json")
    args = ["data", "check-images", "--images", images, "--json", out] + (["--labels", labels] if labels else [])
    ok(run(1, args))
    with open(out) as f:
        return json.load(f)


def test_check_images_grades_the_real_images_right_and_wrong_labels_wrong():
    w = world()
    rates = check(w["prompts"])
    assert rates["count"] == 144 and rates["held_out_count"] == 72
    assert all(rates[k] == 1.0 for k in ("colour", "shape", "size", "position", "all four")), rates
    # The same images graded against another image's labels: the checker must notice.
    wrong = os.path.join(tempdir(), "wrong.h5")
    with h5py.File(w["prompts"], "r") as f, h5py.File(wrong, "w") as g:
        g["labels"] = np.roll(f["labels"][()], 1, axis=0)
    rates = check(w["prompts"], wrong)
    assert rates["all four"] < 0.2 and rates["colour"] < 0.6, rates


def png_pixels(paths):
    """The RGB pixels of PNG files, read by Pillow in the test virtual environment."""
    script = ("import json, sys\nfrom PIL import Image\n"
              "out = []\n"
              "for p in sys.argv[1:]:\n"
              "    im = Image.open(p); assert im.mode == 'RGB', im.mode\n"
              "    out.append([im.size, list(im.tobytes())])\n"
              "print(json.dumps(out))")
    proc = subprocess.run(["timeout", "60", harness.venv_python(), "-c", script, *paths], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [np.array(px, np.uint8).reshape(size[1], size[0], 3) for size, px in json.loads(proc.stdout)]


# Prints [[step, height, width, [pixel bytes]], ...] of a folder's "samples" images, as TensorBoard's
# EventAccumulator reads them and Pillow decodes them.
TB_IMAGES = r"""
import io, json, sys
from PIL import Image
from tensorboard.backend.event_processing import event_accumulator
acc = event_accumulator.EventAccumulator(sys.argv[1], size_guidance={event_accumulator.IMAGES: 0})
acc.Reload()
out = []
for e in acc.Images("samples"):
    im = Image.open(io.BytesIO(e.encoded_image_string))
    out.append([e.step, e.height, e.width, list(im.convert("RGB").tobytes())])
print(json.dumps(out))
"""


def to_rgb8(tokens):
    return np.round(unpatch(tokens) * 255).astype(np.uint8)


def test_a_pixel_model_trains_and_its_samples_are_png_files_equal_to_its_latents():
    harness.venv_python()
    w = world()
    ckpt, tb = tempdir(), tempdir()
    ok(run(2, shape_args(f"--checkpoint.dir={ckpt}", "--flow.sample_every=2", "--flow.sample_cfg=2",
                         "--flow.caption_dropout=0.5", "--flow.sample_steps=3", f"--train.tensorboard_dir={tb}")))
    with h5py.File(os.path.join(ckpt, "ckpt-00000004.h5"), "r") as f:
        assert int(f.attrs["model.pixel_patch"]) == 8
    with h5py.File(os.path.join(ckpt, "samples", "step-00000002.h5"), "r") as f:
        latents = f["latents"][()]
        assert int(f.attrs["pixel_patch"]) == 8 and latents.shape == (144, 16, 192)
    [grid] = png_pixels([os.path.join(ckpt, "samples", "step-00000002.png")])
    assert grid.shape == (18 * 32 + 17 * 2, 8 * 32 + 7 * 2, 3)  # 144 images, 8 a row, 2 black pixels between
    for i in (0, 7, 8, 143):
        y, x = (i // 8) * 34, (i % 8) * 34
        np.testing.assert_array_equal(grid[y:y + 32, x:x + 32], to_rgb8(latents[i]))
    assert not grid[32:34].any()
    # The same grids in TensorBoard's Images tab, at steps 2 and 4.
    proc = subprocess.run(["timeout", "120", harness.venv_python(), "-c", TB_IMAGES, tb], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shown = json.loads(proc.stdout)
    assert [s[0] for s in shown] == [2, 4] and shown[0][1:3] == [grid.shape[0], grid.shape[1]]
    np.testing.assert_array_equal(np.array(shown[0][3], np.uint8).reshape(grid.shape), grid)
    # `sample` on 1, 2 and 3 ranks: the same PNG bytes, each image its latents.
    files = []
    for np_ in (1, 2, 3):
        out = os.path.join(tempdir(), "shapes.h5")
        ok(run(np_, ["sample", "--checkpoint", ckpt, "--prompts", w["prompts"], "--output", out, "--grid", "4x4",
                     "--steps", "3", "--cfg", "2", "--negative", w["empty"], "--seed", "3", "--batch", "16"]))
        pngs = [os.path.join(os.path.dirname(out), "shapes_images", f"{i:04d}.png") for i in range(144)]
        files.append([open(p, "rb").read() for p in pngs + [os.path.join(os.path.dirname(out), "shapes.png")]])
        with h5py.File(out, "r") as f:
            sampled = f["latents"][()]
    assert files[0] == files[1] == files[2], "the PNG bytes differ between 1, 2 and 3 ranks"
    # Training's last samples (flow.sample_cfg=2 against the empty caption, train.seed) are what
    # `sample` draws from its last checkpoint with the same settings.
    again_path = os.path.join(tempdir(), "again.h5")
    ok(run(1, ["sample", "--checkpoint", ckpt, "--prompts", w["prompts"], "--output", again_path, "--grid", "4x4",
               "--steps", "3", "--cfg", "2", "--negative", w["empty"], "--seed", "1337", "--batch", "4"]))
    with h5py.File(again_path, "r") as f, h5py.File(os.path.join(ckpt, "samples", "step-00000004.h5"), "r") as g:
        again, trained = f["latents"][()], g["latents"][()]
    assert np.abs(again - trained).max() / np.abs(trained).max() < 1e-5
    first = png_pixels([os.path.join(os.path.dirname(out), "shapes_images", "0000.png")])[0]
    np.testing.assert_array_equal(first, to_rgb8(sampled[0]))


def zeroed_captions(path):
    out = os.path.join(tempdir(), "zeroed.h5")
    with h5py.File(path, "r") as f, h5py.File(out, "w") as g:
        for name in f:
            g[name] = np.zeros_like(f[name][()]) if name in ("encoder_hidden_states", "pooled_projections") else f[name][()]
        for name, value in f.attrs.items():
            g.attrs[name] = value
    return out


def losses(proc, metrics):
    ok(proc)
    return [r["loss"] for r in read_metrics(metrics)]


def test_caption_dropout_trains_on_the_empty_caption_the_same_on_any_rank_count():
    w = world()
    m = [os.path.join(tempdir(), f"m{i}.jsonl") for i in range(4)]
    dropped = losses(run(2, shape_args("--flow.caption_dropout=1", f"--train.metrics_file={m[0]}")), m[0])
    zeroed = losses(run(2, shape_args(f"--data.train_file={zeroed_captions(w['train'])}",
                                      f"--train.metrics_file={m[1]}")), m[1])
    assert dropped == zeroed, (dropped, zeroed)
    half1 = losses(run(1, shape_args("--flow.caption_dropout=0.5", f"--train.metrics_file={m[2]}")), m[2])
    half2 = losses(run(2, shape_args("--flow.caption_dropout=0.5", f"--train.metrics_file={m[3]}")), m[3])
    assert max(abs(a - b) / abs(b) for a, b in zip(half1, half2)) < 1e-5, (half1, half2)
    assert half2 != dropped and half2 != zeroed


def test_bad_pixel_inputs_are_refused_with_one_line():
    w = world()
    latents = latent_file(8, 3, rows=4, cols=4, channels=192, text=(8, 32), pooled=32)
    expect_usage_error(shape_args(f"--data.train_file={latents}"), "holds VAE latents", "model.pixel_patch=8")
    expect_usage_error(shape_args("--model.pixel_patch=0"), "pixel patches", "set model.pixel_patch=8")
    expect_usage_error(shape_args("--model.pixel_patch=3"), "model.pixel_patch=3", "set model.in_channels=27")
    expect_usage_error(["data", "synth-images", "--out-dir", tempdir(), "--patch", "5"],
                       "--patch=5 does not divide --image-size=32")
    expect_usage_error(["data", "synth-images", "--out-dir", tempdir(), "--image-size", "16"], "--image-size")
    expect_usage_error(["data", "check-images", "--images", latents], "no attribute 'pixel_patch'")
    expect_usage_error(["data", "check-images", "--images", w["prompts"], "--labels", w["train"]],
                       "labels of shape (96, 5)")


def test_the_loss_by_noise_level_adds_up_and_is_plotted():
    """Each step's record splits a flow model's loss into ten noise-level buckets: the buckets'
    means weighted by their samples are the step's loss and the samples are the global batch; noise
    levels pinned near 1 or near 0 (logit-normal, mean +-8) land every sample in the last or the
    first bucket; 1 and 2 ranks give the same buckets; tools/plot_metrics.py draws them
    (loss_by_sigma.png, its pixels those of the data) and draws none for a language model."""
    from test_plots import need_matplotlib, plot, read_png
    m = [os.path.join(tempdir(), f"s{i}.jsonl") for i in range(4)]
    ok(run(1, shape_args(f"--train.metrics_file={m[0]}")))
    ok(run(2, shape_args(f"--train.metrics_file={m[1]}")))
    one, two = read_metrics(m[0]), read_metrics(m[1])
    for r, r2 in zip(one, two):
        assert sum(r["sigma_samples"]) == 8 and len(r["loss_by_sigma"]) == 10, r
        weighted = sum(v * n for v, n in zip(r["loss_by_sigma"], r["sigma_samples"]) if n) / 8
        assert abs(weighted - r["loss"]) < 1e-9 * r["loss"], (weighted, r["loss"])
        assert all((v is None) == (n == 0) for v, n in zip(r["loss_by_sigma"], r["sigma_samples"])), r
        assert r["sigma_samples"] == r2["sigma_samples"]
        assert all(v is None or abs(v - v2) < 1e-6 * v for v, v2 in zip(r["loss_by_sigma"], r2["loss_by_sigma"]))
    for path, mean, bucket in ((m[2], "8", 9), (m[3], "-8", 0)):
        ok(run(2, shape_args(f"--train.metrics_file={path}", "--flow.sigma_sampling=logit_normal",
                             f"--flow.logit_mean={mean}", "--flow.logit_std=0.01")))
        for r in read_metrics(path):
            assert r["sigma_samples"][bucket] == 8 and r["loss_by_sigma"][bucket] == r["loss"], (bucket, r)
    need_matplotlib()
    pixels = {}
    for path in m[1:]:
        out = tempdir()
        plot(path, "--label", "run", "--out", out)
        width, height, pixels[path] = read_png(os.path.join(out, "loss_by_sigma.png"))
        assert width >= 400 and height >= 300
    assert len(set(pixels.values())) == 3, "different losses by noise level drew the same pixels"
