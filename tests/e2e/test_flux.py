"""model.arch=flux (docs/flux.md): the FLUX.1 transformer trained with flow matching on latent
shards, each property against an independent oracle:

- the loss of a step equals a float64 numpy forward written from diffusers' equations
  (flux_reference.py) on the parameters of the checkpoint before it and the samples the sampler and
  the flow-matching draws make (replicated in numpy); Llama's half-split rotary and a swapped final
  modulation, the two classic porting mistakes, are shown to miss it;
- losses do not depend on the rank count or the sharding strategy (1-4 ranks, SHARD_GRAD_OP with
  activation checkpointing, NO_SHARD, HYBRID_SHARD, offload), and a resumed run repeats them bit for bit;
- bad latent files are refused with one line naming the file and the fix (exit 2); generate refuses
  a FLUX checkpoint.
"""
import os

import h5py
import numpy as np

import json

from flux_reference import bf16_round, flow_sample, flux_forward, make_diffusers_folder, window
from harness import ROOT, read_metrics, rel_diff, run, tempdir, tiny_args
from test_adapters import safetensors_arrays
from test_bad_input import expect_usage_error
from test_checkpoint import checksum
from test_checkpoint_edges import meta_checksum

FLUX_INI = os.path.join(ROOT, "inputs", "flux-tiny.ini")
CFG = dict(n_layer=2, n_single_layer=2, n_head=2, head_dim=24, norm_eps=1e-6, guidance_embeds=True, rope_axes=(4, 10, 10),
           rope_theta=10000.0, in_channels=16, context_dim=32, context_len=8, pooled_dim=24, rows=4, cols=4)
SEED, GLOBAL_BATCH = 1337, 12


def latent_file(records, seed, path=None, rows=4, cols=4, channels=16, text=(8, 32), pooled=24, edit=None,
                condition=None):
    """A latent shard of `records` random records (float32), as tools/encode_images.py writes them;
    condition=(rows, cols): with Kontext's condition latents."""
    path = path or os.path.join(tempdir(), f"latents-{seed}.h5")
    rng = np.random.default_rng(seed)
    data = {"latents": rng.standard_normal((records, rows * cols, channels)).astype(np.float32),
            "encoder_hidden_states": rng.standard_normal((records,) + text).astype(np.float32),
            "pooled_projections": rng.standard_normal((records, pooled)).astype(np.float32)}
    attrs = {"grid_rows": np.int64(rows), "grid_cols": np.int64(cols)}
    if condition:
        data["condition_latents"] = rng.standard_normal((records, condition[0] * condition[1], channels)).astype(
            np.float32)
        attrs.update(condition_grid_rows=np.int64(condition[0]), condition_grid_cols=np.int64(condition[1]))
    if edit:
        edit(data, attrs)
    with h5py.File(path, "w") as f:
        for name, value in data.items():
            f[name] = value
        for name, value in attrs.items():
            f.attrs[name] = value
    return path


TRAIN, VAL = {}, {}


def data_files():
    if not TRAIN:
        TRAIN["path"], VAL["path"] = latent_file(24, 1), latent_file(6, 2)
    return TRAIN["path"], VAL["path"]


def flux_args(*overrides, metrics=None, config=FLUX_INI, files=None):
    """A training command of `config` on the latent `files` (train, val; default: data_files())."""
    train, val = files or data_files()
    options = {"--data.train_file": train, "--data.val_file": val, "--train.peak_gflops": "100",
               "--checkpoint.dir": tempdir(), "--train.steps": "4", "--train.eval_every": "2"}
    if metrics:
        options["--train.metrics_file"] = metrics
    for item in overrides:
        key, _, value = item.partition("=")
        options[key] = value
    return ["train", "--config", config, *(f"{k}={v}" for k, v in options.items())]


def ok(proc, what=""):
    assert proc.returncode == 0, f"{what}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def losses(np_, *overrides, **where):
    """The step losses and the validation losses of a run (flux_args' config and files: `where`)."""
    metrics = os.path.join(tempdir(), "metrics.jsonl")
    ok(run(np_, flux_args(*overrides, metrics=metrics, **where)), f"{np_} ranks {overrides}")
    return ([r["loss"] for r in read_metrics(metrics)], [r["val_loss"] for r in read_metrics(metrics, "eval")])


def test_losses_do_not_depend_on_the_rank_count_or_strategy():
    base, base_val = losses(1)
    assert len(base) == 4 and len(base_val) == 2 and all(np.isfinite(base))
    cases = [(2, ()), (3, ()), (4, ()),
             (2, ("--fsdp.sharding_strategy=SHARD_GRAD_OP", "--fsdp.activation_checkpointing=true")),
             (2, ("--fsdp.sharding_strategy=NO_SHARD",)), (3, ("--fsdp.cpu_offload=true",)),
             (4, ("--fsdp.sharding_strategy=HYBRID_SHARD", "--fsdp.shard_group_size=2"))]
    for np_, overrides in cases:
        got, got_val = losses(np_, *overrides)
        for a, b in zip(got + got_val, base + base_val):
            assert rel_diff(a, b) < 1e-5, (np_, overrides, got, base)


def reference_loss(params, step, records, with_rope_halves=False, final_shift_first=False, path=None,
                   keep=lambda v: v):
    """The summed squared error / elements of 0-based `step`, in float64 from the equations; a file
    with condition latents trains Kontext-style (the condition tokens after the target's, ids
    (1, row, col), the loss on the target tokens). keep: flux_forward's."""
    with h5py.File(path or TRAIN["path"], "r") as f:
        x0, text, pooled = f["latents"][()], f["encoder_hidden_states"][()], f["pooled_projections"][()]
        cond = f["condition_latents"][()] if "condition_latents" in f else None
        cond_cols = int(f.attrs["condition_grid_cols"]) if cond is not None else 1
    N = CFG["rows"] * CFG["cols"]
    img_ids = [[0, i // CFG["cols"], i % CFG["cols"]] for i in range(N)]
    if cond is not None:
        img_ids += [[1, i // cond_cols, i % cond_cols] for i in range(cond.shape[1])]
    img_ids = np.array(img_ids, np.float32)
    txt_ids = np.zeros((CFG["context_len"], 3), np.float32)
    total = 0.0
    for j in range(GLOBAL_BATCH):
        r = window(SEED, records, GLOBAL_BATCH, step, j)
        sigma, noisy, target = flow_sample(SEED, step * GLOBAL_BATCH + j, x0[r], sampling="logit_normal")
        hidden = noisy if cond is None else np.concatenate([noisy, cond[r]], 0)
        out = flux_forward(params, CFG, hidden[None].astype(np.float64), text[r][None].astype(np.float64),
                           pooled[r][None].astype(np.float64), [sigma], [1.0], img_ids, txt_ids,
                           rope_halves=with_rope_halves, final_shift_first=final_shift_first, keep=keep)
        total += float(((out[0, :N] - target.astype(np.float64)) ** 2).sum())
    return total / (GLOBAL_BATCH * N * CFG["in_channels"])


def test_a_steps_loss_is_the_reference_forward_of_the_checkpoint_before_it():
    # A gathered checkpoint after one step, its parameters made large (x 12: attention far from
    # uniform, so the rotary turn matters) with their checksums restamped, then resumed for a step:
    # that step's loss is the forward of exactly those parameters.
    folder = tempdir()
    ok(run(2, flux_args(f"--checkpoint.dir={folder}", "--checkpoint.format=gathered", "--train.steps=1")))
    path = os.path.join(folder, "ckpt-00000001.h5")
    params = {}
    with h5py.File(path, "r+") as f:
        for name in f["model"]:
            ds = f["model"][name]
            values = (ds[()] * (1 if name.endswith(".bias") or "norm" in name and "linear" not in name else 12))
            ds[...] = values.astype(np.float32)
            ds.attrs["checksum"] = np.uint64(checksum(ds[()]))
            params[name] = ds[()].astype(np.float64)
    metrics = os.path.join(folder, "resumed.jsonl")
    ok(run(2, flux_args(f"--checkpoint.dir={folder}", "--train.steps=2", metrics=metrics)))
    logged = read_metrics(metrics)
    assert [r["step"] for r in logged] == [2], logged
    expected = reference_loss(params, 1, 24)
    assert rel_diff(logged[0]["loss"], expected) < 1e-6, (logged[0]["loss"], expected)
    # The negative controls: each porting mistake moves the loss far beyond that.
    for halves, swapped in ((True, False), (False, True)):
        wrong = reference_loss(params, 1, 24, with_rope_halves=halves, final_shift_first=swapped)
        assert rel_diff(logged[0]["loss"], wrong) > 1e-3, (halves, swapped, logged[0]["loss"], wrong)


def check_bf16_activations(args, folder, reference, steps=4):
    """fsdp.activation_dtype=bf16 keeps the activations the backward reads in 16 bits: the losses of
    `steps` steps from the diffusers `folder` (`args`: the family's training command; a learning rate
    of 1e-30, which leaves every fp32 weight as it is) lie nearer reference(step, bf16_round) -- the
    residual streams rounded where the embedders and each block but the last make them, and every
    kept tensor inside the blocks where it is made -- than reference(step, identity), with
    checkpointing and without (the same losses to the bit: checkpointing rounds in place what it
    does not keep). Only nearer: where an fp32 value and the float64 one lie on two sides of a bf16
    rounding boundary they round one unit apart, a few of the thousands of roundings, each worth a
    few times an ordinary rounding's share; summed
    over the steps, measured 0.115 (FLUX.1) and 0.185 (FLUX.2) of the distance between the two
    references. It tells rounding where the reference does from not rounding; one missing point of
    the fifteen or so per block would move the losses by less than that margin."""
    rounded = exact = None
    losses = []
    for extra in ([], ["--fsdp.activation_checkpointing=true"]):
        metrics = os.path.join(tempdir(), "metrics.jsonl")
        ok(run(2, args(f"--checkpoint.init_from={folder}", f"--train.steps={steps}", "--train.lr=1e-30",
                       "--fsdp.activation_dtype=bf16", *extra, metrics=metrics)), extra)
        got = [r["loss"] for r in read_metrics(metrics)]
        losses.append(got)
        if rounded is None:  # (the run wrote the data files)
            rounded = [reference(step, bf16_round) for step in range(steps)]
            exact = [reference(step, lambda v: v) for step in range(steps)]
        off = sum(abs(g - r) for g, r in zip(got, rounded))
        shift = sum(abs(r - e) for r, e in zip(rounded, exact))
        print(f"bf16 activations {extra}: {off / shift:.3f} of the distance between the references")
        assert len(got) == steps and off < 0.5 * shift, (extra, got, rounded, exact)
    # Checkpointing's recompute rounds as the kept copies were rounded: the same losses to the bit.
    assert losses[0] == losses[1], losses


def check_held_equals_planned(args, cases):
    """What a run's arrays hold (counted at allocation) equals its plan byte for byte, on 2 ranks,
    for each case of options (`args`: the family's training command)."""
    for case in cases:
        metrics = os.path.join(tempdir(), "m.jsonl")
        ok(run(2, args("--train.steps=2", "--train.eval_every=0", *case, metrics=metrics)), case)
        r = read_metrics(metrics)[-1]
        assert r["held_mem_bytes"] == r["peak_mem_bytes"], (case, r["held_mem_bytes"], r["peak_mem_bytes"])


def test_memory_held_matches_the_plan():
    # The block inputs in fp32 and bf16, with and without checkpointing (its one working set shared
    # by the double and single blocks), and with fp32 parameters but bf16 block inputs.
    check_held_equals_planned(flux_args, [(), ("--fsdp.activation_checkpointing=true",),
                                          ("--fsdp.param_dtype=bf16",),
                                          ("--fsdp.param_dtype=bf16", "--fsdp.activation_checkpointing=true"),
                                          ("--fsdp.activation_dtype=bf16", "--fsdp.activation_checkpointing=true")])


def test_fp16_block_inputs_are_refused_and_fp16_parameters_keep_them_fp32():
    # FLUX's residual streams outgrow fp16's range (diffusers clips them in fp16): one line, exit 2.
    expect_usage_error(flux_args("--fsdp.activation_dtype=fp16"), "fsdp.activation_dtype=fp16",
                       "outgrow fp16's range", "use bf16 or fp32")
    # fsdp.activation_dtype=auto with fp16 parameters keeps them in fp32 (bf16 parameters: bf16).
    for dtype, kept in (("fp16", "fp32"), ("bf16", "bf16")):
        proc = ok(run(1, flux_args(f"--fsdp.param_dtype={dtype}", "--train.steps=1", "--train.eval_every=0")), dtype)
        assert f"activations {kept} " in proc.stdout, (dtype, proc.stdout[-1500:])


def test_bf16_activations_follow_the_reference_rounding_each_where_it_is_made():
    folder = os.path.join(tempdir(), "flux-diffusers")
    params = make_diffusers_folder(folder, CFG, seed=3)
    check_bf16_activations(flux_args, folder, lambda step, keep: reference_loss(params, step, 24, keep=keep))


def test_a_diffusers_folder_trains_from_its_weights_and_converts_both_ways_bit_for_bit():
    folder = os.path.join(tempdir(), "flux-diffusers")
    params = make_diffusers_folder(folder, CFG, seed=3)
    # checkpoint.init_from: the first step's loss is the reference forward of the folder's weights.
    metrics = os.path.join(tempdir(), "metrics.jsonl")
    ok(run(2, flux_args(f"--checkpoint.init_from={folder}", "--train.steps=1", metrics=metrics)))
    logged = read_metrics(metrics)[0]["loss"]
    expected = reference_loss(params, 0, 24)
    assert rel_diff(logged, expected) < 1e-6, (logged, expected)
    # convert: folder -> checkpoint (2 ranks) -> folder (3 ranks), the same tensors bit for bit,
    # and diffusers' config keys.
    h5 = os.path.join(tempdir(), "flux.h5")
    ok(run(2, ["convert", "--input", folder, "--output", h5]), "folder -> checkpoint")
    back = os.path.join(tempdir(), "back")
    ok(run(3, ["convert", "--input", h5, "--output", back]), "checkpoint -> folder")
    original = safetensors_arrays(os.path.join(folder, "diffusion_pytorch_model.safetensors"))[0]
    again = safetensors_arrays(os.path.join(back, "diffusion_pytorch_model.safetensors"))[0]
    assert sorted(original) == sorted(again)
    for name in original:
        assert np.array_equal(original[name].view(np.uint32), again[name].view(np.uint32)), name
    with open(os.path.join(folder, "config.json")) as f, open(os.path.join(back, "config.json")) as g:
        written, read = json.load(g), json.load(f)
    assert "torch_dtype" not in written
    for key, value in read.items():
        assert written[key] == value, (key, written.get(key), value)
    # A configuration that contradicts the folder's config.json is refused, naming both.
    expect_usage_error(flux_args(f"--checkpoint.init_from={folder}", "--model.n_single_layer=3"),
                       "model.n_single_layer=3 but config.json says 2")


def test_kontext_conditions_on_an_image_and_learns_only_its_target():
    # 8 condition tokens (a 2 x 4 grid) after the 16 target tokens: the loss of the first step is
    # the reference forward of a diffusers folder's weights over both, scored on the target.
    train = latent_file(24, 11, condition=(2, 4))
    val = latent_file(6, 12, condition=(2, 4))
    folder = os.path.join(tempdir(), "kontext")
    params = make_diffusers_folder(folder, CFG, seed=7)
    kontext = (f"--data.train_file={train}", f"--data.val_file={val}", "--model.condition_len=8",
               f"--checkpoint.init_from={folder}")
    metrics = os.path.join(tempdir(), "metrics.jsonl")
    ok(run(2, flux_args(*kontext, "--train.steps=1", metrics=metrics)))
    logged = read_metrics(metrics)[0]["loss"]
    expected = reference_loss(params, 0, 24, path=train)
    assert rel_diff(logged, expected) < 1e-6, (logged, expected)
    # Without the condition (as plain FLUX) the loss differs: the model sees the condition image.
    plain = losses(1, f"--checkpoint.init_from={folder}", f"--data.train_file={train}", f"--data.val_file={val}",
                   "--train.steps=1", "--train.eval_every=0")[0][0]
    assert rel_diff(plain, logged) > 1e-4, (plain, logged)
    base, base_val = losses(1, *kontext)
    for np_ in (2, 3):
        got, got_val = losses(np_, *kontext)
        assert all(rel_diff(a, b) < 1e-5 for a, b in zip(got + got_val, base + base_val)), (np_, got, base)
    # A file without the condition latents is refused, naming what is missing.
    expect_usage_error(flux_args("--model.condition_len=8", f"--checkpoint.init_from={folder}"),
                       "no dataset 'condition_latents'")


LORA_TARGETS = ("attn.to_q,attn.to_k,attn.to_v,attn.to_out.0,attn.add_q_proj,attn.add_k_proj,attn.add_v_proj,"
                "attn.to_add_out,ff.net.0.proj,ff.net.2,ff_context.net.0.proj,ff_context.net.2,proj_mlp,proj_out")


def test_lora_on_a_diffusers_base_trains_alone_the_same_on_any_rank_count():
    folder = os.path.join(tempdir(), "flux-diffusers")
    params = make_diffusers_folder(folder, CFG, seed=5)
    lora = (f"--checkpoint.init_from={folder}", "--adapter.type=lora", f"--adapter.targets={LORA_TARGETS}",
            "--adapter.rank=4", "--adapter.alpha=4", "--train.lr=1e-2", "--checkpoint.format=gathered")
    base, base_val = losses(1, *lora)
    assert base[-1] != base[0]
    for np_ in (2, 3):
        got, got_val = losses(np_, *lora)
        for a, b in zip(got + got_val, base + base_val):
            assert rel_diff(a, b) < 1e-5, (np_, got, base)
    # The base is frozen: the checkpoint holds the folder's weights bit for bit, and trained adapters
    # on every targeted layer of both kinds of block (the LoRA B matrices start at zero).
    ckpt = tempdir()
    ok(run(2, flux_args(*lora, f"--checkpoint.dir={ckpt}")))
    with h5py.File(os.path.join(ckpt, "ckpt-00000004.h5"), "r") as f:
        model = f["model"]
        for name, value in params.items():
            assert np.array_equal(model[name][()], value.astype(np.float32)), name
        adapted = [n for n in model if n.endswith(".lora_B.weight")]
        assert len(adapted) == 2 * 12 + 2 * 5, sorted(adapted)  # 12 layers per double block, 5 per single
        assert "single_transformer_blocks.1.proj_out.lora_B.weight" in adapted
        assert all(np.abs(model[n][()]).max() > 0 for n in adapted)
        trained = {n: model[n][()].astype(np.float64) for n in model}
    # export --adapter: diffusers' LoRA file, the checkpoint's adapters under transformer., the
    # LoraConfig in its metadata as diffusers' save_lora_weights writes it.
    out = os.path.join(tempdir(), "lora")
    ok(run(2, ["export", "--checkpoint", os.path.join(ckpt, "ckpt-00000004.h5"), "--adapter", "--output", out]))
    assert sorted(os.listdir(out)) == ["pytorch_lora_weights.safetensors"]
    lora_file, meta = safetensors_arrays(os.path.join(out, "pytorch_lora_weights.safetensors"))
    assert sorted(lora_file) == sorted("transformer." + n for n in trained if ".lora_" in n)
    for name, value in lora_file.items():
        assert np.array_equal(value, trained[name[len("transformer."):]].astype(np.float32)), name
    config = json.loads(meta["lora_adapter_metadata"])
    assert config["transformer.r"] == 4 and config["transformer.lora_alpha"] == 4, config
    assert config["transformer.target_modules"] == LORA_TARGETS.split(","), config
    # adapter.init_from reads that file back: the model it makes validates as the trained one did.
    trained_val = losses(2, *lora)[1][-1]
    metrics = os.path.join(tempdir(), "again.jsonl")
    ok(run(2, flux_args(*lora, f"--adapter.init_from={out}", "--train.lr=1e-30", "--train.steps=1",
                        "--train.eval_every=1", metrics=metrics)))
    again = read_metrics(metrics, "eval")[0]["val_loss"]
    assert rel_diff(again, trained_val) < 1e-6, (again, trained_val)
    expect_usage_error(flux_args(*lora, f"--adapter.init_from={out}", "--adapter.rank=8"),
                       "diffusers LoRA file", "rank 4 and alpha 4", "adapter.rank=8")
    # export --merge: a diffusers folder of W + (alpha / r) B A, merged here independently.
    merged_dir = os.path.join(tempdir(), "merged")
    ok(run(3, ["export", "--checkpoint", os.path.join(ckpt, "ckpt-00000004.h5"), "--format", "hf", "--merge",
               "--output", merged_dir]))
    merged = safetensors_arrays(os.path.join(merged_dir, "diffusion_pytorch_model.safetensors"))[0]
    assert sorted(merged) == sorted(params)
    for name, base_value in params.items():
        expected = base_value
        module = name[:-len(".weight")]
        if name.endswith(".weight") and module + ".lora_A.weight" in trained:
            expected = base_value + trained[module + ".lora_B.weight"] @ trained[module + ".lora_A.weight"]
        assert np.allclose(merged[name], expected, rtol=1e-5, atol=1e-6), name


def test_a_resumed_run_repeats_the_losses_bit_for_bit():
    straight, _ = losses(2)
    # Stop after 2 steps, then resume to 4 from the step-2 checkpoint (same rank count: same bits).
    folder = tempdir()
    first, resumed = os.path.join(folder, "m1.jsonl"), os.path.join(folder, "m2.jsonl")
    ok(run(2, flux_args(f"--checkpoint.dir={folder}", "--train.steps=2", metrics=first)))
    ok(run(2, flux_args(f"--checkpoint.dir={folder}", "--train.steps=4", metrics=resumed)))
    got = [r["loss"] for r in read_metrics(first)] + [r["loss"] for r in read_metrics(resumed)]
    assert got == straight, (got, straight)


def test_bad_latent_files_are_refused_with_one_line():
    train, _ = data_files()

    def bad(edit, *needles):
        path = latent_file(12, 9, edit=edit)
        expect_usage_error(flux_args(f"--data.train_file={path}"), path, *needles)

    bad(lambda d, a: d.update(latents=d["latents"][:, :, :8]), "'latents' has shape (12, 16, 8)", "model.in_channels")
    bad(lambda d, a: d.pop("pooled_projections"), "no dataset 'pooled_projections'")
    bad(lambda d, a: a.update(grid_rows=np.int64(2)), "grid_rows x grid_cols = 2 x 4")
    bad(lambda d, a: a.update(grid_rows=np.array([2, 2]), grid_cols=np.array([4, 4])), "name 2 grids",
        "the target latents are one image")
    bad(lambda d, a: d.update(encoder_hidden_states=d["encoder_hidden_states"][:6]), "holds 6 records")
    bad(lambda d, a: d.update(latents=d["latents"].astype(np.float16)), "is not float32")

    def poison(d, a):
        d["latents"][7, 3, 2] = np.nan
    bad(poison, "record 7 of dataset 'latents' holds a non-finite value")
    expect_usage_error(flux_args(f"--data.train_file={train}", "--train.seq_len=9"), "train.seq_len=9")
    not_hdf5 = os.path.join(tempdir(), "latents.h5")
    with open(not_hdf5, "w") as f:
        f.write("not hdf5")
    expect_usage_error(flux_args(f"--data.train_file={not_hdf5}"), "is not an HDF5 file of latents")


def euler_reference(params, cfg, text, pooled, rows, cols, steps, shift, guidance, seed, cfg_scale=1.0,
                    neg_text=None, neg_pooled=None, condition=None, condition_cols=1):
    """sample's images from the equations: the Euler steps of the flow from each prompt's noise, in
    float64 from the noise of the sampler's stream (rounded to float32 as it draws it). condition
    (P or 1, M, in_channels): Kontext's clean condition tokens after the target's, ids (1, row, col),
    in the negative prompts' forwards too; condition_cols: their grid's width, or FLUX.2's reference
    images' grids [(rows, cols), ...]. cfg["arch"] == "flux2": FLUX.2's forward (no pooled vector)
    and ids (image (0, row, col, 0), text (0, 0, 0, l), reference image k's t = 10 + 10 k)."""
    from flux_reference import counter_normal, flux2_forward, mix64
    flux2 = cfg.get("arch") == "flux2"
    N = rows * cols
    img_ids = [[0, i // cols, i % cols] + [0] * flux2 for i in range(N)]
    if condition is not None:
        grids = condition_cols if isinstance(condition_cols, list) else [
            (condition.shape[1] // condition_cols, condition_cols)]
        for k, (rows_k, cols_k) in enumerate(grids):
            img_ids += [[10 + 10 * k if flux2 else 1, i // cols_k, i % cols_k] + [0] * flux2
                        for i in range(rows_k * cols_k)]
    img_ids = np.array(img_ids, np.float32)
    txt_ids = np.array([[0, 0, 0, l] if flux2 else [0, 0, 0] for l in range(text.shape[1])], np.float32)
    sigmas = [1.0 - (1.0 - 1.0 / steps) * i / (steps - 1) if steps > 1 else 1.0 for i in range(steps)]
    sigmas = [shift * s / (1 + (shift - 1) * s) for s in sigmas] + [0.0]

    def forward(hidden, t, p, s32):
        if flux2:
            return flux2_forward(params, cfg, hidden, t, [s32], [guidance], img_ids, txt_ids)
        return flux_forward(params, cfg, hidden, t, p, [s32], [guidance], img_ids, txt_ids)

    out = []
    for k in range(text.shape[0]):
        key = mix64(mix64(seed ^ 0x73616D706C696E67) ^ mix64(k))
        x = counter_normal(key, np.arange(N * cfg["in_channels"])).astype(np.float32).astype(np.float64)
        x = x.reshape(1, N, cfg["in_channels"])
        clean = None if condition is None else condition[k if len(condition) > 1 else 0][None].astype(np.float64)
        for i in range(steps):
            s32 = np.float32(sigmas[i])
            hidden = x if clean is None else np.concatenate([x, clean], 1)
            v = forward(hidden, text[k:k + 1], None if flux2 else pooled[k:k + 1], s32)
            if cfg_scale > 1:
                vn = forward(hidden, neg_text[0:1], None if flux2 else neg_pooled[0:1], s32)
                v = vn + cfg_scale * (v - vn)
            x = x + (sigmas[i + 1] - sigmas[i]) * v[:, :N]  # the target's tokens leave
        out.append(x[0])
    return np.stack(out)


def test_sample_edits_kontexts_condition_images_as_the_equations_do():
    # A Kontext checkpoint (one step from a diffusers folder with 2 x 4 condition tokens), sampled
    # with one condition image per prompt on 1 and 2 ranks: the reference Euler steps with the
    # clean condition tokens after the target's; another condition image gives other images.
    folder = os.path.join(tempdir(), "kontext-base")
    make_diffusers_folder(folder, CFG, seed=13)
    ckpt = tempdir()
    ok(run(2, flux_args(f"--data.train_file={latent_file(24, 21, condition=(2, 4))}",
                        f"--data.val_file={latent_file(6, 22, condition=(2, 4))}", "--model.condition_len=8",
                        f"--checkpoint.init_from={folder}", f"--checkpoint.dir={ckpt}", "--checkpoint.format=gathered",
                        "--train.steps=1")))
    with h5py.File(os.path.join(ckpt, "ckpt-00000001.h5"), "r") as f:
        params = {name: f["model"][name][()].astype(np.float64) for name in f["model"]}
    prompts, negative = prompts_file(2, 23, tokens=8), prompts_file(1, 24, tokens=8)
    rng = np.random.default_rng(25)
    conditions = []
    for k in range(2):
        path = os.path.join(tempdir(), f"condition-{k}.h5")
        with h5py.File(path, "w") as f:
            f["condition_latents"] = rng.standard_normal((2, 8, 16)).astype(np.float32)
            f.attrs["condition_grid_rows"], f.attrs["condition_grid_cols"] = np.int64(2), np.int64(4)
        conditions.append(path)
    args = ["--prompts", prompts, "--grid", "4x4", "--steps", "3", "--guidance", "3.5", "--seed", "5", "--shift", "1.5",
            "--cfg", "2", "--negative", negative]
    outputs = []
    for np_, condition in ((1, conditions[0]), (2, conditions[0]), (1, conditions[1])):
        out = os.path.join(tempdir(), "kontext.h5")
        ok(run(np_, ["sample", "--checkpoint", ckpt, "--output", out, "--condition", condition,
                     "--batch", str(np_), *args]), f"{np_} ranks")
        with h5py.File(out, "r") as f:
            outputs.append(f["latents"][()])
    assert outputs[0].shape == (2, 16, 16)
    scale = np.abs(outputs[0]).max()
    assert np.abs(outputs[1] - outputs[0]).max() / scale < 1e-5
    assert np.abs(outputs[2] - outputs[0]).max() / scale > 1e-2, "another condition image, the same images"
    # One condition image for every prompt: as a file holding it once per prompt.
    with h5py.File(conditions[1], "r") as f:
        second = f["condition_latents"][1:2]
    once, twice = os.path.join(tempdir(), "once.h5"), os.path.join(tempdir(), "twice.h5")
    for path, images in ((once, second), (twice, np.concatenate([second, second]))):
        with h5py.File(path, "w") as f:
            f["condition_latents"] = images
            f.attrs["condition_grid_rows"], f.attrs["condition_grid_cols"] = np.int64(2), np.int64(4)
    shared = []
    for condition in (once, twice):
        out = os.path.join(tempdir(), "shared.h5")
        ok(run(1, ["sample", "--checkpoint", ckpt, "--output", out, "--condition", condition, "--batch", "2", *args]))
        with h5py.File(out, "r") as f:
            shared.append(f["latents"][()])
    assert np.array_equal(shared[0], shared[1])
    with h5py.File(prompts, "r") as f, h5py.File(negative, "r") as g, h5py.File(conditions[0], "r") as c:
        expected = euler_reference(params, CFG, f["encoder_hidden_states"][()].astype(np.float64),
                                   f["pooled_projections"][()].astype(np.float64), 4, 4, 3, 1.5, 3.5, 5, 2.0,
                                   g["encoder_hidden_states"][()].astype(np.float64),
                                   g["pooled_projections"][()].astype(np.float64), c["condition_latents"][()], 4)
    error = np.abs(outputs[0] - expected).max() / np.abs(expected).max()
    assert error < 1e-5, error
    # A Kontext checkpoint needs its condition images; a plain one takes none; shapes must fit.
    out = os.path.join(tempdir(), "bad.h5")
    expect_usage_error(["sample", "--checkpoint", ckpt, "--output", out, *args], "is a Kontext model",
                       "--condition FILE.h5", np_=1)
    plain = tempdir()
    ok(run(1, ["convert", "--input", folder, "--output", os.path.join(plain, "ckpt-00000000.h5")]))
    expect_usage_error(["sample", "--checkpoint", plain, "--output", out, "--condition", conditions[0], *args],
                       "no Kontext model", np_=1)
    wide = os.path.join(tempdir(), "wide-condition.h5")
    with h5py.File(wide, "w") as f:
        f["condition_latents"] = np.zeros((3, 8, 16), np.float32)
        f.attrs["condition_grid_rows"], f.attrs["condition_grid_cols"] = np.int64(2), np.int64(4)
    expect_usage_error(["sample", "--checkpoint", ckpt, "--output", out, "--condition", wide, *args],
                       "holds 3 condition images", np_=1)


def prompts_file(count, seed, tokens=5):
    path = os.path.join(tempdir(), f"prompts-{seed}.h5")
    rng = np.random.default_rng(seed)
    with h5py.File(path, "w") as f:
        f["encoder_hidden_states"] = rng.standard_normal((count, tokens, 32)).astype(np.float32)
        f["pooled_projections"] = rng.standard_normal((count, 24)).astype(np.float32)
    return path


def converted_folder(cfg, seed, name):
    """A random diffusers folder of `cfg` and a run folder holding it as a gathered checkpoint: (its
    parameters, the run folder)."""
    folder = os.path.join(tempdir(), name)
    params = make_diffusers_folder(folder, cfg, seed=seed)
    ckpt = tempdir()
    ok(run(1, ["convert", "--input", folder, "--output", os.path.join(ckpt, "ckpt-00000000.h5"), "--layout",
               "gathered"]))
    return params, ckpt


def test_sample_draws_the_reference_eulers_images_on_any_rank_count():
    params, ckpt = converted_folder(CFG, 9, "flux-diffusers")
    prompts, negative = prompts_file(3, 1), prompts_file(1, 2)
    outputs = []
    for np_, batch in ((1, 1), (2, 2), (3, 3)):
        out = os.path.join(tempdir(), "samples.h5")
        ok(run(np_, ["sample", "--checkpoint", ckpt, "--prompts", prompts, "--output", out, "--grid", "2x3",
                     "--steps", "3", "--guidance", "3.5", "--seed", "7", "--batch", str(batch), "--shift", "1.5",
                     "--cfg", "2", "--negative", negative]), f"{np_} ranks")
        with h5py.File(out, "r") as f:
            outputs.append(f["latents"][()])
            assert (int(f.attrs["grid_rows"]), int(f.attrs["grid_cols"])) == (2, 3)
    assert outputs[0].shape == (3, 6, 16)
    scale = np.abs(outputs[0]).max()
    for other in outputs[1:]:  # the same images on any rank count and batch size, to rounding
        assert np.abs(other - outputs[0]).max() / scale < 1e-5, (np.abs(other - outputs[0]).max(), scale)
    with h5py.File(prompts, "r") as f, h5py.File(negative, "r") as g:
        expected = euler_reference(params, CFG, f["encoder_hidden_states"][()].astype(np.float64),
                                   f["pooled_projections"][()].astype(np.float64), 2, 3, 3, 1.5, 3.5, 7, 2.0,
                                   g["encoder_hidden_states"][()].astype(np.float64),
                                   g["pooled_projections"][()].astype(np.float64))
    error = np.abs(outputs[0] - expected).max() / np.abs(expected).max()
    assert error < 1e-5, error
    # Bad input: --cfg without negative prompts; a language model's checkpoint (naming the families
    # that sample); prompts of another width.
    expect_usage_error(["sample", "--checkpoint", ckpt, "--prompts", prompts, "--output", out, "--grid", "2x3",
                        "--cfg", "2"], "--cfg=2 needs --negative", np_=1)
    gpt = tempdir()
    ok(run(1, tiny_args(f"--checkpoint.dir={gpt}", "--train.steps=1")))
    expect_usage_error(["sample", "--checkpoint", gpt, "--prompts", prompts, "--output", out, "--grid", "2x3"],
                       "is a 'gpt2' model, which predicts no image", "(flux, flux2)", np_=1)
    wide = os.path.join(tempdir(), "wide.h5")
    with h5py.File(wide, "w") as f:
        f["encoder_hidden_states"] = np.zeros((1, 5, 33), np.float32)
        f["pooled_projections"] = np.zeros((1, 24), np.float32)
    expect_usage_error(["sample", "--checkpoint", ckpt, "--prompts", wide, "--output", out, "--grid", "2x3"],
                       "--prompts=", "(P, L, 32)", np_=1)


def test_training_draws_samples_as_sample_does():
    folder = tempdir()
    prompts = prompts_file(3, 4, tokens=8)
    ok(run(2, flux_args(f"--checkpoint.dir={folder}", "--flow.sample_every=2", f"--flow.sample_prompts={prompts}",
                        "--flow.sample_steps=3", "--flow.sample_guidance=2.5")))
    assert sorted(os.listdir(os.path.join(folder, "samples"))) == ["step-00000002.h5", "step-00000004.h5"]
    with h5py.File(os.path.join(folder, "samples", "step-00000004.h5"), "r") as f:
        during = f["latents"][()]
        assert during.shape == (3, 16, 16) and np.isfinite(during).all()
    # `sample` on the step-4 checkpoint, with the same settings, draws the same images.
    out = os.path.join(tempdir(), "after.h5")
    ok(run(1, ["sample", "--checkpoint", folder, "--prompts", prompts, "--output", out, "--grid", "4x4", "--steps",
               "3", "--guidance", "2.5", "--seed", str(SEED)]))
    with h5py.File(out, "r") as f:
        after = f["latents"][()]
    assert np.abs(after - during).max() / np.abs(after).max() < 1e-5, np.abs(after - during).max()
    expect_usage_error(flux_args("--flow.sample_every=2"), "flow.sample_every needs flow.sample_prompts")
    expect_usage_error(tiny_args("--flow.shift=3"), "a flow.* key is set, but model.arch=gpt2 trains on tokens")


def test_a_kontext_model_draws_its_edits_while_training_as_sample_does():
    # Kontext training with flow.sample_condition: the samples edit those images, and `sample` on the
    # last checkpoint with --condition draws the same; bad inputs stop before the first step.
    ckpt = tempdir()
    train, val = latent_file(24, 41, condition=(2, 4)), latent_file(6, 42, condition=(2, 4))
    prompts = prompts_file(2, 43, tokens=8)
    picked = {}
    for name, source in (("same", val), ("other", train)):  # each file's first two condition images
        picked[name] = os.path.join(tempdir(), f"condition-{name}.h5")
        with h5py.File(source, "r") as f, h5py.File(picked[name], "w") as g:
            g["condition_latents"] = f["condition_latents"][:2]
            for key in ("condition_grid_rows", "condition_grid_cols"):
                g.attrs[key] = f.attrs[key]
    base = os.path.join(tempdir(), "kontext-sampled-base")
    make_diffusers_folder(base, CFG, seed=45)  # weights under which the condition image matters
    kontext = (f"--data.train_file={train}", f"--data.val_file={val}", "--model.condition_len=8",
               f"--checkpoint.init_from={base}")
    ok(run(2, flux_args(*kontext, f"--checkpoint.dir={ckpt}", "--flow.sample_every=4",
                        f"--flow.sample_prompts={prompts}", f"--flow.sample_condition={picked['same']}",
                        "--flow.sample_steps=2")))
    with h5py.File(os.path.join(ckpt, "samples", "step-00000004.h5"), "r") as f:
        during = f["latents"][()]
    assert during.shape == (2, 16, 16) and np.isfinite(during).all()
    outputs = {}
    for name, condition in picked.items():
        out = os.path.join(tempdir(), f"after-{name}.h5")
        ok(run(1, ["sample", "--checkpoint", ckpt, "--prompts", prompts, "--output", out, "--grid", "4x4",
                   "--steps", "2", "--guidance", "3.5", "--seed", str(SEED), "--condition", condition, "--batch", "2"]))
        with h5py.File(out, "r") as f:
            outputs[name] = f["latents"][()]
    scale = np.abs(outputs["same"]).max()
    assert np.abs(outputs["same"] - during).max() / scale < 1e-5, np.abs(outputs["same"] - during).max()
    assert np.abs(outputs["other"] - during).max() / scale > 1e-2, "other condition images, the same samples"
    # A Kontext model's samples need their images (with as many tokens as the model's); a plain
    # model takes none; an unreadable prompts file stops the run before its first step.
    sampling = ("--flow.sample_every=2", f"--flow.sample_prompts={prompts}")
    expect_usage_error(flux_args(*kontext, *sampling), "flow.sample_condition=FILE.h5")
    expect_usage_error(flux_args(*sampling, f"--flow.sample_condition={picked['same']}"), "flow.sample_condition",
                       "model.condition_len > 0")
    expect_usage_error(flux_args(*kontext, *sampling, f"--flow.sample_condition={val}"), "holds 6 condition images")
    wide = latent_file(2, 44, condition=(3, 4))
    expect_usage_error(flux_args(*kontext, *sampling, f"--flow.sample_condition={wide}"), "12 tokens",
                       "model.condition_len")
    expect_usage_error(flux_args("--flow.sample_every=2", "--flow.sample_prompts=/nonexistent/p.h5"),
                       "flow.sample_prompts: '/nonexistent/p.h5' does not exist")


def test_the_shipped_flux1_shapes_plan():
    for ini, count in (("flux1-dev.ini", "11901.4M parameters"), ("flux1-schnell.ini", "11891.2M parameters")):
        proc = ok(run(1, ["plan", "--config", os.path.join(ROOT, "inputs", ini), "--world-size", "4",
                          "--memory-limit", "24GiB"]), ini)
        assert count in proc.stdout, proc.stdout[:500]
        assert "recommended: fsdp.sharding_strategy=FULL_SHARD" in proc.stdout, proc.stdout[-1500:]


def test_bf16_trains_near_fp32_the_same_on_any_rank_count():
    fp32, _ = losses(1)
    bf16, _ = losses(1, "--fsdp.param_dtype=bf16")
    assert all(rel_diff(a, b) < 2e-2 for a, b in zip(bf16, fp32)), (bf16, fp32)
    for np_ in (2, 3):
        got, _ = losses(np_, "--fsdp.param_dtype=bf16")
        assert all(rel_diff(a, b) < 1e-5 for a, b in zip(got, bf16)), (np_, got, bf16)


def test_generate_refuses_flux():
    folder = tempdir()
    ok(run(1, flux_args(f"--checkpoint.dir={folder}", "--train.steps=1")))
    # The checkpoint records FLUX's keys (format version 6) under its metadata checksum.
    with h5py.File(os.path.join(folder, "ckpt-00000001.h5"), "r") as f:
        assert int(f.attrs["version"]) == 10 and int(f.attrs["model.n_single_layer"]) == 2
        assert f.attrs["model.rope_axes"] in (b"4,10,10", "4,10,10") and int(f.attrs["model.condition_len"]) == 0
        assert int(f.attrs["meta_checksum"]) == meta_checksum(f.attrs)
    expect_usage_error(["generate", "--checkpoint", folder, "--prompt", "a cat"], "'flux' model",
                       "has no key/value-cache decoding", np_=1)


def test_lora_dropout_keys_every_kind_of_row_the_same_on_any_rank_count():
    # adapter.dropout on FLUX: each product's rows (image, text, joint tokens, the samples of the
    # modulations) take masks keyed by the sample's sequence and their place: the same on any rank
    # count and micro-batch size (a row's key does not depend on where its sample sits in the
    # micro-batch), and under activation checkpointing, which recomputes the forward with the same masks.
    folder = os.path.join(tempdir(), "flux-diffusers")
    make_diffusers_folder(folder, CFG, seed=5)
    lora = (f"--checkpoint.init_from={folder}", "--adapter.type=lora", f"--adapter.targets={LORA_TARGETS},norm1.linear",
            "--adapter.rank=4", "--adapter.alpha=4", "--train.lr=1e-2", "--train.eval_every=0")
    base, _ = losses(1, *lora, "--adapter.dropout=0.3")
    for np_, extra in ((2, ()), (3, ()), (2, ("--fsdp.activation_checkpointing=true",)),
                       (2, ("--train.micro_batch=2",)), (3, ("--train.micro_batch=2",))):
        got, _ = losses(np_, *lora, "--adapter.dropout=0.3", *extra)
        assert all(rel_diff(a, b) < 1e-5 for a, b in zip(got, base)), (np_, extra, got, base)
    plain, _ = losses(1, *lora)
    # LoRA's B starts at zero, so the first step's loss is the base model's either way; the masks
    # change the gradients and so every later loss.
    assert plain[0] == base[0] and all(rel_diff(a, b) > 1e-6 for a, b in zip(plain[1:], base[1:])), (plain, base)
