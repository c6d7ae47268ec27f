"""The FSDP controls change memory and traffic, never the math: every sharding strategy, deferred
gradient reduction and activation checkpointing give the losses of the 1-rank FULL_SHARD run to
1e-5 relative (fp32 summation order only), and checkpoints move between strategies."""
import os

from harness import read_metrics, rel_diff, run, tempdir, tiny_args

STEPS = 8


def losses(np_, *overrides, ckdir=None):
    metrics = os.path.join(tempdir(), "m.jsonl")
    extra = [f"--checkpoint.dir={ckdir}"] if ckdir else ["--checkpoint.save=false"]
    proc = run(np_, tiny_args(f"--train.steps={STEPS}", f"--train.metrics_file={metrics}", *extra, *overrides))
    assert proc.returncode == 0, f"{overrides} np={np_}: exit {proc.returncode}\n{proc.stderr[-2000:]}"
    return [r["loss"] for r in read_metrics(metrics)], proc.stdout


def assert_close(reference, other, label):
    worst = max(rel_diff(a, b) for a, b in zip(reference, other))
    assert len(reference) == len(other) and worst <= 1e-5, f"{label}: worst relative difference {worst:.2e}"


def test_every_strategy_gives_the_same_losses():
    reference, _ = losses(1)
    cases = [
        (2, "--fsdp.sharding_strategy=SHARD_GRAD_OP"),
        (3, "--fsdp.sharding_strategy=SHARD_GRAD_OP"),
        (2, "--fsdp.sharding_strategy=NO_SHARD"),
        (3, "--fsdp.sharding_strategy=NO_SHARD"),
        (4, "--fsdp.sharding_strategy=HYBRID_SHARD", "--fsdp.shard_group_size=2"),
        (2, "--fsdp.sharding_strategy=HYBRID_SHARD"),  # group = the node's 2 ranks
        (3, "--fsdp.reduce_every_microbatch=false"),
        (4, "--fsdp.sharding_strategy=HYBRID_SHARD", "--fsdp.shard_group_size=2",
         "--fsdp.reduce_every_microbatch=false"),
    ]
    for np_, *options in cases:
        other, stdout = losses(np_, *options)
        assert_close(reference, other, f"np={np_} {options}")


def test_hybrid_groups_are_reported():
    _, stdout = losses(4, "--fsdp.sharding_strategy=HYBRID_SHARD", "--fsdp.shard_group_size=2")
    assert "HYBRID_SHARD (shard group 2, replicas 2)" in stdout


def test_checkpoint_moves_between_strategies():
    reference, _ = losses(1)
    for layout in ("sharded", "gathered"):
        ckdir = tempdir()
        losses(2, "--fsdp.sharding_strategy=NO_SHARD", "--checkpoint.every=4", f"--checkpoint.format={layout}",
               ckdir=ckdir)
        middle = os.path.join(ckdir, "ckpt-00000004.h5")
        resumed, stdout = losses(3, "--fsdp.sharding_strategy=FULL_SHARD", f"--checkpoint.resume={middle}",
                                 ckdir=tempdir())
        assert f"resumed from {middle}" in stdout
        assert_close(reference[4:], resumed, f"{layout}: NO_SHARD x2 -> FULL_SHARD x3")


def test_conflicting_hybrid_options_are_rejected():
    for np_, options, needle in [(4, ["--fsdp.shard_group_size=2"], "HYBRID_SHARD"),
                                 (4, ["--fsdp.sharding_strategy=HYBRID_SHARD", "--fsdp.shard_group_size=3"], "divide")]:
        proc = run(np_, tiny_args(*options), timeout=60)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "fsdp.shard_group_size" in proc.stderr and needle in proc.stderr, proc.stderr[-2000:]


def test_activation_checkpointing_recomputes_the_same_bits_with_less_memory():
    plain, plain_out = losses(2)
    recomputed, ckpt_out = losses(2, "--fsdp.activation_checkpointing=true")
    assert plain == recomputed  # the recomputed forward is deterministic: identical losses

    def activations(stdout):
        line = next(l for l in stdout.splitlines() if l.startswith("memory per rank"))
        value, unit = line.split("activations ")[1].split(",")[0].split()[:2]
        return float(value) * {"B": 1, "KiB": 1024, "MiB": 1 << 20, "GiB": 1 << 30}[unit]
    assert activations(ckpt_out) < 0.8 * activations(plain_out)


def test_prefetching_changes_timing_not_bits():
    # Prefetched all-gathers fill the same buffers with the same values: identical losses.
    plain, _ = losses(3, "--fsdp.backward_prefetch=NONE", "--fsdp.limit_all_gathers=1")
    for options in (["--fsdp.backward_prefetch=BACKWARD_PRE"],
                    ["--fsdp.backward_prefetch=BACKWARD_POST", "--fsdp.forward_prefetch=true"],
                    ["--fsdp.forward_prefetch=true", "--fsdp.limit_all_gathers=3"],
                    ["--fsdp.sharding_strategy=HYBRID_SHARD", "--fsdp.forward_prefetch=true"]):
        other, _ = losses(3, *options)
        assert other == plain, options


def test_bad_prefetch_options_are_rejected():
    for option, needle in (("--fsdp.backward_prefetch=SIDEWAYS", "BACKWARD_PRE"), ("--fsdp.limit_all_gathers=0", ">= 1")):
        proc = run(2, tiny_args(option), timeout=60)
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr[-1000:]


def test_cpu_offload_changes_where_state_lives_not_bits():
    # The master shards, gradients and moments move to host memory (on the CPU backend the
    # "device" is host memory too, so this exercises the staging path): identical losses, and
    # the device accounting loses the sharded parameters and optimizer state.
    def categories(stdout):
        line = next(l for l in stdout.splitlines() if l.startswith("memory per rank"))
        return {part.split()[0] for part in line.split(":", 1)[1].split("|")[0].split(",")}
    for np_, options in ((1, []), (3, ["--fsdp.param_dtype=bf16"]),
                         (4, ["--fsdp.sharding_strategy=HYBRID_SHARD", "--fsdp.shard_group_size=2"]),
                         (2, ["--fsdp.sharding_strategy=NO_SHARD", "--fsdp.reduce_every_microbatch=false"])):
        plain, plain_out = losses(np_, *options)
        offloaded, offload_out = losses(np_, "--fsdp.cpu_offload=true", *options)
        assert offloaded == plain, (np_, options)
        assert {"sharded_params", "optimizer_state"} <= categories(plain_out)
        assert not {"sharded_params", "optimizer_state"} & categories(offload_out), offload_out
