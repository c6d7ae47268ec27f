"""One host synchronization per optimizer step. The loss and the gradient norm are summed into
device memory, all-reduced there, and the fused AdamW decides clipping, the fp16 loss scale and the
inf/NaN skip from them on the device; the host reads both once, at the end of the step (with
cpu_offload: when the gradient shards come down). Every wait of the host for the device is counted
by the Device (copies into host memory, synchronize, reductions returned to the host) -- on the
CPU backend as on a GPU, since the count is the code's, not the hardware's -- and each step's count
is in the metrics as host_syncs. Evaluation and checkpoints happen between steps. The step's
phases (phase_seconds) are timed without adding a wait."""
import os
import subprocess

import harness
from harness import EXE, mpirun_command, read_metrics, tempdir, tiny_args

LORA = ["--adapter.type=lora", "--adapter.targets=attn.c_attn,mlp.c_proj", "--adapter.rank=4",
        "--adapter.alpha=8", "--adapter.dropout=0.1"]


def steps_of(np_, *overrides):
    metrics = os.path.join(tempdir(), "m.jsonl")
    args = tiny_args("--train.steps=4", f"--train.metrics_file={metrics}", "--checkpoint.every=2", *overrides)
    proc = subprocess.run(mpirun_command(np_, [EXE, *args]), cwd=harness.ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, f"{overrides}: exit {proc.returncode}\n{proc.stderr[-2000:]}"
    return read_metrics(metrics)


def test_every_step_waits_for_the_device_once():
    cases = [
        (2, []),  # FULL_SHARD, gradient accumulation over several micro-batches
        (2, ["--fsdp.sharding_strategy=SHARD_GRAD_OP"]),
        (2, ["--fsdp.sharding_strategy=NO_SHARD", "--fsdp.reduce_every_microbatch=false"]),
        (4, ["--fsdp.sharding_strategy=HYBRID_SHARD", "--fsdp.shard_group_size=2"]),
        (2, ["--fsdp.cpu_offload=true"]),
        (2, ["--fsdp.param_dtype=bf16", "--fsdp.activation_checkpointing=true", "--train.eval_every=2"]),
        (2, ["--fsdp.param_dtype=fp16", "--debug.inject_inf_step=2"]),  # an overflow: the step is skipped
        (1, ["--train.grad_clip=0.01", *LORA]),  # every step clipped
    ]
    for np_, overrides in cases:
        steps = steps_of(np_, *overrides)
        assert len(steps) == 4, overrides
        assert [s["host_syncs"] for s in steps] == [1] * 4, (np_, overrides, [s["host_syncs"] for s in steps])
        if "--debug.inject_inf_step=2" in overrides:
            assert [s["skipped"] for s in steps] == [False, True, False, False], overrides


def test_a_reduction_returned_to_the_host_would_be_counted():
    """The count is not a constant: OFT's Cayley transform solves each block's system on the host,
    a copy down and up per adapted layer and step, and those waits show."""
    oft = ["--adapter.type=oft", "--adapter.targets=attn.c_attn", "--adapter.block_size=8",
           "--adapter.cayley_neumann=false"]
    steps = steps_of(1, *oft)
    assert all(s["host_syncs"] > 1 for s in steps), [s["host_syncs"] for s in steps]


def test_the_steps_phases_lie_within_the_step():
    """phase_seconds (forward, backward, grad_sync, optimizer) are spans between boundaries inside
    the step, each summed over micro-batches: none is negative, the ones every configuration has
    are positive, and on one rank their sum cannot exceed the step's own time -- counting a
    micro-batch twice, a boundary left from the previous step or a span in the wrong unit would.
    (With several ranks each phase is the slowest rank's, and maxima of different ranks may sum
    past any one rank's step.)"""
    cases = [
        (1, ["--train.micro_batch=2"]),  # several micro-batches on one rank
        (1, ["--fsdp.cpu_offload=true"]),  # the gradients' copy to the host is grad_sync
        (1, ["--fsdp.param_dtype=bf16", *LORA]),
        (2, []),  # FULL_SHARD: the deferred reduce-scatters are grad_sync
    ]
    for np_, overrides in cases:
        for s in steps_of(np_, *overrides):
            phases = s["phase_seconds"]
            assert set(phases) == {"forward", "backward", "grad_sync", "optimizer"}, phases
            assert all(v >= 0 for v in phases.values()), (overrides, phases)
            assert phases["forward"] > 0 and phases["backward"] > 0 and phases["optimizer"] > 0, (overrides, phases)
            if np_ == 1:
                assert sum(phases.values()) <= s["step_seconds"], (overrides, phases, s["step_seconds"])
            else:
                assert phases["grad_sync"] > 0, (overrides, phases)
