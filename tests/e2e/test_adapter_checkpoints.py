"""Adapter-only checkpoints (checkpoint.adapters_only) end to end. Oracles independent of the code
under test:

- h5py: the file holds the adapters' datasets and nothing else, with the values (and moments) of
  the full checkpoint the same run writes at the same step; it is a small fraction of that file;
- the base checksum recomputed here from its definition (docs/checkpoint-format.md: the element
  checksum of the base model laid end to end in declaration order) over the base checkpoint that
  checkpoint.init_from names; a full checkpoint of the same run records the same value;
- the uninterrupted run: a resume from an adapter-only file (its base from checkpoint.init_from)
  gives the same losses, exactly on the same rank count, to 1e-5 on another, in both layouts;
- another base, no base, and the commands that need the base exit 2 with one line;
- `export --adapter` of an adapter-only file equals that of the full checkpoint of the step;
- LoHa, LoKr and OFT: their parameters alone in the file, and the resume continues the run."""
import functools
import json
import os
import shutil

import h5py
import numpy as np

from harness import read_metrics, rel_diff, run, run_single, tempdir, tiny_args
from test_adapters import LORA, safetensors_arrays
from test_bad_input import expect_usage_error
from test_checkpoint import checksum, ckpt_name, param_shapes, text
from test_freeze import base_checkpoint, latest, params_of
from test_llama import ok

FORMATS = ("sharded", "gathered")
STEPS = 6
SAVE_AT = 3


@functools.lru_cache(maxsize=None)
def other_base():
    """Another base model: two steps from another seed."""
    d = tempdir()
    ok(run(2, tiny_args("--train.steps=2", "--train.seed=7", f"--checkpoint.dir={d}")), "other base")
    return latest(d)


def adapter_args(*options, base=None):
    """A LoRA run on the base checkpoint (checkpoint.init_from)."""
    return tiny_args(*LORA, f"--train.steps={STEPS}", f"--checkpoint.init_from={base or base_checkpoint()}", *options)


@functools.lru_cache(maxsize=None)
def adapter_run(np_, fmt, adapters_only, *options):
    """(losses, folder) of the uninterrupted LoRA run, checkpoints at SAVE_AT and STEPS."""
    d = tempdir()
    metrics = os.path.join(d, "m.jsonl")
    ok(run(np_, adapter_args(f"--checkpoint.dir={d}", f"--train.metrics_file={metrics}", f"--checkpoint.format={fmt}",
                             f"--checkpoint.every={SAVE_AT}", "--checkpoint.keep=10",
                             f"--checkpoint.adapters_only={str(adapters_only).lower()}", *options)),
       f"np={np_} {fmt} adapters_only={adapters_only} {options}")
    return [r["loss"] for r in read_metrics(metrics)], d


def base_checksum_of(path):
    """The base checksum by its definition: the element checksum of every parameter of the
    (full) checkpoint `path`, laid end to end in declaration order."""
    arrays = params_of(path)
    order = ["wte", "wpe", "ln_f.weight", "ln_f.bias"] + [n for n in param_shapes() if n.startswith("h.")]
    return checksum(np.concatenate([arrays[f"model/{name}"].reshape(-1) for name in order]))


def datasets(path):
    names = []
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
    return sorted(names)


def test_adapter_only_file_is_small_and_holds_the_adapters_alone():
    expected_base = base_checksum_of(base_checkpoint())
    for fmt in FORMATS:
        _, full_dir = adapter_run(2, fmt, False)
        _, only_dir = adapter_run(2, fmt, True)
        for step in (SAVE_AT, STEPS):
            full, only = os.path.join(full_dir, ckpt_name(step)), os.path.join(only_dir, ckpt_name(step))
            ratio = os.path.getsize(only) / os.path.getsize(full)
            assert ratio < 0.1, (fmt, step, os.path.getsize(only), os.path.getsize(full))
            with h5py.File(only, "r") as f, h5py.File(full, "r") as g:
                assert int(f.attrs["version"]) == 10 and int(f.attrs["adapters_only"]) == 1
                assert int(g.attrs["adapters_only"]) == 0
                assert text(f.attrs["layout"]) == fmt and text(f.attrs["adapter.type"]) == "lora"
                # The base the adapters were trained on, by the definition, in both files.
                assert int(f.attrs["base_checksum"]) == int(g.attrs["base_checksum"]) == expected_base, fmt
            got, want = params_of(only), params_of(full)
            adapters = {k for k in want if ".lora_" in k}
            assert len(adapters) == 3 * 8  # A and B of 4 layers; weights and both moments
            assert set(got) == adapters, sorted(set(got) ^ adapters)
            for key in adapters:  # the same run on the same ranks: the same bits
                assert np.array_equal(got[key], want[key]), (fmt, step, key)
            names = datasets(only)
            if fmt == "gathered":
                assert names == sorted(adapters), names
            else:  # one flat dataset per block (the root has no adapters), the adapters end to end
                assert names == [f"shards/h.{l}/{part}" for l in (0, 1) for part in ("exp_avg", "exp_avg_sq", "params")]
                with h5py.File(only, "r") as f:
                    index = text(f["shards/h.0"].attrs["index"]).split()
                    assert index[:4] == ["h.0.attn.qkv.lora_A.weight", "0", "160", "4x40"], index
                    assert int(f["shards/h.0/params"].attrs["numel"]) == 160 + 480 + 640 + 160
        proc = ok(run_single(["inspect", os.path.join(only_dir, ckpt_name(STEPS))]), "inspect")
        assert "adapter-only checkpoint" in proc.stdout and "version 10" in proc.stdout, proc.stdout[:2000]
        assert f"base model checksum 0x{expected_base:016x} (not in the file)" in proc.stdout, proc.stdout[:2000]
        prefix = "/" + names[0].split("/")[0] + "/"  # /model/ or /shards/: a row of the parameter table
        rows = [l.split()[0] for l in proc.stdout.splitlines() if l.split() and l.split()[-1].startswith(prefix)]
        assert len(rows) == 8 and all(".lora_" in r for r in rows), rows  # the parameters it holds


def resumed_losses(np_, fmt, from_dir, *options, folder=None):
    metrics = os.path.join(tempdir(), "m.jsonl")
    proc = ok(run(np_, adapter_args(f"--checkpoint.dir={folder or tempdir()}", f"--train.metrics_file={metrics}",
                                    f"--checkpoint.format={fmt}", "--checkpoint.adapters_only=true",
                                    f"--checkpoint.resume={os.path.join(from_dir, ckpt_name(SAVE_AT))}", *options)),
              f"resume np={np_} {fmt}")
    assert f"resumed from {os.path.join(from_dir, ckpt_name(SAVE_AT))} at step {SAVE_AT}" in proc.stdout
    assert "initialised the weights from ShardTrain checkpoint" in proc.stdout  # the base, first
    return [r["loss"] for r in read_metrics(metrics)]


def test_resume_from_an_adapter_only_file_is_exact_on_any_rank_count():
    for fmt in FORMATS:
        straight, saved2 = adapter_run(2, fmt, True)
        assert straight == adapter_run(2, fmt, False)[0]  # what is saved does not change training
        assert resumed_losses(2, fmt, saved2) == straight[SAVE_AT:], fmt
        for np_, saved in ((3, saved2), (2, adapter_run(3, fmt, True)[1])):
            losses = resumed_losses(np_, fmt, saved)
            assert max(rel_diff(a, b) for a, b in zip(losses, straight[SAVE_AT:])) < 1e-5, (fmt, np_, losses, straight)
    # Replicas (HYBRID_SHARD: 2 shard groups of 2) count each base element once, loading and saving.
    d = tempdir()
    losses = resumed_losses(4, "sharded", saved2, "--fsdp.sharding_strategy=HYBRID_SHARD", "--fsdp.shard_group_size=2",
                            folder=d)
    assert max(rel_diff(a, b) for a, b in zip(losses, straight[SAVE_AT:])) < 1e-5, (losses, straight)
    with h5py.File(os.path.join(d, ckpt_name(STEPS)), "r") as f:
        assert int(f.attrs["base_checksum"]) == base_checksum_of(base_checkpoint())
    # checkpoint.resume=auto, the usual restart: the run's own folder and options, after a crash
    # that lost the last checkpoint.
    d = tempdir()
    common = (f"--checkpoint.dir={d}", "--checkpoint.adapters_only=true", f"--checkpoint.every={SAVE_AT}")
    ok(run(3, adapter_args(*common)), "first run")
    os.remove(os.path.join(d, ckpt_name(STEPS)))
    with open(os.path.join(d, "latest"), "w") as f:
        f.write(ckpt_name(SAVE_AT) + "\n")
    metrics = os.path.join(tempdir(), "m.jsonl")
    proc = ok(run(2, adapter_args(*common, f"--train.metrics_file={metrics}")), "restart")
    assert f"resumed from {os.path.join(d, ckpt_name(SAVE_AT))} at step {SAVE_AT}" in proc.stdout, proc.stdout[-2000:]
    straight, _ = adapter_run(2, "sharded", True)
    losses = [r["loss"] for r in read_metrics(metrics)]
    assert max(rel_diff(a, b) for a, b in zip(losses, straight[SAVE_AT:])) < 1e-5, (losses, straight)


def test_another_base_is_refused_naming_both_checksums():
    _, saved = adapter_run(2, "sharded", True)
    path = os.path.join(saved, ckpt_name(SAVE_AT))
    stored, other = base_checksum_of(base_checkpoint()), base_checksum_of(other_base())
    assert stored != other
    needles = (path, f"0x{stored:016x}", f"0x{other:016x}", "give the base it was trained on as checkpoint.init_from")
    for extra in ((), ("--checkpoint.allow_data_change=true",)):
        expect_usage_error(adapter_args(f"--checkpoint.resume={path}", *extra, base=other_base()), *needles)
    # resume=auto must not skip it and start afresh on the other base.
    d = tempdir()
    ok(run(2, adapter_args(f"--checkpoint.dir={d}", f"--train.steps={SAVE_AT}", "--checkpoint.adapters_only=true")),
       "first part")
    expect_usage_error(adapter_args(f"--checkpoint.dir={d}", "--checkpoint.adapters_only=true", base=other_base()),
                       os.path.join(d, ckpt_name(SAVE_AT)), f"0x{stored:016x}", f"0x{other:016x}")
    assert sorted(os.listdir(d)) == [ckpt_name(SAVE_AT), "config.ini", "latest", "metrics.jsonl"]


def test_a_missing_base_and_settings_without_one_are_refused():
    _, saved = adapter_run(2, "gathered", True)
    path = os.path.join(saved, ckpt_name(SAVE_AT))
    base = f"0x{base_checksum_of(base_checkpoint()):016x}"
    no_base = [a for a in adapter_args(f"--checkpoint.resume={path}") if not a.startswith("--checkpoint.init_from")]
    expect_usage_error(no_base, path, "without the base model", base, "checkpoint.init_from")
    expect_usage_error(adapter_args(f"--checkpoint.init_from={path}"), path, "no base model", "checkpoint.resume")
    expect_usage_error([a for a in adapter_args("--checkpoint.adapters_only=true")
                        if not a.startswith("--checkpoint.init_from")],
                       "checkpoint.adapters_only", "checkpoint.init_from")
    expect_usage_error(tiny_args("--checkpoint.adapters_only=true", f"--checkpoint.init_from={base_checkpoint()}"),
                       "checkpoint.adapters_only", "adapter.type=none")
    # What needs the model needs the base: merged or llm.c exports of an adapter-only file.
    expect_usage_error(["export", "--format", "hf", "--merge", "--checkpoint", path, "--output", tempdir()],
                       path, "adapters alone", "--adapter")
    expect_usage_error(["export", "--format", "hf", "--checkpoint", path, "--output", tempdir()], path)
    expect_usage_error(["export", "--checkpoint", path, "--output", os.path.join(tempdir(), "m.bin")], path)


def test_generate_and_eval_put_an_adapter_only_file_on_its_base():
    """generate and eval of an adapter-only checkpoint load its base under the adapters (the run's
    checkpoint.init_from, or --base): the greedy text and the loss of the full checkpoint of the same
    step. A moved base is found with --base; another base is refused naming both checksums; a
    missing one names --base."""
    _, only = adapter_run(2, "gathered", True)
    _, full = adapter_run(2, "gathered", False)
    adapters, whole = (os.path.join(d, ckpt_name(SAVE_AT)) for d in (only, full))
    prompt = ["--prompt", "Dora has", "--max-tokens", "16", "--temperature", "0"]
    want = run(2, ["generate", "--checkpoint", whole, *prompt])
    ok(want, "generate from the full checkpoint")
    got = run(2, ["generate", "--checkpoint", adapters, *prompt])
    ok(got, "generate from the adapter-only checkpoint")
    assert got.stdout == want.stdout and len(want.stdout) > len("Dora has"), (got.stdout, want.stdout)
    assert "go onto the base model ShardTrain checkpoint" in got.stdout + got.stderr, got.stderr
    moved = os.path.join(tempdir(), "moved-base.h5")
    shutil.copy(base_checkpoint(), moved)
    got = run(2, ["generate", "--checkpoint", adapters, "--base", moved, *prompt])
    ok(got, "generate with --base")
    assert got.stdout == want.stdout
    scores = []
    for path in (whole, adapters):
        proc = run(2, ["eval", "--checkpoint", path])
        ok(proc, f"eval {path}")
        scores.append(proc.stdout.split("| loss ")[1].split(" ")[0])
    assert scores[0] == scores[1], scores
    expect_usage_error(["generate", "--checkpoint", adapters, "--base", other_base(), *prompt], adapters,
                       "base model of checksum")
    expect_usage_error(["generate", "--checkpoint", adapters, "--base", "/no/such/base", *prompt],
                       "--base='/no/such/base' does not exist")


def test_export_adapter_equals_the_full_checkpoints():
    for fmt in FORMATS:
        _, full_dir = adapter_run(2, fmt, False)
        _, only_dir = adapter_run(2, fmt, True)
        outs = []
        for folder, np_ in ((full_dir, 2), (only_dir, 3)):
            out = os.path.join(tempdir(), "adapter")
            ckpt = os.path.join(folder, ckpt_name(STEPS))
            ok(run(np_, ["export", "--adapter", "--checkpoint", ckpt, "--output", out]), f"export --adapter {fmt}")
            outs.append(out)
        (full, meta_full), (only, meta_only) = (safetensors_arrays(os.path.join(o, "adapter_model.safetensors"))
                                                for o in outs)
        assert meta_full == meta_only and sorted(full) == sorted(only) and len(full) == 8, sorted(only)
        for name in full:
            assert np.array_equal(full[name], only[name]), (fmt, name)
        configs = [json.load(open(os.path.join(o, "adapter_config.json"))) for o in outs]
        assert configs[0] == configs[1]


def test_version_3_files_load_and_damaged_version_4_attributes_are_refused():
    """A file of the previous format (version 3: no adapters_only, no base_checksum) is a full
    checkpoint and resumes as before; adapters_only must be 0 or 1, and 1 only with adapters."""
    from test_checkpoint_edges import meta_checksum
    _, full_dir = adapter_run(2, "gathered", False)
    straight, _ = adapter_run(2, "gathered", True)
    v3 = os.path.join(tempdir(), ckpt_name(SAVE_AT))
    shutil.copy(os.path.join(full_dir, ckpt_name(SAVE_AT)), v3)
    with h5py.File(v3, "r+") as f:
        f.attrs["version"] = np.int64(3)
        del f.attrs["adapters_only"], f.attrs["base_checksum"]
        f.attrs["meta_checksum"] = np.uint64(meta_checksum(f.attrs))
    metrics = os.path.join(tempdir(), "m.jsonl")
    ok(run(2, adapter_args(f"--checkpoint.resume={v3}", f"--checkpoint.dir={tempdir()}",
                           f"--train.metrics_file={metrics}", "--checkpoint.format=gathered")), "version 3")
    assert [r["loss"] for r in read_metrics(metrics)] == straight[SAVE_AT:]
    proc = ok(run_single(["inspect", v3]), "inspect")
    assert "version 3" in proc.stdout and "base model checksum" not in proc.stdout, proc.stdout[:2000]

    _, only_dir = adapter_run(2, "gathered", True)
    plain = base_checkpoint()  # no adapters
    for source, value, needle in ((os.path.join(only_dir, ckpt_name(SAVE_AT)), 2, "adapters_only=2"),
                                  (plain, 1, "adapters_only=1 but adapter.type=none")):
        path = os.path.join(tempdir(), "damaged.h5")
        shutil.copy(source, path)
        with h5py.File(path, "r+") as f:
            f.attrs["adapters_only"] = np.int64(value)
            f.attrs["meta_checksum"] = np.uint64(meta_checksum(f.attrs))
        expect_usage_error(["inspect", path], path, needle, np_=1)


def test_dora_magnitudes_travel_in_adapter_only_files():
    """DoRA's magnitudes are adapter parameters: saved, and restored on resume (not re-derived
    from the base, which only a fresh start does)."""
    dora = "--adapter.type=dora"
    straight, saved = adapter_run(2, "sharded", True, dora)
    with h5py.File(os.path.join(saved, ckpt_name(SAVE_AT)), "r") as f:
        index = text(f["shards/h.0"].attrs["index"])
    assert "h.0.attn.qkv.lora_magnitude_vector" in index and "h.0.ln_1" not in index, index
    losses = resumed_losses(3, "sharded", saved, dora)
    assert max(rel_diff(a, b) for a, b in zip(losses, straight[SAVE_AT:])) < 1e-5, (losses, straight)


def test_loha_lokr_and_oft_parameters_travel_in_adapter_only_files():
    """Their parameters are adapters like LoRA's: an adapter-only file holds them alone (with their
    moments), and a resume from it on another rank count continues the run."""
    cases = (("sharded", ("--adapter.type=oft", "--adapter.block_size=8"), (".oft_R.weight",), 4),
             ("gathered", ("--adapter.type=lokr", "--adapter.rank=1", "--adapter.decompose_both=true"),
              (".lokr_w1_a", ".lokr_w1_b", ".lokr_w2_a", ".lokr_w2_b"), 16),
             ("sharded", ("--adapter.type=loha",), (".hada_w1_a", ".hada_w1_b", ".hada_w2_a", ".hada_w2_b"), 16))
    for fmt, method, suffixes, count in cases:
        straight, saved = adapter_run(2, fmt, True, *method)
        stored = params_of(os.path.join(saved, ckpt_name(SAVE_AT)))
        assert len(stored) == 3 * count and all(k.endswith(suffixes) for k in stored), sorted(stored)
        losses = resumed_losses(3, fmt, saved, *method)
        assert max(rel_diff(a, b) for a, b in zip(losses, straight[SAVE_AT:])) < 1e-5, (method, losses, straight)
