#!/usr/bin/env python3
"""`make bench`: the layer benchmarks (Google Benchmark) and the training-throughput benchmark.

Training throughput: gpt2-124M at train.seq_len=64, micro_batch 4, global_batch 16, on
1 rank x 2 threads and on 2 ranks x 1 thread (--bind-to none), STEPS steps each; the first step
(page faults, warm-up) is dropped and min/median/max are taken over the rest. MFU is the
trainer's own: model FLOP/s (6*(non-embedding params + V*C) + 12*L*T*C per token) divided by the
FLOP/s of a 2048^3 OpenBLAS SGEMM that every rank measures at the same moment at start-up (so
for 2 ranks, SGEMM runs on both at once). The machine's OpenBLAS environment is left as it is.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))


def train_run(build, ranks, threads, steps):
    from harness import ensure_data, mpirun_command
    train, _ = ensure_data()
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        args = [os.path.join(build, "shardtrain"), "train", "--config", os.path.join(ROOT, "inputs", "gpt2-124M.ini"),
                "--train.seq_len=64", "--train.micro_batch=4", "--train.global_batch=16", f"--train.steps={steps}",
                f"--train.threads={threads}", f"--data.train_file={train}", "--data.val_file=",
                f"--train.metrics_file={metrics}"]
        proc = subprocess.run(mpirun_command(ranks, args, timeout=1200), cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"benchmark run failed ({ranks} ranks):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        rows = [json.loads(l) for l in open(metrics) if '"kind":"step"' in l][1:]
        peak = float(re.search(r"SGEMM peak ([\d.]+) GFLOP/s", proc.stdout).group(1))
        core = re.search(r"compute: OpenBLAS (\S+)", proc.stdout).group(1)
        return rows, peak, core


def summarize(values):
    return min(values), statistics.median(values), max(values)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", default="build")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--skip-layers", action="store_true")
    args = parser.parse_args()
    build = os.path.abspath(os.path.join(ROOT, args.build))
    os.environ["SHARDTRAIN_BUILD"] = build
    if os.geteuid() == 0:
        os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    if not args.skip_layers:
        print("== layer benchmarks (Google Benchmark, OMP_NUM_THREADS=2)", flush=True)
        env = dict(os.environ, OMP_NUM_THREADS="2")
        subprocess.run([os.path.join(build, "layer_bench"), "--benchmark_min_time=0.2", "--benchmark_color=false"],
                       env=env, check=True)
    print(f"\n== training throughput: gpt2-124M, seq_len 64, micro_batch 4, global_batch 16, {args.steps} steps",
          flush=True)
    results = {}
    for ranks, threads in ((1, 2), (2, 1)):
        rows, peak, core = train_run(build, ranks, threads, args.steps)
        tps = summarize([r["tokens_per_s"] for r in rows])
        mfu = summarize([r["mfu"] for r in rows])
        results[(ranks, threads)] = tps
        print(f"{ranks} rank x {threads} thr | OpenBLAS {core} | SGEMM peak {peak:.1f} GFLOP/s/rank | "
              f"tokens/s min {tps[0]:.1f} median {tps[1]:.1f} max {tps[2]:.1f} | "
              f"MFU min {mfu[0]:.3f} median {mfu[1]:.3f} max {mfu[2]:.3f}", flush=True)
    ratio = results[(2, 1)][1] / results[(1, 2)][1]
    print(f"scaling: 2 ranks x 1 thread / 1 rank x 2 threads, median tokens/s: {ratio:.3f}")


if __name__ == "__main__":
    main()
