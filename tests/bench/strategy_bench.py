#!/usr/bin/env python3
"""Strategy benchmark: sharding strategy x rank count (1, 2, 4) x param dtype (fp32, bf16) on a
4-layer C=256 GPT (seq 64, micro-batch 2, global batch 16), each run twice -- as is, and with
debug.skip_communication=true (collectives move no data) -- and reports per rank: peak memory
(tracked), tokens/s, bytes sent per step against the theoretical volume, and the exposed
communication time = 1 - t(no communication) / t(real), from median step times (steps 2..N).

Theoretical volume per rank per step (elements, Psi = parameters, N ranks in the shard group,
A micro-batches per step), the usual ZeRO accounting: FULL_SHARD / SHARD_GRAD_OP 3 Psi (N-1)/N
per micro-batch (two all-gathers and a reduce-scatter; ZeRO-2 keeps parameters gathered, so
2 Psi (N-1)/N is its own minimum), NO_SHARD (DDP) 2 Psi (N-1)/N per step. Our engine re-gathers
only blocks no longer held, so FULL_SHARD measures below 3 Psi on shallow models.
Draws docs/strategy-memory.png (memory per rank against 1-16 ranks, per strategy) from
`shardtrain plan`, which equals the tracked peak, when matplotlib (python3-matplotlib) is installed.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))

MODEL = ["--model.n_layer=4", "--model.n_embd=256", "--model.n_head=4", "--model.vocab_size=256",
         "--model.max_seq_len=64", "--train.seq_len=64", "--train.micro_batch=2", "--train.global_batch=16"]
STEPS = 5


def run(build, ranks, extra):
    from harness import ensure_data, mpirun_command
    train, _ = ensure_data()
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        args = [os.path.join(build, "shardtrain"), "train", *MODEL, f"--train.steps={STEPS}", "--train.threads=1",
                f"--data.train_file={train}", "--checkpoint.save=false", f"--train.metrics_file={metrics}",
                "--train.peak_gflops=100", *extra]
        proc = subprocess.run(mpirun_command(ranks, args, timeout=600), cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"strategy run failed: {ranks} ranks {extra}\n{proc.stderr[-3000:]}")
        rows = [json.loads(l) for l in open(metrics) if '"kind":"step"' in l][1:]
    return rows


def psi():
    c, layers, v, t = 256, 4, 256, 64
    return v * c + t * c + 2 * c + layers * (12 * c * c + 13 * c)


def theory_bytes(strategy, ranks, accumulation, param_bytes):
    p, n = psi(), ranks
    if n == 1:
        return 0
    if strategy == "NO_SHARD":
        return 4 * 2 * p * (n - 1) / n
    return accumulation * (2 * p * param_bytes + p * 4) * (n - 1) / n


def main():
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("build", nargs="?", default="build")
    parser.add_argument("--strategies", default="FULL_SHARD,SHARD_GRAD_OP,NO_SHARD,HYBRID_SHARD")
    parser.add_argument("--plot-only", action="store_true",
                        help="only draw docs/strategy-memory.png from `shardtrain plan` (equal to the tracked peak)")
    args = parser.parse_args()
    build = os.path.abspath(os.path.join(ROOT, args.build))
    if args.plot_only:
        return plot_planned_memory(build)
    os.environ["SHARDTRAIN_BUILD"] = build
    if os.geteuid() == 0:
        os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    print(f"{'strategy':<14} {'ranks':>5} {'dtype':>5} {'peak MiB/rank':>13} {'tokens/s':>9} {'MB sent/step':>12} "
          f"{'theory MB':>9} {'ratio':>6} {'exposed comm':>12}")
    for strategy in args.strategies.split(","):
        for ranks in (1, 2, 4):
            if strategy == "HYBRID_SHARD" and ranks != 4:
                continue  # with one group it is FULL_SHARD
            for dtype in ("fp32", "bf16"):
                extra = [f"--fsdp.sharding_strategy={strategy}", f"--fsdp.param_dtype={dtype}"]
                if strategy == "HYBRID_SHARD":
                    extra.append("--fsdp.shard_group_size=2")
                real = run(build, ranks, extra)
                silent = run(build, ranks, extra + ["--debug.skip_communication=true"])
                t_real = statistics.median(r["step_seconds"] for r in real)
                t_silent = statistics.median(r["step_seconds"] for r in silent)
                peak = real[-1]["peak_mem_bytes"] / 2**20
                sent = real[-1]["comm_bytes"] / 1e6
                shard_ranks = 2 if strategy == "HYBRID_SHARD" else ranks
                accumulation = 16 // (2 * ranks)
                theory = theory_bytes(strategy if strategy != "HYBRID_SHARD" else "FULL_SHARD", shard_ranks,
                                      accumulation, 2 if dtype == "bf16" else 4) / 1e6
                if strategy == "HYBRID_SHARD":
                    theory += 4 * 2 * (psi() / 2) * (2 - 1) / 2 / 1e6  # replica all-reduce of the shard
                ratio = f"{sent / theory:.2f}" if theory else "-"
                exposed = max(0.0, 1 - t_silent / t_real)
                print(f"{strategy:<14} {ranks:>5} {dtype:>5} {peak:>13.1f} {statistics.median(r['tokens_per_s'] for r in real):>9.0f} "
                      f"{sent:>12.2f} {theory:>9.2f} {ratio:>6} {100 * exposed:>11.0f}%", flush=True)
    try:
        plot_planned_memory(build)  # the plan equals the tracked peaks printed above
    except ImportError:
        print("(matplotlib not installed: apt-get install python3-matplotlib for docs/strategy-memory.png)")


def plot_planned_memory(build):
    """Memory per rank against rank count, per strategy, from the planner: the trainer asserts
    that what it allocates equals this plan (tests/e2e/test_memory.py), so no run is needed."""
    import re
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ranks = [1, 2, 4, 8, 16]
    series = {}
    for n in ranks:
        proc = subprocess.run([os.path.join(build, "shardtrain"), "plan", f"--world-size={n}", "--format=lines", f"--ranks-per-node={min(n, 2)}",
                               *[m for m in MODEL if "global_batch" not in m],
                               f"--train.global_batch={2 * n * max(1, 8 // n)}"],
                              cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        for m in re.finditer(r"PLAN strategy=(\w+) reduce=(\w+) checkpointing=no offload=no peak_bytes=(\d+)", proc.stdout):
            strategy, reduce, peak = m.group(1), m.group(2), int(m.group(3))
            if reduce == "micro" or strategy == "NO_SHARD":
                series.setdefault(strategy, {})[n] = peak / 2**20
    fig, ax = plt.subplots(figsize=(6, 4))
    for strategy, points in series.items():
        xs = sorted(points)
        ax.plot(xs, [points[x] for x in xs], marker="o", label=strategy)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ranks)
    ax.set_xticklabels([str(r) for r in ranks])
    ax.set_xlabel("ranks (HYBRID_SHARD: 2 per shard group)")
    ax.set_ylabel("peak memory per rank (MiB)")
    ax.set_title("4-layer C=256 GPT, fp32, micro-batch 2 x 64 tokens")
    ax.legend()
    ax.grid(alpha=0.3)
    out = os.path.join(ROOT, "docs", "strategy-memory.png")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
