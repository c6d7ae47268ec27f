"""Black Forest Labs' single-file FLUX.1 layout (flux1-dev.safetensors) in: `convert` and
checkpoint.init_from read it as they read a diffusers folder. The oracle is the diffusers folder of
the same random weights: the test writes the single file from it in BFL's layout -- their module
names (flux/model.py), q, k and v fused (a single block's linear1 = q | k | v | MLP), the final
modulation's halves stored (shift, scale) -- the inverse of diffusers' convert_flux_to_diffusers.py,
and both must convert to the same checkpoint bit for bit."""
import os

import h5py
import numpy as np

from flux_reference import make_diffusers_folder
from harness import run, tempdir
from safetensors_io import read_safetensors, write_safetensors
from test_bad_input import expect_usage_error

# FLUX.1's heads of 128 (their rotary axes are not in the file), one block of each kind.
CFG = dict(n_layer=1, n_single_layer=1, n_head=2, head_dim=128, norm_eps=1e-6, guidance_embeds=True,
           rope_axes=(16, 56, 56), rope_theta=10000.0, in_channels=16, context_dim=32, context_len=8, pooled_dim=24)


def bfl_tensors(d, cfg):
    """diffusers' tensors `d` (name -> array) in Black Forest Labs' names and layout."""
    C = cfg["n_head"] * cfg["head_dim"]
    out = {}

    def linear(bfl, diffusers):
        out[bfl + ".weight"], out[bfl + ".bias"] = d[diffusers + ".weight"], d[diffusers + ".bias"]

    def fused(bfl, parts):
        for leaf in ("weight", "bias"):
            out[f"{bfl}.{leaf}"] = np.concatenate([d[f"{p}.{leaf}"] for p in parts])

    linear("img_in", "x_embedder")
    linear("txt_in", "context_embedder")
    linear("time_in.in_layer", "time_text_embed.timestep_embedder.linear_1")
    linear("time_in.out_layer", "time_text_embed.timestep_embedder.linear_2")
    linear("vector_in.in_layer", "time_text_embed.text_embedder.linear_1")
    linear("vector_in.out_layer", "time_text_embed.text_embedder.linear_2")
    if cfg["guidance_embeds"]:
        linear("guidance_in.in_layer", "time_text_embed.guidance_embedder.linear_1")
        linear("guidance_in.out_layer", "time_text_embed.guidance_embedder.linear_2")
    for leaf in ("weight", "bias"):  # diffusers (scale, shift) -> BFL (shift, scale)
        scale, shift = np.split(d[f"norm_out.linear.{leaf}"], 2)
        out[f"final_layer.adaLN_modulation.1.{leaf}"] = np.concatenate([shift, scale])
    linear("final_layer.linear", "proj_out")
    for l in range(cfg["n_layer"]):
        b, t = f"double_blocks.{l}.", f"transformer_blocks.{l}."
        for s, mod, qkv, norms, proj, ff in (
                ("img_", "norm1", ("to_q", "to_k", "to_v"), ("norm_q", "norm_k"), "to_out.0", "ff"),
                ("txt_", "norm1_context", ("add_q_proj", "add_k_proj", "add_v_proj"),
                 ("norm_added_q", "norm_added_k"), "to_add_out", "ff_context")):
            linear(b + s + "mod.lin", t + mod + ".linear")
            fused(b + s + "attn.qkv", [t + "attn." + n for n in qkv])
            out[b + s + "attn.norm.query_norm.scale"] = d[t + "attn." + norms[0] + ".weight"]
            out[b + s + "attn.norm.key_norm.scale"] = d[t + "attn." + norms[1] + ".weight"]
            linear(b + s + "attn.proj", t + "attn." + proj)
            linear(b + s + "mlp.0", t + ff + ".net.0.proj")
            linear(b + s + "mlp.2", t + ff + ".net.2")
    for l in range(cfg["n_single_layer"]):
        b, t = f"single_blocks.{l}.", f"single_transformer_blocks.{l}."
        linear(b + "modulation.lin", t + "norm.linear")
        fused(b + "linear1", [t + "attn.to_q", t + "attn.to_k", t + "attn.to_v", t + "proj_mlp"])
        out[b + "norm.query_norm.scale"] = d[t + "attn.norm_q.weight"]
        out[b + "norm.key_norm.scale"] = d[t + "attn.norm_k.weight"]
        linear(b + "linear2", t + "proj_out")
    assert out["final_layer.adaLN_modulation.1.weight"].shape == (2 * C, C)
    return out


def convert(source, output):
    proc = run(1, ["convert", "--input", source, "--output", output, "--layout", "gathered"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc


def datasets(path):
    found = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: found.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return found


def folder_and_file(cfg=CFG, seed=5, prefix=""):
    folder = os.path.join(tempdir(), "diffusers")
    params = make_diffusers_folder(folder, cfg, seed)
    single = os.path.join(tempdir(), "flux1-test.safetensors")
    write_safetensors({prefix + k: v.astype(np.float32) for k, v in bfl_tensors(params, cfg).items()}, single)
    return folder, single


SHAPE_KEYS = ("model.n_layer", "model.n_single_layer", "model.n_embd", "model.n_head", "model.in_channels",
              "model.context_dim", "model.pooled_dim", "model.guidance_embeds", "model.rope_axes")


def assert_same_checkpoint(want, got, keys, label):
    """Two checkpoints with the same datasets bit for bit and the same `keys` attributes."""
    a, b = datasets(want), datasets(got)
    assert sorted(a) == sorted(b) and len(a) > 10
    for name in a:
        assert np.array_equal(a[name], b[name]), (label, name)
    with h5py.File(want, "r") as f, h5py.File(got, "r") as g:
        for key in keys:
            assert f.attrs[key] == g.attrs[key], (label, key)


def test_a_black_forest_labs_file_converts_as_its_diffusers_folder():
    for prefix in ("", "model.diffusion_model."):  # BFL's own files, ComfyUI's copies
        folder, single = folder_and_file(prefix=prefix)
        want, got = os.path.join(tempdir(), "a.h5"), os.path.join(tempdir(), "b.h5")
        convert(folder, want)
        convert(single, got)
        assert_same_checkpoint(want, got, SHAPE_KEYS, prefix)


def test_a_schnell_file_has_no_guidance_embedder_and_trains_from_init_from():
    cfg = dict(CFG, guidance_embeds=False)
    folder, single = folder_and_file(cfg, seed=6)
    ckpt = os.path.join(tempdir(), "c.h5")
    convert(single, ckpt)
    with h5py.File(ckpt, "r") as f:
        assert not f.attrs["model.guidance_embeds"]
    # checkpoint.init_from takes the file as it takes a folder: the model's shape from it.
    from test_flux import latent_file
    train = latent_file(6, 3, channels=16, text=(8, 32), pooled=24)
    out = tempdir()
    proc = run(1, ["train", "--model.arch=flux", f"--checkpoint.init_from={single}", f"--checkpoint.dir={out}",
                   f"--data.train_file={train}", "--data.val_file=", "--train.steps=1", "--train.global_batch=2",
                   "--train.micro_batch=2", "--train.seq_len=16", "--model.context_len=8", "--train.warmup_steps=0"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "C=256 H=2" in proc.stdout and "no-guidance" in proc.stdout


def test_bad_black_forest_labs_files_are_named():
    folder, single = folder_and_file(seed=7)
    base = bfl_tensors(make_diffusers_folder(folder, CFG, 7), CFG)

    def broken(edit):
        tensors = dict(base)
        edit(tensors)
        path = os.path.join(tempdir(), "broken.safetensors")
        write_safetensors(tensors, path)
        return path
    out = os.path.join(tempdir(), "x.h5")
    missing = broken(lambda t: t.pop("single_blocks.0.linear2.bias"))
    expect_usage_error(["convert", "--input", missing, "--output", out], "tensor 'single_blocks.0.linear2.bias' is missing",
                       np_=1)
    extra = broken(lambda t: t.__setitem__("double_blocks.0.img_attn.extra", np.zeros(3, np.float32)))
    expect_usage_error(["convert", "--input", extra, "--output", out], "unexpected tensor 'double_blocks.0.img_attn.extra'",
                       np_=1)
    short = broken(lambda t: t.__setitem__("double_blocks.0.txt_attn.qkv.weight",
                                           t["double_blocks.0.txt_attn.qkv.weight"][:-1]))
    expect_usage_error(["convert", "--input", short, "--output", out], "'double_blocks.0.txt_attn.qkv.weight' has shape [767, 256]",
                       "needs [768, 256]", np_=1)
    no_pooled = broken(lambda t: [t.pop(n) for n in list(t) if n.startswith("vector_in.")])
    expect_usage_error(["convert", "--input", no_pooled, "--output", out], "without a 2-dimensional 'vector_in",
                       np_=1)
    other = os.path.join(tempdir(), "other.safetensors")
    write_safetensors({"encoder.weight": np.zeros((2, 2), np.float32)}, other)
    expect_usage_error(["convert", "--input", other, "--output", out], "in no model's single-file layout", np_=1)
    narrow = os.path.join(tempdir(), "narrow.safetensors")
    small = dict(CFG, n_head=4, head_dim=64, rope_axes=(8, 28, 28))
    write_safetensors(bfl_tensors(make_diffusers_folder(os.path.join(tempdir(), "d"), small, 8), small), narrow)
    expect_usage_error(["convert", "--input", narrow, "--output", out], "heads of 64 dimensions", "axes_dims_rope", np_=1)


# kohya-ss's module for each of our LoRA targets (BFL's names, '_' for '.'), and our layers' rows of
# a fused module's up matrix.
def kohya_modules(cfg):
    C = cfg["n_head"] * cfg["head_dim"]
    flux2 = cfg.get("arch") == "flux2"  # SwiGLU MLPs (2F rows in), a single block's linear1 one module
    F = cfg["mlp_width"] if flux2 else 4 * C
    mlp_in, mlp_out, F_in = (".linear_in", ".linear_out", 2 * F) if flux2 else (".net.0.proj", ".net.2", F)
    modules = {}  # kohya module -> [(diffusers module, first row, rows)], (in, rows)
    for l in range(cfg["n_layer"]):
        t, b = f"transformer_blocks.{l}.", f"lora_unet_double_blocks_{l}_"
        for s, qkv, proj, ff in (("img_", ("to_q", "to_k", "to_v"), "to_out.0", "ff"),
                                 ("txt_", ("add_q_proj", "add_k_proj", "add_v_proj"), "to_add_out", "ff_context")):
            modules[b + s + "attn_qkv"] = ([(t + "attn." + n, i * C, C) for i, n in enumerate(qkv)], (C, 3 * C))
            modules[b + s + "attn_proj"] = ([(t + "attn." + proj, 0, C)], (C, C))
            modules[b + s + "mlp_0"] = ([(t + ff + mlp_in, 0, F_in)], (C, F_in))
            modules[b + s + "mlp_2"] = ([(t + ff + mlp_out, 0, C)], (F, C))
    for l in range(cfg["n_single_layer"]):
        t, b = f"single_transformer_blocks.{l}.", f"lora_unet_single_blocks_{l}_"
        if flux2:
            modules[b + "linear1"] = ([(t + "attn.to_qkv_mlp_proj", 0, 3 * C + F_in)], (C, 3 * C + F_in))
            modules[b + "linear2"] = ([(t + "attn.to_out", 0, C)], (C + F, C))
            continue
        parts = ["attn.to_q", "attn.to_k", "attn.to_v"]
        modules[b + "linear1"] = ([(t + p, i * C, C) for i, p in enumerate(parts)] + [(t + "proj_mlp", 3 * C, F)],
                                  (C, 3 * C + F))
        modules[b + "linear2"] = ([(t + "proj_out", 0, C)], (C + F, C))
    return modules


def kohya_file(cfg, rank, seed, path, alphas=(2.0, 4.0, 8.0)):
    """A kohya LoRA file of random down/up matrices and per-module alphas; returns
    {diffusers weight: its update (alpha / rank) up[rows] down} in float64."""
    rng = np.random.default_rng(seed)
    tensors, updates = {}, {}
    for k, (name, (layers, (inp, rows))) in enumerate(sorted(kohya_modules(cfg).items())):
        down = (0.1 * rng.standard_normal((rank, inp))).astype(np.float32)
        up = (0.1 * rng.standard_normal((rows, rank))).astype(np.float32)
        alpha = alphas[k % len(alphas)]
        tensors[name + ".lora_down.weight"], tensors[name + ".lora_up.weight"] = down, up
        tensors[name + ".alpha"] = np.array(alpha, np.float32)
        for module, first, n in layers:
            updates[module + ".weight"] = alpha / rank * up[first:first + n].astype(np.float64) @ down.astype(np.float64)
    write_safetensors(tensors, path)
    return updates


def merged_after_reading(args, lora, kohya):
    """The merged export's tensors after one step at a learning rate of 1e-30 (the adapters as read
    from the kohya file) of the training command `args(*lora, ...)`."""
    from test_flux import ok
    ckpt = tempdir()
    ok(run(2, args(*lora, f"--adapter.init_from={kohya}", "--train.lr=1e-30", "--train.steps=1",
                   "--train.eval_every=0", f"--checkpoint.dir={ckpt}")))
    merged_dir = os.path.join(tempdir(), "merged")
    ok(run(2, ["export", "--checkpoint", os.path.join(ckpt, "ckpt-00000001.h5"), "--format", "hf", "--merge",
               "--output", merged_dir]))
    return read_safetensors(os.path.join(merged_dir, "diffusion_pytorch_model.safetensors"))[0]


def test_a_kohya_lora_file_is_read_into_each_fused_layer():
    from test_flux import CFG as TINY, LORA_TARGETS, flux_args
    folder = os.path.join(tempdir(), "base")
    params = make_diffusers_folder(folder, TINY, seed=11)
    kohya = os.path.join(tempdir(), "kohya.safetensors")
    updates = kohya_file(TINY, 4, 12, kohya)
    lora = (f"--checkpoint.init_from={folder}", "--adapter.type=lora", f"--adapter.targets={LORA_TARGETS}",
            "--adapter.rank=4", "--adapter.alpha=4", "--checkpoint.format=gathered")
    merged = merged_after_reading(flux_args, lora, kohya)
    assert len(updates) == 2 * 12 + 2 * 5
    for name, base in params.items():
        expected = base + updates.get(name, 0)
        assert np.allclose(merged[name], expected, rtol=1e-5, atol=1e-6), name
    assert not np.allclose(merged["single_transformer_blocks.1.proj_mlp.weight"],
                           params["single_transformer_blocks.1.proj_mlp.weight"], atol=1e-4)
    # What the file and the configuration disagree on is named.
    expect_usage_error(flux_args(*lora, f"--adapter.init_from={kohya}", "--adapter.rank=8"),
                       "kohya LoRA file", "has rank 4", "adapter.rank=8")
    partial = LORA_TARGETS.replace("attn.to_k,", "")
    expect_usage_error(flux_args(*lora, f"--adapter.targets={partial}", f"--adapter.init_from={kohya}"),
                       "lora_unet_double_blocks_0_img_attn_qkv", "target all of its parts")
    tensors = read_safetensors(kohya)[0]
    tensors["lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight"] = np.zeros((4, 8), np.float32)
    with_te = os.path.join(tempdir(), "with_te.safetensors")
    write_safetensors(tensors, with_te)
    expect_usage_error(flux_args(*lora, f"--adapter.init_from={with_te}"), "adapts a text encoder")


def test_a_checkpoint_converts_to_a_black_forest_labs_file_and_back():
    # Out: the file holds BFL's tensors as the test lays them out from the diffusers folder (fused
    # q|k|v and linear1, the final modulation's halves swapped), exactly; back in: the same checkpoint.
    folder, _ = folder_and_file(seed=9)
    params = make_diffusers_folder(folder, CFG, 9)
    ckpt, again = os.path.join(tempdir(), "a.h5"), os.path.join(tempdir(), "b.h5")
    convert(folder, ckpt)
    single = os.path.join(tempdir(), "out", "flux1-out.safetensors")
    os.makedirs(os.path.dirname(single))
    proc = run(2, ["convert", "--input", ckpt, "--output", single])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "single file" in proc.stdout and os.listdir(os.path.dirname(single)) == ["flux1-out.safetensors"]
    got = read_safetensors(single)[0]
    want = bfl_tensors(params, CFG)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert np.array_equal(got[name], value.astype(np.float32)), name
    convert(single, again)
    a, b = datasets(ckpt), datasets(again)
    assert sorted(a) == sorted(b)
    for name in a:
        assert np.array_equal(a[name], b[name]), name
    # A language model has no single-file layout; a folder named .safetensors is refused.
    from harness import tiny_args
    gpt = tempdir()
    assert run(1, tiny_args(f"--checkpoint.dir={gpt}", "--train.steps=1")).returncode == 0
    expect_usage_error(["convert", "--input", os.path.join(gpt, "ckpt-00000001.h5"), "--output",
                        os.path.join(tempdir(), "gpt.safetensors")], "model.arch=gpt2 goes to a Hugging Face folder",
                       np_=1)


# FLUX.2: four rotary axes for heads of 128, one block of each kind, a SwiGLU MLP 2.5 x wide.
CFG2 = dict(arch="flux2", n_layer=1, n_single_layer=1, n_head=2, head_dim=128, mlp_width=640, norm_eps=1e-6,
            guidance_embeds=True, rope_axes=(32, 32, 32, 32), rope_theta=2000.0, in_channels=16, context_dim=32,
            context_len=8)


def bfl2_tensors(d, cfg):
    """diffusers' Flux2Transformer2DModel tensors `d` in Black Forest Labs' FLUX.2 names: the inverse of
    diffusers' convert_flux2_transformer_checkpoint_to_diffusers (single_file_utils.py), which was run
    on this function's output of a random model and gave back `d` exactly (diffusers 0.42.1)."""
    root = {"img_in": "x_embedder", "txt_in": "context_embedder",
            "time_in.in_layer": "time_guidance_embed.timestep_embedder.linear_1",
            "time_in.out_layer": "time_guidance_embed.timestep_embedder.linear_2",
            "double_stream_modulation_img.lin": "double_stream_modulation_img.linear",
            "double_stream_modulation_txt.lin": "double_stream_modulation_txt.linear",
            "single_stream_modulation.lin": "single_stream_modulation.linear", "final_layer.linear": "proj_out"}
    if cfg["guidance_embeds"]:
        root["guidance_in.in_layer"] = "time_guidance_embed.guidance_embedder.linear_1"
        root["guidance_in.out_layer"] = "time_guidance_embed.guidance_embedder.linear_2"
    out = {bfl + ".weight": d[ours + ".weight"] for bfl, ours in root.items()}
    scale, shift = np.split(d["norm_out.linear.weight"], 2)
    out["final_layer.adaLN_modulation.1.weight"] = np.concatenate([shift, scale])
    for l in range(cfg["n_layer"]):
        b, t = f"double_blocks.{l}.", f"transformer_blocks.{l}.attn."
        for s, qkv, norms, proj, ff in (("img_", ("to_q", "to_k", "to_v"), ("norm_q", "norm_k"), "to_out.0", "ff"),
                                        ("txt_", ("add_q_proj", "add_k_proj", "add_v_proj"),
                                         ("norm_added_q", "norm_added_k"), "to_add_out", "ff_context")):
            out[b + s + "attn.qkv.weight"] = np.concatenate([d[t + n + ".weight"] for n in qkv])
            out[b + s + "attn.norm.query_norm.scale"] = d[t + norms[0] + ".weight"]
            out[b + s + "attn.norm.key_norm.scale"] = d[t + norms[1] + ".weight"]
            out[b + s + "attn.proj.weight"] = d[t + proj + ".weight"]
            out[b + s + "mlp.0.weight"] = d[f"transformer_blocks.{l}.{ff}.linear_in.weight"]
            out[b + s + "mlp.2.weight"] = d[f"transformer_blocks.{l}.{ff}.linear_out.weight"]
    for l in range(cfg["n_single_layer"]):
        b, t = f"single_blocks.{l}.", f"single_transformer_blocks.{l}.attn."
        out[b + "linear1.weight"], out[b + "linear2.weight"] = d[t + "to_qkv_mlp_proj.weight"], d[t + "to_out.weight"]
        out[b + "norm.query_norm.scale"], out[b + "norm.key_norm.scale"] = d[t + "norm_q.weight"], d[t + "norm_k.weight"]
    return out


def test_a_flux2_black_forest_labs_file_converts_as_its_folder_trains_and_goes_back():
    folder = os.path.join(tempdir(), "flux2-diffusers")
    params = make_diffusers_folder(folder, CFG2, 10)
    want = os.path.join(tempdir(), "folder.h5")
    convert(folder, want)
    for prefix in ("", "model.diffusion_model."):  # BFL's own files, ComfyUI's copies
        single = os.path.join(tempdir(), "flux2-test.safetensors")
        write_safetensors({prefix + k: v.astype(np.float32) for k, v in bfl2_tensors(params, CFG2).items()}, single)
        got = os.path.join(tempdir(), "single.h5")
        convert(single, got)
        assert_same_checkpoint(want, got, SHAPE_KEYS + ("model.arch", "model.rope_theta", "model.intermediate_size"),
                               prefix)
    # Out: the checkpoint as a FLUX.2 single file holds exactly those tensors.
    out = os.path.join(tempdir(), "flux2-out.safetensors")
    proc = run(2, ["convert", "--input", want, "--output", out])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    written, expected = read_safetensors(out)[0], bfl2_tensors(params, CFG2)
    assert sorted(written) == sorted(expected)
    for name, value in expected.items():
        assert np.array_equal(written[name], value.astype(np.float32)), name
    # checkpoint.init_from takes the file: the model's shape from it.
    from test_flux import latent_file
    from test_flux2 import no_pooled
    train = latent_file(6, 3, channels=16, text=(8, 32), edit=no_pooled)
    proc = run(1, ["train", "--model.arch=flux2", f"--checkpoint.init_from={out}", f"--checkpoint.dir={tempdir()}",
                   f"--data.train_file={train}", "--data.val_file=", "--train.steps=1", "--train.global_batch=2",
                   "--train.micro_batch=2", "--train.seq_len=16", "--model.context_len=8", "--train.warmup_steps=0"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "C=256 H=2" in proc.stdout, proc.stdout[-2000:]


def test_a_kohya_lora_file_adapts_flux2_by_its_black_forest_labs_modules():
    # FLUX.2's modules in BFL's names (its single blocks' linear1 and linear2 whole): the merged
    # export equals W + (alpha / rank) up down for every adapted weight.
    from test_flux2 import CFG as TINY2, LORA_TARGETS as TARGETS2, flux2_args
    folder = os.path.join(tempdir(), "base2")
    params = make_diffusers_folder(folder, TINY2, seed=13)
    kohya = os.path.join(tempdir(), "kohya2.safetensors")
    updates = kohya_file(TINY2, 4, 14, kohya)
    lora = (f"--checkpoint.init_from={folder}", "--adapter.type=lora", f"--adapter.targets={TARGETS2}",
            "--adapter.rank=4", "--adapter.alpha=4", "--checkpoint.format=gathered")
    merged = merged_after_reading(flux2_args, lora, kohya)
    assert len(updates) == 2 * 12 + 2 * 2
    for name, base in params.items():
        assert np.allclose(merged[name], base + updates.get(name, 0), rtol=1e-5, atol=1e-6), name
