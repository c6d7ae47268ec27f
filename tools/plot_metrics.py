#!/usr/bin/python3
"""Plots one or several ShardTrain metrics files (train.metrics_file, JSON Lines) as PNGs.

    /usr/bin/python3 tools/plot_metrics.py checkpoints/tiny/metrics.jsonl other.jsonl --out plots

writes into --out: loss.png (train loss, val loss dashed with markers), throughput.png (tokens/s,
MFU), memory.png (peak bytes per category and the total) and optimizer.png (learning rate,
gradient norm), one curve per file, and for flow-matching runs (FLUX) loss_by_sigma.png: the
training loss by noise level, averaged over the first, middle and last third of the steps, labelled with the run name: the folder of a default
`<run_name>/metrics.jsonl`, else the file name; --label overrides. Needs Debian's
python3-matplotlib (`make deps` installs it). Exit code 2 on an unreadable or malformed file.
"""
import argparse
import json
import math
import os
import sys


def fail(message):
    print(f"plot_metrics: error: {message}", file=sys.stderr)
    sys.exit(2)


def load(path):
    """(step records, eval records) of a metrics file, each sorted by step."""
    steps, evals = [], []
    try:
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    kind, record["step"] = record["kind"], int(record["step"])
                except (ValueError, KeyError, TypeError) as e:
                    fail(f"{path}:{number}: not a metrics record ({e}): {line.strip()[:80]}")
                {"step": steps, "eval": evals}.get(kind, []).append(record)
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror}")
    if not steps and not evals:
        fail(f"{path}: no step or eval records (is it a train.metrics_file?)")
    return sorted(steps, key=lambda r: r["step"]), sorted(evals, key=lambda r: r["step"])


def default_labels(paths):
    """Run names: the folder of a default <run_name>/metrics.jsonl, else the file name without
    .jsonl; the paths themselves where those collide."""
    labels = []
    for p in paths:
        name = os.path.basename(p)
        folder = os.path.basename(os.path.dirname(os.path.abspath(p)))
        labels.append(folder if name == "metrics.jsonl" else name.removesuffix(".jsonl"))
    return labels if len(set(labels)) == len(labels) else list(paths)


def series(records, key, scale=1.0):
    """(steps, values) with null (a non-finite value) as NaN, which leaves a gap in the curve."""
    values = []
    for r in records:
        v = r.get(key)
        values.append(v * scale if isinstance(v, (int, float)) else math.nan)
    return [r["step"] for r in records], values


def sigma_phases(records):
    """A flow-matching run's loss by noise-level bucket over the first, middle and last third of its
    steps: [(name, bucket centres, mean losses)], each bucket's mean over the phase weighted by its
    samples (steps' loss_by_sigma and sigma_samples); NaN where no sample fell. [] for other runs."""
    records = [r for r in records if isinstance(r.get("loss_by_sigma"), list) and isinstance(r.get("sigma_samples"), list)]
    if not records:
        return []
    K = len(records[0]["loss_by_sigma"])
    centres = [(k + 0.5) / K for k in range(K)]
    phases, n = [], len(records)
    for name, part in (("first third", records[:max(1, n // 3)]), ("middle third", records[n // 3:max(n // 3 + 1, 2 * n // 3)]),
                       ("last third", records[2 * n // 3:])):
        sums, counts = [0.0] * K, [0] * K
        for r in part:
            for k, (loss, samples) in enumerate(zip(r["loss_by_sigma"], r["sigma_samples"])):
                if isinstance(loss, (int, float)) and samples:
                    sums[k] += loss * samples
                    counts[k] += samples
        phases.append((name, centres, [s / c if c else math.nan for s, c in zip(sums, counts)]))
    return phases


def memory_series(records, category):
    return [r["step"] for r in records], [r.get("peak_mem", {}).get(category, math.nan) / 2**20 for r in records]


def save(fig, out, name):
    path = os.path.join(out, name)
    fig.savefig(path, dpi=100)
    print(path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", metavar="METRICS", help="metrics files (JSON Lines)")
    parser.add_argument("--out", default="plots", help="folder for the PNGs (created; default: plots)")
    parser.add_argument("--label", action="append", default=None,
                        help="label of the matching file, once per file (default: run names)")
    args = parser.parse_args()
    if args.label is not None and len(args.label) != len(args.files):
        fail(f"{len(args.label)} --label for {len(args.files)} files: give one per file or none")
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        fail("matplotlib is missing: apt-get install python3-matplotlib, and run this with /usr/bin/python3")
    runs = [(label, *load(path)) for label, path in zip(args.label or default_labels(args.files), args.files)]
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        fail(f"cannot create --out {args.out}: {e.strerror}")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    def figure(panels, title, fill):
        """A figure of len(panels) axes (titles, y labels); fill(ax, i, label, steps, evals, color) draws."""
        cols = min(3, len(panels))
        rows = (len(panels) + cols - 1) // cols
        fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
        for i, ax in enumerate(axes.flat):
            if i >= len(panels):
                ax.set_visible(False)
                continue
            for n, (label, steps, evals) in enumerate(runs):
                fill(ax, i, label, steps, evals, colors[n % len(colors)])
            ax.set_title(panels[i][0])
            ax.set_ylabel(panels[i][1])
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        axes.flat[0].legend(fontsize="small")
        fig.suptitle(title)
        fig.tight_layout()
        return fig

    def loss(ax, i, label, steps, evals, color):
        ax.plot(*series(steps, "loss"), color=color, label=f"{label} train")
        if evals:
            ax.plot(*series(evals, "val_loss"), "o--", color=color, label=f"{label} val")

    def throughput(ax, i, label, steps, evals, color):
        ax.plot(*(series(steps, "tokens_per_s") if i == 0 else series(steps, "mfu", 100)), color=color, label=label)

    def optimizer(ax, i, label, steps, evals, color):
        ax.plot(*series(steps, ("lr", "grad_norm")[i]), color=color, label=label)

    categories = []
    for _, steps, _ in runs:
        for r in steps:
            categories += [c for c in r.get("peak_mem", {}) if c not in categories]

    def memory(ax, i, label, steps, evals, color):
        # Runs often use the same memory: a line style per run keeps overlapping curves visible.
        style = ("-", "--", ":", "-.")[[r[0] for r in runs].index(label) % 4]
        xy = series(steps, "peak_mem_bytes", 2.0**-20) if i == 0 else memory_series(steps, categories[i - 1])
        ax.plot(*xy, style, color=color, label=label)

    save(figure([("loss", "cross-entropy (nats)")], "Loss", loss), args.out, "loss.png")
    save(figure([("throughput", "tokens/s"), ("MFU", "% of peak")], "Throughput", throughput), args.out,
         "throughput.png")
    save(figure([("peak total", "MiB")] + [(c, "MiB") for c in categories],
                "Peak memory per rank by category (max over ranks)", memory), args.out, "memory.png")
    save(figure([("learning rate", "lr"), ("gradient norm", "L2 norm")], "Optimizer", optimizer), args.out,
         "optimizer.png")
    if any(sigma_phases(steps) for _, steps, _ in runs):
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for n, (label, steps, _) in enumerate(runs):
            for (phase, centres, losses), style in zip(sigma_phases(steps), ("o:", "o--", "o-")):
                ax.plot(centres, losses, style, color=colors[n % len(colors)], label=f"{label}, {phase}")
        ax.set_xlabel("noise level sigma (bucket centre)")
        ax.set_ylabel("flow-matching loss (MSE)")
        ax.set_xlim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        fig.suptitle("Training loss by noise level")
        fig.tight_layout()
        save(fig, args.out, "loss_by_sigma.png")


if __name__ == "__main__":
    main()
