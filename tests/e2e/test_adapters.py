"""LoRA adapters end to end. The oracles are independent of our code:

- PEFT itself (peft 0.21.2, tests/fixtures/peft, made once with torch and committed): a Hugging
  Face base folder plus a PEFT adapter folder, imported, give the loss of PEFT's logits on the same
  tokens, for GPT-2 (Conv1D, fan_in_fan_out) and Llama (q/v/down_proj of fused products);
  exported again, the adapter folder holds PEFT's names, shapes and values; --merge gives PEFT's
  merged weights (merge_and_unload);
- the base model's bits: after training only adapter tensors moved;
- the rank count and strategy: losses equal the 1-rank run's (1e-5), bf16 within 1%;
- the uninterrupted run: a resume is exact;
- one error line and exit 2 for each conflicting or bad setting."""
import functools
import json
import os

import numpy as np

from harness import ROOT, read_metrics, rel_diff, run, tempdir, tiny_args
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
    """name -> float32 array of a safetensors file, read with numpy alone (the format is an 8-byte
    header length, a JSON header, then the data)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        assert t["dtype"] == "F32", (name, t["dtype"])
        begin, end = t["data_offsets"]
        out[name] = np.frombuffer(data[begin:end], dtype="<f4").reshape(t["shape"])
    return out, header.get("__metadata__")


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


def fixture_adapter(arch, method, init=True):
    """The options of a fixture's adapter (rank 4, alpha 8), started from its PEFT folder."""
    options = [f"--adapter.type={method}", f"--adapter.targets={FIXTURE_TARGETS[arch]}", "--adapter.rank=4",
               "--adapter.alpha=8"]
    return options + ([f"--adapter.init_from={os.path.join(FIXTURES, arch, method)}"] if init else [])


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


def test_export_writes_pefts_folder_and_merge_pefts_weights():
    for arch, method in ((arch, method) for arch in ("gpt2", "llama") for method in METHODS):
        ckpt, out, merged = peft_round_trip(arch, method)
        fixture = os.path.join(FIXTURES, arch, method)
        assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
        ours, meta = safetensors_arrays(os.path.join(out, "adapter_model.safetensors"))
        theirs, _ = safetensors_arrays(os.path.join(fixture, "adapter_model.safetensors"))
        assert meta == {"format": "pt"}
        assert sorted(ours) == sorted(theirs), sorted(set(ours) ^ set(theirs))
        for name in theirs:
            assert ours[name].shape == theirs[name].shape and np.array_equal(ours[name], theirs[name]), (method, name)
        config, reference = (json.load(open(os.path.join(p, "adapter_config.json"))) for p in (out, fixture))
        for key in ("peft_type", "r", "lora_alpha", "fan_in_fan_out", "use_dora", "use_rslora", "lora_bias", "bias"):
            assert config[key] == reference[key], (arch, key, config[key], reference[key])
        assert sorted(config["target_modules"]) == sorted(reference["target_modules"])
        # --merge: PEFT's merge_and_unload, to float32 rounding of W + s B A.
        got, _ = safetensors_arrays(os.path.join(merged, "model.safetensors"))
        want, _ = safetensors_arrays(os.path.join(fixture, "merged.safetensors"))
        base, _ = safetensors_arrays(os.path.join(FIXTURES, arch, "base", "model.safetensors"))
        assert sorted(got) == sorted(want)
        changed = 0
        for name in want:
            assert np.allclose(got[name], want[name], rtol=1e-5, atol=1e-6), (arch, method, name)
            changed += not np.array_equal(want[name], base[name])
        assert changed == 2 * len(FIXTURE_TARGETS[arch].split(",")), changed  # the adapted weights of 2 layers


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
    # A LoRA folder into a DoRA run; DoRA with dropout.
    expect_usage_error(fixture_args("gpt2", TOKENS[0]) + fixture_adapter("gpt2", "lora")[1:] + ["--adapter.type=dora"],
                       "use_dora is false but adapter.type=dora")
    expect_usage_error(tiny_args(*LORA, "--adapter.type=dora", "--adapter.dropout=0.1"), "adapter.type=dora")


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
