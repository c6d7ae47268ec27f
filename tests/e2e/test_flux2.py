"""model.arch=flux2 (docs/flux.md): FLUX.2's transformer -- no biases, no pooled vector, shared
modulations, SwiGLU MLPs, fused single blocks, four rotary axes -- trained with flow matching on
latent shards, each property against an independent oracle:

- the first step's loss from a diffusers folder equals a float64 numpy forward written from
  Flux2Transformer2DModel's equations (flux_reference.flux2_forward, itself checked against
  diffusers' own model to 1.6e-15 by tests/fixtures/flux2/check_reference.py) on the folder's
  weights and the samples the sampler draws; FLUX.1's GELU MLP, an unshared text modulation and
  FLUX.1's all-zero text ids are shown to miss it;
- folder -> checkpoint -> folder is bit for bit, with diffusers' config keys;
- losses do not depend on the rank count or the sharding strategy;
- LoRA on diffusers' module names trains the adapters alone and exports diffusers' LoRA file;
- a FLUX.2 configuration that names a pooled vector is refused with one line (exit 2);
- `sample` draws the float64 Euler steps of the same forward on 1 and 2 ranks, on Flux2Pipeline's
  schedule (its empirical mu of the image tokens and the step count).
"""
import json
import os
import re

import h5py
import numpy as np

from flux_reference import flow_sample, flux2_forward, gelu_tanh, make_diffusers_folder, window
from harness import ROOT, read_metrics, rel_diff, run, tempdir
from test_adapters import safetensors_arrays
from test_bad_input import expect_usage_error
from test_flux import check_bf16_activations, check_held_equals_planned, converted_folder, euler_reference, flux_args, latent_file, ok, prompts_file
from test_flux import losses as flux_losses

FLUX2_INI = os.path.join(ROOT, "inputs", "flux2-tiny.ini")
CFG = dict(arch="flux2", n_layer=2, n_single_layer=2, n_head=2, head_dim=24, mlp_width=96, norm_eps=1e-6,
           guidance_embeds=True, rope_axes=(6, 6, 6, 6), rope_theta=2000.0, in_channels=16, context_dim=32,
           context_len=8, rows=4, cols=4)
SEED, GLOBAL_BATCH, RECORDS = 1337, 12, 24
FILES = {}


def no_pooled(data, attrs):
    del data["pooled_projections"]


def data_files():
    if not FILES:
        FILES["train"] = latent_file(RECORDS, 11, edit=no_pooled)
        FILES["val"] = latent_file(6, 12, edit=no_pooled)
    return FILES["train"], FILES["val"]


def flux2_args(*overrides, metrics=None):
    return flux_args(*overrides, metrics=metrics, config=FLUX2_INI, files=data_files())


def losses(np_, *overrides):
    """The step losses, then the validation losses."""
    steps, val = flux_losses(np_, *overrides, config=FLUX2_INI, files=data_files())
    return steps + val


def reference_loss(params, step, path=None, condition_t=10, condition_step=10, **variant):
    """The summed squared error / elements of 0-based `step` in float64 from the equations, with
    FLUX.2's ids: image (0, row, col, 0), text (0, 0, 0, l), reference image k's (condition_t +
    condition_step k, row, col, 0) after the target's, each on its own grid (the file's
    condition_grid_rows and condition_grid_cols: scalars, or one per image); text_ids_zero=True is
    FLUX.1's zeros."""
    text_ids_zero = variant.pop("text_ids_zero", False)
    with h5py.File(path or FILES["train"], "r") as f:
        x0, text = f["latents"][()], f["encoder_hidden_states"][()]
        cond = f["condition_latents"][()] if "condition_latents" in f else None
        grids = list(zip(np.atleast_1d(f.attrs["condition_grid_rows"]), np.atleast_1d(f.attrs["condition_grid_cols"]))
                     ) if cond is not None else []
    N, L = CFG["rows"] * CFG["cols"], CFG["context_len"]
    ids = [[0, i // CFG["cols"], i % CFG["cols"], 0] for i in range(N)]
    for k, (rows, cols) in enumerate(grids):
        ids += [[condition_t + condition_step * k, i // cols, i % cols, 0] for i in range(rows * cols)]
    img_ids = np.array(ids, np.float32)
    txt_ids = np.array([[0, 0, 0, 0 if text_ids_zero else l] for l in range(L)], np.float32)
    total = 0.0
    for j in range(GLOBAL_BATCH):
        r = window(SEED, RECORDS, GLOBAL_BATCH, step, j)
        sigma, noisy, target = flow_sample(SEED, step * GLOBAL_BATCH + j, x0[r], sampling="logit_normal")
        hidden = noisy if cond is None else np.concatenate([noisy, cond[r]], 0)
        out = flux2_forward(params, CFG, hidden[None].astype(np.float64), text[r][None].astype(np.float64), [sigma],
                            [1.0], img_ids, txt_ids, **variant)
        total += float(((out[0, :N] - target.astype(np.float64)) ** 2).sum())
    return total / (GLOBAL_BATCH * N * CFG["in_channels"])


def test_a_flux2_folder_trains_from_its_weights_and_converts_both_ways_bit_for_bit():
    folder = os.path.join(tempdir(), "flux2-diffusers")
    params = make_diffusers_folder(folder, CFG, seed=3)
    metrics = os.path.join(tempdir(), "metrics.jsonl")
    ok(run(2, flux2_args(f"--checkpoint.init_from={folder}", "--train.steps=1", metrics=metrics)))
    logged = read_metrics(metrics)[0]["loss"]
    expected = reference_loss(params, 0)
    assert rel_diff(logged, expected) < 1e-6, (logged, expected)
    # The negative controls: FLUX.1's MLP activation (GELU of the gate half), the text stream
    # modulated by the image stream's parameters, FLUX.1's text ids.
    gelu_half = lambda x: gelu_tanh(x[..., :x.shape[-1] // 2])  # noqa: E731
    for variant in (dict(activation=gelu_half), dict(shared_mod=False), dict(text_ids_zero=True)):
        wrong = reference_loss(params, 0, **variant)
        assert rel_diff(logged, wrong) > 1e-4, (variant, logged, wrong)
    # convert: folder -> checkpoint (2 ranks) -> folder (3 ranks), the same tensors bit for bit,
    # and diffusers' config keys.
    h5 = os.path.join(tempdir(), "flux2.h5")
    ok(run(2, ["convert", "--input", folder, "--output", h5]), "folder -> checkpoint")
    back = os.path.join(tempdir(), "back")
    ok(run(3, ["convert", "--input", h5, "--output", back]), "checkpoint -> folder")
    original = safetensors_arrays(os.path.join(folder, "diffusion_pytorch_model.safetensors"))[0]
    again = safetensors_arrays(os.path.join(back, "diffusion_pytorch_model.safetensors"))[0]
    assert sorted(original) == sorted(again) and not any(n.endswith(".bias") for n in again)
    for name in original:
        assert np.array_equal(original[name].view(np.uint32), again[name].view(np.uint32)), name
    with open(os.path.join(folder, "config.json")) as f, open(os.path.join(back, "config.json")) as g:
        written, read = json.load(g), json.load(f)
    for key, value in read.items():
        assert written[key] == value, (key, written.get(key), value)


def test_memory_held_matches_the_plan():
    check_held_equals_planned(flux2_args, [("--fsdp.activation_checkpointing=true",),
                                           ("--fsdp.activation_dtype=bf16", "--fsdp.activation_checkpointing=true")])


def test_the_plan_recomputes_the_fewest_blocks_that_fit_and_the_run_keeps_the_bits():
    """Under a memory limit between recomputing no block and every block, `shardtrain plan`
    recommends the fewest first blocks that fit (fsdp.checkpoint_blocks). A run with them holds
    what the plan says, under the limit, and gives the losses of keeping every activation bit for
    bit; one block fewer is refused by the trainer's own check (exit 2), and so are a count
    without checkpointing and one past the model's blocks."""
    shape = ("--model.n_single_layer=4", "--train.steps=2", "--train.eval_every=0")  # 2 double + 4 single

    def plan(*options):
        proc = ok(run(1, ["plan", "--world-size=2", "--format=lines", *flux2_args(*shape, *options)[1:]]), "plan")
        rows = re.findall(r"^PLAN strategy=FULL_SHARD reduce=micro checkpointing=(\S+) offload=no peak_bytes=(\d+) "
                          r"\S+ fits=(\d)", proc.stdout, re.M)
        return proc.stdout, {ckpt: (int(peak), fits == "1") for ckpt, peak, fits in rows}

    _, rows = plan()
    none, every = rows["no"][0], rows["yes"][0]
    assert every < none, rows
    limit = every + (none - every) // 2
    out, rows = plan(f"--fsdp.memory_limit={limit}B")
    recommended = re.search(r"^recommended: fsdp.sharding_strategy=FULL_SHARD fsdp.reduce_every_microbatch=true "
                            r"fsdp.activation_checkpointing=true fsdp.checkpoint_blocks=(\d+) ", out, re.M)
    assert recommended, out
    k = int(recommended.group(1))
    assert 2 <= k < 6 and rows[f"{k}/6"][1] and rows[f"{k}/6"][0] <= limit, (k, rows)
    print(f"      limit {limit} B: the first {k} of 6 blocks recompute ({rows})")
    assert not rows["no"][1] and rows["yes"][1], rows
    chosen = ("--fsdp.activation_checkpointing=true", f"--fsdp.checkpoint_blocks={k}", f"--fsdp.memory_limit={limit}B")
    metrics = os.path.join(tempdir(), "m.jsonl")
    ok(run(2, flux2_args(*shape, *chosen, metrics=metrics)), chosen)
    records = read_metrics(metrics)
    assert records[-1]["held_mem_bytes"] == records[-1]["peak_mem_bytes"] == rows[f"{k}/6"][0], (records[-1], rows)
    kept = os.path.join(tempdir(), "kept.jsonl")
    ok(run(2, flux2_args(*shape, metrics=kept)), "no checkpointing")
    assert [r["loss"] for r in records] == [r["loss"] for r in read_metrics(kept)]
    # With bf16 parameters and activations too (the blocks' 16-bit copies, and a recomputing block's
    # rounding in place): the losses of keeping everything, bit for bit.
    half = ("--fsdp.param_dtype=bf16",)
    assert (flux_losses(2, *shape, *half, *chosen[:2], config=FLUX2_INI, files=data_files())
            == flux_losses(2, *shape, *half, config=FLUX2_INI, files=data_files()))
    if k > 2:
        expect_usage_error(flux2_args(*shape, *chosen[:1], f"--fsdp.checkpoint_blocks={k - 1}", chosen[2]),
                           "out of memory", f"fsdp.memory_limit={limit}B", np_=2)
    expect_usage_error(flux2_args(*shape, "--fsdp.checkpoint_blocks=2"), "fsdp.checkpoint_blocks=2",
                       "fsdp.activation_checkpointing=false", np_=2)
    expect_usage_error(flux2_args(*shape, "--fsdp.activation_checkpointing=true", "--fsdp.checkpoint_blocks=7"),
                       "fsdp.checkpoint_blocks=7", "the model's 6 blocks", np_=2)


def test_bf16_activations_follow_the_reference_rounding_each_where_it_is_made():
    folder = os.path.join(tempdir(), "flux2-diffusers")
    params = make_diffusers_folder(folder, CFG, seed=3)
    check_bf16_activations(flux2_args, folder, lambda step, keep: reference_loss(params, step, keep=keep))


def test_a_condition_image_enters_flux2_as_its_first_reference_image():
    """model.condition_len: the condition latents after the target's with ids (10, row, col, 0), as
    diffusers' Flux2 pipeline places its first reference image; the loss on the target tokens."""
    folder = os.path.join(tempdir(), "flux2-diffusers")
    params = make_diffusers_folder(folder, CFG, seed=4)
    train = latent_file(RECORDS, 13, edit=no_pooled, condition=(2, 4))
    val = latent_file(6, 14, edit=no_pooled, condition=(2, 4))
    metrics = os.path.join(tempdir(), "metrics.jsonl")
    ok(run(2, flux2_args(f"--checkpoint.init_from={folder}", "--train.steps=1", "--model.condition_len=8",
                         f"--data.train_file={train}", f"--data.val_file={val}", metrics=metrics)))
    logged = read_metrics(metrics)[0]["loss"]
    assert rel_diff(logged, reference_loss(params, 0, path=train)) < 1e-6
    assert rel_diff(logged, reference_loss(params, 0, path=train, condition_t=1)) > 1e-6  # FLUX.1 Kontext's t


def two_grids(data, attrs):
    """A 2 x 4 and a 3 x 2 reference image per record (14 condition tokens)."""
    attrs["condition_grid_rows"], attrs["condition_grid_cols"] = np.array([2, 3]), np.array([4, 2])


def two_references(data, attrs):
    no_pooled(data, attrs)
    two_grids(data, attrs)


def test_several_reference_images_enter_flux2_each_on_its_own_grid_and_time():
    """Several reference images (multi-reference editing): each one's tokens on its own grid with
    t = 10, 20, ..., as Flux2Pipeline's _prepare_image_ids numbers them; FLUX.1 Kontext refuses them."""
    folder = os.path.join(tempdir(), "flux2-references")
    params = make_diffusers_folder(folder, CFG, seed=6)
    train = latent_file(RECORDS, 15, condition=(2, 7), edit=two_references)
    val = latent_file(6, 16, condition=(2, 7), edit=two_references)
    metrics, ckpt = os.path.join(tempdir(), "metrics.jsonl"), tempdir()
    ok(run(2, flux2_args(f"--checkpoint.init_from={folder}", "--train.steps=1", "--model.condition_len=14",
                         f"--data.train_file={train}", f"--data.val_file={val}", f"--checkpoint.dir={ckpt}",
                         "--checkpoint.format=gathered", metrics=metrics)))
    logged = read_metrics(metrics)[0]["loss"]
    assert rel_diff(logged, reference_loss(params, 0, path=train)) < 1e-6
    assert rel_diff(logged, reference_loss(params, 0, path=train, condition_step=0)) > 1e-6  # all at t = 10
    # FLUX.1 Kontext takes one image; the grid attributes must pair up and add up.
    flux1 = latent_file(RECORDS, 17, condition=(2, 7), edit=two_grids)
    expect_usage_error(flux_args(f"--data.train_file={flux1}", f"--data.val_file={flux1}", "--model.condition_len=14"),
                       "2 condition images per sample", "FLUX.1 Kontext edits one")

    def unpaired(data, attrs):
        two_references(data, attrs)
        attrs["condition_grid_cols"] = np.array([7])

    def short(data, attrs):
        two_references(data, attrs)
        attrs["condition_grid_cols"] = np.array([4, 1])

    # `sample` edits with both references: the float64 Euler steps with the same ids.
    with h5py.File(os.path.join(ckpt, "ckpt-00000001.h5"), "r") as f:
        trained = {name: f["model"][name][()].astype(np.float64) for name in f["model"]}
    prompts = prompts_file(2, 33, tokens=6)
    references = os.path.join(tempdir(), "references.h5")
    with h5py.File(val, "r") as f, h5py.File(references, "w") as g:
        g["condition_latents"] = f["condition_latents"][:2]
        for key in ("condition_grid_rows", "condition_grid_cols"):
            g.attrs[key] = f.attrs[key]
        condition = f["condition_latents"][:2].astype(np.float64)
    out = os.path.join(tempdir(), "edits.h5")
    ok(run(2, ["sample", "--checkpoint", ckpt, "--prompts", prompts, "--output", out, "--grid", "2x3", "--steps", "2",
               "--guidance", "2.5", "--seed", "4", "--shift", "1.5", "--condition", references]))
    with h5py.File(out, "r") as f:
        got = f["latents"][()]
    expected = euler_reference(trained, CFG, prompt_text(prompts), None, 2, 3, 2, 1.5, 2.5, 4, condition=condition,
                               condition_cols=[(2, 4), (3, 2)])
    assert np.abs(got - expected).max() / np.abs(expected).max() < 1e-5
    for edit, needle in ((unpaired, "condition_grid_rows holds 2 values, condition_grid_cols 1"),
                         (short, "2 x 4 + 3 x 1 is not the 14 tokens")):
        bad = latent_file(RECORDS, 18, condition=(2, 7), edit=edit)
        expect_usage_error(flux2_args("--model.condition_len=14", f"--data.train_file={bad}",
                                      f"--data.val_file={val}"), needle)


def test_flux2_losses_do_not_depend_on_the_rank_count_or_strategy():
    base = losses(1)
    assert len(base) == 6 and all(np.isfinite(base)) and base[3] != base[0]
    for np_, overrides in [(2, ()), (3, ("--fsdp.sharding_strategy=SHARD_GRAD_OP",
                                         "--fsdp.activation_checkpointing=true")),
                           (4, ("--fsdp.sharding_strategy=HYBRID_SHARD", "--fsdp.shard_group_size=2"))]:
        got = losses(np_, *overrides)
        for a, b in zip(got, base):
            assert rel_diff(a, b) < 1e-5, (np_, overrides, got, base)


LORA_TARGETS = ("attn.to_q,attn.to_k,attn.to_v,attn.to_out.0,attn.add_q_proj,attn.add_k_proj,attn.add_v_proj,"
                "attn.to_add_out,ff.linear_in,ff.linear_out,ff_context.linear_in,ff_context.linear_out,"
                "attn.to_qkv_mlp_proj,attn.to_out")


def test_lora_on_flux2_trains_the_adapters_alone_and_exports_diffusers_keys():
    folder = os.path.join(tempdir(), "flux2-diffusers")
    params = make_diffusers_folder(folder, CFG, seed=5)
    lora = (f"--checkpoint.init_from={folder}", "--adapter.type=lora", f"--adapter.targets={LORA_TARGETS}",
            "--adapter.rank=4", "--adapter.alpha=4", "--train.lr=1e-2", "--checkpoint.format=gathered")
    base = losses(1, *lora)
    assert base[3] != base[0]
    got = losses(2, *lora)
    for a, b in zip(got, base):
        assert rel_diff(a, b) < 1e-5, (got, base)
    ckpt = tempdir()
    ok(run(2, flux2_args(*lora, f"--checkpoint.dir={ckpt}")))
    with h5py.File(os.path.join(ckpt, "ckpt-00000004.h5"), "r") as f:
        model = f["model"]
        for name, value in params.items():  # the base frozen, bit for bit
            assert np.array_equal(model[name][()], value.astype(np.float32)), name
        adapted = [n for n in model if n.endswith(".lora_B.weight")]
        assert len(adapted) == 2 * 12 + 2 * 2, sorted(adapted)  # 12 layers per double block, 2 per single
        assert "single_transformer_blocks.1.attn.to_qkv_mlp_proj.lora_B.weight" in adapted
        assert all(np.abs(model[n][()]).max() > 0 for n in adapted)
        trained = {n: model[n][()] for n in model if ".lora_" in n}
    out = os.path.join(tempdir(), "lora")
    ok(run(2, ["export", "--checkpoint", os.path.join(ckpt, "ckpt-00000004.h5"), "--adapter", "--output", out]))
    lora_file, meta = safetensors_arrays(os.path.join(out, "pytorch_lora_weights.safetensors"))
    assert sorted(lora_file) == sorted("transformer." + n for n in trained)
    for name, value in lora_file.items():
        assert np.array_equal(value, trained[name[len("transformer."):]]), name
    assert json.loads(meta["lora_adapter_metadata"])["transformer.r"] == 4


def test_a_pooled_vector_is_refused_for_flux2():
    expect_usage_error(flux2_args("--model.pooled_dim=768"), "model.pooled_dim=768", "set model.pooled_dim=0")


def test_the_text_encoder_in_the_job_gives_flux2_its_cached_context():
    """FLUX.2 with a frozen text encoder in the job (no pooled vector to make): the same losses as
    training on what encode-text caches of the same captions (one caption per forward in both, so
    that the encoder's products see the same rows and give the same bits)."""
    from test_text_encoder import EC, TOKENS, encoder

    def captions(data, attrs):
        del data["pooled_projections"], data["encoder_hidden_states"]
        words = ["red square", "blue triangle at the top", "small green circle", "large cyan square at the left"]
        data["captions"] = np.array([words[i % 4].encode() for i in range(data["latents"].shape[0])], dtype=object)

    files = {k: latent_file(n, 20 + n, edit=captions) for k, n in (("train", RECORDS), ("val", 6))}
    cached = {}
    for k, path in files.items():
        cached[k] = os.path.join(tempdir(), f"cached-{k}.h5")
        ok(run(2, ["encode-text", "--text-encoder", encoder(), "--layers", "0,-1", "--tokens", str(TOKENS),
                   "--input", path, "--output", cached[k], "--batch", "1", "--threads", "1"]))
    shape = (f"--model.context_len={TOKENS}", f"--model.context_dim={2 * EC}")
    on_cache = losses(2, f"--data.train_file={cached['train']}", f"--data.val_file={cached['val']}", *shape)
    in_job = losses(2, f"--data.train_file={files['train']}", f"--data.val_file={files['val']}", *shape,
                    f"--text_encoder.source={encoder()}", "--text_encoder.layers=0,-1")
    assert max(rel_diff(a, b) for a, b in zip(in_job, on_cache)) < 1e-9, (in_job, on_cache)


def empirical_mu(image_tokens, steps):
    """Flux2Pipeline's compute_empirical_mu (diffusers 0.42.1)."""
    a1, b1, a2, b2 = 8.73809524e-05, 1.89833333, 0.00016927, 0.45666666
    m_200 = a2 * image_tokens + b2
    if image_tokens > 4300:
        return m_200
    a = (m_200 - (a1 * image_tokens + b1)) / 190.0
    return a * steps + m_200 - 200.0 * a


def prompt_text(path):
    with h5py.File(path, "r") as f:
        return f["encoder_hidden_states"][()].astype(np.float64)


def test_sample_draws_flux2_on_its_pipelines_schedule_on_any_rank_count():
    params, ckpt = converted_folder(CFG, 21, "flux2-sample")
    prompts, negative = prompts_file(2, 31, tokens=6), prompts_file(1, 32, tokens=6)
    shift = float(np.exp(empirical_mu(6, 3)))
    outputs = []
    for np_ in (1, 2):
        out = os.path.join(tempdir(), "samples.h5")
        ok(run(np_, ["sample", "--checkpoint", ckpt, "--prompts", prompts, "--output", out, "--grid", "2x3",
                     "--steps", "3", "--guidance", "2.5", "--seed", "3", "--cfg", "1.5", "--negative", negative]))
        with h5py.File(out, "r") as f:
            outputs.append(f["latents"][()])
            assert abs(float(f.attrs["shift"]) - shift) < 1e-12 * shift, (float(f.attrs["shift"]), shift)
    text, neg_text = prompt_text(prompts), prompt_text(negative)
    expected = euler_reference(params, CFG, text, None, 2, 3, 3, shift, 2.5, 3, 1.5, neg_text)
    for got in outputs:
        error = np.abs(got - expected).max() / np.abs(expected).max()
        assert error < 1e-5, error
    # FLUX.1's image-size shift would have drawn other images.
    flux1 = euler_reference(params, CFG, text, None, 2, 3, 3, float(np.exp(0.5 + 0.65 / 3840 * (6 - 256))), 2.5, 3,
                            1.5, neg_text)
    assert np.abs(flux1 - expected).max() / np.abs(expected).max() > 1e-3
