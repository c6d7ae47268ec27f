"""fsdp.keep_half_shard: with a 16-bit param_dtype each rank keeps its shard rounded to that type and
rounds it again only after the masters change (the optimizer's step, a load), not at every gather;
on a shard group of one that copy is the gathered unit itself. The oracle is the same run rounding
at every gather (keep_half_shard=false): the same bits, step losses and evaluations, on every
strategy, with offload, fp16's skipped steps, a quantized base, and across a resume. Its memory is
2 bytes per held shard element, planned and held alike."""
import os
import subprocess

from harness import EXE, ROOT, read_metrics, run, tempdir, tiny_args
from test_quantization import BASE, training

STEPS = 8
BF16 = "--fsdp.param_dtype=bf16"


def history(np_, *overrides, ckdir=None):
    """(step losses, evaluation losses, step metrics, stdout) of a tiny run: 12 / np_ micro-batches a
    step, an evaluation every 3 steps."""
    metrics = os.path.join(tempdir(), "m.jsonl")
    extra = [f"--checkpoint.dir={ckdir}"] if ckdir else ["--checkpoint.save=false"]
    proc = run(np_, tiny_args(f"--train.steps={STEPS}", "--train.eval_every=3", f"--train.metrics_file={metrics}",
                              *extra, *overrides))
    assert proc.returncode == 0, f"{overrides} np={np_}: exit {proc.returncode}\n{proc.stderr[-2000:]}"
    steps = read_metrics(metrics)
    evals = [r["val_loss"] for r in read_metrics(metrics, kind="eval")]
    return [r["loss"] for r in steps], evals, steps, proc.stdout


def test_the_kept_copy_gives_the_bits_of_rounding_at_every_gather():
    cases = [
        (1, BF16),  # the kept copy is the gathered unit
        (1, BF16, "--fsdp.limit_all_gathers=1"),
        # Prefetches into block buffers that held another block (4 blocks, 2 buffers).
        (1, BF16, "--model.n_layer=4"),
        (1, BF16, "--model.n_layer=4", "--fsdp.forward_prefetch=true"),
        (2, BF16, "--model.n_layer=4", "--fsdp.forward_prefetch=true", "--fsdp.sharding_strategy=NO_SHARD"),
        (2, BF16, "--model.n_layer=4", "--fsdp.forward_prefetch=true"),
        (2, BF16),  # copied into the gather
        (3, BF16, "--fsdp.sharding_strategy=SHARD_GRAD_OP"),
        (4, BF16, "--fsdp.sharding_strategy=HYBRID_SHARD", "--fsdp.shard_group_size=2"),
        (2, BF16, "--fsdp.cpu_offload=true"),
        (1, BF16, "--fsdp.cpu_offload=true"),
        (2, "--fsdp.param_dtype=fp16", "--fsdp.reduce_dtype=fp16"),
    ]
    for np_, *options in cases:
        every_gather = history(np_, *options, "--fsdp.keep_half_shard=false")
        kept = history(np_, *options, "--fsdp.keep_half_shard=true")
        assert len(kept[1]) == 3, kept[1]  # after steps 3, 6 and the last
        assert kept[:2] == every_gather[:2], (np_, options, kept[:2], every_gather[:2])
        assert kept[0][0] != kept[0][-1], kept[0]  # the masters moved, so stale copies would show


def test_a_frozen_base_under_lora_gives_the_same_bits():
    # The frozen spaces' copies are rounded once, the adapters' after every step; units with records
    # gather through the slot's buffer.
    for base in ((), ("--fsdp.frozen_dtype=nf4",)):
        for np_ in (1, 2):
            every_gather = training(np_, BASE, *base, BF16, "--fsdp.keep_half_shard=false")[0]
            kept = training(np_, BASE, *base, BF16, "--fsdp.keep_half_shard=true")[0]
            assert kept == every_gather, (base, np_, kept, every_gather)


def test_a_resumed_run_rounds_the_loaded_masters():
    straight = history(2, BF16, "--fsdp.keep_half_shard=false")[0]
    ckdir = tempdir()
    history(2, BF16, "--checkpoint.every=4", ckdir=ckdir)
    middle = os.path.join(ckdir, "ckpt-00000004.h5")
    for np_ in (1, 2):
        resumed, _, _, stdout = history(np_, BF16, f"--checkpoint.resume={middle}", ckdir=tempdir())
        assert f"resumed from {middle}" in stdout
        if np_ == 2:
            assert resumed == straight[4:], (resumed, straight)
        else:  # another rank count: its summation order
            assert max(abs(a - b) / abs(b) for a, b in zip(resumed, straight[4:])) < 1e-5, (resumed, straight)


def test_the_copy_costs_two_bytes_per_held_element():
    # tiny.ini: root 12880 elements, blocks 19720; even, so 2 ranks hold half of each unpadded.
    held = {1: 12880 + 2 * 19720, 2: (12880 + 2 * 19720) // 2}
    for np_ in (1, 2):
        without = history(np_, BF16, "--fsdp.keep_half_shard=false")[2][0]
        kept = history(np_, BF16)[2][0]  # the default
        assert kept["peak_mem"]["sharded_params"] == without["peak_mem"]["sharded_params"] + 2 * held[np_]
        for step in (kept, without):
            assert step["held_mem_bytes"] == step["planned_mem_bytes"]
        if np_ == 1:  # the kept copies are the gathered ones: the root's and 2 block buffers' own copies go
            saved = without["peak_mem"]["comm_buffers"] - kept["peak_mem"].get("comm_buffers", 0)
            assert saved == 2 * (12880 + 2 * 19720), saved
    # fp32 gathers have nothing to keep.
    fp32 = history(2)[2][0]
    assert fp32["peak_mem"]["sharded_params"] == 4 * held[2]
    # auto keeps no copy where the masters are offloaded; asked for, it stays on the device.
    offloaded = history(2, BF16, "--fsdp.cpu_offload=true")[2][0]
    assert offloaded["peak_mem"].get("sharded_params", 0) == 0, offloaded["peak_mem"]
    kept = history(2, BF16, "--fsdp.cpu_offload=true", "--fsdp.keep_half_shard=true")[2][0]
    assert kept["peak_mem"]["sharded_params"] == 2 * held[2]


def plan_params(*overrides):
    """The params column of `plan`'s FULL_SHARD row (micro, no checkpointing, no offload), in bytes."""
    out = subprocess.run([EXE, "plan", "--config", os.path.join(ROOT, "inputs", "tiny.ini"), "--world-size", "2", BF16,
                          *overrides], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    row = next(l.split() for l in out.stdout.splitlines() if l.split()[:4] == ["FULL_SHARD", "micro", "no", "no"])
    value, unit = float(row[4]), row[5]
    return value * {"B": 1, "KiB": 1024, "MiB": 1024 ** 2}[unit]


def test_a_gpu_plan_keeps_no_copy_unless_asked():
    held = (12880 + 2 * 19720) // 2
    gpu = plan_params("--train.device=cuda")
    assert abs(plan_params("--train.device=cuda", "--fsdp.keep_half_shard=true") - (gpu + 2 * held)) < 103  # shown to 0.1 KiB
    assert abs(plan_params() - (gpu + 2 * held)) < 103  # the CPU's auto keeps it
