"""train.freeze end to end, each property against an independent oracle:

- frozen parameters never change: the final checkpoint holds, bit for bit, the values of the
  checkpoint the run started from (checkpoint.init_from), in both layouts and on 1 and 3 ranks,
  and their moments are zero; every trainable tensor moved;
- the losses do not depend on the rank count or strategy (to 1e-5 of the 1-rank run), with units
  that mix frozen and trainable parameters, wholly frozen units and a frozen tied embedding;
- a resume is exact, and a checkpoint of a frozen run loads in a run that freezes nothing;
- memory: on one rank the gradients are 4 bytes and the moments 8 bytes per trainable parameter,
  counted by the trainer and predicted by `plan`;
- bad patterns exit 2 on every rank naming the pattern or the group."""
import functools
import os

import h5py
import numpy as np

from harness import read_metrics, rel_diff, run, run_single, tempdir, tiny_args
from test_bad_input import expect_usage_error
from test_checkpoint import ckpt_name, reassemble
from test_llama import llama_args, ok

MIXED = "wpe,h.0.ln_1.*,h.1.mlp.fc.weight"  # parts of the root and of both blocks
STEPS = 6


def latest(folder):
    with open(os.path.join(folder, "latest")) as f:
        return os.path.join(folder, f.read().strip())


def params_of(path):
    """{'model/<name>': array, 'optim/exp_avg/<name>': ...} of a checkpoint of either layout."""
    with h5py.File(path, "r") as f:
        sharded = "shards" in f
    if sharded:
        return reassemble(path)
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return out


@functools.lru_cache(maxsize=None)
def base_checkpoint():
    """Two unfrozen steps on 2 ranks: the weights the frozen runs start from."""
    d = tempdir()
    ok(run(2, tiny_args("--train.steps=2", f"--checkpoint.dir={d}")), "base run")
    return latest(d)


@functools.lru_cache(maxsize=None)
def frozen_run(np_, *options, freeze=MIXED):
    """(step records, final checkpoint) of a run from the base checkpoint with `freeze`."""
    d = tempdir()
    metrics = os.path.join(d, "m.jsonl")
    ok(run(np_, tiny_args(f"--train.steps={STEPS}", f"--train.freeze={freeze}", f"--checkpoint.dir={d}",
                          f"--checkpoint.init_from={base_checkpoint()}", f"--train.metrics_file={metrics}",
                          *options)), f"np={np_} {options} freeze={freeze}")
    return read_metrics(metrics), latest(d)


def frozen_names(names, freeze=MIXED):
    import fnmatch
    return {n for n in names if any(fnmatch.fnmatchcase(n, p) for p in freeze.split(","))}


def test_frozen_parameters_keep_their_bits_and_the_rest_trains():
    base = params_of(base_checkpoint())
    names = [k[len("model/"):] for k in base if k.startswith("model/")]
    frozen = frozen_names(names)
    assert frozen and len(frozen) < len(names)
    for np_, fmt in [(1, "sharded"), (3, "gathered"), (3, "sharded")]:
        _, path = frozen_run(np_, f"--checkpoint.format={fmt}")
        after = params_of(path)
        for name in names:
            same = np.array_equal(after[f"model/{name}"], base[f"model/{name}"])
            assert same == (name in frozen), (np_, fmt, name, "frozen but changed" if name in frozen else "unchanged")
            moments = after[f"optim/exp_avg/{name}"], after[f"optim/exp_avg_sq/{name}"]
            if name in frozen:
                assert not any(m.any() for m in moments), (np_, fmt, name, "a frozen parameter has moments")
            else:
                assert moments[1].any(), (np_, fmt, name)


def test_losses_do_not_depend_on_rank_count_or_strategy():
    for freeze in [MIXED, "h.0.*", "wte,wpe,h.0.*"]:  # mixed units; a whole block; the backward stops above h.0
        reference = [r["loss"] for r in frozen_run(1, freeze=freeze)[0]]
        cases = [(2, ()), (3, ()), (4, ("--fsdp.sharding_strategy=SHARD_GRAD_OP",)),
                 (4, ("--fsdp.sharding_strategy=HYBRID_SHARD", "--fsdp.shard_group_size=2")),
                 (2, ("--fsdp.reduce_every_microbatch=false", "--fsdp.activation_checkpointing=true")),
                 (2, ("--fsdp.cpu_offload=true", "--fsdp.forward_prefetch=true"))]
        for np_, options in cases:
            losses = [r["loss"] for r in frozen_run(np_, *options, freeze=freeze)[0]]
            worst = max(rel_diff(a, b) for a, b in zip(losses, reference))
            assert worst < 1e-5, (freeze, np_, options, worst)
    # And freezing changes the training: not the unfrozen run's losses.
    unfrozen = [r["loss"] for r in frozen_run(1, freeze="h.1.mlp.proj.bias")[0]]
    assert max(rel_diff(a, b) for a, b in zip(unfrozen, reference)) > 1e-4


def test_resume_is_exact_and_checkpoints_load_without_freezing():
    d = tempdir()
    ok(run(2, tiny_args(f"--train.freeze={MIXED}", f"--checkpoint.dir={d}", f"--train.steps={STEPS}",
                        f"--checkpoint.init_from={base_checkpoint()}", "--checkpoint.every=3",
                        "--checkpoint.keep=100")), "saving run")
    straight = [r["loss"] for r in frozen_run(2)[0]]
    for np_ in (2, 3):
        metrics = os.path.join(tempdir(), "m.jsonl")
        ok(run(np_, tiny_args(f"--train.freeze={MIXED}", f"--checkpoint.dir={tempdir()}", f"--train.steps={STEPS}",
                              f"--checkpoint.resume={os.path.join(d, ckpt_name(3))}",
                              f"--checkpoint.init_from={base_checkpoint()}",
                              f"--train.metrics_file={metrics}")), f"resumed on {np_}")
        resumed = [r["loss"] for r in read_metrics(metrics)]
        if np_ == 2:
            assert resumed == straight[3:], (resumed, straight)  # same ranks: the same bits
        else:
            assert max(rel_diff(a, b) for a, b in zip(resumed, straight[3:])) < 1e-5
    # The frozen run's checkpoint starts a run that trains everything, on another rank count.
    ok(run(3, tiny_args("--train.steps=1", f"--checkpoint.init_from={latest(d)}")), "unfrozen from frozen")


def test_memory_counts_trainable_parameters_only():
    full = frozen_run(1, freeze="h.1.mlp.proj.bias")[0][-1]["peak_mem"]
    steps, path = frozen_run(1)
    mem = steps[-1]["peak_mem"]
    base = params_of(base_checkpoint())
    trained = [v.size for k, v in base.items()
               if k.startswith("model/") and k[len("model/"):] not in frozen_names([k[len("model/"):]])]
    trainable = sum(trained)
    # Two moments per trainable element; the fused AdamW step's table, one 48-byte entry per trained
    # tensor (each under 64 Ki elements here).
    assert mem["gradients"] == 4 * trainable, (mem, trainable)
    assert mem["optimizer_state"] == 8 * trainable + 48 * len(trained), (mem, trainable, len(trained))
    assert mem["sharded_params"] == full["sharded_params"]
    # `plan` predicts what the trainer held.
    args = tiny_args(f"--train.freeze={MIXED}")[1:]
    proc = run_single(["plan", "--world-size=1", "--format=lines", *args])
    assert proc.returncode == 0, proc.stderr
    assert f"peak_bytes={steps[-1]['held_mem_bytes']}" in proc.stdout, proc.stdout


def test_llama_freezes_whole_groups_only():
    metrics = os.path.join(tempdir(), "m.jsonl")
    freeze = "embed_tokens.weight,layers.0.*,layers.1.self_attn.[qkv]_proj.weight"
    losses = {}
    for np_ in (1, 3):
        m = os.path.join(tempdir(), "m.jsonl")
        proc = ok(run(np_, llama_args("--train.steps=4", f"--train.freeze={freeze}", "--checkpoint.save=false",
                                      f"--train.metrics_file={m}")), f"llama np={np_}")
        losses[np_] = [r["loss"] for r in read_metrics(m)]
    assert max(rel_diff(a, b) for a, b in zip(losses[1], losses[3])) < 1e-5
    assert "frozen (train.freeze=" in proc.stdout
    expect_usage_error(llama_args("--train.freeze=layers.0.self_attn.q_proj.weight"),
                       "freeze all of the group or none of it")
    del metrics


def test_bad_patterns_exit_2_naming_them():
    expect_usage_error(tiny_args("--train.freeze=h.0.*,nothing.here"), "pattern 'nothing.here' matches no parameter")
    expect_usage_error(tiny_args("--train.freeze=*"), "freezes every parameter")


def test_frozen_parameters_are_gathered_but_never_reduced():
    """Bytes sent per step on 2 ranks, exactly: every parameter is all-gathered (PSI per
    micro-batch; both blocks stay held for the backward), only the trainable ones are
    reduce-scattered; each collective sends (N-1)/N of its volume. MIXED's spaces are all even, so
    nothing is padded. `plan` predicts the same bytes."""
    from test_precision import PSI
    trainable = (256 * 40 + 2 * 40) + (19720 - 2 * 40) + (19720 - 160 * 40)  # root, h.0, h.1 less MIXED
    accumulation, n = 24 // (2 * 2), 2
    expected = accumulation * (PSI * 4 + trainable * 4) * (n - 1) / n
    metrics = os.path.join(tempdir(), "m.jsonl")
    ok(run(2, tiny_args(f"--train.freeze={MIXED}", "--train.steps=2", "--checkpoint.save=false",
                        f"--train.metrics_file={metrics}")), "traffic")
    assert read_metrics(metrics)[-1]["comm_bytes"] == expected, (read_metrics(metrics)[-1]["comm_bytes"], expected)
    proc = run_single(["plan", "--world-size=2", "--format=lines", *tiny_args(f"--train.freeze={MIXED}")[1:]])
    assert f"strategy=FULL_SHARD reduce=micro checkpointing=no offload=no" in proc.stdout
    line = next(l for l in proc.stdout.splitlines()
                if l.startswith("PLAN strategy=FULL_SHARD reduce=micro checkpointing=no offload=no"))
    assert f"traffic_bytes={expected:.0f}" in line, (line, expected)
