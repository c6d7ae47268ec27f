#!/usr/bin/env python3
"""`make bench`: the layer benchmarks (Google Benchmark), training throughput, checkpoint I/O, architectures.

Training throughput: gpt2-124M at train.seq_len=64, micro_batch 4, global_batch 16, on
1 rank x 2 threads and on 2 ranks x 1 thread (--bind-to none), STEPS steps each; the first step
(page faults, warm-up) is dropped and min/median/max are taken over the rest. MFU is the
trainer's own: model FLOP/s (6*(non-embedding params + V*C) + 12*L*T*C per token) divided by the
FLOP/s of a 2048^3 OpenBLAS SGEMM that every rank measures at the same moment at start-up (so
for 2 ranks, SGEMM runs on both at once). The machine's OpenBLAS environment is left as it is.

Architectures (--only arch): gpt2-124M beside llama-135M at T = 64 and T = 1024 (see arch_section).
FLUX (--only flux): FLUX.1- and FLUX.2-shaped models of GPT-2 small's width beside gpt2-124M (see flux_section).
Llama's variants (--only families): llama-135M's shape as llama, qwen2 (q/k/v biases) and qwen3 (q/k norms)
at T = 256 (see families_section).

Adapters (--only adapters): gpt2-124M and llama-135M (--adapter-models) full fine-tuning against LoRA
(rank 8 and 64 on every linear layer), LoHa, LoKr, OFT and freezing all but the last two blocks, on 1,
2 and 4 ranks (--adapter-cases picks some; see adapter_section).

GEMM libraries (--only gemm, build/gemm_bench): OpenBLAS, BLIS and oneDNN in fp32 and oneDNN in bf16
on every linear layer's three products of gpt2-124M and llama-135M at N = 256, 1024, 4096 rows and a
2048^3 square, 1 and 2 threads, interleaved per repeat; per model, rows and threads the layers are
summed: GFLOP/s = the products' FLOP / the sum of their median times, and each library against OpenBLAS.

CPU bf16 compute (--only bf16): gpt2-124M and llama-135M training at T = 64 (as above) on 1 rank x 2
threads, fp32 and fsdp.param_dtype=bf16 interleaved for --bf16-rounds rounds: tokens/s min/median,
their ratio, MFU against the same-run GEMM and the hardware peak, and the final-step loss difference.

16-bit activations (--only activations): gpt2-124M at T = 64 and T = 1024 (ARCH_SHAPES), 1 rank x 2
threads, fsdp.param_dtype=bf16 with fsdp.activation_dtype fp32 and bf16 interleaved for --arch-rounds
rounds: tokens/s min/median and their ratio, the activations' planned bytes, the final-step loss
difference.

Against another build (--only baseline --baseline DIR [--baseline-dtype bf16]): gpt2-124M at T = 64
and T = 1024 on this build and DIR's (e.g. an older commit built elsewhere), interleaved (see
baseline_section).

A quantized frozen base (--only quant): llama-135M with LoRA r=8 on every linear layer (T = 64,
micro_batch 4, global_batch 16, fsdp.param_dtype=bf16) on a base held fp32 (gathered in bf16), NF4
(also with double quantization) or FP8, 1 rank x 2 threads and 2 ranks x 1 thread, rounds interleaved: tokens/s (median of the
steps after the first, min/median over rounds), the sharded parameters per rank and the bytes sent
per step (see quant_section).
Distillation (--only distill): gpt2-124M alone and distilled from a gpt-300M teacher on 1, 2 and 4
ranks, tokens/s and each model's memory per rank (see distill_section).

Convert (--only convert): a random-weights Hugging Face folder of inputs/llama-1.1B.ini's shape (F32,
4.4 GB; numpy, tensor by tensor) converted to a sharded checkpoint and back (`shardtrain convert`), and
the same checkpoint exported (`export --format hf`), on 1 and 2 ranks (--convert-ranks), --convert-repeats
times, in a folder under the build folder; the disk's write and read speed measured before each repeat
(1 GiB of random bytes, write + fsync, then a cold read). Every input's page cache is dropped
(posix_fadvise DONTNEED) before it is read. MB/s: 10^6 bytes of model (the F32 tensors) per second of
the command's wall time (MPI start-up included); ratio: against the same repeat's disk write speed,
min/median. Memory: each rank's RssAnon sampled every 20 ms from /proc/<pid>/status, the peak over the
run, max over ranks and repeats, against the rank's parameter shard + 256 MiB. The round trip's
model.safetensors must equal the input byte for byte.

Checkpoint I/O (build/ckpt_bench, see tests/bench/ckpt_bench.cpp): a gpt2-124M checkpoint (params,
exp_avg, exp_avg_sq: 3 x 124.4M fp32 = 1493 MB of tensor data) saved and loaded on 1, 2 and 4 ranks
(threads per rank as the trainer picks them: cores / ranks) in both layouts, after one warm-up
repeat, CKPT_REPEATS times each, in a temporary folder under the build folder (not /tmp, which may
be tmpfs). Each repeat first measures the disk itself on one rank (the others sleep): a plain file
of the same size written with 16 MiB write() calls + fsync, then read back sequentially. Every
timed write and read starts right after a page-cache drop (reads are cold; if the drop is not
permitted the table says "warm cache"). The save includes the fsync of the file, as the checkpoint
manager does it. MB/s is 10^6 bytes of tensor data per second. Ratios are per repeat (checkpoint
MB/s / disk MB/s of the same repeat), min/median. Save memory: the growth of each rank's peak RSS
during the save (clear_refs + VmHWM), max over ranks and repeats (warm-up included), against the
64 MiB target.
"""
import argparse
import json
import shutil
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))


def train_run(build, ranks, threads, steps, config="gpt2-124M.ini", seq_len=64, micro_batch=4, global_batch=16,
              extra=(), stdout=None):
    from harness import ensure_data, mpirun_command
    train, _ = ensure_data()
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        args = [os.path.join(build, "shardtrain"), "train", "--config", os.path.join(ROOT, "inputs", config),
                f"--train.seq_len={seq_len}", "--checkpoint.save=false", "--checkpoint.resume=none",
                f"--train.micro_batch={micro_batch}", f"--train.global_batch={global_batch}", f"--train.steps={steps}",
                f"--train.threads={threads}", f"--data.train_file={train}", "--data.val_file=",
                f"--train.metrics_file={metrics}", *extra]
        proc = subprocess.run(mpirun_command(ranks, args, timeout=1200), cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"benchmark run failed ({ranks} ranks):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        if stdout is not None:
            stdout.append(proc.stdout)
        rows = [json.loads(l) for l in open(metrics) if '"kind":"step"' in l][1:]
        peak = float(re.search(r"GEMM peak ([\d.]+) GFLOP/s", proc.stdout).group(1))
        core = re.search(r"\| OpenBLAS (\S+)", proc.stdout).group(1)
        return rows, peak, core


CKPT_RANKS = (1, 2, 4)
CKPT_LAYOUTS = ("sharded", "gathered")
CKPT_GROWTH_TARGET_MIB = 64.0
CKPT_RATIO_TARGET = 0.7


def filesystem_of(path):
    """'source type mounted-on' of the filesystem holding path (df), or a best effort."""
    proc = subprocess.run(["df", "--output=source,fstype,target", path], capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    return " ".join(lines[-1].split()) if proc.returncode == 0 and len(lines) > 1 else "unknown"


def ckpt_run(build, ranks, layout, repeats, tmp, profile=False):
    from harness import mpirun_command
    args = [os.path.join(build, "ckpt_bench"), "--layout", layout, "--dir", tmp, "--repeats", str(repeats),
            "--warmup", "1"] + (["--profile", "1"] if profile else [])
    proc = subprocess.run(mpirun_command(ranks, args, timeout=600 + 300 * repeats), cwd=ROOT, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        sys.exit(f"checkpoint benchmark failed ({layout}, {ranks} ranks):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows, warmup = [], []
    for line in proc.stdout.splitlines():
        if line.startswith(("RESULT ", "WARMUP ")):
            row = {k: v for k, v in (f.split("=", 1) for f in line.split()[1:] if "=" in f)}
            (rows if line.startswith("RESULT ") else warmup).append(row)
    if len(rows) != repeats:
        sys.exit(f"checkpoint benchmark printed {len(rows)} RESULT lines, expected {repeats}:\n{proc.stdout}")
    return rows, warmup


def ckpt_section(build, repeats, profile=False):
    tmp = tempfile.mkdtemp(prefix="ckpt-bench-", dir=build)
    try:
        print(f"\n== checkpoint I/O: gpt2-124M, 1 warm-up + {repeats} repeats per row, folder {tmp}", flush=True)
        print(f"filesystem: {filesystem_of(tmp)}", flush=True)
        columns = [("layout", "<9"), ("ranks", ">5"), ("thr", ">3"), ("save MB/s", ">9"), ("disk wr MB/s", ">12"),
                   ("ratio min/med", ">13"), ("load MB/s", ">9"), ("cold rd MB/s", ">12"), ("ratio min/med", ">13"),
                   ("save growth MiB", ">15"), ("shard MiB", ">9")]
        print(" | ".join(f"{name:{fmt}}" for name, fmt in columns), flush=True)
        cold_all = True
        for layout in CKPT_LAYOUTS:
            for ranks in CKPT_RANKS:
                rows, warmup = ckpt_run(build, ranks, layout, repeats, tmp, profile)
                mb = [int(r["bytes"]) / 1e6 for r in rows]
                save = [m / float(r["save_s"]) for m, r in zip(mb, rows)]
                write = [m / float(r["disk_write_s"]) for m, r in zip(mb, rows)]
                load = [m / float(r["load_s"]) for m, r in zip(mb, rows)]
                read = [m / float(r["disk_read_s"]) for m, r in zip(mb, rows)]
                wr_ratio = [a / b for a, b in zip(save, write)]
                rd_ratio = [a / b for a, b in zip(load, read)]
                growth = max(float(r["save_growth_mib_max"]) for r in rows + warmup)
                cold = all(r["cold"] == "1" for r in rows)
                cold_all = cold_all and cold
                med = statistics.median
                cells = [layout, ranks, rows[0]["threads"], f"{med(save):.0f}", f"{med(write):.0f}",
                         f"{min(wr_ratio):.2f}/{med(wr_ratio):.2f}" + (" " if med(wr_ratio) >= CKPT_RATIO_TARGET else "*"),
                         f"{med(load):.0f}", f"{med(read):.0f}", f"{min(rd_ratio):.2f}/{med(rd_ratio):.2f} ",
                         f"{growth:.1f} " + ("ok" if growth <= CKPT_GROWTH_TARGET_MIB else "OVER"),
                         f"{float(rows[0]['shard_mib']):.0f}"]
                line = " | ".join(f"{str(c):{fmt}}" for c, (_, fmt) in zip(cells, columns))
                print(line + ("" if cold else "  (warm cache)"), flush=True)
                if profile:  # the same bytes without HDF5 (see ckpt_bench.cpp), medians
                    coll = med([m / float(r["mpiio_coll_s"]) for m, r in zip(mb, rows)])
                    indep = med([m / float(r["mpiio_indep_s"]) for m, r in zip(mb, rows)])
                    print(f"{'':<9}   profile: save {med(float(r['save_s']) for r in rows):.2f} s, of which checksums "
                          f"{med(float(r['checksum_s_max']) for r in rows):.2f} s; MPI-IO alone, one call per "
                          f"dataset: collective {coll:.0f} MB/s, independent {indep:.0f} MB/s", flush=True)
        print(f"targets: save >= {CKPT_RATIO_TARGET} x the disk's write speed (* = median below); save growth "
              f"<= {CKPT_GROWTH_TARGET_MIB:.0f} MiB (max over ranks and repeats, warm-up included)")
        print("reads: " + ("cold (page cache dropped before each timed read and write)" if cold_all else
                           "WARM CACHE in rows marked so: /proc/sys/vm/drop_caches was not writable"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

def summarize(values):
    return min(values), statistics.median(values), max(values)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", default="build")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--ckpt-repeats", type=int, default=3)
    parser.add_argument("--ckpt-profile", action="store_true",
                        help="also time the checksums and the same bytes through MPI-IO alone")
    parser.add_argument("--only", choices=("layers", "train", "ckpt", "arch", "families", "flux", "adapters", "distill",
                                           "gemm",
                                           "bf16", "quant",
                                           "activations",
                                           "convert", "baseline"),
                        help="run one section only")
    parser.add_argument("--arch-rounds", type=int, default=2)
    parser.add_argument("--baseline", default="",
                        help="baseline section: another build folder (e.g. of an older commit) to time against this one")
    parser.add_argument("--baseline-dtype", default="fp32", choices=("fp32", "bf16"),
                        help="baseline section: fsdp.param_dtype of both builds' runs")
    parser.add_argument("--adapter-models", default="gpt2,llama", help="adapters section: gpt2, llama or both")
    parser.add_argument("--adapter-cases", default="",
                        help="adapters section: comma-separated case names to run besides full fine-tuning "
                             "(e.g. 'LoHa r=8,OFT b=32'); empty = all")
    parser.add_argument("--skip-layers", action="store_true")
    parser.add_argument("--bf16-rounds", type=int, default=3)
    parser.add_argument("--gemm-repeats", type=int, default=5)
    parser.add_argument("--gemm-quick", action="store_true", help="gemm section without the LM heads")
    parser.add_argument("--convert-ranks", default="1,2", help="convert section: rank counts, comma-separated")
    parser.add_argument("--convert-repeats", type=int, default=2)
    parser.add_argument("--convert-export", action=argparse.BooleanOptionalAction, default=True,
                        help="convert section: also time export --format hf of the checkpoint")
    args = parser.parse_args()
    build = os.path.abspath(os.path.join(ROOT, args.build))
    os.environ["SHARDTRAIN_BUILD"] = build
    if os.geteuid() == 0:
        os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    sections = [args.only] if args.only else ["train", "ckpt", "arch", "families", "flux", "adapters", "quant",
                                              "distill", "gemm", "bf16"]
    if not args.only and not args.skip_layers:
        sections.insert(0, "layers")
    if "layers" in sections:
        print("== layer benchmarks (Google Benchmark, OMP_NUM_THREADS=2)", flush=True)
        env = dict(os.environ, OMP_NUM_THREADS="2")
        subprocess.run([os.path.join(build, "layer_bench"), "--benchmark_min_time=0.2", "--benchmark_color=false"],
                       env=env, check=True)
    if "train" in sections:
        train_section(build, args.steps)
    if "ckpt" in sections:
        ckpt_section(build, args.ckpt_repeats, args.ckpt_profile)
    if "arch" in sections:
        arch_section(build, args.steps, args.arch_rounds)
    if "families" in sections:
        families_section(build, args.steps, args.arch_rounds)
    if "adapters" in sections:
        adapter_section(build, args.steps, args.adapter_models.split(","),
                        [c for c in args.adapter_cases.split(",") if c])
    if "flux" in sections:
        flux_section(build, args.steps, args.arch_rounds)
    if "quant" in sections:
        quant_section(build, args.steps, args.arch_rounds)
    if "distill" in sections:
        distill_section(build, args.steps)
    if "gemm" in sections:
        gemm_section(build, args.gemm_repeats, args.gemm_quick)
    if "bf16" in sections:
        bf16_section(build, args.steps, args.bf16_rounds)
    if "activations" in sections:
        activations_section(build, args.steps, args.arch_rounds)
    if "baseline" in sections:
        if not args.baseline:
            sys.exit("--only baseline needs --baseline DIR, the build folder to compare with")
        baseline_section(build, os.path.abspath(args.baseline), args.steps, args.arch_rounds, args.baseline_dtype)
    if "convert" in sections:
        convert_section(build, [int(r) for r in args.convert_ranks.split(",")], args.convert_repeats,
                        args.convert_export)


GEMM_LIBS = ("openblas", "blis", "onednn-f32", "onednn-bf16")


def gemm_section(build, repeats, quick):
    print(f"\n== GEMM libraries: build/gemm_bench --repeats {repeats} (median GFLOP/s, layers summed by time)",
          flush=True)
    # --quick leaves out the LM heads (the largest products: half an hour more on 2 shared cores).
    proc = subprocess.run([os.path.join(build, "gemm_bench"), "--repeats", str(repeats)] + (["--quick"] if quick else []),
                          capture_output=True, text=True, check=True)
    print(proc.stdout, flush=True)
    print(proc.stdout.splitlines()[0])
    groups = {}  # (model, rows, threads) -> [flop, seconds per library]
    for line in proc.stdout.splitlines():
        m = re.match(r"(\S+) (\S+) N=(\d+) \S+ \((\d+)x(\d+)x(\d+)\)\s+(\d+) \|(.*)", line)
        square = re.match(r"square 2048\^3\s+(\d+) \|(.*)", line)
        if not m and not square:
            continue
        if m:
            key, flop = (m.group(1), int(m.group(3)), int(m.group(7))), 2.0 * int(m.group(4)) * int(m.group(5)) * int(m.group(6))
            cells = m.group(8)
        else:
            key, flop, cells = ("square 2048^3", 2048, int(square.group(1))), 2.0 * 2048 ** 3, square.group(2)
        medians = [float(x) for x in re.findall(r"\S+ [\d.]+/([\d.]+)", cells)]
        g = groups.setdefault(key, [0.0, [0.0] * len(medians)])  # no onednn-bf16 on a CPU without AVX-512
        g[0] += flop
        for i, gflops in enumerate(medians):
            g[1][i] += flop / (gflops * 1e9)
    libraries = GEMM_LIBS[:max((len(g[1]) for g in groups.values()), default=0)]
    print(f"{'shape':<14} {'N':>5} {'thr':>3} | " + " | ".join(f"{lib:>17}" for lib in libraries))
    for (model, rows, threads), (flop, seconds) in sorted(groups.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1])):
        rates = [flop / s / 1e9 for s in seconds]
        print(f"{model:<14} {rows:>5} {threads:>3} | " +
              " | ".join(f"{r:7.1f} ({r / rates[0]:.2f}x)" for r in rates), flush=True)


def bf16_section(build, steps, rounds):
    print(f"\n== CPU bf16 compute: 1 rank x 2 threads, T = 64, micro_batch 4, global_batch 16, {rounds} rounds of "
          f"{steps} steps, fp32 and bf16 interleaved (first step of each run dropped)", flush=True)
    # "bf16 every gather": the masters rounded at every gather (fsdp.keep_half_shard=false), the
    # default before the shard's 16-bit copy was kept.
    variants = {"fp32": ["--fsdp.param_dtype=fp32"], "bf16": ["--fsdp.param_dtype=bf16"],
                "bf16 every gather": ["--fsdp.param_dtype=bf16", "--fsdp.keep_half_shard=false"]}
    for config in ARCH_CONFIGS:
        runs = {name: [] for name in variants}
        for _ in range(rounds):
            for dtype in runs:
                out = []
                rows, peak, _ = train_run(build, 1, 2, steps, config, extra=variants[dtype], stdout=out)
                runs[dtype].append((rows, peak))
        tps = {d: summarize([r["tokens_per_s"] for rows, _ in v for r in rows]) for d, v in runs.items()}
        for dtype, v in runs.items():
            mfu = summarize([r["mfu"] for rows, _ in v for r in rows])
            hw = summarize([r["hardware_mfu"] for rows, _ in v for r in rows])
            peaks = summarize([p for _, p in v])
            print(f"{config:16s} {dtype} | tokens/s min {tps[dtype][0]:.1f} median {tps[dtype][1]:.1f} | GEMM peak "
                  f"median {peaks[1]:.1f} GFLOP/s | MFU median {mfu[1]:.3f} | hardware MFU median {hw[1]:.3f}",
                  flush=True)
        loss = [abs(a[-1]["loss"] - b[-1]["loss"]) / a[-1]["loss"] for (a, _), (b, _) in zip(runs["fp32"], runs["bf16"])]
        print(f"{config:16s} bf16 / fp32 median tokens/s: {tps['bf16'][1] / tps['fp32'][1]:.2f} (rounding at every "
              f"gather: {tps['bf16 every gather'][1] / tps['fp32'][1]:.2f}) | final loss relative difference max "
              f"{max(loss):.2e}", flush=True)


def activations_section(build, steps, rounds):
    print(f"\n== 16-bit activations: gpt2-124M, fsdp.param_dtype=bf16, 1 rank x 2 threads, {rounds} rounds of "
          f"{steps} steps, fsdp.activation_dtype fp32 and bf16 interleaved (first step of each run dropped)", flush=True)
    for seq_len, micro, global_batch in ARCH_SHAPES:
        runs = {"fp32": [], "bf16": []}
        for _ in range(rounds):
            for dtype in runs:
                rows, _, _ = train_run(build, 1, 2, steps, "gpt2-124M.ini", seq_len, micro, global_batch,
                                       extra=["--fsdp.param_dtype=bf16", f"--fsdp.activation_dtype={dtype}"])
                runs[dtype].append(rows)
        tps = {d: summarize([r["tokens_per_s"] for rows in v for r in rows]) for d, v in runs.items()}
        for dtype, v in runs.items():
            activations = v[0][-1]["peak_mem"]["activations"]
            print(f"T={seq_len:5d} activations {dtype} | tokens/s min {tps[dtype][0]:.1f} median {tps[dtype][1]:.1f} | "
                  f"activations {activations / 2**20:.1f} MiB", flush=True)
        loss = [abs(a[-1]["loss"] - b[-1]["loss"]) / a[-1]["loss"] for a, b in zip(runs["fp32"], runs["bf16"])]
        print(f"T={seq_len:5d} bf16 / fp32 activations median tokens/s: {tps['bf16'][1] / tps['fp32'][1]:.2f} | final "
              f"loss relative difference max {max(loss):.2e}", flush=True)


def train_section(build, steps):
    print(f"\n== training throughput: gpt2-124M, seq_len 64, micro_batch 4, global_batch 16, {steps} steps",
          flush=True)
    results = {}
    for ranks, threads in ((1, 2), (2, 1)):
        rows, peak, core = train_run(build, ranks, threads, steps)
        tps = summarize([r["tokens_per_s"] for r in rows])
        mfu = summarize([r["mfu"] for r in rows])
        results[(ranks, threads)] = tps
        print(f"{ranks} rank x {threads} thr | OpenBLAS {core} | SGEMM peak {peak:.1f} GFLOP/s/rank | "
              f"tokens/s min {tps[0]:.1f} median {tps[1]:.1f} max {tps[2]:.1f} | "
              f"MFU min {mfu[0]:.3f} median {mfu[1]:.3f} max {mfu[2]:.3f}", flush=True)
    ratio = results[(2, 1)][1] / results[(1, 2)][1]
    print(f"scaling: 2 ranks x 1 thread / 1 rank x 2 threads, median tokens/s: {ratio:.3f}")

# (seq_len, micro_batch, global_batch): about 1k tokens per micro-batch at T = 64, one sequence at T = 1024.
ARCH_SHAPES = ((64, 4, 16), (1024, 1, 1))
ARCH_CONFIGS = ("gpt2-124M.ini", "llama-135M.ini")


def arch_section(build, steps, rounds):
    """gpt2-124M beside llama-135M (SmolLM-135M's shape) on 1 rank x 2 threads, interleaved: each round
    runs both models at each sequence length, so the two see the same machine load."""
    print(f"\n== architectures: {', '.join(ARCH_CONFIGS)}, 1 rank x 2 threads, {rounds} rounds of {steps} steps "
          "(first step of each run dropped)", flush=True)
    rows = {}
    for _ in range(rounds):
        for seq_len, micro, global_batch in ARCH_SHAPES:
            for config in ARCH_CONFIGS:
                run_rows, peak, _ = train_run(build, 1, 2, steps, config, seq_len, micro, global_batch)
                rows.setdefault((config, seq_len), []).extend((r, peak) for r in run_rows)
    for seq_len, _, _ in ARCH_SHAPES:
        medians = {}
        for config in ARCH_CONFIGS:
            data = rows[(config, seq_len)]
            tps = summarize([r["tokens_per_s"] for r, _ in data])
            mfu = summarize([r["mfu"] for r, _ in data])
            peaks = summarize([p for _, p in data])
            medians[config] = mfu[1]
            print(f"T={seq_len:5d} {config:16s} | SGEMM peak median {peaks[1]:.1f} GFLOP/s | tokens/s min {tps[0]:.1f} "
                  f"median {tps[1]:.1f} max {tps[2]:.1f} | MFU min {mfu[0]:.3f} median {mfu[1]:.3f} max {mfu[2]:.3f}",
                  flush=True)
        print(f"T={seq_len:5d} MFU llama / gpt2 (medians): {medians[ARCH_CONFIGS[1]] / medians[ARCH_CONFIGS[0]]:.3f}",
              flush=True)


FAMILY_ARCHS = ("llama", "qwen2", "qwen3")


def families_section(build, steps, rounds):
    """llama-135M's shape (SmolLM-135M: heads of 64) built as each of Llama's variants -- the same
    GEMMs, so what differs is a variant's own work: Qwen2's biases added to q|k|v, Qwen3's RMSNorm of
    each query and key head and its row copies -- on 1 rank x 2 threads at T = 256, micro-batch 4,
    interleaved in each round; tokens/s against llama's (medians) and the activations each plans."""
    print(f"\n== Llama's variants at llama-135M's shape: {', '.join(FAMILY_ARCHS)}, 1 rank x 2 threads, T = 256, "
          f"{rounds} rounds of {steps} steps (first step of each run dropped)", flush=True)
    rows = {}
    for _ in range(rounds):
        for arch in FAMILY_ARCHS:
            run_rows, _, _ = train_run(build, 1, 2, steps, "llama-135M.ini", 256, 4, 4, [f"--model.arch={arch}"])
            rows.setdefault(arch, []).extend(run_rows)
    medians = {}
    for arch in FAMILY_ARCHS:
        tps = summarize([r["tokens_per_s"] for r in rows[arch]])
        medians[arch] = tps[1]
        activations = rows[arch][-1]["peak_mem"]["activations"]
        print(f"{arch:6s} | tokens/s min {tps[0]:.1f} median {tps[1]:.1f} max {tps[2]:.1f} | "
              f"{tps[1] / medians['llama']:.3f} of llama | activations {activations} B", flush=True)


# A FLUX-shaped model of GPT-2 small's width (C = 768: 6 heads of 128, rotary axes 16,56,56) with
# 2 double- and 4 single-stream blocks (132 C^2 of block weights, GPT-2 small's 12 blocks have 144),
# 256 image tokens (a 16 x 16 packed grid: 512 x 512 pixels), 64 text tokens of 768, pooled 768.
FLUX_BENCH = ["--model.n_layer=2", "--model.n_single_layer=4", "--model.n_embd=768", "--model.n_head=6",
              "--model.max_seq_len=256", "--model.in_channels=64", "--model.context_dim=768", "--model.context_len=64",
              "--model.pooled_dim=768", "--model.rope_axes=16,56,56", "--train.seq_len=256"]
# And FLUX.2's at the same width and block counts: SwiGLU MLPs 3 C wide, shared modulations, no
# biases, no pooled vector, four rotary axes of 32 (104 C^2 of block weights).
FLUX2_BENCH = ["--model.n_layer=2", "--model.n_single_layer=4", "--model.n_embd=768", "--model.n_head=6",
               "--model.intermediate_size=2304", "--model.max_seq_len=256", "--model.in_channels=64",
               "--model.context_dim=768", "--model.context_len=64", "--model.pooled_dim=0",
               "--model.rope_axes=32,32,32,32", "--train.seq_len=256"]


def flux_latents(folder, records=16, rows=16, cols=16, channels=64, text=(64, 768), pooled=768):
    import h5py
    import numpy as np
    path = os.path.join(folder, "latents.h5")
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f["latents"] = rng.standard_normal((records, rows * cols, channels)).astype(np.float32)
        f["encoder_hidden_states"] = rng.standard_normal((records,) + text).astype(np.float32)
        f["pooled_projections"] = rng.standard_normal((records, pooled)).astype(np.float32)
        f.attrs["grid_rows"], f.attrs["grid_cols"] = np.int64(rows), np.int64(cols)
    return path


def flux_run(build, steps, latents, micro_batch=1, global_batch=4, flux2=False, extra=()):
    from harness import mpirun_command
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        config = os.path.join(ROOT, "inputs", "flux2-tiny.ini" if flux2 else "flux-tiny.ini")
        args = [os.path.join(build, "shardtrain"), "train", "--config", config, *(FLUX2_BENCH if flux2 else FLUX_BENCH), "--checkpoint.save=false", "--checkpoint.resume=none", f"--train.steps={steps}",
                f"--train.micro_batch={micro_batch}", f"--train.global_batch={global_batch}", "--train.threads=2",
                f"--data.train_file={latents}", "--data.val_file=", f"--train.metrics_file={metrics}", *extra]
        proc = subprocess.run(mpirun_command(1, args, timeout=1200), cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"flux benchmark run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        rows = [json.loads(l) for l in open(metrics) if '"kind":"step"' in l][1:]
        peak = float(re.search(r"GEMM peak ([\d.]+) GFLOP/s", proc.stdout).group(1))
        flops = float(re.search(r"\| ([\d.]+) MFLOP per token", proc.stdout).group(1)) * 1e6
        return rows, peak, flops


def flux_section(build, steps, rounds):
    """The FLUX.1- and FLUX.2-shaped models (FLUX_BENCH, FLUX2_BENCH) beside gpt2-124M at T = 320 (their
    joint sequence: 256 image + 64 text tokens), 1 rank x 2 threads, interleaved rounds; MFU against
    each run's SGEMM peak, and the achieved GFLOP/s (tokens/s x the model's FLOPs per token: for
    FLUX, per image token). And FLUX.1's with its activations in bf16 (fsdp.activation_dtype,
    fp32 parameters): what rounding and widening them costs; FLUX.2's with activation
    checkpointing: what recomputing each block's forward costs, and recomputing only the first 3 of
    its 6 blocks (fsdp.checkpoint_blocks) half of that (MFU counts the model's FLOPs, not the
    recompute's)."""
    print(f"\n== FLUX beside GPT-2: {rounds} rounds of {steps} steps, 1 rank x 2 threads (first step dropped)",
          flush=True)
    rows = {"flux": [], "flux-bf16-activations": [], "flux2": [], "flux2-checkpointing": [],
            "flux2-recompute-half": [], "gpt2": []}
    with tempfile.TemporaryDirectory() as tmp:
        latents = flux_latents(tmp)
        for _ in range(rounds):
            r, peak, flops = flux_run(build, steps, latents)
            rows["flux"].extend((x, peak, flops) for x in r)
            r, peak, flops = flux_run(build, steps, latents, extra=["--fsdp.activation_dtype=bf16"])
            rows["flux-bf16-activations"].extend((x, peak, flops) for x in r)
            r, peak, flops = flux_run(build, steps, latents, flux2=True)
            rows["flux2"].extend((x, peak, flops) for x in r)
            r, peak, flops = flux_run(build, steps, latents, flux2=True, extra=["--fsdp.activation_checkpointing=true"])
            rows["flux2-checkpointing"].extend((x, peak, flops) for x in r)
            r, peak, flops = flux_run(build, steps, latents, flux2=True, extra=["--fsdp.activation_checkpointing=true",
                                                                                "--fsdp.checkpoint_blocks=3"])
            rows["flux2-recompute-half"].extend((x, peak, flops) for x in r)
            r, peak, out = [], 0, []
            run_rows, peak, _ = train_run(build, 1, 2, steps, "gpt2-124M.ini", 320, 1, 4, stdout=out)
            flops = float(re.search(r"\| ([\d.]+) MFLOP per token", out[0]).group(1)) * 1e6
            rows["gpt2"].extend((x, peak, flops) for x in run_rows)
    medians = {}
    for name, data in rows.items():
        tps = summarize([r["tokens_per_s"] for r, _, _ in data])
        mfu = summarize([r["mfu"] for r, _, _ in data])
        gflops = statistics.median(r["tokens_per_s"] * f / 1e9 for r, _, f in data)
        medians[name] = (mfu[1], gflops)
        print(f"{name:21s} | SGEMM peak median {statistics.median(p for _, p, _ in data):.1f} GFLOP/s | "
              f"{data[0][2] / 1e6:.1f} MFLOP per token | tokens/s min {tps[0]:.1f} median {tps[1]:.1f} max {tps[2]:.1f} | "
              f"MFU min {mfu[0]:.3f} median {mfu[1]:.3f} max {mfu[2]:.3f} | GFLOP/s median {gflops:.1f}", flush=True)
    print(f"flux-bf16-activations / flux (medians): MFU {medians['flux-bf16-activations'][0] / medians['flux'][0]:.3f}", flush=True)
    for name in ("flux2-checkpointing", "flux2-recompute-half"):
        print(f"{name} / flux2 (medians): MFU {medians[name][0] / medians['flux2'][0]:.3f}", flush=True)
    for name in ("flux", "flux2"):
        print(f"{name} / gpt2 (medians): MFU {medians[name][0] / medians['gpt2'][0]:.3f}, "
              f"GFLOP/s {medians[name][1] / medians['gpt2'][1]:.3f}", flush=True)


def baseline_section(build, baseline, steps, rounds, dtype="fp32"):
    """gpt2-124M at T = 64 and T = 1024 (ARCH_SHAPES) on this build and on a baseline build (another
    commit's), 1 rank x 2 threads, fsdp.param_dtype `dtype`, interleaved: each round runs both builds
    at each shape, so they see the same machine load. MFU is each run's own (against its start-up
    GEMM peak)."""
    print(f"\n== this build against {baseline}: gpt2-124M {dtype}, 1 rank x 2 threads, {rounds} rounds of {steps} "
          "steps (first step of each run dropped)", flush=True)
    rows = {}
    for _ in range(rounds):
        for seq_len, micro, global_batch in ARCH_SHAPES:
            for name, folder in (("baseline", baseline), ("this build", build)):
                run_rows, _, _ = train_run(folder, 1, 2, steps, "gpt2-124M.ini", seq_len, micro, global_batch,
                                           extra=[f"--fsdp.param_dtype={dtype}"])
                rows.setdefault((name, seq_len), []).extend(run_rows)
    for seq_len, _, _ in ARCH_SHAPES:
        medians = {}
        for name in ("baseline", "this build"):
            tps = summarize([r["tokens_per_s"] for r in rows[(name, seq_len)]])
            mfu = summarize([r["mfu"] for r in rows[(name, seq_len)]])
            medians[name] = tps[1]
            print(f"T={seq_len:5d} {name:10s} | tokens/s min {tps[0]:.1f} median {tps[1]:.1f} max {tps[2]:.1f} | "
                  f"MFU min {mfu[0]:.3f} median {mfu[1]:.3f}", flush=True)
        print(f"T={seq_len:5d} tokens/s this build / baseline (medians): "
              f"{medians['this build'] / medians['baseline']:.3f}", flush=True)


def adapter_cases(all_linear, all_but_last_two):
    return (("full fine-tuning", ()),
            ("LoRA r=8", ("--adapter.type=lora", f"--adapter.targets={all_linear}", "--adapter.rank=8")),
            ("LoRA r=64", ("--adapter.type=lora", f"--adapter.targets={all_linear}", "--adapter.rank=64")),
            ("last 2 blocks", (f"--train.freeze={all_but_last_two}",)),
            ("LoHa r=8", ("--adapter.type=loha", f"--adapter.targets={all_linear}", "--adapter.rank=8")),
            ("LoKr r=8", ("--adapter.type=lokr", f"--adapter.targets={all_linear}", "--adapter.rank=8")),
            ("OFT b=32", ("--adapter.type=oft", f"--adapter.targets={all_linear}", "--adapter.block_size=32")))


# Per model: every linear layer adapted; frozen: the embeddings and all blocks but the last two.
ADAPTER_MODELS = {
    "gpt2": ("gpt2-124M.ini", adapter_cases("attn.c_attn,attn.c_proj,mlp.c_fc,mlp.c_proj", "wte,wpe,h.[0-9].*")),
    "llama": ("llama-135M.ini", adapter_cases("q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                                              "embed_tokens.weight,layers.?.*,layers.1?.*,layers.2[0-7].*")),
}
MEMORY_COLUMNS = ("sharded_params", "gathered_units", "gradients", "optimizer_state", "activations", "comm_buffers")


def adapter_section(build, steps, models, only_cases):
    """gpt2-124M or llama-135M (T = 64, micro_batch 4, global_batch 16) trained in full, with LoRA,
    LoHa, LoKr and OFT on every linear layer and with all but the last two blocks frozen, FULL_SHARD on 1 rank x 2 threads, 2 ranks x 1 thread and 4
    ranks x 1 thread (oversubscribed on 2 cores: its tokens/s say little, its memory is exact). Each
    rank count runs the four cases back to back; tokens/s are medians over the steps after the
    first, and the ratio to full fine-tuning is taken within the rank count. Memory is the trainer's
    own count of one rank's bytes by category (what it allocated; held = planned)."""
    for model in models:
        config, cases = ADAPTER_MODELS[model]
        cases = [c for c in cases if not only_cases or c[0] in only_cases or c[0] == "full fine-tuning"]
        print(f"\n== adapters: {config}, seq_len 64, micro_batch 4, global_batch 16, {steps} steps, FULL_SHARD",
              flush=True)
        print("ranks | case | tokens/s median | / full | MiB per rank: " + " ".join(MEMORY_COLUMNS) + " total",
              flush=True)
        adapter_model_runs(build, steps, config, cases)


def adapter_model_runs(build, steps, config, cases):
    for ranks, threads in ((1, 2), (2, 1), (4, 1)):
        full = None
        for name, extra in cases:
            rows, _, _ = train_run(build, ranks, threads, steps, config=config, extra=extra)
            tps = summarize([r["tokens_per_s"] for r in rows])[1]
            full = full or tps
            mem = rows[-1]["peak_mem"]
            mib = [mem[c] / 2**20 for c in MEMORY_COLUMNS]
            print(f"{ranks} x {threads} | {name:16s} | {tps:8.1f} | {tps / full:5.2f} | " +
                  " ".join(f"{m:7.1f}" for m in mib) + f" {sum(mib):8.1f}", flush=True)


QUANT_FORMATS = {"fp32": ("--fsdp.frozen_dtype=fp32",), "nf4": ("--fsdp.frozen_dtype=nf4",),
                 "nf4+dq": ("--fsdp.frozen_dtype=nf4", "--fsdp.double_quant=true"), "fp8": ("--fsdp.frozen_dtype=fp8",)}


def quant_section(build, steps, rounds):
    """LoRA on llama-135M's base held in each fsdp.frozen_dtype (docs/quantization.md), the GEMMs in
    bf16-rounded weights either way (fsdp.param_dtype=bf16: the fp32 base is LoRA on a bf16 base as
    far as compute goes). Per rank count the formats run interleaved, `rounds` times; tokens/s is
    the median over a run's steps after the first, reported min/median over rounds and as a ratio to
    the fp32 base's median in the same rank count. Bytes are one rank's (held = planned)."""
    config, cases = ADAPTER_MODELS["llama"]
    lora = dict(cases)["LoRA r=8"]
    print(f"\n== quantized base: {config} + LoRA r=8 on every linear layer, seq_len 64, micro_batch 4, "
          f"global_batch 16, {steps} steps, fsdp.param_dtype=bf16, {rounds} rounds", flush=True)
    print("ranks | frozen_dtype | tokens/s min / median | / fp32 | sharded_params MiB | comm MiB/step | "
          "full checkpoint MiB, save s min / median", flush=True)
    for ranks, threads in ((1, 2), (2, 1)):
        runs = {f: [] for f in QUANT_FORMATS}
        saves = {f: [] for f in QUANT_FORMATS}
        for _ in range(rounds):
            for fmt in QUANT_FORMATS:
                with tempfile.TemporaryDirectory(dir=ROOT) as ckpt:  # the final step's full checkpoint
                    out = []
                    rows, _, _ = train_run(build, ranks, threads, steps, config=config, stdout=out,
                                           extra=(*lora, "--fsdp.param_dtype=bf16", *QUANT_FORMATS[fmt],
                                                  "--checkpoint.save=true", f"--checkpoint.dir={ckpt}"))
                    saved = re.search(r"saved (\S+) \(sharded, ([\d.]+) s\)", out[0])
                    saves[fmt].append((os.path.getsize(saved.group(1)), float(saved.group(2))))
                runs[fmt].append((summarize([r["tokens_per_s"] for r in rows])[1], rows[-1]))
        base = statistics.median(t for t, _ in runs["fp32"])
        for fmt in QUANT_FORMATS:
            tps = [t for t, _ in runs[fmt]]
            last = runs[fmt][-1][1]
            seconds = [t for _, t in saves[fmt]]
            print(f"{ranks} x {threads} | {fmt:6s} | {min(tps):8.1f} / {statistics.median(tps):8.1f} | "
                  f"{statistics.median(tps) / base:5.2f} | {last['peak_mem']['sharded_params'] / 2**20:8.2f} | "
                  f"{last['comm_bytes'] / 2**20:8.2f} | {saves[fmt][-1][0] / 2**20:8.1f}, "
                  f"{min(seconds):.2f} / {statistics.median(seconds):.2f}", flush=True)


def distill_section(build, steps):
    """gpt2-124M (T = 64, micro_batch 4, global_batch 16) trained alone and distilled from a gpt-300M
    teacher, FULL_SHARD on 1 rank x 2 threads, 2 ranks x 1 thread and 4 ranks x 1 thread (oversubscribed:
    its memory is exact, its tokens/s say little). The teacher's weights come from one saved step of
    gpt-300M (random: speed and memory do not depend on them). Tokens/s are medians over the steps
    after the first, the ratio taken within the rank count; memory is each model's bytes on one rank
    by category, as the trainer allocated them (the student's from the metrics, the teacher's from
    its start line)."""
    from harness import ensure_data, mpirun_command
    train, _ = ensure_data()
    with tempfile.TemporaryDirectory() as tmp:
        args = [os.path.join(build, "shardtrain"), "train", "--config", os.path.join(ROOT, "inputs", "gpt-300M.ini"),
                "--train.seq_len=64", "--train.micro_batch=1", "--train.global_batch=1", "--train.steps=1",
                "--train.threads=2", f"--data.train_file={train}", "--data.val_file=", f"--checkpoint.dir={tmp}",
                "--checkpoint.format=gathered"]
        proc = subprocess.run(mpirun_command(1, args, timeout=1200), cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"teacher run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        teacher = os.path.join(tmp, "ckpt-00000001.h5")
        print(f"\n== distillation: gpt2-124M student, gpt-300M teacher, seq_len 64, micro_batch 4, global_batch 16, "
              f"{steps} steps, FULL_SHARD, alpha 0.5, T 2", flush=True)
        print("ranks | case | tokens/s median | / alone | student MiB per rank: " + " ".join(MEMORY_COLUMNS) +
              " total | teacher per rank", flush=True)
        for ranks, threads in ((1, 2), (2, 1), (4, 1)):
            alone = None
            for name, extra in (("student alone", ()), ("distilled", (f"--distill.teacher={teacher}",))):
                out = []
                rows, _, _ = train_run(build, ranks, threads, steps, extra=extra, stdout=out)
                tps = summarize([r["tokens_per_s"] for r in rows])[1]
                alone = alone or tps
                mib = [rows[-1]["peak_mem"][c] / 2**20 for c in MEMORY_COLUMNS]
                found = re.search(r"teacher memory per rank: (.*?) \| total (\S+ \S+)", out[0])
                teacher_mem = f"{found.group(1)} (total {found.group(2)})" if found else "-"
                print(f"{ranks} x {threads} | {name:13s} | {tps:8.1f} | {tps / alone:5.2f} | " +
                      " ".join(f"{m:7.1f}" for m in mib) + f" {sum(mib):8.1f} | {teacher_mem}", flush=True)


CONVERT_CONFIG = "llama-1.1B.ini"
CONVERT_BAR_MIB = 256  # the bar: every rank's peak RssAnon <= its parameter shard + this


def llama_model_of(ini):
    import configparser
    c = configparser.ConfigParser(inline_comment_prefixes=("#",))
    c.read(ini)
    m = c["model"]
    return {k: m[k] for k in m}


def write_random_llama_folder(folder, model, seed=1):
    """A random-weights LlamaForCausalLM folder of `model`'s shape ([model] of an INI): config.json and
    one F32 model.safetensors, N(0, 0.02) matrices and unit norms, written tensor by tensor in slices of
    at most 64 MiB. Returns the tensors' bytes."""
    import numpy as np
    L, C, H, KV = (int(model[k]) for k in ("n_layer", "n_embd", "n_head", "n_kv_head"))
    I, V, T = (int(model[k]) for k in ("intermediate_size", "vocab_size", "max_seq_len"))
    d = C // H
    # In ShardTrain's order and JSON spacing, so that a round trip can be compared byte for byte.
    shapes = {"model.embed_tokens.weight": (V, C), "model.norm.weight": (C,), "lm_head.weight": (V, C)}
    for l in range(L):
        p = f"model.layers.{l}."
        shapes.update({p + "input_layernorm.weight": (C,), p + "self_attn.q_proj.weight": (C, C),
                       p + "self_attn.k_proj.weight": (KV * d, C), p + "self_attn.v_proj.weight": (KV * d, C),
                       p + "self_attn.o_proj.weight": (C, C), p + "post_attention_layernorm.weight": (C,),
                       p + "mlp.gate_proj.weight": (I, C), p + "mlp.up_proj.weight": (I, C),
                       p + "mlp.down_proj.weight": (C, I)})
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        n = 4 * int(np.prod(shape))
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    with open(os.path.join(folder, "model.safetensors"), "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for name, shape in shapes.items():
            if len(shape) == 1:
                f.write(np.ones(shape, "<f4").tobytes())
                continue
            rows = max(1, (16 << 20) // shape[1])
            for r in range(0, shape[0], rows):
                block = rng.standard_normal((min(rows, shape[0] - r), shape[1]), dtype=np.float32) * np.float32(0.02)
                f.write(block.astype("<f4").tobytes())
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": C, "intermediate_size": I,
              "num_hidden_layers": L, "num_attention_heads": H, "num_key_value_heads": KV, "vocab_size": V,
              "max_position_embeddings": T, "rms_norm_eps": float(model["norm_eps"]),
              "rope_theta": float(model["rope_theta"]), "tie_word_embeddings": False, "torch_dtype": "float32"}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return offset


def llama_shard_bytes(model, ranks):
    """One rank's parameter shard (FULL_SHARD over `ranks`): each unit padded to a multiple of ranks."""
    L, C, H, KV = (int(model[k]) for k in ("n_layer", "n_embd", "n_head", "n_kv_head"))
    I, V = int(model["intermediate_size"]), int(model["vocab_size"])
    root = 2 * V * C + C  # embed_tokens, lm_head (untied), norm
    block = 2 * C * C + 2 * KV * (C // H) * C + 3 * C * I + 2 * C
    return 4 * (-(-root // ranks) + L * -(-block // ranks))


def drop_page_cache(path):
    """Drops the cached pages of a file, or of every file under a folder (the next read is cold)."""
    paths = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs] if os.path.isdir(path) else [path]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_speed(folder, size=1 << 30):
    """(write MB/s, cold read MB/s) of a plain file of `size` random bytes in `folder`: 16 MiB writes +
    fsync, then the cache dropped and 16 MiB reads."""
    chunk = os.urandom(16 << 20)
    path = os.path.join(folder, "disk-speed.bin")
    t0 = time.monotonic()
    with open(path, "wb", buffering=0) as f:
        for _ in range(size // len(chunk)):
            f.write(chunk)
        os.fsync(f.fileno())
    write = size / 1e6 / (time.monotonic() - t0)
    drop_page_cache(path)
    t0 = time.monotonic()
    with open(path, "rb", buffering=0) as f:
        while f.read(16 << 20):
            pass
    read = size / 1e6 / (time.monotonic() - t0)
    os.remove(path)
    return write, read


def child_pids(pid):
    try:
        return [int(c) for t in os.listdir(f"/proc/{pid}/task")
                for c in open(f"/proc/{pid}/task/{t}/children").read().split()]
    except OSError:
        return []


def rank_pids(root_pid):
    """The shardtrain processes below root_pid (timeout -> mpirun -> ranks), by the kernel's child lists:
    other jobs' ranks are not among them."""
    pids, frontier = [], [root_pid]
    for _ in range(3):
        frontier = [c for p in frontier for c in child_pids(p)]
        for c in frontier:
            try:
                if open(f"/proc/{c}/comm").read().strip() == "shardtrain":
                    pids.append(c)
            except OSError:
                pass
    return pids


def run_sampling_rss_anon(cmd, expected, timeout):
    """Runs cmd (mpirun of `expected` ranks); returns (wall seconds, stdout, peak RssAnon in bytes of each rank
    process), RssAnon sampled every 20 ms from /proc/<pid>/status. Exits on failure."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peaks, ranks = {}, []
    while True:
        try:
            out, err = proc.communicate(timeout=0.02)
            break
        except subprocess.TimeoutExpired:
            if len(ranks) < expected:
                ranks = rank_pids(proc.pid)
            for pid in ranks:
                try:
                    for line in open(f"/proc/{pid}/status"):
                        if line.startswith("RssAnon:"):
                            peaks[pid] = max(peaks.get(pid, 0), int(line.split()[1]) * 1024)
                except OSError:
                    pass
            if time.monotonic() - t0 > timeout:
                proc.kill()
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{out[-3000:]}\n{err[-3000:]}")
    return wall, out, list(peaks.values())


def same_bytes(a, b):
    import filecmp
    return filecmp.cmp(a, b, shallow=False)


def convert_section(build, rank_counts, repeats, with_export):
    from harness import mpirun_command
    exe = os.path.join(build, "shardtrain")
    model = llama_model_of(os.path.join(ROOT, "inputs", CONVERT_CONFIG))
    tmp = tempfile.mkdtemp(prefix="convert-bench-", dir=build)
    try:
        folder = os.path.join(tmp, "hf")
        model_bytes = write_random_llama_folder(folder, model)
        print(f"\n== convert: {CONVERT_CONFIG}'s shape, random F32 weights ({model_bytes / 1e9:.2f} GB of tensors), "
              f"{repeats} repeats per row, folder {tmp}", flush=True)
        print(f"filesystem: {filesystem_of(tmp)}", flush=True)
        columns = [("ranks", ">5"), ("step", "<22"), ("wall s min/med", ">14"), ("MB/s med", ">8"),
                   ("disk wr MB/s", ">12"), ("disk rd MB/s", ">12"), ("/ disk wr min/med", ">17"),
                   ("RssAnon MiB max", ">15"), ("shard MiB", ">9"), ("bar", ">4")]
        print(" | ".join(f"{name:{fmt}}" for name, fmt in columns), flush=True)
        ckpt, back, exported = (os.path.join(tmp, n) for n in ("model.h5", "back", "exported"))
        steps = [("HF -> ckpt (convert)", folder, ["convert", "--input", folder, "--output", ckpt]),
                 ("ckpt -> HF (convert)", ckpt, ["convert", "--input", ckpt, "--output", back])]
        if with_export:
            steps.append(("ckpt -> HF (export)", ckpt, ["export", "--format", "hf", "--checkpoint", ckpt,
                                                        "--output", exported]))
        for ranks in rank_counts:
            shard_mib = llama_shard_bytes(model, ranks) / 2**20
            results = {name: [] for name, _, _ in steps}
            for _ in range(repeats):
                write, read = disk_speed(tmp)
                for name, source, args in steps:
                    drop_page_cache(source)
                    wall, _, peaks = run_sampling_rss_anon(mpirun_command(ranks, [exe, *args], timeout=1800), ranks,
                                                          1800)
                    results[name].append((wall, write, read, max(peaks) / 2**20 if peaks else float("nan")))
                if not same_bytes(os.path.join(back, "model.safetensors"), os.path.join(folder, "model.safetensors")):
                    sys.exit("convert's round trip changed model.safetensors")
                for path in (ckpt, back, exported):
                    if os.path.isdir(path):
                        shutil.rmtree(path)
                    elif os.path.exists(path):
                        os.remove(path)
            for name, rows in results.items():
                med = statistics.median
                walls = [r[0] for r in rows]
                ratios = [model_bytes / 1e6 / r[0] / r[1] for r in rows]
                peak = max(r[3] for r in rows)
                cells = [ranks, name, f"{min(walls):.1f}/{med(walls):.1f}", f"{model_bytes / 1e6 / med(walls):.0f}",
                         f"{med(r[1] for r in rows):.0f}", f"{med(r[2] for r in rows):.0f}",
                         f"{min(ratios):.2f}/{med(ratios):.2f}", f"{peak:.0f}", f"{shard_mib:.0f}",
                         "ok" if peak <= shard_mib + CONVERT_BAR_MIB else "OVER"]
                print(" | ".join(f"{str(c):{fmt}}" for c, (_, fmt) in zip(cells, columns)), flush=True)
        print(f"bar: each rank's peak RssAnon <= its parameter shard + {CONVERT_BAR_MIB} MiB; the round trip's "
              "model.safetensors equal to the input byte for byte (checked)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
