"""Adapters end to end: LoRA and DoRA, LoHa, LoKr and OFT. The oracles are independent of our code:

- PEFT itself (peft 0.21.2, tests/fixtures/peft, made once with torch and committed): a Hugging
  Face base folder plus a PEFT adapter folder, imported, give the loss of PEFT's logits on the same
  tokens, for GPT-2 (Conv1D, fan_in_fan_out; LoRA and DoRA alone, as PEFT applies nothing else
  there) and Llama (q/v/down_proj of fused products; every method, LoKr also with both factors
  low-rank, OFT also with the exact Cayley transform); exported again, the adapter folder holds
  PEFT's names, shapes, values and config keys; --merge gives PEFT's merged weights
  (merge_and_unload);
- numpy, from the spec's formulas (tests/fixtures/peft/README.md): --merge of LoHa, LoKr and OFT on
  GPT-2, where PEFT has no fixture;
- the base model's bits: after training only adapter tensors moved;
- the rank count and strategy: losses equal the 1-rank run's (1e-5), bf16 within 1%; for LoHa, LoKr
  and OFT on Llama too;
- the uninterrupted run: a resume is exact (LoHa, LoKr and OFT: to 1e-5 on another rank count);
- one error line and exit 2 for each conflicting or bad setting."""
import functools
import json
import os
import shutil

import numpy as np

from harness import ROOT, read_metrics, rel_diff, run, run_single, tempdir, tiny_args
from safetensors_io import read_safetensors
from test_bad_input import expect_usage_error, write_tokens
from test_checkpoint import ckpt_name
from test_freeze import latest, params_of
from test_llama import llama_args, ok

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "peft")
TOKENS = json.load(open(os.path.join(FIXTURES, "tokens.json")))["tokens"]
# The fixtures' adapters: rank 4, alpha 8, on these layers.
FIXTURE_TARGETS = {"gpt2": "attn.c_attn,mlp.c_fc,mlp.c_proj",
                   "llama": "self_attn.q_proj,self_attn.v_proj,mlp.down_proj"}
LORA = ["--adapter.type=lora", "--adapter.targets=attn.c_attn,mlp.c_proj", "--adapter.rank=4", "--adapter.alpha=8"]
STEPS = 6


def safetensors_arrays(path):
    """name -> float32 array of a safetensors file of F32 tensors, and its metadata."""
    tensors, metadata = read_safetensors(path)
    for name, value in tensors.items():
        assert value.dtype == np.float32, (name, value.dtype)
    return tensors, metadata


def fixture_args(arch, sequence):
    """One step from the fixture's base folder (its config.json gives the model) on a token file
    that repeats `sequence` (16 tokens, seq_len 16): every window is that sequence, its last target
    the sequence's first token."""
    data = write_tokens(os.path.join(tempdir(), "seq.bin"), list(sequence) * 40 + [sequence[0]])
    ini = os.path.join(tempdir(), "fixture.ini")
    with open(ini, "w") as f:
        f.write("[train]\nthreads = 1\n")
    return ["train", "--config", ini, f"--checkpoint.init_from={os.path.join(FIXTURES, arch, 'base')}",
            f"--data.train_file={data}", "--data.val_file=", "--train.seq_len=16", "--train.micro_batch=1",
            "--train.global_batch=6", "--train.steps=1", "--train.lr=1e-30", "--train.weight_decay=0",
            "--train.peak_gflops=100", f"--checkpoint.dir={tempdir()}"]


def reference_loss(logits, sequence):
    """Mean cross-entropy of logits (16, V) against the next token, wrapping to the first."""
    targets = list(sequence[1:]) + [sequence[0]]
    x = logits.astype(np.float64)
    lse = np.log(np.exp(x - x.max(1, keepdims=True)).sum(1)) + x.max(1)
    return float(np.mean(lse - x[np.arange(16), targets]))


def first_loss(np_, args):
    metrics = os.path.join(tempdir(), "m.jsonl")
    proc = ok(run(np_, args + [f"--train.metrics_file={metrics}"]), " ".join(args[-6:]))
    return read_metrics(metrics)[0]["loss"], proc


METHODS = ("lora", "dora")
# The fixtures of LoHa, LoKr and OFT (llama alone: PEFT 0.21.2 refuses them on GPT-2's Conv1D layers)
# and the options of each one's settings (adapter_config.json).
DELTA_FIXTURES = {
    "loha": ("--adapter.type=loha", "--adapter.rank=4", "--adapter.alpha=8"),
    "lokr": ("--adapter.type=lokr", "--adapter.rank=4", "--adapter.alpha=8"),
    "lokr_r1_both": ("--adapter.type=lokr", "--adapter.rank=1", "--adapter.alpha=2", "--adapter.decompose_both=true"),
    "oft": ("--adapter.type=oft", "--adapter.block_size=8"),
    "oft_cayley": ("--adapter.type=oft", "--adapter.block_size=8", "--adapter.cayley_neumann=false"),
}


def fixture_adapter(arch, fixture, init=True):
    """The options of a fixture's adapter (LoRA and DoRA: rank 4, alpha 8), started from its PEFT
    folder. The first option is adapter.type."""
    options = list(DELTA_FIXTURES.get(fixture, (f"--adapter.type={fixture}", "--adapter.rank=4", "--adapter.alpha=8")))
    options.insert(1, f"--adapter.targets={FIXTURE_TARGETS[arch]}")
    return options + ([f"--adapter.init_from={os.path.join(FIXTURES, arch, fixture)}"] if init else [])


def test_peft_adapters_import_with_pefts_loss():
    for arch in ("gpt2", "llama"):
        base = np.load(os.path.join(FIXTURES, arch, "base_logits.npy"))
        for b, sequence in enumerate(TOKENS):
            without = reference_loss(base[b], sequence)
            for method in METHODS:
                expected = reference_loss(np.load(os.path.join(FIXTURES, arch, method, "logits.npy"))[b], sequence)
                assert abs(expected - without) > 5e-4  # the adapter matters at this tolerance
                for np_ in (1, 3):
                    loss, proc = first_loss(np_, fixture_args(arch, sequence) + fixture_adapter(arch, method))
                    assert "initialised the adapters from PEFT folder" in proc.stdout
                    assert rel_diff(loss, expected) < 1e-6, (arch, method, b, np_, loss, expected, without)
                # Freshly initialised, an adapter changes nothing: B = 0 (and DoRA's m = ||W||).
                loss, _ = first_loss(2, fixture_args(arch, sequence) + fixture_adapter(arch, method, init=False))
                assert rel_diff(loss, without) < 1e-6, (arch, method, b, loss, without)
            loss, _ = first_loss(2, fixture_args(arch, sequence))
            assert rel_diff(loss, without) < 1e-6, (arch, b, loss, without)


def test_loha_lokr_and_oft_peft_adapters_import_with_pefts_loss():
    base = np.load(os.path.join(FIXTURES, "llama", "base_logits.npy"))
    for i, fixture in enumerate(DELTA_FIXTURES):
        for b, sequence in enumerate(TOKENS):
            without = reference_loss(base[b], sequence)
            expected = reference_loss(np.load(os.path.join(FIXTURES, "llama", fixture, "logits.npy"))[b], sequence)
            assert abs(expected - without) > 5e-4  # the adapter matters at this tolerance
            np_ = (1, 3)[(i + b) % 2]
            loss, proc = first_loss(np_, fixture_args("llama", sequence) + fixture_adapter("llama", fixture))
            assert "initialised the adapters from PEFT folder" in proc.stdout
            assert rel_diff(loss, expected) < 1e-6, (fixture, b, np_, loss, expected, without)
        # Freshly initialised, the adapter changes nothing: LoHa's w2_b and LoKr's w1 (or w1_a) are
        # zero, OFT's rotations the identity.
        b = i % 2
        loss, _ = first_loss(2, fixture_args("llama", TOKENS[b]) + fixture_adapter("llama", fixture, init=False))
        assert rel_diff(loss, reference_loss(base[b], TOKENS[b])) < 1e-6, (fixture, loss)


@functools.lru_cache(maxsize=None)
def peft_round_trip(arch, method):
    """(checkpoint, exported adapter folder, merged folder) of one lr-1e-30 step from the fixture."""
    d = tempdir()
    ok(run(2, fixture_args(arch, TOKENS[0]) + fixture_adapter(arch, method) + [f"--checkpoint.dir={d}"]), "train")
    ckpt = latest(d)
    out, merged = os.path.join(tempdir(), "adapter"), os.path.join(tempdir(), "merged")
    ok(run(2, ["export", "--adapter", "--checkpoint", ckpt, "--output", out]), "export --adapter")
    ok(run(3, ["export", "--format", "hf", "--merge", "--checkpoint", ckpt, "--output", merged]), "export --merge")
    return ckpt, out, merged


def check_round_trip(arch, fixture):
    """export --adapter of the imported fixture is PEFT's folder again; --merge is PEFT's merge."""
    ckpt, out, merged = peft_round_trip(arch, fixture)
    folder = os.path.join(FIXTURES, arch, fixture)
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
    ours, meta = safetensors_arrays(os.path.join(out, "adapter_model.safetensors"))
    theirs, _ = safetensors_arrays(os.path.join(folder, "adapter_model.safetensors"))
    assert meta == {"format": "pt"}
    assert sorted(ours) == sorted(theirs), sorted(set(ours) ^ set(theirs))
    for name in theirs:
        assert ours[name].shape == theirs[name].shape and np.array_equal(ours[name], theirs[name]), (fixture, name)
    config, reference = (json.load(open(os.path.join(p, "adapter_config.json"))) for p in (out, folder))
    if fixture in METHODS:
        keys = ("peft_type", "r", "lora_alpha", "fan_in_fan_out", "use_dora", "use_rslora", "lora_bias", "bias")
    else:  # every key PEFT saved, with its value (task_type and auto_mapping are the model class's business)
        assert set(reference) <= set(config), set(reference) - set(config)
        keys = sorted(set(reference) - {"task_type", "auto_mapping", "target_modules", "base_model_name_or_path"})
    # The base the run started from (PEFT wrote None: its base was made in memory), for AutoPeftModel.
    assert config["base_model_name_or_path"] == os.path.join(FIXTURES, arch, "base"), config
    for key in keys:
        assert config[key] == reference[key], (arch, fixture, key, config[key], reference[key])
    assert sorted(config["target_modules"]) == sorted(reference["target_modules"])
    # --merge: PEFT's merge_and_unload, to float32 rounding.
    got, _ = safetensors_arrays(os.path.join(merged, "model.safetensors"))
    want, _ = safetensors_arrays(os.path.join(folder, "merged.safetensors"))
    base, _ = safetensors_arrays(os.path.join(FIXTURES, arch, "base", "model.safetensors"))
    assert sorted(got) == sorted(want)
    changed = 0
    for name in want:
        assert np.allclose(got[name], want[name], rtol=1e-5, atol=1e-6), (arch, fixture, name,
                                                                          np.abs(got[name] - want[name]).max())
        changed += not np.array_equal(want[name], base[name])
    assert changed == 2 * len(FIXTURE_TARGETS[arch].split(",")), changed  # the adapted weights of 2 layers


def test_export_writes_pefts_folder_and_merge_pefts_weights():
    for arch, method in ((arch, method) for arch in ("gpt2", "llama") for method in METHODS):
        check_round_trip(arch, method)


def test_loha_lokr_and_oft_export_pefts_folder_and_merge_pefts_weights():
    for fixture in DELTA_FIXTURES:
        check_round_trip("llama", fixture)


@functools.lru_cache(maxsize=None)
def lora_run(np_, *options):
    d = tempdir()
    metrics = os.path.join(d, "m.jsonl")
    ok(run(np_, tiny_args(*LORA, f"--train.steps={STEPS}", f"--checkpoint.dir={d}", f"--train.metrics_file={metrics}",
                          *options)), f"lora np={np_} {options}")
    return [r["loss"] for r in read_metrics(metrics)], latest(d)


def test_only_the_adapters_train_and_losses_do_not_depend_on_ranks_or_strategy():
    reference, path = lora_run(1)
    assert reference[-1] < reference[0] - 1e-3
    cases = [(2, ()), (3, ()), (4, ("--fsdp.sharding_strategy=SHARD_GRAD_OP",)),
             (4, ("--fsdp.sharding_strategy=HYBRID_SHARD", "--fsdp.shard_group_size=2")),
             (2, ("--fsdp.sharding_strategy=NO_SHARD", "--fsdp.activation_checkpointing=true")),
             (2, ("--fsdp.cpu_offload=true", "--fsdp.reduce_every_microbatch=false"))]
    for np_, options in cases:
        losses, _ = lora_run(np_, *options)
        assert max(rel_diff(a, b) for a, b in zip(losses, reference)) < 1e-5, (np_, options, losses, reference)
    bf16, _ = lora_run(2, "--fsdp.param_dtype=bf16")
    assert max(rel_diff(a, b) for a, b in zip(bf16, reference)) < 1e-2
    # The base is the initial model, bit for bit; every adapter tensor moved (B from zero).
    init = params_of(lora_run(2, "--train.steps=1", "--train.lr=1e-30")[1])
    final = params_of(path)
    for key, value in final.items():
        if not key.startswith("model/"):
            continue
        if ".lora_" in key:
            assert not np.array_equal(value, init[key]), key
        else:
            assert np.array_equal(value, init[key]), key
            assert not final[key.replace("model/", "optim/exp_avg_sq/")].any(), key


def test_resume_is_exact():
    d = tempdir()
    ok(run(2, tiny_args(*LORA, f"--train.steps={STEPS}", f"--checkpoint.dir={d}", "--checkpoint.every=3",
                        "--checkpoint.keep=100")), "saving run")
    straight, _ = lora_run(2)
    metrics = os.path.join(tempdir(), "m.jsonl")
    ok(run(3, tiny_args(*LORA, f"--train.steps={STEPS}", f"--checkpoint.dir={tempdir()}",
                        f"--checkpoint.resume={os.path.join(d, ckpt_name(3))}", f"--train.metrics_file={metrics}")),
       "resume")
    resumed = [r["loss"] for r in read_metrics(metrics)]
    assert max(rel_diff(a, b) for a, b in zip(resumed, straight[3:])) < 1e-5, (resumed, straight)


def test_a_base_checkpoint_starts_adapters_and_llama_trains_them():
    d = tempdir()
    ok(run(2, tiny_args("--train.steps=2", f"--checkpoint.dir={d}")), "base")
    losses, path = lora_run(2, f"--checkpoint.init_from={latest(d)}")
    base, adapted = params_of(latest(d)), params_of(path)
    for key, value in base.items():
        if key.startswith("model/"):
            assert np.array_equal(adapted[key], value), key
    metrics = os.path.join(tempdir(), "m.jsonl")
    ok(run(3, llama_args("--adapter.type=lora", "--adapter.targets=q_proj,v_proj,mlp.down_proj,gate_proj,up_proj",
                         "--train.steps=4", "--checkpoint.save=false", f"--train.metrics_file={metrics}")), "llama")
    assert len(read_metrics(metrics)) == 4


def test_an_absurd_alpha_is_refused_and_a_divergence_with_a_large_one_names_it():
    expect_usage_error(tiny_args(*LORA, "--adapter.alpha=1e30"), "adapter.alpha=1e+30",
                       "alpha / rank = 2.5e+29: at most 1e4")
    # A large but allowed scaling (64 / 4 = 16): when the run diverges, the advice names adapter.alpha.
    proc = run(2, tiny_args(*LORA, "--adapter.alpha=64", "--debug.inject_inf_step=1", "--train.steps=2"))
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "lower adapter.alpha: it scales the adapters' output by alpha / rank = 16" in proc.stdout + proc.stderr, \
        (proc.stdout + proc.stderr)[-2000:]


def test_conflicting_and_bad_settings_exit_2():
    expect_usage_error(tiny_args("--adapter.type=lora"), "adapts nothing")
    expect_usage_error(tiny_args("--adapter.type=lora", "--adapter.targets=attn.c_attn,q_proj"),
                       "'q_proj' matches no linear layer")
    expect_usage_error(tiny_args("--adapter.type=lora", "--adapter.targets=c_attn", "--adapter.rank=41"),
                       "adapter.rank=41 is larger than")
    expect_usage_error(tiny_args("--adapter.targets=c_attn"), "adapter.type=none")
    expect_usage_error(tiny_args(*LORA, "--adapter.dropout=1"), "adapter.dropout")
    # A checkpoint with adapters given to a run without them, and the other way round.
    _, path = lora_run(2)
    expect_usage_error(tiny_args(f"--checkpoint.resume={path}", f"--train.steps={STEPS + 2}"),
                       "holds other adapters", "--merge")
    expect_usage_error(["export", "--format", "hf", "--checkpoint", path, "--output", tempdir()], "--adapter", "--merge")
    expect_usage_error(["export", path, "--output", os.path.join(tempdir(), "m.bin")], "llm.c's format cannot")
    # A PEFT adapter of another rank.
    bad = fixture_args("gpt2", TOKENS[0]) + ["--adapter.type=lora", f"--adapter.targets={FIXTURE_TARGETS['gpt2']}",
                                             "--adapter.rank=2", "--adapter.alpha=8",
                                             f"--adapter.init_from={os.path.join(FIXTURES, 'gpt2', 'lora')}"]
    expect_usage_error(bad, "r=4 but adapter.rank=2")
    # A LoRA folder into a DoRA run.
    expect_usage_error(fixture_args("gpt2", TOKENS[0]) + fixture_adapter("gpt2", "lora")[1:] + ["--adapter.type=dora"],
                       "use_dora is false but adapter.type=dora")


def test_dora_trains_the_same_on_any_rank_count():
    dora = ("--adapter.type=dora",)
    reference, path = lora_run(1, *dora)
    assert reference[-1] < reference[0] - 1e-3
    assert max(rel_diff(a, b) for a, b in zip(reference, lora_run(1)[0])) > 1e-5  # not LoRA's run
    for np_, options in [(3, ()), (2, ("--fsdp.activation_checkpointing=true",)),
                         (4, ("--fsdp.sharding_strategy=HYBRID_SHARD", "--fsdp.shard_group_size=2"))]:
        losses, _ = lora_run(np_, *dora, *options)
        assert max(rel_diff(a, b) for a, b in zip(losses, reference)) < 1e-5, (np_, options, losses, reference)
    magnitudes = [v for k, v in params_of(path).items() if k.startswith("model/") and k.endswith("lora_magnitude_vector")]
    # One per adapted layer of each block: c_attn's 3 x 40 outputs, mlp.c_proj's 40.
    assert sorted(m.shape for m in magnitudes) == [(40,), (40,), (120,), (120,)]
    # With dropout (PEFT's other formula, docs/adapters.md): another run, the same on any rank
    # count and with the blocks recomputed.
    dropped, _ = lora_run(1, *dora, "--adapter.dropout=0.2")
    assert dropped[-1] < dropped[0] - 1e-3
    assert max(rel_diff(a, b) for a, b in zip(dropped, reference)) > 1e-4  # dropout changes training
    for np_, options in [(3, ()), (2, ("--fsdp.activation_checkpointing=true",))]:
        losses, _ = lora_run(np_, *dora, "--adapter.dropout=0.2", *options)
        assert max(rel_diff(a, b) for a, b in zip(losses, dropped)) < 1e-5, (np_, options, losses, dropped)


def test_dropout_is_the_same_stream_on_any_rank_count_with_recomputation_and_resume():
    dropout = "--adapter.dropout=0.2"
    reference, _ = lora_run(1, dropout)
    assert max(rel_diff(a, b) for a, b in zip(reference, lora_run(1)[0])) > 1e-4  # dropout changes training
    for np_, options in [(3, ()), (2, ("--fsdp.activation_checkpointing=true",)),
                         (4, ("--fsdp.sharding_strategy=SHARD_GRAD_OP",))]:
        losses, _ = lora_run(np_, dropout, *options)
        assert max(rel_diff(a, b) for a, b in zip(losses, reference)) < 1e-5, (np_, options, losses, reference)
    d = tempdir()
    ok(run(2, tiny_args(*LORA, dropout, f"--train.steps={STEPS}", f"--checkpoint.dir={d}", "--checkpoint.every=3",
                        "--checkpoint.keep=100")), "saving run")
    metrics = os.path.join(tempdir(), "m.jsonl")
    ok(run(2, tiny_args(*LORA, dropout, f"--train.steps={STEPS}", f"--checkpoint.dir={tempdir()}",
                        f"--checkpoint.resume={os.path.join(d, ckpt_name(3))}", f"--train.metrics_file={metrics}")),
       "resume")
    straight, _ = lora_run(2, dropout)
    assert [r["loss"] for r in read_metrics(metrics)] == straight[3:]


# LoHa, LoKr and OFT trained on llama-tiny (C 40, KV 20, MLP 104): q and v of the fused q|k|v, gate of
# the fused gate|up, down. LoKr with both factors low-rank and an unsorted factorization (4, n);
# OFT with one rotation per layer.
LLAMA_TARGETS = "self_attn.q_proj,self_attn.v_proj,mlp.gate_proj,mlp.down_proj"
DELTA_TRAINING = {
    "loha": ("--adapter.type=loha", "--adapter.rank=4"),
    "lokr": ("--adapter.type=lokr", "--adapter.rank=1", "--adapter.decompose_both=true", "--adapter.decompose_factor=4"),
    "oft": ("--adapter.type=oft", "--adapter.block_size=8", "--adapter.block_share=true"),
}


@functools.lru_cache(maxsize=None)
def delta_run(method, np_, *options):
    """(losses, folder) of a llama-tiny run of DELTA_TRAINING[method], checkpoints at 3 and STEPS."""
    d = tempdir()
    metrics = os.path.join(d, "m.jsonl")
    ok(run(np_, llama_args(*DELTA_TRAINING[method], f"--adapter.targets={LLAMA_TARGETS}", f"--train.steps={STEPS}",
                           f"--checkpoint.dir={d}", "--checkpoint.every=3", "--checkpoint.keep=10",
                           f"--train.metrics_file={metrics}", *options)), f"{method} np={np_} {options}")
    return [r["loss"] for r in read_metrics(metrics)], d


def test_loha_lokr_and_oft_train_alone_the_same_on_any_rank_count_and_resume_exactly():
    cases = {"loha": (3, ()), "lokr": (4, ("--fsdp.sharding_strategy=HYBRID_SHARD", "--fsdp.shard_group_size=2")),
             "oft": (2, ("--fsdp.sharding_strategy=NO_SHARD", "--fsdp.activation_checkpointing=true"))}
    per_layer = {"loha": 4, "lokr": 4, "oft": 1}  # tensors: hada_w1_a ... hada_w2_b; lokr_w1_a ... lokr_w2_b; oft_R
    settings = {"loha": "loha rank 4 alpha 16 on",
                "lokr": "lokr rank 1 alpha 16 decompose_both true decompose_factor 4 on",
                "oft": "oft block_size 8 rotation cayley-neumann 5 terms block_share true on"}
    for method, (np_, options) in cases.items():
        reference, d = delta_run(method, 1)
        losses, _ = delta_run(method, np_, *options)
        assert max(rel_diff(a, b) for a, b in zip(losses, reference)) < 1e-5, (method, np_, losses, reference)
        # From step 3 to step 6 every adapter tensor moved and nothing else did.
        early, late = (params_of(os.path.join(d, ckpt_name(step))) for step in (3, STEPS))
        names = [k[len("model/"):] for k in late if k.startswith("model/")]
        adapters = {n for n in names if any(s in n for s in (".hada_", ".lokr_", ".oft_R"))}
        assert len(adapters) == 2 * 4 * per_layer[method], sorted(adapters)
        assert {n for n in names if not np.array_equal(early["model/" + n], late["model/" + n])} == adapters, method
        # A resume from step 3 on 3 ranks continues the run.
        metrics = os.path.join(tempdir(), "m.jsonl")
        ok(run(3, llama_args(*DELTA_TRAINING[method], f"--adapter.targets={LLAMA_TARGETS}", f"--train.steps={STEPS}",
                             f"--checkpoint.dir={tempdir()}", f"--checkpoint.resume={os.path.join(d, ckpt_name(3))}",
                             f"--train.metrics_file={metrics}")), f"{method} resume")
        resumed = [r["loss"] for r in read_metrics(metrics)]
        assert max(rel_diff(a, b) for a, b in zip(resumed, reference[3:])) < 1e-5, (method, resumed, reference)
        # inspect names the method's own settings.
        proc = ok(run_single(["inspect", os.path.join(d, ckpt_name(STEPS))]), "inspect")
        line = next(l for l in proc.stdout.splitlines() if l.startswith("adapters: "))
        assert line.startswith(f"adapters: {settings[method]} {LLAMA_TARGETS},"), line


GPT2_MODULES = {"attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj", "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}


def oft_rotation(v, b, terms):
    """The spec's R (b, b) of one block's parameters: the Cayley-Neumann series of `terms` (>= 4)
    terms, or (terms None) the exact Cayley transform."""
    U = np.zeros((b, b))
    U[np.triu_indices(b, 1)] = v  # row-major strict upper triangle, as torch.triu_indices
    Q, I = U - U.T, np.eye(b)
    if terms is None:
        return (I - Q) @ np.linalg.inv(I + Q)
    R, power = I.copy(), I
    for k in range(1, terms):
        power = power @ Q
        R += (1 if k == terms - 1 else 2) * power
    return R


def merged_by_formula(method, W, t, s=None, b=None, share=False, terms=5):
    """W (out, in) with the adapter tensors t (PEFT's suffix -> array) folded in, by the spec."""
    if method == "loha":
        return W + s * (t["hada_w1_a"] @ t["hada_w1_b"]) * (t["hada_w2_a"] @ t["hada_w2_b"])
    if method == "lokr":
        w1 = t["lokr_w1"] if "lokr_w1" in t else t["lokr_w1_a"] @ t["lokr_w1_b"]
        w2 = t["lokr_w2"] if "lokr_w2" in t else t["lokr_w2_a"] @ t["lokr_w2_b"]
        return W + s * np.kron(w1, w2)
    n = W.shape[1]
    Rf = np.zeros((n, n))
    for j in range(n // b):
        Rf[j * b:(j + 1) * b, j * b:(j + 1) * b] = oft_rotation(t["oft_R.weight"][0 if share else j], b, terms)
    return W @ Rf.T


# LoHa, LoKr and OFT on GPT-2 (no PEFT fixture: PEFT refuses them there) and the formula's settings.
GPT2_DELTA = {
    "loha": (("--adapter.type=loha", "--adapter.rank=2", "--adapter.alpha=3"), {"s": 1.5}),
    "lokr": (("--adapter.type=lokr", "--adapter.rank=1", "--adapter.alpha=2", "--adapter.decompose_both=true",
              "--adapter.decompose_factor=4"), {"s": 2.0}),
    "oft": (("--adapter.type=oft", "--adapter.block_size=20", "--adapter.cayley_neumann=false"), {"b": 20, "terms": None}),
}


def test_loha_lokr_and_oft_merge_on_gpt2_by_the_formulas_and_export_adapter_is_refused():
    for method, (options, settings) in GPT2_DELTA.items():
        d = tempdir()
        ok(run(2, tiny_args(*options, "--adapter.targets=attn.c_attn,mlp.c_proj", "--train.steps=2",
                            f"--checkpoint.dir={d}")), method)
        ckpt, merged = latest(d), os.path.join(tempdir(), "merged")
        ok(run(3, ["export", "--format", "hf", "--merge", "--checkpoint", ckpt, "--output", merged]), "--merge")
        got, _ = safetensors_arrays(os.path.join(merged, "model.safetensors"))
        params = params_of(ckpt)
        adapted = 0
        for l in range(2):
            for ours, theirs in GPT2_MODULES.items():
                prefix = f"model/h.{l}.{ours}."
                W = params[prefix + "weight"].astype(np.float64)
                t = {k[len(prefix):]: v.astype(np.float64) for k, v in params.items()
                     if k.startswith(prefix) and k[len(prefix):] not in ("weight", "bias")}
                want = merged_by_formula(method, W, t, **settings) if t else W
                if t:
                    assert np.abs(want - W).max() > 1e-4, (method, l, ours)  # the adapter matters here
                    adapted += 1
                # Transformers' Conv1D stores (in, out).
                assert np.allclose(got[f"transformer.h.{l}.{theirs}.weight"].T, want, rtol=1e-5, atol=1e-7), \
                    (method, l, ours, np.abs(got[f"transformer.h.{l}.{theirs}.weight"].T - want).max())
        assert adapted == 4, adapted
        (expect_usage_error if method == "lokr" else expect_usage_error_alone)(
            ["export", "--adapter", "--checkpoint", ckpt, "--output", tempdir()], ckpt, "PEFT 0.21.2 cannot load",
            "Conv1D", "--format hf --merge")


def expect_usage_error_alone(args, *needles):
    """expect_usage_error in one process without mpirun (singleton MPI): an error exit under mpirun
    costs a second or two of its teardown, and each rank runs the same check."""
    proc = run_single(args)
    assert proc.returncode == 2, f"exit {proc.returncode}, expected 2\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    errors = [l for l in proc.stderr.splitlines() if "error" in l]
    assert len(errors) == 1, f"expected one error line, got:\n{proc.stderr}"
    for needle in needles:
        assert needle in errors[0], f"{needle!r} not in {errors[0]!r}"


def peft_folder_with(fixture, **changes):
    """A copy of a llama fixture's PEFT folder with adapter_config.json keys changed."""
    folder = os.path.join(tempdir(), fixture)
    shutil.copytree(os.path.join(FIXTURES, "llama", fixture), folder)
    path = os.path.join(folder, "adapter_config.json")
    config = json.load(open(path))
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f)
    return folder


def test_loha_lokr_and_oft_bad_settings_and_other_peft_folders_exit_2():
    expect_usage_error(llama_args("--adapter.type=oft", f"--adapter.targets={LLAMA_TARGETS}"),
                       "adapter.block_size=32 does not divide the 40 inputs of model.layers.0.self_attn.q_proj",
                       "set adapter.block_size to a divisor")
    expect_usage_error_alone(llama_args("--adapter.type=oft", "--adapter.targets=mlp.down_proj", "--adapter.block_size=16"),
                       "adapter.block_size=16 does not divide the 104 inputs", "such as 13 or 26")
    expect_usage_error_alone(tiny_args(*LORA, "--adapter.type=loha", "--adapter.dropout=0.1"), "adapter.dropout",
                       "adapter.type=loha")
    start = fixture_args("llama", TOKENS[0])

    def init(folder):
        return [f"--adapter.init_from={folder if os.path.isabs(folder) else os.path.join(FIXTURES, 'llama', folder)}"]

    # A folder of another method, or of other settings (on several ranks once: the ranks agree).
    expect_usage_error(start + fixture_adapter("llama", "loha", init=False) + init("lokr"),
                       "peft_type LOKR but adapter.type=loha", "set adapter.type=lokr")
    expect_usage_error_alone(start + fixture_adapter("llama", "lora", init=False) + init("oft"),
                       "peft_type OFT but adapter.type=lora", "set adapter.type=oft")
    expect_usage_error_alone(start + fixture_adapter("llama", "oft", init=False) + init("loha"),
                       "peft_type LOHA but adapter.type=oft", "set adapter.type=loha")
    expect_usage_error_alone(start + fixture_adapter("llama", "oft") + ["--adapter.block_size=4"],
                       "oft_block_size=8 but adapter.block_size=4", "set adapter.block_size=8")
    expect_usage_error_alone(start + fixture_adapter("llama", "oft_cayley", init=False) + init("oft"),
                       "use_cayley_neumann is true but adapter.cayley_neumann=false",
                       "set adapter.cayley_neumann=true")
    expect_usage_error_alone(start + fixture_adapter("llama", "oft") + ["--adapter.neumann_terms=6"],
                       "num_cayley_neumann_terms=5 but adapter.neumann_terms=6")
    expect_usage_error_alone(start + fixture_adapter("llama", "oft") + ["--adapter.block_share=true"],
                       "block_share is false but adapter.block_share=true")
    expect_usage_error_alone(start + fixture_adapter("llama", "lokr_r1_both") + ["--adapter.decompose_both=false"],
                       "decompose_both is true but adapter.decompose_both=false", "set adapter.decompose_both=true")
    expect_usage_error_alone(start + fixture_adapter("llama", "lokr") + ["--adapter.decompose_factor=4"],
                       "decompose_factor=-1 but adapter.decompose_factor=4")
    expect_usage_error_alone(start + fixture_adapter("llama", "loha") + ["--adapter.alpha=16"],
                       "alpha=8 but adapter.alpha=16", "set adapter.alpha")
    expect_usage_error_alone(start + fixture_adapter("llama", "lokr") + ["--adapter.rank=2"], "r=4 but adapter.rank=2")
    # What we do not implement.
    for fixture, changes, needles in (
            ("loha", {"rank_dropout": 0.1}, ("rank_dropout=0.1", "not implemented")),
            ("lokr", {"module_dropout": 0.2}, ("module_dropout=0.2", "not implemented")),
            ("loha", {"alpha_pattern": {"q_proj": 4}}, ("rank_pattern/alpha_pattern",)),
            ("oft", {"coft": True}, ("coft is true", "not implemented")),
            ("oft", {"r": 4, "oft_block_size": 0}, ("r=4 sets the number of OFT blocks", "oft_block_size"))):
        expect_usage_error_alone(start + fixture_adapter("llama", fixture, init=False) +
                           init(peft_folder_with(fixture, **changes)), "adapter_config.json", *needles)
    # OFT's module_dropout is saved but never applied by PEFT 0.21.2: accepted, PEFT's loss.
    loss, _ = first_loss(2, start + fixture_adapter("llama", "oft", init=False) +
                         init(peft_folder_with("oft", module_dropout=0.1)))
    expected = reference_loss(np.load(os.path.join(FIXTURES, "llama", "oft", "logits.npy"))[0], TOKENS[0])
    assert rel_diff(loss, expected) < 1e-6, (loss, expected)
