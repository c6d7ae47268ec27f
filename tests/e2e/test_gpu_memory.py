"""On a GPU: the caching allocator's high-water mark (device_reserved_bytes in the metrics, "GPU
reserved" in the step line) against the memory plan, which counts the backend's own workspaces
and the allocator's rounding (docs/memory.md). NCCL's buffers are outside the allocator, so
single-rank runs compare exactly what the allocator holds. Skipped without a CUDA build and a GPU."""
import os
import re
import subprocess

from harness import EXE, ROOT, Skip, read_metrics, run, run_single, tempdir, tiny_args

# The plan counts each grow-only workspace at its largest request; the smaller blocks it grew
# through during the first step stay in the allocator's cache (reserved, reused by nothing
# larger), hence the allowance above the plan.
TOLERANCE = 0.05
SLACK_BYTES = 16 << 20


def gpu_or_skip():
    if subprocess.run(["sh", "-c", "command -v nvidia-smi && nvidia-smi -L"], capture_output=True).returncode != 0:
        raise Skip("no GPU (nvidia-smi -L fails)")
    probe = run_single(["train", *tiny_args("--train.device=cuda", "--train.steps=0")[1:]])
    if "make CUDA=1" in probe.stderr:
        raise Skip("this build has no CUDA backend (make CUDA=1)")


def planned(overrides):
    proc = run_single(["plan", "--world-size=1", "--format=lines", *tiny_args(*overrides)[1:]])
    assert proc.returncode == 0, proc.stderr
    want = "yes" if "--fsdp.activation_checkpointing=true" in overrides else "no"
    for line in proc.stdout.splitlines():
        m = re.match(rf"PLAN strategy=NO_SHARD reduce=step checkpointing={want} offload=no peak_bytes=(\d+)", line)
        if m:
            return int(m.group(1))
    raise AssertionError(proc.stdout)


def test_reserved_gpu_memory_is_within_tolerance_of_the_plan():
    gpu_or_skip()
    for extra in ([], ["--fsdp.param_dtype=bf16"], ["--fsdp.activation_checkpointing=true"]):
        overrides = ["--train.device=cuda", "--train.steps=2", "--checkpoint.save=false", *extra]
        metrics = os.path.join(tempdir(), "m.jsonl")
        proc = run(1, tiny_args(*overrides, f"--train.metrics_file={metrics}"), timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        reserved = read_metrics(metrics)[-1]["device_reserved_bytes"]
        plan = planned(overrides)
        assert reserved <= plan * (1 + TOLERANCE) + SLACK_BYTES, (extra, reserved, plan)
        assert reserved >= plan * (1 - TOLERANCE), (extra, reserved, plan)
